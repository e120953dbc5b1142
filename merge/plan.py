"""`diag plan`: from a store to a merge plan (granularity, α per submodule, the rest).

Choosing the granularity (``auto``): candidates from finest to coarsest are
attn-mlp, layer, model (head-mlp only when asked: seed 002 Table 3 finds head
level unstable). The finest candidate whose levels all have a mean
Non-linearity Score ≤ `nl_max` and a mean Projection Distance ≤ `pd_max` is
chosen; model level is the fallback. Defaults: ``nl_max = 0.5`` (seed 002
Table 17 on Llama-2-7B: attn 0.023, layer 0.16, MLP 0.20 versus model 2.76,
so 0.5 separates "nearly linear" submodules from the non-linear whole) and
``pd_max = 0.2`` (Projection Distance of a linear module is 0; 0.2 tolerates a
20 % deviation of the merged update from the linear combination along Δ_lin).
Both are overridable.

The plan's α per submodule come from the store's ``alpha/<granularity>`` group
(`diag alpha`). Parameters outside every chosen module (embeddings, final norm,
lm_head, and at attn-mlp level the blocks' norms) get `rest`: by default the
mean of the task vectors (θ0 + Σ_t τ_t / T).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import yaml

from diagnostics.errors import SubmergeError
from diagnostics.modules import GRANULARITIES
from diagnostics.store import Store, provenance
from diagnostics.tensors import TensorInfo
from merge.rules import ParameterRule, head_rule, mean_rule, weights_rule

DEFAULT_NL_MAX = 0.5
DEFAULT_PD_MAX = 0.2
AUTO_ORDER = ("attn-mlp", "layer", "model")
LEVELS_OF = GRANULARITIES


class PlanError(SubmergeError):
    pass


@dataclass
class Plan:
    base_model: str
    finetuned: dict[str, str]
    granularity: str
    alpha: dict[str, dict[str, float]]
    rest: dict = field(default_factory=lambda: {"method": "mean-task-vector"})
    attention: dict = field(default_factory=dict)  # num_heads, num_kv_heads, head_dim (head-mlp)
    decision: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({"submerge_plan": 1, **asdict(self)}, sort_keys=False, allow_unicode=True))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if not path.exists():
            raise PlanError(f"plan file {path} not found")
        content = yaml.safe_load(path.read_text()) or {}
        if content.pop("submerge_plan", None) != 1:
            raise PlanError(f"{path} is not a submerge plan (no 'submerge_plan: 1')")
        try:
            plan = cls(**content)
        except TypeError as exc:
            raise PlanError(f"{path}: {exc}") from exc
        plan.base_model = _local_against(path.parent, plan.base_model)
        plan.finetuned = {t: _local_against(path.parent, spec) for t, spec in plan.finetuned.items()}
        return plan

    # -------------------------------------------------------------- per-tensor rules

    def rule_for(self, info: TensorInfo) -> ParameterRule:
        """The merge rule of one checkpoint tensor under this plan (its unit from the tensor table)."""
        tasks = list(self.finetuned)
        unit = info.unit(self.granularity)
        if unit is not None and self.granularity == "head-mlp" and info.level == "attn":
            return self._head_rule(info, tasks)
        if unit is not None and unit in self.alpha:
            return weights_rule(self.alpha[unit])
        return self._rest_rule(tasks)

    def _rest_rule(self, tasks: list[str]) -> ParameterRule:
        method = self.rest.get("method", "mean-task-vector")
        if method == "mean-task-vector":
            return mean_rule(tasks)
        if method == "weights":
            return weights_rule(self.rest["weights"])
        return ParameterRule(method=method, options=self.rest.get("options") or {})

    def _head_rule(self, info: TensorInfo, tasks: list[str]) -> ParameterRule:
        heads, kv_heads, dim = (self.attention.get(k) for k in ("num_heads", "num_kv_heads", "head_dim"))
        if not heads:
            raise PlanError("a head-mlp plan needs attention.num_heads / num_kv_heads / head_dim")
        alphas = np.array([[self.alpha[f"layers.{info.layer}.attn.head.{h}"][t] for t in tasks] for h in range(heads)])
        try:
            return head_rule(info, tasks, alphas, kv_heads, dim)
        except ValueError as exc:
            raise PlanError(str(exc)) from exc

    # -------------------------------------------------------------- mergekit

    def to_mergekit(self, num_layers: int) -> tuple[dict, list[str]]:
        """The equivalent mergekit `task_arithmetic` config and what it cannot express."""
        tasks = list(self.finetuned)
        notes: list[str] = []
        rest = self._rest_rule(tasks)
        if rest.weights is None:
            notes.append(f"the rest rule '{self.rest.get('method')}' is a method, not weights: exported as 1/T")
            rest_weights = {t: 1.0 / len(tasks) for t in tasks}
        else:
            rest_weights = rest.weights
        if self.granularity == "head-mlp":
            notes.append("mergekit has no per-head weights: attention exported with the mean α of each layer's heads")
        models = []
        for task in tasks:
            if self.granularity == "model":
                weight = float(self.alpha["model"][task])
            else:
                weight = []
                if self.granularity == "layer":
                    weight.append({"filter": "layers.", "value": [float(self.alpha[f"layers.{j}"][task])
                                                                  for j in range(num_layers)]})
                else:
                    attn = []
                    for j in range(num_layers):
                        if self.granularity == "attn-mlp":
                            attn.append(float(self.alpha[f"layers.{j}.attn"][task]))
                        else:
                            keys = [k for k in self.alpha if k.startswith(f"layers.{j}.attn.head.")]
                            attn.append(float(np.mean([self.alpha[k][task] for k in keys])))
                    weight.append({"filter": "self_attn", "value": attn})
                    weight.append(
                        {
                            "filter": "mlp",
                            "value": [float(self.alpha[f"layers.{j}.mlp"][task]) for j in range(num_layers)],
                        }
                    )
                weight.append({"value": float(rest_weights[task])})
            model = _mergekit_model(self.base_model, self.finetuned[task])
            models.append({"model": model, "parameters": {"weight": weight}})
        config = {
            "merge_method": "task_arithmetic",
            "base_model": self.base_model,
            "models": models,
            "parameters": {"normalize": False},
            "dtype": "float32",
        }
        return config, [n for n in notes if n]


def _absolute(spec: str) -> str:
    """A model spec that names an existing local path, made absolute (a hub id stays as it is)."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def _local_against(directory: Path, spec: str) -> str:
    """A relative spec that exists next to the plan file, resolved there (plans written by hand or before
    `make_plan` stored absolute paths); anything else unchanged."""
    candidate = directory / Path(spec).expanduser()
    return str(candidate.resolve()) if not Path(spec).expanduser().is_absolute() and candidate.exists() else spec


def _mergekit_model(base_model: str, spec: str) -> str:
    """mergekit names a LoRA fine-tune as BASE+ADAPTER."""
    return f"{base_model}+{spec}" if (Path(spec) / "adapter_config.json").exists() else spec


def _level_stats(store: Store) -> dict[str, dict[str, float]]:
    stats: dict[str, dict[str, float]] = {}
    if store.has("linearity"):
        linearity = store.dataset("linearity")
        for level in set(linearity.level.values.tolist()):
            values = linearity.nonlinearity_score.where(linearity.level == level, drop=True).values
            stats.setdefault(str(level), {})["nonlinearity_score"] = float(np.nanmean(values))
    if store.has("projection"):
        projection = store.dataset("projection")
        for level in set(projection.level.values.tolist()):
            values = projection.projection_distance.where(projection.level == level, drop=True).values
            stats.setdefault(str(level), {})["projection_distance"] = float(np.nanmean(values))
    return stats


def choose_granularity(
    stats: dict, *, nl_max: float = DEFAULT_NL_MAX, pd_max: float = DEFAULT_PD_MAX, available: set[str] | None = None
) -> tuple[str, list[str]]:
    """The finest granularity whose levels stay under the thresholds; returns it and the reasons."""
    reasons = []
    for granularity in AUTO_ORDER:
        if available is not None and granularity not in available:
            reasons.append(
                f"{granularity}: no alpha/{granularity} in the store (run diag alpha --granularity {granularity})"
            )
            continue
        failing = []
        for level in LEVELS_OF[granularity]:
            level_stats = stats.get(level, {})
            nl = level_stats.get("nonlinearity_score")
            pd = level_stats.get("projection_distance")
            if nl is None:
                failing.append(f"no Non-linearity Score for level {level}")
            elif not nl <= nl_max:
                failing.append(f"{level} NL {nl:.3g} > {nl_max}")
            if pd is not None and not pd <= pd_max:
                failing.append(f"{level} PD {pd:.3g} > {pd_max}")
        if not failing or granularity == "model":
            reasons.append(f"{granularity}: chosen" + (f" (fallback: {'; '.join(failing)})" if failing else ""))
            return granularity, reasons
        reasons.append(f"{granularity}: rejected ({'; '.join(failing)})")
    raise PlanError(
        "no granularity available (" + "; ".join(reasons) + "): run diag alpha at a coarser granularity, "
        "raise --nl-max / --pd-max, or pass --granularity"
    )


def make_plan(
    store_path: str | Path,
    *,
    granularity: str = "auto",
    nl_max: float = DEFAULT_NL_MAX,
    pd_max: float = DEFAULT_PD_MAX,
    rest: dict | None = None,
    command: str | None = None,
) -> Plan:
    """Build a plan from a store (see module docstring)."""
    store = Store(store_path)
    if not store.exists():
        raise PlanError(f"no store at {store_path}")
    available = {g for g in LEVELS_OF if store.has(f"alpha/{g}")}
    stats = _level_stats(store)
    if granularity == "auto":
        chosen, reasons = choose_granularity(stats, nl_max=nl_max, pd_max=pd_max, available=available - {"head-mlp"})
    elif granularity in LEVELS_OF:
        if granularity not in available:
            raise PlanError(
                f"store {store_path} has no alpha/{granularity}: run "
                f"`diag alpha --granularity {granularity} --out {store_path}` first"
            )
        chosen, reasons = granularity, [f"{granularity}: asked for"]
    else:
        raise PlanError(f"unknown granularity '{granularity}' (auto, {', '.join(LEVELS_OF)})")
    alpha = store.dataset(f"alpha/{chosen}")
    if not alpha.attrs.get("complete", True):
        raise PlanError(f"alpha/{chosen} in {store_path} is incomplete; re-run diag alpha to finish it")
    origin = alpha.attrs.get("provenance", {})
    tasks = [str(t) for t in alpha.task.values]
    finetuned = {t: (origin.get("finetuned", {}).get(t, {}) or {}).get("spec", t) for t in tasks}
    base_model = (store.attrs.get("base_model") or {}).get("spec") or origin.get("base_model", {}).get("spec")
    plan = plan_from_alpha(alpha, _absolute(base_model), {t: _absolute(s) for t, s in finetuned.items()}, rest=rest)
    plan.decision.update({"nl_max": nl_max, "pd_max": pd_max, "level_stats": stats, "reasons": reasons})
    plan.provenance = provenance(command, store=str(store_path), store_settings=alpha.attrs.get("settings"))
    return plan


def plan_from_alpha(alpha, base_model: str, finetuned: dict[str, str], *, rest: dict | None = None) -> Plan:
    """A plan from an `alpha/<granularity>` dataset (from the store, or solved on the fly)."""
    granularity = str(alpha.granularity.values[0])
    tasks = [str(t) for t in alpha.task.values]
    values = {
        str(m): {t: float(alpha.alpha.sel(module=m, task=t).isel(granularity=0)) for t in tasks}
        for m in alpha.module.values
    }
    attention = {}
    if granularity == "head-mlp":
        config = _base_config(base_model)
        heads = config.get("num_attention_heads") or config.get("n_head")
        attention = {
            "num_heads": heads,
            "num_kv_heads": config.get("num_key_value_heads", heads),
            "head_dim": config.get("head_dim") or (config.get("hidden_size") or config.get("n_embd")) // heads,
        }
    return Plan(
        base_model=base_model,
        finetuned={t: finetuned[t] for t in tasks},
        granularity=granularity,
        alpha=values,
        rest=rest or {"method": "mean-task-vector"},
        attention=attention,
        decision={
            "condition_numbers_max": float(np.nanmax(alpha.condition_number.values)),
            "least_squares_modules": [str(m) for m, f in zip(alpha.module.values, alpha.least_squares.values[0]) if f],
        },
    )


def _base_config(spec: str) -> dict:
    from diagnostics.models import local_path

    path = local_path(spec)
    config = path / "config.json" if path.is_dir() else path.parent / "config.json"
    return json.loads(config.read_text()) if config.exists() else {}

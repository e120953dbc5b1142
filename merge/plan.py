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

import dataclasses
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from submerge.diagnostics.checkpoints import local_path
from submerge.diagnostics.errors import SubmergeError
from submerge.diagnostics.execution import RunSettings
from submerge.diagnostics.linearity.evidence import (
    CHOOSABLE,
    DEFAULT_FOLDS,
    EVIDENCE_CANDIDATES,
    part_of,
    unit_names,
)
from submerge.diagnostics.linearity.evidence import block_objectives as measured_block_objectives
from submerge.diagnostics.linearity.evidence import evidence as measure_evidence
from submerge.diagnostics.modules import GRANULARITIES
from submerge.diagnostics.outputs import check_output_file, file_starts_with, replace_file
from submerge.diagnostics.provenance import provenance
from submerge.diagnostics.safe_yaml import load_yaml
from submerge.diagnostics.store import Store
from submerge.diagnostics.tensors import TensorInfo, TensorTable
from submerge.merge.plan_schema import PER_LAYER, unit_problems, validate_plan
from submerge.merge.rules import ParameterRule, head_rule, mean_rule, weights_rule
from submerge.merge.strategies import STRATEGIES
from submerge.merge.tensor_merge import method_delta

DEFAULT_NL_MAX = 0.5
DEFAULT_PD_MAX = 0.2
AUTO_ORDER = ("attn-mlp", "layer", "model")
# PER_LAYER ("per-layer"): Plan.granularity of a plan whose blocks each have their own (evidence choice)
LEVELS_OF = GRANULARITIES


#: Whether a file is a plan submerge wrote (its first line); only such a file is replaced by a plan (with --force).
is_plan_file = file_starts_with("submerge_plan: 1\n")
#: The first line of an exported mergekit config: marks it as an earlier export (replaced only with --force).
MERGEKIT_HEADER = "# mergekit config exported by submerge (diag plan --export-mergekit)\n"


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
    # granularity "per-layer": each block's own granularity (layer index → layer / attn-mlp / head-mlp)
    layer_granularity: dict = field(default_factory=dict)
    # matrices merged by a method instead of α (interference steering): checkpoint name → {method, options, reason}
    matrix_rules: dict = field(default_factory=dict)
    # "mean": units of the granularity without α get the mean task vector (else every unit must have α)
    fallback: str | None = None

    def save(self, path: str | Path, *, force: bool = False, option: str = "--out") -> Path:
        """Write the plan (YAML, first line ``submerge_plan: 1``) atomically. An existing file is replaced only
        with `force` and only when it is a submerge plan (`submerge.diagnostics.outputs`)."""
        check_output_file(path, force, option=option, ours=is_plan_file, what="a submerge plan")
        return replace_file(path, yaml.safe_dump({"submerge_plan": 1, **asdict(self)}, sort_keys=False,
                                                 allow_unicode=True))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan file safely (`submerge.diagnostics.safe_yaml`) and check it against the plan schema
        (`submerge.merge.plan_schema`) before anything runs."""
        path = Path(path)
        if not path.exists():
            raise PlanError(f"plan file {path} not found")
        document = load_yaml(path, what="plan file")
        if not isinstance(document.data, dict) or document.data.get("submerge_plan") != 1:
            raise PlanError(f"{path} is not a submerge plan (no 'submerge_plan: 1')")
        plan = cls(**validate_plan(document))
        plan.base_model = _local_against(path.parent, plan.base_model)
        plan.finetuned = {t: _local_against(path.parent, spec) for t, spec in plan.finetuned.items()}
        return plan

    # -------------------------------------------------------------- per-tensor rules

    def rule_for(self, info: TensorInfo) -> ParameterRule:
        """The merge rule of one checkpoint tensor under this plan (its unit from the tensor table)."""
        tasks = list(self.finetuned)
        steered = self.matrix_rules.get(info.name)
        if steered is not None:
            return ParameterRule(method=steered["method"], options=dict(steered.get("options") or {}))
        granularity = self.granularity_of(info.layer)
        if granularity is None:
            return self._rest_rule(tasks)
        unit = info.unit(granularity)
        if unit is not None and granularity == "head-mlp" and info.level == "attn":
            return self._head_rule(info, tasks)
        if unit is not None and unit in self.alpha:
            return weights_rule(self.alpha[unit])
        if unit is not None and self.fallback == "mean":
            return mean_rule(tasks)
        return self._rest_rule(tasks)

    def check_units(self, table: TensorTable) -> None:
        """Refuse a plan whose α units are not those of the model (`table`): a unit without α (unless
        ``fallback: mean``) or α for a unit the model does not have."""
        expected, blocks = set(), {info.layer for info in table if info.layer >= 0}
        heads = self.attention.get("num_heads") or 0
        for info in table:
            granularity = self.granularity_of(info.layer)
            unit = info.unit(granularity) if granularity is not None else None
            if unit is not None and granularity == "head-mlp" and info.level == "attn":
                expected.update(f"{unit}.head.{head}" for head in range(heads))
            elif unit is not None:
                expected.add(unit)
        problems = unit_problems(self.alpha, expected, self.granularity, len(blocks), self.fallback)
        if problems:
            raise PlanError(f"the plan does not fit the base model {self.base_model}: {'; '.join(problems)}")

    def granularity_of(self, layer: int) -> str | None:
        """The granularity that merges block `layer` (None: outside the blocks of a per-layer plan)."""
        if self.granularity != PER_LAYER:
            return self.granularity
        chosen = self.layer_granularity.get(layer, self.layer_granularity.get(str(layer)))
        if chosen is None and layer >= 0:
            raise PlanError(f"per-layer plan has no granularity for layer {layer} (layer_granularity)")
        return chosen

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

    def _part_alpha(self, layer: int, part: str, task: str) -> float:
        """α of block `layer`'s attention or MLP for `task` (mean over heads at head level)."""
        granularity = self.granularity_of(layer)
        if granularity == "layer":
            return float(self.alpha[f"layers.{layer}"][task])
        if part == "attn" and granularity == "head-mlp":
            keys = [k for k in self.alpha if k.startswith(f"layers.{layer}.attn.head.")]
            return float(np.mean([self.alpha[k][task] for k in keys]))
        return float(self.alpha[f"layers.{layer}.{part}"][task])

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
        granularities = {self.granularity_of(j) for j in range(num_layers)}
        if "head-mlp" in granularities:
            notes.append("mergekit has no per-head weights: attention exported with the mean α of each layer's heads")
        if self.granularity == PER_LAYER and "layer" in granularities:
            notes.append("per-layer plan: the norms of blocks merged at layer granularity get the rest weight, "
                         "not the block's α")
        if self.matrix_rules:
            methods = ", ".join(sorted({rule["method"] for rule in self.matrix_rules.values()}))
            notes.append(f"{len(self.matrix_rules)} interference-steered matrices ({methods}) exported with their "
                         "unit's α")
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
                    for part, name in (("attn", "self_attn"), ("mlp", "mlp")):
                        weight.append({"filter": name,
                                       "value": [self._part_alpha(j, part, task) for j in range(num_layers)]})
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
            scores = linearity.nonlinearity_score.where(linearity.level == level, drop=True)
            _warn_unscored(linearity, scores, str(level))
            values = scores.values
            stats.setdefault(str(level), {})["nonlinearity_score"] = float(np.nanmean(values))
    if store.has("projection"):
        projection = store.dataset("projection")
        for level in set(projection.level.values.tolist()):
            values = projection.projection_distance.where(projection.level == level, drop=True).values
            stats.setdefault(str(level), {})["projection_distance"] = float(np.nanmean(values))
    return stats


def _warn_unscored(linearity, scores, level: str) -> None:
    """Warn about each task without one finite Non-linearity Score at `level` (its mean leaves it out)."""
    for task in scores.task.values:
        if np.isfinite(scores.sel(task=task).values).any():
            continue
        unchanged = "unchanged" in linearity and bool(
            linearity.unchanged.sel(task=task).where(linearity.level == level, drop=True).all())
        reason = ("its update leaves these modules' outputs unchanged (zero update)" if unchanged
                  else "every score is NaN")
        warnings.warn(f"linearity, level {level}: task {task} has no finite Non-linearity Score ({reason}); the "
                      "level's mean is over the other tasks only", UserWarning, stacklevel=3)


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
    for group in ("linearity", "projection"):  # the thresholds' figures must be of the models α was fitted on
        changes = store.model_changes(group, origin) if store.has(group) else []
        if changes:
            raise PlanError(f"store {store_path}: group '{group}' was measured on other models than alpha/{chosen}: "
                            f"{'; '.join(changes)}. Measure both on the same models (another --out)")
    tasks = [str(t) for t in alpha.task.values]
    finetuned = {t: (origin.get("finetuned", {}).get(t, {}) or {}).get("spec", t) for t in tasks}
    base_model = (store.attrs.get("base_model") or {}).get("spec") or origin.get("base_model", {}).get("spec")
    plan = plan_from_alpha(alpha, _absolute(base_model), {t: _absolute(s) for t, s in finetuned.items()}, rest=rest)
    plan.decision.update({"nl_max": nl_max, "pd_max": pd_max, "level_stats": stats, "reasons": reasons})
    plan.provenance = provenance(command, store=str(store_path), store_settings=alpha.attrs.get("settings"),
                                 models={"base_model": origin.get("base_model"), "finetuned": origin.get("finetuned")})
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
    path = local_path(spec)
    config = path / "config.json" if path.is_dir() else path.parent / "config.json"
    return json.loads(config.read_text()) if config.exists() else {}


# ====================================================================== a plan chosen by evidence
#
# The evidence plan picks the granularity of every block by cross-validation instead of thresholds. The evidence
# itself — per block and candidate granularity, the held-out Eq. 10 objective of the block merged as this plan
# would merge it, fold by fold, and α per unit — is measured by the driver
# `submerge.diagnostics.linearity.evidence.evidence` on the shared sweep and kept in the store group `evidence`
# (see that module). This section turns it into a plan:
#   - `CandidateMerge`: how a block merges at a candidate with given α (`Plan.rule_for`, so norms, GQA groups and
#     interference-steered matrices are treated exactly as `diag merge` will); the driver calls it per block;
#   - `choose_by_evidence`: reads the evidence dataset; each block's score per candidate is the mean over folds,
#     and the block takes the coarsest candidate within `tolerance` standard errors of the best (`one_se_choice`);
#     the final α of the chosen units are those solved on all fit records;
#   - `evidence_plan`: both, from an experiment.
#
# Interference steering: a weight matrix whose task subspaces collide in the store's `interference`
# group (STI/Σσ above `sti_max`, or the mean SAR over tasks below `sar_min`) is merged with
# `steer_method` (TSV-M by default; Iso-C on request) at scaling = the mean α of the unit that holds
# it, instead of θ0 + Σ α_t τ_t. Defaults: `DEFAULT_STI_MAX` and `DEFAULT_SAR_MIN` below.

# STI/Σσ (TSV-M's Singular Task Interference divided by the kept singular values) is 0 for orthogonal
# task subspaces; on the demo kit it averages 2.44 over attention matrices and 1.36 over MLP matrices
# (README). 3.0 marks only the matrices where the collision is well above the typical attention level.
DEFAULT_STI_MAX = 3.0
# SAR (Iso-C) is 1 when every task matrix lies inside the top subspace of the task-arithmetic sum;
# below 0.5 a task keeps less than half its energy there (its subspace is crowded out).
DEFAULT_SAR_MIN = 0.5
STEER_METHODS = ("tsv-m", "iso-c")
#: The steering method unless --steer says otherwise.
DEFAULT_STEER_METHOD = "tsv-m"
#: Strategies that need data and that a block can still be merged by: RegMean, whose only data are the input Grams of
#: the block's linear maps — the evidence step measures them on each fold's training records, and `diag compare` /
#: `diag merge PLAN --data` on the fit records. Only the block's weight matrices take it; its other tensors (norms,
#: biases) keep the block's α.
GRAM_RULES = ("regmean",)
#: Strategies a block can be merged by as an evidence candidate (``--candidates layer,attn-mlp,ties``): the data-free
#: registered strategies at their paper defaults (the closed form is the granularities' own rule; NAN reads θ0
#: itself, which a candidate merge lacks), and the gram rules.
BLOCK_RULES = tuple(name for name, method in STRATEGIES.items()
                    if not method.needs_data and not method.checkpoint_inputs and name != "closed-form") + GRAM_RULES
#: What the evidence plan chooses among per block unless told (`diag compare --candidates`): closed-form α per layer
#: or per attention + MLP, or RegMean on the block's weight matrices (on the demo kit every block takes RegMean, and
#: the plan beats every tuned baseline: README, "Tuned leaderboard on the demo kit").
PLAN_CANDIDATES = (*EVIDENCE_CANDIDATES, "regmean")


def interference_marks(interference, *, sti_max: float = DEFAULT_STI_MAX,
                       sar_min: float = DEFAULT_SAR_MIN) -> dict[str, str]:
    """Matrices of an `interference` dataset whose task subspaces collide → the reason (empty if None)."""
    if interference is None:
        return {}
    marks = {}
    sar = interference.sar.mean("task").values
    for name, sti, mean_sar in zip(interference.matrix.values, interference.sti_normalized.values, sar):
        reasons = []
        if np.isfinite(sti) and sti > sti_max:
            reasons.append(f"STI/Σσ {sti:.3g} > {sti_max}")
        if np.isfinite(mean_sar) and mean_sar < sar_min:
            reasons.append(f"mean SAR {mean_sar:.3g} < {sar_min}")
        if reasons:
            marks[str(name)] = "; ".join(reasons)
    return marks


def rule_delta(rule: ParameterRule, info: TensorInfo, vectors: list[torch.Tensor], tasks: list[str],
               grams: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The merged task vector of one tensor under `rule` (weights: Σ w_t τ_t; method: the strategy, as the writer
    merges it, with the tensor's per-task data input `grams` — RegMean's input Grams — where its method takes one)."""

    if rule.weights is None:
        return method_delta(info, vectors, rule, grams)
    total = torch.zeros_like(vectors[0])
    for task, vector in zip(tasks, vectors):
        weight = rule.weights.get(task, 0.0)
        total = total + (weight.to(vector.device) if isinstance(weight, torch.Tensor) else weight) * vector
    return total


def _mean_weight(rule: ParameterRule) -> float:
    """Mean over tasks (and heads) of a weights rule."""
    return float(np.mean([float(torch.as_tensor(w, dtype=torch.float64).mean()) for w in rule.weights.values()]))


def steer(plan: Plan, infos: list[TensorInfo], marks: dict[str, str], method: str = DEFAULT_STEER_METHOD) -> Plan:
    """Give the marked matrices among `infos` `method` at scaling = their unit's mean α (in place)."""
    if method not in STEER_METHODS:
        raise PlanError(f"unknown steering method '{method}' (choose from {', '.join(STEER_METHODS)})")
    for info in infos:
        if info.name not in marks or info.kind != "matrix":
            continue
        plan.matrix_rules.pop(info.name, None)
        rule = plan.rule_for(info)
        if rule.weights is None:
            continue
        plan.matrix_rules[info.name] = {"method": method, "options": {"scaling": _mean_weight(rule)},
                                        "reason": marks[info.name]}
    return plan


def interference_ranking(interference) -> list[str]:
    """The matrices of an `interference` dataset, those whose task subspaces collide most first (STI/Σσ descending;
    NaN last, in the dataset's order)."""
    scores = [(str(name), float(sti)) for name, sti in zip(interference.matrix.values,
                                                             interference.sti_normalized.values)]
    return [name for name, _ in sorted(scores, key=lambda item: -item[1] if math.isfinite(item[1]) else math.inf)]


def steered_matrices(infos: list[TensorInfo], share: float, ranking: list[str] | None = None) -> frozenset[str]:
    """The block weight matrices a plan steers at `share` (0 … 1): the first ⌈share · n⌉ of the n block matrices in
    `ranking` order (`interference_ranking`), or all of them at share 1 without a ranking."""
    matrices = [info.name for info in infos if info.kind == "matrix" and info.layer >= 0]
    if not 0.0 <= share <= 1.0:
        raise PlanError(f"steer share must be within 0 … 1, got {share}")
    if ranking is None:
        if share not in (0.0, 1.0):
            raise PlanError("steering a share of the matrices ranks them by interference: the store has no "
                            "complete `interference` group (run diag interference first)")
        return frozenset(matrices if share == 1.0 else ())
    position = {name: i for i, name in enumerate(ranking)}
    ordered = sorted(matrices, key=lambda name: position.get(name, len(position)))
    return frozenset(ordered[:math.ceil(share * len(ordered) - 1e-9)])


@dataclass(frozen=True)
class SteeredPart:
    """One of the two parts of a plan whose `steered` matrices are merged by `method` (`part` "rest": the plan's own
    rule on every other tensor and zero on the steered ones; "steered": `method` at scaling 1 on the steered
    matrices and zero elsewhere). θ0 + λ·rest + μ·steered is the plan steered at scale μ: `diag compare` tunes λ and
    μ apart, because a strategy's natural scale is not the closed form's α."""

    plan: Plan
    steered: frozenset[str]
    method: str
    part: str

    def __call__(self, info: TensorInfo) -> ParameterRule:
        if (info.name in self.steered) == (self.part == "steered"):
            return (ParameterRule(method=self.method, options={"scaling": 1.0}) if self.part == "steered"
                    else self.plan.rule_for(info))
        return ParameterRule(weights=dict.fromkeys(self.plan.finetuned, 0.0))


def _scaled_options(method: str, options: dict | None, scale: float, where: str) -> dict:
    """`options` of a strategy rule with its ``scaling`` (the strategy's default when not given) times `scale`."""
    defaults = STRATEGIES[method].options
    if "scaling" not in defaults:
        raise PlanError(f"{where}: {method} has no scaling option, so the plan cannot be scaled by λ = {scale:g}")
    options = dict(options or {})
    options["scaling"] = scale * float(options.get("scaling", defaults["scaling"]))
    return options


#: The rules a plan's rest (the tensors outside its α units: embedding, final norm, head …) can take, by name: the
#: mean task vector (`make_plan`'s default) or task arithmetic's sum Σ_t τ_t. `diag compare` tunes the choice for the
#: evidence plan (`submerge.merge.tuning.GRIDS`): where the fine-tunes change the embedding, its sum can be worth more
#: than its mean.
PLAN_RESTS = ("mean", "sum")


def with_rest(plan: Plan, rest: str) -> Plan:
    """`plan` with its rest rule replaced by the rule named `rest` (of `PLAN_RESTS`)."""
    if rest == "mean":
        return dataclasses.replace(plan, rest={"method": "mean-task-vector"})
    if rest == "sum":
        return dataclasses.replace(plan, rest={"method": "weights", "weights": dict.fromkeys(plan.finetuned, 1.0)})
    raise PlanError(f"unknown rest rule '{rest}' (choose from {', '.join(PLAN_RESTS)})")


def tuned_plan(plan: Plan, scale: float, *, steered: frozenset[str] = frozenset(), steer_method: str | None = None,
               steer_scale: float | None = None, record: dict | None = None) -> Plan:
    """The plan `diag compare` tuned: θ0 + scale·(its update) + steer_scale·(`steer_method` on the `steered`
    matrices), as a plan `diag merge` writes directly. Every α, the rest's weights and every rule's ``scaling`` are
    multiplied by `scale`; the steered matrices get `steer_method` at scaling `steer_scale`. `record` (the tuned
    hyperparameters) goes into ``decision["tuned"]``."""
    rest_rule = plan._rest_rule(list(plan.finetuned))  # the mean task vector is weights 1/T there
    if rest_rule.weights is not None:
        rest = {"method": "weights", "weights": {t: scale * float(w) for t, w in rest_rule.weights.items()}}
    else:
        rest = {**plan.rest, "options": _scaled_options(rest_rule.method, rest_rule.options, scale, "the plan's rest")}
    rules = {name: {**rule, "options": _scaled_options(rule["method"], rule.get("options"), scale, name)}
             for name, rule in plan.matrix_rules.items() if name not in steered}
    for name in sorted(steered):
        rules[name] = {"method": steer_method, "options": {"scaling": float(steer_scale)},
                       "reason": f"compare: steered to {steer_method} at its tuned scale {steer_scale:g}"}
    return dataclasses.replace(
        plan, alpha={unit: {t: scale * float(w) for t, w in weights.items()} for unit, weights in plan.alpha.items()},
        rest=rest, matrix_rules=rules, decision={**plan.decision, "tuned": dict(record or {"λ": scale})})


def one_se_choice(fold_scores: dict[str, list[float]], order=("layer", "attn-mlp", "head-mlp"),
                  tolerance: float = 1.0) -> str:
    """The coarsest candidate whose cross-validated objective is within `tolerance` standard errors of the best.

    ``fold_scores[c]`` is candidate c's objective on each held-out fold. The best is the lowest mean; a
    coarser candidate c is kept when mean_k(s_c,k − s_best,k) ≤ tolerance · sd_k(s_c,k − s_best,k)/√k
    (paired fold differences: the one-standard-error rule of Hastie, Tibshirani & Friedman, ESL §7.10).
    ``tolerance = 0`` is the plain "lower mean wins".
    """
    means = {c: float(np.mean(v)) for c, v in fold_scores.items()}
    best = min(means, key=lambda c: (means[c], order.index(c) if c in order else len(order)))
    for candidate in sorted(means, key=lambda c: order.index(c) if c in order else len(order)):
        diffs = np.asarray(fold_scores[candidate]) - np.asarray(fold_scores[best])
        spread = float(np.std(diffs, ddof=1)) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
        if candidate == best or float(np.mean(diffs)) <= tolerance * spread:
            return candidate
    return best


@dataclass
class LayerEvidence:
    """What the cross-validation measured in one block."""

    layer: int
    fold_objective: dict[str, list[float]]  # candidate → Eq. 10 objective of the block on each held-out fold
    alpha: dict[str, dict[str, dict[str, float]]]  # candidate → unit → task → α on all fit records
    tolerance: float = 1.0  # standard errors a finer candidate must win by (`one_se_choice`)

    @property
    def cv_objective(self) -> dict[str, float]:
        """Candidate → mean over folds of the held-out-fold objective."""
        return {c: float(np.mean(v)) for c, v in self.fold_objective.items()}

    def choice(self, among=None) -> str:
        scores = {c: v for c, v in self.fold_objective.items() if among is None or c in among}
        return one_se_choice(scores, tolerance=self.tolerance)

    def reason(self, folds: int, among=None) -> str:
        scores = sorted(((c, v) for c, v in self.cv_objective.items() if among is None or c in among),
                        key=lambda item: item[1])
        listed = " < ".join(f"{c} {v:.6g}" for c, v in scores)
        rule = "lowest mean" if self.tolerance == 0 else f"coarsest within {self.tolerance:g} SE of the best"
        return (f"{self.choice(among)}: held-out Eq. 10 objective of the block ({folds}-fold CV over fit records; "
                f"{rule}) {listed}")


@dataclass
class Evidence:
    """Per-block cross-validation results; `plan()` is the evidence plan, `single(g)` the one-granularity plan."""

    base_model: str
    finetuned: dict[str, str]
    layers: list[LayerEvidence]
    infos: list[TensorInfo]  # every tensor of the model (for steering)
    marks: dict[str, str]  # interference-marked matrices → reason
    settings: dict
    attention: dict = field(default_factory=dict)
    rest: dict | None = None

    def _plan(self, choice: dict[int, str], steered: bool) -> Plan:
        """Each block at its chosen granularity's α; a block that chose a rule (a strategy) has it on every tensor
        (RegMean: on every weight matrix; `block_rule_names`) in `matrix_rules`, unsteered (as the evidence measured
        it), and its block α underneath."""
        alpha = {}
        for evidence in self.layers:
            alpha.update(evidence.alpha[choice[evidence.layer]])
        granularity = {layer: chosen if chosen in CHOOSABLE else "layer" for layer, chosen in choice.items()}
        plan = Plan(base_model=self.base_model, finetuned=dict(self.finetuned), granularity=PER_LAYER, alpha=alpha,
                    rest=self.rest or {"method": "mean-task-vector"}, attention=dict(self.attention),
                    layer_granularity=granularity)
        if steered:
            steer(plan, self.infos, self.marks, self.settings["steer_method"])
        for layer, chosen in choice.items():
            if chosen not in CHOOSABLE:
                for name in block_rule_names(chosen, layer, self.infos):
                    plan.matrix_rules[name] = block_rule(chosen, layer)
        return plan

    def plan(self, *, among=None, command: str | None = None) -> Plan:
        """Each block at the granularity (of `among`, default all) with the lower cross-validated objective;
        marked matrices steered. `decision` records every block's scores and reason."""
        among = list(among or self.settings["candidates"])
        choice = {e.layer: e.choice(among) for e in self.layers}
        plan = self._plan(choice, steered=True)
        ruled = {info.name for info in self.infos if info.layer in choice and choice[info.layer] not in CHOOSABLE}
        folds = self.settings["folds"]
        totals = {c: float(sum(e.cv_objective[c] for e in self.layers)) for c in among}
        totals[PER_LAYER] = float(sum(e.cv_objective[choice[e.layer]] for e in self.layers))
        plan.decision = {
            "choose": "evidence",
            **self.settings,
            "candidates": among,
            "cv_objective_total": totals,
            "layers": {e.layer: {"granularity": choice[e.layer], "cv_objective": e.cv_objective,
                                 "fold_objective": e.fold_objective,
                                 "reason": e.reason(folds, among)} for e in self.layers},
            "steered": {name: rule["reason"] for name, rule in plan.matrix_rules.items() if name not in ruled},
        }
        plan.provenance = provenance(command, base_model=self.base_model, finetuned=self.finetuned)
        return plan

    def single(self, granularity: str, *, steered: bool = False) -> Plan:
        """Closed-form α at one granularity in every block (solved on all fit records)."""
        plan = self._plan({e.layer: granularity for e in self.layers}, steered)
        plan.granularity = granularity
        plan.layer_granularity = {}
        plan.decision = {"choose": "asked for", "granularity": granularity, **self.settings}
        return plan


@dataclass(frozen=True)
class PlanDelta:
    """The merged task vector of each tensor under `plan` (a picklable `TensorDelta`: the evidence driver and
    `block_objectives` replay blocks merged by it); `grams` (checkpoint name → per-task input Gram) for its RegMean
    rules."""

    plan: Plan
    grams: dict | Callable | None = None  # a dict, or a callable such as `GramsByLayer` (name → Grams or None)

    def __call__(self, info: TensorInfo, vectors: list[torch.Tensor]) -> torch.Tensor:
        rule = self.plan.rule_for(info)
        grams = None
        if rule.weights is None and rule.method in GRAM_RULES and self.grams is not None:
            grams = self.grams(info.name) if callable(self.grams) else self.grams.get(info.name)
        return rule_delta(rule, info, vectors, list(self.plan.finetuned), grams)


def gram_ruled(plan: Plan) -> list[str]:
    """The tensors `plan` merges by a rule that needs their input Grams (RegMean), in plan order."""
    return [name for name, rule in plan.matrix_rules.items() if rule.get("method") in GRAM_RULES]


def block_rule_names(method: str, layer: int, infos: list[TensorInfo]) -> list[str]:
    """The tensors of block `layer` that a block rule `method` merges: every one, or for a gram rule (RegMean) the
    block's weight matrices (its other tensors keep the block's α)."""
    return [info.name for info in infos if info.layer == layer and (method not in GRAM_RULES or info.kind == "matrix")]


@dataclass(frozen=True)
class CandidateMerge:
    """How a block merges at a candidate granularity with given α — a per-layer plan of that block, steered — as
    the evidence driver asks for it (`submerge.diagnostics.linearity.evidence.CandidateMerge`; picklable, Ray
    workers call it). `marks` (matrix → reason) from `interference_marks`; `settings` go into the store group's
    settings, so evidence measured under other rules is not reused."""

    finetuned: dict[str, str]
    attention: dict  # num_heads, num_kv_heads, head_dim
    rest: dict = field(default_factory=lambda: {"method": "mean-task-vector"})
    marks: dict = field(default_factory=dict)
    steer_method: str = DEFAULT_STEER_METHOD
    sti_max: float = DEFAULT_STI_MAX
    sar_min: float = DEFAULT_SAR_MIN
    block_rules: tuple = ()  # strategies (of `BLOCK_RULES`) a whole block may be merged by instead of α

    def __post_init__(self):
        if self.steer_method not in STEER_METHODS:
            raise PlanError(f"unknown steering method '{self.steer_method}' (choose from {', '.join(STEER_METHODS)})")
        unknown = [rule for rule in self.block_rules if rule not in BLOCK_RULES]
        if unknown:
            raise PlanError(f"unknown block rule(s) {unknown}: a block can be merged by {', '.join(BLOCK_RULES)}")

    @property
    def gram_rules(self) -> tuple:
        """The block rules fitted on each fold's input Grams (the evidence driver measures them)."""
        return tuple(rule for rule in self.block_rules if rule in GRAM_RULES)

    @property
    def settings(self) -> dict:
        return {"rest": self.rest, "steer_method": self.steer_method, "sti_max": self.sti_max,
                "sar_min": self.sar_min, "steered": sorted(self.marks),
                **({"block_rules": list(self.block_rules)} if self.block_rules else {})}

    def plan(self, layer: int, granularity: str, alpha: dict) -> Plan:
        """Block `layer` at `granularity` with α per unit, as a per-layer plan (unsteered)."""
        return Plan(base_model="", finetuned=dict(self.finetuned), granularity=PER_LAYER, alpha=alpha,
                    rest=self.rest, attention=self.attention, layer_granularity={layer: granularity})

    def __call__(self, layer: int, granularity: str, alpha: dict, infos: list[TensorInfo],
                 grams: dict | None = None) -> PlanDelta:
        if granularity in self.block_rules:  # the block by the strategy, at its paper defaults (`block_rule_names`)
            plan = self.plan(layer, "layer", alpha if granularity in GRAM_RULES else {})
            plan.matrix_rules = {name: block_rule(granularity, layer)
                                 for name in block_rule_names(granularity, layer, infos)}
            missing = [name for name in plan.matrix_rules if granularity in GRAM_RULES and name not in (grams or {})]
            if missing:
                raise PlanError(f"block {layer}: {granularity} needs the input Grams of {missing} (only linear maps "
                                "have them)")
            return PlanDelta(plan, grams)
        return PlanDelta(steer(self.plan(layer, granularity, alpha), infos, self.marks, self.steer_method))


def block_rule(method: str, layer: int) -> dict:
    """The plan's `matrix_rules` entry of a tensor of a block the evidence merged by `method` (paper defaults)."""
    return {"method": method, "options": {}, "reason": f"evidence: block {layer} merged by {method}"}


def choose_by_evidence(dataset, merge: CandidateMerge, *, base_model: str, infos: list[TensorInfo],
                       tolerance: float = 1.0) -> Evidence:
    """The evidence plan's choices from an `evidence` dataset (the driver's result or the store group) measured
    with `merge`; `infos`: every tensor of the model (for steering the final plan)."""
    tasks = [str(t) for t in dataset.task.values]
    if tasks != list(merge.finetuned):
        raise PlanError(f"the evidence was measured for tasks {tasks}, the plan merges {list(merge.finetuned)}")
    candidates = [str(c) for c in dataset.candidate.values]
    parts = [str(p) for p in dataset.part.values]
    heads = merge.attention.get("num_heads") or 0
    fold_objective, alpha = dataset.fold_objective.values, dataset.alpha.values
    layers = []
    for i, layer in enumerate(int(j) for j in dataset.layer.values):
        scores = {c: [float(v) for v in fold_objective[i, n]] for n, c in enumerate(candidates)}
        solved = {c: {u: dict(zip(tasks, map(float, alpha[i, parts.index(part_of(u))])))
                      for u in unit_names(c if c in CHOOSABLE else "layer", layer, heads)}
                  for c in candidates}  # a block rule keeps the block's α underneath its rules
        layers.append(LayerEvidence(layer, scores, solved, tolerance))
    settings = {"candidates": candidates, "folds": int(dataset.sizes["fold"]),
                "balance": bool(dataset.attrs.get("balance", True)), "sti_max": merge.sti_max,
                "sar_min": merge.sar_min, "steer_method": merge.steer_method, "tolerance": tolerance,
                "fit_records": int(dataset.attrs["fit_records"])}
    return Evidence(base_model=base_model, finetuned=dict(merge.finetuned), layers=layers, infos=list(infos),
                    marks=dict(merge.marks), settings=settings, attention=dict(merge.attention), rest=merge.rest)


def candidate_merge(experiment, finetuned: dict[str, str], *, interference=None, sti_max: float = DEFAULT_STI_MAX,
                    sar_min: float = DEFAULT_SAR_MIN, steer_method: str = DEFAULT_STEER_METHOD,
                    rest: dict | None = None, block_rules: tuple = ()) -> CandidateMerge:
    """The `CandidateMerge` of an experiment's base: its attention shape, the matrices `interference` (the store's
    ``interference`` dataset, or None: no steering) marks."""
    if list(finetuned) != list(experiment.tasks):
        raise PlanError(f"finetuned {list(finetuned)} must name the experiment's tasks {experiment.tasks} in order")
    arch = experiment.arch
    return CandidateMerge(finetuned=dict(finetuned), rest=rest or {"method": "mean-task-vector"},
                          attention={"num_heads": arch.num_heads, "num_kv_heads": arch.num_kv_heads,
                                     "head_dim": arch.head_dim},
                          marks=interference_marks(interference, sti_max=sti_max, sar_min=sar_min),
                          steer_method=steer_method, sti_max=sti_max, sar_min=sar_min,
                          block_rules=tuple(block_rules))


def check_evidence_options(experiment, options: dict | None) -> None:
    """The evidence step's settings (`evidence_plan`'s keywords), checked before any work: a compare that fails on
    them later would leave its group behind."""
    options = dict(options or {})
    candidates = tuple(dict.fromkeys(options.get("candidates") or PLAN_CANDIDATES))
    for candidate in candidates:
        if candidate not in CHOOSABLE and candidate not in BLOCK_RULES:
            raise PlanError(f"--candidates: '{candidate}' is neither a granularity choosable per layer "
                            f"({', '.join(CHOOSABLE)}) nor a strategy a block can be merged by "
                            f"({', '.join(BLOCK_RULES)})")
    folds = options.get("folds", DEFAULT_FOLDS)
    if not isinstance(folds, int) or folds < 2:
        raise PlanError(f"--folds must be at least 2 (got {folds})")
    fewest = min(len(data.texts) for data in experiment.data.values())
    if fewest < folds:
        raise PlanError(f"{folds}-fold cross-validation needs at least {folds} fit records per task; one task has "
                        f"{fewest} (raise --fit or lower --folds)")
    if options.get("steer_method", DEFAULT_STEER_METHOD) not in STEER_METHODS:
        raise PlanError(f"--steer: unknown steering method {options['steer_method']!r} (choose from "
                        f"{', '.join(STEER_METHODS)})")
    for key in ("sti_max", "sar_min", "tolerance"):
        if key in options and not math.isfinite(float(options[key])):
            raise PlanError(f"--{key.replace('_', '-')} must be a finite number, got {options[key]!r}")


def evidence_plan(
    experiment,
    finetuned: dict[str, str],
    *,
    candidates: tuple[str, ...] = PLAN_CANDIDATES,
    folds: int = DEFAULT_FOLDS,
    balance: bool = True,
    interference=None,
    sti_max: float = DEFAULT_STI_MAX,
    sar_min: float = DEFAULT_SAR_MIN,
    steer_method: str = DEFAULT_STEER_METHOD,
    tolerance: float = 1.0,
    rest: dict | None = None,
    run: RunSettings | None = None,
    **run_options,
) -> Evidence:
    """The evidence step on the experiment's (fit) records (`evidence`: with ``store``, group ``evidence``,
    resumable), read by `choose_by_evidence`; see the section comment.

    `finetuned`: the specs written into the plan (task → spec, the experiment's tasks in order). `interference`:
    the store's ``interference`` dataset (or None: no steering). ``run`` or its fields as keywords (``store``,
    ``force``, ``progress``, ``capture_budget``, ``engine`` …): `submerge.diagnostics.execution.RunSettings`.
    """
    merge = candidate_merge(experiment, finetuned, interference=interference, sti_max=sti_max, sar_min=sar_min,
                            steer_method=steer_method, rest=rest,
                            block_rules=tuple(c for c in candidates if c not in CHOOSABLE))
    dataset = measure_evidence(experiment, merge, candidates=candidates, folds=folds, balance=balance, run=run,
                               **run_options)
    infos = list(TensorTable.from_model(experiment.base.model, experiment.base.checkpoint_names, experiment.arch))
    return choose_by_evidence(dataset, merge, base_model=experiment.base.spec, infos=infos, tolerance=tolerance)


def block_objectives(experiment, plan: Plan, *, fit=None, balance: bool = True, layers: list[int] | None = None,
                     progress: bool = False) -> dict[int, float]:
    """Eq. 10 objective (Eq. 33 balanced) of every block merged by `plan`, on all of the experiment's records
    (`submerge.diagnostics.linearity.evidence.block_objectives`). Use an experiment on held-out records (``skip``)
    to check a plan out of sample. A plan with RegMean rules (`gram_ruled`) needs `fit`, the experiment on the
    records it is fitted on (their input Grams, as `diag compare` and `diag merge PLAN --data` take them)."""
    grams = None
    if gram_ruled(plan):
        if fit is None:
            raise PlanError(f"the plan merges {len(gram_ruled(plan))} matrices by RegMean: give fit= (the experiment "
                            "on its fit records, whose input Grams they need)")
        grams = fit.input_grams(plan.finetuned)
    return measured_block_objectives(experiment, PlanDelta(plan, grams), balance=balance, layers=layers,
                                     progress=progress)

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
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from submerge.diagnostics.capture import (
    head_output,
    layer_chunks,
    record_inputs,
    replay,
    replay_with_heads,
    sample_features,
)
from submerge.diagnostics.checkpoints import local_path
from submerge.diagnostics.errors import SubmergeError
from submerge.diagnostics.linearity import alpha_system, balance_denominator, merge_objective, solve_alpha, task_gram
from submerge.diagnostics.modules import GRANULARITIES, get_module, module_parameter_names
from submerge.diagnostics.outputs import check_output_file, file_starts_with, replace_file
from submerge.diagnostics.progress import progress_bar
from submerge.diagnostics.provenance import provenance
from submerge.diagnostics.store import Store
from submerge.diagnostics.tensors import TensorInfo, TensorTable
from submerge.merge.rules import ParameterRule, head_rule, mean_rule, weights_rule
from submerge.merge.strategies import merge_parameter

DEFAULT_NL_MAX = 0.5
DEFAULT_PD_MAX = 0.2
AUTO_ORDER = ("attn-mlp", "layer", "model")
PER_LAYER = "per-layer"  # Plan.granularity of a plan whose blocks each have their own (evidence choice)
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

    def save(self, path: str | Path, *, force: bool = False, option: str = "--out") -> Path:
        """Write the plan (YAML, first line ``submerge_plan: 1``) atomically. An existing file is replaced only
        with `force` and only when it is a submerge plan (`submerge.diagnostics.outputs`)."""
        check_output_file(path, force, option=option, ours=is_plan_file, what="a submerge plan")
        return replace_file(path, yaml.safe_dump({"submerge_plan": 1, **asdict(self)}, sort_keys=False,
                                                 allow_unicode=True))

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
        return self._rest_rule(tasks)

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
    path = local_path(spec)
    config = path / "config.json" if path.is_dir() else path.parent / "config.json"
    return json.loads(config.read_text()) if config.exists() else {}


# ====================================================================== a plan chosen by evidence
#
# `choose_by_evidence` picks the granularity of every block by cross-validation instead of thresholds.
# The fit records of each task are split into k folds by record position (record i → fold i mod k).
# For each block j and each candidate granularity c (layer, attn-mlp; head-mlp only when asked):
#   1. per-sample Grams G(x) of every unit of c (the block, or its attention and MLP, or heads + MLP)
#      from replays of the base and of each fine-tune on inputs recorded on the base (Eq. 14);
#   2. for each fold k, α of every unit solved on the other k−1 folds (Eq. 12–14 / 33–34);
#   3. the block's parameters merged as the plan would merge them (`Plan.rule_for`, so norms, GQA
#      groups and interference-steered matrices are treated exactly as `diag merge` will), the block
#      replayed on fold k's recorded inputs, and the true Eq. 10 objective (balanced by Eq. 33's
#      denominator) of the block output against each input task's own fine-tune;
#   4. the candidate's score is the mean over folds; the block takes the candidate with the lower score.
# Scoring every candidate on the same function (the block's output) makes the scores comparable;
# the final α of the chosen units are solved on all fit records.
#
# Interference steering: a weight matrix whose task subspaces collide in the store's `interference`
# group (STI/Σσ above `sti_max`, or the mean SAR over tasks below `sar_min`) is merged with
# `steer_method` (TSV-M by default; Iso-C on request) at scaling = the mean α of the unit that holds
# it, instead of θ0 + Σ α_t τ_t. Defaults: `DEFAULT_STI_MAX` and `DEFAULT_SAR_MIN` below.

EVIDENCE_CANDIDATES = ("layer", "attn-mlp")
DEFAULT_FOLDS = 4
# STI/Σσ (TSV-M's Singular Task Interference divided by the kept singular values) is 0 for orthogonal
# task subspaces; on the demo kit it averages 2.44 over attention matrices and 1.36 over MLP matrices
# (README). 3.0 marks only the matrices where the collision is well above the typical attention level.
DEFAULT_STI_MAX = 3.0
# SAR (Iso-C) is 1 when every task matrix lies inside the top subspace of the task-arithmetic sum;
# below 0.5 a task keeps less than half its energy there (its subspace is crowded out).
DEFAULT_SAR_MIN = 0.5
STEER_METHODS = ("tsv-m", "iso-c")


def unit_names(granularity: str, layer: int, num_heads: int = 0) -> list[str]:
    """The α units of block `layer` at `granularity` (names as in the store and the plan)."""
    if granularity == "layer":
        return [f"layers.{layer}"]
    if granularity == "attn-mlp":
        return [f"layers.{layer}.attn", f"layers.{layer}.mlp"]
    if granularity == "head-mlp":
        return [f"layers.{layer}.attn.head.{h}" for h in range(num_heads)] + [f"layers.{layer}.mlp"]
    raise PlanError(f"granularity '{granularity}' cannot be chosen per layer (layer, attn-mlp, head-mlp)")


def fold_alphas(grams_by_task, folds_by_task, fold: int, *, balance: bool = True) -> np.ndarray:
    """α (Eq. 12–14, balanced Eq. 33–34) solved on the samples outside `fold` of every task.

    ``grams_by_task[a]`` is the (n_a, T, T) stack of per-sample Grams on task a's inputs and
    ``folds_by_task[a]`` the (n_a,) fold of each sample; ``fold = -1`` uses every sample.
    """

    train = []
    for a, (grams, folds) in enumerate(zip(grams_by_task, folds_by_task)):
        kept = np.asarray(grams)[np.asarray(folds) != fold]
        if kept.shape[0] == 0:
            raise PlanError(f"fold {fold} leaves no fit record of task {a} to solve α on: use fewer folds")
        train.append(kept)
    return solve_alpha(*alpha_system(train, balance=balance)).alpha


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


def rule_delta(rule: ParameterRule, info: TensorInfo, vectors: list[torch.Tensor], tasks: list[str]) -> torch.Tensor:
    """The merged task vector of one tensor under `rule` (weights: Σ w_t τ_t; method: the strategy)."""

    if rule.weights is None:
        return merge_parameter(info.name, vectors, rule.method, rule.options, kind=info.kind)
    total = torch.zeros_like(vectors[0])
    for task, vector in zip(tasks, vectors):
        weight = rule.weights.get(task, 0.0)
        total = total + (weight.to(vector.device) if isinstance(weight, torch.Tensor) else weight) * vector
    return total


def _mean_weight(rule: ParameterRule) -> float:
    """Mean over tasks (and heads) of a weights rule."""
    return float(np.mean([float(torch.as_tensor(w, dtype=torch.float64).mean()) for w in rule.weights.values()]))


def steer(plan: Plan, infos: list[TensorInfo], marks: dict[str, str], method: str = "tsv-m") -> Plan:
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
        alpha = {}
        for evidence in self.layers:
            alpha.update(evidence.alpha[choice[evidence.layer]])
        plan = Plan(base_model=self.base_model, finetuned=dict(self.finetuned), granularity=PER_LAYER, alpha=alpha,
                    rest=self.rest or {"method": "mean-task-vector"}, attention=dict(self.attention),
                    layer_granularity=dict(choice))
        if steered:
            steer(plan, self.infos, self.marks, self.settings["steer_method"])
        return plan

    def plan(self, *, among=None, command: str | None = None) -> Plan:
        """Each block at the granularity (of `among`, default all) with the lower cross-validated objective;
        marked matrices steered. `decision` records every block's scores and reason."""
        among = list(among or self.settings["candidates"])
        plan = self._plan({e.layer: e.choice(among) for e in self.layers}, steered=True)
        folds = self.settings["folds"]
        totals = {c: float(sum(e.cv_objective[c] for e in self.layers)) for c in among}
        totals[PER_LAYER] = float(sum(e.cv_objective[e.choice(among)] for e in self.layers))
        plan.decision = {
            "choose": "evidence",
            **self.settings,
            "candidates": among,
            "cv_objective_total": totals,
            "layers": {e.layer: {"granularity": e.choice(among), "cv_objective": e.cv_objective,
                                 "fold_objective": e.fold_objective,
                                 "reason": e.reason(folds, among)} for e in self.layers},
            "steered": {name: rule["reason"] for name, rule in plan.matrix_rules.items()},
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


class _BlockScorer:
    """Replays the units of one block on recorded inputs and scores candidate merges of it."""

    def __init__(self, experiment, finetuned: dict[str, str], settings: dict, marks: dict[str, str],
                 rest: dict | None = None):
        self.experiment, self.settings, self.marks = experiment, settings, marks
        self.rest = rest or {"method": "mean-task-vector"}
        self.tasks = experiment.tasks
        self.arch = experiment.arch
        self.model = experiment.base.model
        self.source = experiment.parameter_source()
        self.finetuned = finetuned
        self.table = TensorTable.from_model(self.model, experiment.base.checkpoint_names, self.arch)
        self.attention = {"num_heads": self.arch.num_heads, "num_kv_heads": self.arch.num_kv_heads,
                          "head_dim": self.arch.head_dim}

    def unit_paths(self, layer: int) -> dict[str, tuple[str, int | None]]:
        """Every unit the candidates need in block `layer` → (module path, head or None)."""
        units = {f"layers.{layer}": (self.arch.layer_path(layer), None)}
        for candidate in self.settings["candidates"]:
            for unit in unit_names(candidate, layer, self.arch.num_heads)[int(candidate == "layer"):]:
                part = unit.split(".")[2]
                head = int(unit.rsplit(".", 1)[1]) if ".head." in unit else None
                units[unit] = ((self.arch.attn_path(layer) if part == "attn" else self.arch.mlp_path(layer)), head)
        return units

    def features(self, path: str, recs, params, head: int | None = None) -> list[torch.Tensor]:
        """Per-sample float64 features of the module at `path` (or one of its heads) replayed with `params`."""

        module = get_module(self.model, path)
        out = []
        for rec in recs:
            if head is None:
                output = replay(module, rec, params)
            else:
                _, x, weight = replay_with_heads(module, self.arch, rec, params)
                output = head_output(x, weight, self.arch, head)
            out += sample_features(output, rec.token_mask)
        return out

    def unit_grams(self, path: str, head, recorded) -> tuple[list[np.ndarray], list[list[list[torch.Tensor]]]]:
        """Per-sample Grams (per input task) of one unit and its features [task][variant][sample]."""

        variants = [self.source.variant(path, {})] + [self.source.variant(path, {t: 1.0}) for t in self.tasks]
        grams, feats = [], []
        for task in self.tasks:
            per_variant = [self.features(path, recorded[task][path], params, head) for params in variants]
            deltas = [[f[s] - per_variant[0][s] for f in per_variant[1:]] for s in range(len(per_variant[0]))]
            grams.append(np.stack([task_gram(d).numpy() for d in deltas]))
            feats.append(per_variant)
        return grams, feats

    def block_parameters(self, layer: int, plan: Plan) -> dict[str, torch.Tensor]:
        """Block `layer`'s parameters merged by `plan` (local names), θ0 + δ in the compute dtype, never rounded
        back to storage (plus the block's floating buffers, upcast, as `ParameterSource.variant` gives them)."""

        path = self.arch.layer_path(layer)
        params = self.source.upcast_buffers(path)
        base = self.source.base_parameters(path)
        deltas = {t: self.source.deltas(path, t) for t in self.tasks}
        for local, full in module_parameter_names(self.model, path).items():
            weight = base[local]
            info = self.table.get(self.experiment.base.checkpoint_name(full), tuple(weight.shape))
            delta = rule_delta(plan.rule_for(info), info, [deltas[t][local] for t in self.tasks], self.tasks)
            compute = torch.promote_types(weight.dtype, self.source.compute_dtype)
            params[local] = weight.to(device=self.source.device, dtype=compute) + delta.to(compute)
        return params

    def block_plan(self, layer: int, candidate: str, alpha: dict) -> Plan:
        plan = Plan(base_model="", finetuned=dict(self.finetuned), granularity=PER_LAYER, alpha=alpha,
                    rest=self.rest, attention=self.attention, layer_granularity={layer: candidate})
        return steer(plan, [i for i in self.table if i.layer == layer], self.marks, self.settings["steer_method"])

    def fold_objective(self, merged, layer_feats, layer_grams, folds_by_task, fold: int) -> float:
        """Eq. 10 (balanced by Eq. 33 when `balance`) of the merged block on the samples of `fold`."""

        chosen, targets, denominators = [], [], []
        for a in range(len(self.tasks)):
            keep = np.flatnonzero(folds_by_task[a] == fold)
            chosen.append([merged[a][s] for s in keep])
            targets.append([layer_feats[a][1 + a][s] for s in keep])
            denominators.append([balance_denominator(layer_grams[a][s]) for s in keep])
        return merge_objective(chosen, targets, denominators if self.settings["balance"] else None)

    def layer_evidence(self, layer: int, recorded) -> LayerEvidence:
        """Cross-validated Eq. 10 objective of every candidate granularity in block `layer`."""
        folds, balance = self.settings["folds"], self.settings["balance"]
        layer_path = self.arch.layer_path(layer)
        folds_by_task = [np.array([i % folds for rec in recorded[t][layer_path] for i in rec.sample_index])
                         for t in self.tasks]
        grams, layer_feats = {}, None
        for unit, (path, head) in self.unit_paths(layer).items():
            grams[unit], feats = self.unit_grams(path, head, recorded)
            if unit == f"layers.{layer}":
                layer_feats = feats
        cv, full = {}, {}
        for candidate in self.settings["candidates"]:
            units = unit_names(candidate, layer, self.arch.num_heads)

            def solved(fold, units=units):
                return {u: dict(zip(self.tasks, map(float, fold_alphas(grams[u], folds_by_task, fold,
                                                                           balance=balance)))) for u in units}

            scores = []
            for fold in range(folds):
                params = self.block_parameters(layer, self.block_plan(layer, candidate, solved(fold)))
                merged = [self.features(layer_path, recorded[t][layer_path], params) for t in self.tasks]
                scores.append(self.fold_objective(merged, layer_feats, grams[f"layers.{layer}"], folds_by_task, fold))
            cv[candidate] = [float(v) for v in scores]
            full[candidate] = solved(-1)
        return LayerEvidence(layer, cv, full, self.settings["tolerance"])


def choose_by_evidence(
    experiment,
    finetuned: dict[str, str],
    *,
    candidates: tuple[str, ...] = EVIDENCE_CANDIDATES,
    folds: int = DEFAULT_FOLDS,
    balance: bool = True,
    interference=None,
    sti_max: float = DEFAULT_STI_MAX,
    sar_min: float = DEFAULT_SAR_MIN,
    steer_method: str = "tsv-m",
    tolerance: float = 1.0,
    rest: dict | None = None,
    capture_budget: int = 2**30,
    progress: bool = True,
) -> Evidence:
    """Cross-validate the granularity of every block on the experiment's (fit) records; see the section comment.

    `interference`: the store's `interference` dataset (or None: no steering). `finetuned`: the specs
    written into the plan (task → spec, the experiment's tasks).
    """

    candidates = tuple(dict.fromkeys(candidates))
    for candidate in candidates:
        unit_names(candidate, 0, 1)
    if folds < 2:
        raise PlanError(f"--folds must be at least 2 (got {folds})")
    fewest = min(len(data.texts) for data in experiment.data.values())
    if fewest < folds:
        raise PlanError(f"{folds}-fold cross-validation needs at least {folds} fit records per task; "
                        f"one task has {fewest} (raise --fit or lower --folds)")
    if steer_method not in STEER_METHODS:
        raise PlanError(f"unknown steering method '{steer_method}' (choose from {', '.join(STEER_METHODS)})")
    marks = interference_marks(interference, sti_max=sti_max, sar_min=sar_min)
    settings = {"candidates": list(candidates), "folds": folds, "balance": balance, "sti_max": sti_max,
                "sar_min": sar_min, "steer_method": steer_method, "tolerance": tolerance, "fit_records": fewest}
    scorer = _BlockScorer(experiment, finetuned, settings, marks, rest)
    arch = experiment.arch
    padded = max(sum(b.input_ids.numel() for b in batches) for batches in experiment.batches.values())
    element = next(experiment.base.model.parameters()).element_size()
    per_layer = padded * scorer.model.config.get_text_config().hidden_size * element * 3 * len(experiment.tasks)
    layers = []
    with progress_bar(progress) as bar:
        job = bar.add_task("Choosing granularity per layer", total=arch.num_layers)
        for chunk in layer_chunks(arch.num_layers, per_layer, capture_budget):
            paths = [p for j in chunk for p in (arch.layer_path(j), arch.attn_path(j), arch.mlp_path(j))]
            recorded = {t: record_inputs(scorer.model, arch, paths, experiment.batches[t], device=experiment.device,
                                         compute=scorer.source.compute_dtype)
                        for t in experiment.tasks}
            for layer in chunk:
                bar.update(job, description=f"Choosing granularity · layer {layer}")
                layers.append(scorer.layer_evidence(layer, recorded))
                scorer.source.clear()
                bar.advance(job)
            del recorded
    return Evidence(base_model=experiment.base.spec, finetuned=dict(finetuned), layers=layers,
                    infos=list(scorer.table), marks=marks, settings=settings, attention=scorer.attention, rest=rest)


def block_objectives(experiment, plan: Plan, *, balance: bool = True, layers: list[int] | None = None,
                     progress: bool = False) -> dict[int, float]:
    """Eq. 10 objective (Eq. 33 balanced) of every block merged by `plan`, on all of the experiment's records.

    The block's inputs are recorded on the base; its merged output is compared with each input task's own
    fine-tune. Use an experiment on held-out records (``skip``) to check a plan out of sample.
    """

    settings = {"candidates": [], "folds": 1, "balance": balance, "steer_method": "tsv-m", "tolerance": 0.0}
    scorer = _BlockScorer(experiment, dict(plan.finetuned), settings, {}, plan.rest)
    arch = experiment.arch
    chosen = list(range(arch.num_layers)) if layers is None else list(layers)
    objectives = {}
    with progress_bar(progress) as bar:
        job = bar.add_task("Block objectives", total=len(chosen))
        for layer in chosen:
            path = arch.layer_path(layer)
            recorded = {t: record_inputs(scorer.model, arch, [path], experiment.batches[t], device=experiment.device,
                                         compute=scorer.source.compute_dtype)
                        for t in experiment.tasks}
            grams, feats = scorer.unit_grams(path, None, recorded)
            params = scorer.block_parameters(layer, plan)
            merged = [scorer.features(path, recorded[t][path], params) for t in experiment.tasks]
            zeros = [np.zeros(len(g), dtype=int) for g in grams]
            objectives[layer] = scorer.fold_objective(merged, feats, grams, zeros, 0)
            scorer.source.clear()
            bar.advance(job)
    return objectives

"""The hyperparameter grid of every merge method `diag compare` tunes, and the search over it.

Every merge compare runs is θ0 + λ·δ: δ is the merged update written once per setting of the method's other knobs
(its options at ``scaling`` 1; all of a method's settings in one pass where they fit, `merge.compare.TOGETHER_BYTES`),
and each λ is evaluated as the scaled model θ0 + λ·δ
(`submerge.diagnostics.evaluate.scaled_source`), without writing another checkpoint. For a strategy with a
``scaling`` option (λ of its paper's equation: τ_M = λ·f(τ_1 … τ_T)) this λ *is* that option; for one without (RegMean,
Fisher, STAR, the closed form, the plan …) it is a global scale of the merged update, the same knob the baselines get.

The grids (`GRIDS`, method → {option: values}; λ for every method is `LAMBDAS` unless the method's own grid names
``scaling``):

- task arithmetic: λ ∈ {0.1, …, 1.0} (seed 002, App. A.3.4 / Table 12);
- DARE: drop rate ∈ {0.6, 0.7, 0.8, 0.9} × λ ∈ {0.6, 0.8, 1.0} (seed 002, App. A.3.4 / Table 12);
- Consensus TA / TALL masks: mask λ ∈ {0.2, …, 0.6} (seed 003, §TALL-masks);
- the trimming methods (TIES, PCB, SFTM, KnOTS): kept fraction top-k ∈ {0.1, 0.2, 0.3, 0.5}; Breadcrumbs β ∈
  {0.85, 0.9}; DELLA drop rate ∈ {0.5, 0.7, 0.9}; CART rank ratio ∈ {0.04, 0.08, 0.16}: the seeds name these knobs
  (seed 003) but no grid; these values bracket each paper's default and are this project's choice (top-k 0.5 since
  stop 33: with {0.1, 0.2, 0.3} all four chose 0.3, the grid's edge, on the demo kit). Their λ grid is
  `LAMBDAS_WIDE` (a trimmed update is smaller than Σ τ, so the best λ may exceed 1);
- the evidence plan: besides its λ, the share of its block matrices steered to its steering method (`--steer`:
  TSV-M or Iso-C), 0, ½ or all of them, the most colliding first by the store's ``interference`` group (without one:
  none or all), at that method's own scale μ; λ and μ are searched apart, because a strategy's natural scale is not
  the closed form's α (on the demo kit Iso-C's tuned λ is 2.0, the plan's 1.2); and its rest (the tensors outside
  the blocks: embedding, final norm, head) as the mean task vector or the sum Σ_t τ_t (`merge.plan.PLAN_RESTS`),
  each written as its own δ, λ searched on each, the steering tried on the better;
- every merge whose update is already at its natural scale (`CALIBRATED`: averages, fitted or learned weights,
  the subspace methods, the closed forms and the plan): λ ∈ `LAMBDAS_WIDE`, which brackets that scale (1) as it
  does for the trimming methods. With the narrower grid of task arithmetic, the demo kit's plan chose λ = 1, the
  grid's edge, with its fit loss still falling (stop 32).

The criterion (`criterion_weights`, ``tune_by``): a candidate's fit loss is Σ_t w_t L_t over the subset's tasks on the
fit records. ``"gain"`` weighs each task by the inverse of its fine-tune's gain on those records, w_t ∝ 1 /
(L_base,t − L_finetune_t,t): the leaderboard's mean normalised gain, (1/T) Σ_t (L_base,t − L_t) / (L_base,t −
L_finetune_t,t), is a constant minus (1/T) Σ_t L_t / (L_base,t − L_finetune_t,t), so the candidate with the lowest
weighted loss is the one with the best mean normalised gain on the fit records: methods are tuned on the measure they
are ranked by. ``"loss"``: the plain mean over tasks (w_t = 1/T), which weighs a task by the size of its loss changes,
so a task whose fine-tune gains little counts little in the tuning and much on the leaderboard.

`search`: ``"grid"`` evaluates every λ of the grid; ``"line"`` (`line_search`) finds the minimum of the fit loss
over the sorted λ grid by a discrete golden-section search, which assumes the loss is unimodal in λ (a quadratic
to first order: the loss of θ0 + λδ near θ0) and evaluates about log_φ(n) + 2 values instead of n; a method's
second and later settings start from the best λ found so far and walk downhill from it (exact under the same
assumption; 3 evaluations where the best λ does not move).
"""

from __future__ import annotations

import itertools
import json
import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from submerge.diagnostics.errors import SubmergeError
from submerge.merge.plan import PLAN_RESTS

LAMBDAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
LAMBDAS_WIDE = (0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0)
TOP_K = (0.1, 0.2, 0.3, 0.5)

#: method → {option: values}. ``scaling`` here replaces the λ grid; every other option is written as its own δ.
GRIDS: dict[str, dict[str, tuple]] = {
    "task-arithmetic": {"scaling": LAMBDAS},
    "dare": {"drop_rate": (0.6, 0.7, 0.8, 0.9), "scaling": (0.6, 0.8, 1.0)},
    "consensus": {"mask_lambda": (0.2, 0.3, 0.4, 0.5, 0.6), "scaling": LAMBDAS_WIDE},
    "ties": {"top_k": TOP_K, "scaling": LAMBDAS_WIDE},
    "pcb": {"top_k": TOP_K, "scaling": LAMBDAS_WIDE},
    "sftm": {"top_k": TOP_K, "scaling": LAMBDAS_WIDE},
    "knots": {"top_k": TOP_K, "scaling": LAMBDAS_WIDE},
    "breadcrumbs": {"beta": (0.85, 0.9), "scaling": LAMBDAS_WIDE},
    "della": {"drop_rate": (0.5, 0.7, 0.9), "scaling": LAMBDAS_WIDE},
    "cart": {"rank_ratio": (0.04, 0.08, 0.16)},
}
#: Merges at their natural scale already (weights averaged, fitted or learned; subspace methods; closed forms; plan).
CALIBRATED = ("weight-average", "nan", "fisher", "tsv-m", "iso-c", "iso-cts", "star", "regmean", "adamerging",
              "lorahub", "closed-form-layer", "closed-form-attn-mlp", "plan")
GRIDS.update({method: {"scaling": LAMBDAS_WIDE} for method in CALIBRATED})
#: The evidence plan also tries steering a share of its block matrices (most colliding first) to its steering method
#: at that method's own scale μ (searched over that method's λ grid; `submerge.merge.compare._tune_steering`).
STEER_SHARES = (0.0, 0.5, 1.0)
GRIDS["plan"]["steer_share"] = STEER_SHARES
GRIDS["plan"]["rest"] = PLAN_RESTS

SEARCHES = ("line", "grid")
TUNE_BY = ("gain", "loss")
SCALE = "scaling"


class TuningError(SubmergeError):
    """A tuning request compare cannot run (unknown search, an empty grid)."""


def check_search(search: str | None) -> str | None:
    """None (or "none"): no tuning, the paper defaults; else "line" or "grid"."""
    if search in (None, "none", False):
        return None
    if search not in SEARCHES:
        raise TuningError(f"--tune must be one of none, {', '.join(SEARCHES)}; got {search!r}")
    return search


def check_tune_by(tune_by: str) -> str:
    if tune_by not in TUNE_BY:
        raise TuningError(f"--tune-by must be one of {', '.join(TUNE_BY)}; got {tune_by!r}")
    return tune_by


def criterion_weights(tune_by: str, base_losses: Sequence[float], finetuned_losses: Sequence[float],
                      tasks: Sequence[str]) -> np.ndarray:
    """Task weights w (summing to 1) of the tuning criterion Σ_t w_t L_t on the fit records (see the module
    docstring). `base_losses[i]` and `finetuned_losses[i]`: the base's and task i's own fine-tune's fit loss on task
    i. ``"gain"``: w_t ∝ 1 / (L_base,t − L_finetune_t,t); where a fine-tune does not improve on the base on the fit
    records that ratio is undefined, and the weights fall back to the plain mean with a warning naming the task."""
    check_tune_by(tune_by)
    uniform = np.full(len(tasks), 1.0 / len(tasks))
    if tune_by == "loss":
        return uniform
    gains = np.asarray(base_losses, dtype=np.float64) - np.asarray(finetuned_losses, dtype=np.float64)
    if not np.all(np.isfinite(gains) & (gains > 0)):
        bad = [f"{t} ({g:+.4f} nats)" for t, g in zip(tasks, gains) if not (math.isfinite(g) and g > 0)]
        warnings.warn(f"--tune-by gain: the fine-tune of {', '.join(bad)} does not improve on the base on the fit "
                      "records, so its normalised gain there is undefined: tuning on the plain mean loss instead",
                      UserWarning, stacklevel=2)
        return uniform
    inverse = 1.0 / gains
    return inverse / inverse.sum()


def settings_of(method: str, options: dict | None = None) -> list[dict]:
    """The settings of `method`'s knobs other than λ, each a dict of options, in grid order ([{}] when it has
    none). `options` (method → {option: values}) replaces those methods' rows of `GRIDS`."""
    grid = {k: v for k, v in (GRIDS | (options or {})).get(method, {}).items() if k != SCALE}
    if any(len(values) == 0 for values in grid.values()):
        raise TuningError(f"the grid of {method} has an option with no value: {grid}")
    return [dict(zip(grid, combination)) for combination in itertools.product(*grid.values())]


def lambdas_of(method: str, lambdas: Sequence[float] | None = None, options: dict | None = None) -> tuple[float, ...]:
    """λ values of `method`: its grid's ``scaling``, else `lambdas` (compare's ``--lambdas``), else `LAMBDAS`."""
    grid = (GRIDS | (options or {})).get(method, {})
    values = grid.get(SCALE) or lambdas or LAMBDAS
    if not values:
        raise TuningError(f"the λ grid of {method} is empty")
    return tuple(sorted(float(v) for v in values))


def grid_search(values: Sequence[float], loss: Callable[[float], float], start: float | None = None
                ) -> tuple[float, dict[float, float]]:
    """Every value's loss; the value with the lowest (ties: the smaller value). `start` is ignored."""
    losses = {float(v): float(loss(float(v))) for v in values}
    return min(losses, key=lambda v: (losses[v], v)), losses


def line_search(values: Sequence[float], loss: Callable[[float], float], start: float | None = None
                ) -> tuple[float, dict[float, float]]:
    """The minimiser of `loss` over the sorted `values`, exact when `loss` is unimodal over them (NaN counts as
    +inf); returns (best, the losses evaluated).

    Without `start` (or with one not among `values`): a discrete golden-section search, about log_φ(n) + 2
    evaluations. With `start` (a guess: another setting's best λ of the same method): a descent from it, which
    evaluates `start` and its neighbours and walks downhill while the loss falls, 3 evaluations when the guess is
    the minimum and one more per step away from it."""
    points = sorted(float(v) for v in values)
    losses: dict[float, float] = {}

    def at(index: int) -> float:
        value = points[index]
        if value not in losses:
            result = float(loss(value))
            losses[value] = float("inf") if math.isnan(result) else result
        return losses[value]

    if start is not None and float(start) in points:
        here = points.index(float(start))
        around = [index for index in (here - 1, here + 1) if 0 <= index < len(points)]
        lower = [index for index in around if at(index) < at(here)]
        if lower:
            step = min(lower, key=lambda index: (at(index), index)) - here
            here += step
            while 0 <= here + step < len(points) and at(here + step) < at(here):
                here += step
        return min(losses, key=lambda v: (losses[v], v)), losses
    low, high = 0, len(points) - 1
    ratio = (5 ** 0.5 - 1) / 2
    while high - low > 2:
        left = high - round(ratio * (high - low))
        right = low + round(ratio * (high - low))
        if left >= right:
            left, right = (low + high) // 2, (low + high) // 2 + 1
        if at(left) <= at(right):
            high = right
        else:
            low = left
    for index in range(low, high + 1):
        at(index)
    return min(losses, key=lambda v: (losses[v], v)), losses


def search_function(search: str) -> Callable:
    return {"line": line_search, "grid": grid_search}[search]


def label(setting: dict, scale: float, scale_name: str) -> str:
    """The chosen hyperparameters as one line: "top_k=0.2 scaling=1.2"."""
    parts = [f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}" for key, value in setting.items()]
    return " ".join([*parts, f"{scale_name}={scale:g}"])


def record(setting: dict, scale: float, scale_name: str) -> str:
    """The chosen hyperparameters as JSON (the store's ``hyperparameters`` coordinate)."""
    return json.dumps({**setting, scale_name: scale}, sort_keys=True)

"""Linearity diagnostics of fine-tuning updates, submodule by submodule.

The top section holds the pure equations of seed 002 (Dai et al., *Leveraging
submodule linearity enhances task arithmetic performance in LLMs*): they take
feature vectors that were already computed (a module's output on one sequence,
real tokens only, flattened to 1-D) and return numbers. All arithmetic is in
float64. Different samples may have different lengths; vectors compared within
one sample must have the same length.

Equation map (seed 002):
- Non-linearity Score: Eq. 19 (discrete form, App. A.2) of Eq. 4.
- Projection Distance: Eq. 8; per-sample cosine_merge: Eq. 7 (= Eq. 15);
  its mean: Eq. 16; cosine_base: Eq. 17 (mean over pairs, see DESIGN.md).
- Merge objective on real outputs: Eq. 10 (= Eq. 20); balanced: Eq. 33.
- Linearised merge objective: Eq. 11 (= Eq. 22); balanced: Eq. 33 with
  Property 2 (Eq. 6) substituted, as in App. A.3.2.
- Closed-form α: B tensor Eq. 14 (= Eq. 24), balanced Eq. 34; A and b Eq. 13
  (= Eq. 31); α = A⁻¹b Eq. 12 (= Eq. 32).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# --- equations ---


def _as_float64_vector(vector: torch.Tensor, name: str) -> torch.Tensor:
    """Return ``vector`` flattened to 1-D float64; raise on a non-tensor."""
    if not isinstance(vector, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(vector).__name__}")
    return vector.detach().reshape(-1).to(torch.float64)


def _pairwise_distances(rows: torch.Tensor) -> torch.Tensor:
    """Exact Euclidean distances between the rows of a (..., R, D) float64 tensor.

    Uses the difference-based path of ``torch.cdist`` (no ‖a‖²+‖b‖²−2⟨a,b⟩
    expansion), so nearly equal rows keep their small distances.
    """
    return torch.cdist(rows, rows, compute_mode="donot_use_mm_for_euclid_dist")


def _nonlinearity_from_distances(distances: torch.Tensor) -> torch.Tensor:
    """Eq. 19 of seed 002 given the (..., N+1, N+1) distance matrices."""
    steps = distances.shape[-1] - 1
    index = torch.arange(steps + 1, dtype=torch.float64)
    ideal = (index[:, None] - index[None, :]).abs() / steps  # |i - j| / N
    endpoint = distances[..., steps, 0]  # ‖F_N − F_0‖ = D(f(x;θ), f(x;θ0))
    safe_endpoint = torch.where(endpoint > 0, endpoint, torch.ones_like(endpoint))
    ratios = distances / safe_endpoint[..., None, None]
    score = ((ratios - ideal) ** 2).sum(dim=(-2, -1))
    return torch.where(endpoint > 0, score, torch.full_like(score, math.nan))


def nonlinearity_score(trajectory: torch.Tensor) -> float:
    """Non-linearity Score of one sample, seed 002 Eq. 19 (App. A.2).

    ``trajectory`` is (N+1, D): row k is F_k = f(x; θ0 + (k/N)τ), so row 0 is
    the base output and row N the fine-tuned output. Returns

        NL(x) = Σ_{i=0..N} Σ_{j=0..N} ( ‖F_i − F_j‖ / ‖F_N − F_0‖ − |i − j|/N )²

    with exact Euclidean distances in float64. It is 0 for a module whose
    output moves along a straight line at constant speed, and invariant to
    scaling, translation and rotation of the feature space. A module that
    fine-tuning did not change (‖F_N − F_0‖ = 0) gives NaN; non-finite
    features give NaN too. Never raises on values, only on shapes.
    """
    if not isinstance(trajectory, torch.Tensor) or trajectory.ndim != 2:
        shape = tuple(trajectory.shape) if isinstance(trajectory, torch.Tensor) else type(trajectory).__name__
        raise ValueError(f"trajectory must be a 2-D tensor (N+1, D), got {shape}")
    if trajectory.shape[0] < 2:
        raise ValueError(f"trajectory needs at least 2 rows (N >= 1), got shape {tuple(trajectory.shape)}")
    rows = trajectory.detach().to(torch.float64)
    return float(_nonlinearity_from_distances(_pairwise_distances(rows)))


def nonlinearity_scores(trajectories: torch.Tensor | Sequence[torch.Tensor]) -> np.ndarray:
    """Non-linearity Score (seed 002 Eq. 19) of many samples at once.

    ``trajectories`` is either a (S, N+1, D) tensor (samples of equal length,
    computed in one batched call) or a sequence of (N+1, D_s) tensors (lengths
    may differ). Returns a float64 array of S scores, NaN where a sample's
    endpoints coincide.
    """
    if isinstance(trajectories, torch.Tensor):
        if trajectories.ndim != 3 or trajectories.shape[1] < 2:
            raise ValueError(f"trajectories must be (S, N+1, D) with N >= 1, got {tuple(trajectories.shape)}")
        rows = trajectories.detach().to(torch.float64)
        return _nonlinearity_from_distances(_pairwise_distances(rows)).numpy()
    return np.array([nonlinearity_score(trajectory) for trajectory in trajectories], dtype=np.float64)


def projection_terms(delta_merge: torch.Tensor, delta_lin: torch.Tensor) -> tuple[float, float]:
    """Per-sample pieces of the Projection Distance, seed 002 Eq. 7-8 (= Eq. 15).

    ``delta_merge`` = Δ_merge(x) = f(x; θ0 + Σ α_t τ_t) − f(x; θ0) and
    ``delta_lin`` = Δ_lin(x) = Σ α_t Δf_t(x). Returns ``(ratio, cosine)`` with

        ratio  = ‖Δ_merge‖ · cos(Δ_merge, Δ_lin) / ‖Δ_lin‖ = ⟨Δ_merge, Δ_lin⟩ / ‖Δ_lin‖²
        cosine = cos(Δ_merge, Δ_lin)                                   (Eq. 7)

    ``ratio`` is the length of Δ_merge projected on Δ_lin, in units of
    ‖Δ_lin‖ (1 for an exactly linear merge). It is computed in the second
    form, so Δ_merge = 0 gives ratio 0 (the merge did nothing the linear
    prediction asked for) while its cosine is NaN; Δ_lin = 0 gives NaN for both.
    """
    merge = _as_float64_vector(delta_merge, "delta_merge")
    linear = _as_float64_vector(delta_lin, "delta_lin")
    if merge.shape != linear.shape:
        raise ValueError(f"delta_merge {tuple(merge.shape)} and delta_lin {tuple(linear.shape)} differ in length")
    inner = float(torch.dot(merge, linear))
    linear_norm = float(torch.linalg.vector_norm(linear))
    merge_norm = float(torch.linalg.vector_norm(merge))
    ratio = inner / linear_norm**2 if linear_norm > 0 else math.nan
    cosine = inner / (merge_norm * linear_norm) if merge_norm > 0 and linear_norm > 0 else math.nan
    return ratio, cosine


def _nanmean(values: Sequence[float] | np.ndarray) -> float:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    finite = array[~np.isnan(array)]
    return float(finite.mean()) if finite.size else math.nan


def projection_distance(ratios: Sequence[float] | np.ndarray) -> float:
    """Projection Distance, seed 002 Eq. 8: |1 − E_x ratio(x)|.

    ``ratios`` are the per-sample ``projection_terms(...)[0]`` over x in the
    union of the merged tasks' inputs. NaN samples (Δ_lin = 0) are left out of
    the mean; all NaN gives NaN.
    """
    return abs(1.0 - _nanmean(ratios))


def cosine_merge(cosines: Sequence[float] | np.ndarray) -> float:
    """cosine_merge^E, seed 002 Eq. 16: E_x cos(Δ_merge(x), Δ_lin(x)).

    ``cosines`` are the per-sample ``projection_terms(...)[1]`` (Eq. 7/15);
    NaN samples are left out, all NaN gives NaN.
    """
    return _nanmean(cosines)


def _cosine(first: torch.Tensor, second: torch.Tensor) -> float:
    first_norm = float(torch.linalg.vector_norm(first))
    second_norm = float(torch.linalg.vector_norm(second))
    if first_norm == 0 or second_norm == 0:
        return math.nan
    return float(torch.dot(first, second)) / (first_norm * second_norm)


def pairwise_task_cosine(task_deltas: Sequence[torch.Tensor]) -> float:
    """One sample's term of cosine_base (seed 002 Eq. 17).

    ``task_deltas`` are Δf_t(x) = f(x; θ0 + τ_t) − f(x; θ0) for t = 1..T
    (T >= 2) on one input x. Returns the mean over pairs t < t' of
    cos(Δf_t, Δf_t'). Eq. 17 prints 1/(T(T−1)) in front of a sum over t < t',
    which is half a mean; DESIGN.md pins the plain mean over the T(T−1)/2
    pairs. A pair with a zero vector is NaN and left out; all pairs NaN → NaN.
    """
    if len(task_deltas) < 2:
        raise ValueError(f"task_deltas needs at least 2 tasks, got {len(task_deltas)}")
    vectors = [_as_float64_vector(delta, f"task_deltas[{t}]") for t, delta in enumerate(task_deltas)]
    lengths = {tuple(vector.shape) for vector in vectors}
    if len(lengths) != 1:
        raise ValueError(f"task_deltas of one sample must have equal lengths, got {sorted(lengths)}")
    cosines = [_cosine(vectors[t], vectors[other]) for t in range(len(vectors)) for other in range(t + 1, len(vectors))]
    return _nanmean(cosines)


def cosine_base(task_deltas_per_sample: Sequence[Sequence[torch.Tensor]]) -> float:
    """cosine_base^E, seed 002 Eq. 17 (mean over task pairs, see DESIGN.md).

    ``task_deltas_per_sample[s][t]`` is Δf_t(x_s). Returns the mean over
    samples of ``pairwise_task_cosine``; NaN samples are left out.
    """
    return _nanmean([pairwise_task_cosine(task_deltas) for task_deltas in task_deltas_per_sample])


def task_gram(deltas: Sequence[torch.Tensor]) -> torch.Tensor:
    """Gram matrix G_bc(x) = ⟨Δf_b(x), Δf_c(x)⟩ of one sample (inner sum of Eq. 14).

    ``deltas[t]`` = Δf_t(x) = f(x; θ0 + τ_t) − f(x; θ0) on one input x.
    Returns a (T, T) float64 tensor.
    """
    if len(deltas) == 0:
        raise ValueError("task_gram needs at least one task delta, got none")
    vectors = [_as_float64_vector(delta, f"deltas[{t}]") for t, delta in enumerate(deltas)]
    lengths = {tuple(vector.shape) for vector in vectors}
    if len(lengths) != 1:
        raise ValueError(f"deltas of one sample must have equal lengths, got {sorted(lengths)}")
    stacked = torch.stack(vectors)
    return stacked @ stacked.T


def balance_denominator(gram: torch.Tensor | np.ndarray) -> float:
    """Sample weight denominator of seed 002 Eq. 33-34: (1/T) Σ_t ‖Δf_t(x)‖² = trace(G(x)) / T."""
    gram_array = np.asarray(gram, dtype=np.float64)
    return float(np.trace(gram_array)) / gram_array.shape[0]


def _checked_grams(grams_by_input_task: Sequence[torch.Tensor | np.ndarray]) -> list[np.ndarray]:
    """Validate ``grams_by_input_task`` (T entries of shape (n_a, T, T)); return float64 arrays."""
    task_count = len(grams_by_input_task)
    if task_count == 0:
        raise ValueError("grams_by_input_task is empty: need one (n_a, T, T) stack per task")
    checked = []
    for a, grams in enumerate(grams_by_input_task):
        if isinstance(grams, torch.Tensor):
            grams = grams.detach().cpu()
        array = np.asarray(grams, dtype=np.float64)
        if array.ndim != 3 or array.shape[1:] != (task_count, task_count):
            raise ValueError(
                f"grams_by_input_task[{a}] must have shape (n_a, {task_count}, {task_count}), got {array.shape}"
            )
        if array.shape[0] == 0:
            raise ValueError(f"grams_by_input_task[{a}] has no samples: task {a} needs at least one input")
        if not np.all(np.isfinite(array)):
            raise ValueError(f"grams_by_input_task[{a}] contains non-finite values")
        checked.append(array)
    return checked


def _sample_weights(grams: np.ndarray, balance: bool) -> np.ndarray:
    """Per-sample weights 1/((1/T) trace G(x)) (Eq. 33-34) or 1 (Eq. 14).

    A sample whose task deltas are all zero has numerator and denominator 0;
    it carries no information and gets weight 0 (left out of the sum but still
    counted in its task's n_a, like a zero term of the unbalanced sum).
    """
    if not balance:
        return np.ones(grams.shape[0])
    denominators = np.trace(grams, axis1=1, axis2=2) / grams.shape[1]
    weights = np.zeros_like(denominators)
    np.divide(1.0, denominators, out=weights, where=denominators > 0)
    return weights


def alpha_system(
    grams_by_input_task: Sequence[torch.Tensor | np.ndarray], balance: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Linear system A α = b of the closed-form merge weights, seed 002 Eq. 13-14 / 34.

    ``grams_by_input_task[a]`` is an (n_a, T, T) stack of ``task_gram`` for
    the inputs x ∈ H_a of task a (the Grams of all T task deltas on inputs of
    task a). With

        B_abc = E_{x∈H_a} G_bc(x) / ((1/T) Σ_t G_tt(x))      (balanced, Eq. 34)
        B_abc = E_{x∈H_a} G_bc(x)                            (unbalanced, Eq. 14)

    returns (A, b) as float64 arrays, A_jk = Σ_a B_ajk and b_j = Σ_a B_aja
    (Eq. 13 / 31: "b_j = Σ_t B_tjt", the target delta is that of the input
    task a). Note DESIGN.md writes b_j = Σ_a B_ajj, which is not the
    stationarity condition of Eq. 11/33; this follows the paper.
    """
    grams_list = _checked_grams(grams_by_input_task)
    task_count = len(grams_list)
    matrix = np.zeros((task_count, task_count))
    vector = np.zeros(task_count)
    for a, grams in enumerate(grams_list):
        weights = _sample_weights(grams, balance)
        b_a = np.einsum("s,sjk->jk", weights, grams) / grams.shape[0]  # B_a·· (Eq. 14 / 34)
        matrix += b_a
        vector += b_a[:, a]  # B_a j a
    return matrix, vector


@dataclass(frozen=True)
class AlphaSolution:
    """Merge weights α = A⁻¹b (seed 002 Eq. 12) and how they were obtained."""

    alpha: np.ndarray  # float64, one weight per task
    condition_number: float  # 2-norm condition number of A (inf when singular)
    used_least_squares: bool  # True when A was singular / too ill-conditioned for solve


def solve_alpha(
    matrix: np.ndarray | torch.Tensor, vector: np.ndarray | torch.Tensor, *, max_condition: float = 1e12
) -> AlphaSolution:
    """Solve A α = b for the merge weights, seed 002 Eq. 12 (= Eq. 32).

    ``matrix`` and ``vector`` are A and b from ``alpha_system``. Solves in
    float64 with ``np.linalg.solve`` (as the paper does) when A's 2-norm
    condition number is finite and at most ``max_condition``; otherwise, or
    if the solve reports a singular matrix, returns the minimum-norm least
    squares solution (``np.linalg.lstsq``), which still minimises the
    linearised objective (Eq. 11 / 33) because A is its Hessian / 2.
    """
    a_matrix = np.asarray(matrix.detach().cpu() if isinstance(matrix, torch.Tensor) else matrix, dtype=np.float64)
    b_vector = np.asarray(vector.detach().cpu() if isinstance(vector, torch.Tensor) else vector, dtype=np.float64)
    if a_matrix.ndim != 2 or a_matrix.shape[0] != a_matrix.shape[1] or b_vector.shape != (a_matrix.shape[0],):
        raise ValueError(f"A must be (T, T) and b (T,), got A {a_matrix.shape} and b {b_vector.shape}")
    if not (np.all(np.isfinite(a_matrix)) and np.all(np.isfinite(b_vector))):
        raise ValueError("A or b contains non-finite values")
    with np.errstate(divide="ignore", invalid="ignore"):
        condition = float(np.linalg.cond(a_matrix))
    if not math.isfinite(condition):
        condition = math.inf
    if condition <= max_condition:
        try:
            return AlphaSolution(np.linalg.solve(a_matrix, b_vector), condition, False)
        except np.linalg.LinAlgError:
            pass
    alpha, *_ = np.linalg.lstsq(a_matrix, b_vector, rcond=None)
    return AlphaSolution(alpha, condition, True)


def linearized_objective(
    alpha: Sequence[float] | np.ndarray, grams_by_input_task: Sequence[torch.Tensor | np.ndarray], balance: bool
) -> float:
    """Linearised merge objective, seed 002 Eq. 11 (= Eq. 22), balanced form Eq. 33.

    With Property 2 (Eq. 6) substituted into Eq. 10 / 33,

        L(α) = Σ_a E_{x∈H_a} w(x) ‖Σ_b α_b Δf_b(x) − Δf_a(x)‖²
             = Σ_a E_{x∈H_a} w(x) (αᵀG(x)α − 2 (G(x)α)_a + G_aa(x)),

    with w(x) = 1 / ((1/T) Σ_t ‖Δf_t(x)‖²) when ``balance`` (Eq. 33) and 1
    otherwise (Eq. 11/22), computed from the same Grams as ``alpha_system``
    (zero-delta samples get weight 0 there and here). ``solve_alpha`` of that
    system minimises it. The expansion loses digits near a perfect fit
    (L ≈ 0); use ``merge_objective`` on vectors for the exact residual.
    """
    grams_list = _checked_grams(grams_by_input_task)
    weights_alpha = np.asarray(alpha, dtype=np.float64)
    if weights_alpha.shape != (len(grams_list),):
        raise ValueError(f"alpha must have shape ({len(grams_list)},), got {weights_alpha.shape}")
    total = 0.0
    for a, grams in enumerate(grams_list):
        weights = _sample_weights(grams, balance)
        quadratic = np.einsum("j,sjk,k->s", weights_alpha, grams, weights_alpha)
        cross = grams[:, a, :] @ weights_alpha
        per_sample = quadratic - 2.0 * cross + grams[:, a, a]
        total += float(np.mean(weights * per_sample))
    return total


def merge_objective(
    merged_outputs: Sequence[Sequence[torch.Tensor]],
    finetuned_outputs: Sequence[Sequence[torch.Tensor]],
    balance_denominators: Sequence[Sequence[float]] | None = None,
) -> float:
    """True merge objective on replayed outputs, seed 002 Eq. 10 (= Eq. 20); Eq. 33 if balanced.

    ``merged_outputs[t][s]`` is f(x_s; θ0 + Σ α_t' τ_t') and
    ``finetuned_outputs[t][s]`` is f(x_s; θ_t) for the s-th input x_s ∈ H_t.
    Returns Σ_t E_{x∈H_t} ‖f(x; θ_merged) − f(x; θ_t)‖², each term divided by
    ``balance_denominators[t][s]`` = (1/T) Σ_t'' ‖Δf_t''(x_s)‖² when given
    (Eq. 33; see ``balance_denominator``). A zero denominator gives that
    sample weight 0, as in ``alpha_system``.
    """
    if len(merged_outputs) != len(finetuned_outputs) or len(merged_outputs) == 0:
        raise ValueError(
            f"merged_outputs ({len(merged_outputs)} tasks) and finetuned_outputs "
            f"({len(finetuned_outputs)} tasks) must list the same, non-zero number of tasks"
        )
    if balance_denominators is not None and len(balance_denominators) != len(merged_outputs):
        raise ValueError(f"balance_denominators has {len(balance_denominators)} tasks, expected {len(merged_outputs)}")
    total = 0.0
    for t, (merged_task, finetuned_task) in enumerate(zip(merged_outputs, finetuned_outputs)):
        if len(merged_task) != len(finetuned_task) or len(merged_task) == 0:
            raise ValueError(
                f"task {t}: merged_outputs has {len(merged_task)} samples, finetuned_outputs {len(finetuned_task)}"
                " (need the same, non-zero count)"
            )
        terms = []
        for s, (merged, finetuned) in enumerate(zip(merged_task, finetuned_task)):
            merged_vector = _as_float64_vector(merged, f"merged_outputs[{t}][{s}]")
            finetuned_vector = _as_float64_vector(finetuned, f"finetuned_outputs[{t}][{s}]")
            if merged_vector.shape != finetuned_vector.shape:
                raise ValueError(
                    f"merged_outputs[{t}][{s}] {tuple(merged_vector.shape)} and finetuned_outputs[{t}][{s}] "
                    f"{tuple(finetuned_vector.shape)} differ in length"
                )
            squared = float(torch.sum((merged_vector - finetuned_vector) ** 2))
            if balance_denominators is not None:
                denominator = float(balance_denominators[t][s])
                squared = squared / denominator if denominator > 0 else 0.0
            terms.append(squared)
        total += float(np.mean(terms))
    return total


def mean_std(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """Mean and (population, ddof=0) standard deviation, ignoring NaN; (NaN, NaN) if all NaN or empty."""
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    finite = array[~np.isnan(array)]
    if finite.size == 0:
        return math.nan, math.nan
    return float(finite.mean()), float(finite.std())


# --- drivers: capture/replay → equations → store ---
#
# The functions below run the equations on real module outputs: record each
# task's inputs on the base (a few layers at a time), replay every module on its
# variants (θ0 + aτ, merges), turn outputs into per-sample features (real tokens
# only) and write one store unit per module so a killed run resumes.

import itertools  # noqa: E402
from collections.abc import Callable  # noqa: E402

import xarray as xr  # noqa: E402

from diagnostics.capture import (  # noqa: E402
    head_output,
    layer_chunks,
    model_outputs,
    record_inputs,
    replay,
    replay_with_heads,
)
from diagnostics.modules import DEFAULT_LEVELS, Submodule, find_submodules, get_module  # noqa: E402
from diagnostics.progress import progress_bar  # noqa: E402
from diagnostics.store import Store, UnitWriter  # noqa: E402

DEFAULT_CAPTURE_BUDGET = 2 * 1024**3  # bytes of recorded inputs held at once
GRANULARITIES = {"model": ("model",), "layer": ("layer",), "attn-mlp": ("attn", "mlp"), "head-mlp": ("head", "mlp")}


def _projection_grid(size: int, values: Sequence[float] | None) -> list[tuple[float, ...]]:
    """Default α grids of seed 002 Fig. 3: {0.2,…,1}² for two models, {0.3,0.5,0.7}^T beyond."""
    if values is None:
        values = (0.2, 0.4, 0.6, 0.8, 1.0) if size == 2 else (0.3, 0.5, 0.7)
    return list(itertools.product(values, repeat=size))


def _module_coords(modules: Sequence[Submodule]) -> dict:
    return {
        "module": np.array([m.name for m in modules], dtype=object),
        "level": ("module", np.array([m.level for m in modules], dtype=object)),
        "layer": ("module", np.array([m.layer for m in modules])),
        "head": ("module", np.array([-1 if m.head is None else m.head for m in modules])),
    }


def _units(modules: Sequence[Submodule]) -> dict[str, list[Submodule]]:
    """Modules grouped by the module path whose replay serves them (an attention serves its heads)."""
    units: dict[str, list[Submodule]] = {}
    for module in modules:
        units.setdefault(module.path, []).append(module)
    return units


def _bytes_per_layer(experiment, paths_per_layer: int) -> int:
    hidden = experiment.base.model.config.get_text_config().hidden_size
    element = next(experiment.base.model.parameters()).element_size()
    padded = max(sum(b.input_ids.numel() for b in batches) for batches in experiment.batches.values())
    return padded * hidden * element * max(1, paths_per_layer)


def _modules_for(experiment, levels: Sequence[str]) -> list[Submodule]:
    """Submodules of the requested levels, blocks first, the model level last."""
    block_levels = tuple(level for level in levels if level != "model")
    modules = find_submodules(experiment.base.model, block_levels, arch=experiment.arch) if block_levels else []
    if "model" in levels:
        modules.append(Submodule("model", "model", -1, experiment.arch.backbone_path))
    return modules


def _by_layer(modules: Sequence[Submodule]) -> dict[int, list[Submodule]]:
    by_layer: dict[int, list[Submodule]] = {}
    for module in modules:
        if module.level != "model":
            by_layer.setdefault(module.layer, []).append(module)
    return by_layer


def _finish_chunk(chunk, by_layer, done, finish_unit, bar, job) -> None:
    """Write one store unit per layer of a finished chunk (the modules not already done)."""
    for layer in chunk:
        layer_modules = [m for m in by_layer.get(layer, []) if m.name not in done]
        if layer_modules:
            finish_unit(layer_modules)
            bar.advance(job, len(layer_modules))


def _replay_variants(source, arch, path: str, recorded, variants, *, heads: bool = False):
    """Outputs of the module at `path` for each variant (built by `source`) on every recorded batch.

    Returns outputs[v][b] and, with `heads`, (o_proj input, o_proj weight) per [v][b] / [v].
    """
    module = get_module(source.base.model, path)
    outputs, o_inputs, o_weights = [], [], []
    for variant in variants:
        params = source.variant(path, variant)
        per_batch, per_batch_x = [], []
        for rec in recorded:
            if heads:
                out, x, weight = replay_with_heads(module, arch, rec, params)
                per_batch_x.append(x)
            else:
                out = replay(module, rec, params)
            per_batch.append(out)
        outputs.append(per_batch)
        if heads:
            o_inputs.append(per_batch_x)
            o_weights.append(weight)
    return outputs, o_inputs, o_weights


def _trajectories(outputs, recorded, sample_positions, *, head=None, o_inputs=None, o_weights=None, arch=None):
    """Yield (position, trajectory (V, D) float64) per sample from per-variant outputs."""
    for b, rec in enumerate(recorded):
        mask = rec.token_mask
        for i, index in enumerate(rec.sample_index):
            rows = []
            for v in range(len(outputs)):
                if head is None:
                    value = outputs[v][b][i][mask[i]]
                else:
                    value = head_output(o_inputs[v][b][i][mask[i]], o_weights[v], arch, head)
                rows.append(value.reshape(-1).to(torch.float64))
            yield sample_positions[index], torch.stack(rows)


def nonlinearity(
    experiment,
    *,
    levels: Sequence[str] = DEFAULT_LEVELS,
    steps: int = 10,
    store: Store | None = None,
    force: bool = False,
    progress: bool = True,
    model_output: str = "hidden",
    capture_budget: int = DEFAULT_CAPTURE_BUDGET,
    command: str | None = None,
    on_unit: Callable[[str], None] | None = None,
) -> xr.Dataset:
    """Non-linearity Score (seed 002 Eq. 19) of every fine-tune on its own task, per module and sample.

    Returns (and, with `store`, writes group ``linearity``) a Dataset with
    ``nonlinearity_score`` (task, module, sample) and ``unchanged`` (task, module):
    modules the fine-tune left untouched score NaN and are flagged. ``sample`` is
    the record index in the task's file; ``level``, ``layer`` (−1 for the model)
    and ``head`` label ``module``.
    """
    if steps < 1:
        raise ValueError("steps must be at least 1")
    tasks = experiment.tasks
    source = experiment.parameter_source()
    modules = _modules_for(experiment, levels)
    settings = {**experiment.settings, "levels": list(levels), "steps": steps, "model_output": model_output}
    writer = UnitWriter(store, "linearity", settings, force=force, root=experiment.root_attrs(command),
                        attrs=experiment.group_attrs(command), on_unit=on_unit)
    done = writer.done
    positions = np.arange(experiment.settings["skip"], experiment.settings["skip"] + experiment.max_samples)
    sample_positions = {int(index): j for j, index in enumerate(positions)}
    variants_of = {task: [{task: k / steps} for k in range(steps + 1)] for task in tasks}

    def finish_unit(unit_modules: list[Submodule], scores: dict, unchanged: dict) -> None:
        array = np.full((len(tasks), len(unit_modules), len(positions)), np.nan)
        flags = np.zeros((len(tasks), len(unit_modules)), dtype=bool)
        for t, task in enumerate(tasks):
            for m, module in enumerate(unit_modules):
                array[t, m] = scores.get((task, module.name), np.full(len(positions), np.nan))
                flags[t, m] = unchanged.get((task, module.name), False)
        piece = xr.Dataset(
            {"nonlinearity_score": (("task", "module", "sample"), array), "unchanged": (("task", "module"), flags)},
            coords={"task": np.array(tasks, dtype=object), "sample": positions, **_module_coords(unit_modules)},
        )
        writer.add(piece, unit_modules[-1].name)

    by_layer = _by_layer(modules)
    paths_per_layer = max((len(_units(ms)) for ms in by_layer.values()), default=1)
    chunks = layer_chunks(experiment.arch.num_layers, _bytes_per_layer(experiment, paths_per_layer) * len(tasks),
                          capture_budget)
    with progress_bar(progress) as bar:
        job = bar.add_task("Non-linearity Score", total=len(modules))
        bar.advance(job, sum(1 for m in modules if m.name in done))
        for chunk in chunks:
            chunk_modules = [m for layer in chunk for m in by_layer.get(layer, []) if m.name not in done]
            if not chunk_modules:
                continue
            bar.update(job, description=f"Non-linearity Score · capturing layers {chunk[0]}–{chunk[-1]}")
            recorded = {task: record_inputs(experiment.base.model, experiment.arch, list(_units(chunk_modules)),
                                            experiment.batches[task], device=experiment.device) for task in tasks}
            for layer in chunk:
                layer_modules = [m for m in by_layer.get(layer, []) if m.name not in done]
                if not layer_modules:
                    continue
                scores, unchanged = {}, {}
                for path, served in _units(layer_modules).items():
                    for task in tasks:
                        bar.update(job, description=f"Non-linearity Score · {served[0].name} · {task}")
                        if not source.changed(path, task):
                            for module in served:
                                unchanged[(task, module.name)] = True
                            continue
                        heads = any(m.level == "head" for m in served)
                        outputs, o_inputs, o_weights = _replay_variants(
                            source, experiment.arch, path, recorded[task][path], variants_of[task], heads=heads)
                        for module in served:
                            values = np.full(len(positions), np.nan)
                            for position, trajectory in _trajectories(
                                outputs, recorded[task][path], sample_positions, head=module.head,
                                o_inputs=o_inputs, o_weights=o_weights, arch=experiment.arch,
                            ):
                                values[position] = nonlinearity_score(trajectory)
                            scores[(task, module.name)] = values
                        del outputs, o_inputs
                    source.clear()
                finish_unit(layer_modules, scores, unchanged)
                bar.advance(job, len(layer_modules))
            del recorded
        if "model" in levels and "model" not in done:
            scores, unchanged = {}, {}
            for task in tasks:
                bar.update(job, description=f"Non-linearity Score · model · {task}")
                outputs = model_outputs(source, experiment.arch, experiment.batches[task],
                                        variants_of[task], output=model_output)
                values = np.full(len(positions), np.nan)
                for b, batch in enumerate(experiment.batches[task]):
                    mask = batch.attention_mask.to(experiment.device).bool()
                    for i, index in enumerate(batch.sample_index):
                        rows = [outputs[k][b][i][mask[i]].reshape(-1).to(torch.float64) for k in range(steps + 1)]
                        values[sample_positions[index]] = nonlinearity_score(torch.stack(rows))
                scores[(task, "model")] = values
                del outputs
            finish_unit([m for m in modules if m.level == "model"], scores, unchanged)
            bar.advance(job)
    return writer.finish({"equation": "seed 002 Eq. 19", "summary": "mean ± std over modules and samples"},
                        result_attrs={"equation": "seed 002 Eq. 19", "steps": steps, "model_output": model_output,
                                      "features": "module output on one sequence, real tokens only, flattened"})


def summarize_nonlinearity(dataset: xr.Dataset):
    """Table 17 of seed 002: mean ± std of the score per level (rows) and task (columns)."""
    import pandas as pd

    rows = {}
    for level in dict.fromkeys(dataset.level.values.tolist()):
        selected = dataset.nonlinearity_score.where(dataset.level == level, drop=True)
        rows[level] = {str(task): mean_std(selected.sel(task=task).values.ravel()) for task in dataset.task.values}
    return pd.DataFrame.from_dict(rows, orient="index")


# ---------------------------------------------------------------- projection distance


def projection(
    experiment,
    *,
    levels: Sequence[str] = DEFAULT_LEVELS,
    alphas: Sequence[float] | None = None,
    store: Store | None = None,
    force: bool = False,
    progress: bool = True,
    capture_budget: int = DEFAULT_CAPTURE_BUDGET,
    command: str | None = None,
    on_unit: Callable[[str], None] | None = None,
) -> xr.Dataset:
    """Projection Distance (Eq. 8), cosine_merge (Eq. 16) and cosine_base (Eq. 17) per module.

    For every subset S of two or more fine-tunes and every α in its grid (seed 002
    Fig. 3 unless `alphas`), over x in the union of S's task data:
    Δ_merge = f(x; θ0 + Σ α_t τ_t) − f(x; θ0), Δ_lin = Σ α_t Δf_t(x).
    """
    tasks = experiment.tasks
    if len(tasks) < 2:
        raise ValueError("the Projection Distance needs at least two fine-tunes")
    if "head" in levels:
        raise ValueError("projection supports levels model, layer, attn, mlp (head outputs: use `diag linearity`)")
    source = experiment.parameter_source()
    subsets = [s for size in range(2, len(tasks) + 1) for s in itertools.combinations(tasks, size)]
    combos = [(subset, alpha) for subset in subsets for alpha in _projection_grid(len(subset), alphas)]
    combo_alpha = np.full((len(combos), len(tasks)), np.nan)
    for c, (subset, alpha) in enumerate(combos):
        for task, value in zip(subset, alpha):
            combo_alpha[c, tasks.index(task)] = value
    subset_names = ["+".join(s) for s in subsets]
    modules = _modules_for(experiment, levels)
    settings = {**experiment.settings, "levels": list(levels), "alphas": None if alphas is None else list(alphas)}
    writer = UnitWriter(store, "projection", settings, force=force, root=experiment.root_attrs(command),
                        attrs=experiment.group_attrs(command), on_unit=on_unit)
    done = writer.done

    def metrics_for(deltas_by_task, merged_by_combo):
        """deltas_by_task[input_task][t][b]: Δf_t on input task's batches; merged_by_combo[c][input_task][b]."""
        pd_values = np.full(len(combos), np.nan)
        cos_values = np.full(len(combos), np.nan)
        base_values = np.full(len(subsets), np.nan)
        for s, subset in enumerate(subsets):
            per_sample = []
            for input_task in subset:
                for b, rec_mask in enumerate(masks[input_task]):
                    for i in range(rec_mask.shape[0]):
                        per_sample.append([deltas_by_task[input_task][t][b][i][rec_mask[i]].reshape(-1)
                                           for t in subset])
            base_values[s] = cosine_base(per_sample)
        for c, (subset, alpha) in enumerate(combos):
            ratios, cosines = [], []
            for input_task in subset:
                for b, rec_mask in enumerate(masks[input_task]):
                    for i in range(rec_mask.shape[0]):
                        lin = sum(a * deltas_by_task[input_task][t][b][i][rec_mask[i]].reshape(-1).double()
                                  for t, a in zip(subset, alpha))
                        merged = merged_by_combo[c][input_task][b][i][rec_mask[i]].reshape(-1)
                        ratio, cosine = projection_terms(merged, lin)
                        ratios.append(ratio)
                        cosines.append(cosine)
            pd_values[c] = projection_distance(ratios)
            cos_values[c] = cosine_merge(cosines)
        return pd_values, cos_values, base_values

    masks = {task: [b.attention_mask.to(experiment.device).bool() for b in experiment.batches[task]] for task in tasks}

    def finish_unit(unit_modules, values):
        piece = xr.Dataset(
            {
                "projection_distance": (("module", "combo"), np.stack([values[m.name][0] for m in unit_modules])),
                "cosine_merge": (("module", "combo"), np.stack([values[m.name][1] for m in unit_modules])),
                "cosine_base": (("module", "subset"), np.stack([values[m.name][2] for m in unit_modules])),
            },
            coords={
                **_module_coords(unit_modules),
                "combo": np.arange(len(combos)),
                "task": np.array(tasks, dtype=object),
                "subset": np.array(subset_names, dtype=object),
                "combo_subset": ("combo", np.array(["+".join(s) for s, _ in combos], dtype=object)),
                "combo_alpha": (("combo", "task"), combo_alpha),
            },
        )
        writer.add(piece, unit_modules[-1].name)

    by_layer = _by_layer(modules)
    chunks = layer_chunks(experiment.arch.num_layers, _bytes_per_layer(experiment, 3) * len(tasks), capture_budget)
    with progress_bar(progress) as bar:
        job = bar.add_task("Projection Distance", total=len(modules))
        bar.advance(job, sum(1 for m in modules if m.name in done))
        for chunk in chunks:
            chunk_modules = [m for layer in chunk for m in by_layer.get(layer, []) if m.name not in done]
            if not chunk_modules:
                continue
            recorded = {task: record_inputs(experiment.base.model, experiment.arch, [m.path for m in chunk_modules],
                                            experiment.batches[task], device=experiment.device) for task in tasks}
            values = {}
            for module in chunk_modules:
                bar.update(job, description=f"Projection Distance · {module.name}")
                deltas_by_task, merged_by_combo, base_out = {}, [dict() for _ in combos], {}
                for input_task in tasks:
                    rec = recorded[input_task][module.path]
                    outs, _, _ = _replay_variants(source, experiment.arch, module.path, rec,
                                                  [{}] + [{t: 1.0} for t in tasks])
                    base_out[input_task] = outs[0]
                    deltas_by_task[input_task] = {t: [o - b for o, b in zip(outs[1 + j], outs[0])]
                                                  for j, t in enumerate(tasks)}
                for c, (subset, alpha) in enumerate(combos):
                    variant = dict(zip(subset, alpha))
                    for input_task in subset:
                        outs, _, _ = _replay_variants(source, experiment.arch, module.path,
                                                      recorded[input_task][module.path], [variant])
                        merged_by_combo[c][input_task] = [o - b for o, b in zip(outs[0], base_out[input_task])]
                values[module.name] = metrics_for(deltas_by_task, merged_by_combo)
                source.clear()
            del recorded
            _finish_chunk(chunk, by_layer, done, lambda ms: finish_unit(ms, values), bar, job)
        if "model" in levels and "model" not in done:
            bar.update(job, description="Projection Distance · model")
            variants = [{}] + [{t: 1.0} for t in tasks]
            deltas_by_task, merged_by_combo = {}, [dict() for _ in combos]
            for input_task in tasks:
                outs = model_outputs(source, experiment.arch, experiment.batches[input_task], variants)
                deltas_by_task[input_task] = {t: [o - b for o, b in zip(outs[1 + j], outs[0])]
                                              for j, t in enumerate(tasks)}
                wanted = [c for c, (subset, _) in enumerate(combos) if input_task in subset]
                for start in range(0, len(wanted), 8):
                    group = wanted[start:start + 8]
                    merged = model_outputs(source, experiment.arch, experiment.batches[input_task],
                                           [dict(zip(*combos[c])) for c in group])
                    for c, outs_c in zip(group, merged):
                        merged_by_combo[c][input_task] = [o - b for o, b in zip(outs_c, outs[0])]
                del outs
            finish_unit([m for m in modules if m.level == "model"],
                        {"model": metrics_for(deltas_by_task, merged_by_combo)})
            bar.advance(job)
    return writer.finish({"equations": "seed 002 Eq. 8 (PD), Eq. 16 (cosine_merge), Eq. 17 (cosine_base)",
                         "cosine_base": "mean over pairs t<t' (Eq. 17 prints 1/(T(T-1)) over t<t', half a mean)",
                         "data": "x ranges over the union of the subset's task data"})


# ---------------------------------------------------------------- closed-form α


def alpha(
    experiment,
    *,
    granularity: str = "layer",
    balance: bool = True,
    store: Store | None = None,
    force: bool = False,
    progress: bool = True,
    capture_budget: int = DEFAULT_CAPTURE_BUDGET,
    max_condition: float = 1e12,
    command: str | None = None,
    on_unit: Callable[[str], None] | None = None,
) -> xr.Dataset:
    """Closed-form merge coefficients α per submodule (seed 002 Eq. 12–14; balanced Eq. 33–34).

    For each module i, Δf_t(x) = f(x; θ0^i + τ_t^i) − f(x; θ0^i) on the inputs of
    every task; α = A⁻¹b in float64, least squares when A is singular or
    ill-conditioned (flagged, with the condition number). The Eq. 10 objective
    (true module outputs) is stored at the solved α and at uniform weights 1/T,
    and the linearised objective (Eq. 22 / 33) at both.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity '{granularity}' (choose from {list(GRANULARITIES)})")
    tasks = experiment.tasks
    source = experiment.parameter_source()
    levels = GRANULARITIES[granularity]
    modules = _modules_for(experiment, levels)
    group = f"alpha/{granularity}"
    settings = {**experiment.settings, "granularity": granularity, "balance": balance, "max_condition": max_condition}
    writer = UnitWriter(store, group, settings, force=force, root=experiment.root_attrs(command),
                        attrs=experiment.group_attrs(command), on_unit=on_unit)
    done = writer.done
    uniform = np.full(len(tasks), 1.0 / len(tasks))

    def solve(module_name, outputs_by_input):
        """outputs_by_input[a] = (masks, [outputs per variant: base, task_1..task_T])."""
        grams, finetuned_feats = [], []
        for input_task in tasks:
            masks, outs = outputs_by_input[input_task]
            per_sample, deltas = [], []
            for b, mask in enumerate(masks):
                for i in range(mask.shape[0]):
                    base = outs[0][b][i][mask[i]].reshape(-1).double()
                    d = [outs[1 + t][b][i][mask[i]].reshape(-1).double() - base for t in range(len(tasks))]
                    per_sample.append(task_gram(d).numpy())
                    deltas.append((base, d))
            grams.append(np.stack(per_sample))
            finetuned_feats.append(deltas)
        A, b = alpha_system(grams, balance=balance)
        solution = solve_alpha(A, b, max_condition=max_condition)
        return grams, solution, finetuned_feats

    def true_objective(weights, merged_outputs_by_input, finetuned_feats, grams):
        merged, tuned, denominators = [], [], []
        for a, input_task in enumerate(tasks):
            masks, outs = merged_outputs_by_input[input_task]
            m_list, t_list = [], []
            j = 0
            for b, mask in enumerate(masks):
                for i in range(mask.shape[0]):
                    base, d = finetuned_feats[a][j]
                    m_list.append(outs[b][i][mask[i]].reshape(-1).double())
                    t_list.append(base + d[a])
                    j += 1
            merged.append(m_list)
            tuned.append(t_list)
            denominators.append([balance_denominator(g) for g in grams[a]])
        return merge_objective(merged, tuned, denominators if balance else None)

    def finish_unit(unit_modules, results):
        piece = xr.Dataset(
            {
                "alpha": (("granularity", "module", "task"), np.stack([results[m.name]["alpha"] for m in unit_modules])[None]),
                "condition_number": (("granularity", "module"), np.array([[results[m.name]["cond"] for m in unit_modules]])),
                "least_squares": (("granularity", "module"), np.array([[results[m.name]["lstsq"] for m in unit_modules]])),
                "objective_alpha": (("granularity", "module"), np.array([[results[m.name]["obj_alpha"] for m in unit_modules]])),
                "objective_uniform": (("granularity", "module"), np.array([[results[m.name]["obj_uniform"] for m in unit_modules]])),
                "linearized_objective_alpha": (("granularity", "module"),
                                               np.array([[results[m.name]["lin_alpha"] for m in unit_modules]])),
                "linearized_objective_uniform": (("granularity", "module"),
                                                 np.array([[results[m.name]["lin_uniform"] for m in unit_modules]])),
            },
            coords={"granularity": np.array([granularity], dtype=object), "task": np.array(tasks, dtype=object),
                    **_module_coords(unit_modules)},
        )
        writer.add(piece, unit_modules[-1].name)

    def record_result(module, grams, solution, obj_alpha, obj_uniform):
        return {"alpha": solution.alpha, "cond": solution.condition_number, "lstsq": solution.used_least_squares,
                "obj_alpha": obj_alpha, "obj_uniform": obj_uniform,
                "lin_alpha": linearized_objective(solution.alpha, grams, balance),
                "lin_uniform": linearized_objective(uniform, grams, balance)}

    by_layer = _by_layer(modules)
    chunks = layer_chunks(experiment.arch.num_layers, _bytes_per_layer(experiment, 2) * len(tasks), capture_budget)
    variants = [{}] + [{t: 1.0} for t in tasks]
    with progress_bar(progress) as bar:
        job = bar.add_task(f"Closed-form α ({granularity})", total=len(modules))
        bar.advance(job, sum(1 for m in modules if m.name in done))
        for chunk in chunks:
            chunk_modules = [m for layer in chunk for m in by_layer.get(layer, []) if m.name not in done]
            if not chunk_modules:
                continue
            units = _units(chunk_modules)
            recorded = {task: record_inputs(experiment.base.model, experiment.arch, list(units),
                                            experiment.batches[task], device=experiment.device) for task in tasks}
            results = {}
            for path, served in units.items():
                bar.update(job, description=f"Closed-form α · {served[0].name}")
                heads = any(m.level == "head" for m in served)
                replays = {task: _replay_variants(source, experiment.arch, path, recorded[task][path], variants,
                                                  heads=heads) for task in tasks}
                masks = {task: [r.token_mask for r in recorded[task][path]] for task in tasks}
                for module in served:
                    if module.level == "head":
                        outputs_by_input = {}
                        for task in tasks:
                            _, x, w = replays[task]
                            outputs_by_input[task] = (masks[task], [
                                [head_output(x[v][b], w[v], experiment.arch, module.head) for b in range(len(x[v]))]
                                for v in range(len(variants))])
                        grams, solution, _ = solve(module.name, outputs_by_input)
                        results[module.name] = record_result(module, grams, solution, math.nan, math.nan)
                        continue
                    outputs_by_input = {task: (masks[task], replays[task][0]) for task in tasks}
                    grams, solution, feats = solve(module.name, outputs_by_input)
                    objectives = []
                    for weights in (solution.alpha, uniform):
                        merged_by_input = {}
                        for task in tasks:
                            outs, _, _ = _replay_variants(source, experiment.arch, path, recorded[task][path],
                                                          [dict(zip(tasks, map(float, weights)))])
                            merged_by_input[task] = (masks[task], outs[0])
                        objectives.append(true_objective(weights, merged_by_input, feats, grams))
                    results[module.name] = record_result(module, grams, solution, *objectives)
                del replays
                source.clear()
            del recorded
            _finish_chunk(chunk, by_layer, done, lambda ms: finish_unit(ms, results), bar, job)
        if "model" in levels and "model" not in done:
            bar.update(job, description="Closed-form α · model")
            outputs_by_input, batches_masks = {}, {}
            for task in tasks:
                masks = [b.attention_mask.to(experiment.device).bool() for b in experiment.batches[task]]
                outs = model_outputs(source, experiment.arch, experiment.batches[task], variants)
                outputs_by_input[task] = (masks, outs)
                batches_masks[task] = masks
            grams, solution, feats = solve("model", outputs_by_input)
            objectives = []
            for weights in (solution.alpha, uniform):
                merged_by_input = {}
                for task in tasks:
                    outs = model_outputs(source, experiment.arch, experiment.batches[task],
                                         [dict(zip(tasks, map(float, weights)))])
                    merged_by_input[task] = (batches_masks[task], outs[0])
                objectives.append(true_objective(weights, merged_by_input, feats, grams))
            finish_unit([m for m in modules if m.level == "model"],
                        {"model": record_result(None, grams, solution, *objectives)})
            bar.advance(job)
    notes = {"equations": "seed 002 Eq. 12-14 (α = A⁻¹b), balanced Eq. 33-34" if balance else "seed 002 Eq. 12-14",
             "b_vector": "b_j = Σ_a B_aja (seed 002 Eq. 13)",
             "objective": "Eq. 10 on replayed module outputs (balanced by Eq. 33's denominator when balance)",
             "uniform": "α_t = 1/T", "head_objective": "NaN: heads are solved on their own outputs only",
             "gqa": "a k/v group shared by heads gets the mean α of its heads when merging (exact for plain MHA)"}
    return writer.finish(notes)

"""The pure equations of the linearity diagnostics (no model, no store).

The equations of seed 002 (Dai et al., *Leveraging submodule linearity
enhances task arithmetic performance in LLMs*) take feature vectors that
were already computed (a module's output on one sequence, real tokens only,
flattened to 1-D) and return numbers. All arithmetic is in
float64. Different samples may have different lengths; vectors compared within
one sample must have the same length.

Equation map (seed 002):
- Non-linearity Score: Eq. 19 (discrete form, App. A.2) of Eq. 4.
- Projection Distance: Eq. 8; per-sample cosine_merge: Eq. 7 (= Eq. 15);
  its mean: Eq. 16; cosine_base: Eq. 17 (mean over pairs, see docs/ARCHITECTURE.md).
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


def _as_float64_vector(vector: torch.Tensor, name: str) -> torch.Tensor:
    """Return ``vector`` flattened to 1-D float64; raise on a non-tensor."""
    if not isinstance(vector, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(vector).__name__}")
    return vector.detach().reshape(-1).to(torch.float64)


def _pairwise_distances(rows: torch.Tensor) -> torch.Tensor:
    """Euclidean distances between the rows of a (..., R, D) float64 tensor, from the Gram matrix of the rows
    centred on the first one: c_i = r_i − r_0, ‖r_i − r_j‖² = G_ii + G_jj − 2 G_ij with G = c cᵀ.

    Centring removes what the rows share (a module's output is large beside its change along a line), so the
    expansion loses only about ε₆₄ · (spread / distance)² relative: for the N + 1 points of a line, whose spread is
    at most about N times their smallest distance, 1e-14 at N = 10 (``tests/test_linearity_math.py`` checks it
    against differences). One matrix product instead of R(R − 1)/2 difference passes: 2–3× faster than
    ``torch.cdist``'s difference-based path on the CPU. Its sums depend on the thread count, as every product's
    does: the engines fix it (`submerge.diagnostics.execution`).
    """
    centred = rows - rows[..., :1, :]
    return _distances_from_gram(centred @ centred.transpose(-1, -2))


def _distances_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """‖c_i − c_j‖ from the (..., R, R) Gram matrix G = c cᵀ of rows c (`_pairwise_distances`)."""
    squares = gram.diagonal(dim1=-2, dim2=-1)
    return (squares[..., :, None] + squares[..., None, :] - 2 * gram).clamp_min_(0).sqrt_()


def _nonlinearity_from_distances(distances: torch.Tensor) -> torch.Tensor:
    """Eq. 19 of seed 002 given the (..., N+1, N+1) distance matrices."""
    steps = distances.shape[-1] - 1
    index = torch.arange(steps + 1, dtype=torch.float64, device=distances.device)
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
        return _nonlinearity_from_distances(_pairwise_distances(rows)).cpu().numpy()
    return np.array([nonlinearity_score(trajectory) for trajectory in trajectories], dtype=np.float64)


# The float64 buffer of `nonlinearity_scores_of_points`, a few sequences at a time. Below glibc's largest mmap
# threshold (32 MiB), so that the buffer comes back from the heap at the next call instead of being mapped and
# faulted in anew (8 sequences × 128 tokens × 576 features at 11 points: 41 ms a call at 64 MiB, 27 ms at 16 MiB).
POINTS_CHUNK_BYTES = 16 * 2**20


def nonlinearity_scores_of_points(points: Sequence[torch.Tensor], token_mask: torch.Tensor | None = None) -> np.ndarray:
    """Non-linearity Score (seed 002 Eq. 19) of every sequence of one batch, from the batch's outputs at each point.

    ``points[k]`` is the (B, T, ...) output at point k (k = 0: the base, k = N: the fine-tune) and ``token_mask``
    (B, T) marks the real tokens (None: all are). Sequence i's score is `nonlinearity_score` of the (N+1, D_i)
    trajectory of its real tokens flattened, to float64 rounding: the points are converted to float64, centred on
    the first and the padded positions set to zero, so that they add nothing to each sequence's Gram matrix, which
    one batched product gives for every sequence at once (instead of one trajectory, one copy and one product per
    sequence). A few sequences at a time, so that the float64 buffer stays within `POINTS_CHUNK_BYTES`. Returns a
    float64 array of B scores (NaN where a sequence's endpoints coincide or its real features are not finite)."""
    if len(points) < 2:
        raise ValueError(f"points needs at least 2 outputs (N >= 1), got {len(points)}")
    first = points[0]
    if any(p.shape != first.shape for p in points):
        raise ValueError(f"every point's output must have one shape, got {sorted({tuple(p.shape) for p in points})}")
    batch, seq = first.shape[0], first.shape[1] if first.ndim > 1 else 1
    if token_mask is not None and tuple(token_mask.shape) != (batch, seq):
        raise ValueError(f"token_mask must be (batch, seq) = {(batch, seq)}, got {tuple(token_mask.shape)}")
    per_sequence = len(points) * max(1, first[0].numel()) * 8
    step = max(1, POINTS_CHUNK_BYTES // per_sequence)
    scores = []
    for lo in range(0, batch, step):
        hi = min(batch, lo + step)
        rows = torch.empty((hi - lo, len(points), *first.shape[1:]), dtype=torch.float64, device=first.device)
        for k, point in enumerate(points):
            rows[:, k].copy_(point[lo:hi].detach())
        rows = rows.reshape(hi - lo, len(points), seq, -1)
        rows[:, 1:] -= rows[:, :1]
        rows[:, 0] = 0.0
        if token_mask is not None and not bool(token_mask[lo:hi].all()):  # only the padded positions written
            rows.transpose(1, 2)[~token_mask[lo:hi].to(rows.device)] = 0.0
        centred = rows.reshape(hi - lo, len(points), -1)
        gram = centred @ centred.transpose(-1, -2)
        scores.append(_nonlinearity_from_distances(_distances_from_gram(gram)))
    return torch.cat(scores).cpu().numpy()


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


def projection_terms_of_batch(delta_merge: torch.Tensor, delta_lin: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """`projection_terms` of every row at once: ``delta_merge`` and ``delta_lin`` are (S, ...) tensors whose row s
    is sample s's Δ_merge and Δ_lin (flattened; positions that are not the sample's, such as padding, set to zero
    in both, so that they add nothing). Returns float64 arrays (ratios, cosines) of S values, as `projection_terms`
    gives them to float64 rounding (the sums are the same products, reduced in another order)."""
    if delta_merge.shape != delta_lin.shape or delta_merge.ndim < 1:
        raise ValueError(f"delta_merge {tuple(delta_merge.shape)} and delta_lin {tuple(delta_lin.shape)} must be "
                         "(samples, ...) of one shape")
    merge = delta_merge.detach().reshape(delta_merge.shape[0], -1).to(torch.float64)
    linear = delta_lin.detach().reshape(delta_lin.shape[0], -1).to(torch.float64)
    inner = torch.linalg.vecdot(merge, linear)
    linear_norm = torch.linalg.vector_norm(linear, dim=1)
    merge_norm = torch.linalg.vector_norm(merge, dim=1)
    nan = torch.full_like(inner, math.nan)
    ratio = torch.where(linear_norm > 0, inner / linear_norm**2, nan)
    cosine = torch.where((merge_norm > 0) & (linear_norm > 0), inner / (merge_norm * linear_norm), nan)
    return ratio.cpu().numpy(), cosine.cpu().numpy()


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
    which is half a mean; we take the plain mean over the T(T−1)/2
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
    """cosine_base^E, seed 002 Eq. 17 (mean over task pairs, see docs/ARCHITECTURE.md).

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
    task a). An earlier design note wrote b_j = Σ_a B_ajj, which is not the
    stationarity condition of Eq. 11/33; this follows the paper (docs/ARCHITECTURE.md).
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
    """Mean and (population, ddof=0) standard deviation, ignoring NaN; (NaN, NaN) if all NaN or empty.

    The "mean ± std" summary of seed 002 Table 17 (over samples and modules of a level).
    """
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    finite = array[~np.isnan(array)]
    if finite.size == 0:
        return math.nan, math.nan
    return float(finite.mean()), float(finite.std())

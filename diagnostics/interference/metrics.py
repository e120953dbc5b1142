"""Weight-space interference metrics: the pure equations (no data, no checkpoints, no store).

For one 2-D weight matrix of a base model W_0 and T fine-tunes W_1..W_T the
task matrices are Δ_t = W_t − W_0 (docs/ARCHITECTURE.md, "Choices the papers leave open").
This module measures, per matrix:

- per task: ‖Δ_t‖_F, the effective rank (Roy & Vetterli 2007);
- per pair: cosine of the flattened matrices, sign-conflict rate;
- STI, Singular Task Interference (TSV-M; survey seed 003 eq.
  "singular task interference", Sec. "Task Singular Vectors Merging");
- SAR, Subspace Alignment Ratio (Iso-C; seed 003 Sec. "Isotropic Model
  Merging" and App. 13.1 for the k_M rule);
- I(k), Row Space Interference, and R(k), Reconstruction Error (CART; seed 003
  Sec. "Centered Arithmetic with Rank-reduced Task Vectors" and App. 14), on
  plain Δ_t and on centred Δ̄_t = W_t − mean_s W_s.

SVD.  Two routes give the same figures.  The default (``exact_svd=False``,
:mod:`submerge.diagnostics.interference.gram`) takes each matrix's singular
values and vectors from the eigendecomposition of its r × r Gram matrix, r =
min(m, n), built from the T(T+1)/2 cross-Gram products of the task matrices;
STI, SAR, I(k) and R(k) stay within 1e-4 (relative) of the exact route, as that
module states and the tests check.  ``exact_svd=True`` is the reference: every
decomposition a full thin SVD, ``torch.linalg.svd(x, full_matrices=False)``
(:func:`submerge.diagnostics.spectral.thin_svd`, shared with the SVD merges of
``submerge.merge.strategies``), with the Gram matrices of I(k), STI's UᵀU and
VᵀV and SAR's projections in float64.  Both compute in ``svd_dtype`` (float32
or float64) on the device the tensors live on — CUDA when the caller put them
there; the streaming driver (``submerge.diagnostics.interference.driver``)
moves them to CUDA when ``device="auto"`` finds one.  Metric arithmetic after
the decompositions (sums of squares, entropies, norms) is float64, and results
are Python floats or float64 numpy arrays.

What each metric needs of the spectrum.  The effective rank needs every
singular value; R(k) the tail Σ_{i>k} σ_i²; STI the top k = ⌊min(m, n)/T⌋
triplets of each Δ_t (a third of them for T = 3); I(k) the top k right vectors
at every k of the grid (64 % of them at the default fraction 0.64; k = r needs
none: it is ‖Δ_iΔ_jᵀ‖_F); SAR the top k_M left vectors of Δ_M, most of them for
a flat spectrum.  So each of the 2T + 1 matrices needs most of its
decomposition, and a truncated or randomised SVD (``torch.svd_lowrank``) would
not save work — a randomised one would also need a spectral gap that the flat
spectra of full fine-tunes do not have.  Only the standalone
:func:`effective_rank` takes singular values alone (``svdvals``).

Zero updates.  A matrix that a fine-tune did not change (common with LoRA)
gives Δ_t = 0.  Quantities that are ratios of zero (effective rank, cosine,
normalised STI, SAR with ‖Δ_t‖ = 0, I(k) when a task's top-k energy is 0) are
NaN, never an exception; STI, R(k), norms and sign-conflict rates stay finite.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from submerge.diagnostics.interference.gram import (
    CrossGrams,
    GramSpectrum,
    gram_spectrum,
    resolves_sti,
    row_space_curves,
    sar_projections,
    sti_from_spectra,
)
from submerge.diagnostics.spectral import Svd, concat_top, numerical_rank, thin_svd
from submerge.diagnostics.spectral import svd_dtype as _svd_dtype

__all__ = [
    "DEFAULT_RANK_FRACS",
    "SAR_EPS",
    "centered",
    "centered_one",
    "cosine_similarity",
    "effective_rank",
    "effective_rank_cutoff",
    "effective_rank_from_singular_values",
    "matrix_interference",
    "rank_from_fraction",
    "reconstruction_error",
    "row_space_interference",
    "sar",
    "sign_conflict_rate",
    "sti",
    "sti_rank",
    "task_matrix_interference",
    "task_vector_norm",
]

DEFAULT_RANK_FRACS: tuple[float, ...] = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0)
SAR_EPS = 0.05  # Iso-C's ε for the k_M rule (seed 003, Sec. Iso-C)

_CHUNK = 1 << 20  # elements per chunk for float64 reductions over big matrices (8 MiB)


# --------------------------------------------------------------------------- helpers


def _check_matrix(matrix: torch.Tensor, name: str) -> None:
    if not isinstance(matrix, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(matrix).__name__}")
    if matrix.ndim != 2:
        raise ValueError(f"{name} must be a 2-D matrix, got shape {tuple(matrix.shape)}")


def _check_same_shape(matrices: Sequence[torch.Tensor], name: str) -> None:
    if len(matrices) == 0:
        raise ValueError(f"{name} is empty: need at least one task matrix")
    for index, matrix in enumerate(matrices):
        _check_matrix(matrix, f"{name}[{index}]")
    shapes = {tuple(m.shape) for m in matrices}
    if len(shapes) != 1:
        raise ValueError(f"{name} must all have one shape, got {[tuple(m.shape) for m in matrices]}")


def _flat_chunks(a: torch.Tensor, b: torch.Tensor):
    """Yield matching float64 chunks of the flattened a and b (bounded extra memory)."""
    a_flat, b_flat = a.reshape(-1), b.reshape(-1)
    for start in range(0, a_flat.numel(), _CHUNK):
        yield (a_flat[start : start + _CHUNK].to(torch.float64), b_flat[start : start + _CHUNK].to(torch.float64))


def _sum_squares64(a: torch.Tensor) -> float:
    flat = a.reshape(-1)
    total = 0.0
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start : start + _CHUNK].to(torch.float64)
        total += float(torch.dot(chunk, chunk))
    return total


def _as_singular_values(singular_values) -> torch.Tensor:
    values = torch.as_tensor(singular_values).detach().to("cpu", torch.float64).reshape(-1)
    if bool((values < 0).any()):
        raise ValueError(f"singular_values must be non-negative, got {values.tolist()}")
    return torch.sort(values, descending=True).values


# --------------------------------------------------------------------- per task / pair


def task_vector_norm(task_matrix: torch.Tensor) -> float:
    """Frobenius norm ‖Δ_t‖_F of a task matrix (any shape; float64 accumulation)."""
    return math.sqrt(_sum_squares64(task_matrix))


def effective_rank_from_singular_values(singular_values) -> float:
    """Effective rank of a spectrum (Roy & Vetterli 2007, Eq. 1-2).

    erank = exp(H(p)), H(p) = −Σ_i p_i log p_i, p_i = σ_i / Σ_j σ_j — the
    exponential of the Shannon entropy of the singular values normalised to sum
    to one (0 log 0 = 0).  It is 1 for a rank-one matrix and n for n equal
    singular values.  NaN for an all-zero spectrum.
    """
    values = _as_singular_values(singular_values)
    total = float(values.sum())
    if total == 0.0:
        return float("nan")
    p = values[values > 0] / total
    return math.exp(float(-(p * torch.log(p)).sum()))


def effective_rank(matrix: torch.Tensor, *, svd_dtype: str = "float32") -> float:
    """Effective rank of a matrix (Roy & Vetterli 2007): exp of the Shannon entropy
    of its singular values normalised to sum to one.  See
    :func:`effective_rank_from_singular_values`."""
    _check_matrix(matrix, "matrix")
    return effective_rank_from_singular_values(torch.linalg.svdvals(matrix.to(_svd_dtype(svd_dtype))))


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """cos(a, b) = ⟨a, b⟩ / (‖a‖ ‖b‖) of the flattened tensors, in float64.

    NaN when either tensor is all zero.
    """
    if a.shape != b.shape:
        raise ValueError(f"cosine_similarity: shapes differ, a {tuple(a.shape)} vs b {tuple(b.shape)}")
    dot = norm_a = norm_b = 0.0
    for chunk_a, chunk_b in _flat_chunks(a, b):
        dot += float(torch.dot(chunk_a, chunk_b))
        norm_a += float(torch.dot(chunk_a, chunk_a))
        norm_b += float(torch.dot(chunk_b, chunk_b))
    if norm_a == 0.0 or norm_b == 0.0:
        return float("nan")
    return dot / math.sqrt(norm_a * norm_b)


def sign_conflict_rate(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of entries where a and b are both non-zero with opposite signs.

    rate = #{i : a_i · b_i < 0} / N, with N = the number of entries of the
    tensor (ALL entries, zeros included, not only the entries where both are
    non-zero).  0.0 for an empty tensor.
    """
    if a.shape != b.shape:
        raise ValueError(f"sign_conflict_rate: shapes differ, a {tuple(a.shape)} vs b {tuple(b.shape)}")
    count = a.numel()
    if count == 0:
        return 0.0
    a_flat, b_flat = a.reshape(-1), b.reshape(-1)
    conflicts = 0
    for start in range(0, count, _CHUNK):
        sign_a = torch.sign(a_flat[start : start + _CHUNK])
        sign_b = torch.sign(b_flat[start : start + _CHUNK])
        conflicts += int((sign_a * sign_b < 0).sum())
    return conflicts / count


# ------------------------------------------------------------------------------- STI


def sti_rank(shape: tuple[int, int], num_tasks: int) -> int:
    """TSV-M's per-task rank k = max(1, ⌊min(m, n) / T⌋) (docs/ARCHITECTURE.md, STI)."""
    if num_tasks < 1:
        raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
    return max(1, min(shape) // num_tasks)


def _sti_from_svds(svds: Sequence[Svd], shape: tuple[int, int], svd_dtype: torch.dtype) -> tuple[float, float, int]:
    k = sti_rank(shape, len(svds))
    # Directions with σ = 0 have arbitrary singular vectors (any orthonormal
    # completion); they would make STI depend on LAPACK's choice through the
    # off-diagonal blocks, so a task keeps min(k, numerical rank) directions.
    kept = concat_top(svds, [min(k, numerical_rank(svd.S, shape, svd_dtype)) for svd in svds])
    if kept.S.numel() == 0:
        return 0.0, float("nan"), k
    U = kept.U.to(torch.float64)
    V = kept.Vh.to(torch.float64).T
    sigma = kept.S.to(U.device)
    identity = torch.eye(U.shape[1], dtype=torch.float64, device=U.device)
    left = U.T @ U - identity
    right = V.T @ V - identity
    interference = (left * sigma[None, :]) @ right  # (UᵀU − I) Σ (VᵀV − I)
    value = float(interference.abs().sum())
    sigma_sum = float(sigma.sum())
    return value, value / sigma_sum, k


def sti(task_matrices: Sequence[torch.Tensor], *, svd_dtype: str = "float32") -> tuple[float, float, int]:
    """Singular Task Interference (TSV-M; seed 003 eq. "singular task interference").

    Each Δ_t is truncated to its top k = max(1, ⌊min(m,n)/T⌋) singular triplets,
    U = [U_1 … U_T], V = [V_1 … V_T] (singular vectors as columns),
    Σ = blockdiag(Σ_1 … Σ_T), and

        STI = ‖(UᵀU − I) Σ (VᵀV − I)‖₁   (entrywise: sum of |entries|).

    Returns ``(sti, sti_normalized, k)`` with sti_normalized = STI / Σσ, the sum
    of all kept singular values, so matrices of different scale compare.  A
    task whose numerical rank is below k keeps only its non-zero directions
    (σ = 0 directions are not unique).  STI = 0 and normalised = NaN when every
    Δ_t is zero.
    """
    _check_same_shape(task_matrices, "task_matrices")
    dtype = _svd_dtype(svd_dtype)
    shape = tuple(task_matrices[0].shape)
    return _sti_from_svds([thin_svd(m, dtype) for m in task_matrices], shape, dtype)


# ------------------------------------------------------------------------------- SAR


def effective_rank_cutoff(singular_values, eps: float = SAR_EPS) -> int:
    """Iso-C's k_M (seed 003, App. 13.1):

        k_M = min{k : Σ_{i>k} σ_i² ≤ ε² Σ_i σ_i²},  k ∈ {0, …, r},

    the fewest top singular directions whose rank-k approximation has relative
    Frobenius error ≤ ε.  0 only for an all-zero spectrum.  Singular values are
    sorted descending first.
    """
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    values = _as_singular_values(singular_values)
    energy = values**2
    total = float(energy.sum())
    # tail[k] = Σ_{i>k} σ_i² for k = 0..r
    tail = torch.cat([torch.flip(torch.cumsum(torch.flip(energy, [0]), 0), [0]), energy.new_zeros(1)])
    ok = torch.nonzero(tail <= eps**2 * total)
    return int(ok[0])


def _sar_from_basis(task_matrix: torch.Tensor, merged_basis: torch.Tensor) -> float:
    # ‖U_k U_kᵀ Δ_t‖_F = ‖U_kᵀ Δ_t‖_F because U_k has orthonormal columns.
    norm_squared = _sum_squares64(task_matrix)
    if norm_squared == 0.0:
        return float("nan")
    basis = merged_basis.to(torch.float64)
    columns_per_block = max(1, _CHUNK // max(1, task_matrix.shape[0]))
    projected = 0.0
    for start in range(0, task_matrix.shape[1], columns_per_block):
        block = task_matrix[:, start : start + columns_per_block].to(device=basis.device, dtype=torch.float64)
        projected += float(((basis.T @ block) ** 2).sum())
    return min(1.0, math.sqrt(projected / norm_squared))


def sar(
    task_matrix: torch.Tensor, merged_matrix: torch.Tensor, eps: float = SAR_EPS, *, svd_dtype: str = "float32"
) -> tuple[float, int]:
    """Subspace Alignment Ratio (Iso-C; seed 003, Sec. Iso-C):

        SAR(Δ_t, Δ_M; k_M) = ‖U_{k_M} U_{k_M}ᵀ Δ_t‖_F / ‖Δ_t‖_F,

    U_{k_M} the top k_M left singular vectors of the merged task matrix Δ_M and
    k_M from :func:`effective_rank_cutoff` (ε = 0.05).  Returns ``(sar, k_M)``;
    SAR ∈ [0, 1], NaN when Δ_t = 0, 0 when Δ_M = 0 (k_M = 0).
    """
    _check_matrix(task_matrix, "task_matrix")
    _check_matrix(merged_matrix, "merged_matrix")
    if task_matrix.shape != merged_matrix.shape:
        raise ValueError(
            f"sar: task_matrix {tuple(task_matrix.shape)} and merged_matrix {tuple(merged_matrix.shape)} differ in shape"
        )
    merged_svd = thin_svd(merged_matrix, svd_dtype)
    k_merged = effective_rank_cutoff(merged_svd.S, eps)
    return _sar_from_basis(task_matrix, merged_svd.U[:, :k_merged]), k_merged


# ---------------------------------------------------------------------- CART I(k), R(k)


def rank_from_fraction(rank_frac: float, min_dim: int) -> int:
    """k = max(1, round(frac · min(m, n))), rounding half up (⌊x + ½⌋), capped at min(m, n)."""
    if not 0 < rank_frac <= 1:
        raise ValueError(f"rank fraction must be in (0, 1], got {rank_frac}")
    return min(min_dim, max(1, math.floor(rank_frac * min_dim + 0.5)))


def centered(task_weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """CART's centred task matrices Δ̄_t = W_t − (1/T) Σ_s W_s (seed 003, Sec. CART).

    Translation invariant: passing the task matrices Δ_t = W_t − W_0 instead of
    the weights gives the same result.  The mean is taken in float64; results
    come back in the inputs' dtype promoted to at least float32.  Row block by row
    block (about ``_CHUNK`` entries each), so the float64 mean and differences never
    take more than a block's memory beside the results (a vocabulary-sized matrix's
    float64 copies are 1.6 GB each at Llama-2-7B's 32,000 × 4,096); every entry is
    the same arithmetic as on the whole matrix, so the results are bitwise those.
    One at a time: `centered_one`.
    """
    _check_same_shape(task_weights, "task_weights")
    first = task_weights[0]
    results = [_centered_output(first) for _ in task_weights]
    for rows in _row_blocks(first):
        mean = _block_mean(task_weights, rows)
        for result, weight in zip(results, task_weights):
            result[rows] = weight[rows].to(torch.float64) - mean
    return results


def centered_one(task_weights: Sequence[torch.Tensor], index: int) -> torch.Tensor:
    """Δ̄_index of `centered`, bitwise, alone: the float64 mean of each row block is formed again for it (T
    conversions per block), so a caller that needs the T centred matrices one after another holds one (a 7B
    embedding's is 0.8 GB in float32), not T."""
    result = _centered_output(task_weights[0])
    for rows in _row_blocks(task_weights[0]):
        result[rows] = task_weights[index][rows].to(torch.float64) - _block_mean(task_weights, rows)
    return result


def _centered_output(first: torch.Tensor) -> torch.Tensor:
    return torch.empty(first.shape, dtype=torch.promote_types(first.dtype, torch.float32), device=first.device)


def _row_blocks(matrix: torch.Tensor):
    """Row slices of about ``_CHUNK`` entries each (whole rows)."""
    rows_per_block = max(1, _CHUNK // max(1, matrix.shape[1]))
    for start in range(0, matrix.shape[0], rows_per_block):
        yield slice(start, start + rows_per_block)


def _block_mean(task_weights: Sequence[torch.Tensor], rows: slice) -> torch.Tensor:
    """(1/T) Σ_t W_t[rows] in float64, summed in task order."""
    mean = torch.zeros(task_weights[0][rows].shape, dtype=torch.float64, device=task_weights[0].device)
    for weight in task_weights:
        mean += weight[rows].to(torch.float64)
    mean /= len(task_weights)
    return mean


def _row_space_interference_curve(svds: Sequence[Svd], ranks: Sequence[int]) -> list[float]:
    """I(k) for every k in ``ranks`` from one Gram matrix Ṽ_iᵀṼ_j per task pair (float64).

    With σ̃ the top-k singular values of a task divided by their root energy,
    Σ̃_i Ṽ_iᵀ Ṽ_j Σ̃_j is the leading k×k block of Ṽ_iᵀṼ_j scaled by σ̃_i on
    the rows and σ̃_j on the columns; its (j, i) counterpart is the transpose,
    with the same Frobenius norm.  NaN at a k where some task's top-k energy is 0.
    """
    if len(ranks) == 0:
        return []
    k_max = max(ranks)
    device = svds[0].Vh.device
    rows = [svd.Vh[:k_max, :].to(torch.float64) for svd in svds]
    spectra = [svd.S[:k_max].to(device) for svd in svds]
    grams = {(i, j): rows[i] @ rows[j].T for i in range(len(svds)) for j in range(i + 1, len(svds))}
    del rows
    curve = []
    for k in ranks:
        energies = [float((spectrum[:k] ** 2).sum()) for spectrum in spectra]
        if any(energy == 0.0 for energy in energies):
            curve.append(float("nan"))
            continue
        tilde = [spectrum[:k] / math.sqrt(energy) for spectrum, energy in zip(spectra, energies)]
        total = 0.0
        for (i, j), gram in grams.items():
            block = tilde[i][:, None] * gram[:k, :k] * tilde[j][None, :]
            total += 2.0 * float(torch.linalg.matrix_norm(block))
        curve.append(total)
    return curve


def _reconstruction_error_from_svds(svds: Sequence[Svd], k: int) -> float:
    return float(sum(float((svd.S[k:] ** 2).sum()) for svd in svds))


def _check_rank(k: int, shape: tuple[int, ...]) -> None:
    if not 1 <= k <= min(shape):
        raise ValueError(f"rank k must be in [1, min(m, n) = {min(shape)}] for matrices of shape {shape}, got {k}")


def row_space_interference(task_matrices: Sequence[torch.Tensor], k: int, *, svd_dtype: str = "float32") -> float:
    """CART's Row Space Interference (seed 003, Sec. CART and App. 14):

        I(k) = Σ_{i≠j} ‖Σ̃_i Ṽ_iᵀ Ṽ_j Σ̃_j‖_F   (the k×k form, docs/ARCHITECTURE.md),

    Ṽ_t ∈ ℝ^{n×k} the top-k right singular vectors of Δ_t, Σ̃_t = diag(σ̃_{t,i}),
    σ̃_{t,i} = σ_{t,i} / √(Σ_{i≤k} σ_{t,i}²).  Pass :func:`centered` matrices for
    CART's centred variant.  NaN when some task's top-k energy is zero.
    """
    _check_same_shape(task_matrices, "task_matrices")
    _check_rank(k, tuple(task_matrices[0].shape))
    return _row_space_interference_curve([thin_svd(m, svd_dtype) for m in task_matrices], [k])[0]


def reconstruction_error(task_matrices: Sequence[torch.Tensor], k: int, *, svd_dtype: str = "float32") -> float:
    """CART's Reconstruction Error (seed 003, Sec. CART and App. 14):

        R(k) = Σ_t ‖Δ_t − SVD_k(Δ_t)‖_F² = Σ_t Σ_{i>k} σ_{t,i}²   (Eckart–Young),

    0 at full rank.  Pass :func:`centered` matrices for CART's centred variant.
    """
    _check_same_shape(task_matrices, "task_matrices")
    _check_rank(k, tuple(task_matrices[0].shape))
    return _reconstruction_error_from_svds([thin_svd(m, svd_dtype) for m in task_matrices], k)


# ------------------------------------------------------------------------ everything


def matrix_interference(base: torch.Tensor, finetuned: Sequence[torch.Tensor],
                        rank_fracs: Sequence[float] = DEFAULT_RANK_FRACS, merged: torch.Tensor | None = None, *,
                        eps: float = SAR_EPS, svd_dtype: str = "float32", exact_svd: bool = False) -> dict:
    """Every weight-space interference metric of one matrix, each SVD done once.

    ``base`` is W_0, ``finetuned`` the T fine-tuned W_t (any float dtype, one
    device); ``merged`` is the merged *task* matrix Δ_M for SAR (default: task
    arithmetic Σ_t Δ_t).  The task matrices Δ_t = W_t − W_0 are formed in
    ``svd_dtype`` and passed to :func:`task_matrix_interference` (with
    ``exact_svd``), which documents the returned dict.
    """
    _check_matrix(base, "base")
    if len(finetuned) == 0:
        raise ValueError("finetuned is empty: need at least one fine-tuned matrix")
    for index, weight in enumerate(finetuned):
        _check_matrix(weight, f"finetuned[{index}]")
        if weight.shape != base.shape:
            raise ValueError(f"finetuned[{index}] has shape {tuple(weight.shape)}, base has {tuple(base.shape)}")
    dtype = _svd_dtype(svd_dtype)
    base_cast = base.to(dtype)
    task_matrices = [weight.to(dtype) - base_cast for weight in finetuned]
    del base_cast
    return task_matrix_interference(task_matrices, rank_fracs, merged, eps=eps, svd_dtype=svd_dtype,
                                    exact_svd=exact_svd)


def task_matrix_interference(
    task_matrices: Sequence[torch.Tensor],
    rank_fracs: Sequence[float] = DEFAULT_RANK_FRACS,
    merged: torch.Tensor | None = None,
    *,
    eps: float = SAR_EPS,
    svd_dtype: str = "float32",
    exact_svd: bool = False,
) -> dict:
    """Every weight-space interference metric of T task matrices Δ_t of one weight.

    The spectra of the T task matrices Δ_t, the T centred Δ̄_t and Δ_M (``merged``, default Σ_t Δ_t) are
    computed once each and reused across metrics: by default through their r × r Gram matrices
    (:mod:`submerge.diagnostics.interference.gram`: one eigendecomposition each, within 1e-4 of the exact
    route on STI, SAR, I(k) and R(k)); with ``exact_svd`` by a full thin SVD of each (the reference, bitwise the
    results of the versions before the Gram route). Returns a dict (floats / float64 numpy arrays):

    - ``task_vector_norm``, ``effective_rank``: (T,)
    - ``cosine``, ``sign_conflict``: (T, T), symmetric, diagonal 1 / 0
    - ``sti``, ``sti_normalized``: float; ``sti_k``: int (per-task rank k)
    - ``sar``: (T,); ``sar_k``: int (k_M of Δ_M)
    - ``rank_fracs``: (R,); ``ranks``: (R,) int, k per fraction
    - ``row_space_interference``, ``reconstruction_error``: (R, 2), column 0
      on plain Δ_t, column 1 on centred Δ̄_t
    """
    _check_same_shape(task_matrices, "task_matrices")
    dtype = _svd_dtype(svd_dtype)
    task_matrices = [delta.to(dtype) for delta in task_matrices]
    shape = tuple(task_matrices[0].shape)
    if merged is not None:
        _check_matrix(merged, "merged")
        if tuple(merged.shape) != shape:
            raise ValueError(f"merged has shape {tuple(merged.shape)}, the task matrices have {shape}")
    norms = np.array([task_vector_norm(delta) for delta in task_matrices])
    cosine, conflict = _pair_metrics(task_matrices, norms)
    ranks = np.array([rank_from_fraction(frac, min(shape)) for frac in rank_fracs], dtype=np.int64)
    spectral = _spectral_by_svds if exact_svd else _spectral_by_grams
    return {
        "task_vector_norm": norms,
        "cosine": cosine,
        "sign_conflict": conflict,
        "rank_fracs": np.asarray(rank_fracs, dtype=np.float64),
        "ranks": ranks,
        **spectral(task_matrices, ranks, merged, eps, dtype, norms),
    }


def _spectral_by_svds(task_matrices: list[torch.Tensor], ranks: np.ndarray, merged: torch.Tensor | None, eps: float,
                      dtype: torch.dtype, norms: np.ndarray) -> dict:
    """Effective rank, STI, SAR, I(k) and R(k) from full thin SVDs of the 2T + 1 matrices (``exact_svd``)."""
    shape = tuple(task_matrices[0].shape)
    interference = np.zeros((len(ranks), 2))
    reconstruction = np.zeros((len(ranks), 2))
    read_columns = sti_rank(shape, len(task_matrices))
    svds = []
    for delta in task_matrices:  # U beyond STI's k columns is never read: each task keeps U[:, :k] (T = 3: a third)
        svd = thin_svd(delta, dtype)
        svds.append(Svd(svd.U[:, :read_columns].clone(), svd.S, svd.Vh))
        del svd
    effective_ranks = np.array([effective_rank_from_singular_values(svd.S) for svd in svds])
    sti_value, sti_normalized, sti_k = _sti_from_svds(svds, shape, dtype)
    interference[:, 0], reconstruction[:, 0] = _rank_curves(svds, ranks)
    del svds
    sar_values, sar_k = _sar_against_merged(task_matrices, merged, eps, dtype)
    interference[:, 1], reconstruction[:, 1] = _rank_curves(_centered_spectra(task_matrices, dtype), ranks)
    return {"effective_rank": effective_ranks, "sti": sti_value, "sti_normalized": sti_normalized, "sti_k": sti_k,
            "sar": sar_values, "sar_k": sar_k, "row_space_interference": interference,
            "reconstruction_error": reconstruction}


def _spectral_by_grams(task_matrices: list[torch.Tensor], ranks: np.ndarray, merged: torch.Tensor | None, eps: float,
                       dtype: torch.dtype, norms: np.ndarray) -> dict:
    """The same figures as :func:`_spectral_by_svds` through the cross-Gram matrices (:mod:`.gram`).

    The Δ_t's own figures (effective rank, STI, plain I(k) and R(k)) fall back to thin SVDs of the Δ_t when STI keeps
    a direction whose σ² is below ``gram.STI_RESOLVED`` · σ_max² (:func:`resolves_sti`; a signal over a noise floor:
    the float32 Gram does not resolve the individual singular vectors that STI's entrywise norm depends on).
    """
    shape = tuple(task_matrices[0].shape)
    rank_list = [int(k) for k in ranks]
    grams = CrossGrams(task_matrices, merged)
    spectra = [gram_spectrum(grams.get(t, t), grams.tall[t]) for t in range(len(task_matrices))]
    sti_k = sti_rank(shape, len(spectra))
    kept = [min(sti_k, numerical_rank(spectrum.S, shape, dtype)) for spectrum in spectra]
    interference = np.zeros((len(ranks), 2))
    reconstruction = np.zeros((len(ranks), 2))
    if resolves_sti(spectra, kept):
        sti_value, sigma_sum = sti_from_spectra(spectra, kept, grams)
        sti_normalized = sti_value / sigma_sum if sigma_sum > 0 else float("nan")
        interference[:, 0] = row_space_curves(spectra, rank_list, grams, centred=False)
        reconstruction[:, 0] = [_tail_energy(spectra, k) for k in rank_list]
        effective_ranks = np.array([effective_rank_from_singular_values(spectrum.S) for spectrum in spectra])
    else:
        del spectra
        spectra = [thin_svd(delta, dtype) for delta in task_matrices]
        sti_value, sti_normalized, sti_k = _sti_from_svds(spectra, shape, dtype)
        interference[:, 0], reconstruction[:, 0] = _rank_curves(spectra, ranks)
        effective_ranks = np.array([effective_rank_from_singular_values(svd.S) for svd in spectra])
    del spectra
    merged_spectrum = gram_spectrum(grams.merged_gram)
    sar_k = effective_rank_cutoff(merged_spectrum.S, eps)
    projections = sar_projections(merged_spectrum, sar_k, grams)
    del merged_spectrum
    sar_values = np.array([float("nan") if norm == 0.0 else min(1.0, math.sqrt(max(projected, 0.0)) / norm)
                           for projected, norm in zip(projections, norms)])
    centred_spectra = [gram_spectrum(grams.centred(t, t), grams.centred_tall(t)) for t in range(len(task_matrices))]
    interference[:, 1] = row_space_curves(centred_spectra, rank_list, grams, centred=True)
    reconstruction[:, 1] = [_tail_energy(centred_spectra, k) for k in rank_list]
    return {"effective_rank": effective_ranks, "sti": sti_value, "sti_normalized": sti_normalized, "sti_k": sti_k,
            "sar": sar_values, "sar_k": sar_k, "row_space_interference": interference,
            "reconstruction_error": reconstruction}


def _tail_energy(spectra: Sequence[GramSpectrum], k: int) -> float:
    """R(k) = Σ_t Σ_{i>k} σ_{t,i}²."""
    return float(sum(float((spectrum.S[k:] ** 2).sum()) for spectrum in spectra))


def _pair_metrics(task_matrices: Sequence[torch.Tensor], norms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(T, T) cosine (diagonal 1, NaN for a zero Δ_t) and sign-conflict rate (diagonal 0) of every pair."""
    num_tasks = len(task_matrices)
    cosine = np.eye(num_tasks)
    conflict = np.zeros((num_tasks, num_tasks))
    for i in range(num_tasks):
        if norms[i] == 0.0:
            cosine[i, i] = np.nan
        for j in range(i + 1, num_tasks):
            cosine[i, j] = cosine[j, i] = cosine_similarity(task_matrices[i], task_matrices[j])
            conflict[i, j] = conflict[j, i] = sign_conflict_rate(task_matrices[i], task_matrices[j])
    return cosine, conflict


def _rank_curves(svds: Sequence[Svd], ranks: np.ndarray) -> tuple[list[float], list[float]]:
    """I(k) and R(k) at every k of ``ranks`` from the T decompositions."""
    interference = _row_space_interference_curve(svds, [int(k) for k in ranks])
    reconstruction = [_reconstruction_error_from_svds(svds, int(k)) for k in ranks]
    return interference, reconstruction


def _sar_against_merged(task_matrices: list[torch.Tensor], merged: torch.Tensor | None, eps: float,
                        dtype: torch.dtype) -> tuple[np.ndarray, int]:
    """SAR of every Δ_t against Δ_M (``merged``, default Σ_t Δ_t) and k_M; one SVD of Δ_M."""
    if merged is None:
        merged_matrix = task_matrices[0].clone()
        for delta in task_matrices[1:]:
            merged_matrix += delta
    else:  # shape checked by task_matrix_interference
        merged_matrix = merged.to(device=task_matrices[0].device)
    merged_svd = thin_svd(merged_matrix, dtype)
    del merged_matrix
    sar_k = effective_rank_cutoff(merged_svd.S, eps)
    merged_basis = merged_svd.U[:, :sar_k].clone()  # a copy, so that the full U is freed
    del merged_svd
    return np.array([_sar_from_basis(delta, merged_basis) for delta in task_matrices]), sar_k


def _centered_spectra(task_matrices: list[torch.Tensor], dtype: torch.dtype) -> list[Svd]:
    """S and Vh of each centred Δ̄_t (U is not needed for I(k) / R(k) and is dropped at once); one Δ̄_t at a time."""
    _check_same_shape(task_matrices, "task_matrices")
    spectra = []
    for index in range(len(task_matrices)):
        centered_svd = thin_svd(centered_one(task_matrices, index), dtype)
        spectra.append(Svd(torch.empty(0), centered_svd.S, centered_svd.Vh))
        del centered_svd
    return spectra

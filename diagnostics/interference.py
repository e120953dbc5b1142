"""Weight-space interference between task matrices (no data needed).

For one 2-D weight matrix of a base model W_0 and T fine-tunes W_1..W_T the
task matrices are Δ_t = W_t − W_0 (seed 003; docs/ARCHITECTURE.md).
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

SVD.  Every decomposition is a full (exact) thin SVD,
``torch.linalg.svd(x, full_matrices=False)``, computed in ``svd_dtype``
(float32 or float64) on the device the tensors live on — CUDA when the caller
put them there; the streaming driver moves them to CUDA when ``device="auto"``
finds one.  All metric arithmetic after the SVD (Gram matrices, projections,
sums of squares, entropies) is done in float64, and results are Python floats
or float64 numpy arrays.

A truncated / randomised SVD (``torch.svd_lowrank``) is not used.  It would be
exact enough only where a metric reads the top of the spectrum with a clear
gap below it: STI (top k = min(m,n)/T per task), I(k) at small rank fractions,
and R(k) and k_M when computed as ‖Δ‖_F² minus the energy of the top
components.  The effective rank needs the whole spectrum, I(k) at large rank
fractions needs nearly all of it, and a randomised SVD of a flat spectrum
(full fine-tunes, Iso-C-like merges) has no gap to exploit — so exact SVD is
the default and the only path here.

Driver.  :func:`interference` streams a whole checkpoint one matrix at a time
(T task matrices in memory, read lazily through ``diagnostics.models``), builds
an ``xarray.Dataset`` over (matrix, task, task_other, rank_frac, centered) and
optionally writes the store group ``interference`` with resume;
:func:`summarize_interference` gives the per-level / per-layer means.

Zero updates.  A matrix that a fine-tune did not change (common with LoRA)
gives Δ_t = 0.  Quantities that are ratios of zero (effective rank, cosine,
normalised STI, SAR with ‖Δ_t‖ = 0, I(k) when a task's top-k energy is 0) are
NaN, never an exception; STI, R(k), norms and sign-conflict rates stay finite.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "DEFAULT_RANK_FRACS",
    "SAR_EPS",
    "centered",
    "cosine_similarity",
    "effective_rank",
    "effective_rank_cutoff",
    "effective_rank_from_singular_values",
    "interference",
    "matrix_interference",
    "rank_from_fraction",
    "reconstruction_error",
    "row_space_interference",
    "sar",
    "sign_conflict_rate",
    "sti",
    "sti_rank",
    "summarize_interference",
    "task_matrix_interference",
    "task_vector_norm",
]

DEFAULT_RANK_FRACS: tuple[float, ...] = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0)
SAR_EPS = 0.05  # Iso-C's ε for the k_M rule (seed 003, Sec. Iso-C)

_SVD_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_CHUNK = 1 << 20  # elements per chunk for float64 reductions over big matrices (8 MiB)


# --------------------------------------------------------------------------- helpers


def _svd_dtype(svd_dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(svd_dtype, torch.dtype):
        if svd_dtype in (torch.float32, torch.float64):
            return svd_dtype
    elif svd_dtype in _SVD_DTYPES:
        return _SVD_DTYPES[svd_dtype]
    raise ValueError(f"svd_dtype must be 'float32' or 'float64', got {svd_dtype!r}")


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


class _Svd(NamedTuple):
    """Thin SVD x = U diag(S) Vh, factors in the SVD dtype, S in float64."""

    U: torch.Tensor  # (m, r)
    S: torch.Tensor  # (r,) float64, descending
    Vh: torch.Tensor  # (r, n)


def _svd(matrix: torch.Tensor, svd_dtype: str | torch.dtype) -> _Svd:
    dtype = _svd_dtype(svd_dtype)
    U, S, Vh = torch.linalg.svd(matrix.to(dtype), full_matrices=False)
    return _Svd(U, S.to(torch.float64), Vh)


def _numerical_rank(singular_values: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> int:
    """Count of σ_i > σ_max · max(m, n) · eps(dtype) (the usual matrix_rank tolerance)."""
    if singular_values.numel() == 0:
        return 0
    tolerance = float(singular_values[0]) * max(shape) * torch.finfo(dtype).eps
    return int((singular_values > tolerance).sum())


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


def _sti_from_svds(svds: Sequence[_Svd], shape: tuple[int, int], svd_dtype: torch.dtype) -> tuple[float, float, int]:
    k = sti_rank(shape, len(svds))
    kept = []
    for svd in svds:
        # Directions with σ = 0 have arbitrary singular vectors (any orthonormal
        # completion); they would make STI depend on LAPACK's choice through the
        # off-diagonal blocks, so a task keeps min(k, numerical rank) directions.
        kept.append(min(k, _numerical_rank(svd.S, shape, svd_dtype)))
    if sum(kept) == 0:
        return 0.0, float("nan"), k
    U = torch.cat([svd.U[:, :keep] for svd, keep in zip(svds, kept)], dim=1).to(torch.float64)
    V = torch.cat([svd.Vh[:keep, :] for svd, keep in zip(svds, kept)], dim=0).to(torch.float64).T
    sigma = torch.cat([svd.S[:keep] for svd, keep in zip(svds, kept)]).to(U.device)
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
    return _sti_from_svds([_svd(m, dtype) for m in task_matrices], shape, dtype)


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
    merged_svd = _svd(merged_matrix, svd_dtype)
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
    come back in the inputs' dtype promoted to at least float32.
    """
    _check_same_shape(task_weights, "task_weights")
    mean = torch.zeros(task_weights[0].shape, dtype=torch.float64, device=task_weights[0].device)
    for weight in task_weights:
        mean += weight.to(torch.float64)
    mean /= len(task_weights)
    out_dtype = torch.promote_types(task_weights[0].dtype, torch.float32)
    return [(weight.to(torch.float64) - mean).to(out_dtype) for weight in task_weights]


def _row_space_interference_curve(svds: Sequence[_Svd], ranks: Sequence[int]) -> list[float]:
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


def _reconstruction_error_from_svds(svds: Sequence[_Svd], k: int) -> float:
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
    return _row_space_interference_curve([_svd(m, svd_dtype) for m in task_matrices], [k])[0]


def reconstruction_error(task_matrices: Sequence[torch.Tensor], k: int, *, svd_dtype: str = "float32") -> float:
    """CART's Reconstruction Error (seed 003, Sec. CART and App. 14):

        R(k) = Σ_t ‖Δ_t − SVD_k(Δ_t)‖_F² = Σ_t Σ_{i>k} σ_{t,i}²   (Eckart–Young),

    0 at full rank.  Pass :func:`centered` matrices for CART's centred variant.
    """
    _check_same_shape(task_matrices, "task_matrices")
    _check_rank(k, tuple(task_matrices[0].shape))
    return _reconstruction_error_from_svds([_svd(m, svd_dtype) for m in task_matrices], k)


# ------------------------------------------------------------------------ everything


def matrix_interference(
    base: torch.Tensor,
    finetuned: Sequence[torch.Tensor],
    rank_fracs: Sequence[float] = DEFAULT_RANK_FRACS,
    merged: torch.Tensor | None = None,
    *,
    eps: float = SAR_EPS,
    svd_dtype: str = "float32",
) -> dict:
    """Every weight-space interference metric of one matrix, each SVD done once.

    ``base`` is W_0, ``finetuned`` the T fine-tuned W_t (any float dtype, one
    device); ``merged`` is the merged *task* matrix Δ_M for SAR (default: task
    arithmetic Σ_t Δ_t).  The task matrices Δ_t = W_t − W_0 are formed in
    ``svd_dtype`` and passed to :func:`task_matrix_interference`, which
    documents the returned dict.
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
    return task_matrix_interference(task_matrices, rank_fracs, merged, eps=eps, svd_dtype=svd_dtype)


def task_matrix_interference(
    task_matrices: Sequence[torch.Tensor],
    rank_fracs: Sequence[float] = DEFAULT_RANK_FRACS,
    merged: torch.Tensor | None = None,
    *,
    eps: float = SAR_EPS,
    svd_dtype: str = "float32",
) -> dict:
    """Every weight-space interference metric of T task matrices Δ_t of one weight.

    T SVDs of Δ_t, T of the centred Δ̄_t and one of Δ_M (``merged``, default
    Σ_t Δ_t) are computed, and their singular vectors are reused across metrics.
    Returns a dict (floats / float64 numpy arrays):

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
    num_tasks = len(task_matrices)

    norms = np.array([task_vector_norm(delta) for delta in task_matrices])
    cosine = np.eye(num_tasks)
    conflict = np.zeros((num_tasks, num_tasks))
    for i in range(num_tasks):
        if norms[i] == 0.0:
            cosine[i, i] = np.nan
        for j in range(i + 1, num_tasks):
            cosine[i, j] = cosine[j, i] = cosine_similarity(task_matrices[i], task_matrices[j])
            conflict[i, j] = conflict[j, i] = sign_conflict_rate(task_matrices[i], task_matrices[j])

    ranks = np.array([rank_from_fraction(frac, min(shape)) for frac in rank_fracs], dtype=np.int64)
    interference = np.zeros((len(ranks), 2))
    reconstruction = np.zeros((len(ranks), 2))

    svds = [_svd(delta, dtype) for delta in task_matrices]
    effective_ranks = np.array([effective_rank_from_singular_values(svd.S) for svd in svds])
    sti_value, sti_normalized, sti_k = _sti_from_svds(svds, shape, dtype)
    interference[:, 0] = _row_space_interference_curve(svds, [int(k) for k in ranks])
    for index, k in enumerate(ranks):
        reconstruction[index, 0] = _reconstruction_error_from_svds(svds, int(k))
    del svds

    if merged is None:
        merged_matrix = task_matrices[0].clone()
        for delta in task_matrices[1:]:
            merged_matrix += delta
    else:
        _check_matrix(merged, "merged")
        if tuple(merged.shape) != shape:
            raise ValueError(f"merged has shape {tuple(merged.shape)}, the task matrices have {shape}")
        merged_matrix = merged.to(device=task_matrices[0].device)
    merged_svd = _svd(merged_matrix, dtype)
    del merged_matrix
    sar_k = effective_rank_cutoff(merged_svd.S, eps)
    merged_basis = merged_svd.U[:, :sar_k].clone()  # a copy, so that the full U is freed
    del merged_svd
    sar_values = np.array([_sar_from_basis(delta, merged_basis) for delta in task_matrices])
    del merged_basis

    centered_matrices = centered(task_matrices)
    centered_svds = []
    while centered_matrices:
        centered_svd = _svd(centered_matrices.pop(0), dtype)
        # U is not needed for I(k) / R(k): keep S and Vh only.
        centered_svds.append(_Svd(torch.empty(0), centered_svd.S, centered_svd.Vh))
        del centered_svd
    interference[:, 1] = _row_space_interference_curve(centered_svds, [int(k) for k in ranks])
    for index, k in enumerate(ranks):
        reconstruction[index, 1] = _reconstruction_error_from_svds(centered_svds, int(k))

    return {
        "task_vector_norm": norms,
        "effective_rank": effective_ranks,
        "cosine": cosine,
        "sign_conflict": conflict,
        "sti": sti_value,
        "sti_normalized": sti_normalized,
        "sti_k": sti_k,
        "sar": sar_values,
        "sar_k": sar_k,
        "rank_fracs": np.asarray(rank_fracs, dtype=np.float64),
        "ranks": ranks,
        "row_space_interference": interference,
        "reconstruction_error": reconstruction,
    }


# ---------------------------------------------------------------- streaming driver

GROUP = "interference"


def _merged_task_matrix(name: str, task_matrices: list[torch.Tensor], sar_against: str, sar_options: dict | None,
                        kind: str | None = None):
    """Δ_M for SAR: None for task arithmetic (the core's default), else a merge strategy's τ_M."""
    if sar_against == "ta":
        return None
    from merge.strategies import merge_parameter  # lazy: merge/ builds on diagnostics/, not the reverse

    # merge_parameter: per-name seeds for random methods, the documented fallback for
    # embeddings under matrix-only methods, the strategy's paper defaults.
    return merge_parameter(name, task_matrices, sar_against, sar_options, kind=kind)


def _check_strategy(sar_against: str, sar_options: dict | None) -> None:
    if sar_against == "ta":
        if sar_options:
            raise ValueError(f"sar_options {sar_options} given, but sar_against='ta' takes none")
        return
    from merge.strategies import STRATEGIES

    if sar_against not in STRATEGIES:
        raise ValueError(f"sar_against must be 'ta' or a merge strategy ({', '.join(STRATEGIES)}), got {sar_against!r}")
    STRATEGIES[sar_against].resolve_options(sar_options)  # unknown options fail before any work


def _matrix_names(base, table, names: Sequence[str] | None) -> list[str]:
    if names is not None:
        unknown = [name for name in names if name not in base]
        if unknown:
            raise ValueError(f"matrices not in the base checkpoint {base.spec}: {unknown[:10]}")
        return list(names)
    found = [name for name in base.names() if name.endswith(".weight") and len(base.shape(name)) == 2]
    return sorted(found, key=lambda name: (table.get(name).layer, name))  # layer 2 before layer 10


def _tied_duplicates(base, table, readers: dict, names: list[str]) -> dict[str, str]:
    """Embedding-level matrices stored twice with equal values (tied lm_head = embed) → {duplicate: kept}."""
    # output projections last, so the input embedding is the one kept
    embed = sorted((name for name in names if table.get(name).level == "embed"), key=lambda n: "lm_head" in n)
    duplicates: dict[str, str] = {}
    for i, first in enumerate(embed):
        for second in embed[i + 1 :]:
            if second in duplicates or base.shape(first) != base.shape(second):
                continue
            if not torch.equal(base.get(first), base.get(second)):
                continue
            if all(torch.equal(reader.get(first), reader.get(second)) for reader in readers.values()):
                duplicates[second] = first
    return duplicates


def _matrices_dataset(table, names, shapes, results, task_names, rank_fracs):
    """One Dataset (no attrs) for the given matrices; see :func:`interference`."""
    import xarray as xr

    locations = [table.get(name) for name in names]
    num_tasks, num_fracs = len(task_names), len(rank_fracs)

    def stacked(key, shape, dtype=np.float64):
        if not results:
            return np.zeros((0, *shape), dtype=dtype)
        return np.stack([np.asarray(r[key], dtype=dtype) for r in results])

    matrix, task, pair = ("matrix",), ("matrix", "task"), ("matrix", "task", "task_other")
    curve = ("matrix", "rank_frac", "centered")
    return xr.Dataset(
        {
            "task_vector_norm": (task, stacked("task_vector_norm", (num_tasks,))),
            "effective_rank": (task, stacked("effective_rank", (num_tasks,))),
            "cosine": (pair, stacked("cosine", (num_tasks, num_tasks))),
            "sign_conflict": (pair, stacked("sign_conflict", (num_tasks, num_tasks))),
            "sti": (matrix, stacked("sti", ())),
            "sti_normalized": (matrix, stacked("sti_normalized", ())),
            "sti_k": (matrix, stacked("sti_k", (), np.int64)),
            "sar": (task, stacked("sar", (num_tasks,))),
            "sar_k": (matrix, stacked("sar_k", (), np.int64)),
            "rank": (("matrix", "rank_frac"), stacked("ranks", (num_fracs,), np.int64)),
            "row_space_interference": (curve, stacked("row_space_interference", (num_fracs, 2))),
            "reconstruction_error": (curve, stacked("reconstruction_error", (num_fracs, 2))),
        },
        coords={
            "matrix": np.array(names, dtype=object),
            "module": ("matrix", np.array([loc.module for loc in locations], dtype=object)),
            "layer": ("matrix", np.array([loc.layer for loc in locations], dtype=np.int64)),
            "level": ("matrix", np.array([loc.level for loc in locations], dtype=object)),
            "rows": ("matrix", np.array([shape[0] for shape in shapes], dtype=np.int64)),
            "cols": ("matrix", np.array([shape[1] for shape in shapes], dtype=np.int64)),
            "task": np.array(task_names, dtype=object),
            "task_other": np.array(task_names, dtype=object),
            "rank_frac": np.asarray(rank_fracs, dtype=np.float64),
            "centered": np.array([False, True]),
        },
    )


def interference(
    base,
    finetuned: dict,
    *,
    rank_fracs: Sequence[float] = DEFAULT_RANK_FRACS,
    sar_against: str = "ta",
    sar_options: dict | None = None,
    eps: float = SAR_EPS,
    svd_dtype: str = "float32",
    device: str = "auto",
    progress: bool = True,
    matrices: Sequence[str] | None = None,
    transposed: Sequence[str] | None = None,
    table=None,
    store=None,
    force: bool = False,
    command: str | None = None,
    flush_every: int = 8,
):
    """Weight-space interference of every 2-D weight matrix, streamed one matrix at a time.

    ``base`` is a :class:`diagnostics.models.CheckpointReader`; ``finetuned``
    maps task names to CheckpointReaders (LoRA readers included) or to
    :class:`diagnostics.models.TaskVectorReader` objects.  For each matrix only
    the T task matrices Δ_t (in ``svd_dtype``, on ``device``) and their SVD
    factors are in memory; each Δ_t is read through ``TaskVectorReader`` (exact
    LoRA updates, vocabulary cropping, NaN/Inf check).  Memory: the T task
    matrices plus about ten copies of one matrix for the SVDs and the float64
    products (``benchmarks/interference.py`` measures it).

    Matrices: every tensor of the base whose name ends in ``.weight`` and that is
    2-D (no size cap), ordered by layer, or the names in ``matrices``.  An
    embedding-level matrix stored twice with equal values in the base and every
    fine-tune (tied ``lm_head`` = embedding) is measured once; the skipped name
    is listed in ``attrs["tied_duplicates"]``.  Weights stored (in, out) (GPT-2
    ``Conv1D``; from the tensor table ``table``, built from the base's config when
    not given, or the names in ``transposed``) are transposed to (out, in) first,
    so U is always the output space and the row space V the input space, as
    CART's I(k) assumes.

    SAR is taken against task arithmetic Σ_t Δ_t (``sar_against="ta"``) or
    against the merged task vector of the merge strategy
    ``merge.strategies.STRATEGIES[sar_against]`` (its paper defaults, updated by
    ``sar_options``), computed per matrix by ``merge.strategies.merge_parameter``.

    Returns an ``xarray.Dataset`` with dims matrix, task, task_other, rank_frac,
    centered (False: plain Δ_t, True: centred Δ̄_t) and variables
    task_vector_norm, effective_rank, sar (matrix, task); cosine, sign_conflict
    (matrix, task, task_other); sti, sti_normalized, sti_k, sar_k (matrix);
    rank (matrix, rank_frac); row_space_interference, reconstruction_error
    (matrix, rank_frac, centered).  Coordinates along matrix: the parameter
    name, and module, layer, level (from the tensor table ``diagnostics.tensors``),
    rows, cols.  The attrs name every rule (k, ε, norms, SVD dtype).

    With ``store`` (a :class:`diagnostics.store.Store`) the group
    ``interference`` is written ``flush_every`` matrices at a time; a run that
    stopped resumes after the last matrix written (same settings), other
    settings are an error unless ``force``.
    """
    import xarray as xr

    from diagnostics.models import CheckpointReader, TaskVectorReader, pick_device
    from diagnostics.progress import progress_bar

    if not finetuned:
        raise ValueError("finetuned is empty: need at least one fine-tuned model")
    for task, reader in finetuned.items():
        if not isinstance(reader, (TaskVectorReader, CheckpointReader)):
            raise TypeError(f"finetuned['{task}'] must be a CheckpointReader or TaskVectorReader, "
                            f"got {type(reader).__name__}")
    dtype = _svd_dtype(svd_dtype)
    for frac in rank_fracs:
        rank_from_fraction(frac, 1)  # validates the fraction
    _check_strategy(sar_against, sar_options)
    target = pick_device(device)
    task_names = list(finetuned)
    task_readers = {
        task: reader if isinstance(reader, TaskVectorReader) else TaskVectorReader(task, base, reader)
        for task, reader in finetuned.items()
    }
    if table is None:
        from diagnostics.tensors import TensorTable

        table = TensorTable.from_reader(base)
    names = _matrix_names(base, table, matrices)
    duplicates = _tied_duplicates(base, table, {t: r.finetuned for t, r in task_readers.items()}, names)
    names = [name for name in names if name not in duplicates]
    transposed = set(transposed) if transposed is not None else {info.name for info in table if info.transposed}
    attrs = {
        "task_matrix": "Δ_t = W_t − W_0; centered: Δ̄_t = W_t − mean_s W_s",
        "norm": "Frobenius",
        "effective_rank": "Roy & Vetterli 2007: exp of the Shannon entropy of σ_i / Σσ",
        "sign_conflict_denominator": "all entries of the matrix",
        "sti_equation": "seed 003, TSV-M: ‖(UᵀU − I) Σ (VᵀV − I)‖₁ entrywise (sum of |entries|)",
        "sti_rank_rule": "k = max(1, floor(min(m, n) / T)); a task of lower numerical rank keeps its non-zero directions",
        "sti_normalized": "sti / Σσ of the kept singular values",
        "sar_equation": "seed 003, Iso-C: ‖U_k U_kᵀ Δ_t‖_F / ‖Δ_t‖_F, U_k top k_M left singular vectors of Δ_M",
        "sar_k_rule": "k_M = min{k : Σ_{i>k} σ_i² ≤ ε² Σ σ_i²} of Δ_M",
        "sar_eps": float(eps),
        "sar_against": sar_against,
        "sar_options": dict(sar_options or {}),
        "rank_rule": "k = max(1, floor(frac · min(m, n) + 0.5)), capped at min(m, n)",
        "row_space_interference": "seed 003, CART: I(k) = Σ_{i≠j} ‖Σ̃_i Ṽ_iᵀ Ṽ_j Σ̃_j‖_F, σ̃ = σ / sqrt(Σ_{i≤k} σ²)",
        "reconstruction_error": "seed 003, CART: R(k) = Σ_t Σ_{i>k} σ_{t,i}²",
        "svd": "torch.linalg.svd, full thin SVD (exact)",
        "svd_dtype": str(dtype).removeprefix("torch."),
        "device": str(target),
        "tied_duplicates": dict(duplicates),
        "transposed": sorted(transposed),
    }

    done: set[str] = set()
    pieces: list = []
    if store is not None:
        from diagnostics.store import provenance

        settings = {
            "tasks": task_names, "rank_fracs": [float(f) for f in rank_fracs], "sar_against": sar_against,
            "sar_options": dict(sar_options or {}), "eps": float(eps), "svd_dtype": attrs["svd_dtype"],
            "matrices": list(matrices) if matrices is not None else "all", "transposed": sorted(transposed),
        }
        base_info = base.fingerprint()
        inputs = {"base_model": base_info,
                  "finetuned": {task: reader.finetuned.fingerprint() for task, reader in task_readers.items()}}
        done = store.begin(GROUP, settings, force=force, root=provenance(command, base_model=base_info),
                           attrs={"provenance": provenance(command, **inputs)}, dim="matrix")
        if done:
            pieces.append(store.dataset(GROUP))
    todo = [name for name in names if name not in done]

    buffer: tuple[list, list, list] = ([], [], [])

    def flush() -> None:
        if not buffer[0]:
            return
        piece = _matrices_dataset(table, *buffer, task_names, rank_fracs)
        if store is not None:
            store.append(GROUP, piece, dim="matrix")
        pieces.append(piece)
        for part in buffer:
            part.clear()

    with progress_bar(progress) as bar:
        job = bar.add_task("interference", total=len(names))
        bar.advance(job, len(names) - len(todo))
        for name in todo:
            bar.update(job, description=f"interference · {name}")
            task_matrices = []
            for task in task_names:
                delta = task_readers[task].get(name, dtype=dtype, device=target)
                task_matrices.append(delta.T if name in transposed else delta)
            merged = _merged_task_matrix(name, task_matrices, sar_against, sar_options, table.get(name).kind)
            result = task_matrix_interference(task_matrices, rank_fracs, merged, eps=eps, svd_dtype=svd_dtype)
            buffer[0].append(name)
            buffer[1].append(tuple(task_matrices[0].shape))
            buffer[2].append(result)
            del task_matrices, merged
            if len(buffer[0]) >= flush_every:
                flush()
            bar.advance(job)
        flush()

    if not pieces:
        pieces.append(_matrices_dataset(table, [], [], [], task_names, rank_fracs))
    dataset = xr.concat(pieces, dim="matrix", data_vars="minimal", coords="minimal") if len(pieces) > 1 else pieces[0]
    dataset.attrs.update(attrs)
    if store is not None:
        store.finish(GROUP, attrs)
    return dataset


def summarize_interference(dataset, *, rank_frac: float = 0.08, by: Sequence[str] = ("level", "layer")):
    """Means of the per-matrix figures grouped by ``by`` (default per level and layer), as a pandas table.

    Per matrix: task_vector_norm, effective_rank and sar are averaged over tasks,
    cosine and sign_conflict over the pairs t < t', and I(k) (plain and centred)
    is taken at the grid's rank fraction nearest ``rank_frac`` (default 8 %,
    CART's reported optimum).  NaNs (matrices a task did not change) are skipped.
    Pass ``by=("level",)`` for one row per level (attn, mlp, embed, ...).
    """
    import pandas as pd
    import xarray as xr

    num_tasks = dataset.sizes["task"]
    upper = xr.DataArray(np.triu(np.ones((num_tasks, num_tasks), dtype=bool), k=1), dims=("task", "task_other"))
    pairs = dataset[["cosine", "sign_conflict"]].where(upper)
    nearest = dataset.sel(rank_frac=rank_frac, method="nearest")
    chosen = float(nearest["rank_frac"])
    table = pd.DataFrame(
        {
            "level": dataset["level"].values,
            "layer": dataset["layer"].values,
            "task_vector_norm": dataset["task_vector_norm"].mean("task").values,
            "effective_rank": dataset["effective_rank"].mean("task").values,
            "cosine": pairs["cosine"].mean(("task", "task_other")).values if num_tasks > 1 else np.nan,
            "sign_conflict": pairs["sign_conflict"].mean(("task", "task_other")).values if num_tasks > 1 else np.nan,
            "sti_normalized": dataset["sti_normalized"].values,
            "sar": dataset["sar"].mean("task").values,
            f"I({chosen:g})": nearest["row_space_interference"].sel(centered=False).values,
            f"I_centered({chosen:g})": nearest["row_space_interference"].sel(centered=True).values,
        }
    )
    table = table.drop(columns=[column for column in ("level", "layer") if column not in by])
    grouped = table.groupby(list(by)).mean()
    grouped.insert(0, "matrices", table.groupby(list(by)).size())
    return grouped

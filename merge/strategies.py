"""Merge strategies: one pure function per method, over the task vectors of ONE parameter.

Convention
----------
Every strategy takes ``task_vectors`` (a list of tensors τ_t = θ_t − θ0 of one shape,
one per fine-tuned model) plus keyword options whose defaults come from the paper, and
returns the **merged task vector** τ_M (same shape and dtype as the inputs). The merged
weight is θ0 + τ_M. Arithmetic is done in float64 (``COMPUTE_DTYPE``) on the inputs'
device; the result is cast back to the inputs' dtype.

The final scaling coefficient is called ``scaling`` everywhere (λ in Task Arithmetic,
TIES, DARE, Breadcrumbs, DELLA and CART; α in TSV-M and Iso-C/CTS; γ in SFTM).
Fractions are fractions (``top_k=0.2`` means the paper's "top-20 %").

Papers: "survey" is seed 003 (a survey of model merging whose section for each method
gives the equations quoted here; its equations are labelled, not numbered, so the label
is cited), "SFTM" is seed 001 (Qiu et al., Superpose Singular Features for Model Merging).

Matrix-only methods (TSV-M, Iso-C, Iso-CTS, CART, STAR, SFTM, RegMean) need 2-D tensors;
``merge_parameter`` applies the documented fallback to biases, norms and embeddings
(SFTM Alg. 2 lines 9–16: biases/embeddings by task arithmetic, norms by mean) and
reshapes >2-D kernels to (out, rest) as SFTM §3.3 does for convolutions.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from diagnostics.spectral import concat_top, numerical_rank, thin_svd

__all__ = [
    "COMPUTE_DTYPE",
    "DEFAULT_FALLBACK",
    "PARAMETER_KINDS",
    "STRATEGIES",
    "MergeMethod",
    "SftmSystem",
    "TsvBases",
    "breadcrumbs",
    "breadcrumbs_mask",
    "cart",
    "dare",
    "della",
    "drop_and_rescale",
    "elect_sign_disjoint_mean",
    "iso_c",
    "iso_cts",
    "keep_top_magnitude",
    "magprune",
    "merge_parameter",
    "parameter_kind",
    "procrustes_orthonormalise",
    "regmean",
    "sftm",
    "sftm_system",
    "star",
    "star_truncate",
    "task_arithmetic",
    "ties",
    "tsv_bases",
    "tsv_m",
    "weight_average",
    "weighted_task_arithmetic",
]

COMPUTE_DTYPE = torch.float64

# ----------------------------------------------------------------------------- helpers


def _check_task_vectors(task_vectors: Sequence[torch.Tensor], *, matrix: bool = False) -> None:
    if isinstance(task_vectors, torch.Tensor) or not isinstance(task_vectors, Sequence):
        raise TypeError("task_vectors must be a list of tensors (one per task)")
    if len(task_vectors) == 0:
        raise ValueError("task_vectors is empty: need at least one task vector")
    for index, task_vector in enumerate(task_vectors):
        if not isinstance(task_vector, torch.Tensor):
            raise TypeError(f"task_vectors[{index}] must be a torch.Tensor, got {type(task_vector).__name__}")
        if not task_vector.is_floating_point():
            raise ValueError(f"task_vectors[{index}] must be floating point, got dtype {task_vector.dtype}")
    shapes = [tuple(task_vector.shape) for task_vector in task_vectors]
    if len(set(shapes)) != 1:
        raise ValueError(f"task_vectors must all have one shape, got {shapes}")
    if matrix and len(shapes[0]) != 2:
        raise ValueError(f"this method needs 2-D task matrices, got task_vectors of shape {shapes[0]}")


def _stack(task_vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """(T, *shape) float64 stack of the task vectors."""
    return torch.stack([task_vector.to(COMPUTE_DTYPE) for task_vector in task_vectors])


def _as_output(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return result.to(dtype=like.dtype, device=like.device)


def _check_fraction(value: float, name: str, *, low_open: bool = False, high_open: bool = False) -> float:
    value = float(value)
    low_ok = value > 0 if low_open else value >= 0
    high_ok = value < 1 if high_open else value <= 1
    if not (low_ok and high_ok) or math.isnan(value):
        interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
        raise ValueError(f"{name} must be a fraction in {interval} (e.g. 0.2 for 20 %), got {value}")
    return value


def _count_from_fraction(fraction: float, total: int) -> int:
    """round(fraction · total), rounding half up (⌊x + ½⌋), clipped to [0, total]."""
    return min(total, max(0, math.floor(fraction * total + 0.5)))


def _thin_svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD matrix = U diag(S) Vᵀ in the matrix's dtype (float64 here), returning (U, S, V) with V (n × r)."""
    left, singular_values, right_transposed = thin_svd(matrix, matrix.dtype)
    return left, singular_values, right_transposed.mT


# -------------------------------------------------------------------- element-wise methods


def weight_average(task_vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Simple average of the fine-tuned weights (Wortsman et al. 2022, model soups).

    Survey §"Simple Average": θ_M = (1/T) Σ_t θ_t = θ0 + (1/T) Σ_t τ_t, so the merged task
    vector is the mean of the task vectors. No options.
    """
    _check_task_vectors(task_vectors)
    return _as_output(_stack(task_vectors).mean(dim=0), task_vectors[0])


def task_arithmetic(task_vectors: Sequence[torch.Tensor], *, scaling: float = 1.0) -> torch.Tensor:
    """Task Arithmetic (Ilharco et al. 2023): τ_M = λ Σ_t τ_t.

    Survey §"Task Arithmetic": θ_M = θ0 + λ Σ_t τ_t. The paper picks λ on held-out data;
    the default ``scaling`` λ = 1 is the plain sum (no validation data here).
    """
    _check_task_vectors(task_vectors)
    return _as_output(float(scaling) * _stack(task_vectors).sum(dim=0), task_vectors[0])


def weighted_task_arithmetic(
    task_vectors: Sequence[torch.Tensor], weights: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """Task Arithmetic with one coefficient per task: τ_M = Σ_t w_t τ_t.

    Survey §"Task Arithmetic" with a per-task λ_t (as in AdaMerging's task-wise form); used
    by the submodule closed-form merge, whose α per task and submodule come from the store
    (seed 002). ``weights`` has one entry per task; there is no default.
    """
    _check_task_vectors(task_vectors)
    weights = torch.as_tensor(weights, dtype=COMPUTE_DTYPE).reshape(-1)
    if weights.numel() != len(task_vectors):
        raise ValueError(f"weights has {weights.numel()} entries but there are {len(task_vectors)} task vectors")
    stacked = _stack(task_vectors)
    weights = weights.to(stacked.device).reshape(-1, *([1] * (stacked.ndim - 1)))
    return _as_output((weights * stacked).sum(dim=0), task_vectors[0])


def keep_top_magnitude(task_vector: torch.Tensor, top_k: float) -> torch.Tensor:
    """TIES step (1) Trim: keep the top-k fraction of entries by |value|, zero the rest.

    Survey §TIES-Merging: τ̂_t = keep_topk_reset_rest_to_zero(τ_t, k). Keeps exactly
    round(k · n) entries (at least one when k > 0); among equal magnitudes the order of
    ``torch.topk`` decides. Returned in float64.
    """
    top_k = _check_fraction(top_k, "top_k")
    flat = task_vector.to(COMPUTE_DTYPE).reshape(-1)
    keep = _count_from_fraction(top_k, flat.numel())
    if top_k > 0:
        keep = max(1, keep)
    if keep >= flat.numel():
        return flat.reshape(task_vector.shape).clone()
    mask = torch.zeros_like(flat, dtype=torch.bool)
    if keep > 0:
        mask[torch.topk(flat.abs(), keep).indices] = True
    return torch.where(mask, flat, torch.zeros_like(flat)).reshape(task_vector.shape)


def elect_sign_disjoint_mean(task_vectors: torch.Tensor) -> torch.Tensor:
    """TIES steps (2) Elect Sign and (3) Disjoint Merge on a (T, ...) stack.

    Survey §TIES-Merging: γ_m = sgn(Σ_t τ̂_t); for each entry p, A_p = {t : sgn(τ̂_t^p) = γ_m^p}
    and τ_m^p = (1/|A_p|) Σ_{t∈A_p} τ̂_t^p, zeros ignored. An entry whose sum is exactly 0
    gets γ_m = 0 and merges to 0 (the equation as written). Also DELLA's Elect and Fuse.
    """
    elected_sign = torch.sign(task_vectors.sum(dim=0))
    agrees = (torch.sign(task_vectors) == elected_sign) & (task_vectors != 0)
    selected = torch.where(agrees, task_vectors, torch.zeros_like(task_vectors))
    count = agrees.sum(dim=0).clamp(min=1)
    return selected.sum(dim=0) / count


def ties(task_vectors: Sequence[torch.Tensor], *, top_k: float = 0.2, scaling: float = 1.0) -> torch.Tensor:
    """TIES-Merging (Yadav et al. 2023, Algorithm 1): trim, elect sign, disjoint mean, scale by λ.

    Survey §TIES-Merging steps (1)–(3) and θ_M = θ0 + λ τ_M. Defaults k = 20 % (the survey's
    "e.g., k = 20") and λ = 1 (the TIES paper's choice without a validation set; not in the
    seed survey).
    Trimming is per parameter tensor (the writer streams one tensor at a time); the paper
    trims over the whole model's task vector.
    """
    _check_task_vectors(task_vectors)
    trimmed = torch.stack([keep_top_magnitude(task_vector, top_k) for task_vector in task_vectors])
    return _as_output(float(scaling) * elect_sign_disjoint_mean(trimmed), task_vectors[0])


def _generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return generator


def drop_and_rescale(task_vector: torch.Tensor, drop_rate: float, generator: torch.Generator) -> torch.Tensor:
    """DARE on one task vector (Yu et al. 2024): m ~ Bernoulli(p), τ̂ = (1 − m) ⊙ τ / (1 − p).

    Survey eq. (dare); the 1/(1 − p) rescale keeps E[τ̂] = τ (survey App. "Theoretical Analysis
    for DARE"). Returned in float64.
    """
    drop_rate = _check_fraction(drop_rate, "drop_rate", high_open=True)
    values = task_vector.to(COMPUTE_DTYPE)
    if drop_rate == 0:
        return values.clone()
    dropped = torch.bernoulli(torch.full_like(values, drop_rate), generator=generator)
    return (1 - dropped) * values / (1 - drop_rate)


def dare(
    task_vectors: Sequence[torch.Tensor],
    *,
    drop_rate: float = 0.9,
    seed: int = 0,
    base: str = "task-arithmetic",
    top_k: float = 1.0,
    scaling: float = 1.0,
) -> torch.Tensor:
    """DARE (Yu et al. 2024) as a plug-in before Task Arithmetic or TIES.

    Survey eqs. (dare) and (dare-merge): each τ_t is dropped with rate p and rescaled by
    1/(1 − p), then merged with ``base``: "task-arithmetic" gives τ_M = λ Σ_t τ̂_t;
    "ties" gives TIES on the τ̂_t (trim to ``top_k``, default 1.0 = no trim, then elect
    sign and disjoint mean, scaled by λ). Defaults: p = 0.9 (the DARE paper's usual drop
    rate for merging SFT LMs; the survey's App. mentions rates up to 0.99), λ = 1. One ``torch.Generator`` seeded with ``seed`` draws the
    tasks' masks in task order, so a seed gives one result.
    """
    _check_task_vectors(task_vectors)
    if base not in ("task-arithmetic", "ties"):
        raise ValueError(f"dare base must be 'task-arithmetic' or 'ties', got {base!r}")
    generator = _generator(seed, task_vectors[0].device)
    rescaled = torch.stack([drop_and_rescale(task_vector, drop_rate, generator) for task_vector in task_vectors])
    if base == "task-arithmetic":
        merged = rescaled.sum(dim=0)
    else:
        trimmed = torch.stack([keep_top_magnitude(task_vector, top_k) for task_vector in rescaled])
        merged = elect_sign_disjoint_mean(trimmed)
    return _as_output(float(scaling) * merged, task_vectors[0])


def breadcrumbs_mask(task_vector: torch.Tensor, beta: float, gamma: float) -> torch.Tensor:
    """Model Breadcrumbs' mask m^{β,γ} for one tensor (Davari & Belilovsky 2024).

    Survey eq. (mask): sort |w| ascending with index i; m = 0 if i ≤ β or i ≥ γ, else 1.
    β and γ are read as fractions of the n entries: the round(β n) smallest and the
    n − round(γ n) largest magnitudes are masked (0-based ascending index i is masked when
    i < round(β n) or i ≥ round(γ n)). Returns a bool tensor of the input's shape.
    """
    beta = _check_fraction(beta, "beta")
    gamma = _check_fraction(gamma, "gamma")
    if beta > gamma:
        raise ValueError(f"breadcrumbs needs beta <= gamma, got beta={beta}, gamma={gamma}")
    flat = task_vector.to(COMPUTE_DTYPE).reshape(-1)
    total = flat.numel()
    order = torch.argsort(flat.abs(), stable=True)
    ascending_index = torch.empty_like(order)
    ascending_index[order] = torch.arange(total, device=order.device)
    keep = (ascending_index >= _count_from_fraction(beta, total)) & (
        ascending_index < _count_from_fraction(gamma, total)
    )
    return keep.reshape(task_vector.shape)


def breadcrumbs(
    task_vectors: Sequence[torch.Tensor], *, beta: float = 0.85, gamma: float = 0.993, scaling: float = 1.0
) -> torch.Tensor:
    """Model Breadcrumbs (Davari & Belilovsky 2024): τ_M = λ Σ_t m_t^{β,γ} ⊙ τ_t.

    Survey eqs. (mask) and (breadcrumbs-merge); the mask is layer-wise, i.e. per parameter
    tensor. Defaults β = 0.85 (drop the smallest 85 %) and γ = 0.993 (drop the largest
    0.7 %) are the Breadcrumbs paper's reported setting (not in the seed survey, which gives
    no values); λ = 1.
    """
    _check_task_vectors(task_vectors)
    masked = [torch.where(breadcrumbs_mask(tv, beta, gamma), tv.to(COMPUTE_DTYPE), 0.0) for tv in task_vectors]
    return _as_output(float(scaling) * torch.stack(masked).sum(dim=0), task_vectors[0])


def magprune(task_vector: torch.Tensor, drop_rate: float, epsilon: float, generator: torch.Generator) -> torch.Tensor:
    """DELLA's MAGPRUNE on one task vector (Deep et al. 2024), row by row.

    Survey eq. (della magprune prob): within a row of n deltas, rank magnitudes r_i ∈ {0..n−1},
    Δ_i = (ε/n) r_i, p_i = p − ε/2 + Δ_i; drop with m_i ~ Bernoulli(p_i), rescale the kept
    ones by 1/(1 − p_i). Ranks run from the largest magnitude (r = 0) to the smallest, so
    larger deltas are dropped less often, which is what MAGPRUNE is for (the survey's
    "higher rank for larger magnitude" would do the opposite). Rows: the last dimension
    of a matrix (a >2-D tensor is viewed as (shape[0], −1)); a vector is one row.
    """
    drop_rate = float(drop_rate)
    epsilon = float(epsilon)
    if epsilon < 0 or drop_rate - epsilon / 2 < 0 or drop_rate + epsilon / 2 >= 1:
        raise ValueError(
            f"della needs 0 <= drop_rate - epsilon/2 and drop_rate + epsilon/2 < 1, "
            f"got drop_rate={drop_rate}, epsilon={epsilon}"
        )
    values = task_vector.to(COMPUTE_DTYPE)
    rows = values.reshape(1, -1) if values.ndim < 2 else values.reshape(values.shape[0], -1)
    width = rows.shape[1]
    order = torch.argsort(rows.abs(), dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(width, device=rows.device).expand_as(order).contiguous())
    drop_probability = drop_rate - epsilon / 2 + (epsilon / width) * ranks.to(COMPUTE_DTYPE)
    dropped = torch.bernoulli(drop_probability, generator=generator)
    return ((1 - dropped) * rows / (1 - drop_probability)).reshape(task_vector.shape)


def della(
    task_vectors: Sequence[torch.Tensor],
    *,
    drop_rate: float = 0.5,
    epsilon: float = 0.1,
    seed: int = 0,
    scaling: float = 1.0,
) -> torch.Tensor:
    """DELLA-Merging (Deep et al. 2024): MAGPRUNE drop-and-rescale, elect sign, fuse, scale.

    Survey §DELLA-Merging: τ̂_t = MAGPRUNE(τ_t), S = sgn(Σ_t τ̂_t), C = {t : sgn(τ̂_t) = S},
    τ^avg = mean over C, θ_M = θ0 + λ τ^avg. ε = 0 reduces the drop to DARE. The survey
    gives no values; the defaults p = 0.5, ε = 0.1 are the middle of the DELLA paper's
    grid, λ = 1. A seeded ``torch.Generator`` draws the masks in task order.
    """
    _check_task_vectors(task_vectors)
    generator = _generator(seed, task_vectors[0].device)
    pruned = torch.stack([magprune(task_vector, drop_rate, epsilon, generator) for task_vector in task_vectors])
    return _as_output(float(scaling) * elect_sign_disjoint_mean(pruned), task_vectors[0])


# --------------------------------------------------------------------------- matrix methods


def procrustes_orthonormalise(matrix: torch.Tensor) -> torch.Tensor:
    """Nearest matrix with orthonormal columns: X = P D Qᵀ (thin SVD) ↦ P Qᵀ.

    Survey App. "Equivalence between Whitening and Procrustes", Proposition 1: P Qᵀ solves
    min ‖X_⊥ − X‖_F s.t. X_⊥ᵀ X_⊥ = I and equals the whitening X (XᵀX)^{-1/2}. Columns are
    orthonormal when X has at most as many columns as rows and full column rank.
    """
    left, _, right_transposed = torch.linalg.svd(matrix, full_matrices=False)
    return left @ right_transposed


class TsvBases(NamedTuple):
    """TSV-M's decorrelated bases: merged = left @ diag(singular_values) @ rightᵀ."""

    left: torch.Tensor  # U_⊥, (m, Σ k_t)
    singular_values: torch.Tensor  # σ̂, (Σ k_t,)
    right: torch.Tensor  # V_⊥, (n, Σ k_t)


def tsv_bases(task_vectors: Sequence[torch.Tensor], rank_per_task: int | None = None) -> TsvBases:
    """TSV-M's Procrustes-orthogonalised task singular vectors (Gargiulo et al. 2025).

    Survey §TSV-Merging and App. "Equivalence between Whitening and Procrustes": keep the
    top-k singular triplets of each Δ_t (k = ⌊min(m, n)/T⌋, at least 1, by default),
    concatenate Û = [Û_1 … Û_T], V̂ = [V̂_1 … V̂_T], σ̂ = [σ̂_1 … σ̂_T], and replace Û, V̂ by
    their Procrustes solutions U_⊥ = P Qᵀ, V_⊥ likewise. Triplets with a numerically zero
    singular value are left out: they carry no weight in the merge but their arbitrary
    singular vectors would perturb the Procrustes step (this only matters for rank-deficient
    task matrices, e.g. LoRA updates; full-rank matrices are as in the paper).
    """
    _check_task_vectors(task_vectors, matrix=True)
    shape = tuple(task_vectors[0].shape)
    if rank_per_task is None:
        rank_per_task = max(1, min(shape) // len(task_vectors))
    rank_per_task = int(rank_per_task)
    if not 1 <= rank_per_task <= min(shape):
        raise ValueError(f"rank_per_task must be in [1, {min(shape)}] for shape {shape}, got {rank_per_task}")
    svds = [thin_svd(task_vector, COMPUTE_DTYPE) for task_vector in task_vectors]
    keep = [min(rank_per_task, numerical_rank(svd.S, shape, task_vector.dtype))
            for svd, task_vector in zip(svds, task_vectors)]
    left, singular_values, right_transposed = concat_top(svds, keep)
    right = right_transposed.mT.contiguous()
    if singular_values.numel() == 0:
        return TsvBases(left, singular_values, right)
    return TsvBases(procrustes_orthonormalise(left), singular_values, procrustes_orthonormalise(right))


def tsv_m(task_vectors: Sequence[torch.Tensor], *, scaling: float = 1.0) -> torch.Tensor:
    """TSV-Merge (Gargiulo et al. 2025): τ_M = α U_⊥ Σ̂ V_⊥ᵀ.

    Survey §TSV-Merging: θ_M = θ0 + α M̂ with M̂ = Û_⊥ Σ̂ V̂_⊥ᵀ, per-task rank k = r/T
    (see ``tsv_bases``). Default α = 1 (TSV-M's setting without validation data).
    """
    _check_task_vectors(task_vectors, matrix=True)
    bases = tsv_bases(task_vectors)
    merged = (bases.left * bases.singular_values) @ bases.right.mT
    return _as_output(float(scaling) * merged, task_vectors[0])


def iso_c(task_vectors: Sequence[torch.Tensor], *, scaling: float = 1.0) -> torch.Tensor:
    """Iso-C (Marczak et al. 2025): flatten the spectrum of the task-arithmetic sum.

    Survey §Isotropic Model Merging: Δ_TA = Σ_t Δ_t = U Σ Vᵀ, Δ_Iso-C = σ̄ U Vᵀ with
    σ̄ = (1/r) Σ_i σ_i, and θ_M = θ0 + α Δ_Iso-C. r is the rank of Δ_TA: for a full-rank
    Δ_TA (the paper's case) r = min(m, n); for a rank-deficient one the directions with
    numerically zero σ are left out instead of being filled with arbitrary singular vectors.
    Default α = 1 (the paper tunes α on validation data).
    """
    _check_task_vectors(task_vectors, matrix=True)
    shape = tuple(task_vectors[0].shape)
    left, singular_values, right = _thin_svd(_stack(task_vectors).sum(dim=0))
    rank = numerical_rank(singular_values, shape, task_vectors[0].dtype)
    if rank == 0:
        return _as_output(torch.zeros(shape, dtype=COMPUTE_DTYPE, device=left.device), task_vectors[0])
    mean_singular_value = singular_values[:rank].mean()
    merged = mean_singular_value * (left[:, :rank] @ right[:, :rank].mT)
    return _as_output(float(scaling) * merged, task_vectors[0])


def iso_cts(
    task_vectors: Sequence[torch.Tensor], *, common_fraction: float = 0.8, scaling: float = 1.0
) -> torch.Tensor:
    """Iso-CTS (Marczak et al. 2025): common subspace plus task-specific directions, isotropic.

    Survey §Isotropic Model Merging: keep the top-k singular vectors of Δ_TA (k ≈ 0.8 r,
    ``common_fraction``); project each Δ_t off that subspace, Δ̄_t = Δ_t − U_k U_kᵀ Δ_t
    (eq. orthogonal), and keep its top s = (r − k)/T triplets; U_* = [U_k | Ū_1 … Ū_T],
    V_* likewise, orthogonalised by Procrustes as in TSV-M; σ̄ = (1/r)(Σ σ^cm + Σ σ^ts);
    Δ = σ̄ U_⊥ V_⊥ᵀ; θ_M = θ0 + α Δ. As in the authors' code, s = round((r − k)/T) and k is
    then set to r − T s so that k + T s = r = min(m, n). Directions with a numerically zero
    singular value are left out and σ̄ is the mean over the directions kept (see ``iso_c``).
    Default α = 1.
    """
    _check_task_vectors(task_vectors, matrix=True)
    common_fraction = _check_fraction(common_fraction, "common_fraction")
    shape = tuple(task_vectors[0].shape)
    full_rank = min(shape)
    task_count = len(task_vectors)
    stacked = _stack(task_vectors)
    per_task = min(round((full_rank - math.floor(common_fraction * full_rank)) / task_count), full_rank // task_count)
    common_rank = full_rank - task_count * per_task

    left, singular_values, right = _thin_svd(stacked.sum(dim=0))
    common_rank = min(common_rank, numerical_rank(singular_values, shape, task_vectors[0].dtype))
    common_left = left[:, :common_rank]
    lefts, values, rights = [common_left], [singular_values[:common_rank]], [right[:, :common_rank]]
    if per_task > 0:
        for task_matrix in stacked:
            residual = task_matrix - common_left @ (common_left.mT @ task_matrix)
            task_left, task_values, task_right = _thin_svd(residual)
            task_scale = float(torch.linalg.matrix_norm(task_matrix))
            keep = min(per_task, numerical_rank(task_values, shape, task_vectors[0].dtype, scale=task_scale))
            lefts.append(task_left[:, :keep])
            values.append(task_values[:keep])
            rights.append(task_right[:, :keep])
    kept_values = torch.cat(values)
    if kept_values.numel() == 0:
        return _as_output(torch.zeros(shape, dtype=COMPUTE_DTYPE, device=stacked.device), task_vectors[0])
    orthonormal_left = procrustes_orthonormalise(torch.cat(lefts, dim=1))
    orthonormal_right = procrustes_orthonormalise(torch.cat(rights, dim=1))
    merged = kept_values.mean() * (orthonormal_left @ orthonormal_right.mT)
    return _as_output(float(scaling) * merged, task_vectors[0])


def cart(task_vectors: Sequence[torch.Tensor], *, rank_ratio: float = 0.08, scaling: float = 1.0) -> torch.Tensor:
    """CART (Choi et al. 2025): weight average plus low-rank centred task matrices.

    Survey §CART: θ_M = θ_avg + λ Σ_t SVD_k(θ_t − θ_avg); in task vectors
    τ_M = τ̄ + λ Σ_t SVD_k(τ_t − τ̄) with τ̄ = mean_t τ_t. k = round(rank_ratio · min(m, n))
    (half up). At k = min(m, n) the low-rank step is the identity and the centred matrices
    sum to zero, so the result is exactly the weight average (computed as such); k = 0 gives
    it too. Defaults: rank ratio 8 % (the survey: "around 8 % of the full rank"), λ = 1.
    """
    _check_task_vectors(task_vectors, matrix=True)
    rank_ratio = _check_fraction(rank_ratio, "rank_ratio")
    stacked = _stack(task_vectors)
    mean = stacked.mean(dim=0)
    full_rank = min(mean.shape)
    rank = _count_from_fraction(rank_ratio, full_rank)
    if rank == 0 or rank >= full_rank:
        return _as_output(mean, task_vectors[0])
    low_rank_sum = torch.zeros_like(mean)
    for task_matrix in stacked:
        left, singular_values, right = _thin_svd(task_matrix - mean)
        low_rank_sum += (left[:, :rank] * singular_values[:rank]) @ right[:, :rank].mT
    return _as_output(mean + float(scaling) * low_rank_sum, task_vectors[0])


def star_truncate(task_matrix: torch.Tensor, energy_fraction: float) -> torch.Tensor:
    """STAR's spectral truncation and nuclear-norm rescale of one task matrix (float64).

    Survey §STAR: r = min{k : Σ_{i≤k} σ_i / Σ_{i≤R} σ_i ≥ η}, σ'_k = (Σ_{i≤R} σ_i / Σ_{i≤r} σ_i) σ_k
    for k ≤ r, Δ_out = Σ_{k≤r} σ'_k u_k v_kᵀ, so ‖Δ_out‖_* = ‖Δ‖_*.
    """
    energy_fraction = _check_fraction(energy_fraction, "energy_fraction", low_open=True)
    left, singular_values, right = _thin_svd(task_matrix.to(COMPUTE_DTYPE))
    nuclear_norm = singular_values.sum()
    if nuclear_norm == 0:
        return torch.zeros_like(task_matrix, dtype=COMPUTE_DTYPE)
    captured = torch.cumsum(singular_values, dim=0) / nuclear_norm
    rank = int((captured < energy_fraction - 1e-12).sum()) + 1
    rank = min(rank, singular_values.numel())
    rescaled = singular_values[:rank] * (nuclear_norm / singular_values[:rank].sum())
    return (left[:, :rank] * rescaled) @ right[:, :rank].mT


def star(task_vectors: Sequence[torch.Tensor], *, energy_fraction: float = 0.4) -> torch.Tensor:
    """STAR (Lee et al. 2025): truncate each task matrix's spectrum, rescale, average.

    Survey §STAR: Δ_M = (1/T) Σ_t Δ_{t,out} (see ``star_truncate``), θ_M = θ0 + Δ_M.
    Default η = 40 % (the survey: "typically set to 40"). No extra scaling.
    """
    _check_task_vectors(task_vectors, matrix=True)
    truncated = torch.stack([star_truncate(task_vector, energy_fraction) for task_vector in task_vectors])
    return _as_output(truncated.mean(dim=0), task_vectors[0])


class SftmSystem(NamedTuple):
    """SFTM's linear system (seed 001 Eq. 4) and its solution, rows/columns ordered (task, k)."""

    coefficient_matrix: torch.Tensor  # Σ ∘ U ∘ V, (r, r)
    singular_values: torch.Tensor  # σ, (r,)
    alpha: torch.Tensor  # α*, (r,)
    left: torch.Tensor  # [u_i^(k)], (m, r)
    right: torch.Tensor  # [v_i^(k)], (n, r)


def sftm_system(task_matrices: Sequence[torch.Tensor]) -> SftmSystem:
    """Build and solve SFTM's system (Σ ∘ U ∘ V) α = σ (seed 001 Eqs. 3–4, Algorithm 1).

    Σ_{(i,k),(i',k')} = σ_{i'}^{(k')}, U_{(i,k),(i',k')} = u_i^{(k)ᵀ} u_{i'}^{(k')},
    V_{(i,k),(i',k')} = v_{i'}^{(k')ᵀ} v_i^{(k)}; one equation per singular triplet of every
    task matrix, r_i = numerical rank of M_i. Since Σ ∘ U ∘ V = G diag(σ) with G = U ∘ V
    symmetric positive semi-definite, the solver solves G β = σ with the (Hermitian)
    pseudo-inverse and sets α = β / σ: the exact solution when the system is regular, the
    minimum-norm β when it is singular (e.g. two identical task matrices).
    """
    _check_task_vectors(task_matrices, matrix=True)
    shape = tuple(task_matrices[0].shape)
    svds = [thin_svd(task_matrix, COMPUTE_DTYPE) for task_matrix in task_matrices]
    keep = [numerical_rank(svd.S, shape, task_matrices[0].dtype) for svd in svds]
    left, singular_values, right_transposed = concat_top(svds, keep)
    right = right_transposed.mT.contiguous()
    gram = (left.mT @ left) * (right.mT @ right)
    coefficient_matrix = gram * singular_values.unsqueeze(0)
    if singular_values.numel() == 0:
        alpha = singular_values.clone()
    else:
        weighted = torch.linalg.pinv(gram, hermitian=True) @ singular_values
        alpha = weighted / singular_values
    return SftmSystem(coefficient_matrix, singular_values, alpha, left, right)


def sftm(task_vectors: Sequence[torch.Tensor], *, top_k: float = 0.2, scaling: float = 1.0) -> torch.Tensor:
    """SFTM (seed 001, Algorithms 1–2): superpose the task matrices' singular features.

    Alg. 2 line 5: keep the top-η entries by magnitude of each M_i (as TIES's trim);
    Alg. 1: SVD of each trimmed M_i, solve (Σ ∘ U ∘ V) α = σ (Eq. 4), M = Σ_i Σ_k α_i^(k)
    σ_i^(k) u_i^(k) v_i^(k)ᵀ (Eq. 1); Alg. 2 line 7: P = P_pre + γ M. The paper fixes no
    default: it searches η ∈ [0.1, 0.5] and γ ∈ [0.5, 1.2]; η = 0.2 follows the TIES trim
    it adopts, γ = 1 keeps every feature's gain ⟨u, M v⟩ = σ as Eq. 2 demands.
    """
    _check_task_vectors(task_vectors, matrix=True)
    trimmed = [keep_top_magnitude(task_vector, top_k) for task_vector in task_vectors]
    system = sftm_system(trimmed)
    merged = (system.left * (system.alpha * system.singular_values)) @ system.right.mT
    return _as_output(float(scaling) * merged, task_vectors[0])


def regmean(
    task_vectors: Sequence[torch.Tensor],
    *,
    gram_matrices: Sequence[torch.Tensor],
    off_diagonal_scale: float = 0.9,
) -> torch.Tensor:
    """RegMean (Jin et al. 2023) for one linear map's weight W (out × in), y = W x.

    Survey eq. (regmean solution) and App. "Derivation for the complete formulation of
    RegMean": W_M = (Σ_t G̃_t)^{-1} Σ_t G̃_t W_t in the survey's (in × out) layout, with
    G_t = X_tᵀ X_t the Gram matrix of the map's inputs for task t (in × in) and
    G̃_t = a G_t + (1 − a) diag(G_t) (non-diagonal entries scaled by a = 0.9, the paper's
    usual value; a = 1 is the plain least-squares merge of Σ_t ‖X_t Wᵀ − X_t W_tᵀ‖²).
    With W_t = W_0 + τ_t the base weight cancels: τ_M = (Σ_t τ_t G̃_t)(Σ_t G̃_t)^{-1}, so
    only the task vectors are needed. Weights stored (in × out), e.g. GPT-2's Conv1D, must
    be transposed by the caller. A singular Σ_t G̃_t (an input feature never active) is
    handled with the pseudo-inverse.
    """
    _check_task_vectors(task_vectors, matrix=True)
    off_diagonal_scale = _check_fraction(off_diagonal_scale, "off_diagonal_scale")
    out_features, in_features = task_vectors[0].shape
    if gram_matrices is None or len(gram_matrices) != len(task_vectors):
        count = "none" if gram_matrices is None else len(gram_matrices)
        raise ValueError(f"regmean needs one Gram matrix per task vector: got {count} for {len(task_vectors)} tasks")
    total_gram = torch.zeros(in_features, in_features, dtype=COMPUTE_DTYPE, device=task_vectors[0].device)
    right_hand_side = torch.zeros(in_features, out_features, dtype=COMPUTE_DTYPE, device=task_vectors[0].device)
    for index, (task_vector, gram) in enumerate(zip(task_vectors, gram_matrices)):
        if tuple(gram.shape) != (in_features, in_features):
            raise ValueError(
                f"gram_matrices[{index}] has shape {tuple(gram.shape)}, expected ({in_features}, {in_features}) "
                f"for a weight of shape {(out_features, in_features)} (out × in)"
            )
        gram = gram.to(device=total_gram.device, dtype=COMPUTE_DTYPE)
        scaled_gram = off_diagonal_scale * gram + (1 - off_diagonal_scale) * torch.diag(torch.diagonal(gram))
        total_gram += scaled_gram
        right_hand_side += scaled_gram @ task_vector.to(COMPUTE_DTYPE).mT
    try:
        merged_transposed = torch.linalg.solve(total_gram, right_hand_side)
    except torch.linalg.LinAlgError:
        merged_transposed = torch.linalg.pinv(total_gram, hermitian=True) @ right_hand_side
    return _as_output(merged_transposed.mT, task_vectors[0])


# ---------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class MergeMethod:
    """A registered strategy: ``function(task_vectors, **options)`` returns the merged task vector."""

    name: str
    function: Callable[..., torch.Tensor]
    defaults: Mapping[str, object] = field(default_factory=dict)
    description: str = ""
    matrix_only: bool = False

    def resolve_options(self, options: Mapping[str, object] | None = None) -> dict[str, object]:
        """Defaults updated by ``options``; unknown keys raise, strings (from the CLI) are coerced.

        A string value takes the type of the default: "0.2" or "20%" for a float, "3" for an
        int, "true"/"false" for a bool.
        """
        resolved = dict(self.defaults)
        for key, value in (options or {}).items():
            if key not in self.defaults:
                known = ", ".join(sorted(self.defaults)) or "none"
                raise ValueError(f"unknown option {key!r} for merge method {self.name!r} (options: {known})")
            resolved[key] = _coerce(value, self.defaults[key], f"{self.name} option {key!r}")
        return resolved


def _coerce(value: object, default: object, what: str) -> object:
    if not isinstance(value, str) or isinstance(default, str):
        return value
    text = value.strip()
    try:
        if isinstance(default, bool):
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"{what}: cannot read {value!r} as {type(default).__name__}") from None
    return value


STRATEGIES: dict[str, MergeMethod] = {
    method.name: method
    for method in (
        MergeMethod(
            "weight-average", weight_average, {}, "mean of the fine-tuned weights (Wortsman et al. 2022, model soups)"
        ),
        MergeMethod(
            "task-arithmetic",
            task_arithmetic,
            {"scaling": 1.0},
            "θ0 + λ·Σ task vectors (Ilharco et al. 2023, Task Arithmetic)",
        ),
        MergeMethod(
            "ties",
            ties,
            {"top_k": 0.2, "scaling": 1.0},
            "trim to top-k %, elect sign, disjoint mean (Yadav et al. 2023, TIES-Merging)",
        ),
        MergeMethod(
            "dare",
            dare,
            {"drop_rate": 0.9, "seed": 0, "base": "task-arithmetic", "top_k": 1.0, "scaling": 1.0},
            "random drop p and rescale 1/(1-p), then task arithmetic or TIES (Yu et al. 2024, DARE)",
        ),
        MergeMethod(
            "breadcrumbs",
            breadcrumbs,
            {"beta": 0.85, "gamma": 0.993, "scaling": 1.0},
            "mask the smallest β and largest 1-γ magnitudes per tensor (Davari & Belilovsky 2024, Model Breadcrumbs)",
        ),
        MergeMethod(
            "della",
            della,
            {"drop_rate": 0.5, "epsilon": 0.1, "seed": 0, "scaling": 1.0},
            "magnitude-ranked drop and rescale, elect sign, fuse (Deep et al. 2024, DELLA-Merging)",
        ),
        MergeMethod(
            "tsv-m",
            tsv_m,
            {"scaling": 1.0},
            "top r/T singular vectors per task, Procrustes-decorrelated (Gargiulo et al. 2025, TSV-Merge)",
            matrix_only=True,
        ),
        MergeMethod(
            "iso-c",
            iso_c,
            {"scaling": 1.0},
            "task-arithmetic sum with a flat singular spectrum (Marczak et al. 2025, Iso-C)",
            matrix_only=True,
        ),
        MergeMethod(
            "iso-cts",
            iso_cts,
            {"common_fraction": 0.8, "scaling": 1.0},
            "Iso-C on a common subspace plus task-specific directions (Marczak et al. 2025, Iso-CTS)",
            matrix_only=True,
        ),
        MergeMethod(
            "cart",
            cart,
            {"rank_ratio": 0.08, "scaling": 1.0},
            "weight average plus low-rank centred task matrices (Choi et al. 2025, CART)",
            matrix_only=True,
        ),
        MergeMethod(
            "star",
            star,
            {"energy_fraction": 0.4},
            "spectral truncation to η of the nuclear norm, rescale, average (Lee et al. 2025, STAR)",
            matrix_only=True,
        ),
        MergeMethod(
            "sftm",
            sftm,
            {"top_k": 0.2, "scaling": 1.0},
            "trim, then superpose singular features by solving (Σ∘U∘V)α = σ (Qiu et al., SFTM)",
            matrix_only=True,
        ),
        MergeMethod(
            "regmean",
            regmean,
            {"off_diagonal_scale": 0.9},
            "closed-form least squares on recorded input Gram matrices (Jin et al. 2023, RegMean)",
            matrix_only=True,
        ),
    )
}

# ------------------------------------------------------------------- per-parameter helper

PARAMETER_KINDS = ("matrix", "embedding", "bias", "norm")

DEFAULT_FALLBACK: dict[str, tuple[str, dict[str, object]]] = {
    # SFTM Alg. 2 lines 9–16 / DESIGN.md: biases and embeddings by task arithmetic,
    # normalisation parameters by the mean.
    "embedding": ("task-arithmetic", {}),
    "bias": ("task-arithmetic", {}),
    "norm": ("weight-average", {}),
}

_EMBEDDING_NAME = re.compile(r"embed|(^|\.)(wte|wpe|shared|lm_head)(\.|$)")
_NORM_NAME = re.compile(r"norm|(^|[._])ln(\d*|_\w*)?(\.|$)")


def parameter_kind(name: str, shape: Sequence[int]) -> str:
    """Classify a parameter as "matrix", "embedding", "bias" or "norm" from its name and shape.

    - "norm": 0/1-D tensors named *norm* or *ln* (ln_1, ln_f, embeddings.LayerNorm, …),
      weights and biases;
    - "embedding": other names containing "embed" or a module wte / wpe / shared / lm_head
      (the output embedding), any shape;
    - "bias": any other 0/1-D tensor;
    - "matrix": any other tensor with 2 or more dimensions.
    """
    lowered = name.lower()
    if len(shape) < 2 and _NORM_NAME.search(lowered):
        return "norm"
    if _EMBEDDING_NAME.search(lowered):
        return "embedding"
    return "bias" if len(shape) < 2 else "matrix"


def _parameter_seed(seed: int, name: str) -> int:
    """Mix the user's seed with the parameter name so that equal-shaped tensors get different masks."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode("utf-8"))) % (2**63)


def merge_parameter(
    name: str,
    task_vectors: Sequence[torch.Tensor],
    method: str | MergeMethod,
    options: Mapping[str, object] | None = None,
    *,
    kind: str | None = None,
    fallback: Mapping[str, str | tuple[str, Mapping[str, object]]] | None = None,
    gram_matrices: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Merge the task vectors of the parameter ``name`` with ``method``; returns τ_M.

    ``kind`` (default: ``parameter_kind(name, shape)``) decides the route. A matrix-only
    method given an embedding, bias or norm uses ``fallback[kind]`` instead: a method name
    or (name, options); the caller's ``fallback`` entries replace those of
    ``DEFAULT_FALLBACK``. Element-wise methods (TA, TIES, DARE, …) apply to every kind, as
    their papers do. Tensors with more than two dimensions are merged by matrix-only methods
    as (shape[0], −1) matrices (SFTM §3.3) and reshaped back. A ``seed`` option is mixed with
    ``name`` so that tensors of equal shape do not share one random mask. ``gram_matrices``
    (one per task) is forwarded to RegMean.
    """
    merge_method = _lookup(method)
    _check_task_vectors(task_vectors)
    shape = tuple(task_vectors[0].shape)
    kind = kind or parameter_kind(name, shape)
    if kind not in PARAMETER_KINDS:
        raise ValueError(f"{name}: kind must be one of {PARAMETER_KINDS}, got {kind!r}")
    resolved = merge_method.resolve_options(options)

    if merge_method.matrix_only and kind != "matrix":
        routes = {**DEFAULT_FALLBACK, **(fallback or {})}
        if kind not in routes:
            raise ValueError(f"{name}: no fallback for kind {kind!r} under matrix-only method {merge_method.name!r}")
        route = routes[kind]
        fallback_name, fallback_options = (route, {}) if isinstance(route, str) else route
        fallback_method = _lookup(fallback_name)
        if fallback_method.matrix_only:
            raise ValueError(
                f"{name}: fallback for kind {kind!r} must be an element-wise method, got {fallback_name!r}"
            )
        return merge_parameter(name, task_vectors, fallback_method, fallback_options, kind=kind)

    if "seed" in resolved:
        resolved["seed"] = _parameter_seed(resolved["seed"], name)
    if merge_method.name == "regmean":
        if gram_matrices is None:
            raise ValueError(f"{name}: regmean needs gram_matrices (the inputs' X_tᵀX_t per task) for this linear map")
        resolved["gram_matrices"] = gram_matrices
    elif gram_matrices is not None:
        raise ValueError(f"{name}: gram_matrices are only used by regmean, not {merge_method.name!r}")

    if merge_method.matrix_only:
        if len(shape) < 2:
            raise ValueError(f"{name}: method {merge_method.name!r} needs a matrix, got shape {shape}")
        if len(shape) > 2:
            matrices = [task_vector.reshape(shape[0], -1) for task_vector in task_vectors]
            return merge_method.function(matrices, **resolved).reshape(shape)
    return merge_method.function(list(task_vectors), **resolved)


def _lookup(method: str | MergeMethod) -> MergeMethod:
    if isinstance(method, MergeMethod):
        return method
    if method not in STRATEGIES:
        raise ValueError(f"unknown merge method {method!r}; known: {', '.join(STRATEGIES)}")
    return STRATEGIES[method]

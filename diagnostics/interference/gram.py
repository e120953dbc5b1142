"""The interference metrics through cross-Gram matrices: the default route (``exact_svd=False``).

For the T task matrices Δ_t (m × n) of one weight, STI, SAR, I(k), R(k) and the effective rank
(:mod:`submerge.diagnostics.interference.metrics`) need the singular values and some singular vectors of 2T + 1
matrices: the Δ_t, the centred Δ̄_t = Δ_t − (1/T) Σ_s Δ_s and the merged Δ_M. Work in the tall form
A_t = Δ_t (m ≥ n) or A_t = Δ_tᵀ (m < n), L × r with r = min(m, n), and let K_st = A_sᵀA_t (r × r). Every
one of the 2T + 1 matrices is a linear combination of the A_t, so its Gram matrix is a combination of the
T(T+1)/2 cross-Gram matrices K_st, and one eigendecomposition of that r × r Gram (:func:`gram_eigh`) gives
its singular values σ_a = √λ_a and the singular vectors Y of the short side. The long side never needs to be
formed: with Z = A Y Σ⁻¹ its vectors,

- STI: Z_iᵀZ_j = Σ_i⁻¹ Y_iᵀ K_ij Y_j Σ_j⁻¹ (STI is symmetric in U and V, so which side is which does not matter);
- I(k) (right singular vectors V): Σ_i V_iᵀV_j Σ_j = Σ_i Y_iᵀY_j Σ_j when V = Y (m ≥ n), Y_iᵀ K_ij Y_j when V = Z;
  at k = r it is ‖Δ_iΔ_jᵀ‖_F² = tr(K_ii K_jj) (m ≥ n) or ‖K_ij‖_F² (m < n), no vectors at all;
- SAR (left singular vectors U of Δ_M): ‖U_kᵀΔ_t‖_F² = Σ_{a≤k} ‖(Y_kᵀ C_t)_a‖² / λ_a with C_t = A_MᵀA_t when U = Z,
  Σ_{a≤k} y_aᵀ K_tt y_a when U = Y.

Cost. 6 Gram products of L × r matrices (T = 3; the T symmetric K_tt by BLAS ``syrk`` on the CPU, half the
multiply-adds, :func:`gram_matrix`) and 2T + 1 symmetric r × r eigendecompositions instead of 2T + 1 thin SVDs of
m × n matrices; the products after them are r-sized. The eigendecompositions are full:
I(k) at the grid's rank fraction 0.64 needs 64 % of every Δ_t's and Δ̄_t's singular vectors, SAR's k_M of a
flat spectrum most of Δ_M's, and the effective rank every singular value, so a truncated or randomised SVD
would not be cheaper here (and a randomised one needs a spectral gap that full fine-tunes do not have).

Error bound. A Gram matrix squares the condition number: an eigenvalue from the float32 Gram carries an
absolute error of about c · eps · λ_max (c a small multiple of √L from the product's rounding), so σ_a = √λ_a
is accurate to about c · eps · σ_max² / (2 σ_a), and a singular vector to about c · eps · σ_max² / (σ_a · gap)
where the exact SVD's is eps · σ_max / gap. Hence three guards:

- σ_a with λ_a < ``REFINE_BELOW`` · λ_max are recomputed from the matrix itself as ‖A y_a‖ (a Rayleigh
  quotient, accurate to second order in the error of y_a), for the Δ_t and the Δ̄_t, whose small singular values
  enter the effective rank and R(k);
- STI's entrywise norm depends on individual singular vectors (not only on subspaces, as I(k) and SAR, which also
  weight each direction by its σ): when STI keeps a direction with λ_a < ``STI_RESOLVED`` · λ_max (a signal over a
  noise floor, which STI's k = r/T reaches), the Δ_t's figures come from thin SVDs instead (``metrics``);
- centred and merged Grams are formed from the matrices themselves where combining the K_st would cancel
  (:class:`CrossGrams`).

The bound, which ``tests/test_interference.py`` checks on flat, low-rank, low-rank-plus-noise, decaying, agreeing
and cancelling spectra and ``benchmarks/scale.py`` on Llama-2-7B-sized matrices: STI, SAR and I(k) within 1e-4
relative of the exact route; R(k) within 1e-4 relative to max(R(k), 1e-2 · R(0)) — tails holding at least 1 % of
the energy to 1e-4 relative, smaller ones to 1e-6 of the total energy (both routes' R(k) of a rank-deficient matrix
is float32 rounding noise); the effective rank within 1e-3 (a matrix whose spectrum falls below √eps · σ_max has
singular values the Gram does not resolve one by one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from submerge.diagnostics.spectral import gram_eigh, gram_matrix

__all__ = ["REFINE_BELOW", "STI_RESOLVED", "CrossGrams", "GramSpectrum", "gram_spectrum", "resolves_sti",
           "row_space_curves", "sar_projections", "sti_from_spectra"]

REFINE_BELOW = 1e-2  # λ_a / λ_max under which σ_a of a Δ_t is recomputed as ‖A_t y_a‖
STI_RESOLVED = 1e-3  # the smallest λ_a / λ_max among STI's kept directions that the float32 Gram resolves
_COLUMNS = 256  # columns of A_t y per product when refining (bounded memory on a vocabulary-sized matrix)
_ROWS = 4096  # rows per float64 block when averaging the task matrices


class GramSpectrum(NamedTuple):
    """Singular values ``S`` (r,) float64, descending, and short-side singular vectors ``Y`` (r, r) of one matrix."""

    S: torch.Tensor
    Y: torch.Tensor


class CrossGrams:
    """The cross-Gram matrices K_st = A_sᵀA_t of T task matrices in their tall form, and the Grams of the centred and
    the merged matrices (in the task matrices' dtype).

    ``right`` is True when A_t = Δ_t (m ≥ n: the short side is V), False when A_t = Δ_tᵀ (U). ``merged``: Δ_M for
    SAR, or None for task arithmetic Σ_t Δ_t. The centred Grams Ā_sᵀĀ_t and task arithmetic's A_ΣᵀA_t are
    combinations of the K_st unless the combination cancels: when a centred matrix holds less than
    1/``CANCELLATION`` of its task matrix's energy (tasks that nearly agree), or A_Σ less than 1/``CANCELLATION``
    of Σ_t ‖A_t‖² (tasks that nearly cancel), its Grams are products of the matrix itself, so that the float32
    rounding of the K_st is never amplified by more than ``CANCELLATION``.
    """

    CANCELLATION = 4.0

    def __init__(self, task_matrices: Sequence[torch.Tensor], merged: torch.Tensor | None = None):
        rows, cols = task_matrices[0].shape
        self.right = rows >= cols
        self.tall = [delta if self.right else delta.mT for delta in task_matrices]
        self.dtype = self.tall[0].dtype
        count = len(self.tall)
        self.pairs = {(s, t): gram_matrix(self.tall[s]) if s == t else self.tall[s].mT @ self.tall[t]
                      for s in range(count) for t in range(s, count)}
        self._sum_cross = [sum(self.get(s, t) for s in range(count)) for t in range(count)]  # A_Σᵀ A_t
        self._sum_gram = sum(self._sum_cross)  # A_Σᵀ A_Σ
        self._mean = None
        self._centred_grams: dict[int, torch.Tensor] = {}
        energies = [_trace(self.get(t, t)) for t in range(count)]
        total = _trace(self._sum_gram)
        centred = [energies[t] - 2 * _trace(self._sum_cross[t]) / count + total / count**2 for t in range(count)]
        self._direct_centred = any(self.CANCELLATION * c < e for c, e in zip(centred, energies))
        self._merged = merged
        if merged is None and self.CANCELLATION * total < sum(energies):
            self._merged = sum(task_matrices)  # task arithmetic, formed: Σ_t K_st would cancel
        if self._merged is None:  # A_M = A_Σ: C_t = A_Σᵀ A_t, A_Mᵀ A_M = Σ_t C_t
            self.merged_gram = self._sum_gram
        else:
            self._merged = self._merged if self.right else self._merged.mT
            self._merged = self._merged.to(device=self.tall[0].device, dtype=self.dtype)
            self.merged_gram = gram_matrix(self._merged)

    def get(self, s: int, t: int) -> torch.Tensor:
        """K_st = A_sᵀ A_t."""
        return self.pairs[(s, t)] if s <= t else self.pairs[(t, s)].mT

    def merged_cross(self, t: int) -> torch.Tensor:
        """C_t = A_Mᵀ A_t."""
        if self._merged is None:
            return self._sum_cross[t]
        return self._merged.mT @ self.tall[t]

    def centred_tall(self, t: int) -> torch.Tensor:
        """Ā_t = A_t − (1/T) Σ_u A_u (the mean taken in float64, row block by row block, and kept)."""
        if self._mean is None:
            self._mean = torch.empty_like(self.tall[0])
            for start in range(0, self._mean.shape[0], _ROWS):
                rows = slice(start, start + _ROWS)
                self._mean[rows] = sum(tall[rows].to(torch.float64) for tall in self.tall) / len(self.tall)
        return self.tall[t] - self._mean

    def centred(self, s: int, t: int) -> torch.Tensor:
        """Ā_sᵀ Ā_t: K_st − (1/T)(A_Σᵀ A_s)ᵀ − (1/T) A_Σᵀ A_t + (1/T²) A_Σᵀ A_Σ, or the product itself (cancellation)."""
        if s == t and s in self._centred_grams:
            return self._centred_grams[s]
        if self._direct_centred:
            value = gram_matrix(self.centred_tall(s)) if s == t else self.centred_tall(s).mT @ self.centred_tall(t)
        else:
            count = len(self.tall)
            value = self.get(s, t) - (self._sum_cross[s].mT + self._sum_cross[t]) / count + self._sum_gram / count**2
        if s == t:
            self._centred_grams[s] = value  # each is needed twice: its spectrum and I(r)
        return value


def _trace(matrix: torch.Tensor) -> float:
    return float(torch.diagonal(matrix).sum(dtype=torch.float64))


def gram_spectrum(gram: torch.Tensor, tall: torch.Tensor | None = None) -> GramSpectrum:
    """σ and Y of a matrix from its Gram ``gram`` = AᵀA; with ``tall`` = A, the σ_a with λ_a < ``REFINE_BELOW`` ·
    λ_max are recomputed as ‖A y_a‖ (float64 norms) and the spectrum re-sorted, vectors with it."""
    values, vectors = gram_eigh(gram)
    singular = values.sqrt()
    if tall is None or values.numel() == 0:
        return GramSpectrum(singular, vectors)
    small = torch.nonzero(values < REFINE_BELOW * values[0]).flatten().tolist()
    for start in range(0, len(small), _COLUMNS):
        chosen = small[start : start + _COLUMNS]
        images = tall @ vectors[:, chosen]
        singular[chosen] = torch.linalg.vector_norm(images.to(torch.float64), dim=0).to(singular.device)
    order = torch.argsort(singular, descending=True, stable=True)
    return GramSpectrum(singular[order], vectors[:, order.to(vectors.device)])


def resolves_sti(spectra: Sequence[GramSpectrum], kept: Sequence[int]) -> bool:
    """Whether the float32 Gram resolves every direction STI keeps: σ_k² ≥ ``STI_RESOLVED`` · σ_max² of each task."""
    return all(k == 0 or float(spectrum.S[k - 1]) ** 2 >= STI_RESOLVED * float(spectrum.S[0]) ** 2
               for spectrum, k in zip(spectra, kept))


def sti_from_spectra(spectra: Sequence[GramSpectrum], kept: Sequence[int], grams: CrossGrams) -> tuple[float, float]:
    """(‖(UᵀU − I) Σ (VᵀV − I)‖₁, Σσ) over the top ``kept[t]`` triplets of each task (seed 003, TSV-M's STI).

    Block by block over tasks: the diagonal blocks of UᵀU − I and VᵀV − I are 0 (each task's singular vectors are
    orthonormal), the short side's off-diagonal blocks are Y_iᵀY_j and the long side's Σ_i⁻¹ Y_iᵀ K_ij Y_j Σ_j⁻¹,
    so block (i, j) of the product is Σ_{l ≠ i, j} Q_il Σ_l P_lj.
    """
    count = len(spectra)
    vectors = [spectrum.Y[:, :k] for spectrum, k in zip(spectra, kept)]
    sigma = [spectrum.S[:k].to(vectors[t].device, vectors[t].dtype) for t, (spectrum, k) in enumerate(zip(spectra, kept))]
    sigma_sum = float(sum(float(spectrum.S[:k].sum()) for spectrum, k in zip(spectra, kept)))
    short, long = {}, {}
    for i in range(count):
        for j in range(i + 1, count):
            short[(i, j)] = vectors[i].mT @ vectors[j]
            long[(i, j)] = (1 / sigma[i])[:, None] * (vectors[i].mT @ grams.get(i, j) @ vectors[j]) / sigma[j][None, :]
            short[(j, i)], long[(j, i)] = short[(i, j)].mT, long[(i, j)].mT
    total = 0.0
    for i in range(count):
        for j in range(count):
            block = None
            for middle in range(count):
                if middle in (i, j) or kept[middle] == 0:
                    continue
                term = (long[(i, middle)] * sigma[middle][None, :]) @ short[(middle, j)]
                block = term if block is None else block + term
            if block is not None:
                total += float(block.abs().sum(dtype=torch.float64))
    return total, sigma_sum


def sar_projections(merged: GramSpectrum, k_merged: int, grams: CrossGrams) -> list[float]:
    """‖U_kᵀΔ_t‖_F² of every Δ_t, U_k the top ``k_merged`` left singular vectors of Δ_M (seed 003, Iso-C's SAR)."""
    if k_merged == 0:
        return [0.0] * len(grams.tall)
    basis = merged.Y[:, :k_merged]
    projections = []
    for t in range(len(grams.tall)):
        if grams.right:  # U = Z = A_M Y Σ⁻¹: ‖Σ⁻¹ Yᵀ C_t‖²
            rows = (basis.mT @ grams.merged_cross(t)).to(torch.float64)
            energy = merged.S[:k_merged].to(rows.device) ** 2
            projections.append(float(((rows**2).sum(dim=1) / energy).sum()))
        else:  # U = Y: Σ_a y_aᵀ K_tt y_a
            images = grams.get(t, t) @ basis
            projections.append(float((images * basis).sum(dtype=torch.float64)))
    return projections


def row_space_curves(spectra: Sequence[GramSpectrum], ranks: Sequence[int], grams: CrossGrams, *,
                     centred: bool) -> list[float]:
    """I(k) = Σ_{i≠j} ‖Σ̃_i V_iᵀ V_j Σ̃_j‖_F at every k of ``ranks`` (seed 003, CART; NaN where a task's top-k energy
    is 0), on the task matrices or (``centred``) on the centred ones."""
    count = len(spectra)
    cross = grams.centred if centred else grams.get
    full = len(spectra[0].S)
    partial = [k for k in ranks if k < full]
    k_max = max(partial, default=0)
    blocks = {}
    for i in range(count):
        for j in range(i + 1, count):
            pair_cross = None if grams.right else cross(i, j)  # V = Y needs no cross-Gram
            blocks[(i, j)] = _pair_block(spectra[i], spectra[j], pair_cross, k_max)
    whole = {}
    if len(partial) < len(ranks):
        for i in range(count):
            for j in range(i + 1, count):
                whole[(i, j)] = math.sqrt(_whole_pair(cross, i, j, grams.right))
    curve = []
    for k in ranks:
        energies = [float((spectrum.S[:k] ** 2).sum()) for spectrum in spectra]
        if any(energy == 0.0 for energy in energies):
            curve.append(float("nan"))
            continue
        total = 0.0
        for (i, j), block in blocks.items():
            norm = whole[(i, j)] if k >= full else float(torch.linalg.matrix_norm(block[:k, :k]))
            total += 2.0 * norm / math.sqrt(energies[i] * energies[j])
        curve.append(total)
    return curve


def _pair_block(first: GramSpectrum, second: GramSpectrum, cross: torch.Tensor | None, k: int) -> torch.Tensor:
    """Σ_i V_iᵀ V_j Σ_j over the top k directions (k × k, float64): from V = Y, or (``cross`` = K_ij) from
    V = Z as Y_iᵀ K_ij Y_j."""
    if k == 0:
        return torch.zeros(0, 0, dtype=torch.float64, device=first.Y.device)
    left_vectors, right_vectors = first.Y[:, :k], second.Y[:, :k]
    if cross is None:
        gram = (left_vectors.mT @ right_vectors).to(torch.float64)
        return first.S[:k].to(gram.device)[:, None] * gram * second.S[:k].to(gram.device)[None, :]
    return (left_vectors.mT @ cross @ right_vectors).to(torch.float64)


def _whole_pair(cross, i: int, j: int, right: bool) -> float:
    """‖Δ_i Δ_jᵀ‖_F², the k = r value of ‖Σ_i V_iᵀ V_j Σ_j‖_F²: tr(K_ii K_jj) or ‖K_ij‖_F² (float64)."""
    if right:
        return float((cross(i, i).to(torch.float64) * cross(j, j).to(torch.float64)).sum())
    return float((cross(i, j).to(torch.float64) ** 2).sum())

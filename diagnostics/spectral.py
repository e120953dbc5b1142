"""Thin SVDs and the truncate-and-concatenate step shared by the interference metrics and the merges.

One home for three things that TSV-M's STI (``submerge.diagnostics.interference``), TSV-M's
merge (``submerge.merge.strategies.tsv_bases``) and SFTM's linear system
(``submerge.merge.strategies.sftm_system``) all do:

- a full thin SVD ``x = U diag(S) Vh`` in a chosen dtype (:func:`thin_svd`);
- the numerical rank of a spectrum, numpy's ``matrix_rank`` tolerance
  σ_i > scale · max(m, n) · eps (:func:`numerical_rank`);
- keeping the top k_t triplets of each of T decompositions and concatenating
  them into U = [U_1 … U_T], σ = [σ_1 … σ_T], Vh = [Vh_1; …; Vh_T]
  (:func:`concat_top`), the block structure of TSV-M (seed 003, §TSV-Merging)
  and of SFTM (seed 001, Eq. 3–4);
- the Gram matrix XᵀX of a tall matrix at half the products of a general matrix product
  (:func:`gram_matrix`, BLAS ``syrk``), and the eigendecomposition of a symmetric positive
  semi-definite Gram matrix, largest eigenvalue first (:func:`gram_eigh`): the singular values
  and one side's singular vectors of X from XᵀX, as ``submerge.diagnostics.interference.gram``
  uses them.

``merge`` imports this module; it imports nothing from ``merge`` or from the
other diagnostics modules, so both packages can use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import NamedTuple

import scipy.linalg
import scipy.linalg.blas
import scipy.linalg.lapack
import threadpoolctl
import torch

__all__ = ["SVD_DTYPES", "Svd", "concat_top", "gram_eigh", "gram_matrix", "numerical_rank", "solve_symmetric_right",
           "svd_dtype", "thin_svd", "tolerance_dtype"]

SVD_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class Svd(NamedTuple):
    """Thin SVD x = U diag(S) Vh: U (m, r) and Vh (r, n) in the SVD dtype, S (r,) float64, descending."""

    U: torch.Tensor
    S: torch.Tensor
    Vh: torch.Tensor


def svd_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"float64"`` (or the torch dtypes) → the torch dtype; anything else is an error."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.float64):
            return dtype
    elif dtype in SVD_DTYPES:
        return SVD_DTYPES[dtype]
    raise ValueError(f"svd_dtype must be 'float32' or 'float64', got {dtype!r}")


def thin_svd(matrix: torch.Tensor, dtype: str | torch.dtype) -> Svd:
    """Exact thin SVD ``torch.linalg.svd(matrix.to(dtype), full_matrices=False)`` on the matrix's device.

    U and Vh stay in ``dtype``; S is returned in float64 (exact for both dtypes). A wide matrix (m < n) is
    decomposed as its transpose, Xᵀ = U' S V'ᵀ ⇒ X = V' S U'ᵀ: the same factorisation, and LAPACK's
    divide and conquer is about 2.6× faster on the tall form (4096 × 11008 in float32 on 2 cores: 28 s wide,
    11 s tall).
    """
    matrix = matrix.to(svd_dtype(dtype))
    if matrix.ndim == 2 and matrix.shape[0] < matrix.shape[1]:
        U, S, Vh = torch.linalg.svd(matrix.mT, full_matrices=False)
        return Svd(Vh.mT, S.to(torch.float64), U.mT)
    U, S, Vh = torch.linalg.svd(matrix, full_matrices=False)
    return Svd(U, S.to(torch.float64), Vh)


def tolerance_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision a rank is judged at: float64 for float64 inputs, float32 for every narrower float."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def numerical_rank(singular_values: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, *,
                   scale: float | None = None) -> int:
    """Number of σ_i > scale · max(m, n) · eps(dtype), numpy's ``matrix_rank`` tolerance.

    ``scale`` defaults to σ_max = σ_0 (the spectrum is sorted descending; 0 for an
    empty one); ``dtype`` is the inputs' dtype, judged at :func:`tolerance_dtype`
    precision (bf16 / fp16 at float32's eps).
    """
    if scale is None:
        scale = float(singular_values[0]) if singular_values.numel() else 0.0
    tolerance = scale * max(shape) * torch.finfo(tolerance_dtype(dtype)).eps
    return int((singular_values > tolerance).sum())


def concat_top(svds: Sequence[Svd], keep: Sequence[int]) -> Svd:
    """The top ``keep[t]`` triplets of each decomposition, concatenated block by block.

    Returns ``Svd(U, S, Vh)`` with U = [U_1[:, :k_1] … U_T[:, :k_T]] (m, Σk),
    S = [S_1[:k_1] … S_T[:k_T]] (Σk,) and Vh = [Vh_1[:k_1]; …; Vh_T[:k_T]] (Σk, n),
    in the factors' dtypes. Σk = 0 gives empty blocks (m, 0), (0,), (0, n).
    """
    if len(svds) != len(keep):
        raise ValueError(f"concat_top: {len(svds)} decompositions but {len(keep)} ranks to keep")
    U = torch.cat([svd.U[:, :k] for svd, k in zip(svds, keep)], dim=1)
    S = torch.cat([svd.S[:k] for svd, k in zip(svds, keep)])
    Vh = torch.cat([svd.Vh[:k, :] for svd, k in zip(svds, keep)], dim=0)
    return Svd(U, S, Vh)


#: scipy's BLAS and LAPACK (its own OpenBLAS: a thread pool beside torch's OpenMP one) run a call whose square result
#: has an order below this on one thread (`scipy_threads`). With the cores busy (another job) the two pools wait on
#: each other: a Cholesky and solve of order 576 right after a torch product took 872 ms on two threads and 41 ms on
#: one (2 cores, beside the test suite), and RegMean's solves were a third of the evidence step. On a quiet machine
#: one thread costs nothing at 576 (32 / 30 ms) but 1.4x at 1,536 (418 / 294 ms), so larger orders keep the threads
#: set outside (`benchmarks/scipy_threads.py`).
ONE_THREAD_BELOW = 1024

_controller: threadpoolctl.ThreadpoolController | None = None


def scipy_threads(order: int):
    """The context a scipy BLAS / LAPACK call on an (order × order) result runs in: one thread below
    `ONE_THREAD_BELOW` (the same rounding whatever the engine's thread count), else the threads set outside."""
    global _controller
    if order >= ONE_THREAD_BELOW:
        return contextlib.nullcontext()
    if _controller is None:
        _controller = threadpoolctl.ThreadpoolController()  # scipy's libraries are loaded: this module imports them
    return _controller.limit(limits=1, user_api="blas")


_SYRK = {torch.float32: scipy.linalg.blas.ssyrk, torch.float64: scipy.linalg.blas.dsyrk}


def gram_matrix(tall: torch.Tensor) -> torch.Tensor:
    """XᵀX (r, r) of an (L, r) matrix X, exactly symmetric, in X's dtype.

    On the CPU in float32 / float64 through BLAS ``syrk`` (scipy's), which computes one triangle: half the
    multiply-adds of ``X.mT @ X`` (11,008 × 4,096 in float32 on this project's 2-core machine: 1.05 s against
    1.98 s); the other triangle is its mirror. X may be C- or Fortran-contiguous (a transposed view), neither is
    copied. Elsewhere, or for another layout or dtype, ``X.mT @ X``. The sums are the same products in another
    order: entries agree with ``X.mT @ X`` to float rounding, not bitwise.
    """
    syrk = _SYRK.get(tall.dtype)
    if tall.device.type != "cpu" or syrk is None or tall.ndim != 2 or tall.requires_grad:
        return tall.mT @ tall
    array = tall.numpy()
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        return tall.mT @ tall
    with scipy_threads(array.shape[1]):
        if array.flags.c_contiguous:  # arrayᵀ is Fortran-ordered (r, L): syrk(trans=0) gives arrayᵀ · array
            lower = syrk(1.0, array.T, trans=0, lower=1)
        else:  # Fortran-ordered (L, r): syrk(trans=1) gives arrayᵀ · array
            lower = syrk(1.0, array, trans=1, lower=1)
    gram = torch.from_numpy(lower.T).triu_()  # syrk's result is Fortran-ordered: its transpose is C-ordered, upper
    gram += gram.triu(1).mT
    return gram


_POTRF = {torch.float32: scipy.linalg.lapack.spotrf, torch.float64: scipy.linalg.lapack.dpotrf}
_POTRS = {torch.float32: scipy.linalg.lapack.spotrs, torch.float64: scipy.linalg.lapack.dpotrs}
_POCON = {torch.float32: scipy.linalg.lapack.spocon, torch.float64: scipy.linalg.lapack.dpocon}


def solve_symmetric_right(rows: torch.Tensor, matrix: torch.Tensor, *, min_rcond: float = 0.0) -> torch.Tensor:
    """B A⁻¹ for a symmetric positive semi-definite (n, n) A and an (m, n) B; both are overwritten.

    Cholesky (LAPACK ``potrf`` / ``potrs``) where A is positive definite, in place on the CPU: A's C-ordered rows
    are its Fortran-ordered columns (A is symmetric), B's C-ordered rows are the right-hand sides of A X = Bᵀ, so
    neither is copied and the result is ``rows`` itself. At RegMean's largest map of a 7B model (n = 11,008,
    float64) the copies ``torch.linalg.solve`` makes of A and of the result are 0.9 and 0.3 GB. Only A's upper
    triangle (in C order) is read and overwritten, so where A is singular (a feature no input ever had) A is rebuilt
    from the triangle left alone and B A⁺ (the pseudo-inverse) is returned. Elsewhere (another device or dtype, or a
    layout that would need a copy) the same through torch. Results agree with a general LU solve to rounding.

    ``min_rcond`` > 0: also B A⁺ where A is positive definite but ill-conditioned, its reciprocal condition number
    in the 1-norm (LAPACK ``pocon``'s estimate from the Cholesky factor, O(n²)) below `min_rcond`: there the
    pseudo-inverse, which drops the directions of eigenvalues below n · eps · λ_max, differs from the inverse by
    more than rounding (two equal task matrices give such an A once rounded). Above it every eigenvalue is far
    above that cut (λ_min / λ_max ≥ rcond / n up to the estimate's factor), so A⁺ = A⁻¹ and Cholesky gives B A⁺ to
    rounding. Off the in-place path with `min_rcond` set, B A⁺ through torch.
    """
    potrf, potrs, pocon = _POTRF.get(matrix.dtype), _POTRS.get(matrix.dtype), _POCON.get(matrix.dtype)
    in_place = (matrix.device.type == "cpu" and rows.device.type == "cpu" and potrf is not None
                and rows.dtype == matrix.dtype and matrix.is_contiguous() and rows.is_contiguous()
                and not matrix.requires_grad and not rows.requires_grad)
    if not in_place:
        if min_rcond <= 0:
            factor, info = torch.linalg.cholesky_ex(matrix)
            if int(info) == 0:
                return torch.cholesky_solve(rows.mT, factor).mT
        return rows @ torch.linalg.pinv(matrix, hermitian=True)
    diagonal = matrix.diagonal().clone()  # potrf overwrites it: kept to rebuild A if A is singular
    norm = float(matrix.abs().sum(dim=0).max()) if min_rcond > 0 and matrix.numel() else 0.0  # ‖A‖₁, before potrf
    columns = matrix.numpy().T  # Fortran-ordered (n, n), the same memory: A itself, A being symmetric
    with scipy_threads(matrix.shape[0]):
        factor, info = potrf(columns, lower=1, clean=0, overwrite_a=1)
        if info < 0:
            raise ValueError(f"LAPACK potrf: argument {-info} is invalid")
        if info == 0 and min_rcond > 0 and matrix.numel():
            rcond, info = pocon(factor, norm, uplo="L")
            if info != 0:
                raise ValueError(f"LAPACK pocon: argument {-info} is invalid")
            info = 0 if rcond >= min_rcond else 1  # ill-conditioned: as if singular, the pseudo-inverse below
        if info == 0:
            solution, info = potrs(factor, rows.numpy().T, lower=1, overwrite_b=1)
            if info != 0:
                raise ValueError(f"LAPACK potrs: argument {-info} is invalid")
            return rows if solution.ctypes.data == rows.data_ptr() else torch.from_numpy(solution.T)
    lower = matrix.tril(-1)  # potrf wrote the upper triangle (C order) and the diagonal: rebuild A from the rest
    torch.add(lower, lower.mT, out=matrix).diagonal().copy_(diagonal)
    return rows @ torch.linalg.pinv(matrix, hermitian=True)


def gram_eigh(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigendecomposition G = Y diag(λ) Yᵀ of a symmetric positive semi-definite (r, r) Gram matrix, largest first.

    Returns ``(λ, Y)``: λ (r,) float64, descending, with the negative values that rounding gives a
    semi-definite matrix set to 0; Y (r, r) orthonormal columns in G's dtype, column a the eigenvector of λ_a.
    For G = XᵀX these are σ_a² and the right singular vectors of X. Divide and conquer (LAPACK ``syevd``):
    on the CPU through scipy (on the Gram of an 11,008 × 4,096 task matrix, nothing else running on this
    project's 2-core machine, its ``ssyevd`` took 4.2 s where torch's took 5.2 s; ``evr`` and ``evx`` took
    10.3–10.6 s for the top 64 % of the eigenpairs), elsewhere ``torch.linalg.eigh``. Only the lower triangle of
    G is read.
    """
    if gram.device.type == "cpu":
        with scipy_threads(gram.shape[0]):
            values, vectors = scipy.linalg.eigh(gram.detach().numpy(), driver="evd", check_finite=False)
        values, vectors = torch.from_numpy(values), torch.from_numpy(vectors)
    else:
        values, vectors = torch.linalg.eigh(gram)
    return values.flip(0).to(torch.float64).clamp_min(0.0), vectors.flip(1)

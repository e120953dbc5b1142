"""Merge strategies: one pure function per method, over the task vectors of ONE parameter.

Convention
----------
Every strategy takes ``task_vectors`` (a list of tensors τ_t = θ_t − θ0 of one shape,
one per fine-tuned model) plus keyword options whose defaults come from the paper, and
returns the **merged task vector** τ_M (same shape and dtype as the inputs). The merged
weight is θ0 + τ_M, computed on the inputs' device and cast back to the inputs' dtype.

Precision and memory: element-wise methods (weight average, TA, TIES, DARE, Breadcrumbs,
DELLA, PCB, Consensus TA, NAN, Fisher, the closed-form / AdaMerging / LoraHub weights) compute in
the inputs' dtype promoted to at least float32 (``compute_dtype``: bf16/fp16 → float32, float64
stays float64); random masks are drawn from float64 probabilities, so a seed gives the same mask
whatever the dtype. Above ``CHUNK_THRESHOLD`` entries TA, TIES, DARE, Breadcrumbs, DELLA and
Consensus TA run in row chunks, so their peak is about the T task vectors plus the output (PCB
holds T score tensors besides, Fisher the T diagonals). SVDs and solves (TSV-M, Iso-C/CTS, CART,
STAR, SFTM, KnOTS, RegMean) run in float64 (``COMPUTE_DTYPE``) one tensor at a time, never on a
(T, ...) float64 stack (KnOTS: one m × T n concatenation).

Inputs besides the task vectors: data-driven methods take per-tensor inputs computed from the fit
records (``TENSOR_INPUTS``: RegMean's Grams, Fisher's diagonals) or per-task weights learned from
them (closed-form, AdaMerging, LoraHub; `submerge.merge.learned`); NAN takes θ0 of the tensor,
which the merge writer reads from the base checkpoint (``CHECKPOINT_INPUTS``).

Registry: ``STRATEGIES`` maps a method name to a ``MergeMethod`` whose options and defaults
are read from the function's signature; ``ALIASES`` accepts mergekit's spellings.

The final scaling coefficient is called ``scaling`` everywhere (λ in Task Arithmetic,
TIES, DARE, Breadcrumbs, DELLA and CART; α in TSV-M and Iso-C/CTS; γ in SFTM).
Fractions are fractions (``top_k=0.2`` means the paper's "top-20 %").

Per-task options (mergekit's per-model ``weight`` and ``density``, `submerge.merge.recipe`):
TIES, DARE, Breadcrumbs and DELLA take their fractions either as one number or as one number
per task, and ``weights`` w_t (default None: every task 1) and ``normalize``. The weights
multiply each (sparsified) task vector before the sign election, and the merge divides by the
weights of the tasks that enter an entry when ``normalize`` (mergekit's generalised task
arithmetic). The defaults are each paper's equation, unchanged: TIES and DELLA take the
disjoint mean (``normalize=True``), Breadcrumbs and DARE over task arithmetic the sum.

Papers: "survey" is seed 003 (a survey of model merging whose section for each method
gives the equations quoted here; its equations are labelled, not numbered, so the label
is cited), "SFTM" is seed 001 (Qiu et al., Superpose Singular Features for Model Merging).

Matrix-only methods (TSV-M, Iso-C, Iso-CTS, CART, STAR, SFTM, KnOTS, RegMean) need 2-D tensors;
``merge_parameter`` applies the documented fallback to biases, norms and embeddings
(SFTM Alg. 2 lines 9–16: biases/embeddings by task arithmetic, norms by mean) and
reshapes >2-D kernels to (out, rest) as SFTM §3.3 does for convolutions.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import math
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from submerge.diagnostics.spectral import concat_top, numerical_rank, solve_symmetric_right, thin_svd

__all__ = [
    "ALIASES",
    "CHECKPOINT_INPUTS",
    "CHUNK_ELEMENTS",
    "CHUNK_THRESHOLD",
    "CLOSED_FORM_OPTIONS",
    "COMPUTE_DTYPE",
    "DEFAULT_FALLBACK",
    "PARAMETER_KINDS",
    "ROW_LOCAL_METHODS",
    "STRATEGIES",
    "TENSOR_INPUTS",
    "MergeMethod",
    "MergedTaskVector",
    "SftmSystem",
    "TsvBases",
    "adamerging",
    "breadcrumbs",
    "breadcrumbs_mask",
    "cart",
    "compute_dtype",
    "consensus",
    "dare",
    "della",
    "drop_and_rescale",
    "elect_sign_disjoint_mean",
    "fisher",
    "is_row_local",
    "iso_c",
    "iso_cts",
    "keep_top_magnitude",
    "knots",
    "lorahub",
    "magprune",
    "merge_parameter",
    "nan",
    "nan_coefficients",
    "pcb",
    "pcb_balance",
    "procrustes_orthonormalise",
    "regmean",
    "resolve_method",
    "sftm",
    "sftm_system",
    "shared_factors",
    "star",
    "star_truncate",
    "tall_masks",
    "task_arithmetic",
    "ties",
    "tsv_bases",
    "tsv_m",
    "weight_average",
    "weighted_task_arithmetic",
]

#: Inputs of a strategy that the merge writer reads from the base checkpoint, not from data: θ0 of the tensor.
CHECKPOINT_INPUTS = ("base_weight",)
#: Per-tensor inputs from data, one tensor per task, that the merge writer hands to a method (RegMean's input
#: Grams, Fisher merging's diagonal Fishers): method → the function's parameter.
TENSOR_INPUTS = {"regmean": "gram_matrices", "fisher": "fisher_diagonals"}
#: dtype of SVDs, solves and the matrix methods built on them (per tensor, never a (T, ...) stack).
COMPUTE_DTYPE = torch.float64
#: Element-wise methods on tensors above this many entries (≥ 2 dims) run in row chunks of about
#: CHUNK_ELEMENTS entries, so their peak is the T task vectors + the output + one chunk's temporaries.
CHUNK_THRESHOLD = 2**22  # 4 M entries (16 MiB in float32)
CHUNK_ELEMENTS = 2**20  # 1 M entries
#: RegMean forms each task's scaled Gram G̃_t about this many entries (whole rows) at a time, in float64.
REGMEAN_BLOCK_ENTRIES = 2**22  # 4 M entries (32 MiB in float64)

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


def _sum_in(task_vectors: Sequence[torch.Tensor], dtype: torch.dtype = COMPUTE_DTYPE) -> torch.Tensor:
    """Σ_t τ_t in `dtype`, one task at a time (no (T, ...) stack)."""
    total = torch.zeros(task_vectors[0].shape, dtype=dtype, device=task_vectors[0].device)
    for task_vector in task_vectors:
        total += task_vector.to(dtype)
    return total


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


def _per_task(value: float | Sequence[float], count: int, name: str) -> list[float]:
    """One value per task: a number for every task, or a sequence of `count` numbers (a recipe's per-model one)."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if number(value):
        return [float(value)] * count
    if isinstance(value, (list, tuple)) and len(value) == count and all(number(v) for v in value):
        return [float(v) for v in value]
    raise ValueError(f"{name} must be a number or one number per task ({count} tasks), got {value!r}")


def _task_weights(weights: Sequence[float] | None, count: int) -> list[float] | None:
    """The per-task weights w_t (None: every task 1), checked: one finite number per task."""
    if weights is None:
        return None
    values = _per_task(weights, count, "weights") if isinstance(weights, (list, tuple)) else None
    if values is None or not all(math.isfinite(v) for v in values):
        raise ValueError(f"weights must be one finite number per task ({count} tasks), got {weights!r}")
    return values


def _weighted_sum(pieces: Sequence[torch.Tensor], weights: list[float] | None, normalize: bool) -> torch.Tensor:
    """Σ_t w_t τ_t, divided by Σ_t w_t when `normalize` (by 1 when |Σ w| < 1e-8, as mergekit); without weights and
    normalisation the plain sum."""
    if weights is None and not normalize:
        return _sum(pieces)
    weights = weights or [1.0] * len(pieces)
    total = pieces[0] * weights[0]
    for weight, piece in zip(weights[1:], pieces[1:]):
        total += piece * weight
    divisor = math.fsum(weights)
    return total.div_(divisor) if normalize and abs(divisor) >= 1e-8 else total


def _thin_svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD matrix = U diag(S) Vᵀ in the matrix's dtype (float64 here), returning (U, S, V) with V (n × r)."""
    left, singular_values, right_transposed = thin_svd(matrix, matrix.dtype)
    return left, singular_values, right_transposed.mT


#: The decompositions taken within the current `shared_factors` scope (None outside one).
_SHARED_FACTORS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("submerge_shared_factors", default=None)


@contextlib.contextmanager
def shared_factors() -> Iterator[None]:
    """Within this scope, a decomposition of the same task vectors is taken once: the candidates of one tensor
    (several settings of a method, merged from the same τ tensors one after the other: `submerge.merge.writer.
    write_merges`) share KnOTS's SVD of [τ_1 … τ_T] and CART's SVD of each τ_t − τ̄, which their knots (top-k,
    rank ratio) do not change. Results are bitwise those of separate calls; the factors are dropped when the scope
    ends, so it should span one tensor's merges, not a model's."""
    token = _SHARED_FACTORS.set({})
    try:
        yield
    finally:
        _SHARED_FACTORS.reset(token)


def _shared(what: str, task_vectors: Sequence[torch.Tensor], compute: Callable[[], tuple]) -> tuple:
    """`compute()`, or inside `shared_factors` its result for these very tensors (storage, view and in-place
    version), computed once."""
    memo = _SHARED_FACTORS.get()
    if memo is None:
        return compute()
    key = (what, *((t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
                   for t in task_vectors))
    if key not in memo:
        memo[key] = compute()
    return memo[key]


# -------------------------------------------------------------------- element-wise methods


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype element-wise strategies compute in: the inputs' promoted to at least float32."""
    return torch.promote_types(dtype, torch.float32)


def _compute(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(compute_dtype(tensor.dtype))


def _row_chunks(shape: tuple[int, ...], limit: int | None = None, entries: int | None = None) -> list:
    """Slices of dim 0 holding about `entries` (default CHUNK_ELEMENTS) entries each, whole rows, when a tensor of
    ≥ 2 dims has more than `limit` (default CHUNK_THRESHOLD) entries; else one index (``...``: the whole tensor)."""
    numel = math.prod(shape)
    if len(shape) < 2 or numel <= (CHUNK_THRESHOLD if limit is None else limit) or shape[0] == 0:
        return [...]
    rows = max(1, (CHUNK_ELEMENTS if entries is None else entries) // max(1, numel // shape[0]))
    return [slice(start, start + rows) for start in range(0, shape[0], rows)]


def _by_chunks(task_vectors: Sequence[torch.Tensor], combine: Callable[[list[torch.Tensor]], torch.Tensor]
               ) -> torch.Tensor:
    """``combine`` (the task vectors' pieces in compute dtype → merged piece) over row chunks, in row order.

    One piece (the whole tensors) up to CHUNK_THRESHOLD entries; above, the output is allocated once in
    the inputs' dtype and filled chunk by chunk, so the peak is the T inputs + the output + one chunk's
    temporaries. ``combine`` sees the chunks in row-major order (stateful masks rely on it).
    """
    like = task_vectors[0]
    chunks = _row_chunks(tuple(like.shape))
    if len(chunks) == 1:
        return _as_output(combine([_compute(task_vector) for task_vector in task_vectors]), like)
    merged = torch.empty_like(like)
    for rows in chunks:
        merged[rows] = combine([_compute(task_vector[rows]) for task_vector in task_vectors])
    return merged


def _sum(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    total = pieces[0].clone()
    for piece in pieces[1:]:
        total += piece
    return total


# --------------------------------------------------------------------------- the registry

#: name → the function and what `MergeMethod` needs beside it, filled by `registered` as the module is read.
_REGISTERED: dict[str, dict] = {}

#: Options of the closed-form merge's data step (`submerge.diagnostics.linearity.alpha`): the unit α is fitted and
#: applied at, and whether the objective is balanced (seed 002 Eq. 33–34) or plain (Eq. 10–14).
CLOSED_FORM_OPTIONS = {"granularity": "attn-mlp", "balance": True}


def registered(name: str, description: str, *, matrix_only: bool = False,
               data_options: Sequence[str] | Mapping[str, object] = ()):
    """Register the decorated function as the merge strategy `name` (`STRATEGIES`). Its options and their defaults
    are its signature's; ``matrix_only``: it merges 2-D weights only (others fall back, `DEFAULT_FALLBACK`);
    ``data_options``: its data step's options, by name (defaults from the signature) or with their values."""
    def register(function: Callable) -> Callable:
        if name in _REGISTERED:
            raise ValueError(f"merge strategy {name!r} is registered twice")
        _REGISTERED[name] = {"function": function, "description": description, "matrix_only": matrix_only,
                             "data_options": data_options}
        return function
    return register


@registered("weight-average", "mean of the fine-tuned weights (Wortsman et al. 2022, model soups)")
def weight_average(task_vectors: Sequence[torch.Tensor], *, scaling: float = 1.0) -> torch.Tensor:
    """Simple average of the fine-tuned weights (Wortsman et al. 2022, model soups).

    Survey §"Simple Average": θ_M = (1/T) Σ_t θ_t = θ0 + (1/T) Σ_t τ_t, so the merged task
    vector is the mean of the task vectors. ``scaling`` λ multiplies it (1, the default, is the soup itself,
    bitwise; a tuned λ is the global scale every merge `diag compare` tunes gets, and what a tuned plan's
    weight-average blocks carry).
    """
    _check_task_vectors(task_vectors)
    return _by_chunks(task_vectors, lambda pieces: _sum(pieces).div_(len(pieces)).mul_(float(scaling)))


@registered("task-arithmetic", "θ0 + λ·Σ task vectors (Ilharco et al. 2023, Task Arithmetic)")
def task_arithmetic(task_vectors: Sequence[torch.Tensor], *, scaling: float = 1.0) -> torch.Tensor:
    """Task Arithmetic (Ilharco et al. 2023): τ_M = λ Σ_t τ_t.

    Survey §"Task Arithmetic": θ_M = θ0 + λ Σ_t τ_t. The paper picks λ on held-out data;
    the default ``scaling`` λ = 1 is the plain sum (no validation data here).
    """
    _check_task_vectors(task_vectors)
    return _by_chunks(task_vectors, lambda pieces: _sum(pieces).mul_(float(scaling)))


@registered("closed-form",
            "θ0 + Σ_t α_t τ_t with α per submodule solved on task data (seed 002 Eq. 12–14, 33–34; needs data)",
            data_options=CLOSED_FORM_OPTIONS)
def weighted_task_arithmetic(
    task_vectors: Sequence[torch.Tensor], weights: Sequence[float | torch.Tensor] | torch.Tensor
) -> torch.Tensor:
    """Task Arithmetic with one coefficient per task: τ_M = Σ_t w_t τ_t.

    Survey §"Task Arithmetic" with a per-task λ_t (as in AdaMerging's task-wise form). This is the
    submodule closed-form merge (seed 002), registered as ``closed-form``: the merge writer applies
    it to every tensor whose rule has per-task weights (the α of the tensor's unit, from a plan or
    solved on the fly). ``weights`` has one entry per task, with no default; an entry is a number or
    a tensor that broadcasts to the task vectors' shape (head level: one α per row or column).
    Computed task by task in the inputs' dtype promoted to at least float32, summed in task order.
    """
    _check_task_vectors(task_vectors)
    if isinstance(weights, torch.Tensor):
        weights = weights.reshape(-1).tolist()
    if len(weights) != len(task_vectors):
        raise ValueError(f"weights has {len(weights)} entries but there are {len(task_vectors)} task vectors")
    dtype = torch.promote_types(task_vectors[0].dtype, torch.float32)
    merged = None
    for weight, task_vector in zip(weights, task_vectors):
        term = torch.as_tensor(weight, dtype=dtype, device=task_vector.device) * task_vector.to(dtype)
        merged = term if merged is None else merged + term
    return _as_output(merged, task_vectors[0])


class _TopMagnitude:
    """Mask of the `keep` entries of largest |value| of one tensor, produced chunk by chunk in row-major order.

    The keep-th largest magnitude t is found once (`_kth_smallest`); a chunk keeps |x| > t and as
    many entries with |x| = t as make exactly `keep` in all: the first ones in row-major order (a stable
    descending sort, as TIES implementations rank; mergekit's ``magnitude`` agrees), or with
    ``later=True`` the last ones (a stable ascending sort's ranks, Breadcrumbs). Chunks must be given in
    order, in compute dtype.
    """

    def __init__(self, values: torch.Tensor, keep: int, *, later: bool = False):
        total = values.numel()
        self.all, self.none, self.later = keep >= total, keep <= 0, later
        if self.all or self.none:
            return
        magnitude = _compute(values).reshape(-1).abs()
        self.threshold = _kth_smallest(magnitude, total - keep + 1)
        equal = int((magnitude == self.threshold).sum())
        kept_equal = keep - int((magnitude > self.threshold).sum())
        self.budget = equal - kept_equal if later else kept_equal  # equal entries to drop / to keep, in order

    def __call__(self, piece: torch.Tensor) -> torch.Tensor:
        if self.all or self.none:
            return torch.full_like(piece, self.all, dtype=torch.bool)
        magnitude = piece.abs()
        equal = magnitude == self.threshold
        flat = equal.reshape(-1)
        first = flat & (torch.cumsum(flat, 0) <= self.budget)  # the first `budget` equal entries of this piece
        self.budget -= int(first.sum())
        equal = (equal & ~first.reshape(equal.shape)) if self.later else first.reshape(equal.shape)
        return (magnitude > self.threshold) | equal


def _kth_smallest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th smallest entry (1-based) of a flat tensor, as a 0-d tensor: ``torch.kthvalue``'s value. On the CPU
    NumPy's introselect finds the same entry 6–8× faster than ``torch.kthvalue`` (0.12 s against 0.77–0.94 s for a
    49,152 × 576 embedding, 2 cores); elsewhere ``torch.kthvalue``."""
    if values.device.type != "cpu":
        return torch.kthvalue(values, k).values
    array = values.numpy()
    return torch.tensor(np.partition(array, k - 1)[k - 1], dtype=values.dtype)


def _top_count(top_k: float, total: int) -> int:
    """⌊k · n⌋ entries, at least one when k > 0: the count of the TIES authors' ``topk_values_mask``
    (``int(n · K)``) and of mergekit's ``magnitude`` sparsification, so the same density keeps the same number."""
    top_k = _check_fraction(top_k, "top_k")
    keep = min(total, math.floor(top_k * total + 1e-9))  # + 1e-9: 0.3 · 10 is 3, not 2.9999…
    return max(1, keep) if top_k > 0 else keep


def keep_top_magnitude(task_vector: torch.Tensor, top_k: float) -> torch.Tensor:
    """TIES step (1) Trim: keep the top-k fraction of entries by |value|, zero the rest.

    Survey §TIES-Merging: τ̂_t = keep_topk_reset_rest_to_zero(τ_t, k). Keeps exactly
    ⌊k · n⌋ entries (at least one when k > 0); among equal magnitudes the earlier entry in
    row-major order is kept first (a stable descending sort). Returned in compute dtype (at least float32).
    """
    values = _compute(task_vector)
    mask = _TopMagnitude(values, _top_count(top_k, values.numel()))(values)
    return torch.where(mask, values, torch.zeros_like(values))


def elect_sign_disjoint_mean(task_vectors: torch.Tensor, *, weights: Sequence[float] | None = None,
                             normalize: bool = True) -> torch.Tensor:
    """TIES steps (2) Elect Sign and (3) Disjoint Merge on a (T, ...) stack.

    Survey §TIES-Merging: γ_m = sgn(Σ_t τ̂_t); for each entry p, A_p = {t : sgn(τ̂_t^p) = γ_m^p}
    and τ_m^p = (1/|A_p|) Σ_{t∈A_p} τ̂_t^p, zeros ignored. An entry whose sum is exactly 0
    gets γ_m = 0 and merges to 0 (the equation as written). Also DELLA's Elect and Fuse.

    With per-task `weights` w_t the signs are elected on the weighted vectors w_t τ̂_t, and the disjoint
    mean becomes Σ_{t∈A_p} w_t τ̂_t^p / Σ_{t∈A_p} w_t (a zero divisor counts as 1); with ``normalize=False``
    the disjoint sum Σ_{t∈A_p} w_t τ̂_t^p (mergekit's generalised task arithmetic with sign consensus).
    """
    if weights is not None or not normalize:
        return _weighted_elect(task_vectors, weights, normalize)
    elected_sign = torch.sign(task_vectors.sum(dim=0))
    agrees = (torch.sign(task_vectors) == elected_sign) & (task_vectors != 0)
    selected = torch.where(agrees, task_vectors, torch.zeros_like(task_vectors))
    count = agrees.sum(dim=0).clamp(min=1)
    return selected.sum(dim=0) / count


def _weighted_elect(task_vectors: torch.Tensor, weights: Sequence[float] | None, normalize: bool) -> torch.Tensor:
    count = task_vectors.shape[0]
    weight = torch.tensor(weights if weights is not None else [1.0] * count, dtype=task_vectors.dtype,
                          device=task_vectors.device).reshape(count, *([1] * (task_vectors.ndim - 1)))
    weighted = task_vectors * weight
    elected_sign = torch.sign(weighted.sum(dim=0))
    agrees = (torch.sign(weighted) == elected_sign) & (weighted != 0)
    mixed = torch.where(agrees, weighted, 0.0).sum(dim=0)
    if not normalize:
        return mixed
    divisor = torch.where(agrees, weight, 0.0).sum(dim=0)
    return mixed / torch.where(divisor == 0, 1.0, divisor)


def _trimmed_elect(pieces: list[torch.Tensor], masks: Sequence[_TopMagnitude], scaling: float,
                   weights: list[float] | None = None, normalize: bool = True) -> torch.Tensor:
    trimmed = torch.stack([torch.where(mask(piece), piece, 0.0) for piece, mask in zip(pieces, masks)])
    return float(scaling) * elect_sign_disjoint_mean(trimmed, weights=weights, normalize=normalize)


@registered("ties", "trim to top-k %, elect sign, disjoint mean (Yadav et al. 2023, TIES-Merging)")
def ties(task_vectors: Sequence[torch.Tensor], *, top_k: float | Sequence[float] = 0.2, scaling: float = 1.0,
         weights: Sequence[float] | None = None, normalize: bool = True) -> torch.Tensor:
    """TIES-Merging (Yadav et al. 2023, Algorithm 1): trim, elect sign, disjoint mean, scale by λ.

    Survey §TIES-Merging steps (1)–(3) and θ_M = θ0 + λ τ_M. Defaults k = 20 % (the survey's
    "e.g., k = 20") and λ = 1 (the TIES paper's choice without a validation set; not in the
    seed survey).
    Trimming is per parameter tensor (the writer streams one tensor at a time); the paper
    trims over the whole model's task vector. ``top_k`` may give one k per task; per-task
    ``weights`` and ``normalize=False`` are mergekit's generalisation (`elect_sign_disjoint_mean`).
    """
    _check_task_vectors(task_vectors)
    fractions = _per_task(top_k, len(task_vectors), "top_k")
    weights = _task_weights(weights, len(task_vectors))
    masks = [_TopMagnitude(tv, _top_count(k, tv.numel())) for tv, k in zip(task_vectors, fractions)]
    return _by_chunks(task_vectors, lambda pieces: _trimmed_elect(pieces, masks, scaling, weights, bool(normalize)))


def _generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return generator


def _draw_kept(shape: tuple[int, ...], probability: Callable[[object], torch.Tensor | float],
               generator: torch.Generator, device) -> torch.Tensor:
    """Bool mask of kept entries: entry i dropped with m_i ~ Bernoulli(p_i), drawn in row-major order.

    ``probability(rows)`` gives p for a row slice (a float64 tensor, or a number). Drawn in row chunks
    of about CHUNK_ELEMENTS (the generator's stream is the same as one draw over the whole tensor)."""
    kept = torch.empty(shape, dtype=torch.bool, device=device)
    for rows in _row_chunks(shape, limit=CHUNK_ELEMENTS):
        p = probability(rows)
        p = p if isinstance(p, torch.Tensor) else torch.full(kept[rows].shape, p, dtype=torch.float64, device=device)
        kept[rows] = torch.bernoulli(p, generator=generator) == 0
    return kept


def drop_and_rescale(task_vector: torch.Tensor, drop_rate: float, generator: torch.Generator) -> torch.Tensor:
    """DARE on one task vector (Yu et al. 2024): m ~ Bernoulli(p), τ̂ = (1 − m) ⊙ τ / (1 − p).

    Survey eq. (dare); the 1/(1 − p) rescale keeps E[τ̂] = τ (survey App. "Theoretical Analysis
    for DARE"). Returned in compute dtype (at least float32).
    """
    drop_rate = _check_fraction(drop_rate, "drop_rate", high_open=True)
    values = _compute(task_vector)
    if drop_rate == 0:
        return values.clone()
    kept = _draw_kept(tuple(values.shape), lambda rows: drop_rate, generator, values.device)
    return torch.where(kept, values / (1 - drop_rate), 0.0)


class _Drawn:
    """A task vector's drop mask (bool, drawn once) applied chunk by chunk with its rescale: where(kept, τ/(1 − p), 0)."""

    def __init__(self, kept: torch.Tensor | None, probability: Callable[[torch.Tensor, object], torch.Tensor | float]):
        self.kept, self.probability, self.position = kept, probability, 0

    def __call__(self, piece: torch.Tensor) -> torch.Tensor:
        rows = ... if piece.ndim < 2 or self.kept is None or piece.shape == self.kept.shape else \
            slice(self.position, self.position + piece.shape[0])
        self.position += piece.shape[0] if piece.ndim else 0
        if self.kept is None:
            return piece
        probability = self.probability(piece, rows)
        if isinstance(probability, torch.Tensor):
            probability = probability.to(piece.dtype)
        return torch.where(self.kept[rows], piece / (1 - probability), 0.0)


@registered("dare", "random drop p and rescale 1/(1-p), then task arithmetic or TIES (Yu et al. 2024, DARE)")
def dare(
    task_vectors: Sequence[torch.Tensor],
    *,
    drop_rate: float | Sequence[float] = 0.9,
    seed: int = 0,
    base: str = "task-arithmetic",
    top_k: float | Sequence[float] = 1.0,
    scaling: float = 1.0,
    weights: Sequence[float] | None = None,
    normalize: bool | None = None,
) -> torch.Tensor:
    """DARE (Yu et al. 2024) as a plug-in before Task Arithmetic or TIES.

    Survey eqs. (dare) and (dare-merge): each τ_t is dropped with rate p and rescaled by
    1/(1 − p), then merged with ``base``: "task-arithmetic" gives τ_M = λ Σ_t τ̂_t;
    "ties" gives TIES on the τ̂_t (trim to ``top_k``, default 1.0 = no trim, then elect
    sign and disjoint mean, scaled by λ). Defaults: p = 0.9 (the DARE paper's usual drop
    rate for merging SFT LMs; the survey's App. mentions rates up to 0.99), λ = 1. One ``torch.Generator`` seeded with ``seed`` draws the
    tasks' masks in task order, so a seed gives one result.
    ``drop_rate`` and ``top_k`` may give one value per task; ``weights`` w_t weight each τ̂_t (before the sign
    election over TIES), and ``normalize`` divides by the weights that enter (None: the base's own — the
    disjoint mean for TIES, the plain sum for task arithmetic).
    """
    _check_task_vectors(task_vectors)
    if base not in ("task-arithmetic", "ties"):
        raise ValueError(f"dare base must be 'task-arithmetic' or 'ties', got {base!r}")
    rates = [_check_fraction(p, "drop_rate", high_open=True)
             for p in _per_task(drop_rate, len(task_vectors), "drop_rate")]
    weights = _task_weights(weights, len(task_vectors))
    normalize = (base == "ties") if normalize is None else bool(normalize)
    generator = _generator(seed, task_vectors[0].device)
    shape, device = tuple(task_vectors[0].shape), task_vectors[0].device
    drawn = [_Drawn(None if p == 0 else _draw_kept(shape, lambda rows, p=p: p, generator, device),
                    lambda piece, rows, p=p: p) for p in rates]
    if base == "task-arithmetic":
        return _by_chunks(task_vectors, lambda pieces: float(scaling) * _weighted_sum(
            [d(p) for d, p in zip(drawn, pieces)], weights, normalize))
    fractions = _per_task(top_k, len(task_vectors), "top_k")
    trim = [_check_fraction(k, "top_k") < 1 for k in fractions]

    def unscaled():
        return [_Drawn(d.kept, lambda piece, rows: 0.0) for d in drawn]  # fresh row positions

    masks = [_TopMagnitude(kept(_compute(tv)) if cut else tv, _top_count(k, tv.numel()))
             for kept, tv, k, cut in zip(unscaled(), task_vectors, fractions, trim)]
    if len(set(rates)) == 1 and weights is None and normalize:
        # TIES on τ̂_t: every kept entry is rescaled by the same 1/(1 − p), so the trim ranks, the elected signs
        # and the disjoint mean are those of the unscaled kept entries, times 1/(1 − p) (rounding makes no ties)
        kept = unscaled()
        return _by_chunks(task_vectors, lambda pieces: _trimmed_elect([k(p) for k, p in zip(kept, pieces)], masks,
                                                                      float(scaling) / (1 - rates[0])))
    rescaled = [_Drawn(d.kept, d.probability) for d in drawn]  # τ̂_t = kept τ_t / (1 − p_t): the trim ranks stay
    return _by_chunks(task_vectors, lambda pieces: _trimmed_elect([d(p) for d, p in zip(rescaled, pieces)], masks,
                                                                  scaling, weights, normalize))


def _breadcrumbs_bounds(beta: float, gamma: float) -> tuple[float, float]:
    beta = _check_fraction(beta, "beta")
    gamma = _check_fraction(gamma, "gamma")
    if beta > gamma:
        raise ValueError(f"breadcrumbs needs beta <= gamma, got beta={beta}, gamma={gamma}")
    return beta, gamma


class _BreadcrumbsMask:
    """m^{β,γ} chunk by chunk: kept when in the top n − round(β n) but not in the top n − round(γ n) magnitudes."""

    def __init__(self, values: torch.Tensor, beta: float, gamma: float):
        total = values.numel()
        self.upper = _TopMagnitude(values, total - _count_from_fraction(beta, total), later=True)
        self.largest = _TopMagnitude(values, total - _count_from_fraction(gamma, total), later=True)

    def __call__(self, piece: torch.Tensor) -> torch.Tensor:
        return self.upper(piece) & ~self.largest(piece)


def breadcrumbs_mask(task_vector: torch.Tensor, beta: float, gamma: float) -> torch.Tensor:
    """Model Breadcrumbs' mask m^{β,γ} for one tensor (Davari & Belilovsky 2024).

    Survey eq. (mask): sort |w| ascending with index i; m = 0 if i ≤ β or i ≥ γ, else 1.
    β and γ are read as fractions of the n entries: the round(β n) smallest and the
    n − round(γ n) largest magnitudes are masked (0-based ascending index i is masked when
    i < round(β n) or i ≥ round(γ n), with equal magnitudes in row-major order as a stable sort
    gives). Returns a bool tensor of the input's shape.
    """
    beta, gamma = _breadcrumbs_bounds(beta, gamma)
    values = _compute(task_vector)
    return _BreadcrumbsMask(values, beta, gamma)(values)


@registered("breadcrumbs",
            "mask the smallest β and largest 1-γ magnitudes per tensor (Davari & Belilovsky 2024, Model Breadcrumbs)")
def breadcrumbs(
    task_vectors: Sequence[torch.Tensor], *, beta: float | Sequence[float] = 0.85,
    gamma: float | Sequence[float] = 0.993, scaling: float = 1.0, weights: Sequence[float] | None = None,
    normalize: bool = False,
) -> torch.Tensor:
    """Model Breadcrumbs (Davari & Belilovsky 2024): τ_M = λ Σ_t m_t^{β,γ} ⊙ τ_t.

    Survey eqs. (mask) and (breadcrumbs-merge); the mask is layer-wise, i.e. per parameter
    tensor. Defaults β = 0.85 (drop the smallest 85 %) and γ = 0.993 (drop the largest
    0.7 %) are the Breadcrumbs paper's reported setting (not in the seed survey, which gives
    no values); λ = 1. ``beta`` and ``gamma`` may give one value per task; ``weights`` w_t make
    it λ Σ_t w_t m_t ⊙ τ_t, divided by Σ_t w_t with ``normalize`` (mergekit's per-model weights).
    """
    _check_task_vectors(task_vectors)
    count = len(task_vectors)
    bounds = [_breadcrumbs_bounds(b, g) for b, g in zip(_per_task(beta, count, "beta"), _per_task(gamma, count, "gamma"))]
    weights = _task_weights(weights, count)
    masks = [_BreadcrumbsMask(task_vector, b, g) for task_vector, (b, g) in zip(task_vectors, bounds)]
    return _by_chunks(task_vectors, lambda pieces: float(scaling) * _weighted_sum(
        [torch.where(mask(piece), piece, 0.0) for mask, piece in zip(masks, pieces)], weights, bool(normalize)))


def _check_della(drop_rate: float, epsilon: float) -> tuple[float, float]:
    drop_rate, epsilon = float(drop_rate), float(epsilon)
    if epsilon < 0 or drop_rate - epsilon / 2 < 0 or drop_rate + epsilon / 2 >= 1:
        raise ValueError(
            f"della needs 0 <= drop_rate - epsilon/2 and drop_rate + epsilon/2 < 1, "
            f"got drop_rate={drop_rate}, epsilon={epsilon}"
        )
    return drop_rate, epsilon


def _magprune_probability(rows: torch.Tensor, drop_rate: float, epsilon: float) -> torch.Tensor:
    """p_i = p − ε/2 + (ε/n) r_i per row of a (rows, n) view, r_i the magnitude rank from the largest (float64)."""
    width = rows.shape[1]
    order = torch.argsort(rows.abs(), dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(width, device=rows.device).expand_as(order).contiguous())
    return drop_rate - epsilon / 2 + (epsilon / width) * ranks.to(torch.float64)


def _as_rows(values: torch.Tensor) -> torch.Tensor:
    return values.reshape(1, -1) if values.ndim < 2 else values.reshape(values.shape[0], -1)


def _magprune_draw(task_vector: torch.Tensor, drop_rate: float, epsilon: float, generator) -> _Drawn:
    rows_view = _as_rows(task_vector)

    def probability(piece, rows):
        return _magprune_probability(_as_rows(piece), drop_rate, epsilon).reshape(piece.shape)

    kept = _draw_kept(tuple(rows_view.shape), lambda rows: _magprune_probability(rows_view[rows], drop_rate, epsilon),
                      generator, task_vector.device)
    return _Drawn(kept.reshape(task_vector.shape), probability)


def magprune(task_vector: torch.Tensor, drop_rate: float, epsilon: float, generator: torch.Generator) -> torch.Tensor:
    """DELLA's MAGPRUNE on one task vector (Deep et al. 2024), row by row.

    Survey eq. (della magprune prob): within a row of n deltas, rank magnitudes r_i ∈ {0..n−1},
    Δ_i = (ε/n) r_i, p_i = p − ε/2 + Δ_i; drop with m_i ~ Bernoulli(p_i), rescale the kept
    ones by 1/(1 − p_i). Ranks run from the largest magnitude (r = 0) to the smallest, so
    larger deltas are dropped less often, which is what MAGPRUNE is for (the survey's
    "higher rank for larger magnitude" would do the opposite). Rows: the last dimension
    of a matrix (a >2-D tensor is viewed as (shape[0], −1)); a vector is one row.
    """
    drop_rate, epsilon = _check_della(drop_rate, epsilon)
    return _magprune_draw(task_vector, drop_rate, epsilon, generator)(_compute(task_vector))


@registered("della", "magnitude-ranked drop and rescale, elect sign, fuse (Deep et al. 2024, DELLA-Merging)")
def della(
    task_vectors: Sequence[torch.Tensor],
    *,
    drop_rate: float | Sequence[float] = 0.5,
    epsilon: float | Sequence[float] = 0.1,
    seed: int = 0,
    scaling: float = 1.0,
    weights: Sequence[float] | None = None,
    normalize: bool = True,
) -> torch.Tensor:
    """DELLA-Merging (Deep et al. 2024): MAGPRUNE drop-and-rescale, elect sign, fuse, scale.

    Survey §DELLA-Merging: τ̂_t = MAGPRUNE(τ_t), S = sgn(Σ_t τ̂_t), C = {t : sgn(τ̂_t) = S},
    τ^avg = mean over C, θ_M = θ0 + λ τ^avg. ε = 0 reduces the drop to DARE. The survey
    gives no values; the defaults p = 0.5, ε = 0.1 are the middle of the DELLA paper's
    grid, λ = 1. A seeded ``torch.Generator`` draws the masks in task order.
    ``drop_rate`` and ``epsilon`` may give one value per task; ``weights`` and ``normalize`` as in
    `elect_sign_disjoint_mean` (mergekit's per-model weights).
    """
    _check_task_vectors(task_vectors)
    count = len(task_vectors)
    settings = [_check_della(p, e) for p, e in zip(_per_task(drop_rate, count, "drop_rate"),
                                                   _per_task(epsilon, count, "epsilon"))]
    weights = _task_weights(weights, count)
    generator = _generator(seed, task_vectors[0].device)
    drawn = [_magprune_draw(task_vector, p, e, generator) for task_vector, (p, e) in zip(task_vectors, settings)]
    return _by_chunks(task_vectors, lambda pieces: float(scaling) * elect_sign_disjoint_mean(
        torch.stack([draw(piece) for draw, piece in zip(drawn, pieces)]), weights=weights, normalize=bool(normalize)))


def _min_max(values: torch.Tensor) -> torch.Tensor:
    """Min-max normalisation to [0, 1] over every entry (PCB's Norm); a constant tensor gives zeros."""
    low, high = values.min(), values.max()
    if high == low:
        return torch.zeros_like(values)
    return (values - low) / (high - low)


def _softmax_over_entries(values: torch.Tensor) -> torch.Tensor:
    """Softmax over every entry of the tensor (one distribution per tensor), in its shape."""
    return torch.softmax(values.reshape(-1), dim=0).reshape(values.shape)


def pcb_balance(task_vectors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """PCB-Merging's parameter competition balancing matrices β_i (Du et al. 2024), one per task.

    Survey §PCB-Merging, eqs. (pcb intra) and (pcb inter), App. "Derivation for the Complete Formulation of
    PCB-Merging": β_intra,i = Softmax(T · Norm(τ_i ⊙ τ_i)), β_inter,i = Σ_j Softmax(Norm(τ_i ⊙ τ_j)) (j = i
    included), β_i = β_intra,i ⊙ β_inter,i. Norm is min-max normalisation to [0, 1] (the appendix's "typically";
    a constant tensor normalises to zeros), each softmax runs over every entry of the tensor. Returned in compute
    dtype (at least float32).
    """
    _check_task_vectors(task_vectors)
    values = [_compute(task_vector) for task_vector in task_vectors]
    count = len(values)
    betas = []
    for tau_i in values:
        intra = _softmax_over_entries(count * _min_max(tau_i * tau_i))
        inter = _sum([_softmax_over_entries(_min_max(tau_i * tau_j)) for tau_j in values])
        betas.append(intra * inter)
    return betas


@registered("pcb",
            "intra/inter-task balancing scores, keep the top r, score-weighted mean (Du et al. 2024, PCB-Merging)")
def pcb(task_vectors: Sequence[torch.Tensor], *, top_k: float = 0.1, scaling: float = 1.0) -> torch.Tensor:
    """PCB-Merging (Du et al. 2024): balance, drop the low-scoring entries, β-weighted mean, scale by λ.

    The main baseline of seed 001's tables (its mask ratio η searched over 0.1–0.5, §4 Hyperparameter Sensitivity).

    Survey §PCB-Merging, eqs. (pcb intra), (pcb inter) (see ``pcb_balance``), (pcb mask) and (pcb merge):
    m_i keeps the top r of β_i (``top_k`` = r, the mask ratio, as a fraction: ⌊r · n⌋ entries, at least one,
    equal scores in row-major order, as TIES's trim), β̂_i = m_i ⊙ β_i, τ_M = Σ_i β̂_i ⊙ τ_i / Σ_i β̂_i (0 where
    no task keeps the entry), θ_M = θ0 + λ τ_M. Default r = 0.1 (the authors' ``pcb_ratio``), λ = 1 (the paper
    tunes λ on validation data). Per parameter tensor, as the writer streams tensors (the paper balances the
    whole model's flattened task vector). The equations are the survey's; the authors' released code differs
    (exp without the softmax's denominator, tanh(τ_i · Σ_j τ_j) for the inter term, outliers clamped).
    """
    betas = pcb_balance(task_vectors)
    keep = _top_count(top_k, betas[0].numel())
    numerator = torch.zeros_like(betas[0])
    denominator = torch.zeros_like(betas[0])
    for beta, task_vector in zip(betas, task_vectors):
        kept = torch.where(_TopMagnitude(beta, keep)(beta), beta, 0.0)
        numerator += kept * _compute(task_vector)
        denominator += kept
    merged = torch.where(denominator > 0, numerator / torch.where(denominator > 0, denominator, 1.0), 0.0)
    return _as_output(float(scaling) * merged, task_vectors[0])


def tall_masks(task_vectors: Sequence[torch.Tensor], mask_lambda: float) -> list[torch.Tensor]:
    """TALL masks (Wang et al. 2024): m_t = 1{|τ_t| ≥ λ_t |τ_MTL − τ_t|} with τ_MTL = Σ_t τ_t, one λ for all tasks.

    Survey §TALL-Masks and Consensus Merging, eq. (tall-mask) (derivation: App. "Derivation for TALL-Mask"). Bool
    tensors of the inputs' shape, computed in compute dtype.
    """
    _check_task_vectors(task_vectors)
    mask_lambda = _check_mask_lambda(mask_lambda)
    values = [_compute(task_vector) for task_vector in task_vectors]
    total = _sum(values)
    return [value.abs() >= mask_lambda * (total - value).abs() for value in values]


def _check_mask_lambda(mask_lambda: float) -> float:
    mask_lambda = float(mask_lambda)
    if not mask_lambda >= 0:
        raise ValueError(f"mask_lambda must be ≥ 0, got {mask_lambda}")
    return mask_lambda


@registered("consensus",
            "task arithmetic on the entries that ≥ k tasks' TALL masks select (Wang et al. 2024, Consensus TA)")
def consensus(task_vectors: Sequence[torch.Tensor], *, mask_lambda: float = 0.4, min_tasks: int = 2,
              scaling: float = 1.0) -> torch.Tensor:
    """Consensus Task Arithmetic with TALL masks (Wang et al. 2024; seed 002 Table 9's "Consensus TA").

    Survey §TALL-Masks and Consensus Merging: TALL masks m_t = 1{|τ_t| ≥ λ_t |τ_MTL − τ_t|} (``tall_masks``),
    m_consensus = 1{Σ_t m_t ≥ k}, τ_consensus = m_consensus ⊙ τ_MTL, θ_M = θ0 + α τ_consensus with
    τ_MTL = Σ_t τ_t (task arithmetic's sum). Defaults: k = 2 (``min_tasks``, the survey's "setting k = 2":
    entries relevant to at least two tasks), λ_t = 0.4 for every task (``mask_lambda``, the middle of the
    survey's grid {0.2, …, 0.6}; the paper tunes it per task on validation data), α = 1 (``scaling``; the paper
    tunes it). Every step is per entry, so the merge is row by row (``ROW_LOCAL_METHODS``).
    """
    _check_task_vectors(task_vectors)
    mask_lambda = _check_mask_lambda(mask_lambda)
    if int(min_tasks) != min_tasks or min_tasks < 0:
        raise ValueError(f"min_tasks must be a whole number ≥ 0, got {min_tasks}")

    def combine(pieces: list[torch.Tensor]) -> torch.Tensor:
        total = _sum(pieces)
        agreeing = torch.zeros(total.shape, dtype=torch.int64, device=total.device)
        for piece in pieces:
            agreeing += piece.abs() >= mask_lambda * (total - piece).abs()
        return float(scaling) * torch.where(agreeing >= int(min_tasks), total, 0.0)

    return _by_chunks(task_vectors, combine)


def nan_coefficients(task_vectors: Sequence[torch.Tensor], base_weight: torch.Tensor) -> list[float]:
    """NAN's coefficients (Si et al. 2025) for one tensor: α_i = (1/‖W_i‖_F) / Σ_j (1/‖W_j‖_F).

    Survey §NAN: W_i is model i's weight θ_i = θ0 + τ_i of this tensor ("the coefficient for the weight
    θ_i^(l) in task i at layer l"); norms in float64. Models whose weight is exactly zero share the whole
    weight (the limit of their norms going to zero together).
    """
    _check_task_vectors(task_vectors)
    if tuple(base_weight.shape) != tuple(task_vectors[0].shape):
        raise ValueError(f"base_weight has shape {tuple(base_weight.shape)}, the task vectors "
                         f"{tuple(task_vectors[0].shape)}")
    base = base_weight.to(device=task_vectors[0].device, dtype=COMPUTE_DTYPE)
    norms = [float(torch.linalg.vector_norm(base + task_vector.to(COMPUTE_DTYPE))) for task_vector in task_vectors]
    zero = [norm == 0 for norm in norms]
    if any(zero):
        return [1.0 / sum(zero) if is_zero else 0.0 for is_zero in zero]
    inverse = [1.0 / norm for norm in norms]
    return [value / sum(inverse) for value in inverse]


@registered("nan", "task arithmetic with α ∝ 1/‖θ_t‖ per tensor, times T/2 (Si et al. 2025, NAN)")
def nan(task_vectors: Sequence[torch.Tensor], *, base_weight: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
    """NAN (Si et al. 2025): task arithmetic with coefficients from the inverse norms of the models' weights.

    Survey §NAN: α_i = (1/‖W_i‖_F) / Σ_j (1/‖W_j‖_F) per layer (here per tensor, ``nan_coefficients``), and
    θ_M = θ0 + (T/2) Σ_i α_i τ_i (the survey's global factor T/2 against coefficients that sum to one);
    ``scaling`` multiplies that (1 = the paper). ``base_weight`` (θ0 of this tensor) is read by the merge
    writer from the base checkpoint, not from data. Data-free.
    """
    coefficients = nan_coefficients(task_vectors, base_weight)
    factor = float(scaling) * len(task_vectors) / 2
    return weighted_task_arithmetic(task_vectors, [factor * coefficient for coefficient in coefficients])


@registered("fisher",
            "Fisher-weighted average, diagonal Fishers estimated on the fit records (Matena & Raffel 2022; needs data)",
            data_options=("seed",))
def fisher(task_vectors: Sequence[torch.Tensor], *, fisher_diagonals: Sequence[torch.Tensor],
           fisher_floor: float = 1e-6, scaling: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Fisher merging (Matena & Raffel 2022): the Fisher-weighted average of the fine-tuned weights.

    A baseline of seeds 000 and 001 ("utilizing the Fisher information matrix to assess the importance of
    individual parameters").

    Survey §Fisher Average, its closed form θ_M^(j) = Σ_i λ_i F_i^(j) θ_i^(j) / Σ_i λ_i F_i^(j) with equal λ_i;
    with θ_i = θ0 + τ_i the base cancels: τ_M = Σ_i F_i τ_i / Σ_i F_i, and θ_M = θ0 + s τ_M (``scaling`` s = 1
    is the paper's average). Each F_i is floored at ``fisher_floor`` (1e-6, the authors' code), so an entry
    no model's Fisher sees is the plain mean. ``fisher_diagonals``: one diagonal Fisher per task, the
    tensor's shape, estimated on each fine-tune by `submerge.merge.learned.fisher_diagonals` (the data step;
    ``seed`` draws its sampled labels). Computed in the inputs' dtype promoted to at least float32.
    """
    _check_task_vectors(task_vectors)
    if fisher_diagonals is None or len(fisher_diagonals) != len(task_vectors):
        count = "none" if fisher_diagonals is None else len(fisher_diagonals)
        raise ValueError(f"fisher needs one Fisher diagonal per task vector: got {count} for {len(task_vectors)}")
    floor = float(fisher_floor)
    if not floor >= 0:
        raise ValueError(f"fisher_floor must be ≥ 0, got {floor}")
    shape = tuple(task_vectors[0].shape)
    numerator, denominator = None, None
    for index, (task_vector, diagonal) in enumerate(zip(task_vectors, fisher_diagonals)):
        if tuple(diagonal.shape) != shape:
            raise ValueError(f"fisher_diagonals[{index}] has shape {tuple(diagonal.shape)}, expected {shape}")
        value = _compute(task_vector)
        weight = diagonal.to(device=value.device, dtype=value.dtype).clamp(min=floor)
        numerator = weight * value if numerator is None else numerator + weight * value
        denominator = weight if denominator is None else denominator + weight
    if floor == 0:  # no Fisher anywhere: the plain mean, as with equal Fishers
        mean = _sum([_compute(task_vector) for task_vector in task_vectors]) / len(task_vectors)
        merged = torch.where(denominator > 0, numerator / torch.where(denominator > 0, denominator, 1.0), mean)
    else:
        merged = numerator / denominator
    return _as_output(float(scaling) * merged, task_vectors[0])


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


@registered("tsv-m",
            "top r/T singular vectors per task, Procrustes-decorrelated (Gargiulo et al. 2025, TSV-Merge)",
            matrix_only=True)
def tsv_m(task_vectors: Sequence[torch.Tensor], *, scaling: float = 1.0) -> torch.Tensor:
    """TSV-Merge (Gargiulo et al. 2025): τ_M = α U_⊥ Σ̂ V_⊥ᵀ.

    Survey §TSV-Merging: θ_M = θ0 + α M̂ with M̂ = Û_⊥ Σ̂ V̂_⊥ᵀ, per-task rank k = r/T
    (see ``tsv_bases``). Default α = 1 (TSV-M's setting without validation data).
    """
    _check_task_vectors(task_vectors, matrix=True)
    bases = tsv_bases(task_vectors)
    merged = (bases.left * bases.singular_values) @ bases.right.mT
    return _as_output(float(scaling) * merged, task_vectors[0])


@registered("iso-c", "task-arithmetic sum with a flat singular spectrum (Marczak et al. 2025, Iso-C)", matrix_only=True)
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
    left, singular_values, right = _thin_svd(_sum_in(task_vectors))
    rank = numerical_rank(singular_values, shape, task_vectors[0].dtype)
    if rank == 0:
        return _as_output(torch.zeros(shape, dtype=COMPUTE_DTYPE, device=left.device), task_vectors[0])
    mean_singular_value = singular_values[:rank].mean()
    merged = mean_singular_value * (left[:, :rank] @ right[:, :rank].mT)
    return _as_output(float(scaling) * merged, task_vectors[0])


@registered("iso-cts",
            "Iso-C on a common subspace plus task-specific directions (Marczak et al. 2025, Iso-CTS)",
            matrix_only=True)
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
    per_task = min(round((full_rank - math.floor(common_fraction * full_rank)) / task_count), full_rank // task_count)
    common_rank = full_rank - task_count * per_task

    left, singular_values, right = _thin_svd(_sum_in(task_vectors))
    common_rank = min(common_rank, numerical_rank(singular_values, shape, task_vectors[0].dtype))
    common_left = left[:, :common_rank]
    lefts, values, rights = [common_left], [singular_values[:common_rank]], [right[:, :common_rank]]
    if per_task > 0:
        for task_vector in task_vectors:
            task_matrix = task_vector.to(COMPUTE_DTYPE)
            residual = task_matrix - common_left @ (common_left.mT @ task_matrix)
            task_left, task_values, task_right = _thin_svd(residual)
            task_scale = float(torch.linalg.matrix_norm(task_matrix))
            keep = min(per_task, numerical_rank(task_values, shape, task_vectors[0].dtype, scale=task_scale))
            lefts.append(task_left[:, :keep])
            values.append(task_values[:keep])
            rights.append(task_right[:, :keep])
    kept_values = torch.cat(values)
    if kept_values.numel() == 0:
        return torch.zeros_like(task_vectors[0])
    orthonormal_left = procrustes_orthonormalise(torch.cat(lefts, dim=1))
    orthonormal_right = procrustes_orthonormalise(torch.cat(rights, dim=1))
    merged = kept_values.mean() * (orthonormal_left @ orthonormal_right.mT)
    return _as_output(float(scaling) * merged, task_vectors[0])


@registered("cart", "weight average plus low-rank centred task matrices (Choi et al. 2025, CART)", matrix_only=True)
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
    mean = _sum_in(task_vectors) / len(task_vectors)
    full_rank = min(mean.shape)
    rank = _count_from_fraction(rank_ratio, full_rank)
    if rank == 0 or rank >= full_rank:
        return _as_output(mean, task_vectors[0])
    low_rank_sum = torch.zeros_like(mean)
    for index, task_vector in enumerate(task_vectors):  # the SVDs do not depend on the rank: shared by candidates
        centred = lambda task_vector=task_vector: _thin_svd(task_vector.to(COMPUTE_DTYPE) - mean)
        left, singular_values, right = _shared(f"cart {index}", task_vectors, centred)
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


@registered("star",
            "spectral truncation to η of the nuclear norm, rescale, average (Lee et al. 2025, STAR)",
            matrix_only=True)
def star(task_vectors: Sequence[torch.Tensor], *, energy_fraction: float = 0.4, scaling: float = 1.0
         ) -> torch.Tensor:
    """STAR (Lee et al. 2025): truncate each task matrix's spectrum, rescale, average.

    Survey §STAR: Δ_M = (1/T) Σ_t Δ_{t,out} (see ``star_truncate``), θ_M = θ0 + Δ_M.
    Default η = 40 % (the survey: "typically set to 40"). The paper has no extra scaling: ``scaling`` λ = 1 (the
    default) is its merge, bitwise; another λ multiplies Δ_M (the global scale `diag compare` tunes, and what a
    tuned plan's STAR blocks carry).
    """
    _check_task_vectors(task_vectors, matrix=True)
    total = star_truncate(task_vectors[0], energy_fraction)
    for task_vector in task_vectors[1:]:
        total += star_truncate(task_vector, energy_fraction)
    return _as_output(total / len(task_vectors) * float(scaling), task_vectors[0])


#: SFTM solves its system by Cholesky where G's reciprocal condition number (LAPACK's 1-norm estimate) is at least
#: this, by the pseudo-inverse below it: well above the pseudo-inverse's own cut (eigenvalues below r · eps · λ_max,
#: 4e-13 at r = 1,728), so the two agree to rounding wherever Cholesky is taken.
SFTM_MIN_RCOND = 1e-6


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
    symmetric positive semi-definite, the solver solves G β = σ and sets α = β / σ: the exact
    solution when the system is regular, the minimum-norm β (the Hermitian pseudo-inverse)
    when it is singular (e.g. two identical task matrices). Where G is well conditioned
    (reciprocal condition number ≥ `SFTM_MIN_RCOND`) the pseudo-inverse is the inverse, and
    β comes from a Cholesky solve (`solve_symmetric_right`) instead of an eigendecomposition:
    the same β to rounding, in about 1/15 of the time for the r = 1,728 systems of SmolLM2's matrices.
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
        weighted = solve_symmetric_right(singular_values[None].clone(), gram, min_rcond=SFTM_MIN_RCOND)[0]
        alpha = weighted / singular_values
    return SftmSystem(coefficient_matrix, singular_values, alpha, left, right)


@registered("sftm",
            "trim, then superpose singular features by solving (Σ∘U∘V)α = σ (Qiu et al., SFTM)",
            matrix_only=True)
def sftm(task_vectors: Sequence[torch.Tensor], *, top_k: float = 0.2, scaling: float = 1.0) -> torch.Tensor:
    """SFTM (seed 001, Algorithms 1–2): superpose the task matrices' singular features.

    Alg. 2 line 5: keep the top-η entries by magnitude of each M_i (as TIES's trim);
    Alg. 1: SVD of each trimmed M_i, solve (Σ ∘ U ∘ V) α = σ (Eq. 4), M = Σ_i Σ_k α_i^(k)
    σ_i^(k) u_i^(k) v_i^(k)ᵀ (Eq. 1); Alg. 2 line 7: P = P_pre + γ M. The paper fixes no
    default: it searches η ∈ [0.1, 0.5] and γ ∈ [0.5, 1.2]; η = 0.2 follows the TIES trim
    it adopts, γ = 1 keeps every feature's gain ⟨u, M v⟩ = σ as Eq. 2 demands.
    """
    _check_task_vectors(task_vectors, matrix=True)
    # float64 trimmed matrices: sftm_system judges numerical rank at its inputs' precision
    trimmed = [keep_top_magnitude(task_vector, top_k).to(COMPUTE_DTYPE) for task_vector in task_vectors]
    system = sftm_system(trimmed)
    merged = (system.left * (system.alpha * system.singular_values)) @ system.right.mT
    return _as_output(float(scaling) * merged, task_vectors[0])


@registered("knots",
            "SVD of the concatenated updates, TIES on the aligned Σ V_t, rebuild (Stoica et al. 2024, KnOTS)",
            matrix_only=True)
def knots(task_vectors: Sequence[torch.Tensor], *, base: str = "ties", top_k: float = 0.2,
          scaling: float = 1.0) -> torch.Tensor:
    """KnOTS (Stoica et al. 2024): align the task updates by one SVD, merge their aligned parts, rebuild.

    Survey §KnOTS: SVD([Δ_1 … Δ_T]) = U Σ [V_1; …; V_T]ᵀ of the column-wise concatenation (m × T n, out × in
    weights as stored), numerically zero singular values dropped (k ≤ Σ_t rank Δ_t); a merging method is
    applied to the task-specific parts, "after optional pruning/rescaling on Σ V_i for magnitude-based
    methods": ``base="ties"`` (the paper's KnOTS-TIES) runs TIES (trim to ``top_k``, elect sign, disjoint
    mean, λ) on the k × n matrices Σ V_tᵀ, ``base="task-arithmetic"`` sums them times λ; Δ_M = U (merged Σ Vᵀ).
    With task arithmetic the SVD cancels (U Σ V_tᵀ = Δ_t): KnOTS-TA is task arithmetic. Defaults: TIES's
    top-k 20 % and λ = 1 (the paper tunes both). One m × T n float64 matrix and its SVD per tensor.
    """
    _check_task_vectors(task_vectors, matrix=True)
    if base not in ("ties", "task-arithmetic"):
        raise ValueError(f"knots base must be 'ties' or 'task-arithmetic', got {base!r}")
    columns = task_vectors[0].shape[1]
    left, singular_values, right = _shared("knots", task_vectors, lambda: _thin_svd(
        torch.cat([task_vector.to(COMPUTE_DTYPE) for task_vector in task_vectors], dim=1)))
    rank = numerical_rank(singular_values, (task_vectors[0].shape[0], columns * len(task_vectors)),
                          task_vectors[0].dtype)
    if rank == 0:
        return torch.zeros_like(task_vectors[0])
    left, scales = left[:, :rank], singular_values[:rank].to(COMPUTE_DTYPE)
    aligned = [scales[:, None] * right[index * columns:(index + 1) * columns, :rank].mT
               for index in range(len(task_vectors))]  # Σ V_tᵀ, k × n
    if base == "ties":
        merged = ties(aligned, top_k=top_k, scaling=scaling)
    else:
        merged = task_arithmetic(aligned, scaling=scaling)
    return _as_output(left @ merged, task_vectors[0])


@registered("regmean",
            "closed-form least squares on recorded input Gram matrices (Jin et al. 2023, RegMean; needs data)",
            matrix_only=True)
def regmean(
    task_vectors: Sequence[torch.Tensor],
    *,
    gram_matrices: Sequence[torch.Tensor],
    off_diagonal_scale: float = 0.9,
    scaling: float = 1.0,
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
    handled with the pseudo-inverse. ``scaling`` λ multiplies τ_M (1: the paper's merge; a tuned λ, as every
    method gets in `diag compare`, and what a tuned plan writes for a block merged by RegMean).

    Memory (float64, n = in): Σ_t G̃_t, Σ_t τ_t G̃_t and one task's τ_t beside its Gram; G̃_t is formed
    ``REGMEAN_BLOCK_ENTRIES`` entries (rows) at a time, and the solve overwrites both sums in place
    (`solve_symmetric_right`, Cholesky), so a 7B down-projection (n = 11,008) needs about 1.6 GB, not the
    3.6 GB of whole G̃_t copies and a general solve. ``gram_matrices`` may be any sequence: each Gram is taken
    once, in task order, and let go before the next (a lazy sequence never holds all T).
    """
    _check_task_vectors(task_vectors, matrix=True)
    off_diagonal_scale = _check_fraction(off_diagonal_scale, "off_diagonal_scale")
    out_features, in_features = task_vectors[0].shape
    if gram_matrices is None or len(gram_matrices) != len(task_vectors):
        count = "none" if gram_matrices is None else len(gram_matrices)
        raise ValueError(f"regmean needs one Gram matrix per task vector: got {count} for {len(task_vectors)} tasks")
    device = task_vectors[0].device
    total_gram = torch.zeros(in_features, in_features, dtype=COMPUTE_DTYPE, device=device)  # Σ_t G̃_t
    merged = torch.zeros(out_features, in_features, dtype=COMPUTE_DTYPE, device=device)  # Σ_t τ_t G̃_t, then τ_M
    blocks = _row_chunks((in_features, in_features), limit=0, entries=REGMEAN_BLOCK_ENTRIES)  # row slices
    for index, task_vector in enumerate(task_vectors):
        gram = gram_matrices[index]
        if tuple(gram.shape) != (in_features, in_features):
            raise ValueError(
                f"gram_matrices[{index}] has shape {tuple(gram.shape)}, expected ({in_features}, {in_features}) "
                f"for a weight of shape {(out_features, in_features)} (out × in)"
            )
        vector = task_vector.to(COMPUTE_DTYPE)
        for rows in blocks:
            scaled = gram[rows].to(device=device, dtype=COMPUTE_DTYPE, copy=True).mul_(off_diagonal_scale)
            diagonal = gram[rows].diagonal(offset=rows.start).to(device=device, dtype=COMPUTE_DTYPE)
            scaled.diagonal(offset=rows.start).add_(diagonal, alpha=1 - off_diagonal_scale)  # G̃_t[i, i] of rows i
            total_gram[rows] += scaled
            merged[:, rows].addmm_(vector, scaled.mT)  # (τ_t G̃_tᵀ)[:, rows] = τ_t G̃_t[rows]ᵀ
            del scaled
        del gram, vector
    merged = solve_symmetric_right(merged, total_gram)  # τ_M = (Σ τ_t G̃_t)(Σ G̃_t)⁻¹, both overwritten
    del total_gram
    if scaling != 1.0:
        merged.mul_(float(scaling))
    return _as_output(merged, task_vectors[0])


# ------------------------------------------------------------------ coefficients learned from data


@registered("adamerging",
            "θ0 + Σ λ τ, λ per tensor learned by next-token entropy minimisation (Yang et al. 2024, AdaMerging; "
            "needs data)",
            data_options=("granularity", "steps", "learning_rate", "initial"))
def adamerging(task_vectors: Sequence[torch.Tensor], weights: Sequence[float | torch.Tensor], *,
               granularity: str = "layer", steps: int = 500, learning_rate: float = 1e-3,
               initial: float = 0.3) -> torch.Tensor:
    """AdaMerging (Yang et al. 2024): θ0 + Σ_t λ_t τ_t with λ learned by entropy minimisation on unlabelled data.

    Seeds 000/001 cite it for its per-task / per-layer coefficients "on unlabeled test datasets".

    Survey §AdaMerging: task-wise θ_M = θ0 + Σ_i λ_i τ_i or layer-wise θ_M^(l) = θ0^(l) + Σ_i λ_i^(l) τ_i^(l),
    the λ minimising Σ_i Σ_{x ∈ B_i} H(f_θM(x)). This function applies the learned ``weights`` (one per task,
    for this tensor); the keyword options configure the data step that learns them
    (`submerge.merge.learned.adamerging_coefficients`): ``granularity`` "layer" (one λ per task and
    parameter tensor, the authors' layer-wise AdaMerging) or "task"; ``steps`` 500 of Adam at
    ``learning_rate`` 1e-3 from λ = ``initial`` 0.3, λ clipped to [0, 1] — the paper's settings. For a language
    model the entropy is the LM analogue of the paper's classification entropy: the mean next-token entropy of
    the merged model over the real tokens of each task's fit records, summed over tasks.
    """
    return weighted_task_arithmetic(task_vectors, weights)


@registered("lorahub",
            "θ0 + Σ w τ, w searched by CMA-ES on the fit records' loss + L1 (Huang et al. 2023, LoraHub; needs data)",
            data_options=("steps", "l1_weight", "bound", "seed"))
def lorahub(task_vectors: Sequence[torch.Tensor], weights: Sequence[float | torch.Tensor], *,
            steps: int = 40, l1_weight: float = 0.05, bound: float = 1.5, seed: int = 42) -> torch.Tensor:
    """LoraHub (Huang et al. 2023): θ0 + Σ_t w_t τ_t with w found by a gradient-free search on a few examples.

    Seeds 000/001 ("Lorahub … searches for coefficients at the task level"); the search minimises the few
    examples' loss + ``l1_weight`` · mean_t |w_t| (0.05, the authors' ``default_l1_regularization``) over
    w ∈ [−``bound``, ``bound``]ᵀ (1.5) from w = 0, with ``steps`` (40, the authors' ``max_inference_step``)
    evaluations. This function applies the found ``weights``; the data step is
    `submerge.merge.learned.lorahub_coefficients` (CMA-ES from the ``cma`` library where the authors used
    nevergrad's NGOpt; ``seed`` seeds it). The loss is the mean next-token cross-entropy of each task's fit
    records, averaged over tasks. LoraHub composes LoRA factors, (Σ w A)(Σ w B); here the dense task vectors
    are weighted, Σ w B A, for full fine-tunes and adapters alike.
    """
    return weighted_task_arithmetic(task_vectors, weights)


# ---------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class MergeMethod:
    """A registered strategy: ``function(task_vectors, **options, **inputs)`` returns the merged task vector.

    Its options and their defaults are read from ``function``'s signature (keyword parameters
    with a default), so the paper defaults live in one place, the function. Parameters without
    a default besides ``task_vectors`` are ``inputs`` that come from data, not from the user
    (RegMean's ``gram_matrices``, the closed-form merge's ``weights``); ``submerge.merge.run`` computes
    them before merging, with ``data_options`` (the data step's own options, e.g. the
    closed-form α's granularity) among the method's options.
    """

    name: str
    function: Callable[..., torch.Tensor]
    description: str = ""
    matrix_only: bool = False
    data_options: Mapping[str, object] = field(default_factory=dict)

    @property
    def options(self) -> dict[str, object]:
        """The function's own options with their defaults (from its signature)."""
        return {name: parameter.default for name, parameter in self._parameters()
                if parameter.default is not inspect.Parameter.empty}

    @property
    def inputs(self) -> tuple[str, ...]:
        """Parameters without a default that data must supply (empty for a plain strategy)."""
        return tuple(name for name, parameter in self._parameters()
                     if parameter.default is inspect.Parameter.empty and name not in CHECKPOINT_INPUTS)

    @property
    def checkpoint_inputs(self) -> tuple[str, ...]:
        """Parameters the merge writer reads from the base checkpoint itself (NAN's ``base_weight``), not data."""
        return tuple(name for name, _ in self._parameters() if name in CHECKPOINT_INPUTS)

    @property
    def needs_data(self) -> bool:
        return bool(self.inputs)

    @property
    def defaults(self) -> dict[str, object]:
        """Every option the method takes, with its default: the function's and the data step's."""
        return {**self.options, **self.data_options}

    def _parameters(self):
        parameters = list(inspect.signature(self.function).parameters.items())[1:]  # [0]: task_vectors
        return [(name, parameter) for name, parameter in parameters
                if parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]

    def resolve_options(self, options: Mapping[str, object] | None = None) -> dict[str, object]:
        """Defaults updated by ``options``; unknown keys raise, strings (from the CLI) are coerced.

        A string value takes the type of the default: "0.2" or "20%" for a float, "3" for an
        int, "true"/"false" for a bool.
        """
        defaults = self.defaults
        resolved = dict(defaults)
        for key, value in (options or {}).items():
            if key not in defaults:
                known = ", ".join(sorted(defaults)) or "none"
                raise ValueError(f"unknown option {key!r} for merge method {self.name!r} (options: {known})")
            resolved[key] = _coerce(value, defaults[key], f"{self.name} option {key!r}")
        return resolved

    def split_options(self, options: Mapping[str, object] | None = None) -> tuple[dict, dict]:
        """Resolved options as (the function's, the data step's)."""
        resolved = self.resolve_options(options)
        data = {key: resolved.pop(key) for key in self.data_options}
        return resolved, data


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





def _method(name: str, entry: dict) -> MergeMethod:
    """The `MergeMethod` of a `registered` function; data-step options given by name take their defaults from the
    function's signature."""
    options = entry["data_options"]
    if not isinstance(options, Mapping):
        parameters = inspect.signature(entry["function"]).parameters
        options = {option: parameters[option].default for option in options}
    return MergeMethod(name, entry["function"], entry["description"], entry["matrix_only"], data_options=options)


#: Every registered strategy, in the order the functions are defined above.
STRATEGIES: dict[str, MergeMethod] = {name: _method(name, entry) for name, entry in _REGISTERED.items()}

#: mergekit's spellings of methods that mean the same merge here → (method, options it implies).
#: Only the method is translated, not mergekit's parameters: mergekit's ``density`` is our ``top_k`` (TIES)
#: or ``1 - drop_rate`` (DARE), its ``lambda`` our ``scaling``. Not aliased, because the merge differs:
#: ``breadcrumbs_ties`` (ours has no sign election), ``della_linear`` (ours elects signs), ``slerp``,
#: ``model_stock``, ``sce``, ``nuslerp``, ``karcher``, ``passthrough``.
ALIASES: dict[str, tuple[str, dict[str, object]]] = {
    "task_arithmetic": ("task-arithmetic", {}),
    "linear": ("weight-average", {}),  # mergekit's linear with equal weights (its default normalize) is the mean
    "dare_linear": ("dare", {"base": "task-arithmetic"}),
    "dare_ties": ("dare", {"base": "ties"}),
    "weight_average": ("weight-average", {}),
    "closed_form": ("closed-form", {}),
}


def resolve_method(method: str | MergeMethod, options: Mapping[str, object] | None = None
                   ) -> tuple[MergeMethod, dict[str, object]]:
    """(registered method, options) for a name or a mergekit alias; an alias's implied options come first."""
    if isinstance(method, MergeMethod):
        return method, dict(options or {})
    name, implied = ALIASES.get(method, (method, {}))
    if name not in STRATEGIES:
        raise ValueError(f"unknown merge method {method!r}; known: {', '.join(STRATEGIES)} "
                         f"(mergekit spellings: {', '.join(ALIASES)})")
    return STRATEGIES[name], {**implied, **(options or {})}


# ------------------------------------------------------------------- per-parameter helper

PARAMETER_KINDS = ("matrix", "embedding", "bias", "norm")

DEFAULT_FALLBACK: dict[str, tuple[str, dict[str, object]]] = {
    # SFTM Alg. 2 lines 9–16 / docs/ARCHITECTURE.md: biases and embeddings by task arithmetic,
    # normalisation parameters by the mean.
    "embedding": ("task-arithmetic", {}),
    "bias": ("task-arithmetic", {}),
    "norm": ("weight-average", {}),
}


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
    fisher_diagonals: Sequence[torch.Tensor] | None = None,
    base_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Merge the task vectors of the parameter ``name`` with ``method``; returns τ_M.

    ``kind`` ("matrix", "embedding", "bias" or "norm") decides the route; it comes from the
    tensor table (``submerge.diagnostics.tensors.TensorInfo.kind``), the one place that classifies
    tensors. Without it the decision is by shape only: "matrix" for 2 or more dimensions,
    else "bias" (so a norm or an embedding is only recognised when ``kind`` says so). A
    matrix-only method given an embedding, bias or norm uses ``fallback[kind]`` instead: a
    method name or (name, options); the caller's ``fallback`` entries replace those of
    ``DEFAULT_FALLBACK``. Element-wise methods (TA, TIES, DARE, …) apply to every kind, as
    their papers do. Tensors with more than two dimensions are merged by matrix-only methods
    as (shape[0], −1) matrices (SFTM §3.3) and reshaped back. A ``seed`` option is mixed with
    ``name`` so that tensors of equal shape do not share one random mask. ``gram_matrices``
    (one per task) is forwarded to RegMean, ``fisher_diagonals`` (one per task) to Fisher merging,
    ``base_weight`` (θ0 of the tensor) to the methods that take it (NAN) and is ignored by the others.
    ``method`` may be a mergekit spelling (``ALIASES``).
    """
    merge_method, options = resolve_method(method, options)
    _check_task_vectors(task_vectors)
    shape = tuple(task_vectors[0].shape)
    kind = kind or ("matrix" if len(shape) >= 2 else "bias")
    if kind not in PARAMETER_KINDS:
        raise ValueError(f"{name}: kind must be one of {PARAMETER_KINDS}, got {kind!r}")
    resolved, _ = merge_method.split_options(options)
    if merge_method.matrix_only and kind != "matrix":
        return _fallback(name, task_vectors, merge_method, kind, fallback)
    if "seed" in resolved:
        resolved["seed"] = _parameter_seed(resolved["seed"], name)
    resolved.update(_inputs(name, merge_method, {"gram_matrices": gram_matrices, "fisher_diagonals": fisher_diagonals}))
    if "base_weight" in merge_method.checkpoint_inputs:
        if base_weight is None:
            raise ValueError(f"{name}: merge method {merge_method.name!r} needs base_weight (θ0 of the tensor: merge "
                             "through submerge.merge.writer, which reads it from the base checkpoint)")
        resolved["base_weight"] = base_weight
    if merge_method.matrix_only:
        if len(shape) < 2:
            raise ValueError(f"{name}: method {merge_method.name!r} needs a matrix, got shape {shape}")
        if len(shape) > 2:
            matrices = [task_vector.reshape(shape[0], -1) for task_vector in task_vectors]
            return merge_method.function(matrices, **resolved).reshape(shape)
    return merge_method.function(list(task_vectors), **resolved)


@dataclass(frozen=True)
class MergedTaskVector:
    """τ_M of one tensor under a registered method (paper defaults updated by ``options``), as a picklable callable
    ``(name, task_vectors, kind) → τ_M``: what ``diag interference --sar-against METHOD`` measures SAR against
    (`submerge.diagnostics.interference.interference`'s ``sar_against``). Unknown methods or options fail here,
    before any work."""

    method: str
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        registered, options = resolve_method(self.method, self.options)
        registered.resolve_options(options)
        object.__setattr__(self, "options", dict(options))

    @property
    def label(self) -> str:
        return self.method

    def __call__(self, name: str, task_vectors: Sequence[torch.Tensor], kind: str | None = None) -> torch.Tensor:
        return merge_parameter(name, task_vectors, self.method, self.options, kind=kind)


#: Methods whose merged row i depends on row i of the task vectors alone (no statistic over the whole tensor,
#: no random stream): a large tensor can be read, merged and written in row blocks (`submerge.merge.writer`).
ROW_LOCAL_METHODS = frozenset({"task-arithmetic", "weight-average", "closed-form", "consensus"})


def is_row_local(method: str | MergeMethod, kind: str) -> bool:
    """Whether `method` (after the matrix-only fallback for `kind`) merges a tensor row by row."""
    merge_method, _ = resolve_method(method)
    if merge_method.matrix_only and kind != "matrix":
        route = DEFAULT_FALLBACK.get(kind)
        return route is not None and route[0] in ROW_LOCAL_METHODS
    return merge_method.name in ROW_LOCAL_METHODS


def _fallback(name, task_vectors, merge_method: MergeMethod, kind: str, fallback) -> torch.Tensor:
    routes = {**DEFAULT_FALLBACK, **(fallback or {})}
    if kind not in routes:
        raise ValueError(f"{name}: no fallback for kind {kind!r} under matrix-only method {merge_method.name!r}")
    route = routes[kind]
    fallback_name, fallback_options = (route, {}) if isinstance(route, str) else route
    fallback_method, fallback_options = resolve_method(fallback_name, fallback_options)
    if fallback_method.matrix_only or fallback_method.needs_data:
        raise ValueError(f"{name}: fallback for kind {kind!r} must be an element-wise method, got {fallback_name!r}")
    return merge_parameter(name, task_vectors, fallback_method, fallback_options, kind=kind)


def _inputs(name: str, merge_method: MergeMethod, tensor_inputs: Mapping[str, object]) -> dict[str, object]:
    """The per-tensor data inputs of a method (`TENSOR_INPUTS`: RegMean's Gram matrices, Fisher merging's
    diagonals); a weighted method's weights are not per name, so a method that needs them cannot run here."""
    wanted = TENSOR_INPUTS.get(merge_method.name)
    for key, value in tensor_inputs.items():
        if value is not None and key != wanted:
            users = [method for method, parameter in TENSOR_INPUTS.items() if parameter == key]
            raise ValueError(f"{name}: {key} are only used by {', '.join(users)}, not {merge_method.name!r}")
    if wanted is not None:
        if tensor_inputs.get(wanted) is None:
            what = {"gram_matrices": "the inputs' X_tᵀX_t per task", "fisher_diagonals": "one Fisher per task"}
            raise ValueError(f"{name}: {merge_method.name} needs {wanted} ({what[wanted]}) for this tensor")
        return {wanted: tensor_inputs[wanted]}
    if merge_method.inputs:
        raise ValueError(f"{name}: merge method {merge_method.name!r} needs {', '.join(merge_method.inputs)} "
                         "from data (run it through submerge.merge.run / diag merge with --data)")
    return {}

"""Merging one tensor: the pure `merge_tensor`, reading a tensor's inputs and merging it (`merge_named`), row by row
for large row-local rules (`merge_row_blocks`), and the worker that merges groups of tensors on any engine.

Both engines run this code (`submerge.diagnostics.execution`): `MergeTask` is the picklable description a Ray
worker opens (it reopens the checkpoints from their paths and merges whole tensors, which travel back to the
driver); in this process it reuses the readers already open and streams large row-local tensors in row blocks.
Either way the tensors are bitwise the same (`merge_row_blocks` gives the rows of the whole merge).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from submerge.diagnostics.checkpoints import checkpoint_spec, reopen_checkpoint
from submerge.diagnostics.placement import process_stats
from submerge.diagnostics.task_vectors import all_finite, reopen_task_vectors, task_vector_specs
from submerge.diagnostics.tensors import TensorInfo, TensorTable
from submerge.merge.rules import MergeError, ParameterRule
from submerge.merge.strategies import (
    CHUNK_THRESHOLD,
    TENSOR_INPUTS,
    compute_dtype,
    is_row_local,
    merge_parameter,
    shared_factors,
    weighted_task_arithmetic,
)

#: Tensors above this many entries whose rule merges row by row are read, merged and written in row blocks of
#: about STREAM_ELEMENTS entries per input (`merge_row_blocks`). Small blocks are faster, not only leaner: each
#: block's temporaries are fresh allocations, and above glibc's mmap threshold (≤ 32 MiB) every one of them is
#: new pages the kernel must fault in and zero. Task arithmetic on the 7B-width 1-layer slice of
#: benchmarks/scale.py: 14.5 s with 2**24 entries (64 MiB in float32), 10.8 s with 2**22, 7.4 s with 2**20.
STREAM_THRESHOLD = CHUNK_THRESHOLD
STREAM_ELEMENTS = 2**20


def merge_tensor(info: TensorInfo, base_tensor: torch.Tensor, task_vectors: Mapping[str, torch.Tensor],
                 rule: ParameterRule, grams: list[torch.Tensor] | None = None, *,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """θ0 + τ_M of one tensor: `task_vectors` (task → τ_t) merged by `rule`, added to `base_tensor`.

    A weights rule is `weighted_task_arithmetic` with each task's weight (0 for a task it does
    not name); a method rule is `merge_parameter` with the table's ``kind``, the base tensor (NAN's
    ``base_weight``) and the method's per-tensor data input `grams`, one per task (`TENSOR_INPUTS`:
    RegMean's input Grams — a Conv1D weight stored (in, out) is transposed around RegMean — or
    Fisher merging's diagonals). The sum is taken in float32 and returned in `dtype` (default: the base
    tensor's). Non-floating tensors (integer buffers) are returned as they are. A NaN/Inf result is a
    `MergeError` naming the tensor.
    """
    if not base_tensor.is_floating_point():
        return base_tensor
    vectors = list(task_vectors.values())
    if rule.weights is not None:
        delta = weighted_task_arithmetic(vectors, [rule.weights.get(task, 0.0) for task in task_vectors])
    else:
        try:
            delta = method_delta(info, vectors, rule, grams, base_weight=base_tensor)
        except ValueError as exc:
            raise MergeError(f"merging '{info.name}' {tuple(base_tensor.shape)}: {exc}") from exc
    compute = compute_dtype(base_tensor.dtype)
    merged = (base_tensor.to(compute) + delta.to(compute)).to(dtype or base_tensor.dtype)
    if not all_finite(merged):
        raise MergeError(f"merged tensor '{info.name}' has NaN/Inf values (rule: {rule.describe()})")
    return merged


def method_delta(info: TensorInfo, vectors: list[torch.Tensor], rule: ParameterRule,
                 grams: list[torch.Tensor] | None = None, *, base_weight: torch.Tensor | None = None) -> torch.Tensor:
    """τ_M of one tensor under a method rule (`merge_parameter` with the table's ``kind``): the method's per-tensor
    data input `grams` (`TENSOR_INPUTS`, one per task; a Conv1D weight stored (in, out) is transposed around
    RegMean) and θ0 of the tensor (`base_weight`, NAN's). The writer and the evidence step's candidate merges
    (`submerge.merge.plan.rule_delta`) both merge through it. A ValueError names what is wrong."""
    transposed = bool(grams) and rule.method == "regmean" and info.transposed
    if transposed:  # GPT-2 Conv1D stores (in, out)
        vectors = [v.T for v in vectors]
    inputs = {TENSOR_INPUTS[rule.method]: grams} if grams and rule.method in TENSOR_INPUTS else {}
    delta = merge_parameter(info.name, vectors, rule.method, rule.options, kind=info.kind, base_weight=base_weight,
                            **inputs)
    return delta.T if transposed else delta


def merge_named(name: str, base_reader, task_vectors, table: TensorTable, rule_fors: Sequence[Callable], *, dtype,
                device, gram_matrices) -> list[tuple[torch.Tensor, str | None]]:
    """(merged tensor, description of its rule) of the base tensor `name` under each rule function of `rule_fors`
    (the outputs of one pass, `submerge.merge.writer.write_merges`); an integer buffer comes back as read (no rule).
    The tensor and its task vectors are read once for all of them, and their merges share the decompositions they
    have in common (`submerge.merge.strategies.shared_factors`). The inputs' files are unmapped afterwards, so their
    pages do not pile up in the RSS."""
    base_tensor = base_reader.get(name, device=device)
    results: list[tuple[torch.Tensor, str | None]] = [(base_tensor, None)] * len(rule_fors)
    if base_tensor.is_floating_point():
        info = table.get(name, tuple(base_tensor.shape))
        rules = [rule_for(info) for rule_for in rule_fors]
        vectors = {task: reader.get(name, torch.float32, device) for task, reader in task_vectors.items()}
        grams = gram_matrices(name) if (gram_matrices and any(r.method in TENSOR_INPUTS for r in rules)) else None
        with shared_factors():
            results = [(merge_tensor(info, base_tensor, vectors, rule, grams if rule.method in TENSOR_INPUTS else None,
                                     dtype=dtype), rule.describe()) for rule in rules]
        del vectors
    for reader in (base_reader, *(tv.finetuned for tv in task_vectors.values())):
        reader.release()
    return results


def _row_local(rule: ParameterRule, info: TensorInfo) -> bool:
    if rule.weights is not None:
        return all(isinstance(w, (int, float)) for w in rule.weights.values())  # per-head weights slice columns
    return is_row_local(rule.method, info.kind)


def merge_row_blocks(name: str, base_reader, task_vectors, table: TensorTable, rule_for, *, dtype,
                     device) -> tuple[Iterator[torch.Tensor], str] | None:
    """(θ0 + τ_M in blocks of rows, rule description) of a tensor above STREAM_THRESHOLD entries whose rule merges
    row by row (`submerge.merge.strategies.is_row_local`), each block read from the checkpoints alone (about
    STREAM_ELEMENTS entries per input): the peak is a few blocks, not T + 3 copies of the tensor. None for
    any other tensor (merged whole by `merge_named`). The blocks are bitwise the rows of the whole merge."""
    shape = tuple(base_reader.shape(name))
    if (len(shape) < 2 or math.prod(shape) <= STREAM_THRESHOLD or not base_reader.dtype(name).is_floating_point
            or not all(reader.reads_rows(name) for reader in task_vectors.values())):
        return None
    info = table.get(name, shape)
    rule = rule_for(info)
    if not _row_local(rule, info):
        return None
    step = max(1, STREAM_ELEMENTS // math.prod(shape[1:]))

    def blocks() -> Iterator[torch.Tensor]:
        for start in range(0, shape[0], step):
            rows = slice(start, min(start + step, shape[0]))
            base = base_reader.get_rows(name, rows, device=device)
            base32 = base.to(torch.float32)
            vectors = {task: reader.get_rows(name, rows, torch.float32, device, base=base32)
                       for task, reader in task_vectors.items()}
            del base32
            yield merge_tensor(info, base, vectors, rule, dtype=dtype)
        for reader in (base_reader, *(tv.finetuned for tv in task_vectors.values())):
            reader.release()

    return blocks(), rule.describe()


class MergeWorker:
    """Merges the groups of tensors it is given: per tensor, (name, [(merged tensor — or its row blocks with
    `stream` —, rule) for each rule function of `rule_fors`])."""

    def __init__(self, base, task_vectors: dict, rule_fors: Sequence[Callable], gram_matrices: Callable | None, *,
                 dtype, device: str, stream: bool):
        self.base, self.task_vectors, self.table = base, task_vectors, TensorTable.from_reader(base)
        self.rule_fors, self.gram_matrices, self.stream = tuple(rule_fors), gram_matrices, stream
        self.options = {"dtype": dtype, "device": device}

    def merge(self, names: list[str]) -> list[tuple]:
        merged = []
        for name in names:
            streamed = [merge_row_blocks(name, self.base, self.task_vectors, self.table, rule_for, **self.options)
                        if self.stream else None for rule_for in self.rule_fors]
            whole = [rule_for for rule_for, blocks in zip(self.rule_fors, streamed) if blocks is None]
            read = iter(merge_named(name, self.base, self.task_vectors, self.table, whole,
                                    gram_matrices=self.gram_matrices, **self.options) if whole else ())
            merged.append((name, [blocks or next(read) for blocks in streamed]))
        return merged

    def stats(self) -> dict:
        """This worker process: its pid, host and peak resident memory (MiB)."""
        return process_stats()


@dataclass
class MergeTask:
    """What a worker needs to merge tensors: the checkpoints (reopened from their paths in a Ray worker; here the
    readers already open, which are not pickled), the rule function of each output, the per-tensor data inputs
    (RegMean's Gram matrices, Fisher's diagonals), dtype and device.

    Pickled for Ray, a per-tensor source with ``names`` (`submerge.diagnostics.capture.GramsByLayer`, which holds
    one block's Grams and continues a forward; `submerge.merge.learned.FisherDiagonals`, on this machine's disk) is
    read whole here first, and sent as a dict."""

    method: ClassVar[str] = "merge"
    base: dict
    task_vectors: dict
    rule_fors: tuple
    gram_matrices: Callable | None
    dtype: torch.dtype | None
    device: str
    opened: tuple | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, base_reader, task_vectors: dict, rule_fors, gram_matrices, *, dtype, device) -> MergeTask:
        return cls(checkpoint_spec(base_reader), task_vector_specs(task_vectors), tuple(rule_fors), gram_matrices, dtype,
                   device, opened=(base_reader, task_vectors))

    def __getstate__(self) -> dict:
        grams = self.gram_matrices
        if grams is not None and hasattr(grams, "names"):  # GramsByLayer: every block's Grams, computed here
            grams = {name: grams(name) for name in sorted(grams.names)}.get
        return {**self.__dict__, "gram_matrices": grams, "opened": None}

    def open(self) -> MergeWorker:
        if self.opened is not None:
            base, task_vectors = self.opened
        else:
            base = reopen_checkpoint(self.base)
            task_vectors = reopen_task_vectors(base, self.task_vectors)
        return MergeWorker(base, task_vectors, self.rule_fors, self.gram_matrices, dtype=self.dtype,
                           device=self.device, stream=self.opened is not None)

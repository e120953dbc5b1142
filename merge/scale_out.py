"""`diag merge` on Ray: groups of tensors merged by worker processes, the checkpoint written by the driver alone.

The base's tensors are cut, in the writer's order (`submerge.merge.writer.writing_order`), into groups
(`submerge.diagnostics.scale_out.group_matrices`: a tensor of 2²⁰ elements or more alone, smaller ones together); each
of ``workers`` Ray actors reopens the base and the fine-tunes from their paths and merges the groups it is given
with the same `submerge.merge.writer.merge_named` as one process (the rule function — a plan's or a method's — and
RegMean's Gram matrices, all computed here, are sent to each worker once). Merged tensors come back in that
order and the driver streams them into its `ShardWriter`, so the output is byte for byte the one-process output
(same torch build and threads). A worker that dies is restarted and its group redone. Memory per worker: one
tensor per input model of its group plus the merged ones; the driver holds the tensors that arrived ahead of
the next one it writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from submerge.diagnostics import scale_out as common
from submerge.diagnostics.tensors import TensorTable

__all__ = ["MergeWorker", "ray_merged"]


class MergeWorker:
    """One worker process: opens the checkpoints once, then merges the groups of tensors it is given."""

    def __init__(self, base_spec: dict, task_specs: dict, rule_for: Callable, gram_matrices: Callable | None,
                 options: dict, threads: int | None):
        if threads:
            torch.set_num_threads(threads)
        self.base = common.reopen_checkpoint(base_spec)
        self.task_vectors = common.reopen_task_vectors(self.base, task_specs)
        self.table = TensorTable.from_reader(self.base)
        self.rule_for, self.gram_matrices, self.options = rule_for, gram_matrices, options

    def merge(self, names: list[str]) -> list[tuple]:
        from submerge.merge.writer import merge_named

        return [(name, *merge_named(name, self.base, self.task_vectors, self.table, self.rule_for,
                                    gram_matrices=self.gram_matrices, **self.options)) for name in names]

    def stats(self) -> dict:
        """This worker process: its pid, host and peak resident memory (MiB)."""
        return common.process_stats()


def ray_merged(names: list[str], base_reader, task_vectors: dict, rule_for: Callable, *, address: str, workers: int,
               dtype, device: str, gram_matrices: Callable | None = None, max_retries: int = 3,
               gpus_per_worker: float = 0, threads_per_worker: int | None = None,
               report: dict | None = None) -> Iterator[tuple]:
    """(name, merged tensor, rule description) of every base tensor of `names`, in that order, from Ray workers.

    RegMean's Grams are computed here, all of them (a `GramsByLayer` holds one block's), and sent to each worker.
    """
    if gram_matrices is not None and hasattr(gram_matrices, "names"):
        gram_matrices = {name: gram_matrices(name) for name in names if name in gram_matrices.names}.get
    sizes = [math.prod(base_reader.shape(name)) for name in names]
    args = (common.checkpoint_spec(base_reader), common.task_vector_specs(task_vectors), rule_for, gram_matrices,
            {"dtype": dtype, "device": device}, threads_per_worker)
    groups = common.group_matrices(names, sizes, workers)
    for group in common.ordered_results(address, MergeWorker, args, "merge", groups, workers=workers,
                                        max_retries=max_retries, gpus_per_worker=gpus_per_worker, report=report):
        yield from group

"""Interference on Ray: matrices measured by N worker processes, results written by the driver alone.

Ray is an optional extra (``pip install "submerge[ray]"``) and is imported only
here, only when :func:`submerge.diagnostics.interference.interference` is called with
``ray=``.  ``ray="auto"`` starts a local Ray instance on this machine (or uses
the one this process already started with ``ray.init``); ``ray=ADDRESS``
joins an existing cluster (``ray start --head`` on one node, ``ray start
--address=...`` on the others).

Work split.  The matrices still to do are cut, in matrix order, into groups: a
matrix of 2²⁰ elements or more is a group of its own, smaller ones are grouped
up to that size (and to at most 1/(4·workers) of all the elements, so that
every worker gets work).  ``workers`` Ray actors each open the checkpoints
themselves from their paths (``checkpoint_spec``: a file system the nodes
share, or the same hub cache on each node); only the names of a group go to a
worker and only the per-matrix result dicts come back, never tensors.  Results
come back in matrix order (``ray.util.ActorPool.map``), so the driver writes
the store through ``UnitWriter`` exactly as one process does: resume, settings
checks and provenance are the same.  A worker process that dies (killed, out of
memory, a lost node) is restarted and its group redone, up to ``max_retries``
times; an exception raised by the measurement itself (a NaN in a checkpoint) is
not retried and reaches the caller as it would in one process.

Memory: each worker holds what one process would (the T task matrices of one
matrix and their SVDs) plus its open checkpoints (memory-mapped safetensors:
pages of the tensors it reads; a GGUF or ``.bin`` checkpoint is loaded whole
in every worker).

Bitwise equality with one process: every matrix is measured by the same code on
the same tensors; results are equal bit for bit when the workers run the same
torch build with the same number of threads per matrix as the single process
(``threads_per_worker``; multi-threaded float reductions may sum in another
order otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from submerge.diagnostics.interference.driver import MatrixJob, measure_matrix
from submerge.diagnostics.placement import pick_device
from submerge.diagnostics.scale_out import (
    GROUP_ELEMENTS,
    checkpoint_spec,
    group_matrices,
    ordered_results,
    process_stats,
    reopen_checkpoint,
    reopen_task_vectors,
    task_vector_specs,
)

__all__ = ["GROUP_ELEMENTS", "checkpoint_spec", "group_matrices", "ray_results", "reopen_checkpoint"]


class InterferenceWorker:
    """One worker process: opens the checkpoints once, then measures the groups of matrices it is given."""

    def __init__(self, base_spec: dict, task_specs: dict, job: MatrixJob, device: str, threads: int | None):
        if threads:
            torch.set_num_threads(threads)
        self.task_readers = reopen_task_vectors(reopen_checkpoint(base_spec), task_specs)
        self.job, self.device = job, pick_device(device)

    def measure(self, names: list[str]) -> list[tuple]:
        return [(name, *measure_matrix(name, self.task_readers, self.job, self.device)) for name in names]

    def stats(self) -> dict:
        """This worker process: its pid, host and peak resident memory (MiB)."""
        return process_stats()


def ray_results(address: str, names: list[str], base, task_readers: dict, job: MatrixJob, *, device: str, workers: int,
                max_retries: int = 3, gpus_per_worker: float = 0, threads_per_worker: int | None = None,
                report: dict | None = None) -> Iterator[tuple]:
    """(name, shape, result) of every matrix in ``names``, in order, measured by ``workers`` Ray actors.

    ``report`` (a dict), when given, receives ``workers``: each worker's `InterferenceWorker.stats` at the end.
    """
    if not names:
        return
    sizes = [math.prod(base.shape(name)) for name in names]
    args = (checkpoint_spec(base), task_vector_specs(task_readers), job, device, threads_per_worker)
    for group in ordered_results(address, InterferenceWorker, args, "measure", group_matrices(names, sizes, workers),
                                 workers=workers, max_retries=max_retries, gpus_per_worker=gpus_per_worker,
                                 report=report):
        yield from group

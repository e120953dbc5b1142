"""The per-matrix work of ``diag interference``: read one matrix's T task matrices and measure them.

Both engines run this code (`submerge.diagnostics.execution`): `InterferenceTask` is the picklable description a
Ray worker opens (it reopens the checkpoints from their paths: a file system the nodes share, or the same hub cache
on each node); in this process it reuses the readers already open. Only the names of a group go to a worker and
only the per-matrix result dicts come back, never tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from submerge.diagnostics.checkpoints import checkpoint_spec, reopen_checkpoint
from submerge.diagnostics.interference.metrics import task_matrix_interference
from submerge.diagnostics.placement import pick_device, process_stats
from submerge.diagnostics.spectral import svd_dtype as _svd_dtype
from submerge.diagnostics.task_vectors import reopen_task_vectors, task_vector_specs

#: Δ_M of one matrix for SAR: ``merged(name, task_matrices, kind)``; None is task arithmetic Σ_t Δ_t. A merge
#: strategy's callable comes from the layer above (`submerge.merge.strategies.MergedTaskVector`): diagnostics
#: never import merge.
MergedMatrix = Callable[[str, list[torch.Tensor], "str | None"], torch.Tensor]


@dataclass(frozen=True)
class MatrixJob:
    """The settings that measuring one matrix needs besides its tensors (picklable)."""

    rank_fracs: tuple[float, ...]
    sar_against: str  # "ta", or the label of `sar_merge`
    sar_options: dict | None
    eps: float
    svd_dtype: str | torch.dtype
    transposed: frozenset[str]
    kinds: dict[str, str] = field(default_factory=dict)  # matrix name -> TensorInfo.kind (merge fallbacks)
    sar_merge: MergedMatrix | None = None
    exact_svd: bool = False  # full thin SVDs (the reference) instead of the Gram route


def measure_matrix(name: str, task_readers: dict, job: MatrixJob, device) -> tuple[tuple[int, int], dict]:
    """Read the T task matrices of matrix ``name`` and measure them: (shape as measured, metrics dict).

    A Conv1D weight (``name in job.transposed``) is transposed to (out, in) first, so U is
    always the output space and the row space V the input space, as CART's I(k) assumes. Each reader's files are
    unmapped once its τ is formed (a tensor of its own), before the SVDs: the pages read leave the RSS.
    """
    dtype = _svd_dtype(job.svd_dtype)
    task_matrices = []
    for reader in task_readers.values():
        delta = reader.get(name, dtype=dtype, device=device)
        task_matrices.append(delta.T if name in job.transposed else delta)
        reader.release()  # τ is its own tensor: the checkpoints' pages read for it leave the RSS before the SVDs
    merged = None if job.sar_merge is None else job.sar_merge(name, task_matrices, job.kinds.get(name))
    result = task_matrix_interference(task_matrices, job.rank_fracs, merged, eps=job.eps, svd_dtype=job.svd_dtype,
                                      exact_svd=job.exact_svd)
    return tuple(task_matrices[0].shape), result


class MatrixWorker:
    """Measures the groups of matrices it is given, with the task-vector readers it holds."""

    def __init__(self, task_readers: dict, job: MatrixJob, device: str):
        self.task_readers, self.job, self.device = task_readers, job, pick_device(device)

    def measure(self, names: list[str]) -> list[tuple]:
        """(name, shape, result) of each matrix of the group, in order. The checkpoints' pages read for a matrix
        leave the RSS once its task matrices are formed (`measure_matrix`; at 7B the mapped pages of every matrix
        read so far would add up)."""
        return [(name, *measure_matrix(name, self.task_readers, self.job, self.device)) for name in names]

    def stats(self) -> dict:
        """This worker process: its pid, host and peak resident memory (MiB)."""
        return process_stats()


@dataclass
class InterferenceTask:
    """What a worker needs to measure matrices: the checkpoints (reopened from their paths in a Ray worker; the
    readers already open here, which are not pickled), the job and the device."""

    method: ClassVar[str] = "measure"
    base: dict
    task_vectors: dict
    job: MatrixJob
    device: str
    opened: dict | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, base_reader, task_readers: dict, job: MatrixJob, device: str) -> InterferenceTask:
        return cls(checkpoint_spec(base_reader), task_vector_specs(task_readers), job, device, opened=task_readers)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "opened": None}

    def open(self) -> MatrixWorker:
        readers = self.opened or reopen_task_vectors(reopen_checkpoint(self.base), self.task_vectors)
        return MatrixWorker(readers, self.job, self.device)

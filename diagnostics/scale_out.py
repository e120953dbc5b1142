"""What every Ray scale-out shares: joining Ray, reopening checkpoints in a worker, a worker's memory.

Ray is an optional extra (``pip install "submerge[ray]"``), imported only when a driver is called with
``ray=``: ``"auto"`` starts a local Ray instance (or uses the one this process already started with
``ray.init``), an address joins a cluster (``ray start --head`` on one node, ``ray start --address=...``
on the others). Workers reopen the checkpoints from their paths (a file system the nodes share, or the
same hub cache on each node). The drivers: `submerge.diagnostics.interference.scale_out` (matrices as tasks) and
`submerge.diagnostics.linearity.scale_out` (a pipeline over blocks).
"""

from __future__ import annotations

import math
import os
import platform
import resource
import sys
from collections.abc import Iterator
from pathlib import Path

from submerge.diagnostics.checkpoints import LoraReader, StateDictReader, open_checkpoint
from submerge.diagnostics.task_vectors import TaskVectorReader

RAY_EXTRA = "pip install 'submerge[ray]' (or pip install 'ray>=2.9')"
GROUP_ELEMENTS = 1 << 20  # a tensor this large is a task of its own; smaller ones are grouped up to it


def check_workers(ray: str | None, workers: int) -> None:
    """A worker count >= 1, and more than 1 only with Ray."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1 or (ray is None and workers != 1):
        raise ValueError(f"workers={workers!r}: give a count >= 1, and more than 1 only with ray='auto' or an address")


def connect(address: str, workers: int, gpus_per_worker: float = 0) -> bool:
    """Start (``"auto"``) or join (an address) Ray unless this process is connected already; True if we did.

    Every worker holds 1 CPU (and ``gpus_per_worker`` GPUs) for the whole run, so a cluster with fewer is an
    error here rather than a run that waits forever.
    """
    try:
        import ray
    except ImportError:
        raise ImportError(f"ray= needs Ray: {RAY_EXTRA}") from None
    started = not ray.is_initialized()
    if started and address == "auto":
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    elif started:
        ray.init(address=address, log_to_driver=False)
    have = ray.cluster_resources()
    if have.get("CPU", 0) < workers or have.get("GPU", 0) < workers * gpus_per_worker:
        if started:
            ray.shutdown()
        raise ValueError(f"{workers} Ray workers need {workers} CPUs and {workers * gpus_per_worker:g} GPUs; the "
                         f"Ray cluster has {have.get('CPU', 0):g} CPUs and {have.get('GPU', 0):g} GPUs")
    return started


def checkpoint_spec(reader) -> dict:
    """What a worker needs to reopen a `CheckpointReader`: its resolved path and how it was opened."""

    if not hasattr(reader, "path"):
        raise TypeError(f"ray needs checkpoints it can reopen from a path; {type(reader).__name__} has none")
    return {"path": str(Path(reader.path).resolve()), "lora": isinstance(reader, LoraReader),
            "allow_pickle": isinstance(reader, StateDictReader)}


def reopen_checkpoint(spec: dict, base=None):
    """The `CheckpointReader` of a :func:`checkpoint_spec` (a LoRA adapter is read against ``base``)."""

    return open_checkpoint(spec["path"], base=base if spec["lora"] else None, allow_pickle=spec["allow_pickle"])


def task_vector_specs(task_readers: dict) -> dict:
    """{task: (checkpoint spec of the fine-tune, vocab)} of `TaskVectorReader`s, for `reopen_task_vectors`."""
    return {task: (checkpoint_spec(reader.finetuned), reader.vocab) for task, reader in task_readers.items()}


def reopen_task_vectors(base, specs: dict) -> dict:
    """The `TaskVectorReader`s of `task_vector_specs` against the base `CheckpointReader` ``base``."""

    return {task: TaskVectorReader(task, base, reopen_checkpoint(spec, base), vocab)
            for task, (spec, vocab) in specs.items()}


def process_stats() -> dict:
    """This process: its pid, host and peak resident memory (MiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"pid": os.getpid(), "host": platform.node(),
            "peak_rss_mib": peak / (1 << 20) if sys.platform == "darwin" else peak / 1024}


def group_matrices(names: list[str], sizes: list[int], workers: int) -> list[list[str]]:
    """Contiguous groups of ``names`` (in order) of about min(2²⁰, total / (4·workers)) elements each."""
    target = min(GROUP_ELEMENTS, max(1, math.ceil(sum(sizes) / (4 * max(1, workers)))))
    groups: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, size in zip(names, sizes):
        current.append(name)
        filled += size
        if filled >= target:
            groups.append(current)
            current, filled = [], 0
    if current:
        groups.append(current)
    return groups


def _pool(actors: list):
    """The actors as a `ray.util.ActorPool`: ordered results, each actor given a new group when it is free."""
    from ray.util import ActorPool

    return ActorPool(actors)


def ordered_results(address: str, worker: type, args: tuple, method: str, groups: list, *, workers: int,
                    max_retries: int = 3, gpus_per_worker: float = 0, report: dict | None = None) -> Iterator:
    """``worker(*args).<method>(group)`` of every group, in group order, computed by ``workers`` Ray actors.

    A worker process that dies is restarted (``max_retries`` times) and its group redone; an exception of
    the method itself is not retried. ``report`` (a dict) receives ``workers``: each actor's ``stats()``.
    """
    import ray

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    started = connect(address, workers, gpus_per_worker)
    remote = ray.remote(worker).options(num_cpus=1, num_gpus=gpus_per_worker, max_restarts=max_retries,
                                        max_task_retries=max_retries)
    actors = [remote.remote(*args) for _ in range(workers)]
    try:
        yield from _pool(actors).map(lambda actor, group: getattr(actor, method).remote(group), groups)
        if report is not None:
            report["workers"] = ray.get([actor.stats.remote() for actor in actors])
    finally:
        for actor in actors:
            ray.kill(actor)
        if started:
            ray.shutdown()

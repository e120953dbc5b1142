"""Execution: where a run's work runs — this process or Ray workers — with how many threads, and the settings
every driver shares.

One small interface, `Engine`, with two implementations in this module (the model: nnsight's swappable backends,
mergekit's ``Executor`` / ``MultiGPUExecutor`` over one planned task graph):

- ``map(task, groups)``: the results of ``task.open().<task.method>(group)`` for every group of items, **in group
  order** — the matrices of ``diag interference``, the tensors of a merge, the models of ``diag eval``. `task` is a
  small picklable description of the per-item work (`WorkerTask`); the per-item code lives in leaf modules
  (`submerge.diagnostics.interference.jobs`, `submerge.merge.tensor_merge`, `submerge.diagnostics.evaluate`) that
  both engines run.
- ``sweep(sweep)``: the layers of a linearity sweep (capture, replay, measure per unit), as a context manager that
  gives a *layer runner* (``layer_results``, ``model_unit``): `submerge.diagnostics.replay.LocalLayers` in this process, or a pipeline of Ray
  workers over contiguous block ranges (`submerge.diagnostics.pipeline.Pipeline`).
- ``running()``: the context every run executes in (the thread count fixed; Ray joined).

Drivers never import Ray and never decide where they run: the caller (the CLI's ``--ray`` / ``--workers`` /
``--threads``) builds the engine and passes it in `RunSettings`. The driver alone writes the store, in order, so
resume, settings checks and provenance are the same on every engine, and a run resumes across engines.

Threads. torch's multi-threaded float reductions, and LAPACK's (scipy's eigendecompositions in the Gram route), sum
in another order with another thread count. Every engine therefore fixes the intra-op thread count of every task,
torch's and the BLAS libraries' alike (`threads`; default: this process's count when the engine
is made) and records it in the store's provenance (``provenance.engine``): with the same `threads`, stores and
merged checkpoints are bitwise equal whatever the engine and the worker count. A Ray worker holds 1 CPU of the
cluster's accounting (``num_cpus=1``, so a run needs `workers` CPUs) and computes with `threads` threads.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import threadpoolctl
import torch

from submerge.diagnostics.base_model import LoadSettings
from submerge.diagnostics.capture import DEFAULT_CAPTURE_BUDGET
from submerge.diagnostics.errors import EngineError, SubmergeError  # noqa: F401 (EngineError: re-exported)
from submerge.diagnostics.pipeline import Pipeline, remote_error
from submerge.diagnostics.placement import hold_threads, process_stats
from submerge.diagnostics.replay import LocalLayers

RAY_EXTRA = "pip install 'submerge[ray]' (or pip install 'ray>=2.9')"
GROUP_ELEMENTS = 1 << 20  # a tensor this large is a group of its own; smaller ones are grouped up to it
CONNECT_TIMEOUT = 60.0  # seconds to reach a Ray cluster before giving up with a message naming its address


class WorkerTask(Protocol):
    """A picklable description of per-item work: ``open()`` gives the worker, ``method`` names what a group gets."""

    method: str

    def open(self) -> object: ...


class Engine(Protocol):
    threads: int
    workers: int

    def running(self) -> contextlib.AbstractContextManager: ...

    def groups(self, names: list[str], sizes: list[int]) -> list[list[str]]: ...

    def map(self, task: WorkerTask, groups: Sequence[list]) -> Iterator: ...

    def sweep(self, sweep) -> contextlib.AbstractContextManager: ...

    def provenance(self) -> dict: ...


def _check_count(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EngineError(f"{what}={value!r}: give a whole number >= 1")
    return value


@contextlib.contextmanager
def fixed_threads(threads: int):
    """torch's intra-op thread count and the BLAS libraries' (scipy's LAPACK, which the Gram route's
    eigendecompositions call) set to `threads` inside the block, restored after. (A scipy call on a matrix of order
    below `spectral.ONE_THREAD_BELOW` runs on one thread whatever this is: `spectral.scipy_threads`.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with threadpoolctl.threadpool_limits(limits=threads, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(before)


def worker_environment(threads: int) -> dict[str, str]:
    """The thread variables a Ray worker starts with: Ray sets OMP_NUM_THREADS to the worker's CPU share (1), and
    OpenBLAS sizes its pool when it loads, so `threads` must be in the environment before the worker imports."""
    return {name: str(threads) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def group_items(names: list[str], sizes: list[int], workers: int) -> list[list[str]]:
    """Contiguous groups of ``names`` (in order) of about min(2²⁰, total / (4·workers)) elements each: a large
    item is a group of its own, small ones travel together, and every worker gets several groups."""
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


# --------------------------------------------------------------------------------------------- this process


@dataclass
class LocalEngine:
    """Everything in this process, with `threads` intra-op threads (default: this process's count now)."""

    threads: int | None = None
    workers: int = field(default=1, init=False)

    def __post_init__(self):
        self.threads = _check_count(torch.get_num_threads() if self.threads is None else self.threads, "threads")

    def running(self):
        return fixed_threads(self.threads)

    def groups(self, names: list[str], sizes: list[int]) -> list[list[str]]:
        """One item a group: here nothing is gained by grouping, and each item is written as soon as it is done."""
        return [[name] for name in names]

    def map(self, task: WorkerTask, groups: Sequence[list]) -> Iterator:
        """``task.open().<method>(group)`` for each group in order, here (the worker is opened once)."""
        with fixed_threads(self.threads):
            worker = task.open()
            method = getattr(worker, task.method)
            for group in groups:
                yield method(group)

    def sweep(self, sweep):
        return contextlib.nullcontext(LocalLayers(sweep))

    def provenance(self) -> dict:
        return {"engine": "local", "threads": self.threads}


# --------------------------------------------------------------------------------------------- Ray


@dataclass
class RayEngine:
    """`workers` Ray actors (``address``: ``"auto"`` starts a local instance, or a cluster's ``host:port``).

    ``gpus_per_worker`` > 0: the workers compute on CUDA. ``max_retries``: restarts of a worker process that dies
    (killed, out of memory, a lost node); its unfinished groups are redone. ``connect_timeout``: seconds to reach
    the cluster. ``report`` (a dict), when given, receives ``workers``: each worker's stats at the end.
    """

    address: str = "auto"
    workers: int = 1
    threads: int | None = None
    gpus_per_worker: float = 0
    max_retries: int = 3
    connect_timeout: float = CONNECT_TIMEOUT
    report: dict | None = field(default=None, compare=False)

    def __post_init__(self):
        _check_count(self.workers, "workers")
        self.threads = _check_count(torch.get_num_threads() if self.threads is None else self.threads, "threads")
        if not self.gpus_per_worker >= 0:
            raise EngineError(f"gpus_per_worker={self.gpus_per_worker!r}: give a number >= 0")

    @property
    def device(self) -> str:
        """Where the workers compute."""
        return "cuda" if self.gpus_per_worker else "cpu"

    @contextlib.contextmanager
    def running(self):
        """This process joined to Ray for the block (a local instance it started is shut down after), threads fixed
        (the driver computes the model level's measures and the store's summaries)."""
        started = connect(self.address, self.workers, self.gpus_per_worker, self.connect_timeout)
        try:
            with fixed_threads(self.threads):
                yield self
        finally:
            if started:
                import ray

                ray.shutdown()

    def groups(self, names: list[str], sizes: list[int]) -> list[list[str]]:
        """Contiguous groups of about min(2²⁰, total / (4·workers)) elements (`group_items`)."""
        return group_items(names, sizes, self.workers)

    def actor_class(self, worker: type):
        """`worker` as a Ray actor class with this engine's resources and restarts."""
        import ray

        return ray.remote(worker).options(num_cpus=1, num_gpus=self.gpus_per_worker, max_restarts=self.max_retries,
                                          max_task_retries=self.max_retries,
                                          runtime_env={"env_vars": worker_environment(self.threads)})

    def map(self, task: WorkerTask, groups: Sequence[list]) -> Iterator:
        """``task.open().<method>(group)`` for each group, computed by the actors, returned in group order."""
        import ray

        with self.running():
            actors = [self.actor_class(TaskActor).remote(task, self.threads) for _ in range(self.workers)]
            try:
                yield from _pool(actors).map(lambda actor, group: actor.run.remote(group), list(groups))
                if self.report is not None:
                    self.report["workers"] = ray.get([actor.stats.remote() for actor in actors])
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                raise remote_error(exc) from None
            finally:
                for actor in actors:
                    ray.kill(actor)

    def sweep(self, sweep):
        return Pipeline(sweep, self)

    def provenance(self) -> dict:
        return {"engine": "ray", "address": self.address, "workers": self.workers, "threads": self.threads,
                "gpus_per_worker": self.gpus_per_worker}


class TaskActor:
    """A Ray actor that opens a `WorkerTask`'s worker once and runs its method on the groups it is given."""

    def __init__(self, task: WorkerTask, threads: int):
        hold_threads(threads)
        self.worker = task.open()
        self.method = getattr(self.worker, task.method)

    def run(self, group: list):
        return self.method(group)

    def stats(self) -> dict:
        stats = getattr(self.worker, "stats", None)
        return stats() if callable(stats) else process_stats()


def _pool(actors: list):
    """The actors as a `ray.util.ActorPool`: ordered results, each actor given a new group when it is free."""
    from ray.util import ActorPool

    return ActorPool(actors)


def connect(address: str, workers: int, gpus_per_worker: float = 0, timeout: float = CONNECT_TIMEOUT) -> bool:
    """Start (``"auto"``) or join (an address) Ray unless this process is connected already; True if we did.

    Every worker holds 1 CPU (and ``gpus_per_worker`` GPUs) for the whole run, so a cluster with fewer is an
    error here rather than a run that waits forever; an address that does not answer within `timeout` seconds
    is an error naming it.
    """
    try:
        import ray
    except ImportError:
        raise EngineError(f"--ray needs Ray, which is not installed: {RAY_EXTRA}") from None
    started = not ray.is_initialized()
    if started and address == "auto":
        try:
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        except Exception as exc:  # noqa: BLE001 — Ray raises a bare Exception when its node does not start in time
            raise EngineError(f"could not start a local Ray instance (--ray auto): {exc}") from None
    elif started:
        _reachable(address, timeout)
        _join(ray, address, timeout)
    have = ray.cluster_resources()
    if have.get("CPU", 0) < workers or have.get("GPU", 0) < workers * gpus_per_worker:
        if started:
            ray.shutdown()
        raise EngineError(f"{workers} Ray workers need {workers} CPUs and {workers * gpus_per_worker:g} GPUs; the "
                          f"Ray cluster has {have.get('CPU', 0):g} CPUs and {have.get('GPU', 0):g} GPUs")
    return started


def _join(ray, address: str, timeout: float) -> None:
    """``ray.init(address)``, given up after `timeout` seconds: a port that accepts connections but is no Ray head
    (a stopped head, another service) makes ``ray.init`` retry for ever. It runs in a daemon thread, which the
    process leaves behind when it gives up."""
    outcome: dict = {}

    def join() -> None:
        try:
            ray.init(address=address, log_to_driver=False)
            outcome["joined"] = True
        except BaseException as exc:  # noqa: BLE001 — handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=join, name="ray-init", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise EngineError(f"the Ray cluster at {address} accepted a connection but did not answer as Ray within "
                          f"{timeout:g} s; is a Ray head (`ray start --head`) running at that port?")
    if "error" in outcome:
        raise EngineError(f"could not join the Ray cluster at {address}: {outcome['error']}") from None


def _reachable(address: str, timeout: float) -> None:
    """Refuse an address whose host:port does not accept a connection within `timeout` seconds (``ray.init``
    itself retries for ever)."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise EngineError(f"--ray {address!r}: give 'auto' or a cluster's HOST:PORT (e.g. 10.0.0.5:6379)")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise EngineError(f"the Ray cluster at {address} did not answer within {timeout:g} s ({exc}); is "
                          "`ray start --head` running there, and is the port open?") from None


# --------------------------------------------------------------------------------------------- run settings


@dataclass
class RunSettings:
    """What every driver takes besides its own options: where results go and how the run executes.

    ``store`` (a `submerge.diagnostics.store.Store`; None: nothing written), ``force`` (replace an existing group),
    ``progress`` (progress bars), ``command`` (recorded in provenance; default the process's argv), ``on_unit``
    (called with each unit's name after it is written: tests kill runs there), ``capture_budget`` (bytes of
    recorded inputs held at once), ``compute_dtype`` (None: float32, or float64), ``engine`` (where the work
    runs: `LocalEngine`, the default, or `RayEngine`).
    """

    store: object = None
    force: bool = False
    progress: bool = True
    command: str | None = None
    on_unit: Callable[[str], None] | None = None
    capture_budget: int = DEFAULT_CAPTURE_BUDGET
    compute_dtype: str | None = None
    engine: Engine = field(default_factory=LocalEngine)

    @classmethod
    def of(cls, run: RunSettings | None = None, **options) -> RunSettings:
        """`run`, or the settings given as keywords (a driver's ``**options``); unknown names are a TypeError."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown run setting(s) {unknown}; known: {', '.join(sorted(known))}")
        if run is not None and options:
            raise TypeError(f"give run=RunSettings(...) or the settings {sorted(options)} as keywords, not both")
        return run if run is not None else cls(**options)


def driver_settings(load: LoadSettings | None, run: RunSettings | None, options: dict) -> tuple[LoadSettings, RunSettings]:
    """A model-loading driver's `LoadSettings` and `RunSettings`, each given as its object or as keywords (the
    driver's ``**options``: ``device="cpu", progress=False`` …, each name to the object that has it)."""
    loading = {name: options.pop(name) for name in list(options) if name in LoadSettings.__dataclass_fields__}
    if load is not None and loading:
        raise TypeError(f"give load=LoadSettings(...) or the settings {sorted(loading)} as keywords, not both")
    return (load if load is not None else LoadSettings(**loading)), RunSettings.of(run, **options)

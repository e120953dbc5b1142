"""Placement: where a model's weights live and where its work computes, and giving mapped pages back.

`execution_device` is the one place that says where capture, replays and block-by-block forwards run: the
parameters' device, or — for a base loaded with ``offload=True`` — the accelerator it is streamed to stage by stage.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
from pathlib import Path

import threadpoolctl
import torch


def release_mapped_pages(module: torch.nn.Module) -> int:
    """Drop from this process's resident memory the pages of `module`'s weights that are read from a memory-mapped
    checkpoint file (madvise ``MADV_DONTNEED`` on those file mappings); the next access reads them again from the
    page cache, not from disk. Returns the bytes that were resident in the mappings released.

    A base loaded in its checkpoint's dtype keeps its weights in private mappings of the safetensors files, and
    every block a forward touches stays resident: without this, a command's RSS grows by one block of stored
    weights per block it passes (≈ 400 MiB per Llama-2-7B block in float16). Only file mappings none of whose
    pages was ever written (their smaps ``Anonymous`` is 0) are released, so nothing any tensor holds can change.
    Linux only; elsewhere nothing is done.
    """
    import bisect
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return 0
    pointers = sorted({t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())
                       if t.device.type == "cpu" and t.untyped_storage().nbytes()})
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    mappings, current = [], None
    for line in lines:
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header: range perms offset dev inode [path]
            fields = line.split()
            low, high = (int(v, 16) for v in fields[0].split("-"))
            current = {"range": (low, high), "file": len(fields) > 5 and fields[4] != "0" and fields[5].startswith("/")}
            mappings.append(current)
        elif current is not None and first in ("Rss:", "Anonymous:"):
            current[first[:-1]] = int(line.split()[1]) * 1024
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    released = 0
    for mapping in mappings:
        (low, high), resident = mapping["range"], mapping.get("Rss", 0)
        if not mapping["file"] or not resident or mapping.get("Anonymous", 1):
            continue
        index = bisect.bisect_left(pointers, low)
        if index < len(pointers) and pointers[index] < high and libc.madvise(low, high - low, 4) == 0:  # DONTNEED
            released += resident
    return released


#: Set on a base model loaded with ``offload=True``: the device its forwards and replays compute on, while its
#: weights stay in host memory (memory-mapped) and each stage is copied there only while it runs.
OFFLOAD_ATTRIBUTE = "submerge_offload_device"


def execution_device(model: torch.nn.Module) -> torch.device:
    """The device `model`'s capture forwards, replays and merges' forwards compute on: its offload device (a base
    loaded with ``offload=True``), else the device its parameters are on."""
    offload = getattr(model, OFFLOAD_ATTRIBUTE, None)
    return offload if offload is not None else next(model.parameters()).device


def canonical_device(device: str | torch.device) -> torch.device:
    """`device` with its index (``cuda`` → ``cuda:0``, the current device), so it compares equal to a tensor's."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def offloads(offload: bool, device: str | torch.device) -> bool:
    """Whether ``offload=True`` takes effect on `device` (a resolved device, not "auto"): only an accelerator has
    weights to keep off it."""
    return offload and torch.device(device).type != "cpu"


def offload_to(model: torch.nn.Module, device: str | torch.device) -> None:
    """Make `model` compute on `device` (`execution_device`) while its weights stay where they are: host memory."""
    setattr(model, OFFLOAD_ATTRIBUTE, canonical_device(device))


def is_offloaded(model: torch.nn.Module) -> bool:
    """Whether `model`'s weights stay in host memory while it computes on another device (``offload=True``)."""
    return getattr(model, OFFLOAD_ATTRIBUTE, None) is not None


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def process_stats() -> dict:
    """This process: its pid, host and peak resident memory (MiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"pid": os.getpid(), "host": platform.node(),
            "peak_rss_mib": peak / (1 << 20) if sys.platform == "darwin" else peak / 1024}


def hold_threads(threads: int) -> None:
    """This worker process computes with `threads` threads from now on: torch's intra-op count and the BLAS
    libraries' (scipy's LAPACK), whose sums depend on it (`submerge.diagnostics.execution` says why)."""
    torch.set_num_threads(threads)
    threadpoolctl.threadpool_limits(limits=threads, user_api="blas")


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (a stale lock's or staging folder's owner is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


TAU_KEPT_BYTES = 1 << 30  # a one-task driver keeps as many tasks' τ of a block as fit here (`tasks_kept_on`)


def tau_kept_bytes(device: torch.device) -> int:
    """Bytes of one block's τ a one-task driver may keep (`tasks_kept_on`): `TAU_KEPT_BYTES` of host memory; on a
    GPU, where the kept τ lives (`ParameterSource` reads it onto the execution device), a quarter of the
    device's free memory where that is more (a 7B block's τ is 0.8 GB a task: on a GPU with room, every task's is
    kept, and a layer's units share one read a task instead of reading it again unit by unit)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(TAU_KEPT_BYTES, free // 4)
    return TAU_KEPT_BYTES


def tasks_kept_on(device: torch.device, block: torch.nn.Module, at_least: int | None) -> int | None:
    """How many tasks' τ of one block a source on `device` keeps (`ParameterSource.tasks_kept`): `at_least` (None:
    all, unbounded), or more where more tasks' float32 τ of `block` fit in `tau_kept_bytes(device)` (SmolLM2-135M:
    every task's; a 7B block's τ is 0.8 GB a task: one on the CPU, every task's on a GPU with room). The sweep asks
    it for the driver's device, and each Ray worker again for its own (a CPU driver's workers may hold GPUs)."""
    if at_least is None:
        return None
    return max(at_least, tau_kept_bytes(device) // max(1, 4 * sum(p.numel() for p in block.parameters())))


VARIANTS_KEPT_BYTES = 1 << 30  # a layer's formed variants are kept for its units and the model level where all fit


def variants_kept_bytes(points: int, block: torch.nn.Module, dtype: torch.dtype) -> int:
    """`ParameterSource.variants_kept_bytes` for a sweep that forms `points` variants of each block (tasks × points
    of a line) in `dtype`: all of them where they fit in `VARIANTS_KEPT_BYTES` (SmolLM2-135M, 3 tasks × 11
    points, float32: 0.47 GB), else 0, none (a 7B block's variant is 0.8 GB: the pool's one buffer per parameter)."""
    needed = points * sum(p.numel() for p in block.parameters()) * dtype.itemsize
    return needed if 0 < needed <= VARIANTS_KEPT_BYTES else 0


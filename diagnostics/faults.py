"""Fault injection for tests: every file a command writes passes a *write point* here.

`fault_point` is called before each write — a store's chunks and metadata (`submerge.diagnostics.store`), a merge's
shards, index, record and copied files (`submerge.merge.writer`), a plan or exported config
(`submerge.diagnostics.outputs.replace_file`) — and before a store unit's row count is committed (``append``).
Nothing happens unless the environment asks: ``$SUBMERGE_WRITE_LOG`` gets one line per point (tests count a
command's write points from it), and ``$SUBMERGE_FAULT_AT`` = ``write:N[:action]`` or ``append:N[:action]`` acts
at the N-th point of this process (`tests/test_faults.py`).
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

FAULT_ENV = "SUBMERGE_FAULT_AT"  # "write:N[:kill|interrupt|nospace|stop]" or "append:N[:...]"
WRITE_LOG_ENV = "SUBMERGE_WRITE_LOG"  # a file that gets one line per write point

counts = {"write": 0, "append": 0}


def fault_point(event: str, path: Path | None = None, data=b"") -> None:
    """Count a write point; at the one named by $SUBMERGE_FAULT_AT, die, interrupt or run out of space.

    ``write:N`` is the N-th file written, ``append:N`` the N-th store unit appended (after its arrays are written,
    before its row count is committed). `data` (bytes or a memoryview) is what is about to be written. Actions:
    ``kill`` (SIGKILL, leaving the half-written temporary file a real kill would), ``interrupt`` (SIGINT, as
    Ctrl-C), ``nospace`` (the file-size limit drops below this write: the kernel refuses it, EFBIG), ``stop``
    (SIGSTOP: the writer pauses, still holding its locks).
    """
    log = os.environ.get(WRITE_LOG_ENV)
    if log:
        with open(log, "a") as handle:
            handle.write(f"{event} {path or ''}\n")
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    counts[event] = counts.get(event, 0) + 1
    kind, count, action = (spec.split(":") + ["kill"])[:3]
    if kind != event or counts[event] != int(count):
        return
    if action == "kill":
        if path is not None and len(data):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial").write_bytes(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "interrupt":
        os.kill(os.getpid(), signal.SIGINT)
    elif action == "stop":  # paused while holding the lock (a second writer must be refused meanwhile)
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "nospace":
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (len(data) // 2, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    else:
        raise ValueError(f"{FAULT_ENV}={spec!r}: the action must be kill, interrupt, nospace or stop")

"""The store: a zarr v3 group tree that opens as an `xarray.DataTree`.

One group per diagnostic (``linearity``, ``projection``, ``alpha``,
``interference``, ``eval`` ...), labelled dimensions, and provenance in the
attrs: the root holds the toolkit and library versions and the base model; each
group holds the settings, inputs (models, data files with hashes) and the
command that made it.

Resuming: a group is written unit by unit (`append` along ``module`` or
``matrix``); its attrs count the rows that were completely written, so a run
that was killed resumes after the last complete unit (a half-written unit is
cut off and redone). An existing group is never replaced unless ``force``;
re-running with other settings, or on other inputs (the models' content hashes
and the data files' SHA-256), without ``force`` is an error that names what
differs.

Crash safety: every file is replaced atomically (zarr writes a temporary file
and renames it; the group attrs are written here the same way, in one write),
the group attrs are never rewritten without their content, and the row count
is committed only after a unit's arrays are written. A kill, Ctrl-C or full
disk at any point leaves a store that resumes to exactly the uninterrupted
result. One process writes a store at a time (`StoreLock`, the file
``.submerge.lock`` in the store).

Consolidated metadata: when a group completes, the metadata of every group and
array is copied into the root's ``zarr.json`` (zarr v3's inline consolidated
metadata), so ``xr.open_datatree(path, engine="zarr")`` opens the store from one
file and without a warning. The first write of any later run removes it before
touching anything else, and it is written again when that run's group completes:
consolidated metadata, when present, always equals what is on disk. A run that is
killed leaves none (a reader then falls back to the files themselves, with
xarray's warning), never a copy that would hide or misdescribe arrays written
after it. Stores written before consolidation existed, or left by a killed run,
are consolidated by `Store.consolidate` (``diag report --consolidate``).

Strings (coordinates such as ``module`` or ``level``) are stored fixed-width,
so they read back as ordinary numpy unicode arrays.

    >>> import xarray as xr
    >>> tree = xr.open_datatree("runs/demo.zarr", engine="zarr")
    >>> tree["linearity"].ds.nonlinearity_score.mean("sample")
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import json
import os
import platform
import re
import shutil
import signal
import sys
import threading
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xarray as xr
import zarr
from packaging.version import InvalidVersion, Version
from zarr.storage import LocalStore, MemoryStore

from submerge.diagnostics.errors import StoreError
from submerge.diagnostics.faults import FAULT_ENV, WRITE_LOG_ENV  # noqa: F401 (tests/test_store.py patches them here)
from submerge.diagnostics.faults import counts as _fault_counts  # noqa: F401
from submerge.diagnostics.faults import fault_point as _fault_point
from submerge.diagnostics.placement import process_alive
from submerge.diagnostics.provenance import (
    identity_changes,
    input_identity,
    jsonable,
    library_versions,
    run_attrs,
    settings_diff,
    settings_grown,
)

LOCK_NAME = ".submerge.lock"
STRING_WIDTH = 64  # the least width of a stored string variable; longer strings widen it
STORE_FORMAT = 2  # groups written with every chunk present and fixed-width strings


@contextlib.contextmanager
def _quiet():
    """zarr/xarray calls without their notes about zarr v3 specs and consolidated metadata (locally only)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have a Zarr V3 specification.*")
        warnings.filterwarnings("ignore", message=".*Consolidated metadata is currently not part.*")
        warnings.filterwarnings("ignore", message=".*Failed to open Zarr store with consolidated metadata.*")
        warnings.filterwarnings("ignore", message=f"Object at {re.escape(LOCK_NAME)}.* is not recognized")  # our lock
        yield


# ---------------------------------------------------------------------------------------------- writes and faults

def _atomic_write(path: Path, data: bytes) -> None:
    """Write `path` as a whole or not at all: a temporary sibling, fsync, then os.replace."""
    _fault_point("write", path, data)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _interrupts_deferred():
    """Ctrl-C (SIGINT) during a store write takes effect as soon as the write is done, not in the middle of it.

    zarr writes from its own event-loop thread: a KeyboardInterrupt in the waiting main thread would leave that
    thread writing on its own (and print its traceback). Each write block is short (one unit), so the
    interrupt waits for it; then the handler that was in place runs as it would have. Only in the main thread
    (the only one Python delivers signals to).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        if callable(previous):
            previous(signal.SIGINT, None)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)


def _drop_unretrieved_write_errors() -> None:
    """After a write failed (full disk, file-size limit), keep zarr's sibling writes quiet.

    zarr writes a call's files concurrently on its event loop; the first OSError is reported (a StoreError),
    and the other writes of that call, failing the same way, end as "exception was never retrieved"
    tracebacks printed when they are collected. Those, and only those (OSErrors nobody retrieved), are
    dropped; everything else goes to the loop's handler as before.
    """
    from zarr.core.sync import _get_loop

    loop = _get_loop()
    previous = loop.get_exception_handler()
    if getattr(previous, "drops_unretrieved_write_errors", False):
        return

    def handler(loop, context):
        if isinstance(context.get("exception"), OSError) and "never retrieved" in context.get("message", ""):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler.drops_unretrieved_write_errors = True
    loop.set_exception_handler(handler)


class _LocalStore(LocalStore):
    """zarr's LocalStore (atomic per file) with the test hook counting each write.

    Keys in `protected` (a group's metadata while its arrays are appended) are not rewritten: xarray would
    replace the group's attrs by the appended dataset's, and the attrs are this module's to write.
    """

    protected: frozenset = frozenset()

    async def _set(self, key, value, exclusive: bool = False) -> None:
        if key in self.protected:
            return
        _fault_point("write", self.root / key, value.to_bytes() if os.environ.get(FAULT_ENV) else b"")
        await super()._set(key, value, exclusive=exclusive)


# ---------------------------------------------------------------------------------------------- the lock


def _process_start(pid: int) -> str | None:
    """The kernel's start time of process `pid` (tells a live holder from a reused pid), if known."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


_HELD: dict[Path, str] = {}  # lock files this process holds → their content


class StoreLock:
    """One writer per store: ``<store>/.submerge.lock`` holds the writer's pid, host and start time.

    Created atomically (the record is written to a temporary file and hard-linked into place, which
    fails if a lock exists). A lock whose process no longer runs on this host is stale: it is explained
    on stderr and taken over. A lock held by this same process is reused (one process, one writer).
    """

    def __init__(self, store_path: Path):
        self.path = Path(store_path) / LOCK_NAME

    def holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"pid": None, "host": None, "unreadable": True}

    def _stale_reason(self, holder: dict) -> str | None:
        if holder.get("unreadable"):
            return "its content is unreadable (the writer was stopped while creating it)"
        if holder.get("host") != platform.node():
            return None
        pid = holder.get("pid")
        if not process_alive(pid):
            return f"process {pid} is no longer running"
        started = holder.get("process_start")
        if started is not None and _process_start(pid) not in (None, started):
            return f"process id {pid} now belongs to another program"
        return None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            if self._create():
                return
            holder = self.holder()
            if holder is None:
                continue
            if holder.get("pid") == os.getpid() and holder.get("host") == platform.node():
                _HELD[self.path] = self.path.read_text()
                return
            reason = self._stale_reason(holder)
            if reason is None:
                raise StoreError(
                    f"store {self.path.parent} is being written by process {holder.get('pid')} on "
                    f"{holder.get('host')} (since {holder.get('started')}: {holder.get('command')}). Wait for it to "
                    f"finish or use another --out; if that process is gone, delete {self.path}."
                )
            if self._take_over(holder):
                print(f"note: {self.path}: taking over a stale lock of process {holder.get('pid')} on "
                      f"{holder.get('host')} (since {holder.get('started')}): {reason}. That run stopped before "
                      f"finishing; its unfinished unit is cut back and redone.", file=sys.stderr)
        raise StoreError(f"could not take the lock {self.path}: other processes keep replacing it")

    def _create(self) -> bool:
        record = {"pid": os.getpid(), "host": platform.node(), "process_start": _process_start(os.getpid()),
                  "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join(sys.argv)}
        text = json.dumps(record)
        temporary = self.path.with_name(f"{LOCK_NAME}.{uuid.uuid4().hex}.partial")
        try:
            temporary.write_text(text)
            os.link(temporary, self.path)
        except FileExistsError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot create the lock {self.path}: {exc.strerror}") from None
        finally:
            temporary.unlink(missing_ok=True)
        _HELD[self.path] = text
        return True

    def _take_over(self, holder: dict) -> bool:
        """Move the stale lock aside; if it was replaced meanwhile by a live writer, put that one back."""
        aside = self.path.with_name(f"{LOCK_NAME}.stale-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            current = json.loads(aside.read_text())
        except (OSError, ValueError):
            current = {"pid": None, "host": None, "unreadable": True}
        if current != holder:
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

    def release(self) -> None:
        text = _HELD.pop(self.path, None)
        with contextlib.suppress(OSError):
            if text is not None and self.path.read_text() == text:
                self.path.unlink()


@atexit.register
def _release_all() -> None:
    for path in list(_HELD):
        StoreLock(path.parent).release()


# ---------------------------------------------------------------------------------------------- status


@dataclass
class GroupStatus:
    """What a group holds: ``complete``, ``partial`` (rows written of expected) or ``corrupt`` (with the file)."""

    group: str
    state: str
    units_done: int = 0
    units_expected: int | None = None
    problem: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        if self.state == "corrupt":
            return f"{self.group}: corrupt: {self.problem}"
        if self.state == "partial":
            of = f" of {self.units_expected}" if self.units_expected is not None else ""
            return (f"{self.group}: partial: {self.units_done}{of} units written; run the same command again to "
                    f"finish it")
        return f"{self.group}: complete ({self.units_done} units)"


def check_store_path(path: str | Path, option: str = "--out") -> None:
    """Refuse, before any work, a store path that is a file, a folder of other files (not a store) or not
    writable; nothing there is touched."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise StoreError(f"{option} {path} is a file, not a store folder: choose another {option}")
    leftovers = (LOCK_NAME, ".partial")  # what a store's killed first write leaves: not the user's files
    others = [p for p in path.iterdir() if not p.name.startswith(leftovers[0]) and not p.name.endswith(leftovers[1])
              ] if path.is_dir() else []
    if others and not (path / "zarr.json").exists():
        raise StoreError(f"{option} {path} is a folder of other files, not a store (no zarr.json): a store is "
                         f"written into a new or empty folder or an earlier store; choose another {option}")
    existing = next(parent for parent in (path, *path.absolute().parents) if parent.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise StoreError(f"{option} {path}: {existing} is not a writable folder")


#: Group attrs a resumed run relies on: (key, check, what it must be).
_CHECKED_ATTRS = (
    ("units_done", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a whole number >= 0"),
    ("units_expected", lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
     "a whole number >= 0 or null"),
    ("complete", lambda v: isinstance(v, bool), "true or false"),
    ("settings", lambda v: isinstance(v, dict), "a mapping"),
    ("provenance", lambda v: isinstance(v, dict), "a mapping"),
    ("store_format", lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number"),
)


def _warn_if_newer(provenance, what: str) -> None:
    """Warn when `what` was written by a newer submerge than this one (its layout or meaning may differ)."""
    theirs = (provenance or {}).get("toolkit_version") if isinstance(provenance, dict) else None
    ours = library_versions()["submerge"]
    try:
        newer = theirs is not None and Version(str(theirs)) > Version(str(ours))
    except InvalidVersion:
        return
    if newer:
        warnings.warn(f"{what} was written by submerge {theirs}, newer than this {ours}: its layout or meaning may "
                      "differ; upgrade submerge to read it safely", UserWarning, stacklevel=3)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise StoreError(f"{path} is missing: the store is damaged") from None
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path} is unreadable ({exc}): the store is damaged (a truncated or edited file)") from None


def _check_array(array: zarr.Array, directory: Path, every_chunk: bool, shape: tuple,
                 decode: bool = True) -> str | None:
    """The first problem of one array within `shape` (a missing or, with `decode`, undecodable chunk file)."""
    grid = [-(-size // chunk) for size, chunk in zip(shape, array.chunks)]
    for index in np.ndindex(*grid) if all(shape) else []:
        key = array.metadata.encode_chunk_key(index)
        chunk_file = directory / key
        if not chunk_file.exists():
            if every_chunk:
                return f"chunk file {chunk_file} is missing"
            continue
        if not decode:
            continue
        region = tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, array.chunks, shape))
        try:
            array[region]
        except Exception as exc:  # noqa: BLE001 — any decoding failure is reported with the file it came from
            return f"chunk file {chunk_file} cannot be decoded ({type(exc).__name__}: {exc})"
    return None


def _limited(shape: tuple, axis: int | None, rows: int | None) -> tuple:
    if axis is None or rows is None:
        return tuple(shape)
    return tuple(min(size, rows) if i == axis else size for i, size in enumerate(shape))


# ---------------------------------------------------------------------------------------------- the store


class Store:
    """A zarr v3 store of diagnostics. See the module docstring."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.lock = StoreLock(self.path)

    # ------------------------------------------------------------------ opening and reading

    def exists(self) -> bool:
        return (self.path / "zarr.json").exists()

    def _zarr_store(self, *protected: str) -> _LocalStore:
        store = _LocalStore(str(self.path))
        store.protected = frozenset(protected)
        return store

    def _root(self, mode: str = "a") -> zarr.Group:
        with _quiet():
            try:
                return zarr.open_group(self._zarr_store(), mode=mode, zarr_format=3, use_consolidated=False)
            except (ValueError, OSError) as exc:
                _read_json(self.path / "zarr.json")  # names the damaged file, if that is the cause
                raise StoreError(f"cannot open the store {self.path}: {exc}") from None

    def _node_type(self, directory: Path) -> str | None:
        meta = directory / "zarr.json"
        if not meta.exists():
            return None
        try:
            return json.loads(meta.read_bytes()).get("node_type")
        except (OSError, ValueError):
            return "unreadable"

    def groups(self) -> list[str]:
        if not self.exists():
            return []
        return sorted(child.name for child in self.path.iterdir()
                      if child.is_dir() and not child.name.startswith(".")
                      and self._node_type(child) in ("group", "unreadable"))

    def has(self, group: str) -> bool:
        return self.exists() and self._node_type(self.path / group) in ("group", "unreadable")

    def open(self) -> xr.DataTree:
        """The whole store as an `xarray.DataTree`; a damaged file is a StoreError that names it."""
        if not self.exists():
            raise StoreError(f"no store at {self.path}")
        for state in self.status().values():
            if state.state == "corrupt":
                raise StoreError(f"store {self.path}: group '{state.group}' is damaged: {state.problem}")
        with _quiet():
            return xr.open_datatree(str(self.path), engine="zarr", consolidated=False)

    def dataset(self, group: str) -> xr.Dataset:
        """One group as an `xarray.Dataset` (loaded)."""
        if not self.has(group):
            groups = ", ".join(self.groups()) or "nothing"
            raise StoreError(f"store {self.path} has no group '{group}' (it has: {groups})")
        try:
            with _quiet():
                dataset = xr.open_zarr(str(self.path), group=group, consolidated=False, zarr_format=3).load()
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 — whatever zarr/xarray raise, name the damaged file instead
            state = self.group_status(group)
            if state.state == "corrupt":
                raise StoreError(f"store {self.path}: group '{group}' is damaged: {state.problem}") from None
            raise StoreError(f"cannot read group '{group}' of {self.path}: {type(exc).__name__}: {exc}") from None
        state = self.group_status(group, decode=False)  # a deleted chunk file reads as NaN: say so instead
        if state.state == "partial" and state.units_done == 0 and self._arrays(group):
            raise StoreError(f"store {self.path}: group '{group}' has no finished unit yet (a run stopped during its "
                             "first write): run the same command again to resume it")
        if state.state == "corrupt":
            raise StoreError(f"store {self.path}: group '{group}' is damaged: {state.problem}")
        _warn_if_newer(dataset.attrs.get("provenance"), f"group '{group}' of {self.path}")
        return _readable_strings(dataset)

    @property
    def attrs(self) -> dict:
        return dict(_read_json(self.path / "zarr.json").get("attributes") or {}) if self.exists() else {}

    def group_attrs(self, group: str) -> dict:
        """A group's attrs, read from its metadata file (settings, inputs, progress, provenance); the attrs a
        resumed run relies on are checked, so a hand-edited file is named instead of failing somewhere later."""
        meta = self.path / group / "zarr.json"
        attrs = _read_json(meta).get("attributes") or {}
        if not isinstance(attrs, dict):
            raise StoreError(f"{meta}: its attributes are {type(attrs).__name__}, not a mapping: the store was edited "
                             "or damaged")
        for key, valid, expected in _CHECKED_ATTRS:
            if key in attrs and not valid(attrs[key]):
                raise StoreError(f"{meta}: attr {key!r} is {attrs[key]!r}, not {expected}: the store was edited or "
                                 f"damaged; recompute group '{group}' with --force (or use another --out)")
        return dict(attrs)

    def model_changes(self, group: str, inputs: dict) -> list[str]:
        """How the models `group` was measured on (its provenance: base model and fine-tunes, by content hash)
        differ from those of `inputs` (a run's fingerprints, or another group's ``provenance`` attr); [] when
        they are the same. A command that reuses a group's numbers (α, interference, linearity) checks this."""
        def models(identity: dict) -> dict:
            return {key: value for key, value in identity.items() if key.startswith(("base model", "fine-tune "))}

        old = models(input_identity(self.group_attrs(group).get("provenance") or {}))
        new = models(input_identity(inputs or {}))
        return identity_changes(old, new) if old and new else []

    def is_complete(self, group: str) -> bool:
        return self.has(group) and bool(self.group_attrs(group).get("complete"))

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, GroupStatus]:
        """`GroupStatus` of every group: complete, partial (units written of expected) or corrupt (the file)."""
        if not self.exists():
            return {}
        _read_json(self.path / "zarr.json")
        found, todo = {}, list(self.groups())
        while todo:
            group = todo.pop(0)
            state = self.group_status(group)
            if state.state == "corrupt" or "units_done" in self.group_attrs(group) or self._arrays(group):
                found[group] = state
            todo += [f"{group}/{child.name}" for child in sorted((self.path / group).iterdir())
                     if child.is_dir() and self._node_type(child) == "group"]
        return found

    def group_status(self, group: str, *, decode: bool = True) -> GroupStatus:
        """Whether `group` is complete, partial or corrupt; every chunk of its written rows is decoded
        (with `decode`; otherwise only checked to exist)."""
        directory = self.path / group
        try:
            attrs = self.group_attrs(group)
        except StoreError as exc:
            return GroupStatus(group, "corrupt", problem=str(exc), file=str(directory / "zarr.json"))
        done, complete = int(attrs.get("units_done", 0)), bool(attrs.get("complete"))
        state = GroupStatus(group, "complete" if complete else "partial", done, attrs.get("units_expected"))
        if not complete and done == 0:  # no unit committed: whatever arrays a cut first write left are not data,
            return state                # and the next run removes them (`_repair`)
        rows = None if complete else done
        for child in sorted(p for p in directory.iterdir() if p.is_dir()):
            problem = self._array_problem(group, child, attrs.get("unit_dim"), rows,
                                          attrs.get("store_format", 1) >= STORE_FORMAT, decode)
            if problem:
                state.state, state.problem, state.file = "corrupt", problem[0], problem[1]
                break
        return state

    def _array_problem(self, group: str, directory: Path, dim: str | None, rows: int | None,
                       every_chunk: bool, decode: bool) -> tuple[str, str] | None:
        meta = directory / "zarr.json"
        try:
            node_type = _read_json(meta).get("node_type")
        except StoreError as exc:
            return str(exc), str(meta)
        if node_type != "array":
            return None
        try:
            with _quiet():
                array = zarr.open_array(self._zarr_store(), path=f"{group}/{directory.name}", mode="r")
        except Exception as exc:  # noqa: BLE001 — invalid metadata of any kind
            return f"{meta} is not valid array metadata ({exc})", str(meta)
        dims = list(array.metadata.dimension_names or ())
        axis = dims.index(dim) if dim in dims else None
        if axis is not None and rows is not None and array.shape[axis] < rows:
            return f"{meta}: {array.shape[axis]} rows along '{dim}', {rows} recorded as written", str(meta)
        with _quiet():
            problem = _check_array(array, directory, every_chunk, _limited(array.shape, axis, rows), decode)
        return (problem, str(directory)) if problem else None

    # ------------------------------------------------------------------ writing

    @contextlib.contextmanager
    def _writing(self, *, consolidating: bool = False):
        """Hold the lock; an OS error (full disk, file-size limit, permissions) becomes a StoreError.

        Any write but the consolidation itself first removes the root's consolidated metadata (one atomic
        write), so that it never describes a store that has changed since (see the module docstring).
        """
        self.lock.acquire()
        try:
            with _quiet(), _interrupts_deferred():
                if not consolidating:
                    self._drop_consolidated()
                yield
        except OSError as exc:
            self.lock.release()
            _drop_unretrieved_write_errors()
            where = f" ({exc.filename})" if exc.filename else ""
            raise StoreError(
                f"could not write the store {self.path}: {exc.strerror or exc}{where}. The units written before "
                f"are kept; fix the cause (e.g. free disk space) and run the same command to resume."
            ) from None
        except BaseException:
            self.lock.release()
            raise

    def _put_attrs(self, group: str, attrs: dict) -> None:
        """Replace a group's attrs (`group` "" is the root) in one atomic write of its metadata file."""
        meta_path = self.path / group / "zarr.json" if group else self.path / "zarr.json"
        meta = _read_json(meta_path) if meta_path.exists() else {"zarr_format": 3, "node_type": "group",
                                                                  "consolidated_metadata": None}
        meta["attributes"] = jsonable(attrs)
        _atomic_write(meta_path, json.dumps(meta, indent=2).encode())

    def begin(self, group: str, settings: dict, *, force: bool = False, root: dict | None = None,
              attrs: dict | None = None, dim: str = "module", expected: int | None = None,
              grows: tuple[str, ...] = ()) -> set[str]:
        """Start or resume writing `group`; returns the labels along `dim` already complete.

        A group made with the same `settings` and inputs resumes; with other settings, or inputs whose
        fingerprints (``attrs["provenance"]``: models' and data files' hashes) differ, it is an error
        naming what changed unless `force`, which deletes the group first. `grows`: settings that may gain
        entries (a list extended at its end, a dict given new keys, everything else the same): the group then
        resumes under the grown settings, marked incomplete, its units kept (compare's methods). `root` updates the
        store's root attrs (kept from the first run otherwise); `attrs` (provenance) go on the group; `expected`
        (the number of labels a complete run writes) lets `status` say how far it got.
        Takes the store's lock (released by `finish`, on error, or at exit).
        """
        settings, attrs = jsonable(settings), jsonable(attrs or {})
        identity = input_identity(attrs.get("provenance") or {})
        with self._writing():
            self.path.mkdir(parents=True, exist_ok=True)
            for stray in self.path.rglob("*.partial"):  # temporary files of writes a kill cut short
                if not stray.name.startswith(LOCK_NAME):  # (another writer's lock being created is not ours)
                    stray.unlink(missing_ok=True)
            self._begin_root(root, force)
            if self.has(group) and not force:
                old = self.group_attrs(group)
                grown = {"settings": settings, "complete": False} if grows and settings_grown(
                    old.get("settings"), settings, grows) else {}
                self._refuse_changes(group, {**old, **grown}, settings, identity)
                updated = {**old, **grown, **({"units_expected": expected} if expected is not None else {})}
                if updated != old:
                    self._put_attrs(group, updated)
                return self._repair(group, dim)
            self._delete(group)
            for parent in list(Path(group).parents)[:-1]:  # "alpha" of "alpha/layer"
                if not (self.path / parent / "zarr.json").exists():
                    self._put_attrs(str(parent), {})
            self._put_attrs(group, {"settings": settings, "identity": identity, "complete": False, "units_done": 0,
                                    "unit_dim": dim, "units_expected": expected, "store_format": STORE_FORMAT,
                                    **attrs})
            return set()

    def _begin_root(self, root: dict | None, force: bool) -> None:
        new = jsonable(root or {})
        old = self.attrs if self.exists() else None
        if old is not None and new:
            old_base, new_base = old.get("base_model") or {}, new.get("base_model") or {}
            if old_base and new_base and old_base.get("path", old_base.get("spec")) != new_base.get(
                    "path", new_base.get("spec")):
                if not force:
                    raise StoreError(
                        f"store {self.path} holds results for base model {old_base.get('spec')!r}, not "
                        f"{new_base.get('spec')!r}; use another --out, or --force to replace the whole store"
                    )
                for group in self.groups():
                    self._delete(group)
                old = {}
        merged = dict(old or {})
        merged.update({key: value for key, value in new.items() if key not in merged or force})
        if old is None or merged != old:
            self._put_attrs("", merged)

    def _refuse_changes(self, group: str, old: dict, settings: dict, identity: dict) -> None:
        if "settings" not in old:
            raise StoreError(
                f"store {self.path}: group '{group}' has no record of its settings (a run of an older version was "
                f"stopped while writing it). Pass --force to recompute it, or choose another --out."
            )
        changes = settings_diff(old.get("settings") or {}, settings)
        old_identity = input_identity(old.get("provenance") or {}) or old.get("identity") or {}
        if identity and old_identity:
            changes += identity_changes(old_identity, identity)
        if changes:
            raise StoreError(
                f"store {self.path} already has group '{group}' made with other settings or inputs "
                f"({'; '.join(changes[:6])}). Pass --force to recompute it, or choose another --out."
            )

    def _delete(self, group: str) -> None:
        """Remove a group at once (renamed aside, then deleted), including leftovers of an interrupted delete."""
        directory, flat = self.path / group, group.replace("/", "__")
        if directory.exists():
            os.rename(directory, self.path / f".{flat}.deleted-{uuid.uuid4().hex}")
        for leftover in self.path.glob(f".{flat}.deleted-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def _arrays(self, group: str) -> list[Path]:
        directory = self.path / group
        return sorted(child for child in directory.iterdir() if child.is_dir() and self._node_type(child) == "array")

    def _repair(self, group: str, dim: str) -> set[str]:
        """Cut arrays back to the rows recorded as complete; return their labels."""
        attrs = self.group_attrs(group)
        directory = self.path / group
        done = int(attrs.get("units_done", 0))
        if done == 0 and not attrs.get("complete"):
            for array_dir in self._arrays(group):
                shutil.rmtree(array_dir)
            return set()
        node = zarr.open_group(self._zarr_store(), path=group, mode="a", zarr_format=3, use_consolidated=False)
        for name, array in node.arrays():
            dims = array.metadata.dimension_names or ()
            if dim in dims and not attrs.get("complete"):
                axis = dims.index(dim)
                if array.shape[axis] < done:
                    raise StoreError(f"store {self.path}: {directory / name} has {array.shape[axis]} rows along "
                                     f"'{dim}' but {done} are recorded as written: the store is damaged")
                if array.shape[axis] > done:
                    array.resize(tuple(done if i == axis else s for i, s in enumerate(array.shape)))
        if dim not in node:
            return set()
        labels = node[dim][:] if attrs.get("complete") else node[dim][:done]
        return {str(v) for v in labels}

    def append(self, group: str, dataset: xr.Dataset, dim: str = "module") -> None:
        """Append complete units along `dim` (one or more labels) to `group`.

        The arrays are written first (the group's metadata file is left alone meanwhile), then the new row
        count is committed in one atomic write: a unit interrupted anywhere is cut back on resume.
        """
        with self._writing():
            attrs = self.group_attrs(group)
            done = int(attrs.get("units_done", 0))
            piece = self._fit_strings(group, dataset.drop_attrs(deep=False))
            append = {"append_dim": dim} if done else {}
            piece.to_zarr(self._zarr_store(f"{group}/zarr.json"), group=group, mode="a", zarr_format=3,
                          consolidated=False, write_empty_chunks=True, **append)
            _fault_point("append")
            self._put_attrs(group, {**attrs, **_detached_coordinates(piece), "units_done": done + dataset.sizes[dim]})

    def write(self, group: str, dataset: xr.Dataset, settings: dict, *, force: bool = False,
              root: dict | None = None, attrs: dict | None = None) -> None:
        """Write a whole group at once (small results)."""
        self.begin(group, settings, force=force, root=root, attrs=attrs, dim="__none__")
        with self._writing():
            self._put_attrs(group, {**self.group_attrs(group), **_detached_coordinates(dataset), "complete": False,
                                    "units_done": 0})
            for array_dir in self._arrays(group):
                shutil.rmtree(array_dir)
            self._fit_strings(group, dataset.drop_attrs(deep=False)).to_zarr(
                self._zarr_store(f"{group}/zarr.json"), group=group, mode="a", zarr_format=3, consolidated=False,
                write_empty_chunks=True)
        self.finish(group, extra=dataset.attrs)

    def annotate(self, group: str, extra: dict) -> None:
        """Add attrs to `group` while it is written (a run resumed after a kill keeps them)."""
        with self._writing():
            self._put_attrs(group, {**self.group_attrs(group), **jsonable(extra)})

    def finish(self, group: str, extra: dict | None = None) -> None:
        """Mark `group` complete, store extra attrs (e.g. choices the metric made) and consolidate the store's
        metadata; releases the lock."""
        self.annotate(group, {**(extra or {}), "complete": True})
        with self._writing(consolidating=True):
            self._write_consolidated()
        self.lock.release()

    # ------------------------------------------------------------------ consolidated metadata

    def consolidate(self) -> None:
        """Write the root's consolidated metadata now (a store written before it existed, or left by a killed
        run): `xr.open_datatree` then opens it without a warning. Takes the store's lock; a store being written
        by another process is refused (its writer consolidates when its group completes)."""
        if not self.exists():
            raise StoreError(f"no store at {self.path}")
        with self._writing(consolidating=True):
            self._write_consolidated()
        self.lock.release()

    def consolidation(self) -> str:
        """``current`` (the root's consolidated metadata equals the files), ``absent`` or ``stale`` (the store
        was changed behind the toolkit's back, e.g. a group deleted by hand)."""
        recorded = _read_json(self.path / "zarr.json").get("consolidated_metadata")
        if not recorded:
            return "absent"
        return "current" if recorded.get("metadata") == self._members() else "stale"

    def consolidation_hint(self) -> str | None:
        """One line for a store whose consolidated metadata is absent or stale (None when it is current)."""
        state = self.consolidation() if self.exists() else "current"
        if state == "current":
            return None
        why = ("has no consolidated metadata (written before submerge consolidated its stores, or by a run that "
               "stopped), so xr.open_datatree warns when it opens it" if state == "absent" else
               "has consolidated metadata that no longer matches its files (changed outside submerge, e.g. a group "
               "deleted by hand), so xr.open_datatree shows the store as it was")
        return f"store {self.path} {why}: `diag report {self.path} --consolidate` consolidates it"

    def _members(self) -> dict[str, dict]:
        """The metadata of every group and array below the root, keyed by path, as zarr consolidates it (a
        group's own ``consolidated_metadata`` empty). Hidden entries (``.name``: the lock, groups being deleted)
        are not part of the hierarchy; arrays are not descended into (their chunks hold no metadata)."""
        members: dict[str, dict] = {}
        pending = [""]
        while pending:
            prefix = pending.pop()
            for child in sorted((self.path / prefix).iterdir()):
                meta_path = child / "zarr.json"
                if child.name.startswith(".") or not child.is_dir() or not meta_path.exists():
                    continue
                key = f"{prefix}/{child.name}" if prefix else child.name
                meta = _read_json(meta_path)
                if meta.get("node_type") == "group":
                    meta["consolidated_metadata"] = {"kind": "inline", "must_understand": False, "metadata": {}}
                    pending.append(key)
                elif meta.get("node_type") != "array":
                    continue
                members[key] = meta
        return members

    def _write_consolidated(self) -> None:
        meta = _read_json(self.path / "zarr.json")
        meta["consolidated_metadata"] = {"kind": "inline", "must_understand": False, "metadata": self._members()}
        _atomic_write(self.path / "zarr.json", json.dumps(meta, indent=2).encode())

    def _drop_consolidated(self) -> None:
        path = self.path / "zarr.json"
        if not path.exists():
            return
        meta = _read_json(path)
        if meta.get("consolidated_metadata") is not None:
            meta["consolidated_metadata"] = None
            _atomic_write(path, json.dumps(meta, indent=2).encode())

    # ------------------------------------------------------------------ strings

    def _fit_strings(self, group: str, dataset: xr.Dataset) -> xr.Dataset:
        """String variables as fixed-width unicode, as wide as the stored array (widened if a string is longer).

        Groups written by earlier versions hold variable-length strings: those stay variable-length.
        """
        dataset = dataset.copy()
        directory = self.path / group
        for name, variable in {**dataset.coords, **dataset.data_vars}.items():
            if not _is_strings(variable.values):
                continue
            values = np.asarray(variable.values, dtype=object).astype(str)
            longest = max((len(v) for v in values.reshape(-1)), default=0)
            stored = _stored_dtype(directory / str(name))
            if stored is not None and stored.kind != "U":
                values = values.astype(object)
            else:
                width = max(STRING_WIDTH, longest) if stored is None else stored.itemsize // 4
                if stored is not None and longest > width:
                    width = max(longest, 2 * width)
                    self._widen(group, str(name), width)
                values = values.astype(f"<U{width}")
            if name in dataset.coords:
                dataset = dataset.assign_coords({name: (variable.dims, values, variable.attrs)})
            else:
                dataset[name] = (variable.dims, values, variable.attrs)
        return dataset

    def _widen(self, group: str, name: str, width: int) -> None:
        """Rewrite string array `name` `width` characters wide, crash-safe.

        The new chunks go under the other chunk-key separator ("c/0" ↔ "c.0"), so they never overwrite the
        old ones; replacing the array's metadata file switches to them in one atomic step.
        """
        directory = self.path / group / name
        array = zarr.open_array(self._zarr_store(), path=f"{group}/{name}", mode="r")
        separator = array.metadata.chunk_key_encoding.to_dict()["configuration"].get("separator", "/")
        new_separator = "." if separator == "/" else "/"
        _remove_chunks(directory, new_separator)  # leftovers of an interrupted earlier widening
        memory: dict = {}
        wide = zarr.create_array(MemoryStore(memory), shape=array.shape, chunks=array.chunks, dtype=f"<U{width}",
                                 fill_value="", chunk_key_encoding={"name": "default", "separator": new_separator},
                                 dimension_names=array.metadata.dimension_names, attributes=dict(array.attrs),
                                 zarr_format=3, config={"write_empty_chunks": True})
        wide[...] = array[...].astype(f"<U{width}")
        for key, buffer in memory.items():
            if key != "zarr.json":
                _atomic_write(directory / key, buffer.to_bytes())
        _atomic_write(directory / "zarr.json", memory["zarr.json"].to_bytes())
        _remove_chunks(directory, separator)


def _remove_chunks(directory: Path, separator: str) -> None:
    if separator == "/":
        shutil.rmtree(directory / "c", ignore_errors=True)
    else:
        for chunk in directory.glob("c.*"):
            chunk.unlink(missing_ok=True)


def _is_strings(values: np.ndarray) -> bool:
    if values.dtype.kind in "UT":
        return True
    return values.dtype.kind == "O" and all(isinstance(v, str) for v in values.reshape(-1))


def _stored_dtype(directory: Path) -> np.dtype | None:
    meta = directory / "zarr.json"
    if not meta.exists():
        return None
    data_type = _read_json(meta).get("data_type")
    if isinstance(data_type, dict) and data_type.get("name") == "fixed_length_utf32":
        return np.dtype(f"<U{data_type['configuration']['length_bytes'] // 4}")
    return np.dtype(object) if data_type in ("string", "variable_length_utf8") else np.dtype(float)


def _detached_coordinates(dataset: xr.Dataset) -> dict:
    """The group attr that names the coordinates no data variable carries (projection's combo_alpha, combo × task,
    beside variables over module × combo): xarray reads them back as coordinates only if the group's "coordinates"
    attr names them, which writing into an existing group does not do; without it they come back as data variables
    and a resumed run cannot join its stored units to its new ones."""
    names = [name for name, coord in dataset.coords.items() if name not in dataset.dims
             and not any(set(coord.dims) <= set(variable.dims) for variable in dataset.data_vars.values())]
    return {"coordinates": " ".join(sorted(names))} if names else {}


def _readable_strings(dataset: xr.Dataset) -> xr.Dataset:
    """Variable-length strings of older stores (numpy StringDType) as plain unicode, so `.astype(str)` works."""
    for name, variable in {**dataset.coords, **dataset.data_vars}.items():
        if variable.dtype.kind == "T":
            values = variable.values.astype(object).astype(str)
            if name in dataset.coords:
                dataset = dataset.assign_coords({name: (variable.dims, values, variable.attrs)})
            else:
                dataset[name] = (variable.dims, values, variable.attrs)
    return dataset


class UnitWriter:
    """A driver's results, unit by unit: appended to `store` as each finishes, gathered for the return value.

    Starts or resumes `group` (`Store.begin`); `done` holds the labels already written. `add` appends one
    finished unit — one or several labels along `dim` (e.g. several matrices) — and calls `on_unit(label)`
    (tests use it to simulate a kill). `finish` concatenates the resumed and new units, sets `notes` (or
    `result_attrs`) on the result and marks the group complete; with no unit at all it returns `empty`.
    `inputs` (fingerprints: base_model, finetuned, data …) builds `root` and `attrs` with `run_attrs`;
    `expected` is the number of labels a complete run writes (for `Store.status`); `grows`: settings that may gain
    entries (`Store.begin`).
    """

    def __init__(self, store: Store | None, group: str, settings: dict, *, dim: str = "module", force: bool = False,
                 root: dict | None = None, attrs: dict | None = None, on_unit=None, inputs: dict | None = None,
                 command: str | None = None, expected: int | None = None, grows: tuple[str, ...] = ()):
        self.store, self.group, self.dim, self.on_unit = store, group, dim, on_unit
        self.settings = settings
        self.done: set[str] = set()
        self.pieces: list[xr.Dataset] = []
        if inputs is not None:
            made_root, made_attrs = run_attrs(command, inputs)
            root = made_root if root is None else root
            attrs = made_attrs if attrs is None else attrs
        if store is not None:
            self.done = store.begin(group, settings, force=force, root=root, attrs=attrs, dim=dim, expected=expected,
                                    grows=grows)
            if self.done:
                self.pieces.append(store.dataset(group))

    def add(self, piece: xr.Dataset, label: str) -> None:
        if self.store is not None:
            self.store.append(self.group, piece, dim=self.dim)
        self.pieces.append(piece)
        if self.on_unit:
            self.on_unit(label)

    def note(self, extra: dict) -> None:
        """Attrs known before the end (e.g. a search done by one unit): on the group now, so a resume keeps them."""
        if self.store is not None:
            self.store.annotate(self.group, extra)

    def finish(self, notes: dict, *, result_attrs: dict | None = None, empty: xr.Dataset | None = None,
               concat: dict | None = None) -> xr.Dataset:
        """The whole result; `concat` passes options to `xarray.concat` (e.g. ``data_vars="minimal"``)."""
        pieces = [p for p in self.pieces if p.sizes.get(self.dim, 0)] or self.pieces[:1]
        if len(pieces) > 1:
            result = xr.concat(pieces, dim=self.dim, **(concat or {}))
        elif pieces:
            result = pieces[0]
        else:
            result = empty.copy() if empty is not None else xr.Dataset()
            if self.store is not None and empty is not None and empty.variables:
                self.store.append(self.group, empty, dim=self.dim)
        result.attrs.update(notes if result_attrs is None else result_attrs)
        if self.settings:  # an in-memory result (no store) says what produced it as a stored group does
            result.attrs.setdefault("settings", self.settings)
        if self.store is not None:
            self.store.finish(self.group, notes)
        return result

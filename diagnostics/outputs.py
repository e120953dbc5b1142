"""Output paths: what a command may write over, checked before any work, and files replaced atomically.

One rule for every path a command writes (`diag merge --out`, `diag compare --keep DIR/<method>`,
`--plan-out`, `diag plan --out`, `--export-mergekit`): **nothing the user owns is deleted unless it is an
earlier output of the same command and ``--force`` is given.** An earlier output is recognised by what the
command itself writes into it (a merge directory's ``submerge_merge.yaml``, a plan's ``submerge_plan: 1``, the
header line of an exported mergekit config); anything else is refused even with ``--force``. The kind of path
(directory or file) and the permission to write its parent are checked up front too, so a long run does not
fail at its end.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

from submerge.diagnostics.errors import SubmergeError
from submerge.diagnostics.faults import fault_point

#: The file every merge directory holds (the plan or options used, provenance): it marks an earlier merge.
MERGE_MARKER = "submerge_merge.yaml"


class OutputError(SubmergeError):
    """An output path exists, is of the wrong kind or cannot be written."""


def _check_parent_writable(path: Path, option: str) -> None:
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{option} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: cannot write into {parent} (permission denied)")


def is_merge_output(directory: Path) -> bool:
    """Whether `directory` holds a checkpoint written by a submerge merge (its ``submerge_merge.yaml``)."""
    return (Path(directory) / MERGE_MARKER).is_file()


def check_output_directory(directory: str | Path, force: bool, *, option: str = "--out",
                           ours: Callable[[Path], bool] = is_merge_output, what: str = "a submerge merge") -> None:
    """Refuse `directory` unless it is absent, empty, or (with `force`) an earlier output (`ours`). Deletes nothing.

    A file where a directory is to be written is refused, with or without `force`."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise OutputError(f"{option} {directory} is a file, not a directory: it is left as it is; "
                          "choose a directory path")
    _check_parent_writable(directory, option)
    if not directory.is_dir() or not any(directory.iterdir()):
        if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
            raise OutputError(f"{option} {directory}: cannot write into it (permission denied)")
        return
    if not force:
        raise OutputError(f"output directory {directory} exists and is not empty; pass --force to replace it "
                          "(only an earlier output is replaced, and only once the new one is complete)")
    if not ours(directory):
        raise OutputError(f"{option} {directory} holds files that are not {what}: it is not replaced, not even "
                          "with --force; choose another directory or empty it yourself")


def check_output_file(path: str | Path, force: bool, *, option: str, ours: Callable[[Path], bool],
                      what: str) -> None:
    """Refuse the file `path` unless it is absent or (with `force`) an earlier output (`ours`). Deletes nothing."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise OutputError(f"{option} {path} is a directory, not a file: it is left as it is; choose a file path")
    _check_parent_writable(path, option)
    if not path.exists():
        return
    if not force:
        raise OutputError(f"{option} {path} exists; pass --force to replace it (only {what} is replaced)")
    if not ours(path):
        raise OutputError(f"{option} {path} is not {what}: it is not replaced, not even with --force; "
                          "choose another path or remove it yourself")
    if not os.access(path, os.W_OK):
        raise OutputError(f"{option} {path}: cannot replace it (permission denied)")


def file_starts_with(prefix: str) -> Callable[[Path], bool]:
    """An `ours` test: the file's first bytes are `prefix` (a header line the command writes)."""
    encoded = prefix.encode()

    def test(path: Path) -> bool:
        try:
            with open(path, "rb") as handle:
                return handle.read(len(encoded)) == encoded
        except OSError:
            return False

    return test


def replace_file(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically: a temporary file beside it, renamed over it once complete."""
    path = Path(path)
    fault_point("write", path, text.encode())
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in [*path.parent.glob(f".{path.name}.*.partial"), *path.parent.glob(f"{path.name}.*.partial")]:
        warnings.warn(f"removing {leftover}: a write of {path} that was killed left it behind", UserWarning,
                      stacklevel=2)
        leftover.unlink(missing_ok=True)
    handle = tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.",
                                         suffix=".partial", delete=False)
    try:
        with handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, path)
    except OSError as exc:  # a full disk, a quota, a file-size limit: the file is as it was
        Path(handle.name).unlink(missing_ok=True)
        raise OutputError(f"could not write {path} ({exc.strerror or exc}): it is left as it was; free space (or "
                          "raise the limit) and run the same command again") from None
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise
    return path

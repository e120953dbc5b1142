"""The store: a zarr v3 group tree that opens as an `xarray.DataTree`.

One group per diagnostic (``linearity``, ``projection``, ``alpha``,
``interference``, ``eval`` ...), labelled dimensions, and provenance in the
attrs: the root holds the toolkit and library versions and the base model; each
group holds the settings, inputs (models, data files with hashes) and the
command that made it.

Resuming: a group is written unit by unit (`append` along ``module`` or
``matrix``); its attrs count the units that were completely written, so a run
that was killed resumes after the last complete unit (a half-written unit is
cut off and redone). An existing group is never replaced unless ``force``;
re-running with other settings without ``force`` is an error that names the
settings that differ.

    >>> import xarray as xr
    >>> tree = xr.open_datatree("runs/demo.zarr", engine="zarr")
    >>> tree["linearity"].ds.nonlinearity_score.mean("sample")
"""

from __future__ import annotations

import datetime as _dt
import platform
import shutil
import sys
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np
import xarray as xr
import zarr

from diagnostics.errors import StoreError

_LIBRARIES = ("submerge", "torch", "transformers", "safetensors", "peft", "numpy", "scipy", "xarray", "zarr")

warnings.filterwarnings("ignore", message=".*does not have a Zarr V3 specification.*")
warnings.filterwarnings("ignore", message=".*Consolidated metadata is currently not part.*")


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def provenance(command: str | None = None, **fields) -> dict:
    """Where numbers came from: versions, host, time, command, plus the caller's fields."""
    info = {
        "toolkit": "submerge",
        "toolkit_version": library_versions()["submerge"],
        "libraries": library_versions(),
        "host": platform.node(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join(sys.argv),
    }
    info.update(fields)
    return _jsonable(info)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {a!r} → {b!r}")
    return changes


class Store:
    """A zarr v3 store of diagnostics. See the module docstring."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()

    # ------------------------------------------------------------------ opening

    def exists(self) -> bool:
        return (self.path / "zarr.json").exists()

    def _root(self, mode: str = "a") -> zarr.Group:
        return zarr.open_group(str(self.path), mode=mode, zarr_format=3)

    def groups(self) -> list[str]:
        if not self.exists():
            return []
        return sorted(name for name, _ in self._root("r").groups())

    def has(self, group: str) -> bool:
        if not self.exists():
            return False
        try:
            node = self._root("r")[group]
        except KeyError:
            return False
        return isinstance(node, zarr.Group)

    def open(self) -> xr.DataTree:
        """The whole store as an `xarray.DataTree`."""
        if not self.exists():
            raise StoreError(f"no store at {self.path}")
        return xr.open_datatree(str(self.path), engine="zarr", consolidated=False)

    def dataset(self, group: str) -> xr.Dataset:
        """One group as an `xarray.Dataset` (loaded)."""
        if not self.has(group):
            raise StoreError(f"store {self.path} has no group '{group}' (it has: {', '.join(self.groups()) or 'nothing'})")
        return xr.open_zarr(str(self.path), group=group, consolidated=False, zarr_format=3).load()

    @property
    def attrs(self) -> dict:
        return dict(self._root("r").attrs) if self.exists() else {}

    # ------------------------------------------------------------------ groups

    def begin(self, group: str, settings: dict, *, force: bool = False, root: dict | None = None,
              attrs: dict | None = None, dim: str = "module") -> set[str]:
        """Start or resume writing `group`; returns the labels along `dim` already complete.

        A group made with the same `settings` resumes; with other settings it is an error
        unless `force`, which deletes the group first. `root` updates the store's root attrs
        (kept from the first run otherwise); `attrs` (provenance) go on the group.
        """
        settings = _jsonable(settings)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.exists() and root:
            old_base = self.attrs.get("base_model")
            new_base = _jsonable(root).get("base_model")
            same = (old_base or {}).get("path", (old_base or {}).get("spec")) == (new_base or {}).get(
                "path", (new_base or {}).get("spec"))
            if old_base and new_base and not same:
                if not force:
                    raise StoreError(
                        f"store {self.path} holds results for base model {old_base.get('spec')!r}, not "
                        f"{new_base.get('spec')!r}; use another --out, or --force to replace the whole store"
                    )
                shutil.rmtree(self.path)
        root_group = self._root("a")
        if root:
            for key, value in _jsonable(root).items():
                if key not in root_group.attrs or force:
                    root_group.attrs[key] = value
        if self.has(group):
            old = dict(root_group[group].attrs)
            if force:
                del root_group[group]
            elif old.get("settings") != settings:
                changes = _diff(old.get("settings") or {}, settings)
                raise StoreError(
                    f"store {self.path} already has group '{group}' made with other settings "
                    f"({'; '.join(changes[:6])}). Pass --force to overwrite it, or choose another --out."
                )
            else:
                return self._repair(group, dim)
        created = root_group.require_group(group)
        created.attrs.update({"settings": settings, "complete": False, "units_done": 0,
                              **(_jsonable(attrs) if attrs else {})})
        return set()

    def _repair(self, group: str, dim: str) -> set[str]:
        """Cut arrays back to the units recorded as complete; return their labels."""
        node = self._root("a")[group]
        done = int(node.attrs.get("units_done", 0))
        for name, array in node.arrays():
            dims = array.metadata.dimension_names or ()
            if dim in dims:
                axis = dims.index(dim)
                if array.shape[axis] > done:
                    shape = list(array.shape)
                    shape[axis] = done
                    array.resize(tuple(shape))
        if done == 0:
            for name in [n for n, _ in node.arrays()]:
                del node[name]
            return set()
        labels = node[dim][:]
        return {str(v) for v in labels[:done]}

    def append(self, group: str, dataset: xr.Dataset, dim: str = "module") -> None:
        """Append complete units along `dim` (one or more labels) to `group`."""
        node = self._root("a")[group]
        kept = dict(node.attrs)
        done = int(kept.get("units_done", 0))
        dataset = _object_strings(dataset).drop_attrs(deep=False)
        append = {"append_dim": dim} if done else {}
        dataset.to_zarr(str(self.path), group=group, mode="a", zarr_format=3, consolidated=False, **append)
        node = self._root("a")[group]
        node.attrs.update({**kept, "units_done": done + dataset.sizes[dim]})

    def write(self, group: str, dataset: xr.Dataset, settings: dict, *, force: bool = False,
              root: dict | None = None, attrs: dict | None = None) -> None:
        """Write a whole group at once (small results)."""
        self.begin(group, settings, force=force, root=root, attrs=attrs, dim="__none__")
        node = self._root("a")[group]
        kept = dict(node.attrs)
        for name in [n for n, _ in node.arrays()]:
            del node[name]
        _object_strings(dataset).drop_attrs(deep=False).to_zarr(
            str(self.path), group=group, mode="a", zarr_format=3, consolidated=False)
        self._root("a")[group].attrs.update(kept)
        self.finish(group, extra=dataset.attrs)

    def finish(self, group: str, extra: dict | None = None) -> None:
        """Mark `group` complete and store extra attrs (e.g. choices the metric made)."""
        node = self._root("a")[group]
        if extra:
            node.attrs.update(_jsonable(extra))
        node.attrs["complete"] = True

    def is_complete(self, group: str) -> bool:
        return self.has(group) and bool(self._root("r")[group].attrs.get("complete"))


def _object_strings(dataset: xr.Dataset) -> xr.Dataset:
    """Store string coordinates as variable-length strings (appends never truncate)."""
    dataset = dataset.copy()
    for name, variable in {**dataset.coords, **dataset.data_vars}.items():
        if variable.dtype.kind == "U":
            values = np.asarray(variable.values, dtype=object)
            if name in dataset.coords:
                dataset = dataset.assign_coords({name: (variable.dims, values)})
            else:
                dataset[name] = (variable.dims, values)
    return dataset


class UnitWriter:
    """A driver's results, unit by unit: appended to `store` as each finishes, gathered for the return value.

    Starts or resumes `group` (`Store.begin`); `done` holds the labels already written. `add` appends one
    finished unit and calls `on_unit(label)` (tests use it to simulate a kill). `finish` concatenates the
    resumed and new units, sets `notes` (or `result_attrs`) on the result and marks the group complete.
    """

    def __init__(self, store: Store | None, group: str, settings: dict, *, dim: str = "module", force: bool = False,
                 root: dict | None = None, attrs: dict | None = None, on_unit=None):
        self.store, self.group, self.dim, self.on_unit = store, group, dim, on_unit
        self.done: set[str] = set()
        self.pieces: list[xr.Dataset] = []
        if store is not None:
            self.done = store.begin(group, settings, force=force, root=root, attrs=attrs, dim=dim)
            if self.done:
                self.pieces.append(store.dataset(group))

    def add(self, piece: xr.Dataset, label: str) -> None:
        if self.store is not None:
            self.store.append(self.group, piece, dim=self.dim)
        self.pieces.append(piece)
        if self.on_unit:
            self.on_unit(label)

    def finish(self, notes: dict, *, result_attrs: dict | None = None) -> xr.Dataset:
        result = xr.concat(self.pieces, dim=self.dim) if len(self.pieces) > 1 else self.pieces[0]
        result.attrs.update(notes if result_attrs is None else result_attrs)
        if self.store is not None:
            self.store.finish(self.group, notes)
        return result

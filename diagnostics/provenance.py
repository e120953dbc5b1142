"""Provenance: where a store's numbers came from — versions, host, time, command, inputs and their content hashes.

Every store group and merged checkpoint records `provenance(...)`; `input_identity` is what a resumed run
compares (the models' and data files' content hashes, not their paths), `settings_diff` what changed in settings.
"""

from __future__ import annotations

import datetime as _dt
import platform
import sys
from importlib import metadata
from pathlib import Path

import numpy as np

_LIBRARIES = ("submerge", "torch", "transformers", "safetensors", "peft", "numpy", "scipy", "xarray", "zarr")


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
    versions = library_versions()
    info = {
        "toolkit": "submerge",
        "toolkit_version": versions["submerge"],
        "libraries": versions,
        "host": platform.node(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join(sys.argv),
    }
    info.update(fields)
    return jsonable(info)


def run_attrs(command: str | None, inputs: dict) -> tuple[dict, dict]:
    """(root attrs, group attrs) of a run on `inputs`: the one place a driver's provenance is built.

    `inputs` holds the fingerprints (``base_model``, ``finetuned``, ``data``, ``models`` ...) and
    anything else worth keeping; the root gets the base model, the group all of it under ``provenance``.
    """
    root = provenance(command, base_model=inputs.get("base_model"))
    return root, {"provenance": provenance(command, **inputs)}


def _model_identity(fingerprint) -> dict:
    if not isinstance(fingerprint, dict):
        return {"hash": str(fingerprint), "path": str(fingerprint)}
    for key in ("content_sha256", "adapter_sha256"):
        if fingerprint.get(key):
            return {"hash": f"sha256:{fingerprint[key]}", "path": fingerprint.get("path") or fingerprint.get("spec")}
    where = fingerprint.get("path") or fingerprint.get("spec")
    size = fingerprint.get("file_size")
    return {"hash": f"{where} ({size} bytes)" if size is not None else str(where), "path": where}


def input_identity(inputs: dict) -> dict:
    """What a group's numbers depend on besides settings: content hashes of models and data files.

    Read from a run's inputs (or a group's ``provenance`` attr): base model, each fine-tune, each data
    file and held-out data file (SHA-256), each evaluated model. Paths are shown in messages but only the hashes are compared
    (a moved file is the same input); a checkpoint without a content hash is identified by path and size.
    """
    inputs = inputs or {}
    identity = {}
    if inputs.get("base_model"):
        identity["base model"] = _model_identity(inputs["base_model"])
    for task, fingerprint in (inputs.get("finetuned") or {}).items():
        identity[f"fine-tune '{task}'"] = _model_identity(fingerprint)
    for key, label in (("data", "data"), ("held_out", "held-out data")):  # held_out: `diag compare`'s records
        for task, data in (inputs.get(key) or {}).items():
            identity[f"{label} '{task}'"] = {"hash": f"sha256:{data.get('sha256')}", "path": data.get("path")}
    for label, spec in (inputs.get("models") or {}).items():
        identity[f"model '{label}'"] = _model_identity(spec)
    return jsonable(identity)


def identity_changes(old: dict, new: dict) -> list[str]:
    def show(entry):
        if entry is None:
            return "absent"
        digest = entry["hash"]
        short = digest[:19] + "…" if digest.startswith("sha256:") else digest
        return f"{entry['path']} ({short})" if entry.get("path") and entry["path"] not in digest else short

    return [f"{name}: {show(old.get(name))} → {show(new.get(name))}" for name in sorted(set(old) | set(new))
            if (old.get(name) or {}).get("hash") != (new.get(name) or {}).get("hash")]


def jsonable(value):
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def settings_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += settings_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {a!r} → {b!r}")
    return changes


def settings_grown(old: dict | None, new: dict, keys: tuple[str, ...]) -> bool:
    """Whether `new` extends `old` at `keys` only: each such setting a list `old`'s extended at its end or a dict
    `old`'s with keys added (absent in `old`: empty), every other setting equal, and `new` not `old` itself."""
    if not isinstance(old, dict) or old == new:
        return False
    for key in set(old) | set(new):
        a, b = old.get(key), new.get(key)
        if key not in keys:
            if a != b:
                return False
        elif isinstance(b, list):
            if not isinstance(a, list) or b[:len(a)] != a:
                return False
        elif isinstance(b, dict):
            if a is not None and (not isinstance(a, dict) or any(k not in b or b[k] != v for k, v in a.items())):
                return False
        elif a != b:
            return False
    return True

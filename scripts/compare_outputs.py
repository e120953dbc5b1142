"""Compare two stores, or two merged checkpoints, bit for bit: every group, variable, coordinate and tensor.

    python scripts/compare_outputs.py runs/a.zarr runs/b.zarr          # stores
    python scripts/compare_outputs.py merged-a/ merged-b/              # checkpoints (safetensors)

Prints one line per group (or one for the checkpoint) and exits 1 if anything differs, naming it. Provenance
(times, hosts, commands, the engine) is not compared: only the numbers and the settings that produced them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind in "fc":
        return bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))  # bitwise, NaNs included
    return bool(np.array_equal(a, b))


def compare_stores(first: Path, second: Path) -> list[str]:
    from submerge.diagnostics.store import Store

    problems = []
    stores = Store(first), Store(second)
    groups = [sorted(store.groups()) for store in stores]
    if groups[0] != groups[1]:
        return [f"groups differ: {groups[0]} vs {groups[1]}"]
    for group in groups[0]:
        a, b = (store.dataset(group) for store in stores)
        differing = [name for name in sorted(set(a.variables) | set(b.variables))
                     if name not in a.variables or name not in b.variables
                     or not _equal(np.asarray(a[name].values), np.asarray(b[name].values))]
        if a.attrs.get("settings") != b.attrs.get("settings"):
            differing.append("attrs.settings")
        print(f"{group}: {'bitwise equal' if not differing else 'DIFFERS in ' + ', '.join(differing)}"
              f" ({len(a.data_vars)} variables)")
        problems += [f"{group}.{name}" for name in differing]
    return problems


def compare_checkpoints(first: Path, second: Path) -> list[str]:
    import torch
    from safetensors.torch import load_file

    def tensors(directory: Path) -> dict:
        found = {}
        for file in sorted(directory.glob("*.safetensors")):
            found.update(load_file(str(file)))
        return found

    def same(x: torch.Tensor, y: torch.Tensor) -> bool:  # the bytes, NaNs included
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.reshape(-1).view(torch.uint8),
                                                                         y.reshape(-1).view(torch.uint8))

    a, b = tensors(first), tensors(second)
    differing = [name for name in sorted(set(a) | set(b)) if name not in a or name not in b or not same(a[name], b[name])]
    print(f"checkpoint: {'bitwise equal' if not differing else 'DIFFERS in ' + ', '.join(differing[:10])}"
          f" ({len(a)} tensors)")
    return differing


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    first, second = (Path(p) for p in argv)
    problems = (compare_checkpoints if list(first.glob("*.safetensors")) else compare_stores)(first, second)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

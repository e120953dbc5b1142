"""Benchmark: `diag interference` in one process and on 1 and 2 local Ray workers.

Builds (offline) the random Llama checkpoint of ``benchmarks/interference.py``
(default 6 layers, hidden 256, three perturbed fine-tunes), then runs, each in a
fresh subprocess:

- ``single``:   ``interference(...)`` in this process, torch limited to 1 thread;
- ``ray-1``:    ``interference(..., ray="auto", workers=1)`` (a local Ray instance, 1 CPU);
- ``ray-2``:    ``interference(..., ray="auto", workers=2)``.

Every Ray worker runs torch with 1 thread too, so the three runs do the same
arithmetic and their arrays must be bitwise equal (checked and printed).  Ray's
start-up (``ray.init``) is timed apart from the interference pass; the pass
includes starting the worker processes (each imports torch and opens the
checkpoints).  Printed:
wall time of the pass, the wall ratio ray-1 / ray-2 (the speed-up of a second
worker), the driver's peak RSS and each worker's peak RSS (``ru_maxrss`` of
the worker process, read from the worker at the end; it includes the Ray
worker runtime, measured alone as ``idle worker``).

    python benchmarks/scale_out.py [--layers 6] [--hidden 256]

Needs the ``ray`` extra (``pip install "submerge[ray]"``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _interference_benchmark():
    """benchmarks/interference.py as a module (its checkpoint builder and task names)."""
    spec = importlib.util.spec_from_file_location("interference_benchmark", ROOT / "benchmarks" / "interference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(mode: str, directory: Path, arrays: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch

    from diagnostics.interference import interference
    from diagnostics.models import open_checkpoint
    from diagnostics.tensors import TensorTable

    torch.set_num_threads(1)
    tasks = _interference_benchmark().TASKS
    base = open_checkpoint(str(directory / "base"))
    finetuned = {task: open_checkpoint(str(directory / task)) for task in tasks}
    table = TensorTable.from_reader(base)  # built before the clock starts (it imports transformers)
    options, startup, idle = {}, 0.0, None
    if mode != "single":
        import ray

        start = time.perf_counter()
        ray.init(num_cpus=int(mode.split("-")[1]), include_dashboard=False, log_to_driver=False)
        startup = time.perf_counter() - start
        idle = ray.get(ray.remote(_idle_peak_rss_mib).remote())
        report: dict = {}
        options = {"ray": "auto", "workers": int(mode.split("-")[1]),
                   "ray_options": {"report": report, "threads_per_worker": 1}}
    start = time.perf_counter()
    dataset = interference(base, finetuned, device="cpu", progress=False, table=table, **options)
    wall = time.perf_counter() - start
    np.savez(arrays, **{name: variable.values for name, variable in dataset.data_vars.items()})
    import resource

    result = {"wall_s": wall, "startup_s": startup, "matrices": dataset.sizes["matrix"],
              "driver_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if mode != "single":
        result["workers"] = report["workers"]
        result["idle_worker_peak_rss_mib"] = idle
    return result


def _idle_peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _bitwise_equal(first: Path, second: Path) -> bool:
    import numpy as np

    a, b = np.load(first, allow_pickle=True), np.load(second, allow_pickle=True)
    return set(a.files) == set(b.files) and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k], equal_nan=a[k].dtype.kind == "f") for k in a.files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run(args.mode, args.dir, args.dir / f"{args.mode}.npz")))
        return
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        sys.path.insert(0, str(ROOT))
        size = _interference_benchmark().build(directory, args.layers, args.hidden)
        print(f"model: {args.layers} layers, hidden {args.hidden}, {size['matrices']} matrices, "
              f"{size['params'] / 1e6:.1f} M parameters; 3 fine-tunes")
        results = {}
        for mode in ("single", "ray-1", "ray-2"):
            command = [sys.executable, __file__, "--mode", mode, "--dir", str(directory)]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results[mode] = json.loads(output.strip().splitlines()[-1])
            line = results[mode]
            print(f"{mode:>6}: interference {line['wall_s']:.2f} s (Ray start-up {line['startup_s']:.1f} s apart), "
                  f"driver peak RSS {line['driver_peak_rss_mib']:.0f} MiB")
            for index, worker in enumerate(line.get("workers", [])):
                print(f"        worker {index}: peak RSS {worker['peak_rss_mib']:.0f} MiB "
                      f"(an idle Ray worker: {line['idle_worker_peak_rss_mib']:.0f} MiB)")
        for mode in ("ray-1", "ray-2"):
            same = _bitwise_equal(directory / "single.npz", directory / f"{mode}.npz")
            print(f"{mode} arrays bitwise equal to single: {same}")
        print(f"wall ratio ray-1 / ray-2: {results['ray-1']['wall_s'] / results['ray-2']['wall_s']:.2f}x; "
              f"single / ray-2: {results['single']['wall_s'] / results['ray-2']['wall_s']:.2f}x")


if __name__ == "__main__":
    main()

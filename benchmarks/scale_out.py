"""Benchmark: `diag interference` and `diag linearity` in one process and on 1 and 2 local Ray workers.

Interference (``--diagnostic interference``): builds (offline) the random Llama checkpoint of
``benchmarks/interference.py`` (default 6 layers, hidden 256, three perturbed fine-tunes).
Linearity (``--diagnostic linearity``): a random Llama of ``submerge.diagnostics.toy`` (default 8 layers, hidden
1024, intermediate 2816: about 51 MB of float32 weights per block) with two perturbed fine-tunes and their
task data (8 samples each); ``nonlinearity`` over the layer, attn and mlp levels with N = 4.  Each in a
fresh subprocess:

- ``single``:   ``LocalEngine(threads=1)``, the driver in this process;
- ``ray-1``:    ``RayEngine("auto", workers=1, threads=1)`` (a local Ray instance, 1 CPU);
- ``ray-2``:    ``RayEngine("auto", workers=2, threads=1)`` (linearity: worker 0 holds blocks 0–3, worker 1 4–7).

Every engine fixes torch's thread count at 1, so the three runs do the same
arithmetic and their arrays must be bitwise equal (checked and printed).  Ray's
start-up (``ray.init``) is timed apart from the pass; the pass includes starting
the worker processes (each imports torch and opens the checkpoints; a linearity
worker reads its blocks).  Printed: wall time of the pass, the wall ratio
ray-1 / ray-2 (the speed-up of a second worker), the driver's peak RSS and each
worker's peak RSS (``ru_maxrss`` of the worker process, read from the worker at
the end; it includes the Ray worker runtime, measured alone as ``idle worker``)
and, for linearity, the blocks and the weights (MiB) it holds.  The linearity
driver on Ray loads the base on the meta device (``weights=False``), as
``diag linearity --ray`` does.

    python benchmarks/scale_out.py [--diagnostic both] [--layers 6] [--hidden 256]
                                   [--linearity-layers 8] [--linearity-hidden 1024]

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
LINEARITY_TASKS = ("math", "code")


def _interference_benchmark():
    """benchmarks/interference.py as a module (its checkpoint builder and task names)."""
    spec = importlib.util.spec_from_file_location("interference_benchmark", ROOT / "benchmarks" / "interference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _start_ray(mode: str) -> tuple[dict, float, float | None]:
    """For a ``ray-N`` mode: Ray started here (timed), the drivers' Ray options, an idle worker's peak RSS."""
    from submerge.diagnostics.execution import LocalEngine, RayEngine

    if mode == "single":
        return {"engine": LocalEngine(threads=1)}, 0.0, None
    import ray

    workers = int(mode.split("-")[1])
    start = time.perf_counter()
    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    startup = time.perf_counter() - start
    idle = ray.get(ray.remote(_idle_peak_rss_mib).remote())
    return {"engine": RayEngine("auto", workers=workers, threads=1, report={})}, startup, idle


def _interference_pass(directory: Path, options: dict):
    from submerge.diagnostics.checkpoints import open_checkpoint
    from submerge.diagnostics.interference import interference
    from submerge.diagnostics.tensors import TensorTable

    base = open_checkpoint(str(directory / "base"))
    finetuned = {task: open_checkpoint(str(directory / task)) for task in _interference_benchmark().TASKS}
    table = TensorTable.from_reader(base)  # built before the clock starts (it imports transformers)
    start = time.perf_counter()
    dataset = interference(base, finetuned, device="cpu", progress=False, table=table, **options)
    return dataset, time.perf_counter() - start


def _linearity_pass(directory: Path, options: dict):
    from submerge.diagnostics.experiment import Experiment
    from submerge.diagnostics.linearity import nonlinearity

    directory = directory / "linearity"
    experiment = Experiment.load(str(directory / "base"), {task: str(directory / task) for task in LINEARITY_TASKS},
                                 {task: str(directory / f"{task}.jsonl") for task in LINEARITY_TASKS},
                                 samples=8, max_tokens=64, batch_size=4, dtype="float32", device="cpu",
                                 weights=type(options["engine"]).__name__ == "LocalEngine")
    start = time.perf_counter()
    dataset = nonlinearity(experiment, levels=("layer", "attn", "mlp"), steps=4, progress=False, **options)
    return dataset, time.perf_counter() - start


def run(mode: str, diagnostic: str, directory: Path, arrays: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    import resource

    import numpy as np
    import torch

    torch.set_num_threads(1)
    options, startup, idle = _start_ray(mode)
    passes = {"interference": _interference_pass, "linearity": _linearity_pass}
    dataset, wall = passes[diagnostic](directory, options)
    np.savez(arrays, **{name: variable.values for name, variable in dataset.data_vars.items()})
    result = {"wall_s": wall, "startup_s": startup,
              "driver_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    report = getattr(options["engine"], "report", None)
    if report is not None:
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


def _build_linearity(directory: Path, layers: int, hidden: int) -> str:
    """The linearity model, its two perturbed fine-tunes and task data under `directory`; a size line."""
    import warnings

    from submerge.diagnostics import toy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = toy.build_model(directory / "linearity" / "base", "llama", layers=layers, hidden=hidden,
                               intermediate=hidden * 11 // 4, heads=8, kv_heads=8)
        toy.perturbed_finetunes(base, LINEARITY_TASKS)  # linearity/math, linearity/code
    for task in LINEARITY_TASKS:
        toy.write_task_data(directory / "linearity" / f"{task}.jsonl", task, count=8)
    size = (base / "model.safetensors").stat().st_size
    return f"linearity model: {layers} layers, hidden {hidden}, {size / 2**20:.0f} MiB float32; 2 fine-tunes"


def _print_mode(mode: str, diagnostic: str, line: dict) -> None:
    print(f"{mode:>6}: {diagnostic} {line['wall_s']:.2f} s (Ray start-up {line['startup_s']:.1f} s apart), "
          f"driver peak RSS {line['driver_peak_rss_mib']:.0f} MiB")
    for index, worker in enumerate(line.get("workers", [])):
        held = (f", blocks {worker['layers'][0]}-{worker['layers'][1]}, weights held {worker['weights_mib']:.0f} MiB"
                if "layers" in worker else "")
        print(f"        worker {index}: peak RSS {worker['peak_rss_mib']:.0f} MiB "
              f"(an idle Ray worker: {line['idle_worker_peak_rss_mib']:.0f} MiB){held}")


def _compare(diagnostic: str, directory: Path) -> None:
    """All three modes of `diagnostic`, each in a fresh subprocess; bitwise checks and wall ratios."""
    results = {}
    for mode in ("single", "ray-1", "ray-2"):
        command = [sys.executable, __file__, "--mode", mode, "--diagnostic", diagnostic, "--dir", str(directory)]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(output.strip().splitlines()[-1])
        _print_mode(mode, diagnostic, results[mode])
    for mode in ("ray-1", "ray-2"):
        same = _bitwise_equal(directory / f"{diagnostic}-single.npz", directory / f"{diagnostic}-{mode}.npz")
        print(f"{mode} arrays bitwise equal to single: {same}")
    print(f"{diagnostic} wall ratio ray-1 / ray-2: {results['ray-1']['wall_s'] / results['ray-2']['wall_s']:.2f}x; "
          f"single / ray-2: {results['single']['wall_s'] / results['ray-2']['wall_s']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--diagnostic", choices=("interference", "linearity", "both"), default="both")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--linearity-layers", type=int, default=8)
    parser.add_argument("--linearity-hidden", type=int, default=1024)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        arrays = args.dir / f"{args.diagnostic}-{args.mode}.npz"
        print(json.dumps(run(args.mode, args.diagnostic, args.dir, arrays)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        sys.path.insert(0, str(ROOT))
        chosen = ("interference", "linearity") if args.diagnostic == "both" else (args.diagnostic,)
        if "interference" in chosen:
            size = _interference_benchmark().build(directory, args.layers, args.hidden)
            print(f"interference model: {args.layers} layers, hidden {args.hidden}, {size['matrices']} matrices, "
                  f"{size['params'] / 1e6:.1f} M parameters; 3 fine-tunes")
        if "linearity" in chosen:
            print(_build_linearity(directory, args.linearity_layers, args.linearity_hidden))
        for diagnostic in chosen:
            _compare(diagnostic, directory)


if __name__ == "__main__":
    main()

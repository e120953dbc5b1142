"""Benchmark: each data-driven command in base-forward units, its FLOPs, achieved GFLOP/s, and where its time goes.

The unit. A base forward is the base model's forward over the same records the command reads — every task's
records, through the engine the commands themselves run (`submerge.diagnostics.capture.model_outputs`: block by
block in the compute dtype, the base's own weights, the final norm, no output head). It is timed before the
commands (after one untimed warm-up forward: the first forward of a process pays one-time costs) and again after
them, in the same process; a command's cost is its wall divided by the mean of the two. The same ratio is also given
in this process's CPU time ("in CPU"): on a VM whose host takes CPU time away (steal, printed as a share of the
run), walls stretch with the host's load and CPU times much less, so the CPU ratio is the one to compare between
runs there.
The records are batched as tokenised (file order, 8 per batch, each batch padded to its longest): the plain forward
a user would run. Since stop 48 linearity, projection and alpha regroup the records by length (less padding), so
the same forward over the regrouped records is timed too, and each cost is also given in that unit ("regrouped").
The machine is shared: the two forwards, and a float32 matmul timed before and after as the machine's peak, show
how the load moved during the run (the 1-minute load average is printed with them).

The commands, through their Python API on one loaded `Experiment`, each writing its store group (temporary store):

    linearity     nonlinearity(levels model, layer, attn, mlp; N = 10)          (diag linearity)
    linearity-plain  the same with plain_replay=True: every point k = 0..N replayed on its own θ0 + (k/N)τ (the
                  straightforward path, the arithmetic before the shared replay: its "before" in the same run)
    projection    projection(levels model, layer, attn, mlp; seed 002's α grids)  (diag projection)
    alpha         alpha(granularity attn-mlp)                                     (diag alpha)
    eval          held-out loss of the base, the T fine-tunes and their task-arithmetic merge, each θ0 + Σ c τ run
                  block by block with the output head (`streamed_losses`, diag eval's arithmetic)
    compare-eval  one candidate of diag compare: θ0 + Σ_t τ_t on the same records (`streamed_losses`)

(eval and compare-eval read the held-out records after the ones the others read, as many and as long.)

Per command: the wall; FLOPs counted by `torch.utils.flop_counter.FlopCounterMode` over a second run (matrix
products and attention; norms, activations and the metric arithmetic are not counted); achieved GFLOP/s = FLOPs /
wall, and that as a share of the measured matmul peak; and (``--profile``) a third run under cProfile, its time
grouped by what each function is for:

    matmuls                 the matrix-product kernels (linear, matmul, bmm, attention), wherever called
    variant parameters      building θ0 + Σ c τ and reading τ (ParameterSource, TaskVectorReader, safetensors)
    capture                 recording the inputs on the base (hooks, the partial forwards' bookkeeping)
    module ops              the other kernels of module forwards (norms, activations, rotary, softmax, adds)
    per-module Python       Python time in torch.nn / transformers / functional_call frames
    features and metrics    per-sample features and the equations (sample_features, equations.py, projections)
    store writes            zarr / xarray / the UnitWriter
    other                   everything else

A builtin (a kernel) counts for the category of the Python function that called it (cProfile's caller split),
except the matrix products, which always count as matmuls.

Kits: ``demo`` (SmolLM2-135M and its three LoRA adapters), ``demo-full`` (its full fine-tunes,
`submerge.diagnostics.demo.demo_full_finetunes`), ``slice1`` / ``slice2`` (the Llama-2-7B-shaped 1- and 2-block
checkpoints of ``benchmarks/scale.py``, float16, three dense fine-tunes). Defaults: 8 records × 128 tokens per task on
the demo kits (the issue's reference point), 2 × 64 on the slices (scale.py's).

    python benchmarks/cost.py [--kits demo,demo-full,slice1,slice2] [--commands linearity,projection,alpha,eval,
        compare-eval] [--samples N] [--max-tokens N] [--profile [COMMANDS]] [--alphas 0.5,1] [--no-flops]
        [--threads N] [--keep DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMMANDS = ("linearity", "linearity-plain", "projection", "alpha", "eval", "compare-eval")
LEVELS = ("model", "layer", "attn", "mlp")
MATMULS = ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "scaled_dot_product_attention", "einsum")
CATEGORIES = ("matmuls", "variant parameters", "capture", "module ops", "per-module Python", "features and metrics",
              "store writes", "other")


# --------------------------------------------------------------------------- kits


def load_kit(kit: str, samples: int, max_tokens: int, scratch: Path):
    """(Experiment, held-out batches for the evaluations, description) of a kit."""
    from submerge.diagnostics.data import read_task_file, tokenize
    from submerge.diagnostics.demo import demo_adapters, ensure_demo_base, ensure_demo_data
    from submerge.diagnostics.experiment import Experiment

    data = {task: str(path) for task, path in ensure_demo_data().items()}
    if kit in ("demo", "demo-full"):
        base = str(ensure_demo_base())
        finetunes = demo_adapters() if kit == "demo" else _full_finetunes()
        dtype, about = "auto", f"SmolLM2-135M + {'LoRA adapters' if kit == 'demo' else 'full fine-tunes'}"
    else:
        layers = int(kit.removeprefix("slice"))
        paths = _slice(layers, scratch)
        base, finetunes = str(paths["base"]), {task: paths[task] for task in ("math", "code", "trivia")}
        dtype, about = "float16", f"Llama-2-7B-shaped slice, {layers} block(s), float16, dense fine-tunes"
    finetunes = {task: str(path) for task, path in finetunes.items()}
    data = {task: data[task] for task in finetunes}
    experiment = Experiment.load(base, finetunes, data, samples=samples, max_tokens=max_tokens, dtype=dtype)
    held_out = {task: tokenize(read_task_file(task, path, samples=samples, skip=samples), experiment.base.tokenizer,
                               max_tokens=max_tokens) for task, path in data.items()}
    tokens = sum(int(b.attention_mask.sum()) for batches in experiment.batches.values() for b in batches)
    return experiment, held_out, (f"{about}; {len(finetunes)} tasks × {samples} records × ≤ {max_tokens} tokens "
                                  f"({tokens} real tokens)")


def _full_finetunes() -> dict[str, Path]:
    """The demo base's full fine-tunes that exist so far (`demo_full_finetunes` wants all three; they are trained
    one after another), at least one."""
    from submerge.diagnostics.demo import DemoKitUnavailable, demo_full_finetunes, full_finetunes_dir

    try:
        return demo_full_finetunes()
    except DemoKitUnavailable:
        found = {folder.name: folder for folder in sorted(full_finetunes_dir().iterdir())
                 if (folder / "model.safetensors").is_file()} if full_finetunes_dir().is_dir() else {}
        if not found:
            raise
        return found


def _slice(layers: int, scratch: Path) -> dict[str, Path]:
    """benchmarks/scale.py's slice with `layers` blocks (built once per scratch folder, in a fresh process)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # a spawned process finds `scale` by its name too
    import scale

    from submerge.diagnostics.demo import ensure_demo_base

    work = scratch / f"L{layers}"
    built = work / "built.json"
    if not built.exists():
        paths = scale.in_fresh_process(scale.build_slice, work, layers, Path(ensure_demo_base()))
        built.write_text(json.dumps({name: str(path) for name, path in paths.items()}))
    return {name: Path(path) for name, path in json.loads(built.read_text()).items()}


# --------------------------------------------------------------------------- what is measured


def base_forward(experiment) -> None:
    """The unit: the base's forward over every task's records, block by block in the compute dtype."""
    from submerge.diagnostics.capture import model_outputs, no_tf32

    source = experiment.parameter_source()
    batches = [batch for task in experiment.tasks for batch in experiment.batches[task]]
    with no_tf32():
        model_outputs(source, experiment.arch, batches, [{}], output="hidden")
    source.clear()


def command_runner(name: str, experiment, held_out: dict, store_dir: Path, alphas=None, floor_samples=None):
    """A no-argument function that runs command `name` once (each call writes its group afresh)."""
    from submerge.diagnostics.evaluate import streamed_losses
    from submerge.diagnostics.linearity import alpha, nonlinearity, projection
    from submerge.diagnostics.store import Store

    store = Store(store_dir / "cost.zarr")
    tasks = experiment.tasks
    options = {"store": store, "force": True, "progress": False}
    if name in ("linearity", "linearity-plain"):
        plain = name == "linearity-plain"
        floor = {} if floor_samples is None else {"floor_samples": floor_samples}  # None: the command's default
        return lambda: nonlinearity(experiment, levels=LEVELS, steps=10, plain_replay=plain, **floor, **options)
    if name == "projection":
        return lambda: projection(experiment, levels=LEVELS, alphas=alphas, **options)
    if name == "alpha":
        return lambda: alpha(experiment, granularity="attn-mlp", **options)

    def losses(variants):
        source = experiment.parameter_source()
        for variant in variants:
            streamed_losses(source, experiment.arch, held_out, variant)

    if name == "eval":  # base, each fine-tune, the task-arithmetic merge
        variants = [{}, *({task: 1.0} for task in tasks), {task: 1.0 for task in tasks}]
        return lambda: losses(variants)
    if name == "compare-eval":
        return lambda: losses([{task: 1.0 for task in tasks}])
    raise ValueError(f"unknown command {name!r} (choose from {', '.join(COMMANDS)})")


def timed(function) -> float:
    """Wall seconds of one call."""
    return clocked(function)[0]


def clocked(function) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call. On a VM whose host takes CPU time away (steal), the
    wall stretches and the CPU time does not: the CPU time of the command over that of the base forward is the
    ratio a loaded host disturbs least."""
    wall, cpu = time.perf_counter(), time.process_time()
    function()
    return time.perf_counter() - wall, time.process_time() - cpu


def cpu_ticks() -> tuple[int, int]:
    """(all ticks, steal ticks) of every CPU since boot, from /proc/stat ((0, 0) where there is none)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def matmul_peak(size: int = 2048, repeats: int = 3) -> float:
    """This machine's float32 matmul rate now, GFLOP/s: the best of `repeats` products of two size² matrices."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = min(timed(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def counted_flops(function) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        function()
    return float(counter.get_total_flops())


def profile(function) -> dict[str, float]:
    """Seconds per category (CATEGORIES) of one run of `function` under cProfile."""
    profiler = cProfile.Profile()
    profiler.enable()
    function()
    profiler.disable()
    return breakdown(pstats.Stats(profiler))


def breakdown(stats: pstats.Stats) -> dict[str, float]:
    """Own time of every function by category; a builtin's time goes to its callers' categories in proportion."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for function, (_, _, own, _, callers) in stats.stats.items():
        if not _is_builtin(function):
            seconds[category(function)] += own
            continue
        if _is_matmul(function):
            seconds["matmuls"] += own
            continue
        split = {caller: timing[2] for caller, timing in callers.items()}
        total = sum(split.values())
        if total <= 0:
            seconds["other"] += own
            continue
        for caller, share in split.items():
            kind = category(caller)
            seconds["module ops" if kind == "per-module Python" else kind] += own * share / total
    return seconds


def _is_builtin(function) -> bool:
    return function[0] == "~" or function[1] == 0


def _is_matmul(function) -> bool:
    """cProfile names builtins "<built-in method torch._C._nn.linear>" or "<method 'matmul' of '...' objects>"."""
    name = function[2]
    if name.startswith("<method '"):
        name = name.split("'")[1]
    elif name.startswith("<built-in method "):
        name = name.removeprefix("<built-in method ").split(" ")[0].rstrip(">").split(".")[-1]
    return name in MATMULS


def category(function) -> str:
    """The category of a Python function (file, line, name)."""
    path, _, name = function
    path = path.replace("\\", "/")
    if "/diagnostics/store.py" in path or "/zarr/" in path or "/xarray/" in path or "/numcodecs/" in path:
        return "store writes"
    if any(part in path for part in ("/diagnostics/checkpoints.py", "/diagnostics/task_vectors.py", "/diagnostics/placement.py", "/safetensors/")) or (
            "/diagnostics/capture.py" in path and name in ("variant", "deltas", "base_parameters", "upcast_buffers",
                                                           "changed", "clear", "upcast", "_placed", "_widened",
                                                           "_pooled_variant", "_form", "_scratch", "_own_on_device",
                                                           "_loaded_as_stored", "token_rows")):
        return "variant parameters"
    if "/diagnostics/capture.py" in path and name in ("record_inputs", "_partial_forward", "register", "keep",
                                                      "_call_backbone", "block_kwargs", "_skipped_blocks"):
        return "capture"
    if "/diagnostics/replay.py" in path and name == "_line_terms":
        return "variant parameters"
    if "/diagnostics/linearity/" in path or ("/diagnostics/capture.py" in path and name == "sample_features") or \
            ("/diagnostics/replay.py" in path and name in ("features", "per_sample", "sample_indices", "minus")) or \
            "/diagnostics/evaluate.py" in path and name in ("summed_token_loss",):
        return "features and metrics"
    if any(part in path for part in ("/torch/nn/", "/transformers/", "/torch/_functorch/", "/torch/func",
                                     "/torch/utils/hooks")) or "/diagnostics/capture.py" in path or \
            "/diagnostics/replay.py" in path:
        return "per-module Python"
    return "other"


# --------------------------------------------------------------------------- one kit


def run_kit(kit: str, args, scratch: Path) -> dict:
    import torch

    experiment, held_out, about = load_kit(kit, args.samples_for(kit), args.tokens_for(kit), scratch)
    print(f"\n== {kit}: {about}; torch threads {torch.get_num_threads()}", flush=True)
    regrouped_experiment = experiment.regrouped()
    base_forward(experiment)  # warm-up: the first forward of a process pays one-time costs (allocator, threads)
    ticks = [cpu_ticks()]
    forward_clock = [clocked(lambda: base_forward(experiment))]
    regrouped = [timed(lambda: base_forward(regrouped_experiment))]
    peak = [matmul_peak()]
    load = [os.getloadavg()[0]]
    forward_flops = counted_flops(lambda: base_forward(experiment))
    results = {}
    with tempfile.TemporaryDirectory(dir=scratch) as store_dir:
        for name in args.commands:
            run = command_runner(name, experiment, held_out, Path(store_dir), args.alphas, args.floor_samples)
            wall, cpu = clocked(run)
            entry = {"wall_s": wall, "cpu_s": cpu}
            if name == "projection":
                entry["alphas"] = args.alphas or "seed 002's grids"
            if args.flops:
                entry["flops"] = counted_flops(run)
            if name in args.profile:
                entry["profile_s"] = profile(run)
            results[name] = entry
            print(f"  {name:<13} {entry['wall_s']:8.1f} s", flush=True)
    forward_clock.append(clocked(lambda: base_forward(experiment)))
    ticks.append(cpu_ticks())
    regrouped.append(timed(lambda: base_forward(regrouped_experiment)))
    peak.append(matmul_peak())
    load.append(os.getloadavg()[0])
    forward, forward_cpu = [wall for wall, _ in forward_clock], [cpu for _, cpu in forward_clock]
    unit, cpu_unit = sum(forward) / 2, sum(forward_cpu) / 2
    all_ticks, steal_ticks = (after - before for after, before in zip(ticks[1], ticks[0]))
    for entry in results.values():
        entry["base_forwards"] = entry["wall_s"] / unit
        entry["base_forwards_cpu"] = entry["cpu_s"] / cpu_unit
        entry["regrouped_forwards"] = entry["wall_s"] / (sum(regrouped) / 2)
        if "flops" in entry:
            entry["gflops_per_s"] = entry["flops"] / entry["wall_s"] / 1e9
            entry["share_of_peak"] = entry["gflops_per_s"] / max(peak)
    return {"about": about, "forward_s": forward, "forward_cpu_s": forward_cpu, "regrouped_forward_s": regrouped,
            "forward_gflop": forward_flops / 1e9, "peak_gflops_per_s": peak, "load_1min": load,
            "steal_share": steal_ticks / all_ticks if all_ticks else None, "commands": results}


def report(kit: str, measured: dict) -> None:
    forward, peak, load = measured["forward_s"], measured["peak_gflops_per_s"], measured["load_1min"]
    print(f"\n{kit}: {measured['about']}")
    print(f"base forward {forward[0]:.2f} s before, {forward[1]:.2f} s after ({measured['forward_gflop']:.1f} GFLOP); "
          f"matmul peak {peak[0]:.0f} / {peak[1]:.0f} GFLOP/s; load average {load[0]:.1f} / {load[1]:.1f}")
    cpu, steal = measured.get("forward_cpu_s"), measured.get("steal_share")
    if cpu:
        print(f"the base forward's CPU time {cpu[0]:.2f} s before, {cpu[1]:.2f} s after"
              + (f"; the host took {steal:.0%} of this VM's CPU time meanwhile (steal)" if steal is not None else ""))
    regrouped = measured["regrouped_forward_s"]
    print(f"the same forward on the records regrouped by length (Experiment.regrouped, as linearity, projection and "
          f"alpha read them): {regrouped[0]:.2f} s before, {regrouped[1]:.2f} s after")
    print(f"{'command':<14}{'wall s':>9}{'base fwd':>10}{'regrouped':>10}{'CPU s':>9}{'in CPU':>8}{'GFLOP':>10}"
          f"{'GFLOP/s':>9}{'of peak':>9}")
    for name, entry in measured["commands"].items():
        flops = entry.get("flops")
        print(f"{name:<14}{entry['wall_s']:>9.1f}{entry['base_forwards']:>10.1f}{entry['regrouped_forwards']:>10.1f}"
              f"{entry.get('cpu_s', float('nan')):>9.1f}{entry.get('base_forwards_cpu', float('nan')):>8.1f}"
              + (f"{flops / 1e9:>10.1f}{entry['gflops_per_s']:>9.1f}{entry['share_of_peak']:>9.1%}" if flops else "")
              + (f"   (α grid values {entry['alphas']})" if "alphas" in entry else ""))
    profiled = {name: entry["profile_s"] for name, entry in measured["commands"].items() if "profile_s" in entry}
    if profiled:
        print(f"\nprofile (cProfile run; share of its time){'':<4}" + "".join(f"{name:>13}" for name in profiled))
        for kind in CATEGORIES:
            print(f"  {kind:<42}" + "".join(f"{seconds[kind] / sum(seconds.values()):>13.1%}"
                                            for seconds in profiled.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kits", default="demo", help="Comma-separated: demo, demo-full, slice1, slice2.")
    parser.add_argument("--commands", default=",".join(COMMANDS))
    parser.add_argument("--samples", type=int, help="Records per task (default 8 on the demo kits, 2 on slices).")
    parser.add_argument("--max-tokens", type=int, help="Token limit (default 128 on the demo kits, 64 on slices).")
    parser.add_argument("--profile", nargs="?", const=",".join(COMMANDS), default="",
                        help="A cProfile run (a third run) of these commands (default when given bare: all).")
    parser.add_argument("--alphas", help="Projection's α grid values, comma-separated (default: seed 002's grids; "
                        "its cost grows with the number of α combinations).")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own).")
    parser.add_argument("--floor-samples", type=int, help="linearity's noise-floor samples per task (default: the "
                        "command's, 1; 0 measures the scores alone, as before the floor existed).")
    parser.add_argument("--no-flops", dest="flops", action="store_false", help="Skip the FLOP-counting run.")
    parser.add_argument("--keep", type=Path, help="Build the slices here and keep them (default: a temp dir).")
    parser.add_argument("--json", type=Path, help="Write every measurement to this JSON file.")
    args = parser.parse_args()
    args.commands = [name for name in args.commands.split(",") if name]
    args.profile = [name for name in args.profile.split(",") if name]
    args.alphas = None if args.alphas is None else [float(value) for value in args.alphas.split(",")]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    unknown = [name for name in args.commands if name not in COMMANDS]
    if unknown:
        parser.error(f"unknown command(s) {unknown}; choose from {', '.join(COMMANDS)}")
    args.samples_for = lambda kit: args.samples or (8 if kit.startswith("demo") else 2)
    args.tokens_for = lambda kit: args.max_tokens or (128 if kit.startswith("demo") else 64)
    scratch = args.keep or Path(tempfile.mkdtemp(prefix="cost_bench_", dir=str(Path.home())))
    scratch.mkdir(parents=True, exist_ok=True)
    measured = {}
    try:
        for kit in args.kits.split(","):
            measured[kit] = run_kit(kit, args, scratch)
            if args.json:
                args.json.write_text(json.dumps(measured, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    for kit, values in measured.items():
        report(kit, values)


if __name__ == "__main__":
    main()

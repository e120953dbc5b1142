"""Benchmark: streaming weight-space interference vs a pass that only reads the tensors.

Builds (offline) a random Llama checkpoint — 24 layers, hidden 256, vocabulary
2048 so that the embedding is ~0.7 of a layer as in Llama-2-7B — and three
synthetic fine-tunes (base + a random rank-8 update + small noise on every
tensor), all float32 safetensors in a temp dir.  Then, each in a fresh
subprocess so peak memory is its own:

- ``read``:          read every 2-D weight of the base and of each fine-tune once
                     (the same tensors the driver reads), nothing else;
- ``svd``:           the same reads plus the exact route's 2T + 1 bare SVDs per matrix
                     (T task matrices, T centred, the merged one) — that route's floor;
- ``exact``:         ``submerge.diagnostics.interference.interference(exact_svd=True)`` over all of them;
- ``interference``:  the same with its default route (Gram matrices, no full SVDs).

Printed: wall time, peak RSS (VmHWM) and peak anonymous RSS (RssAnon sampled
every 2 ms; file-backed pages of the memory-mapped safetensors are excluded —
the kernel can drop them at will) above the process's memory before the pass,
as ratios interference / read, next to the size of one decoder layer and of
the whole model: the driver's extra memory is a small constant times the
largest matrix, not the model.  (tracemalloc does not see torch's allocator,
so memory is read from /proc; both passes run with MALLOC_MMAP_THRESHOLD_ fixed
so that freed blocks go back to the OS and RssAnon tracks live memory.)

    python benchmarks/interference.py [--layers 24] [--hidden 256] [--svd-dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("math", "code", "chat")
# A fixed mmap threshold stops glibc from keeping freed blocks of up to 32 MiB in its heap (its
# dynamic threshold), so RssAnon follows the live tensors rather than the allocator's cache.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "262144"}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class AnonPeak:
    """Sample RssAnon in a thread; `peak` is the largest value seen (KiB)."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, _status_kib("RssAnon"), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_kib("RssAnon"))
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_kib("RssAnon"))


def build(directory: Path, layers: int, hidden: int, seed: int = 0) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from submerge.diagnostics.toy import perturbed_finetunes

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=2048, hidden_size=hidden, intermediate_size=int(hidden * 2.6875), num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory / "base", safe_serialization=True)
    base = load_file(str(directory / "base" / "model.safetensors"))
    perturbed_finetunes(directory / "base", TASKS, seed=seed + 1)
    params = {name: t.numel() for name, t in base.items()}
    layer0 = sum(n for name, n in params.items() if ".layers.0." in name)
    matrices = [t for t in base.values() if t.ndim == 2]
    return {
        "params": sum(params.values()), "layer_params": layer0,
        "largest_matrix": max(t.numel() for t in matrices), "matrices": len(matrices),
    }


def run_phase(phase: str, directory: Path, svd_dtype: str, threads: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import pandas  # noqa: F401  (imported before the baseline: the driver imports them lazily)
    import torch
    import xarray  # noqa: F401

    from submerge.diagnostics.checkpoints import open_checkpoint
    from submerge.diagnostics.interference import interference

    torch.set_num_threads(threads)
    base = open_checkpoint(str(directory / "base"))
    finetuned = {task: open_checkpoint(str(directory / task)) for task in TASKS}
    names = [n for n in base.names() if n.endswith(".weight") and len(base.shape(n)) == 2]
    before_rss, before_anon = _status_kib("VmRSS"), _status_kib("RssAnon")
    start, cpu_start = time.perf_counter(), time.process_time()
    checksum = 0.0
    with AnonPeak() as anon:
        if phase == "read":
            for name in names:  # every byte is touched (safetensors tensors are zero-copy mmap views)
                checksum += float(base.get(name, torch.float32).sum())
                for reader in finetuned.values():
                    checksum += float(reader.get(name, torch.float32).sum())
        elif phase == "svd":
            for name in names:  # the driver's 2T + 1 SVDs, no metrics: its floor
                base_weight = base.get(name, torch.float32)
                deltas = [reader.get(name, torch.float32) - base_weight for reader in finetuned.values()]
                mean = sum(deltas) / len(deltas)
                for matrix in [*deltas, *(d - mean for d in deltas), sum(deltas)]:
                    checksum += float(torch.linalg.svd(matrix, full_matrices=False)[1][0])
        else:
            dataset = interference(base, finetuned, svd_dtype=svd_dtype, device="cpu", progress=False,
                                   exact_svd=phase == "exact")
            checksum = float(dataset["sti_normalized"].mean())
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "wall_s": wall, "cpu_s": cpu, "peak_rss_mib": _status_kib("VmHWM") / 1024, "before_rss_mib": before_rss / 1024,
        "peak_anon_mib": anon.peak / 1024, "before_anon_mib": before_anon / 1024, "checksum": checksum,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--svd-dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 by default: MKL's multi-threaded SVD of small matrices is slow on a busy box)")
    parser.add_argument("--phase", choices=("read", "svd", "exact", "interference"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(run_phase(args.phase, args.dir, args.svd_dtype, args.threads)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        sizes = build(directory, args.layers, args.hidden)
        results = {}
        for phase in ("read", "svd", "exact", "interference"):
            out = subprocess.run(
                [sys.executable, __file__, "--phase", phase, "--dir", str(directory), "--svd-dtype", args.svd_dtype,
                 "--threads", str(args.threads)],
                check=False, capture_output=True, text=True, env={**os.environ, **MALLOC_ENV},
            )
            if out.returncode != 0:
                sys.exit(f"phase '{phase}' failed:\n{out.stderr}")
            results[phase] = json.loads(out.stdout.strip().splitlines()[-1])

    mib = 4 / 2**20  # float32 bytes per parameter → MiB
    model_mib, layer_mib = sizes["params"] * mib, sizes["layer_params"] * mib
    largest_mib = sizes["largest_matrix"] * mib
    print(f"model: {args.layers} layers, hidden {args.hidden}, {sizes['matrices']} 2-D matrices, "
          f"{len(TASKS)} fine-tunes, svd_dtype {args.svd_dtype}, {args.threads} torch thread(s), "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"sizes (float32): model {model_mib:.1f} MiB, one layer {layer_mib:.2f} MiB "
          f"(1/{model_mib / layer_mib:.0f} of the model), largest matrix {largest_mib:.2f} MiB; "
          f"all {1 + len(TASKS)} checkpoints {model_mib * (1 + len(TASKS)):.0f} MiB")
    print(f"memory from /proc with {' '.join(f'{k}={v}' for k, v in MALLOC_ENV.items())}")
    print(f"{'pass':<14}{'wall s':>9}{'CPU s':>8}{'peak RSS MiB':>14}{'Δ RSS MiB':>11}{'peak anon MiB':>15}{'Δ anon MiB':>12}")
    for phase, r in results.items():
        print(f"{phase:<14}{r['wall_s']:>9.2f}{r['cpu_s']:>8.2f}{r['peak_rss_mib']:>14.1f}{r['peak_rss_mib'] - r['before_rss_mib']:>11.1f}"
              f"{r['peak_anon_mib']:>15.1f}{r['peak_anon_mib'] - r['before_anon_mib']:>12.1f}")
    read, svd, full = results["read"], results["svd"], results["interference"]
    extra_anon = full["peak_anon_mib"] - full["before_anon_mib"]
    print(f"ratios interference / read: wall {full['wall_s'] / read['wall_s']:.1f}x, "
          f"peak RSS {full['peak_rss_mib'] / read['peak_rss_mib']:.2f}x, "
          f"peak anon {full['peak_anon_mib'] / read['peak_anon_mib']:.2f}x")
    svd_anon = svd["peak_anon_mib"] - svd["before_anon_mib"]
    print(f"ratios interference / bare SVDs: wall {full['wall_s'] / svd['wall_s']:.2f}x, "
          f"CPU {full['cpu_s'] / svd['cpu_s']:.2f}x, extra anon {extra_anon / svd_anon:.2f}x")
    exact = results["exact"]
    print(f"ratios interference (Gram route) / exact_svd=True: wall {full['wall_s'] / exact['wall_s']:.2f}x, "
          f"CPU {full['cpu_s'] / exact['cpu_s']:.2f}x, peak anon {full['peak_anon_mib'] / exact['peak_anon_mib']:.2f}x")
    print(f"interference extra anonymous memory: {extra_anon:.1f} MiB = {extra_anon / layer_mib:.1f} layers "
          f"= {extra_anon / largest_mib:.1f} x the largest matrix = {extra_anon / model_mib:.2f} of one model")
    print(f"per matrix: {full['wall_s'] / sizes['matrices'] * 1000:.0f} ms wall, "
          f"{full['cpu_s'] / sizes['matrices'] * 1000:.0f} ms CPU (2T + 1 = {2 * len(TASKS) + 1} Gram "
          f"eigendecompositions each)")


if __name__ == "__main__":
    main()

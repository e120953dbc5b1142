"""Benchmark: layer-level Non-linearity Scores by capture/replay vs. the naive full-forward way.

Builds (offline, in a temp dir) a toy Llama — by default 12 layers, hidden 256, 8 heads (4 k/v) —
and one synthetic fine-tune of it (a few Adam steps on the "math" task text, `submerge.diagnostics.toy`),
plus 8 task records of ~128 byte-tokens. Then, on the same loaded base model:

- replay: ``nonlinearity(experiment, levels=("layer",), steps=N)`` — the inputs of every block are
  recorded once on the base, and each block is replayed on θ0^i + (k/N)τ^i, k = 0..N;
- naive:  for every layer i and step k, that block's weights are set to θ0^i + (k/N)τ^i
  (``load_state_dict``; the rest of the model stays θ0), the whole model runs forward, and the
  block's output is taken by a forward hook; then Eq. 19 (seed 002) on the same features
  (block output on one sequence, real tokens only, flattened).

Printed: the largest absolute difference between the two sets of scores (must be ≤ 1e-5), the wall
and process CPU times of both and the speed-up naive / replay, from one run of each. Expect about
`layers`x: the naive way runs L·(N+1) full forwards, replay one recording forward plus L·(N+1)
single-block replays (≈ N+1 forwards).

    python benchmarks/linearity_replay.py [--layers 12] [--hidden 256] [--samples 8] [--tokens 128]
                                          [--steps 10] [--dtype float64] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = "math"
TOLERANCE = 1e-5


def build(directory: Path, layers: int, hidden: int, samples: int) -> tuple[Path, Path, Path]:
    """Base model, one synthetic fine-tune and a task file whose records are ~128 tokens or longer."""
    from submerge.diagnostics import toy

    base = toy.build_model(directory / "base", "llama", layers=layers, hidden=hidden, heads=8, kv_heads=4)
    finetuned = toy.finetune(base, directory / TASK, TASK, steps=5)
    texts = toy.task_texts(TASK, 5 * samples, seed=7)
    data = directory / f"{TASK}.jsonl"
    with open(data, "w") as handle:
        for s in range(samples):  # 3 or 4 questions (~120 or ~160 bytes): some records pad, some truncate
            count = 3 + s % 2
            handle.write(json.dumps({"text": " ".join(texts[5 * s:5 * s + count])}) + "\n")
    return base, finetuned, data


def naive_scores(experiment, steps: int):
    """scores[layer][record index] by full forwards with one block interpolated at a time (seed 002 Eq. 19)."""
    import torch
    from safetensors.torch import load_file

    from submerge.diagnostics.capture import first_output
    from submerge.diagnostics.linearity import nonlinearity_score

    model, arch = experiment.base.model, experiment.arch
    dtype = next(model.parameters()).dtype
    base_file = load_file(Path(experiment.base.reader.path) / "model.safetensors")
    tuned_file = load_file(Path(experiment.task_vectors[TASK].finetuned.path) / "model.safetensors")
    scores = {}
    for layer in range(arch.num_layers):
        block = model.get_submodule(arch.layer_path(layer))
        prefix = arch.layer_path(layer) + "."
        base_state = {name: value.clone() for name, value in block.state_dict().items()}
        deltas = {name: (tuned_file[prefix + name] - base_file[prefix + name]).to(dtype) for name in base_state}
        seen = {}
        handle = block.register_forward_hook(
            lambda module, args, output, seen=seen: seen.__setitem__("out", first_output(output)))
        rows = {}
        try:
            for k in range(steps + 1):
                block.load_state_dict({name: base_state[name] + (k / steps) * deltas[name] for name in base_state})
                for batch in experiment.batches[TASK]:
                    with torch.no_grad():
                        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
                    mask = batch.attention_mask.bool()
                    for i, index in enumerate(batch.sample_index):
                        rows.setdefault(index, []).append(seen["out"][i][mask[i]].reshape(-1).to(torch.float64))
        finally:
            handle.remove()
            block.load_state_dict(base_state)
        scores[layer] = {index: nonlinearity_score(torch.stack(trajectory)) for index, trajectory in rows.items()}
    return scores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch

    from submerge.diagnostics.experiment import Experiment
    from submerge.diagnostics.linearity import nonlinearity

    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        base, finetuned, data = build(Path(tmp), args.layers, args.hidden, args.samples)
        experiment = Experiment.load(str(base), {TASK: str(finetuned)}, {TASK: str(data)}, samples=args.samples,
                                     max_tokens=args.tokens, batch_size=args.samples, dtype=args.dtype,
                                     device="cpu")
        tokens = experiment.batches[TASK][0].attention_mask.sum(dim=1).tolist()
        print(f"model: toy Llama, {args.layers} layers, hidden {args.hidden}, "
              f"{sum(p.numel() for p in experiment.base.model.parameters()) / 1e6:.1f} M parameters, {args.dtype}, "
              f"CPU, {torch.get_num_threads()} threads")
        print(f"data:  {args.samples} samples, real tokens per sample {tokens}; N = {args.steps} steps")

        start, cpu_start = time.perf_counter(), time.process_time()
        replayed = nonlinearity(experiment, levels=("layer",), steps=args.steps, progress=False)
        replay_seconds, replay_cpu = time.perf_counter() - start, time.process_time() - cpu_start

        start, cpu_start = time.perf_counter(), time.process_time()
        naive = naive_scores(experiment, args.steps)
        naive_seconds, naive_cpu = time.perf_counter() - start, time.process_time() - cpu_start

    samples = list(replayed.sample.values)
    difference = 0.0
    print(f"\n{'layer':>6} {'replay (mean NL)':>18} {'naive (mean NL)':>18} {'max |diff|':>12}")
    for layer in range(args.layers):
        ours = replayed.nonlinearity_score.sel(task=TASK, module=f"layers.{layer}").values
        theirs = np.array([naive[layer][index] for index in samples])
        gap = float(np.max(np.abs(ours - theirs)))
        difference = max(difference, gap)
        print(f"{layer:>6} {ours.mean():>18.6e} {theirs.mean():>18.6e} {gap:>12.2e}")
    print(f"\nmax |score difference| over {args.layers} layers x {len(samples)} samples: {difference:.3e} "
          f"({args.dtype}; must be <= {TOLERANCE:g})")
    print(f"{'':38s} {'wall':>9s} {'CPU time':>9s}")
    print(f"{'replay (capture once, replay blocks)':38s} {replay_seconds:8.2f}s {replay_cpu:8.2f}s")
    print(f"{'naive (full forward per layer/step)':38s} {naive_seconds:8.2f}s {naive_cpu:8.2f}s")
    print(f"speed-up naive / replay: {naive_seconds / replay_seconds:.1f}x wall, {naive_cpu / replay_cpu:.1f}x CPU time "
          "(one run each; CPU time is the process's, less disturbed by other load on the machine)")
    return 0 if difference <= TOLERANCE else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark: the evidence step with each fold's merges replayed on that fold's records only and θ0's outputs from
the capture (since stop 51) against every merge replayed on every record and θ0 replayed (before), on the demo kit's
real fine-tunes.

The evidence step (`diag compare`'s plan, `diag plan --choose evidence`) scores, per block, candidate c and fold k,
the block merged with what was fitted on the other folds (α, RegMean's Grams) on fold k's records. Before stop 51
each of those merges replayed the block on every fit record of every task and kept fold k's: at 4 folds and the
plan's three candidates (layer, attn-mlp, regmean), 12 replays of the fit records per block where 3 suffice. Now the
sweep cuts each task's batches within folds (`Experiment.regrouped(folds=k)`) and a fold's merges replay only its
batches (`evidence._merged_features(samples=)`). And the block data (each unit's outputs on θ0 and on each
fine-tune, per task) takes θ0's from the capture, which keeps them (`evidence._captured_base`), instead of replaying
the base: one replay of T + 1 fewer per unit and task. And RegMean's solves (a Cholesky per map and fold) run
scipy's LAPACK on one thread below order 1,024 (`spectral.scipy_threads`): its OpenBLAS pool and torch's OpenMP
pool, on the same cores, waited on each other.

Both ways on the same blocks, in one process, alternating which goes first per repeat: "before" is the code before
this change (batches cut across folds, every merge on every record, θ0's unit outputs replayed rather than taken
from the capture, scipy on the threads set outside), restored by patching what does each.
Printed: each way's wall, their ratio, the largest relative difference of the fold objectives (the batches differ,
so float rounding), and whether every block chooses the same candidate (lowest mean over folds).

    python benchmarks/evidence_folds.py [--layers 0-5] [--tasks math,code,trivia] [--lora] [--repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _layers(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0-5", help="blocks to measure, FIRST-LAST (default 0-5)")
    parser.add_argument("--tasks", default="math,code,trivia", help="comma-separated demo tasks")
    parser.add_argument("--fit", type=int, default=8, help="fit records per task (compare's default 8)")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per record (compare's default 512)")
    parser.add_argument("--folds", type=int, default=4)
    parser.add_argument("--lora", action="store_true", help="the LoRA adapters even where full fine-tunes exist")
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs (alternating which way goes first)")
    args = parser.parse_args()

    import numpy as np
    import torch

    from submerge.diagnostics import spectral
    from submerge.diagnostics.demo import demo_finetunes, ensure_demo_base, ensure_demo_data
    from submerge.diagnostics.experiment import Experiment
    from submerge.merge.plan import PLAN_CANDIDATES, candidate_merge

    evidence_module = importlib.import_module("submerge.diagnostics.linearity.evidence")
    tasks = args.tasks.split(",")
    base = str(ensure_demo_base())
    finetuned, kit = demo_finetunes(args.lora)
    finetuned = {task: str(finetuned[task]) for task in tasks}
    data = ensure_demo_data()
    experiment = Experiment.load(base, finetuned, {task: str(data[task]) for task in tasks}, samples=args.fit,
                                 max_tokens=args.max_tokens, batch_size=8)
    merge = candidate_merge(experiment, finetuned, block_rules=("regmean",))
    layers = _layers(args.layers)
    print(f"SmolLM2-135M + {kit}, tasks {', '.join(tasks)}, {args.fit} fit records × ≤ {args.max_tokens} tokens, "
          f"{args.folds} folds, candidates {', '.join(PLAN_CANDIDATES)}, blocks {args.layers}; torch threads "
          f"{torch.get_num_threads()}", flush=True)

    @contextlib.contextmanager
    def before():
        regrouped, merged_features = Experiment.regrouped, evidence_module._merged_features
        captured_base, one_thread_below = evidence_module._captured_base, spectral.ONE_THREAD_BELOW
        Experiment.regrouped = lambda self, overhead=None, folds=None: regrouped(self, overhead)
        evidence_module._merged_features = lambda layer, delta, table, tasks, samples=None: merged_features(
            layer, delta, table, tasks)
        evidence_module._captured_base = lambda layer, path, task: None
        spectral.ONE_THREAD_BELOW = 0  # scipy's LAPACK on the threads set outside, whatever the order
        try:
            yield
        finally:
            Experiment.regrouped, evidence_module._merged_features = regrouped, merged_features
            evidence_module._captured_base, spectral.ONE_THREAD_BELOW = captured_base, one_thread_below

    results, walls = {}, {"before": [], "each fold's records": []}
    for repeat in range(args.repeats):
        ways = list(walls) if repeat % 2 == 0 else list(walls)[::-1]
        for way in ways:
            with before() if way == "before" else contextlib.nullcontext():
                start = time.perf_counter()
                results[way] = evidence_module.evidence(experiment, merge, candidates=PLAN_CANDIDATES,
                                                        folds=args.folds, layers=layers, progress=False)
                walls[way].append(time.perf_counter() - start)
            print(f"  {way}: {walls[way][-1]:.1f} s", flush=True)
    old, new = results["before"]["fold_objective"].values, results["each fold's records"]["fold_objective"].values
    relative = float(np.max(np.abs(new - old) / np.maximum(np.abs(old), 1e-30)))
    chosen = [np.argmin(scores.mean(axis=1)) for scores in old], [np.argmin(scores.mean(axis=1)) for scores in new]
    best = {way: min(times) for way, times in walls.items()}
    print(f"before {best['before']:.1f} s, each fold's records {best[list(walls)[1]]:.1f} s (best of "
          f"{args.repeats}), ratio {best[list(walls)[1]] / best['before']:.2f}; fold objectives within "
          f"{relative:.1e} relative; every block chooses the same: {chosen[0] == chosen[1]}", flush=True)


if __name__ == "__main__":
    main()

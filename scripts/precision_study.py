"""Is the MLP more non-linear than attention? The Non-linearity Score per level in float32, float64 and bfloat16
compute, with noise floors, and a sweep over update scale (README section of that name; issue 24).

    python scripts/precision_study.py --out runs/precision        # small: 2 records, 128 tokens, niced by you

Writes ``levels.csv`` (kit, task, dtype, level, mean score, mean floor), ``scales.csv`` (scale, dtype, level, mean
score, mean floor) and ``scale_sweep.png``. The kits: the demo's LoRA adapters and the full fine-tunes that exist in
``~/.cache/submerge/full-finetunes-v1`` (`submerge.diagnostics.demo.full_finetunes_dir`). The update-scale sweep
replaces τ by s·τ (every variant θ0 + (k/N)·s·τ) on one full fine-tune.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from submerge.diagnostics import demo
from submerge.diagnostics.experiment import Experiment, HalfPrecisionWarning
from submerge.diagnostics.linearity.nonlinearity import nonlinearity
from submerge.diagnostics.task_vectors import TaskVectorReader

DTYPES = ("float32", "float64", "bfloat16")


class ScaledReader(TaskVectorReader):
    """A task-vector reader whose τ is multiplied by `scale`."""

    def __init__(self, reader: TaskVectorReader, scale: float):
        self.__dict__.update(reader.__dict__)
        self.scale = scale

    def get(self, checkpoint_name, dtype=torch.float32, device="cpu"):
        return super().get(checkpoint_name, dtype, device) * self.scale

    def reads_rows(self, checkpoint_name: str) -> bool:
        return False


def kits(tasks: list[str]) -> dict[str, tuple[str, dict[str, str], dict[str, str]]]:
    """The full fine-tunes of `tasks` that exist, then the demo's LoRA adapters of `tasks`."""
    base = str(demo.ensure_demo_base())
    data = {task: str(path) for task, path in demo.ensure_demo_data().items() if task in tasks}
    chosen = {}
    full = {task: str(demo.full_finetunes_dir() / task) for task in tasks
            if (demo.full_finetunes_dir() / task / "model.safetensors").is_file()}
    if full:
        chosen["full fine-tune"] = (base, full, {t: data[t] for t in full})
    chosen["demo LoRA"] = (base, {t: str(p) for t, p in demo.demo_adapters().items() if t in tasks}, data)
    return chosen


def level_means(dataset, kit: str, dtype: str, levels, exact=None, **extra) -> list[dict]:
    """Mean score per level and task; the floor |score − score₆₄| from `exact` (the float64 run of the same
    records: with one record per task it is the driver's floor), else the driver's."""
    rows = []
    labels = np.array([str(level) for level in dataset.level.values])
    for task in dataset.task.values:
        scores = dataset.nonlinearity_score.sel(task=task).values
        floors = (np.abs(scores - exact.nonlinearity_score.sel(task=task).values).max(axis=-1) if exact is not None
                  else dataset.nonlinearity_floor.sel(task=task).values)
        for level in levels:
            chosen = labels == level
            rows.append({"kit": kit, "task": str(task), "dtype": dtype, **extra, "level": level,
                         "score": float(np.nanmean(scores[chosen])),
                         "floor": float(np.nanmean(floors[chosen])) if np.isfinite(floors[chosen]).any() else np.nan})
    return rows


def load(kit, dtype: str, args) -> Experiment:
    base, finetuned, data = kit
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HalfPrecisionWarning)
        return Experiment.load(base, finetuned, data, samples=args.samples, max_tokens=args.max_tokens,
                               batch_size=args.samples, compute_dtype=dtype, device="cpu")


def run(experiment, args, floor_samples: int = 0):
    start = time.perf_counter()
    dataset = nonlinearity(experiment, levels=args.levels, steps=args.steps, floor_samples=floor_samples,
                           progress=False)
    return dataset, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/precision"))
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--levels", default="attn,mlp")
    parser.add_argument("--tasks", default="math")
    parser.add_argument("--scales", default="1,3,10,30")
    parser.add_argument("--skip-levels", action="store_true", help="only the update-scale sweep")
    args = parser.parse_args()
    args.levels = tuple(args.levels.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = kits(args.tasks.split(","))
    if not args.skip_levels:
        rows = []
        for name, kit in chosen.items():
            results = {}
            for dtype in ("float64", "float32", "bfloat16"):
                results[dtype], seconds = run(load(kit, dtype, args), args)
                rows += level_means(results[dtype], name, dtype, args.levels, exact=results["float64"],
                                    seconds=seconds)
                print(f"{name} {dtype}: {seconds:.0f} s", flush=True)
                pd.DataFrame(rows).to_csv(args.out / "levels.csv", index=False)
    name, kit = next(iter(chosen.items()))
    task = next(iter(kit[1]))
    kit = (kit[0], {task: kit[1][task]}, {task: kit[2][task]})
    rows = []
    for scale in [float(s) for s in args.scales.split(",")]:
        for dtype in ("float32", "bfloat16"):
            experiment = load(kit, dtype, args)
            experiment.task_vectors = {t: ScaledReader(r, scale) for t, r in experiment.task_vectors.items()}
            dataset, seconds = run(experiment, args, floor_samples=1)
            rows += level_means(dataset, name, dtype, args.levels, scale=scale, seconds=seconds)
            print(f"scale {scale:g} {dtype}: {seconds:.0f} s", flush=True)
            pd.DataFrame(rows).to_csv(args.out / "scales.csv", index=False)


if __name__ == "__main__":
    main()

"""Is the MLP more non-linear than attention? The Non-linearity Score per level in float32, float64 and bfloat16
compute, with noise floors, and a sweep over update scale (README section of that name; issue 24).

    python scripts/precision_study.py --out runs/precision        # small: 2 records, 128 tokens, niced by you

Writes ``levels.csv`` (kit, task, dtype, level, mean score, mean floor), ``scales.csv`` (scale, dtype, level, mean
score, mean floor) and ``scale_sweep.png``. The kits: the demo's LoRA adapters and the full fine-tunes that exist in
``~/.cache/submerge/full-finetunes-v2`` (`submerge.diagnostics.demo.full_finetunes_dir`). The update-scale sweep
replaces τ by s·τ (every variant θ0 + (k/N)·s·τ) on one full fine-tune.
"""

from __future__ import annotations

import argparse
import functools
import importlib
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


def plot_sweep(frame: pd.DataFrame, path: Path) -> None:
    """Mean score per level against the update scale, float32 (solid) and bfloat16 (dashed), the bfloat16 floor
    (|score − score in float32|) shaded: where the bfloat16 lines leave it and order the levels as float32 does."""
    from submerge.diagnostics import plot

    levels = list(dict.fromkeys(frame.level))
    with plot.styled() as (plt, sns):
        palette = dict(zip(levels, sns.color_palette("deep", len(levels))))
        fig, ax = plt.subplots(figsize=(8.5, 5), layout="constrained")
        for (level, dtype), part in frame.groupby(["level", "dtype"]):
            part = part.sort_values("scale")
            style = "-" if dtype == "float32" else "--"
            ax.plot(part.scale, part.score, style, marker="o", color=palette[level], label=f"{level} · {dtype}")
            if (part.floor > 0).all():
                ax.fill_between(part.scale, frame.score.min() / 10, part.floor, color=palette[level], alpha=0.15,
                                linewidth=0)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("update scale s (every variant θ0 + (k/N)·s·τ)")
        ax.set_ylabel("Non-linearity Score, mean over modules")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False, title="level · compute")
        plot.title(fig, "Non-linearity Score against update scale — shaded: bfloat16's rounding (|bf16 − fp32|)",
                   f"SmolLM2-135M · {frame.kit.iloc[0]} ({frame.task.iloc[0]})")
        plot.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/precision"))
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--levels", default="attn,mlp")
    parser.add_argument("--tasks", default="math")
    parser.add_argument("--layers", default="0,7,14,21,28", help="blocks measured (comma-separated; '' for all)")
    parser.add_argument("--scales", default="1,3,10,30")
    parser.add_argument("--skip-levels", action="store_true", help="only the update-scale sweep")
    parser.add_argument("--figure", type=Path, default=None, help="the sweep's figure (default: OUT/scale_sweep.png)")
    parser.add_argument("--plot-only", action="store_true", help="draw the figure from OUT/scales.csv")
    args = parser.parse_args()
    figure = args.figure or args.out / "scale_sweep.png"
    if args.plot_only:
        plot_sweep(pd.read_csv(args.out / "scales.csv"), figure)
        return
    args.levels = tuple(args.levels.split(","))
    if args.layers:  # only these blocks (the driver's sweep takes `layers`; its signature does not)
        driver = importlib.import_module("submerge.diagnostics.linearity.nonlinearity")
        driver.Sweep = functools.partial(driver.Sweep, layers=[int(n) for n in args.layers.split(",")])
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
        results = {}
        for dtype in ("float32", "bfloat16"):
            experiment = load(kit, dtype, args)
            experiment.task_vectors = {t: ScaledReader(r, scale) for t, r in experiment.task_vectors.items()}
            results[dtype], seconds = run(experiment, args)
            # floor of the bfloat16 run: |score − score in float32| (float32's own error is ~1e-4 of it)
            rows += level_means(results[dtype], name, dtype, args.levels, exact=results["float32"], scale=scale,
                                seconds=seconds)
            print(f"scale {scale:g} {dtype}: {seconds:.0f} s", flush=True)
            pd.DataFrame(rows).to_csv(args.out / "scales.csv", index=False)
    plot_sweep(pd.DataFrame(rows), figure)


if __name__ == "__main__":
    main()

"""`diag linearity`: the Non-linearity Score (seed 002 Eq. 19) per fine-tune, module and sample.

Owner of the store group ``linearity`` (`LINEARITY`): its layout, its summary table (seed 002 Table 17) and its
figures.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator, Sequence

import numpy as np
import pandas as pd
import xarray as xr

from submerge.diagnostics import plot
from submerge.diagnostics.execution import RunSettings
from submerge.diagnostics.groups import StoreGroup
from submerge.diagnostics.linearity.equations import mean_std, nonlinearity_scores_of_points
from submerge.diagnostics.linearity.floor import (
    FLOOR_NOTE,
    FLOOR_SAMPLES,
    first_records,
    flagged,
    floor_of,
    reference_run,
    wants_floor,
)
from submerge.diagnostics.linearity.sweep import Sweep
from submerge.diagnostics.modules import DEFAULT_LEVELS
from submerge.diagnostics.replay import Outputs, Unit, module_coords
from submerge.diagnostics.tables import long_frame, ordered, strings


def nonlinearity(
    experiment,
    *,
    levels: Sequence[str] = DEFAULT_LEVELS,
    steps: int = 10,
    model_output: str = "hidden",
    plain_replay: bool = False,
    floor_samples: int = FLOOR_SAMPLES,
    run: RunSettings | None = None,
    **run_options,
) -> xr.Dataset:
    """Non-linearity Score (seed 002 Eq. 19) of every fine-tune on its own task, per module and sample.

    Returns (and, with `store`, writes group ``linearity``) a Dataset with
    ``nonlinearity_score`` (task, module, sample), ``nonlinearity_floor`` (task, module) and ``unchanged``
    (task, module): modules the fine-tune left untouched score NaN and are flagged. ``sample`` is
    the record index in the task's file; ``level``, ``layer`` (−1 for the model)
    and ``head`` label ``module``. The floor is what rounding at the compute dtype contributes
    (`submerge.diagnostics.linearity.floor`): the largest |score − score in float64| over the first
    `floor_samples` records of the task (NaN when the compute dtype is float64 or `floor_samples` is 0).
    ``run`` (or its fields as keywords: ``store``, ``force``, ``progress``, ``command``, ``on_unit``,
    ``capture_budget``, ``compute_dtype``, ``engine``): `submerge.diagnostics.execution.RunSettings`; with a
    ``RayEngine`` the layers are measured by a pipeline of Ray workers, and this process alone writes the store.

    The points of a module's line θ0 + (k/N)τ are replayed together (`submerge.diagnostics.replay.replay_line`):
    k = 0 is the base output the capture kept, and the maps whose input every point shares are computed once per
    task. ``plain_replay`` replays every point k = 0..N on its own θ0 + (k/N)τ instead (the straightforward path:
    the reference the shared one is checked against; scores agree to rounding).
    """
    if steps < 1:
        raise ValueError("steps must be at least 1")
    run = RunSettings.of(run, **run_options)
    tasks = experiment.tasks
    settings = {"levels": list(levels), "steps": steps, "model_output": model_output, "floor_samples": floor_samples}
    coefficients = [k / steps for k in range(steps + 1)]
    sweep = Sweep(experiment, levels, LINEARITY.name, settings, run,  # every point moves one task: τ of one held
                  model_output=model_output, capture_outputs=not plain_replay, tasks_kept=1,
                  model_variants={task: [{task: a} for a in coefficients] for task in tasks}, regroup=True)
    positions = np.arange(experiment.settings["skip"], experiment.settings["skip"] + experiment.max_samples)
    position_of = {int(index): j for j, index in enumerate(positions)}

    def measure(unit: Unit) -> dict:
        """{module: (scores (task, sample), unchanged (task,))} of one unit."""
        scores = {m.name: np.full((len(tasks), len(positions)), np.nan) for m in unit.modules}
        unchanged = {m.name: np.zeros(len(tasks), dtype=bool) for m in unit.modules}
        for t, task in enumerate(tasks):
            if not unit.changed(task):
                for module in unit.modules:
                    unchanged[module.name][t] = True
                continue
            replayed = (unit.run(task, [{task: a} for a in coefficients]) if plain_replay
                        else unit.points(task, coefficients))
            for module in unit.modules:
                for indices, found in _scores_per_batch(replayed.of(module)):
                    scores[module.name][t, [position_of[index] for index in indices]] = found
            del replayed
        return {name: (scores[name], unchanged[name]) for name in scores}

    with run.engine.running():  # one Ray instance (when on Ray) for the floor's float64 pass and the sweep
        reference = _reference(experiment, sweep, floor_samples, levels=levels, steps=steps, model_output=model_output)
        sweep.run("Non-linearity Score", measure,
                  functools.partial(_piece, tasks=tasks, positions=positions, reference=reference))
    return sweep.writer.finish({"equation": "seed 002 Eq. 19", "summary": "mean ± std over modules and samples",
                                "nonlinearity_floor": FLOOR_NOTE},
                               result_attrs={"equation": "seed 002 Eq. 19", "steps": steps,
                                             "model_output": model_output,
                                             "features": "module output on one sequence, real tokens only, flattened"})


def _piece(modules, results: dict, *, tasks: list[str], positions: np.ndarray,
           reference: xr.Dataset | None) -> xr.Dataset:
    """One unit's rows of group ``linearity`` from `measure`'s results: the scores, the unchanged flags and the noise
    floor, each score's largest distance from its float64 `reference` over the records that has (NaN without one)."""
    array = np.stack([results[m.name][0] for m in modules], axis=1)
    flags = np.stack([results[m.name][1] for m in modules], axis=1)
    floor = np.full(flags.shape, np.nan)
    if reference is not None:
        position_of = {int(index): j for j, index in enumerate(positions)}
        chosen = [position_of[int(index)] for index in reference.sample.values]
        truth = reference.nonlinearity_score.sel(module=[m.name for m in modules]).transpose(
            "task", "module", "sample").values
        floor = floor_of(array[:, :, chosen], truth)
    return xr.Dataset(
        {"nonlinearity_score": (("task", "module", "sample"), array),
         "nonlinearity_floor": (("task", "module"), floor), "unchanged": (("task", "module"), flags)},
        coords={"task": np.array(tasks, dtype=object), "sample": positions, **module_coords(modules)},
    )


def _scores_per_batch(outputs: Outputs) -> Iterator[tuple[list[int], np.ndarray]]:
    """Per recorded batch, its records' indices and their Eq. 19 scores, every sequence of the batch at once from its
    points' outputs (`nonlinearity_scores_of_points`)."""
    for b, (mask, indices) in enumerate(zip(outputs.masks, outputs.indices)):
        yield indices, nonlinearity_scores_of_points([per_batch[b] for per_batch in outputs.values], mask)


def _reference(experiment, sweep: Sweep, floor_samples: int, **options) -> xr.Dataset | None:
    """The float64 scores of the first `floor_samples` records (None: no floor, or nothing left to measure)."""
    if not wants_floor(sweep.compute_dtype, floor_samples) or sweep.finished():
        return None
    subset = first_records(experiment, floor_samples)
    return nonlinearity(subset, floor_samples=0, run=reference_run(sweep.run_settings), **options)


def summary(dataset: xr.Dataset) -> pd.DataFrame:
    """Seed 002 Table 17: mean and std of the score per level (rows) and task (columns (task, "mean" | "std")),
    over the level's modules and the samples; NaN (modules a fine-tune left unchanged) skipped. Beside them
    (task, "floor"): the mean noise floor of the level's modules, and (task, "flag"): "⚠ k/n" when k of its n
    modules score (mean over samples) within 10× of their floor."""
    levels = strings(dataset.level.values)
    tasks = strings(dataset.task.values)
    scores = dataset.nonlinearity_score.transpose("task", "module", "sample").values
    floors = dataset.nonlinearity_floor.transpose("task", "module").values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN modules (left unchanged)
        module_means = np.nanmean(scores, axis=2)
    rows = {}
    for level in ordered(levels):
        chosen = np.array([label == level for label in levels])
        rows[level] = [value for t in range(len(tasks))
                       for value in (*mean_std(scores[t][chosen]), mean_std(floors[t][chosen])[0],
                                     flagged(module_means[t][chosen], floors[t][chosen]))]
    columns = pd.MultiIndex.from_product([tasks, ["mean", "std", "floor", "flag"]])
    return pd.DataFrame.from_dict(rows, orient="index", columns=columns).rename_axis("level")


def _scores(linearity: xr.Dataset) -> pd.DataFrame:
    frame = long_frame(linearity.nonlinearity_score).dropna(subset=["nonlinearity_score"])
    return frame[frame.nonlinearity_score > 0]


def nonlinearity_per_layer(linearity: xr.Dataset, about: str = ""):
    """Non-linearity Score per layer, one panel per level (layer / attn / mlp / head), one line per task.

    Line: median over samples (and heads); band: 25–75th percentile. Dashed lines: the
    model-level median of each task, for reference. Shaded from the bottom: the noise floor band (up to the
    layer's largest floor, per task): a line inside it is rounding at the compute dtype. Log scale.
    """
    frame = _scores(linearity)
    floors = long_frame(linearity.nonlinearity_floor).dropna(subset=["nonlinearity_floor"])
    tasks = strings(linearity.task.values)
    levels = [level for level in ordered(frame.level) if level != "model"]
    model = frame[frame.level == "model"].groupby("task").nonlinearity_score.median()
    panels = levels or ["model"]
    ncols = 2 if len(panels) == 4 else len(panels)
    nrows = -(-len(panels) // ncols)
    with plot.styled() as (plt, sns):
        palette = dict(zip(tasks, sns.color_palette("colorblind", len(tasks))))
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.4 * ncols + 1.6, 4.0 * nrows + 0.9),
                                 sharey=True, squeeze=False, layout="constrained")
        for ax, level in zip(axes.flat, panels):
            part = frame[frame.level == level]
            if not part.empty:
                sns.lineplot(part, x="layer", y="nonlinearity_score", hue="task", hue_order=tasks, palette=palette,
                             estimator="median", errorbar=("pi", 50), marker="o", markersize=5, ax=ax, legend=False)
                plot.integer_ticks(ax, part.layer)
            for task, value in model.items():
                ax.axhline(value, color=palette.get(task, "grey"), linestyle="--", linewidth=1.2)
            ax.set_yscale("log")
            _shade_floor(ax, floors[floors.level == level], palette)
            ax.set_title(f"{level}" + (" (all heads)" if level == "head" else ""))
            ax.set_xlabel("layer")
            ax.set_ylabel("Non-linearity Score (log)")
        handles = [plt.Line2D([], [], color=palette[t], marker="o", label=t) for t in tasks]
        if not floors.empty:
            handles.append(plt.Rectangle((0, 0), 1, 1, color="grey", alpha=0.25, label="noise floor (rounding)"))
        if not model.empty:
            handles.append(plt.Line2D([], [], color="grey", linestyle="--", label="model level"))
        fig.legend(handles=handles, title="fine-tune", loc="outside right upper", frameon=False)
        plot.title(fig, "Non-linearity Score per layer (seed 002 Eq. 19) — median and IQR over samples", about)
    return fig


def _shade_floor(ax, floors: pd.DataFrame, palette: dict) -> None:
    """Shade each task's noise floor per layer (its largest over the layer's modules) from the axes' bottom."""
    for task, part in floors[floors.nonlinearity_floor > 0].groupby("task"):
        per_layer = part.groupby("layer").nonlinearity_floor.max()
        ax.fill_between(per_layer.index, per_layer.min() / 10, per_layer.values, color=palette.get(task, "grey"),
                        alpha=0.18, linewidth=0, step="mid")


def nonlinearity_by_level(linearity: xr.Dataset, about: str = ""):
    """Distribution of the per-sample Non-linearity Score per level (box plot, log scale), hue = task."""
    frame = _scores(linearity)
    levels = ordered(frame.level)
    with plot.styled() as (plt, sns):
        fig, ax = plt.subplots(figsize=(2.0 * len(levels) + 3.5, 5), layout="constrained")
        sns.boxplot(frame, x="level", y="nonlinearity_score", hue="task", order=levels,
                    hue_order=strings(linearity.task.values), palette="colorblind", log_scale=True, fliersize=2, ax=ax)
        ax.set_xlabel("level (each box: all modules of the level × samples)")
        ax.set_ylabel("Non-linearity Score (log)")
        plot.legend_outside(ax, "fine-tune")
        plot.title(fig, "Non-linearity Score by level — attention vs MLP vs whole layer / model", about)
    return fig


LINEARITY = StoreGroup(
    name="linearity",
    dim="module",
    variables={"nonlinearity_score": ("task", "module", "sample"), "nonlinearity_floor": ("task", "module"),
               "unchanged": ("task", "module")},
    title="Non-linearity Score (seed 002 Eq. 19), mean ± std over modules and samples",
    summary=summary,
    figures={"nonlinearity_per_layer": nonlinearity_per_layer, "nonlinearity_by_level": nonlinearity_by_level},
)

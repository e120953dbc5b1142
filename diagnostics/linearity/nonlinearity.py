"""`diag linearity`: the Non-linearity Score (seed 002 Eq. 19) per fine-tune, module and sample."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xarray as xr

from submerge.diagnostics.execution import RunSettings
from submerge.diagnostics.linearity.equations import mean_std, nonlinearity_score
from submerge.diagnostics.linearity.sweep import Sweep
from submerge.diagnostics.modules import DEFAULT_LEVELS
from submerge.diagnostics.replay import Outputs, Unit, module_coords


def trajectories(outputs: Outputs):
    """(record index, trajectory (V, D) float64) per sample: row v is the sample's features under variant v."""
    for index, rows in zip(outputs.sample_indices(), outputs.per_sample()):
        yield index, torch.stack(rows)


def nonlinearity(
    experiment,
    *,
    levels: Sequence[str] = DEFAULT_LEVELS,
    steps: int = 10,
    model_output: str = "hidden",
    run: RunSettings | None = None,
    **run_options,
) -> xr.Dataset:
    """Non-linearity Score (seed 002 Eq. 19) of every fine-tune on its own task, per module and sample.

    Returns (and, with `store`, writes group ``linearity``) a Dataset with
    ``nonlinearity_score`` (task, module, sample) and ``unchanged`` (task, module):
    modules the fine-tune left untouched score NaN and are flagged. ``sample`` is
    the record index in the task's file; ``level``, ``layer`` (−1 for the model)
    and ``head`` label ``module``.
    ``run`` (or its fields as keywords: ``store``, ``force``, ``progress``, ``command``, ``on_unit``,
    ``capture_budget``, ``compute_dtype``, ``engine``): `submerge.diagnostics.execution.RunSettings`; with a
    ``RayEngine`` the layers are measured by a pipeline of Ray workers, and this process alone writes the store.
    """
    if steps < 1:
        raise ValueError("steps must be at least 1")
    run = RunSettings.of(run, **run_options)
    tasks = experiment.tasks
    settings = {"levels": list(levels), "steps": steps, "model_output": model_output}
    sweep = Sweep(experiment, levels, "linearity", settings, run,
                  model_output=model_output)
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
            replayed = unit.run(task, [{task: k / steps} for k in range(steps + 1)])
            for module in unit.modules:
                for index, trajectory in trajectories(replayed.of(module)):
                    scores[module.name][t, position_of[index]] = nonlinearity_score(trajectory)
            del replayed
        return {name: (scores[name], unchanged[name]) for name in scores}

    def piece(modules, results) -> xr.Dataset:
        array = np.stack([results[m.name][0] for m in modules], axis=1)
        flags = np.stack([results[m.name][1] for m in modules], axis=1)
        return xr.Dataset(
            {"nonlinearity_score": (("task", "module", "sample"), array), "unchanged": (("task", "module"), flags)},
            coords={"task": np.array(tasks, dtype=object), "sample": positions, **module_coords(modules)},
        )

    sweep.run("Non-linearity Score", measure, piece)
    return sweep.writer.finish({"equation": "seed 002 Eq. 19", "summary": "mean ± std over modules and samples"},
                               result_attrs={"equation": "seed 002 Eq. 19", "steps": steps,
                                             "model_output": model_output,
                                             "features": "module output on one sequence, real tokens only, flattened"})


def summarize_nonlinearity(dataset: xr.Dataset):
    """Table 17 of seed 002: mean ± std of the score per level (rows) and task (columns)."""
    import pandas as pd

    rows = {}
    for level in dict.fromkeys(dataset.level.values.tolist()):
        selected = dataset.nonlinearity_score.where(dataset.level == level, drop=True)
        rows[level] = {str(task): mean_std(selected.sel(task=task).values.ravel()) for task in dataset.task.values}
    return pd.DataFrame.from_dict(rows, orient="index")

"""`diag alpha`: closed-form merge coefficients α per submodule (seed 002 Eq. 12–14; balanced Eq. 33–34).

Owner of the store groups ``alpha/<granularity>`` (`ALPHA`): their layout, summary table and figures.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import xarray as xr

from submerge.diagnostics import plot
from submerge.diagnostics.execution import RunSettings
from submerge.diagnostics.groups import StoreGroup
from submerge.diagnostics.linearity.equations import (
    alpha_system,
    balance_denominator,
    linearized_objective,
    merge_objective,
    solve_alpha,
    task_gram,
)
from submerge.diagnostics.linearity.sweep import Sweep
from submerge.diagnostics.modules import GRANULARITIES
from submerge.diagnostics.replay import Outputs, Unit, module_coords
from submerge.diagnostics.tables import long_frame, ordered, strings

_RESULTS = {  # store variable → key of a module's result
    "condition_number": "cond", "least_squares": "lstsq", "objective_alpha": "obj_alpha",
    "objective_uniform": "obj_uniform", "linearized_objective_alpha": "lin_alpha",
    "linearized_objective_uniform": "lin_uniform",
}


def _grams(outputs: dict[str, Outputs], tasks):
    """Per input task a: the (n_a, T, T) Grams of Eq. 14 and per sample (f(x; θ0), [Δf_t(x)]) in float64."""
    grams, features = [], []
    for a in tasks:
        per_sample, deltas = [], []
        for sample in outputs[a].per_sample():
            base = sample[0]
            d = [tuned - base for tuned in sample[1:]]
            per_sample.append(task_gram(d).cpu().numpy())
            deltas.append((base, d))
        grams.append(np.stack(per_sample))
        features.append(deltas)
    return grams, features


def _true_objective(merged: dict[str, Outputs], features, grams, tasks, balance: bool) -> float:
    """Eq. 10 (Eq. 33 when balanced) on the merged replays against each input task's own fine-tune."""
    merged_features, tuned, denominators = [], [], []
    for a, task in enumerate(tasks):
        merged_features.append(list(merged[task].features(0)))
        tuned.append([base + d[a] for base, d in features[a]])
        denominators.append([balance_denominator(g) for g in grams[a]])
    return merge_objective(merged_features, tuned, denominators if balance else None)


def alpha(
    experiment,
    *,
    granularity: str = "layer",
    balance: bool = True,
    max_condition: float = 1e12,
    run: RunSettings | None = None,
    **run_options,
) -> xr.Dataset:
    """Closed-form merge coefficients α per submodule (seed 002 Eq. 12–14; balanced Eq. 33–34).

    For each module i, Δf_t(x) = f(x; θ0^i + τ_t^i) − f(x; θ0^i) on the inputs of
    every task; α = A⁻¹b in float64, least squares when A is singular or
    ill-conditioned (flagged, with the condition number). The Eq. 10 objective
    (true module outputs) is stored at the solved α and at uniform weights 1/T,
    and the linearised objective (Eq. 22 / 33) at both.
    ``run`` (or its fields as keywords: ``store``, ``force``, ``progress``, ``command``, ``on_unit``,
    ``capture_budget``, ``compute_dtype``, ``engine``): `submerge.diagnostics.execution.RunSettings`; with a
    ``RayEngine`` the layers are measured by a pipeline of Ray workers, and this process alone writes the store.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity '{granularity}' (choose from {list(GRANULARITIES)})")
    run = RunSettings.of(run, **run_options)
    tasks = experiment.tasks
    uniform = np.full(len(tasks), 1.0 / len(tasks))
    sweep = Sweep(experiment, GRANULARITIES[granularity], f"{ALPHA.name}/{granularity}",
                  {"granularity": granularity, "balance": balance, "max_condition": max_condition},
                  run, regroup=True)

    def measure(unit: Unit) -> dict:
        replays = {task: unit.run(task, [{}] + [{t: 1.0} for t in tasks]) for task in tasks}
        results = {}
        for module in unit.modules:
            grams, features = _grams({task: replays[task].of(module) for task in tasks}, tasks)
            solution = solve_alpha(*alpha_system(grams, balance=balance), max_condition=max_condition)
            objectives = [math.nan, math.nan]
            if module.level != "head":  # heads are solved on their own outputs only
                objectives = [_true_objective({task: unit.run(task, [dict(zip(tasks, map(float, weights)))]).of(module)
                                               for task in tasks}, features, grams, tasks, balance)
                              for weights in (solution.alpha, uniform)]
            results[module.name] = {
                "alpha": solution.alpha, "cond": solution.condition_number, "lstsq": solution.used_least_squares,
                "obj_alpha": objectives[0], "obj_uniform": objectives[1],
                "lin_alpha": linearized_objective(solution.alpha, grams, balance),
                "lin_uniform": linearized_objective(uniform, grams, balance)}
        return results

    def piece(modules, results) -> xr.Dataset:
        per_module = {name: (("granularity", "module"), np.array([[results[m.name][key] for m in modules]]))
                      for name, key in _RESULTS.items()}
        return xr.Dataset(
            {"alpha": (("granularity", "module", "task"), np.stack([results[m.name]["alpha"] for m in modules])[None]),
             **per_module},
            coords={"granularity": np.array([granularity], dtype=object), "task": np.array(tasks, dtype=object),
                    **module_coords(modules)},
        )

    sweep.run(f"Closed-form α ({granularity})", measure, piece)
    notes = {"equations": "seed 002 Eq. 12-14 (α = A⁻¹b), balanced Eq. 33-34" if balance else "seed 002 Eq. 12-14",
             "b_vector": "b_j = Σ_a B_aja (seed 002 Eq. 13)",
             "objective": "Eq. 10 on replayed module outputs (balanced by Eq. 33's denominator when balance)",
             "uniform": "α_t = 1/T", "head_objective": "NaN: heads are solved on their own outputs only",
             "gqa": "a k/v group shared by heads gets the mean α of its heads when merging (exact for plain MHA)"}
    return sweep.writer.finish(notes)


def _granularity(dataset: xr.Dataset) -> str:
    return str(dataset.granularity.values[0])


def summary(dataset: xr.Dataset) -> pd.DataFrame:
    """Per level of one granularity's group: its modules, the mean α of each task over them, the Eq. 10 objective
    summed over them at α and at 1/T (NaN skipped; NaN for heads, which have none), least-squares fallbacks and the
    largest condition number."""
    data = dataset.isel(granularity=0, drop=True)
    levels = np.array(strings(data.level.values))
    rows = {}
    for level in ordered(levels):
        part = data.isel(module=np.flatnonzero(levels == level))
        row = {"modules": part.sizes["module"]}
        for task in strings(part.task.values):
            row[f"α {task} (mean)"] = float(part.alpha.sel(task=task).mean())
        row["objective α"] = float(part.objective_alpha.sum(skipna=True, min_count=1))  # heads have none: NaN
        row["objective 1/T"] = float(part.objective_uniform.sum(skipna=True, min_count=1))
        row["least squares"] = int(part.least_squares.sum())
        row["max condition"] = float(part.condition_number.max())
        rows[level] = row
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("level")


def _title(dataset: xr.Dataset) -> str:
    return (f"Closed-form α, granularity {_granularity(dataset)} (seed 002 Eq. 12–14): mean α over each level's "
            f"modules; Eq. 10 objectives summed over them")


def alpha_heatmap(alpha: xr.Dataset, about: str = ""):
    """α per submodule and task of one granularity; colour centred on uniform weights 1/T.

    attn-mlp: one panel per part (attn, mlp), rows = layer, columns = task.
    head-mlp: one panel per task, rows = layer, columns = heads and mlp.
    """
    frame = long_frame(alpha.alpha.isel(granularity=0, drop=True))
    frame["part"] = np.where(frame["head"] >= 0, "h" + frame["head"].astype(str), frame["level"])
    frame["row"] = np.where(frame["layer"] >= 0, frame["layer"].astype(str), "model")
    tasks = strings(alpha.task.values)
    parts = list(dict.fromkeys(frame.sort_values(["head"]).part))
    parts = [p for p in parts if p.startswith("h")] + [p for p in parts if not p.startswith("h")]
    rows = list(dict.fromkeys(frame.sort_values("layer").row))
    uniform = 1.0 / len(tasks)
    spread = float(np.nanmax(np.abs(frame.alpha - uniform))) or 0.1
    by_task = len(parts) > 3
    panels, columns = (tasks, parts) if by_task else (parts, tasks)
    with plot.styled("white") as (plt, _):
        width = max(2.6, (0.62 if len(columns) <= 8 else 0.3) * len(columns) + 1.0)
        height = max(0.32 * len(rows) + (1.4 if by_task else 2.8), 3.0 if by_task else 4.0)
        shape = (len(panels), 1) if by_task else (1, len(panels))  # many heads: panels stacked, one per task
        fig, axes = plt.subplots(*shape, figsize=(width * shape[1] + 1.8, height * shape[0] + 1.4 * by_task),
                                 sharey=True, squeeze=False, layout="constrained")
        for col, (ax, panel) in enumerate(zip(axes.flat, panels)):
            part = frame[frame.task == panel] if by_task else frame[frame.part == panel]
            grid = part.pivot_table(index="row", columns="part" if by_task else "task", values="alpha")
            mesh = plot.heatmap(ax, grid.reindex(index=rows, columns=columns), cmap="vlag", vmin=uniform - spread,
                                vmax=uniform + spread, annot=len(rows) * len(columns) <= 240, fmt=".2f", fontsize=8)
            ax.set_title(panel, fontsize=12)
            ax.set_xlabel("head / part" if by_task else "task")
            ax.set_ylabel("layer" if (col == 0 or by_task) and rows != ["model"] else "")
            ax.tick_params(axis="y", rotation=0)
            ax.tick_params(axis="x", rotation=0 if len(columns) <= 6 else 90)
        fig.colorbar(mesh, ax=axes, label=f"α (white: uniform 1/T = {uniform:.2g})",
                     shrink=0.9 if by_task else 1.0, aspect=40 if by_task else 20)
        plot.title(fig, f"Closed-form α per submodule, granularity {_granularity(alpha)} (seed 002 Eq. 12–14)", about)
    return fig


def _reductions(alphas: xr.Dataset | dict[str, xr.Dataset]) -> pd.DataFrame:
    """Per module: 100 · (1 − objective(α) / objective(1/T)), with its level, layer and granularity."""
    datasets = list(alphas.values()) if isinstance(alphas, dict) else [alphas]
    pieces = []
    for dataset in datasets:
        data = dataset.isel(granularity=0, drop=True)
        pieces.append(pd.DataFrame({"objective α": data.objective_alpha.values,
                                    "objective 1/T": data.objective_uniform.values,
                                    "level": strings(data.level.values), "layer": data.layer.values,
                                    "granularity": _granularity(dataset)}))
    frame = pd.concat(pieces).dropna(subset=["objective α", "objective 1/T"]) if pieces else pd.DataFrame()
    frame = frame[frame["objective 1/T"] > 0] if not frame.empty else frame
    if not frame.empty:
        frame["reduction"] = 100.0 * (1.0 - frame["objective α"] / frame["objective 1/T"])
    return frame


def alpha_objective(alphas: xr.Dataset | dict[str, xr.Dataset], about: str = ""):
    """How much the solved α lowers the merge objective (Eq. 10) below uniform 1/T, per module.

    y = 1 − objective(α) / objective(1/T) in percent; one panel per granularity (`alphas`: one group's dataset,
    or {granularity: dataset}), hue = level.
    """
    frame = _reductions(alphas)
    if frame.empty:
        return None
    granularities = ordered(frame.granularity, tuple(GRANULARITIES))
    with plot.styled() as (plt, sns):
        fig, axes = plt.subplots(1, len(granularities), figsize=(4.6 * len(granularities) + 1.8, 4.6),
                                 sharey=True, squeeze=False, layout="constrained")
        for ax, granularity in zip(axes[0], granularities):
            part = frame[frame.granularity == granularity]
            if (part.layer < 0).all():
                sns.barplot(part, x="level", y="reduction", color="C0", ax=ax)
                ax.set_xlabel("")
            else:
                sns.lineplot(part, x="layer", y="reduction", hue="level", hue_order=ordered(part.level),
                             palette="deep", marker="o", ax=ax)
                plot.integer_ticks(ax, part.layer)
                ax.set_xlabel("layer")
                if part.level.nunique() > 1:
                    ax.legend(title="level", frameon=False, fontsize=10, title_fontsize=10)
                else:
                    ax.get_legend().remove()
            ax.axhline(0, color="black", linewidth=0.8)
            ax.set_title(granularity, fontsize=12)
            ax.set_ylabel("objective reduction vs 1/T (%)")
        plot.title(fig, "Merge objective (seed 002 Eq. 10): solved α vs uniform 1/T — higher is better", about)
    return fig


ALPHA = StoreGroup(
    name="alpha",
    per="granularity",
    dim="module",
    variables={"alpha": ("granularity", "module", "task"),
               **{name: ("granularity", "module") for name in _RESULTS}},
    title=_title,
    summary=summary,
    figures={"alpha": alpha_heatmap, "alpha_objective": alpha_objective},
)

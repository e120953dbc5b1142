"""`diag projection`: Projection Distance (seed 002 Eq. 8), cosine_merge (Eq. 16), cosine_base (Eq. 17).

Owner of the store group ``projection`` (`PROJECTION`): its layout, its summary table and its figures.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
import xarray as xr

from submerge.diagnostics import plot
from submerge.diagnostics.execution import RunSettings
from submerge.diagnostics.groups import StoreGroup
from submerge.diagnostics.linearity.equations import (
    POINTS_CHUNK_BYTES,
    cosine_base,
    cosine_merge,
    mean_std,
    projection_distance,
    projection_terms_of_batch,
)
from submerge.diagnostics.linearity.floor import (
    FLOOR_NOTE,
    FLOOR_SAMPLES,
    first_records,
    flagged,
    reference_run,
    wants_floor,
)
from submerge.diagnostics.linearity.sweep import Sweep
from submerge.diagnostics.modules import DEFAULT_LEVELS
from submerge.diagnostics.replay import Outputs, Unit, module_coords
from submerge.diagnostics.tables import long_frame, ordered, strings

COMBOS_PER_REPLAY = 8  # merged variants replayed together (the model level runs them block by block together)
# float64 copies `_metrics` holds at once (every task's Δf, Δ_lin and Δ_merge of a few sequences): the budget, and
# its reason, of Eq. 19's buffer
PROJECTION_CHUNK_BYTES = POINTS_CHUNK_BYTES


def projection_grid(size: int, values: Sequence[float] | None) -> list[tuple[float, ...]]:
    """Default α grids of seed 002 Fig. 3: {0.2,…,1}² for two models, {0.3,0.5,0.7}^T beyond."""
    if values is None:
        values = (0.2, 0.4, 0.6, 0.8, 1.0) if size == 2 else (0.3, 0.5, 0.7)
    return list(itertools.product(values, repeat=size))


def _metrics(tasks, subsets, combos, deltas: dict[str, Outputs], merged: list[dict[str, Outputs]]):
    """PD and cosine_merge per combo, cosine_base per subset, over the samples of the subset's tasks.

    ``deltas[a].values[t]`` is Δf_t on task a's inputs; ``merged[c][a].values[0]`` is Δ_merge of combo c.
    PD's terms are taken a few sequences of a batch at a time (`PROJECTION_CHUNK_BYTES`): each task's Δf converted
    to float64 once for every combo, the padded positions set to zero, Δ_lin = Σ α_t Δf_t summed as one sample's
    features would be (the same float64 values), and `projection_terms_of_batch` for the sequences together.
    """
    base_values = np.full(len(subsets), np.nan)
    for s, subset in enumerate(subsets):
        chosen = [tasks.index(t) for t in subset]
        base_values[s] = cosine_base([[sample[t] for t in chosen] for a in subset for sample in deltas[a].per_sample()])
    ratios, cosines = [[] for _ in combos], [[] for _ in combos]
    for a, outputs in deltas.items():  # the tasks' order: each combo's samples in the order of its subset's tasks
        wanted = [c for c, (subset, _) in enumerate(combos) if a in subset]
        for b, mask in enumerate(outputs.masks):
            first = outputs.values[0][b]
            per_sequence = (len(tasks) + 2) * max(1, first[0].numel()) * 8  # the float64 Δf_t, Δ_lin and Δ_merge
            step = max(1, PROJECTION_CHUNK_BYTES // per_sequence)
            for lo in range(0, first.shape[0], step):
                hi = min(first.shape[0], lo + step)
                padded = None if bool(mask[lo:hi].all()) else ~mask[lo:hi]
                task_deltas = [_real_float64(per_task[b][lo:hi], padded) for per_task in outputs.values]
                for c in wanted:
                    subset, alpha = combos[c]
                    linear = sum(weight * task_deltas[tasks.index(t)] for t, weight in zip(subset, alpha))
                    merge = _real_float64(merged[c][a].values[0][b][lo:hi], padded)
                    ratio, cosine = projection_terms_of_batch(merge, linear)
                    ratios[c].extend(ratio)
                    cosines[c].extend(cosine)
    pd_values = np.array([projection_distance(values) for values in ratios], dtype=np.float64)
    cos_values = np.array([cosine_merge(values) for values in cosines], dtype=np.float64)
    return pd_values, cos_values, base_values


def _real_float64(output: torch.Tensor, padded: torch.Tensor | None) -> torch.Tensor:
    """A float64 copy of `output` (sequences, seq, ...) with the ``padded`` (sequences, seq) positions set to 0."""
    copy = output.detach().to(torch.float64, copy=True)
    if padded is not None:
        copy[padded.to(copy.device)] = 0.0
    return copy


def _combos(tasks: list[str], alphas: Sequence[float] | None):
    """Every subset of two or more of `tasks`, every (subset, α) of its grid (`projection_grid`), and the α of each
    combo per task (NaN: not in the subset), shape (combo, task)."""
    subsets = [s for size in range(2, len(tasks) + 1) for s in itertools.combinations(tasks, size)]
    combos = [(subset, alpha) for subset in subsets for alpha in projection_grid(len(subset), alphas)]
    combo_alpha = np.full((len(combos), len(tasks)), np.nan)
    for c, (subset, alpha) in enumerate(combos):
        for task, value in zip(subset, alpha):
            combo_alpha[c, tasks.index(task)] = value
    return subsets, combos, combo_alpha


def projection(
    experiment,
    *,
    levels: Sequence[str] = DEFAULT_LEVELS,
    alphas: Sequence[float] | None = None,
    floor_samples: int = FLOOR_SAMPLES,
    plain_replay: bool = False,
    run: RunSettings | None = None,
    **run_options,
) -> xr.Dataset:
    """Projection Distance (Eq. 8), cosine_merge (Eq. 16) and cosine_base (Eq. 17) per module.

    For every subset S of two or more fine-tunes and every α in its grid (seed 002
    Fig. 3 unless `alphas`), over x in the union of S's task data:
    Δ_merge = f(x; θ0 + Σ α_t τ_t) − f(x; θ0), Δ_lin = Σ α_t Δf_t(x).
    ``projection_distance_floor`` (module, combo): what rounding at the compute dtype contributes
    (`submerge.diagnostics.linearity.floor`): |PD − PD in float64| over the first `floor_samples` records of each
    task, the largest over the subset's α grid (NaN when the compute dtype is float64 or `floor_samples` is 0).
    A unit's merged variants are replayed with the maps every variant shares computed once per task and task pair
    (`submerge.diagnostics.replay.replay_combos`); ``plain_replay`` replays each merge on its own parameters instead
    (the straightforward path, equal up to float rounding).
    ``run`` (or its fields as keywords: ``store``, ``force``, ``progress``, ``command``, ``on_unit``,
    ``capture_budget``, ``compute_dtype``, ``engine``): `submerge.diagnostics.execution.RunSettings`; with a
    ``RayEngine`` the layers are measured by a pipeline of Ray workers, and this process alone writes the store.
    """
    run = RunSettings.of(run, **run_options)
    tasks = experiment.tasks
    if len(tasks) < 2:
        raise ValueError("the Projection Distance needs at least two fine-tunes")
    if "head" in levels:
        raise ValueError("projection supports levels model, layer, attn, mlp (head outputs: use `diag linearity`)")
    subsets, combos, combo_alpha = _combos(tasks, alphas)
    sweep = Sweep(experiment, levels, PROJECTION.name, {"levels": list(levels), "floor_samples": floor_samples,
                                                     "alphas": None if alphas is None else list(alphas)},
                  run, regroup=True)

    def piece(modules, values, *, floors: xr.DataArray | None) -> xr.Dataset:
        floor = (np.full((len(modules), len(combos)), np.nan) if floors is None
                 else floors.sel(module=[m.name for m in modules]).values)
        return xr.Dataset(
            {
                "projection_distance": (("module", "combo"), np.stack([values[m.name][0] for m in modules])),
                "projection_distance_floor": (("module", "combo"), floor),
                "cosine_merge": (("module", "combo"), np.stack([values[m.name][1] for m in modules])),
                "cosine_base": (("module", "subset"), np.stack([values[m.name][2] for m in modules])),
            },
            coords={
                **module_coords(modules),
                "combo": np.arange(len(combos)),
                "task": np.array(tasks, dtype=object),
                "subset": np.array(["+".join(s) for s in subsets], dtype=object),
                "combo_subset": ("combo", np.array(["+".join(s) for s, _ in combos], dtype=object)),
                "combo_alpha": (("combo", "task"), combo_alpha),
            },
        )

    with run.engine.running():  # one Ray instance (when on Ray) for the floor's two passes and the sweep
        floors = _floors(experiment, sweep, floor_samples, levels=levels, alphas=alphas, plain_replay=plain_replay)
        measure = functools.partial(_measure, tasks=tasks, subsets=subsets, combos=combos, plain_replay=plain_replay)
        sweep.run("Projection Distance", measure, functools.partial(piece, floors=floors))
    return sweep.writer.finish({"equations": "seed 002 Eq. 8 (PD), Eq. 16 (cosine_merge), Eq. 17 (cosine_base)",
                                "cosine_base": "mean over pairs t<t' (Eq. 17 prints 1/(T(T-1)) over t<t', half a mean)",
                                "data": "x ranges over the union of the subset's task data",
                                "projection_distance_floor": FLOOR_NOTE})


def _measure(unit: Unit, *, tasks, subsets, combos, plain_replay: bool) -> dict:
    """{module: (PD per combo, cosine_merge per combo, cosine_base per subset)} of one unit: each task's Δf_t and each
    combo's Δ_merge on every task's inputs, replayed `COMBOS_PER_REPLAY` merges at a time (through the unit's
    shared maps unless `plain_replay`), then `_metrics`."""
    results = {}
    for module in unit.modules:
        deltas, merged = {}, [{} for _ in combos]
        for a in tasks:
            outs = unit.run(a, [{}] + [{t: 1.0} for t in tasks]).of(module)
            base = outs.values[0]
            deltas[a] = Outputs(outs.values[1:], outs.masks, outs.indices).minus(base)
            wanted = [c for c, (subset, _) in enumerate(combos) if a in subset]
            for start in range(0, len(wanted), COMBOS_PER_REPLAY):
                group = wanted[start:start + COMBOS_PER_REPLAY]
                merges = [dict(zip(*combos[c])) for c in group]
                replayed = (unit.run(a, merges) if plain_replay else unit.merged(a, merges)).of(module)
                for v, c in enumerate(group):
                    merged[c][a] = Outputs([replayed.values[v]], replayed.masks, replayed.indices).minus(base)
            del outs
        results[module.name] = _metrics(tasks, subsets, combos, deltas, merged)
    return results


def _floors(experiment, sweep: Sweep, floor_samples: int, **options) -> xr.DataArray | None:
    """|PD − PD in float64| (module, combo) on the first `floor_samples` records, the largest over the α grid of
    the combo's subset (one difference can cancel by chance; the grid's are alike), or None (no floor, or nothing
    left to measure). The Projection Distance is a mean over samples, so both dtypes run on the same records."""
    if not wants_floor(sweep.compute_dtype, floor_samples) or sweep.finished():
        return None
    subset = first_records(experiment, floor_samples)
    compute = str(sweep.source.compute_dtype).removeprefix("torch.")
    distances = [projection(subset, floor_samples=0, run=reference_run(sweep.run_settings, dtype),
                            **options).projection_distance for dtype in (compute, "float64")]
    error = abs(distances[0] - distances[1])
    return error.groupby("combo_subset").max().sel(combo_subset=error.combo_subset).drop_vars("combo_subset")


def summary(dataset: xr.Dataset) -> pd.DataFrame:
    """Per level: mean and std of the Projection Distance over the level's modules and every (subset, α) of the
    grid, and the mean cosine_merge (over the same) and cosine_base (over modules and subsets); NaN skipped.
    "PD floor": the mean noise floor over the same; "near floor": "⚠ k/n" when k of the n (module, α) distances are
    within 10× of their floor."""
    levels = np.array(strings(dataset.level.values))
    rows = {}
    for level in ordered(levels):
        chosen = levels == level
        distance_mean, distance_std = mean_std(dataset.projection_distance.values[chosen])
        distances, floors = dataset.projection_distance.values[chosen], dataset.projection_distance_floor.values[chosen]
        rows[level] = {"PD mean": distance_mean, "PD std": distance_std, "PD floor": mean_std(floors)[0],
                       "near floor": flagged(distances, floors),
                       "cosine_merge": mean_std(dataset.cosine_merge.values[chosen])[0],
                       "cosine_base": mean_std(dataset.cosine_base.values[chosen])[0]}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("level")


def _combo_frame(projection: xr.Dataset) -> pd.DataFrame:
    """Mean Projection Distance over the modules of each level, per combo, with each task's α as columns."""
    frame = long_frame(projection.projection_distance)
    means = frame.groupby(["level", "combo"]).projection_distance.mean().reset_index()
    alphas = projection.combo_alpha.to_pandas()
    alphas.columns = strings(alphas.columns)
    means = means.join(alphas, on="combo")
    means["subset"] = [str(projection.combo_subset.values[c]) for c in means.combo]
    return means


def projection_pairs(projection: xr.Dataset, about: str = "", max_subsets: int = 6):
    """Projection Distance over the α grid of every pair of fine-tunes: heatmap per (pair, level)."""
    means = _combo_frame(projection)
    pairs = [s for s in dict.fromkeys(means.subset) if s.count("+") == 1][:max_subsets]
    if not pairs:
        return None
    levels = ordered(means.level)
    vmax = float(means[means.subset.isin(pairs)].projection_distance.max())
    with plot.styled("white") as (plt, _):
        fig, axes = plt.subplots(len(pairs), len(levels), figsize=(3.4 * len(levels) + 1.2, 3.1 * len(pairs) + 1.2),
                                 squeeze=False, layout="constrained")
        for row, pair in enumerate(pairs):
            first, second = pair.split("+")
            for col, level in enumerate(levels):
                ax = axes[row][col]
                part = means[(means.subset == pair) & (means.level == level)]
                grid = part.pivot_table(index=first, columns=second, values="projection_distance").sort_index(
                    ascending=False)
                mesh = plot.heatmap(ax, grid, cmap="rocket_r", vmin=0, vmax=vmax, annot=grid.size <= 36, fmt=".2f",
                                    square=True, most_x=12, most_y=12)
                ax.set_xlabel(f"α {second}")
                ax.set_ylabel(f"α {first}")
                ax.set_title(f"{level} · {pair}", fontsize=11)
                ax.tick_params(axis="y", rotation=0)
        fig.colorbar(mesh, ax=axes, label="Projection Distance", shrink=min(1.0, 0.35 * len(pairs) + 0.3),
                     aspect=12 + 6 * len(pairs))
        plot.title(fig, "Projection Distance (seed 002 Eq. 8) over the α grid — mean over the level's modules", about)
    return fig


def projection_multi(projection: xr.Dataset, about: str = "", max_combos: int = 30):
    """Projection Distance of subsets of three or more fine-tunes, mean over each level's modules.

    One panel per subset with the level means against each α combo when every subset has at most
    `max_combos` combos (e.g. three models on {0.3, 0.5, 0.7}³ = 27); else one box plot of those
    means over the α grid, per subset and level.
    """
    means = _combo_frame(projection)
    subsets = sorted((s for s in dict.fromkeys(means.subset) if s.count("+") >= 2), key=lambda s: -s.count("+"))
    if not subsets:
        return None
    count = max(means[means.subset == s].combo.nunique() for s in subsets)
    if count > max_combos or len(subsets) > 4:
        return _multi_boxes(means[means.subset.isin(subsets)], subsets, ordered(means.level), about)
    return _multi_points(means, subsets, ordered(means.level), count, about)


def _multi_boxes(means: pd.DataFrame, subsets: list[str], levels: list[str], about: str):
    """One box plot of the level means over the α grid, per subset and level."""
    with plot.styled() as (plt, sns):
        fig, ax = plt.subplots(figsize=(max(8.0, 1.3 * len(subsets) * len(levels) ** 0.5 + 3.0), 5.2),
                               layout="constrained")
        sns.boxplot(means, x="subset", y="projection_distance", hue="level", hue_order=levels, order=subsets,
                    palette="deep", fliersize=2, ax=ax)
        ax.set_xlabel("subset of fine-tunes (each box: the α grid)")
        ax.set_ylabel("Projection Distance")
        plot.tilt_labels(ax, 30 if len(subsets) > 3 else 0)
        plot.legend_outside(ax, "level")
        plot.title(fig, "Projection Distance for three or more fine-tunes over the α grid — level means", about)
    return fig


def _multi_points(means: pd.DataFrame, subsets: list[str], levels: list[str], count: int, about: str):
    """One panel per subset: the level means against each α combo."""
    with plot.styled() as (plt, sns):
        fig, axes = plt.subplots(len(subsets), 1, figsize=(max(7.5, 0.34 * count + 3.5), 4.2 * len(subsets) + 0.8),
                                 squeeze=False, layout="constrained")
        for ax, subset in zip(axes[:, 0], subsets):
            tasks = subset.split("+")
            part = means[means.subset == subset].copy()
            part["α"] = part[tasks].apply(lambda r: "/".join(f"{v:g}" for v in r), axis=1)
            order = list(dict.fromkeys(part.sort_values("combo")["α"]))
            sns.pointplot(part, x="α", y="projection_distance", hue="level", hue_order=levels, order=order,
                          palette="deep", markers="o", linestyles="-", ax=ax)
            ax.set_xlabel(f"α ({' / '.join(tasks)})")
            ax.set_ylabel("Projection Distance")
            ax.set_title(subset, fontsize=11)
            ax.tick_params(axis="x", rotation=90 if len(order) > 6 else 0, labelsize=9 if len(order) > 12 else 10)
            plot.legend_outside(ax, "level")
        plot.title(fig, "Projection Distance for three or more fine-tunes — mean over the level's modules", about)
    return fig


def projection_per_layer(projection: xr.Dataset, about: str = ""):
    """Projection Distance per layer (mean and std over every subset and α), one line per level; shaded: the noise
    floor band (the layer's largest floor)."""
    frame = long_frame(projection.projection_distance).dropna(subset=["projection_distance"])
    levels = [level for level in ordered(frame.level) if level != "model"]
    model = frame[frame.level == "model"].projection_distance
    with plot.styled() as (plt, sns):
        fig, ax = plt.subplots(figsize=(9, 4.8), layout="constrained")
        part = frame[frame.level.isin(levels)]
        if not part.empty:
            sns.lineplot(part, x="layer", y="projection_distance", hue="level", hue_order=levels, palette="deep",
                         errorbar="sd", marker="o", ax=ax)
            plot.integer_ticks(ax, part.layer)
        if not model.empty:
            ax.axhline(model.mean(), color="black", linestyle="--", linewidth=1.2, label="model (mean)")
        floors = long_frame(projection.projection_distance_floor).dropna(subset=["projection_distance_floor"])
        floors = floors[floors.level.isin(levels)].groupby("layer").projection_distance_floor.max()
        if not floors.empty:
            ax.fill_between(floors.index, 0, floors.values, color="grey", alpha=0.25, linewidth=0, step="mid",
                            label="noise floor (rounding)")
        ax.set_xlabel("layer")
        ax.set_ylabel("Projection Distance")
        ax.set_ylim(bottom=0)
        ax.legend(title="level", loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
        plot.title(fig, "Projection Distance per layer — mean ± std over all subsets and α", about)
    return fig


PROJECTION = StoreGroup(
    name="projection",
    dim="module",
    variables={"projection_distance": ("module", "combo"), "projection_distance_floor": ("module", "combo"),
               "cosine_merge": ("module", "combo"),
               "cosine_base": ("module", "subset")},
    title="Projection Distance and cosines (seed 002 Eq. 8, 16, 17), over modules and (subset, α)",
    summary=summary,
    figures={"projection_distance_pairs": projection_pairs, "projection_distance_multi": projection_multi,
             "projection_distance_per_layer": projection_per_layer},
)

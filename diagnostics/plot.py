"""`diag report`: seaborn figures and summary tables from a store.

    >>> from submerge.diagnostics.plot import report, summary_tables, print_tables
    >>> paths = report("runs/llama2.zarr", "runs/llama2-report")    # PNG files, one per figure
    >>> tables = summary_tables("runs/llama2.zarr")                  # pandas DataFrames
    >>> print_tables(tables)                                         # rich tables on the terminal

Each figure function takes the group's `xarray.Dataset` (plus ``about``, the
"base · fine-tunes" line for the title) and returns a matplotlib Figure, so the
notebooks use the same figures. Groups that are missing from a store are
skipped; nothing here computes a metric, it only reads and averages.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import xarray as xr
from matplotlib.ticker import MaxNLocator

from submerge.diagnostics.errors import StoreError
from submerge.diagnostics.store import Store

LEVEL_ORDER = ("model", "layer", "attn", "mlp", "head")
GRANULARITY_ORDER = ("model", "layer", "attn-mlp", "head-mlp")
INTERFERENCE_RANK_FRAC = 0.08  # CART's reported optimum; the I(k) column of the per-layer heatmap
_THEME = {"context": "notebook", "style": "whitegrid", "font_scale": 1.05}


# ---------------------------------------------------------------------------- loading


def load_groups(store_path: str | Path) -> tuple[dict, dict[str, xr.Dataset]]:
    """(root attrs, {group path: loaded Dataset}) for every group of the store that holds data."""
    tree = _open_tree(store_path)
    groups = {}
    for node in tree.subtree:
        if node.has_data:
            groups[node.path.strip("/")] = node.to_dataset().load()
    return dict(tree.attrs), groups


def check_store(store_path: str | Path) -> list[str]:
    """Notes on partial data: every group of a run that stopped half-way (`Store.status`).

    A damaged store (a truncated ``zarr.json``, a missing or undecodable chunk) raises `StoreError`
    naming the file, so a report never shows it as "—".
    """

    store = Store(store_path)
    if not store.exists():
        raise StoreError(f"no store at {store_path}")
    notes = []
    for state in store.status().values():
        if state.state == "corrupt":
            raise StoreError(f"store {store_path}: {state}")
        if state.state != "complete":
            notes.append(f"group {state} (its tables and figures show only those units)")
    return notes


def _open_tree(store_path: str | Path) -> xr.DataTree:
    return Store(store_path).open()


def _short_spec(spec: str) -> str:
    """A model spec for a title: a local path becomes its last component, a hub id stays."""
    if not spec:
        return "?"
    path = Path(spec)
    if path.is_absolute() or spec.startswith((".", "~")) or path.exists():
        return path.name or spec
    return spec if len(spec) <= 48 else "…" + spec[-47:]


def describe(root_attrs: dict, dataset: xr.Dataset | None = None) -> str:
    """The "base: X · fine-tunes: a, b" line that titles every figure."""
    base = (root_attrs.get("base_model") or {}).get("spec")
    if base is None and dataset is not None:
        base = ((dataset.attrs.get("provenance") or {}).get("base_model") or {}).get("spec")
    text = f"base: {_short_spec(base or '?')}"
    if dataset is not None and "task" in dataset.coords:
        text += " · fine-tunes: " + ", ".join(str(t) for t in dataset.task.values)
    return text


def long_frame(array: xr.DataArray) -> pd.DataFrame:
    """Long DataFrame of a DataArray with its coordinates, strings as Python str."""
    frame = array.to_dataframe().reset_index()
    for column in frame.columns:
        if frame[column].dtype == object or str(frame[column].dtype).startswith(("str", "string")):
            frame[column] = frame[column].astype(str)
    return frame


def _strings(values) -> list[str]:
    """Labels as Python str (store coordinates come back as numpy StringDType)."""
    return [str(v) for v in values]


def ordered_levels(values, order=LEVEL_ORDER) -> list[str]:
    present = {str(v) for v in values}
    return [level for level in order if level in present] + sorted(present - set(order))


def _title(fig, what: str, about: str) -> None:
    fig.suptitle(f"{what}\n{about}", fontsize=13)


def _heatmap(ax, grid: pd.DataFrame, *, cmap: str, vmin: float, vmax: float, annot=False, fmt: str = ".2f",
             fontsize: float = 9, square: bool = False, most_x: int = 40, most_y: int = 48):
    """A seaborn-style heatmap of `grid` (rows top to bottom) drawn with pcolormesh; returns the mesh.

    (`seaborn.heatmap` redraws the whole figure once per call to check tick overlap, which is
    quadratic in the number of panels.) `annot`: True to print the values, or an array to print.
    """
    values = grid.to_numpy(dtype=float)
    rows, cols = values.shape
    colormap = sns.color_palette(cmap, as_cmap=True)
    mesh = ax.pcolormesh(np.arange(cols + 1), np.arange(rows + 1), np.ma.masked_invalid(values), cmap=colormap,
                         vmin=vmin, vmax=vmax)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    if square:
        ax.set_aspect("equal")
    step_x, step_y = _label_step(cols, most_x), _label_step(rows, most_y)
    ax.set_xticks(np.arange(cols)[::step_x] + 0.5, [str(c) for c in grid.columns][::step_x])
    ax.set_yticks(np.arange(rows)[::step_y] + 0.5, [str(r) for r in grid.index][::step_y])
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.grid(False)
    if annot is not False and annot is not None:
        labels = values if annot is True else np.asarray(annot, dtype=float)
        colours = mesh.to_rgba(values)
        for i in range(rows):
            for j in range(cols):
                if np.isnan(values[i, j]) or np.isnan(labels[i, j]):
                    continue
                red, green, blue = colours[i, j, :3]
                dark = 0.2126 * red + 0.7152 * green + 0.0722 * blue < 0.45
                ax.text(j + 0.5, i + 0.5, format(labels[i, j], fmt), ha="center", va="center", fontsize=fontsize,
                        color="white" if dark else "black")
    return mesh


def _label_step(count: int, most: int) -> int:
    """Every n-th tick label so that at most `most` show (explicit: seaborn's "auto" redraws the figure)."""
    return max(1, -(-count // most))


def _integer_ticks(ax, values) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(12, max(2, len(set(values))))))


# ---------------------------------------------------------------------------- linearity


def nonlinearity_per_layer(linearity: xr.Dataset, about: str = "") -> plt.Figure:
    """Non-linearity Score per layer, one panel per level (layer / attn / mlp / head), one line per task.

    Line: median over samples (and heads); band: 25–75th percentile. Dashed lines: the
    model-level median of each task, for reference. Log scale (scores span decades).
    """
    frame = long_frame(linearity.nonlinearity_score).dropna(subset=["nonlinearity_score"])
    frame = frame[frame.nonlinearity_score > 0]
    tasks = [str(t) for t in linearity.task.values]
    palette = dict(zip(tasks, sns.color_palette("colorblind", len(tasks))))
    levels = [level for level in ordered_levels(frame.level) if level != "model"]
    model = frame[frame.level == "model"].groupby("task").nonlinearity_score.median()
    panels = levels or ["model"]
    ncols = 2 if len(panels) == 4 else len(panels)
    nrows = -(-len(panels) // ncols)
    with sns.axes_style(_THEME["style"]), sns.plotting_context(_THEME["context"], font_scale=_THEME["font_scale"]):
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.4 * ncols + 1.6, 4.0 * nrows + 0.9),
                                 sharey=True, squeeze=False, layout="constrained")
        for ax, level in zip(axes.flat, panels):
            part = frame[frame.level == level]
            if not part.empty:
                sns.lineplot(part, x="layer", y="nonlinearity_score", hue="task", hue_order=tasks, palette=palette,
                             estimator="median", errorbar=("pi", 50), marker="o", markersize=5, ax=ax, legend=False)
                _integer_ticks(ax, part.layer)
            for task, value in model.items():
                ax.axhline(value, color=palette.get(task, "grey"), linestyle="--", linewidth=1.2)
            ax.set_yscale("log")
            ax.set_title(f"{level}" + (" (all heads)" if level == "head" else ""))
            ax.set_xlabel("layer")
            ax.set_ylabel("Non-linearity Score (log)")
        handles = [plt.Line2D([], [], color=palette[t], marker="o", label=t) for t in tasks]
        if not model.empty:
            handles.append(plt.Line2D([], [], color="grey", linestyle="--", label="model level"))
        fig.legend(handles=handles, title="fine-tune", loc="outside right upper", frameon=False)
        _title(fig, "Non-linearity Score per layer (seed 002 Eq. 19) — median and IQR over samples", about)
    return fig


def nonlinearity_by_level(linearity: xr.Dataset, about: str = "") -> plt.Figure:
    """Distribution of the per-sample Non-linearity Score per level (box plot, log scale), hue = task."""
    frame = long_frame(linearity.nonlinearity_score).dropna(subset=["nonlinearity_score"])
    frame = frame[frame.nonlinearity_score > 0]
    tasks = [str(t) for t in linearity.task.values]
    levels = ordered_levels(frame.level)
    with sns.axes_style(_THEME["style"]), sns.plotting_context(_THEME["context"], font_scale=_THEME["font_scale"]):
        fig, ax = plt.subplots(figsize=(2.0 * len(levels) + 3.5, 5), layout="constrained")
        sns.boxplot(frame, x="level", y="nonlinearity_score", hue="task", order=levels, hue_order=tasks,
                    palette="colorblind", log_scale=True, fliersize=2, ax=ax)
        ax.set_xlabel("level (each box: all modules of the level × samples)")
        ax.set_ylabel("Non-linearity Score (log)")
        sns.move_legend(ax, "upper left", bbox_to_anchor=(1.01, 1), title="fine-tune", frameon=False)
        _title(fig, "Non-linearity Score by level — attention vs MLP vs whole layer / model", about)
    return fig


# ---------------------------------------------------------------------------- projection


def _combo_frame(projection: xr.Dataset, variable: str = "projection_distance") -> pd.DataFrame:
    """Mean of `variable` over the modules of each level, per combo, with each task's α as columns."""
    frame = long_frame(projection[variable])
    means = frame.groupby(["level", "combo"])[variable].mean().reset_index()
    alphas = projection.combo_alpha.to_pandas()
    alphas.columns = [str(c) for c in alphas.columns]
    means = means.join(alphas, on="combo")
    means["subset"] = [str(projection.combo_subset.values[c]) for c in means.combo]
    return means


def projection_pairs(projection: xr.Dataset, about: str = "", max_subsets: int = 6) -> plt.Figure | None:
    """Projection Distance over the α grid of every pair of fine-tunes: heatmap per (pair, level)."""
    means = _combo_frame(projection)
    pairs = [s for s in dict.fromkeys(means.subset) if s.count("+") == 1][:max_subsets]
    if not pairs:
        return None
    levels = ordered_levels(means.level)
    vmax = float(means[means.subset.isin(pairs)].projection_distance.max())
    with sns.axes_style("white"), sns.plotting_context(_THEME["context"], font_scale=_THEME["font_scale"]):
        fig, axes = plt.subplots(len(pairs), len(levels), figsize=(3.4 * len(levels) + 1.2, 3.1 * len(pairs) + 1.2),
                                 squeeze=False, layout="constrained")
        for row, pair in enumerate(pairs):
            first, second = pair.split("+")
            for col, level in enumerate(levels):
                ax = axes[row][col]
                part = means[(means.subset == pair) & (means.level == level)]
                grid = part.pivot_table(index=first, columns=second, values="projection_distance").sort_index(
                    ascending=False)
                small = grid.size <= 36
                mesh = _heatmap(ax, grid, cmap="rocket_r", vmin=0, vmax=vmax, annot=small, fmt=".2f", square=True,
                                most_x=12, most_y=12)
                ax.set_xlabel(f"α {second}")
                ax.set_ylabel(f"α {first}")
                ax.set_title(f"{level} · {pair}", fontsize=11)
                ax.tick_params(axis="y", rotation=0)
        fig.colorbar(mesh, ax=axes, label="Projection Distance", shrink=min(1.0, 0.35 * len(pairs) + 0.3),
                     aspect=12 + 6 * len(pairs))
        _title(fig, "Projection Distance (seed 002 Eq. 8) over the α grid — mean over the level's modules", about)
    return fig


def projection_multi(projection: xr.Dataset, about: str = "", max_combos: int = 30) -> plt.Figure | None:
    """Projection Distance of subsets of three or more fine-tunes, mean over each level's modules.

    One panel per subset with the level means against each α combo when every subset has at most
    `max_combos` combos (e.g. three models on {0.3, 0.5, 0.7}³ = 27); else one box plot of those
    means over the α grid, per subset and level.
    """
    means = _combo_frame(projection)
    subsets = sorted((s for s in dict.fromkeys(means.subset) if s.count("+") >= 2), key=lambda s: -s.count("+"))
    if not subsets:
        return None
    levels = ordered_levels(means.level)
    count = max(means[means.subset == s].combo.nunique() for s in subsets)
    with sns.axes_style(_THEME["style"]), sns.plotting_context(_THEME["context"], font_scale=_THEME["font_scale"]):
        if count > max_combos or len(subsets) > 4:
            part = means[means.subset.isin(subsets)]
            fig, ax = plt.subplots(figsize=(max(8.0, 1.3 * len(subsets) * len(levels) ** 0.5 + 3.0), 5.2),
                                   layout="constrained")
            sns.boxplot(part, x="subset", y="projection_distance", hue="level", hue_order=levels, order=subsets,
                        palette="deep", fliersize=2, ax=ax)
            ax.set_xlabel("subset of fine-tunes (each box: the α grid)")
            ax.set_ylabel("Projection Distance")
            ax.tick_params(axis="x", rotation=30 if len(subsets) > 3 else 0)
            if len(subsets) > 3:
                for label in ax.get_xticklabels():
                    label.set_horizontalalignment("right")
            sns.move_legend(ax, "upper left", bbox_to_anchor=(1.01, 1), title="level", frameon=False)
            _title(fig, "Projection Distance for three or more fine-tunes over the α grid — "
                        "level means", about)
            return fig
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
            sns.move_legend(ax, "upper left", bbox_to_anchor=(1.01, 1), title="level", frameon=False)
        _title(fig, "Projection Distance for three or more fine-tunes — mean over the level's modules", about)
    return fig


def projection_per_layer(projection: xr.Dataset, about: str = "") -> plt.Figure:
    """Projection Distance per layer (mean and std over every subset and α), one line per level."""
    frame = long_frame(projection.projection_distance).dropna(subset=["projection_distance"])
    levels = [level for level in ordered_levels(frame.level) if level != "model"]
    model = frame[frame.level == "model"].projection_distance
    with sns.axes_style(_THEME["style"]), sns.plotting_context(_THEME["context"], font_scale=_THEME["font_scale"]):
        fig, ax = plt.subplots(figsize=(9, 4.8), layout="constrained")
        part = frame[frame.level.isin(levels)]
        if not part.empty:
            sns.lineplot(part, x="layer", y="projection_distance", hue="level", hue_order=levels, palette="deep",
                         errorbar="sd", marker="o", ax=ax)
            _integer_ticks(ax, part.layer)
        if not model.empty:
            ax.axhline(model.mean(), color="black", linestyle="--", linewidth=1.2, label="model (mean)")
        ax.set_xlabel("layer")
        ax.set_ylabel("Projection Distance")
        ax.set_ylim(bottom=0)
        ax.legend(title="level", loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
        _title(fig, "Projection Distance per layer — mean ± std over all subsets and α", about)
    return fig


# ---------------------------------------------------------------------------- interference


def interference_table(interference: xr.Dataset, rank_frac: float = INTERFERENCE_RANK_FRAC) -> pd.DataFrame:
    """One row per matrix: level, layer and the headline figures (task means, pair means, I(k) at `rank_frac`)."""
    num_tasks = interference.sizes["task"]
    upper = xr.DataArray(np.triu(np.ones((num_tasks, num_tasks), dtype=bool), k=1), dims=("task", "task_other"))
    nearest = interference.sel(rank_frac=rank_frac, method="nearest")
    chosen = float(nearest.rank_frac)
    columns = {
        "level": _strings(interference.level.values),
        "layer": interference.layer.values,
        "STI (normalised)": interference.sti_normalized.values,
        "SAR": interference.sar.mean("task").values,
        f"I(k={chosen:g})": nearest.row_space_interference.sel(centered=False).values,
        f"I(k={chosen:g}) centred": nearest.row_space_interference.sel(centered=True).values,
    }
    if num_tasks > 1:
        columns["cosine"] = interference.cosine.where(upper).mean(("task", "task_other")).values
        columns["sign conflict"] = interference.sign_conflict.where(upper).mean(("task", "task_other")).values
    return pd.DataFrame(columns, index=pd.Index(_strings(interference.matrix.values), name="matrix"))


def interference_per_layer(interference: xr.Dataset, about: str = "",
                           rank_frac: float = INTERFERENCE_RANK_FRAC) -> plt.Figure | None:
    """Heatmaps layer × metric (STI, SAR, I(k), cosine, sign conflict), attention and MLP side by side.

    Each cell: the mean over the level's matrices of that layer (annotated); colour: the
    value's place between the metric's lowest and highest cell, so metrics on different
    scales share one colour bar. High STI / I(k) / sign conflict and low SAR mean interference.
    """
    table = interference_table(interference, rank_frac)
    table = table[table.level.isin(["attn", "mlp"]) & (table.layer >= 0)]
    if table.empty:
        return None
    levels = ordered_levels(table.level)
    means = table.groupby(["level", "layer"]).mean(numeric_only=True)
    low, span = means.min(), (means.max() - means.min()).replace(0, 1)
    layers = sorted(table.layer.unique())
    annotate = len(layers) <= 48
    metrics = list(means.columns)
    with sns.axes_style("white"), sns.plotting_context(_THEME["context"], font_scale=_THEME["font_scale"]):
        fig, axes = plt.subplots(1, len(levels), figsize=(1.15 * len(metrics) * len(levels) + 2.5,
                                                          max(4.2, 0.3 * len(layers) + 3.2)),
                                 sharey=True, squeeze=False, layout="constrained")
        for col, (ax, level) in enumerate(zip(axes[0], levels)):
            values = means.loc[level].reindex(layers)
            mesh = _heatmap(ax, (values - low) / span, cmap="mako_r", vmin=0, vmax=1,
                            annot=values.to_numpy() if annotate else False, fmt=".3g",
                            fontsize=8 if len(layers) > 16 else 9)
            ax.set_title(f"{level} matrices", fontsize=12)
            ax.set_xlabel("")
            ax.set_ylabel("layer" if col == 0 else "")
            ax.tick_params(axis="x", rotation=35)
            ax.tick_params(axis="y", rotation=0)
            for label in ax.get_xticklabels():
                label.set_horizontalalignment("right")
        fig.colorbar(mesh, ax=axes, label="lowest → highest per metric", aspect=30)
        _title(fig, "Weight-space interference per layer — STI (TSV-M), SAR (Iso-C), I(k) (CART), pair means", about)
    return fig


def interference_rank(interference: xr.Dataset, about: str = "") -> plt.Figure | None:
    """Row-space interference I(k) against the rank fraction k / min(m, n), mean over matrices per level."""
    frame = long_frame(interference.row_space_interference).dropna(subset=["row_space_interference"])
    frame = frame[frame.level.isin(["attn", "mlp"])]
    if frame.empty:
        return None
    frame["task matrices"] = np.where(frame.centered.astype(str) == "True", "centred Δ̄_t", "Δ_t")
    with sns.axes_style(_THEME["style"]), sns.plotting_context(_THEME["context"], font_scale=_THEME["font_scale"]):
        fig, ax = plt.subplots(figsize=(8.5, 4.8), layout="constrained")
        sns.lineplot(frame, x="rank_frac", y="row_space_interference", hue="level", hue_order=ordered_levels(frame.level),
                     style="task matrices", errorbar="sd", marker="o", palette="deep", ax=ax)
        ax.set_xscale("log")
        fractions = sorted(frame.rank_frac.unique())
        ax.set_xticks(fractions, [f"{f:g}" for f in fractions])
        ax.minorticks_off()
        ax.set_xlabel("rank fraction k / min(m, n)")
        ax.set_ylabel("row-space interference I(k)")
        sns.move_legend(ax, "upper left", bbox_to_anchor=(1.01, 1), frameon=False)
        _title(fig, "Row-space interference I(k) (CART) — mean ± std over matrices", about)
    return fig


# ---------------------------------------------------------------------------- α


def alpha_heatmap(alpha: xr.Dataset, about: str = "") -> plt.Figure:
    """α per submodule and task of one granularity; colour centred on uniform weights 1/T.

    attn-mlp: one panel per part (attn, mlp), rows = layer, columns = task.
    head-mlp: one panel per task, rows = layer, columns = heads and mlp.
    """
    granularity = str(alpha.granularity.values[0])
    frame = long_frame(alpha.alpha.isel(granularity=0, drop=True))
    frame["part"] = np.where(frame["head"] >= 0, "h" + frame["head"].astype(str), frame["level"])
    frame["row"] = np.where(frame["layer"] >= 0, frame["layer"].astype(str), "model")
    tasks = [str(t) for t in alpha.task.values]
    parts = list(dict.fromkeys(frame.sort_values(["head"]).part))
    parts = [p for p in parts if p.startswith("h")] + [p for p in parts if not p.startswith("h")]
    rows = list(dict.fromkeys(frame.sort_values("layer").row))
    uniform = 1.0 / len(tasks)
    spread = float(np.nanmax(np.abs(frame.alpha - uniform))) or 0.1
    by_task = len(parts) > 3
    panels = tasks if by_task else parts
    columns = parts if by_task else tasks
    annotate = len(rows) * len(columns) <= 240
    with sns.axes_style("white"), sns.plotting_context(_THEME["context"], font_scale=_THEME["font_scale"]):
        width = max(2.6, (0.62 if len(columns) <= 8 else 0.3) * len(columns) + 1.0)
        height = max(0.32 * len(rows) + (1.4 if by_task else 2.8), 3.0 if by_task else 4.0)
        shape = (len(panels), 1) if by_task else (1, len(panels))  # many heads: panels stacked, one per task
        fig, axes = plt.subplots(*shape, figsize=(width * shape[1] + 1.8, height * shape[0] + 1.4 * by_task),
                                 sharey=True, squeeze=False, layout="constrained")
        for col, (ax, panel) in enumerate(zip(axes.flat, panels)):
            part = frame[frame.task == panel] if by_task else frame[frame.part == panel]
            grid = part.pivot_table(index="row", columns="part" if by_task else "task", values="alpha")
            grid = grid.reindex(index=rows, columns=columns)
            mesh = _heatmap(ax, grid, cmap="vlag", vmin=uniform - spread, vmax=uniform + spread, annot=annotate,
                            fmt=".2f", fontsize=8)
            ax.set_title(panel, fontsize=12)
            ax.set_xlabel("head / part" if by_task else "task")
            ax.set_ylabel("layer" if (col == 0 or by_task) and rows != ["model"] else "")
            ax.tick_params(axis="y", rotation=0)
            ax.tick_params(axis="x", rotation=0 if len(columns) <= 6 else 90)
        fig.colorbar(mesh, ax=axes, label=f"α (white: uniform 1/T = {uniform:.2g})",
                     shrink=0.9 if by_task else 1.0, aspect=40 if by_task else 20)
        _title(fig, f"Closed-form α per submodule, granularity {granularity} (seed 002 Eq. 12–14)", about)
    return fig


def alpha_objective(alphas: dict[str, xr.Dataset], about: str = "") -> plt.Figure | None:
    """How much the solved α lowers the merge objective (Eq. 10) below uniform 1/T, per module.

    y = 1 − objective(α) / objective(1/T) in percent; one panel per granularity, hue = level.
    """
    pieces = []
    for granularity, dataset in alphas.items():
        data = dataset.isel(granularity=0, drop=True)
        piece = pd.DataFrame({"objective α": data.objective_alpha.values, "objective 1/T": data.objective_uniform.values,
                              "level": _strings(data.level.values), "layer": data.layer.values})
        piece["granularity"] = granularity
        pieces.append(piece)
    if not pieces:
        return None
    frame = pd.concat(pieces).dropna(subset=["objective α", "objective 1/T"])
    frame = frame[frame["objective 1/T"] > 0]
    if frame.empty:
        return None
    frame["reduction"] = 100.0 * (1.0 - frame["objective α"] / frame["objective 1/T"])
    granularities = [g for g in GRANULARITY_ORDER if g in set(frame.granularity)]
    with sns.axes_style(_THEME["style"]), sns.plotting_context(_THEME["context"], font_scale=_THEME["font_scale"]):
        fig, axes = plt.subplots(1, len(granularities), figsize=(4.6 * len(granularities) + 1.8, 4.6),
                                 sharey=True, squeeze=False, layout="constrained")
        for ax, granularity in zip(axes[0], granularities):
            part = frame[frame.granularity == granularity]
            if (part.layer < 0).all():
                sns.barplot(part, x="level", y="reduction", color="C0", ax=ax)
                ax.set_xlabel("")
            else:
                sns.lineplot(part, x="layer", y="reduction", hue="level", hue_order=ordered_levels(part.level),
                             palette="deep", marker="o", ax=ax)
                _integer_ticks(ax, part.layer)
                ax.set_xlabel("layer")
                if part.level.nunique() > 1:
                    ax.legend(title="level", frameon=False, fontsize=10, title_fontsize=10)
                else:
                    ax.get_legend().remove()
            ax.axhline(0, color="black", linewidth=0.8)
            ax.set_title(granularity, fontsize=12)
            ax.set_ylabel("objective reduction vs 1/T (%)")
        _title(fig, "Merge objective (seed 002 Eq. 10): solved α vs uniform 1/T — higher is better", about)
    return fig


# ---------------------------------------------------------------------------- eval


def eval_bars(evaluation: xr.Dataset, about: str = "") -> plt.Figure | None:
    """Every (model, task) variable of group ``eval`` (loss, perplexity, ...) as grouped bars, one row each.

    The value axis is zoomed to the data (it need not start at 0) so that merges that differ
    by a few percent can be told apart; each bar is labelled with its value when few.
    """
    variables = _eval_variables(evaluation)
    if not variables:
        return None
    models = [str(m) for m in evaluation.model.values]
    tasks = [str(t) for t in evaluation.task.values]
    with sns.axes_style(_THEME["style"]), sns.plotting_context(_THEME["context"], font_scale=_THEME["font_scale"]):
        width = max(7.5, 0.42 * len(models) * len(tasks) + 3.0)
        fig, axes = plt.subplots(len(variables), 1, figsize=(width, 3.6 * len(variables) + 1.6),
                                 squeeze=False, layout="constrained")
        for row, (ax, name) in enumerate(zip(axes[:, 0], variables)):
            frame = long_frame(evaluation[name]).dropna(subset=[name])
            sns.barplot(frame, x="model", y=name, hue="task", order=models, hue_order=tasks, palette="colorblind",
                        ax=ax, legend=row == 0)
            low, high = float(frame[name].min()), float(frame[name].max())
            margin = 0.15 * (high - low) or 0.05 * abs(high) or 1.0
            ax.set_ylim(max(0.0, low - margin) if low >= 0 else low - margin, high + margin)
            if len(models) * len(tasks) <= 30:
                for container in ax.containers:
                    ax.bar_label(container, fmt="%.3g", fontsize=8, padding=2)
            ax.set_xlabel("")
            ax.set_ylabel(name + ("" if ax.get_ylim()[0] == 0 else "\n(axis not from 0)"))
            ax.tick_params(axis="x", rotation=25 if len(models) > 5 else 0)
            if len(models) > 5:
                for label in ax.get_xticklabels():
                    label.set_horizontalalignment("right")
        sns.move_legend(axes[0][0], "upper left", bbox_to_anchor=(1.01, 1), title="task", frameon=False)
        _title(fig, "Evaluation of the base, the fine-tunes and the merges (group eval)", about)
    return fig


def _eval_variables(evaluation: xr.Dataset) -> list[str]:
    names = [name for name, v in evaluation.data_vars.items() if set(v.dims) == {"model", "task"}]
    return sorted(names, key=lambda n: (("loss", "perplexity").index(n) if n in ("loss", "perplexity") else 2, n))


# ---------------------------------------------------------------------------- report


def _figures_of(registry: dict, root, groups: dict) -> list[tuple[str, Callable[[], plt.Figure | None]]]:
    """(file stem, drawing call) of every figure in `registry` whose group the store has."""
    return [(name, functools.partial(draw, groups[group], describe(root, groups[group])))
            for group, kinds in registry.items() if group in groups for name, draw in kinds]


def report(store_path: str | Path, out_dir: str | Path | None = None, *, console=None, dpi: int = 130) -> list[Path]:
    """Write one PNG per figure for the groups the store has (missing groups are skipped); return the paths.

    `out_dir` defaults to ``<store>-report`` next to the store. With a rich `console`,
    the summary tables are printed and each figure is listed as it is written.
    """
    store_path = Path(store_path)
    out_dir = Path(out_dir) if out_dir is not None else store_path.with_name(store_path.stem + "-report")
    notes = check_store(store_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    root, groups = load_groups(store_path)
    figures = _figures_of(FIGURES_BEFORE_ALPHA, root, groups)
    alphas = {path.split("/", 1)[1]: ds for path, ds in groups.items() if path.startswith("alpha/")}
    alphas = {g: alphas[g] for g in sorted(alphas, key=lambda g: (GRANULARITY_ORDER + (g,)).index(g))}
    for granularity, ads in alphas.items():
        figures.append((f"alpha_{granularity}", lambda ads=ads: alpha_heatmap(ads, describe(root, ads))))
    if alphas:
        first = next(iter(alphas.values()))
        figures.append(("alpha_objective", lambda: alpha_objective(alphas, describe(root, first))))
    figures += _figures_of(FIGURES_AFTER_ALPHA, root, groups)

    if console is not None:
        print_tables(summary_tables(store_path, groups=(root, groups)), console)
        for note in notes:
            console.print(f"[bold yellow]partial data:[/] {note}", highlight=False)
    written = []
    for name, make in figures:
        fig = make()
        if fig is None:
            continue
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=dpi, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
        if console is not None:
            console.print(f"wrote {path}")
    if console is not None and not written:
        console.print(f"[yellow]{store_path} has no group to plot[/] (it has: {', '.join(groups) or 'nothing'})")
    return written


# ---------------------------------------------------------------------------- tables


def summary_tables(store_path: str | Path, *, groups: tuple[dict, dict] | None = None) -> dict[str, pd.DataFrame]:
    """Summary tables of the groups the store has, as pandas DataFrames.

    - ``nonlinearity``: seed 002 Table 17 — mean and std of the score per level (rows) and task
      (columns (task, mean|std)), over modules and samples; NaN (unchanged modules) skipped.
    - ``projection``: per level, mean / std of the Projection Distance and mean cosines over
      modules and every (subset, α).
    - ``alpha``: per granularity, modules, mean α per task, the Eq. 10 objective summed over
      modules at α and at 1/T, least-squares fallbacks and the largest condition number.
    - ``interference``: per level, means over matrices (`interference_table` columns).
    - ``eval``: loss per model (rows) and task (columns) and every other (model, task) variable.
    """
    _, loaded = groups if groups is not None else load_groups(store_path)
    tables: dict[str, pd.DataFrame] = {}
    if "linearity" in loaded:
        ds = loaded["linearity"]
        frame = long_frame(ds.nonlinearity_score)
        table = frame.groupby(["level", "task"]).nonlinearity_score.agg(["mean", lambda v: v.std(ddof=0)])
        table.columns = ["mean", "std"]
        table = table.unstack("task").swaplevel(axis=1)
        tasks = [str(t) for t in ds.task.values]
        table = table.reindex(index=ordered_levels(table.index), columns=pd.MultiIndex.from_product([tasks, ["mean", "std"]]))
        table.index.name = "level"
        tables["nonlinearity"] = table
    if "projection" in loaded:
        ds = loaded["projection"]
        pd_frame = long_frame(ds.projection_distance)
        table = pd_frame.groupby("level").projection_distance.agg(["mean", lambda v: v.std(ddof=0)])
        table.columns = ["PD mean", "PD std"]
        table["cosine_merge"] = long_frame(ds.cosine_merge).groupby("level").cosine_merge.mean()
        table["cosine_base"] = long_frame(ds.cosine_base).groupby("level").cosine_base.mean()
        table = table.reindex(ordered_levels(table.index))
        table.index.name = "level"
        tables["projection"] = table
    alphas = {path.split("/", 1)[1]: ds for path, ds in loaded.items() if path.startswith("alpha/")}
    if alphas:
        rows = {}
        for granularity in sorted(alphas, key=lambda g: (GRANULARITY_ORDER + (g,)).index(g)):
            data = alphas[granularity].isel(granularity=0, drop=True)
            row = {"modules": data.sizes["module"]}
            for task in data.task.values:
                row[f"α {task} (mean)"] = float(data.alpha.sel(task=task).mean())
            row["objective α"] = float(data.objective_alpha.sum(skipna=True))
            row["objective 1/T"] = float(data.objective_uniform.sum(skipna=True))
            row["least squares"] = int(data.least_squares.sum())
            row["max condition"] = float(data.condition_number.max())
            rows[granularity] = row
        tables["alpha"] = pd.DataFrame.from_dict(rows, orient="index").rename_axis("granularity")
    if "interference" in loaded:
        table = interference_table(loaded["interference"])
        grouped = table.groupby("level").mean(numeric_only=True).drop(columns="layer")
        grouped.insert(0, "matrices", table.groupby("level").size())
        tables["interference"] = grouped.reindex(ordered_levels(grouped.index, ("attn", "mlp", "embed", "norm", "other")))
    if "eval" in loaded:
        ds = loaded["eval"]
        for name in _eval_variables(ds):
            table = ds[name].transpose("model", "task").to_pandas()
            table.index = pd.Index(_strings(table.index), name="model")
            table.columns = pd.Index(_strings(table.columns), name="task")
            tables[f"eval {name}"] = table
    return tables


def _cell(value) -> str:
    if isinstance(value, (float, np.floating)):
        return "—" if np.isnan(value) else f"{value:.4g}"
    return str(value)


def print_tables(tables: dict[str, pd.DataFrame], console=None) -> None:
    """Print `summary_tables` output as rich tables (mean and std columns shown as "mean ± std")."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    titles = {"nonlinearity": "Non-linearity Score (seed 002 Eq. 19), mean ± std over modules and samples",
              "projection": "Projection Distance and cosines (seed 002 Eq. 8, 16, 17), over modules and (subset, α)",
              "alpha": "Closed-form α per granularity (seed 002 Eq. 12–14); objectives summed over modules",
              "interference": "Weight-space interference, mean over matrices per level",
              "eval loss": "Evaluation: loss per model and task", "eval perplexity": "Evaluation: perplexity"}
    for key, frame in tables.items():
        table = Table(title=titles.get(key, key), title_justify="left")
        table.add_column(frame.index.name or "")
        if isinstance(frame.columns, pd.MultiIndex) and list(frame.columns.levels[1]) == ["mean", "std"]:
            tasks = list(dict.fromkeys(frame.columns.get_level_values(0)))
            for task in tasks:
                table.add_column(str(task), justify="right")
            for index, row in frame.iterrows():
                table.add_row(str(index), *[
                    "—" if np.isnan(row[(t, "mean")]) else f"{row[(t, 'mean')]:.4g} ± {row[(t, 'std')]:.2g}"
                    for t in tasks])
        else:
            for column in frame.columns:
                table.add_column(str(column), justify="right")
            for index, row in frame.iterrows():
                table.add_row(str(index), *[_cell(v) for v in row.tolist()])
        console.print(table)


# ---------------------------------------------------------------------------- compare


def compare_leaderboard(comparison: xr.Dataset, about: str = "") -> plt.Figure | None:
    """Group ``compare`` as a leaderboard: mean normalised gain per method (bars, best on top) and each
    task's gain (dots). 0 is the base, 1 the task's own fine-tune (dashed lines)."""
    if "mean_gain" not in comparison or comparison.sizes.get("method", 0) == 0:
        return None
    methods = [str(m) for m in comparison.method.values]
    mean = pd.Series(comparison.mean_gain.values, index=methods).sort_values(ascending=True, na_position="first")
    frame = long_frame(comparison.gain)
    kinds = dict(zip(methods, _strings(comparison.kind.values))) if "kind" in comparison.coords else {}
    palette = {"plan": "#c0392b", "closed-form": "#e67e22", "strategy": "#7f8c8d", "base": "#34495e",
               "finetune": "#2980b9"}
    with sns.axes_style(_THEME["style"]), sns.plotting_context(_THEME["context"], font_scale=_THEME["font_scale"]):
        fig, ax = plt.subplots(figsize=(8.5, 0.38 * len(methods) + 1.8), layout="constrained")
        positions = np.arange(len(mean))
        ax.barh(positions, mean.fillna(0).values, color=[palette.get(kinds.get(m, "strategy"), "#7f8c8d")
                                                         for m in mean.index], alpha=0.85)
        order = {m: i for i, m in enumerate(mean.index)}
        for task, marker in zip(_strings(comparison.task.values), ("o", "s", "^", "D", "v", "P")):
            rows = frame[frame.task == task]
            ax.scatter(rows.gain, [order[m] for m in rows.method], marker=marker, s=22, color="black",
                       zorder=3, label=task)
        for value in (0.0, 1.0):
            ax.axvline(value, color="black", linestyle="--", linewidth=0.8)
        ax.set_yticks(positions, mean.index)
        ax.set_xlabel("normalised gain (base − model) / (base − fine-tune); bars: mean over tasks")
        ax.legend(title="task", loc="lower right", frameon=True, fontsize=8)
        _title(fig, "Held-out leaderboard of merges (group compare)", about)
    return fig


# store group -> the figures drawn from it (file stem, function(dataset, about)), in report order
FIGURES_BEFORE_ALPHA = {
    "linearity": [("nonlinearity_per_layer", nonlinearity_per_layer), ("nonlinearity_by_level", nonlinearity_by_level)],
    "projection": [("projection_distance_pairs", projection_pairs), ("projection_distance_multi", projection_multi),
                   ("projection_distance_per_layer", projection_per_layer)],
}
FIGURES_AFTER_ALPHA = {
    "interference": [("interference_per_layer", interference_per_layer), ("interference_rank", interference_rank)],
    "eval": [("eval", eval_bars)],
    "compare": [("compare", compare_leaderboard)],
}

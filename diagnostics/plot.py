"""Figures: seaborn / matplotlib helpers that take data and draw it; nothing here knows a store group.

Each store group's owner (`submerge.diagnostics.groups`) draws its own figures with these helpers, beside the table
and the layout of the data they show; `submerge.cli.report.report` writes every figure of a store as PNG.

    >>> from submerge.diagnostics import plot
    >>> with plot.styled("white") as (plt, sns):
    ...     fig, ax = plt.subplots(layout="constrained")
    ...     plot.heatmap(ax, grid, cmap="mako_r", vmin=0, vmax=1, annot=True)
    ...     plot.title(fig, "What it shows", plot.describe(root_attrs, dataset))

matplotlib and seaborn are imported by the first figure (`styled`), not with this module, so `diag --help` and the
commands that draw nothing start without them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import xarray as xr

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_CONTEXT, _FONT_SCALE = "notebook", 1.05


@contextmanager
def styled(style: str = "whitegrid") -> Iterator[tuple]:
    """(matplotlib.pyplot, seaborn) inside the figures' seaborn style and plotting context."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    with sns.axes_style(style), sns.plotting_context(_CONTEXT, font_scale=_FONT_SCALE):
        yield plt, sns


def save(fig: Figure, path: Path, dpi: int = 130) -> None:
    """Write `fig` to `path` (PNG) and close it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)


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
    if dataset is not None and "task" in dataset.dims:  # a group over fine-tunes (accuracy's task is a benchmark)
        text += " · fine-tunes: " + ", ".join(str(t) for t in dataset.task.values)
    return text


def title(fig: Figure, what: str, about: str) -> None:
    """The figure's title: what it shows, and under it the "base · fine-tunes" line."""
    fig.suptitle(f"{what}\n{about}", fontsize=13)


def legend_outside(ax, title: str | None = None) -> None:
    """Move the axes' seaborn legend to the right of the axes, without a frame (`title`: a new legend title)."""
    import seaborn as sns

    sns.move_legend(ax, "upper left", bbox_to_anchor=(1.01, 1), frameon=False,
                    **({} if title is None else {"title": title}))


def tilt_labels(ax, rotation: float) -> None:
    """Rotate the x tick labels by `rotation` degrees, right-aligned to their ticks when rotated."""
    ax.tick_params(axis="x", rotation=rotation)
    if rotation:
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")


def integer_ticks(ax, values) -> None:
    """Integer ticks on the x axis (layers), at most 12."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(12, max(2, len(set(values))))))


def _label_step(count: int, most: int) -> int:
    """Every n-th tick label so that at most `most` show (explicit: seaborn's "auto" redraws the figure)."""
    return max(1, -(-count // most))


def heatmap(ax, grid: pd.DataFrame, *, cmap: str, vmin: float, vmax: float, annot=False, fmt: str = ".2f",
            fontsize: float = 9, square: bool = False, most_x: int = 40, most_y: int = 48):
    """A seaborn-style heatmap of `grid` (rows top to bottom) drawn with pcolormesh; returns the mesh.

    (`seaborn.heatmap` redraws the whole figure once per call to check tick overlap, which is
    quadratic in the number of panels.) `annot`: True to print the values, or an array to print.
    """
    import seaborn as sns

    values = grid.to_numpy(dtype=float)
    rows, cols = values.shape
    mesh = ax.pcolormesh(np.arange(cols + 1), np.arange(rows + 1), np.ma.masked_invalid(values),
                         cmap=sns.color_palette(cmap, as_cmap=True), vmin=vmin, vmax=vmax)
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
        _annotate(ax, mesh, values, values if annot is True else np.asarray(annot, dtype=float), fmt, fontsize)
    return mesh


def _annotate(ax, mesh, values: np.ndarray, labels: np.ndarray, fmt: str, fontsize: float) -> None:
    """Print `labels` in the cells, white on dark colours."""
    colours = mesh.to_rgba(values)
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            if np.isnan(values[i, j]) or np.isnan(labels[i, j]):
                continue
            red, green, blue = colours[i, j, :3]
            dark = 0.2126 * red + 0.7152 * green + 0.0722 * blue < 0.45
            ax.text(j + 0.5, i + 0.5, format(labels[i, j], fmt), ha="center", va="center", fontsize=fontsize,
                    color="white" if dark else "black")

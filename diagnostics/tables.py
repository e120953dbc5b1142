"""Tables: store data as pandas frames, and the one way every summary table is shown on a terminal.

    >>> from submerge.diagnostics.tables import long_frame, print_table
    >>> frame = long_frame(dataset.nonlinearity_score)       # one row per value, coordinates as columns
    >>> print_table(summary, "Non-linearity Score")          # a rich table (mean and std as "mean ± std")

Each store group's owner builds its summary table with these helpers (`submerge.diagnostics.groups`); its command and
`diag report` both print it with `print_table`, so they show the same table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import xarray as xr
from rich.console import Console
from rich.table import Table

# the order levels are listed in (tables, figures); the tensor table's levels of weight matrices follow
LEVEL_ORDER = ("model", "layer", "attn", "mlp", "head", "linear", "embed", "norm", "final")


def strings(values: Iterable) -> list[str]:
    """Labels as Python str (store coordinates come back as numpy StringDType, a driver's as objects)."""
    return [str(value) for value in values]


def ordered(values: Iterable, order: Sequence[str] = LEVEL_ORDER) -> list[str]:
    """The distinct labels of `values`, those in `order` first in that order, the others sorted after."""
    present = set(strings(values))
    return [label for label in order if label in present] + sorted(present - set(order))


def long_frame(array: xr.DataArray) -> pd.DataFrame:
    """Long DataFrame of a DataArray with its coordinates, strings as Python str."""
    frame = array.to_dataframe().reset_index()
    for column in frame.columns:
        if frame[column].dtype == object or str(frame[column].dtype).startswith(("str", "string")):
            frame[column] = frame[column].astype(str)
    return frame


def _cell(value) -> str:
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (float, np.floating)):
        return "—" if np.isnan(value) else f"{value:.4g}"
    return str(value)


def _mean_std(mean, std, floor=np.nan, flag="") -> str:
    if np.isnan(mean):
        return "—"
    text = f"{mean:.4g}" if np.isnan(std) else f"{mean:.4g} ± {std:.2g}"
    if not np.isnan(floor):
        text += f" (floor {floor:.2g})"
    return f"{text} {flag}" if flag else text


def _is_mean_std(columns: pd.Index) -> bool:
    if not (isinstance(columns, pd.MultiIndex) and columns.nlevels == 2):
        return False
    parts = set(columns.get_level_values(1))
    return {"mean", "std"} <= parts <= {"mean", "std", "floor", "flag"} or parts == {"mean", "stderr"}


def render_table(frame: pd.DataFrame, title: str) -> Table:
    """`frame` as a rich Table: one column per index level, then the columns (numbers to 4 significant digits,
    NaN as "—"); columns (key, "mean") and (key, "std") (or (key, "stderr"): a standard error) become one column
    "mean ± std" per key, followed by "(floor f)" and the flag where (key, "floor") and (key, "flag") exist (a noise
    floor: `linearity.floor`)."""
    table = Table(title=title, title_justify="left")
    names = [name or "" for name in frame.index.names]
    for name in names:
        table.add_column(str(name))
    index = [key if isinstance(key, tuple) else (key,) for key in frame.index]
    if _is_mean_std(frame.columns):
        keys = list(dict.fromkeys(frame.columns.get_level_values(0)))
        spread = "std" if "std" in frame.columns.get_level_values(1) else "stderr"
        for key in keys:
            table.add_column(str(key), justify="right")
        for labels, (_, row) in zip(index, frame.iterrows()):
            table.add_row(*map(str, labels), *[_mean_std(row[(key, "mean")], row[(key, spread)],
                                                         row.get((key, "floor"), np.nan), row.get((key, "flag"), ""))
                                               for key in keys])
        return _flag_caption(table, frame)
    for column in frame.columns:
        table.add_column(" ".join(map(str, column)) if isinstance(column, tuple) else str(column), justify="right")
    for labels, (_, row) in zip(index, frame.iterrows()):
        table.add_row(*map(str, labels), *[_cell(value) for value in row.tolist()])
    return _flag_caption(table, frame)


def _flag_caption(table: Table, frame: pd.DataFrame) -> Table:
    """The caption that explains the noise-floor flag "⚠ k/n", when a cell has one."""
    if any(isinstance(value, str) and value.startswith("⚠") for value in frame.to_numpy().ravel()):
        table.caption = "⚠ k/n: k of the n scores are within 10× of their noise floor (rounding at the compute dtype)"
    return table


def print_table(frame: pd.DataFrame, title: str, console=None) -> None:
    """Print `render_table(frame, title)` on `console` (a new rich Console when None)."""
    (console or Console()).print(render_table(frame, title))

"""Store groups and their owners: what each group holds, its summary table and its figures.

Every store group has one owner, the driver module that writes it. The owner defines one `StoreGroup`: the group's
layout (its name, the dimension its units are appended along, each variable's dimensions), ``summary(dataset)`` (the
table its command prints and `diag report` prints again: one function, one set of column names) and ``figures``
(file stem → drawing function). The pure equations stay apart from it (`linearity/equations.py`,
`interference/metrics.py`) and `submerge.diagnostics.plot` only draws: xclim's split of indices (equations) and
indicators (what is computed, stored and shown) is the model.

| group | owner | written by |
|---|---|---|
| ``linearity`` | `submerge.diagnostics.linearity.nonlinearity.LINEARITY` | ``diag linearity`` |
| ``projection`` | `submerge.diagnostics.linearity.projection.PROJECTION` | ``diag projection`` |
| ``alpha/<granularity>`` | `submerge.diagnostics.linearity.alpha.ALPHA` | ``diag alpha`` |
| ``interference`` | `submerge.diagnostics.interference.driver.INTERFERENCE` | ``diag interference`` |
| ``eval`` | `submerge.diagnostics.evaluate.EVAL` | ``diag eval`` |
| ``evidence`` | `submerge.diagnostics.linearity.evidence.EVIDENCE` | ``diag compare`` (its evidence step) |
| ``compare`` | `submerge.merge.compare.COMPARE` | ``diag compare`` |
| ``accuracy`` | `submerge.diagnostics.harness.ACCURACY` | ``diag eval --lm-eval`` |
| ``compare_accuracy`` | `submerge.diagnostics.harness.COMPARE_ACCURACY` | ``diag compare --lm-eval`` |

`submerge.cli.report.OWNERS` lists them in report order; a new group defines its `StoreGroup` in its driver module
and adds it there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import xarray as xr

from submerge.diagnostics.errors import StoreError
from submerge.diagnostics.store import Store
from submerge.diagnostics.tables import print_table


@dataclass(frozen=True)
class StoreGroup:
    """One store group as its owner defines it.

    - ``name``: the group (``per``: the family of groups ``name/<per>``, e.g. ``alpha/layer``);
    - ``dim``: the dimension the driver appends its units along (``UnitWriter``'s ``dim``);
    - ``variables``: each data variable and its dimensions (a stored group has exactly these);
    - ``title``: the summary table's title (or a function of the dataset giving it);
    - ``summary``: dataset → pandas DataFrame, the group's summary table;
    - ``figures``: file stem → ``draw(dataset, about)`` returning a matplotlib Figure, or None when the data
      has nothing to draw (``about``: the "base · fine-tunes" line under the title).
    """

    name: str
    dim: str
    variables: Mapping[str, tuple[str, ...]]
    title: str | Callable[[xr.Dataset], str]
    summary: Callable[[xr.Dataset], pd.DataFrame]
    figures: Mapping[str, Callable] = field(default_factory=dict)
    per: str | None = None

    def owns(self, path: str) -> bool:
        """Whether the store group at `path` ("alpha/layer", "linearity") is one of this owner's."""
        head, _, rest = path.partition("/")
        return head == self.name and bool(rest) == (self.per is not None) and "/" not in rest

    def check(self, dataset: xr.Dataset, where: str = "") -> None:
        """StoreError naming the variable when `dataset` lacks one of the layout's variables or has it over other
        dimensions (a group written by another version of submerge, or not by its driver)."""
        for variable, dims in self.variables.items():
            if variable not in dataset.data_vars:
                raise StoreError(f"group '{self.name}'{where} has no variable '{variable}' (its layout: "
                                 f"{', '.join(self.variables)}); write it again with its command")
            if tuple(dataset[variable].dims) != tuple(dims):
                raise StoreError(f"group '{self.name}'{where}: variable '{variable}' is over {dataset[variable].dims}, "
                                 f"the layout says {tuple(dims)}")

    def table_title(self, dataset: xr.Dataset) -> str:
        return self.title(dataset) if callable(self.title) else self.title

    def print_summary(self, dataset: xr.Dataset, console=None, *, where: str = "") -> pd.DataFrame:
        """Print the group's summary table (the same for its command and `diag report`) and return it."""
        self.check(dataset, where)
        frame = self.summary(dataset)
        print_table(frame, self.table_title(dataset), console)
        return frame

    def figure_stem(self, path: str, name: str) -> str:
        """The file stem of figure `name` of the group at `path`: "alpha_layer" for figure "alpha" of alpha/layer."""
        _, _, part = path.partition("/")
        return f"{name}_{part}" if part else name


def load_groups(store_path: str | Path) -> tuple[dict, dict[str, xr.Dataset]]:
    """(root attrs, {group path: loaded Dataset}) for every group of the store that holds data."""
    tree = Store(store_path).open()
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

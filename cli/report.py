"""`diag report`: every group of a store, its summary table and its figures, as its owner defines them.

    >>> from submerge.cli.report import report, summary_tables
    >>> paths = report("runs/llama2.zarr", "runs/llama2-report")    # PNG files, one per figure
    >>> tables = summary_tables("runs/llama2.zarr")                  # {group: pandas DataFrame}

A group's table here is the one its command printed (`StoreGroup.print_summary`: one function, one set of column
names); groups missing from the store are skipped. This module sits above every owner (the ``compare`` group's is in
`submerge.merge`), which is why it lives with the command line; it computes nothing itself.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from submerge.diagnostics.evaluate import EVAL
from submerge.diagnostics.groups import StoreGroup, check_store, load_groups
from submerge.diagnostics.harness import ACCURACY, COMPARE_ACCURACY
from submerge.diagnostics.interference import INTERFERENCE
from submerge.diagnostics.linearity import ALPHA, EVIDENCE, LINEARITY, PROJECTION
from submerge.diagnostics.modules import GRANULARITIES
from submerge.diagnostics.plot import describe, save
from submerge.diagnostics.tables import ordered
from submerge.merge.compare import COMPARE

#: Every group's owner, in report order. A new group (``evidence``, after ALPHA) adds its owner here.
OWNERS: tuple[StoreGroup, ...] = (LINEARITY, PROJECTION, ALPHA, INTERFERENCE, EVAL, ACCURACY, EVIDENCE, COMPARE,
                                   COMPARE_ACCURACY)


def owner_of(path: str) -> StoreGroup | None:
    """The owner of the store group at `path` ("linearity", "alpha/layer"), None for a group no owner knows."""
    return next((owner for owner in OWNERS if owner.owns(path)), None)


def in_report_order(paths) -> list[tuple[str, StoreGroup]]:
    """(path, owner) of each group path that has an owner, in `OWNERS` order (alpha/<granularity>: coarsest first)."""
    found = [(path, owner_of(path)) for path in paths]
    parts = ordered([path.partition("/")[2] for path, _ in found], tuple(GRANULARITIES))
    return sorted(((path, owner) for path, owner in found if owner is not None),
                  key=lambda item: (OWNERS.index(item[1]), parts.index(item[0].partition("/")[2])))


def summary_tables(store_path: str | Path, *, groups: tuple[dict, dict] | None = None) -> dict[str, pd.DataFrame]:
    """{group path: its owner's summary table} for every group of the store that has an owner."""
    _, loaded = groups if groups is not None else load_groups(store_path)
    tables = {}
    for path, owner in in_report_order(loaded):
        owner.check(loaded[path], f" of {store_path}")
        tables[path] = owner.summary(loaded[path])
    return tables


def report(store_path: str | Path, out_dir: str | Path | None = None, *, console=None, dpi: int = 130) -> list[Path]:
    """Write one PNG per figure of the groups the store has (missing groups are skipped); return the paths.

    `out_dir` defaults to ``<store>-report`` next to the store. With a rich `console`, each group's summary
    table is printed (as its command printed it), then each figure is listed as it is written.
    """
    store_path = Path(store_path)
    out_dir = Path(out_dir) if out_dir is not None else store_path.with_name(store_path.stem + "-report")
    notes = check_store(store_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    root, groups = load_groups(store_path)
    chosen = in_report_order(groups)
    for path, owner in chosen:
        owner.check(groups[path], f" of {store_path}")
    if console is not None:
        for path, owner in chosen:
            owner.print_summary(groups[path], console)
        for path in sorted(groups.keys() - {path for path, _ in chosen}):
            console.print(f"[yellow]group {path}[/]: no owner knows it (no table, no figure)", highlight=False)
        for note in notes:
            console.print(f"[bold yellow]partial data:[/] {note}", highlight=False)
    written = []
    for path, owner in chosen:
        for name, draw in owner.figures.items():
            fig = draw(groups[path], describe(root, groups[path]))
            if fig is None:
                continue
            written.append(out_dir / f"{owner.figure_stem(path, name)}.png")
            save(fig, written[-1], dpi)
            if console is not None:
                console.print(f"wrote {written[-1]}")
    if console is not None and not written:
        console.print(f"[yellow]{store_path} has no group to plot[/] (it has: {', '.join(groups) or 'nothing'})")
    return written

"""The streaming interference driver: every 2-D weight matrix of a checkpoint, one matrix at a time.

:func:`interference` reads each matrix's T task matrices lazily (through
``submerge.diagnostics.task_vectors.TaskVectorReader``), measures them with
:func:`submerge.diagnostics.interference.metrics.task_matrix_interference`, builds an
``xarray.Dataset`` over (matrix, task, task_other, rank_frac, centered) and
writes the store group ``interference`` through ``submerge.diagnostics.store.UnitWriter``
(resume, provenance). It owns the group (`INTERFERENCE`: layout, summary table, figures): :func:`matrix_table`
gives one row per matrix and :func:`summary` the means per level (or per level and layer).

The dataset has dims matrix, task, task_other, rank_frac, centered (False:
plain Δ_t, True: centred Δ̄_t) and variables task_vector_norm, effective_rank,
sar (matrix, task); cosine, sign_conflict (matrix, task, task_other); sti,
sti_normalized, sti_k, sar_k (matrix); rank (matrix, rank_frac);
row_space_interference, reconstruction_error (matrix, rank_frac, centered).
Coordinates along matrix: the parameter name, and module, layer, level (from
the tensor table), rows, cols.  The attrs name every rule (k, ε, norms, SVD
dtype).

What each tensor is (matrix order, level / layer / module coordinates, tied
embeddings, GPT-2 ``Conv1D`` weights stored (in, out)) comes from the tensor
table ``submerge.diagnostics.tensors.TensorTable``.

The per-matrix work (`submerge.diagnostics.interference.jobs`) runs on the run's engine
(`submerge.diagnostics.execution`: this process or Ray workers); this process alone writes the store.
SAR against a merge strategy takes that strategy as a callable (``sar_against``: e.g.
``submerge.merge.strategies.MergedTaskVector("ties")``): nothing in ``diagnostics`` imports ``merge``.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterator, Sequence
from contextlib import closing

import numpy as np
import pandas as pd
import torch
import xarray as xr

from submerge.diagnostics import plot
from submerge.diagnostics.checkpoints import CheckpointReader
from submerge.diagnostics.errors import SelectionError
from submerge.diagnostics.execution import RunSettings
from submerge.diagnostics.groups import StoreGroup
from submerge.diagnostics.interference.jobs import InterferenceTask, MatrixJob, MergedMatrix, measure_matrix
from submerge.diagnostics.interference.metrics import (
    DEFAULT_RANK_FRACS,
    SAR_EPS,
    rank_from_fraction,
)
from submerge.diagnostics.placement import pick_device
from submerge.diagnostics.progress import progress_bar
from submerge.diagnostics.spectral import svd_dtype as _svd_dtype
from submerge.diagnostics.store import UnitWriter
from submerge.diagnostics.tables import long_frame, ordered, strings
from submerge.diagnostics.task_vectors import TaskVectorReader
from submerge.diagnostics.tensors import TensorTable

# MatrixJob, measure_matrix: from jobs
__all__ = ["INTERFERENCE", "SVD_ROUTES", "MatrixJob", "interference", "matrix_table", "measure_matrix"]

INTERFERENCE_RANK_FRAC = 0.08  # CART's reported optimum: the I(k) of the tables and the per-layer figure
SVD_ROUTES = {
    "gram": "Gram route: each matrix's singular values and short-side singular vectors from the symmetric "
            "eigendecomposition (LAPACK syevd) of its r × r Gram matrix, built from the cross-Gram products of the task "
            "matrices; σ < 0.1 σ_max of each Δ_t and Δ̄_t recomputed as ‖Δ y‖; STI, SAR, I(k), R(k) within 1e-4 of "
            "the exact route (submerge.diagnostics.interference.gram)",
    "exact": "torch.linalg.svd, full thin SVD (exact)",
}


def _check_settings(svd_dtype, rank_fracs: Sequence[float]) -> None:
    """Fail on a bad SVD dtype or rank fraction before any work."""
    _svd_dtype(svd_dtype)
    for frac in rank_fracs:
        rank_from_fraction(frac, 1)  # validates the fraction


def _sar_reference(sar_against) -> tuple[str, dict, object]:
    """(label, options, Δ_M callable or None) of ``sar_against``: "ta" or a merge strategy's callable."""
    if isinstance(sar_against, str):
        if sar_against != "ta":
            raise ValueError(f"sar_against={sar_against!r}: give 'ta' (task arithmetic) or a merge strategy as a "
                             f"callable, e.g. submerge.merge.strategies.MergedTaskVector({sar_against!r})")
        return "ta", {}, None
    if not callable(sar_against):
        raise TypeError(f"sar_against must be 'ta' or a callable (name, task_matrices, kind) → Δ_M, got "
                        f"{type(sar_against).__name__}")
    return (str(getattr(sar_against, "label", getattr(sar_against, "__name__", repr(sar_against)))),
            dict(getattr(sar_against, "options", None) or {}), sar_against)


def _plan_matrices(base, task_readers: dict, table, matrices, transposed):
    """(table, matrix names in order without tied duplicates, {duplicate: kept}, Conv1D names) from the table."""
    if table is None:

        table = TensorTable.from_reader(base)
    names = _matrix_names(base, table, matrices)
    duplicates = _tied_duplicates(base, table, {t: r.finetuned for t, r in task_readers.items()}, names)
    names = [name for name in names if name not in duplicates]
    transposed = set(transposed) if transposed is not None else {info.name for info in table if info.transposed}
    return table, names, duplicates, frozenset(transposed)


def _matrix_names(base, table, names: Sequence[str] | None) -> list[str]:
    """The matrices measured: every weight matrix of the table, ordered by (layer, name), or those ``names`` give.

    A name with a glob character (``*?[``) is a pattern (`fnmatch`, case-sensitive) over the weight matrices, in
    their order; any other name is a checkpoint tensor taken as it is. Each matrix once, in the order given."""
    found = [name for name in base.names() if table.get(name, base.shape(name)).is_weight_matrix]
    every = sorted(found, key=lambda name: (table.get(name).layer, name))  # layer 2 before layer 10
    if names is None:
        return every
    chosen = []
    for name in names:
        if any(c in name for c in "*?["):
            matched = [m for m in every if fnmatch.fnmatchcase(m, name)]
            if not matched:
                raise SelectionError(f"matrices pattern '{name}' matches no weight matrix of {base.spec} "
                                     f"(they are named like {', '.join(every[:2])} …)")
            chosen += matched
        elif name not in base:
            raise SelectionError(f"matrices not in the base checkpoint {base.spec}: {name}")
        else:
            chosen.append(name)
    return list(dict.fromkeys(chosen))


def _tied_duplicates(base, table, readers: dict, names: list[str]) -> dict[str, str]:
    """Embedding-level matrices stored twice with equal values (tied lm_head = embed) → {duplicate: kept}."""
    # In the table's (model parameter) order: the input embedding, which a tied output
    # embedding's `tied_to` names, comes first and is the one kept.
    position = {name: index for index, name in enumerate(table.names())}
    embed = sorted((name for name in names if table.get(name).level == "embed"),
                   key=lambda name: position.get(name, len(position)))
    duplicates: dict[str, str] = {}
    for i, first in enumerate(embed):
        for second in embed[i + 1 :]:
            if second in duplicates or base.shape(first) != base.shape(second):
                continue
            if not torch.equal(base.get(first), base.get(second)):
                continue
            if all(torch.equal(reader.get(first), reader.get(second)) for reader in readers.values()):
                duplicates[second] = first
    return duplicates


def _matrices_dataset(table, names, shapes, results, task_names, rank_fracs):
    """One Dataset (no attrs) for the given matrices; see :func:`interference`."""
    locations = [table.get(name) for name in names]
    num_tasks, num_fracs = len(task_names), len(rank_fracs)

    def stacked(key, shape, dtype=np.float64):
        if not results:
            return np.zeros((0, *shape), dtype=dtype)
        return np.stack([np.asarray(r[key], dtype=dtype) for r in results])

    matrix, task, pair = ("matrix",), ("matrix", "task"), ("matrix", "task", "task_other")
    curve = ("matrix", "rank_frac", "centered")
    return xr.Dataset(
        {
            "task_vector_norm": (task, stacked("task_vector_norm", (num_tasks,))),
            "effective_rank": (task, stacked("effective_rank", (num_tasks,))),
            "cosine": (pair, stacked("cosine", (num_tasks, num_tasks))),
            "sign_conflict": (pair, stacked("sign_conflict", (num_tasks, num_tasks))),
            "sti": (matrix, stacked("sti", ())),
            "sti_normalized": (matrix, stacked("sti_normalized", ())),
            "sti_k": (matrix, stacked("sti_k", (), np.int64)),
            "sar": (task, stacked("sar", (num_tasks,))),
            "sar_k": (matrix, stacked("sar_k", (), np.int64)),
            "rank": (("matrix", "rank_frac"), stacked("ranks", (num_fracs,), np.int64)),
            "row_space_interference": (curve, stacked("row_space_interference", (num_fracs, 2))),
            "reconstruction_error": (curve, stacked("reconstruction_error", (num_fracs, 2))),
        },
        coords={
            "matrix": np.array(names, dtype=object),
            "module": ("matrix", np.array([loc.module for loc in locations], dtype=object)),
            "layer": ("matrix", np.array([loc.layer for loc in locations], dtype=np.int64)),
            "level": ("matrix", np.array([loc.level for loc in locations], dtype=object)),
            "rows": ("matrix", np.array([shape[0] for shape in shapes], dtype=np.int64)),
            "cols": ("matrix", np.array([shape[1] for shape in shapes], dtype=np.int64)),
            "task": np.array(task_names, dtype=object),
            "task_other": np.array(task_names, dtype=object),
            "rank_frac": np.asarray(rank_fracs, dtype=np.float64),
            "centered": np.array([False, True]),
        },
    )


def _notes(job: MatrixJob, device, duplicates: dict[str, str]) -> dict:
    """The attrs of the result: every rule the metrics follow, and the choices of this run."""
    return {
        "task_matrix": "Δ_t = W_t − W_0; centered: Δ̄_t = W_t − mean_s W_s",
        "norm": "Frobenius",
        "effective_rank": "Roy & Vetterli 2007: exp of the Shannon entropy of σ_i / Σσ",
        "sign_conflict_denominator": "all entries of the matrix",
        "sti_equation": "seed 003, TSV-M: ‖(UᵀU − I) Σ (VᵀV − I)‖₁ entrywise (sum of |entries|)",
        "sti_rank_rule": "k = max(1, floor(min(m, n) / T)); a task of lower numerical rank keeps its non-zero directions",
        "sti_normalized": "sti / Σσ of the kept singular values",
        "sar_equation": "seed 003, Iso-C: ‖U_k U_kᵀ Δ_t‖_F / ‖Δ_t‖_F, U_k top k_M left singular vectors of Δ_M",
        "sar_k_rule": "k_M = min{k : Σ_{i>k} σ_i² ≤ ε² Σ σ_i²} of Δ_M",
        "sar_eps": float(job.eps),
        "sar_against": job.sar_against,
        "sar_options": dict(job.sar_options or {}),
        "rank_rule": "k = max(1, floor(frac · min(m, n) + 0.5)), capped at min(m, n)",
        "row_space_interference": "seed 003, CART: I(k) = Σ_{i≠j} ‖Σ̃_i Ṽ_iᵀ Ṽ_j Σ̃_j‖_F, σ̃ = σ / sqrt(Σ_{i≤k} σ²)",
        "reconstruction_error": "seed 003, CART: R(k) = Σ_t Σ_{i>k} σ_{t,i}²",
        "svd": SVD_ROUTES["exact" if job.exact_svd else "gram"],
        "svd_dtype": str(_svd_dtype(job.svd_dtype)).removeprefix("torch."),
        "device": str(device),
        "tied_duplicates": dict(duplicates),
        "transposed": sorted(job.transposed),
    }


def _open_writer(store, job: MatrixJob, base, task_readers: dict, matrices, *, force: bool, command: str | None,
                 engine: dict):
    """The `UnitWriter` of group ``interference`` (store None: results are only gathered)."""

    settings = {
        "tasks": list(task_readers), "rank_fracs": [float(f) for f in job.rank_fracs],
        "sar_against": job.sar_against, "sar_options": dict(job.sar_options or {}), "eps": float(job.eps),
        "svd_dtype": str(_svd_dtype(job.svd_dtype)).removeprefix("torch."),
        "svd": "exact" if job.exact_svd else "gram",
        "matrices": list(matrices) if matrices is not None else "all", "transposed": sorted(job.transposed),
    }
    if store is None:  # the settings still go on the result
        return UnitWriter(None, INTERFERENCE.name, settings, dim=INTERFERENCE.dim)
    inputs = {"base_model": base.fingerprint(),
              "finetuned": {task: reader.finetuned.fingerprint() for task, reader in task_readers.items()}}
    inputs["engine"] = engine  # provenance only: a run resumes across engines
    return UnitWriter(store, INTERFERENCE.name, settings, dim=INTERFERENCE.dim, force=force, inputs=inputs,
                      command=command)


def _task_readers(base, finetuned: dict) -> dict:
    """task → TaskVectorReader (CheckpointReaders, LoRA readers included, are wrapped against ``base``)."""

    if not finetuned:
        raise ValueError("finetuned is empty: need at least one fine-tuned model")
    for task, reader in finetuned.items():
        if not isinstance(reader, (TaskVectorReader, CheckpointReader)):
            raise TypeError(f"finetuned['{task}'] must be a CheckpointReader or TaskVectorReader, "
                            f"got {type(reader).__name__}")
    return {task: reader if isinstance(reader, TaskVectorReader) else TaskVectorReader(task, base, reader)
            for task, reader in finetuned.items()}


def _results(names: list[str], base, task_readers: dict, job: MatrixJob, device: str, engine) -> Iterator:
    """(name, shape, result) of every matrix in order, measured on `engine` in the engine's groups."""
    groups = engine.groups(names, [math.prod(base.shape(name)) for name in names])
    for group in engine.map(InterferenceTask.of(base, task_readers, job, device), groups):
        yield from group


def _write_in_groups(writer, results: Iterator, flush_every: int, make_piece, on_done) -> None:
    """Append the results to ``writer`` ``flush_every`` matrices at a time (one unit per group)."""
    buffer: list[tuple] = []
    for item in results:
        buffer.append(item)
        on_done(item[0])
        if len(buffer) >= flush_every:
            writer.add(make_piece(buffer), buffer[-1][0])
            buffer = []
    if buffer:
        writer.add(make_piece(buffer), buffer[-1][0])


def interference(
    base,
    finetuned: dict,
    *,
    rank_fracs: Sequence[float] = DEFAULT_RANK_FRACS,
    sar_against: str | MergedMatrix = "ta",
    eps: float = SAR_EPS,
    svd_dtype: str = "float32",
    exact_svd: bool = False,
    device: str = "auto",
    matrices: Sequence[str] | None = None,
    transposed: Sequence[str] | None = None,
    table=None,
    flush_every: int = 8,
    run: RunSettings | None = None,
    **run_options,
):
    """Weight-space interference of every 2-D weight matrix, streamed one matrix at a time.

    ``base`` is a :class:`submerge.diagnostics.checkpoints.CheckpointReader`; ``finetuned`` maps task names to
    CheckpointReaders (LoRA readers included) or :class:`submerge.diagnostics.task_vectors.TaskVectorReader` objects,
    which read each Δ_t (exact LoRA updates, vocabulary cropping, NaN/Inf check).  Memory: the T task
    matrices of one matrix (in ``svd_dtype``, on ``device``), their mean, and about a dozen r × r Gram matrices,
    r = min(m, n); with ``exact_svd`` about ten copies of the matrix for the SVDs and float64 products
    (``benchmarks/interference.py`` and ``benchmarks/scale.py`` measure it).

    Matrices: every weight matrix of the tensor table ``table`` (``TensorInfo.is_weight_matrix``: 2-D,
    no size cap; built from the base's config when not given), ordered by layer, or those ``matrices`` names
    or matches (glob patterns: ``"model.layers.1?.*"``).  An embedding-level matrix stored twice with equal
    values in the base and every fine-tune (tied ``lm_head`` = embedding) is measured once
    (``attrs["tied_duplicates"]``).  Weights stored (in, out) (``TensorInfo.transposed``: GPT-2 ``Conv1D``, or
    the names in ``transposed``) are transposed to (out, in) first.

    Spectra come from the r × r Gram matrices of each matrix's task matrices (the default: one symmetric
    eigendecomposition per decomposed matrix, STI, SAR, I(k) and R(k) within 1e-4 of the exact route,
    :mod:`submerge.diagnostics.interference.gram`) or, with ``exact_svd``, from full thin SVDs (the reference,
    bitwise the figures of the versions before the Gram route); the store records which (``settings.svd``), and a
    run resumes only in the route it started in.

    SAR is taken against task arithmetic Σ_t Δ_t (``sar_against="ta"``) or against the merged task vector of a
    merge strategy, given as a callable ``(name, task_matrices, kind) → Δ_M``:
    ``submerge.merge.strategies.MergedTaskVector("ties", {"top_k": 0.2})`` (its ``label`` and ``options`` are
    recorded).

    Returns the ``xarray.Dataset`` described in this module's docstring.

    ``run`` (or its fields as keywords: ``store``, ``force``, ``progress``, ``command``, ``engine``;
    `submerge.diagnostics.execution.RunSettings`): with a store the group ``interference`` is written
    ``flush_every`` matrices at a time; a run that stopped resumes after the last group written (same settings),
    other settings are an error unless ``force``. With a ``RayEngine`` the matrices are measured by its Ray
    workers, in groups; this process alone writes the store, so results, resume and provenance are as in one
    process.
    """

    run = RunSettings.of(run, **run_options)
    task_readers = _task_readers(base, finetuned)
    _check_settings(svd_dtype, rank_fracs)
    sar_label, sar_options, sar_merge = _sar_reference(sar_against)
    target = pick_device(device)
    table, names, duplicates, transposed = _plan_matrices(base, task_readers, table, matrices, transposed)
    job = MatrixJob(tuple(rank_fracs), sar_label, sar_options, eps, svd_dtype, transposed,
                    {name: table.get(name).kind for name in names}, sar_merge, exact_svd)

    def make_piece(items: list[tuple]):
        return _matrices_dataset(table, [i[0] for i in items], [i[1] for i in items], [i[2] for i in items],
                                 list(task_readers), rank_fracs)

    writer = _open_writer(run.store, job, base, task_readers, matrices, force=run.force, command=run.command,
                          engine=run.engine.provenance())
    todo = [name for name in names if name not in writer.done]
    with progress_bar(run.progress) as bar, run.engine.running():
        bar_job = bar.add_task("interference", total=len(names))
        bar.advance(bar_job, len(names) - len(todo))
        results = _results(todo, base, task_readers, job, device, run.engine)
        with closing(results):
            _write_in_groups(writer, results, flush_every, make_piece, lambda name: bar.advance(bar_job))
    if not writer.pieces:  # nothing to measure and nothing resumed: an empty result, nothing appended
        writer.pieces.append(make_piece([]))
    return writer.finish(_notes(job, target, duplicates))


def matrix_table(dataset: xr.Dataset, rank_frac: float = INTERFERENCE_RANK_FRAC) -> pd.DataFrame:
    """One row per matrix: its level and layer and the headline figures, the columns of every interference table.

    ‖τ‖, effective rank and SAR are averaged over tasks, cosine and sign conflict over the pairs t < t' (NaN with
    one task), and I(k) (plain and centred) is taken at the grid's rank fraction nearest ``rank_frac`` (default
    8 %, CART's reported optimum); STI/Σσ is ``sti_normalized``.
    """
    num_tasks = dataset.sizes["task"]
    upper = xr.DataArray(np.triu(np.ones((num_tasks, num_tasks), dtype=bool), k=1), dims=("task", "task_other"))
    pairs = dataset[["cosine", "sign_conflict"]].where(upper)
    nearest = dataset.sel(rank_frac=rank_frac, method="nearest")
    chosen = f"I(k={float(nearest.rank_frac):g})"
    columns = {
        "level": strings(dataset.level.values),
        "layer": dataset.layer.values,
        "‖τ‖": dataset.task_vector_norm.mean("task").values,
        "effective rank": dataset.effective_rank.mean("task").values,
        "STI/Σσ": dataset.sti_normalized.values,
        "SAR": dataset.sar.mean("task").values,
        chosen: nearest.row_space_interference.sel(centered=False).values,
        f"{chosen} centred": nearest.row_space_interference.sel(centered=True).values,
        "cosine": pairs.cosine.mean(("task", "task_other")).values if num_tasks > 1 else np.nan,
        "sign conflict": pairs.sign_conflict.mean(("task", "task_other")).values if num_tasks > 1 else np.nan,
    }
    return pd.DataFrame(columns, index=pd.Index(strings(dataset.matrix.values), name="matrix"))


def summary(dataset: xr.Dataset, *, by: Sequence[str] = ("level",),
            rank_frac: float = INTERFERENCE_RANK_FRAC) -> pd.DataFrame:
    """The means of `matrix_table` over the matrices of each ``by`` group (default: per level; ``("level",
    "layer")`` for one row per level and layer), NaN skipped, after a column ``matrices`` that counts them."""
    table = matrix_table(dataset, rank_frac).drop(columns=[c for c in ("level", "layer") if c not in by])
    grouped = table.groupby(list(by)).mean()
    grouped.insert(0, "matrices", table.groupby(list(by)).size())
    position = {level: i for i, level in enumerate(ordered(table.level))}  # attn, mlp, embed, norm, final
    return grouped.sort_index(key=lambda index: index.map(position) if index.name == "level" else index)


def interference_per_layer(interference: xr.Dataset, about: str = "", rank_frac: float = INTERFERENCE_RANK_FRAC):
    """Heatmaps layer × metric (STI, SAR, I(k), cosine, sign conflict), attention and MLP side by side.

    Each cell: the mean over the level's matrices of that layer (annotated); colour: the
    value's place between the metric's lowest and highest cell, so metrics on different
    scales share one colour bar. High STI / I(k) / sign conflict and low SAR mean interference.
    """
    table = matrix_table(interference, rank_frac).drop(columns=["‖τ‖", "effective rank"])
    table = table[table.level.isin(["attn", "mlp"]) & (table.layer >= 0)]
    if table.empty:
        return None
    levels = ordered(table.level)
    means = table.groupby(["level", "layer"]).mean(numeric_only=True)
    low, span = means.min(), (means.max() - means.min()).replace(0, 1)
    layers = sorted(table.layer.unique())
    with plot.styled("white") as (plt, _):
        fig, axes = plt.subplots(1, len(levels), figsize=(1.15 * len(means.columns) * len(levels) + 2.5,
                                                          max(4.2, 0.3 * len(layers) + 3.2)),
                                 sharey=True, squeeze=False, layout="constrained")
        for col, (ax, level) in enumerate(zip(axes[0], levels)):
            values = means.loc[level].reindex(layers)
            mesh = plot.heatmap(ax, (values - low) / span, cmap="mako_r", vmin=0, vmax=1,
                                annot=values.to_numpy() if len(layers) <= 48 else False, fmt=".3g",
                                fontsize=8 if len(layers) > 16 else 9)
            ax.set_title(f"{level} matrices", fontsize=12)
            ax.set_xlabel("")
            ax.set_ylabel("layer" if col == 0 else "")
            ax.tick_params(axis="y", rotation=0)
            plot.tilt_labels(ax, 35)
        fig.colorbar(mesh, ax=axes, label="lowest → highest per metric", aspect=30)
        plot.title(fig, "Weight-space interference per layer — STI (TSV-M), SAR (Iso-C), I(k) (CART), pair means",
                   about)
    return fig


def interference_rank(interference: xr.Dataset, about: str = ""):
    """Row-space interference I(k) against the rank fraction k / min(m, n), mean over matrices per level."""
    frame = long_frame(interference.row_space_interference).dropna(subset=["row_space_interference"])
    frame = frame[frame.level.isin(["attn", "mlp"])]
    if frame.empty:
        return None
    frame["task matrices"] = np.where(frame.centered.astype(str) == "True", "centred Δ̄_t", "Δ_t")
    with plot.styled() as (plt, sns):
        fig, ax = plt.subplots(figsize=(8.5, 4.8), layout="constrained")
        sns.lineplot(frame, x="rank_frac", y="row_space_interference", hue="level", hue_order=ordered(frame.level),
                     style="task matrices", errorbar="sd", marker="o", palette="deep", ax=ax)
        ax.set_xscale("log")
        fractions = sorted(frame.rank_frac.unique())
        ax.set_xticks(fractions, [f"{f:g}" for f in fractions])
        ax.minorticks_off()
        ax.set_xlabel("rank fraction k / min(m, n)")
        ax.set_ylabel("row-space interference I(k)")
        plot.legend_outside(ax)
        plot.title(fig, "Row-space interference I(k) (CART) — mean ± std over matrices", about)
    return fig


INTERFERENCE = StoreGroup(
    name="interference",
    dim="matrix",
    variables={
        "task_vector_norm": ("matrix", "task"), "effective_rank": ("matrix", "task"),
        "cosine": ("matrix", "task", "task_other"), "sign_conflict": ("matrix", "task", "task_other"),
        "sti": ("matrix",), "sti_normalized": ("matrix",), "sti_k": ("matrix",), "sar": ("matrix", "task"),
        "sar_k": ("matrix",), "rank": ("matrix", "rank_frac"),
        "row_space_interference": ("matrix", "rank_frac", "centered"),
        "reconstruction_error": ("matrix", "rank_frac", "centered"),
    },
    title=f"Weight-space interference, means over each level's matrices (cosine, sign conflict over task pairs; "
          f"I(k) at the rank fraction nearest {INTERFERENCE_RANK_FRAC:.0%})",
    summary=summary,
    figures={"interference_per_layer": interference_per_layer, "interference_rank": interference_rank},
)

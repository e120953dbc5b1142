"""`diag`: submodule linearity and interference diagnostics, and merges that use them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from cli.common import (
    BatchOption,
    ConfigOption,
    DataOption,
    DeviceOption,
    DtypeOption,
    FinetunedOption,
    ForceOption,
    MaxTokensOption,
    ModelOption,
    OutOption,
    PickleOption,
    ProgressOption,
    RemoteCodeOption,
    SamplesOption,
    VocabOption,
    command_line,
    console,
    out,
    resolve_inputs,
    user_errors,
)

app = typer.Typer(
    name="diag",
    help="Measure how linear and how interfering fine-tuning updates are, submodule by submodule, "
         "store the figures in a zarr store (open it with xarray), and merge with them.\n\n"
         "Typical flow: diag linearity → diag interference → diag plan → diag merge → diag eval / diag report. "
         "With no --model, data-driven commands run on the embedded demo kit.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

LevelsOption = Annotated[str, typer.Option("--levels", help="Comma-separated: model, layer, attn, mlp, head.")]


def _levels(value: str) -> tuple[str, ...]:
    from diagnostics.modules import LEVELS

    levels = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in levels if v not in LEVELS or v == "linear"]
    if bad or not levels:
        raise typer.BadParameter(f"unknown level(s) {bad}; choose from model, layer, attn, mlp, head")
    return levels


def _experiment(model, finetuned, data, *, samples, max_tokens, batch_size, dtype, device, allow_pickle,
                trust_remote_code, vocab, skip=0):
    from diagnostics.experiment import Experiment

    model, named_finetuned, named_data = resolve_inputs(model, finetuned, data)
    with console.status("Loading the base model and opening the fine-tunes ..."):
        return Experiment.load(model, named_finetuned, named_data, samples=samples, skip=skip, max_tokens=max_tokens,
                               batch_size=batch_size, dtype=dtype, device=device, allow_pickle=allow_pickle,
                               trust_remote_code=trust_remote_code, vocab=vocab)


def _print_frame(frame, title: str) -> None:
    table = Table(title=title, title_justify="left")
    table.add_column(frame.index.name or "")
    for column in frame.columns:
        table.add_column(str(column), justify="right")
    for index, row in frame.iterrows():
        table.add_row(str(index), *[_cell(v) for v in row.tolist()])
    out.print(table)


def _cell(value) -> str:
    if isinstance(value, tuple) and len(value) == 2:
        return f"{value[0]:.4g} ± {value[1]:.2g}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@app.command()
@user_errors
def linearity(
    model: ModelOption = None,
    finetuned: FinetunedOption = None,
    data: DataOption = None,
    out_path: OutOption = Path("runs/diag.zarr"),
    levels: LevelsOption = "model,layer,attn,mlp",
    steps: Annotated[int, typer.Option("--steps", help="N of Eq. 19: points θ0 + (k/N)τ, k = 0..N.")] = 10,
    samples: SamplesOption = 30,
    max_tokens: MaxTokensOption = 512,
    batch_size: BatchOption = 8,
    model_output: Annotated[str, typer.Option("--model-output", help="Model-level features: hidden (final hidden "
                                                                     "state after the final norm) or logits.")] = "hidden",
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    allow_pickle: PickleOption = False,
    trust_remote_code: RemoteCodeOption = False,
    vocab: VocabOption = "base",
    force: ForceOption = False,
    progress: ProgressOption = True,
    config: ConfigOption = None,
):
    """Non-linearity Score (seed 002 Eq. 19) of each fine-tune on its own task data, per submodule.

    Writes store group `linearity` (nonlinearity_score over task × module × sample) and prints
    mean ± std per level and task (seed 002 Table 17). A killed run resumes where it stopped.
    """
    from diagnostics.linearity import nonlinearity, summarize_nonlinearity
    from diagnostics.store import Store

    if model_output not in ("hidden", "logits"):
        raise typer.BadParameter("--model-output must be hidden or logits")
    experiment = _experiment(model, finetuned, data, samples=samples, max_tokens=max_tokens, batch_size=batch_size,
                             dtype=dtype, device=device, allow_pickle=allow_pickle,
                             trust_remote_code=trust_remote_code, vocab=vocab)
    dataset = nonlinearity(experiment, levels=_levels(levels), steps=steps, store=Store(out_path), force=force,
                           progress=progress, model_output=model_output, command=command_line())
    _print_frame(summarize_nonlinearity(dataset), "Non-linearity Score (mean ± std over modules and samples)")
    out.print(f"Wrote group [bold]linearity[/] of {out_path}")


@app.command()
@user_errors
def projection(
    model: ModelOption = None,
    finetuned: FinetunedOption = None,
    data: DataOption = None,
    out_path: OutOption = Path("runs/diag.zarr"),
    levels: LevelsOption = "model,layer,attn,mlp",
    alpha_values: Annotated[Optional[str], typer.Option(
        "--alpha", help="Comma-separated α values for the grid (default: seed 002 Fig. 3 grids).")] = None,
    samples: SamplesOption = 30,
    max_tokens: MaxTokensOption = 512,
    batch_size: BatchOption = 8,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    allow_pickle: PickleOption = False,
    trust_remote_code: RemoteCodeOption = False,
    vocab: VocabOption = "base",
    force: ForceOption = False,
    progress: ProgressOption = True,
    config: ConfigOption = None,
):
    """Projection Distance (Eq. 8), cosine_merge (Eq. 16) and cosine_base (Eq. 17) for every subset of
    two or more fine-tunes over an α grid, per submodule. Writes store group `projection`."""
    from diagnostics.linearity import projection as run_projection
    from diagnostics.store import Store

    alphas = None
    if alpha_values:
        try:
            alphas = [float(v) for v in alpha_values.split(",")]
        except ValueError:
            raise typer.BadParameter(f"--alpha expects numbers separated by commas, got '{alpha_values}'") from None
    experiment = _experiment(model, finetuned, data, samples=samples, max_tokens=max_tokens, batch_size=batch_size,
                             dtype=dtype, device=device, allow_pickle=allow_pickle,
                             trust_remote_code=trust_remote_code, vocab=vocab)
    dataset = run_projection(experiment, levels=_levels(levels), alphas=alphas, store=Store(out_path), force=force,
                             progress=progress, command=command_line())
    frame = dataset.projection_distance.mean("combo").to_dataframe().groupby("level")["projection_distance"].agg(
        ["mean", "std"])
    _print_frame(frame, "Projection Distance (mean over the α grid; mean and std over modules)")
    out.print(f"Wrote group [bold]projection[/] of {out_path}")


@app.command()
@user_errors
def alpha(
    model: ModelOption = None,
    finetuned: FinetunedOption = None,
    data: DataOption = None,
    out_path: OutOption = Path("runs/diag.zarr"),
    granularity: Annotated[str, typer.Option("--granularity", help="model, layer, attn-mlp or head-mlp.")] = "layer",
    balance: Annotated[bool, typer.Option("--balance/--no-balance",
                                          help="Sample balancing of Eq. 33-34 (default) or plain Eq. 14.")] = True,
    samples: SamplesOption = 30,
    max_tokens: MaxTokensOption = 512,
    batch_size: BatchOption = 8,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    allow_pickle: PickleOption = False,
    trust_remote_code: RemoteCodeOption = False,
    vocab: VocabOption = "base",
    force: ForceOption = False,
    progress: ProgressOption = True,
    config: ConfigOption = None,
):
    """Closed-form merge weights α per submodule (seed 002 Eq. 12-14, balanced Eq. 33-34).

    Writes store group `alpha/<granularity>` with α, the condition number, a least-squares flag,
    and the Eq. 10 objective at the solved α and at uniform weights."""
    from diagnostics.linearity import GRANULARITIES
    from diagnostics.linearity import alpha as run_alpha
    from diagnostics.store import Store

    if granularity not in GRANULARITIES:
        raise typer.BadParameter(f"--granularity must be one of {', '.join(GRANULARITIES)}")
    experiment = _experiment(model, finetuned, data, samples=samples, max_tokens=max_tokens, batch_size=batch_size,
                             dtype=dtype, device=device, allow_pickle=allow_pickle,
                             trust_remote_code=trust_remote_code, vocab=vocab)
    dataset = run_alpha(experiment, granularity=granularity, balance=balance, store=Store(out_path), force=force,
                        progress=progress, command=command_line())
    frame = dataset.alpha.isel(granularity=0).to_pandas()
    frame["objective α"] = dataset.objective_alpha.isel(granularity=0).to_pandas()
    frame["objective 1/T"] = dataset.objective_uniform.isel(granularity=0).to_pandas()
    frame["lstsq"] = dataset.least_squares.isel(granularity=0).to_pandas()
    _print_frame(frame, f"Closed-form α ({granularity}, {'balanced' if balance else 'unbalanced'})")
    out.print(f"Wrote group [bold]alpha/{granularity}[/] of {out_path}")


@app.command()
@user_errors
def check(
    model: ModelOption = None,
    finetuned: FinetunedOption = None,
    allow_pickle: PickleOption = False,
    vocab: VocabOption = "base",
    scan: Annotated[bool, typer.Option("--scan/--no-scan", help="Also read every tensor to look for NaN/Inf.")] = False,
    config: ConfigOption = None,
):
    """Pre-flight check: do the fine-tunes match the base (names, shapes, vocabulary, NaN/Inf)?"""
    from diagnostics.models import open_checkpoint, open_finetunes

    model, named_finetuned, _ = resolve_inputs(model, finetuned, None, need_data=False)
    base = open_checkpoint(model, allow_pickle=allow_pickle)
    task_vectors, report = open_finetunes(base, named_finetuned, allow_pickle=allow_pickle, vocab=vocab)
    if scan:
        for task, reader in task_vectors.items():
            for name in base.names():
                reader.get(name)
    out.print(f"[green]ok[/]: {len(named_finetuned)} fine-tune(s) match {model} ({len(base.names())} tensors)"
              + (", no NaN/Inf" if scan else ""))
    for task, info in report.items():
        for name, rows in info["vocab_rows"].items():
            out.print(f"  {task}: {name} uses the base's {rows[0]} of {rows[1]} vocabulary rows")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()

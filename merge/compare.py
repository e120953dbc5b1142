"""`diag compare`: every merge strategy, a tuned task arithmetic, closed-form α and the plan, on held-out records.

The protocol (seed 002's): each task subset (`subsets`: the full set, every pair, or both) is merged by every method
and scored on its own tasks; every method is tuned on the fit records over its paper's grid (`tune`,
`submerge.merge.tuning`; None: paper defaults) by the leaderboard's measure, the mean normalised gain, there
(`tune_by`, `merge.tuning.criterion_weights`: the base and each fine-tune are evaluated on the fit records too); fit
and held-out records are redrawn per data-sample seed (`seeds`).
The store group ``compare`` has one unit per (subset, seed, method) along dimension ``unit`` ("math+code|0|ties"),
with coordinates ``subset``, ``seed``, ``method``, ``kind``, ``detail`` and ``hyperparameters`` (the tuned choice,
JSON); tasks outside a unit's subset are NaN. With `objective`, each merge's block objective (Σ Eq. 10 over blocks,
held out) is stored too, and its Spearman rank correlation with the held-out loss across merges (`rank_correlations`).

Methods (labels along coordinate ``method``):

- ``base`` and ``finetuned:<task>``: the references, evaluated like the merges;
- every registered strategy (`submerge.merge.strategies.STRATEGIES`) at its paper's default options
  (RegMean with the input Gram matrices of the fit records, recorded on the base; Fisher merging with each
  fine-tune's diagonal Fisher on its fit records; AdaMerging's and LoraHub's weights learned on the fit records);
- ``task-arithmetic-tuned``: θ0 + λ Σ_t τ_t with λ from `lambdas` chosen by the tuning criterion on the fit
  records (one Σ τ checkpoint is written; each λ is loaded as θ0 + λ(Σ − θ0));
- ``closed-form-layer`` and ``closed-form-attn-mlp``: α per block, or per attention and MLP,
  solved on the fit records (seed 002's comparison);
- ``plan``: by default the evidence plan (`submerge.merge.plan.evidence_plan`: granularity per block by
  cross-validated Eq. 10 objective, interference-steered matrices when the store has an
  ``interference`` group; the evidence is written to the store's group ``evidence``, so a killed run
  resumes it too); ``choose="thresholds"`` takes `diag plan`'s threshold choice from the
  store (needs its ``linearity`` and ``alpha`` groups); a `Plan` or plan file may be given instead. Tuned, the
  evidence plan also tries steering half or all of its block matrices to its steering method at that method's own
  scale (`_tune_steering`), and ``plan_out`` receives the plan as tuned (`submerge.merge.plan.tuned_plan`), so
  `diag merge` of it writes the model compare scored;
- a user's mergekit recipes (`recipes`: label → config, `submerge.merge.recipe.Recipe`), each merged with its own
  rule per tensor and ranked beside the rest (kind ``recipe``).

Records: the first `fit` records of each task fit α, λ, RegMean's Grams, the Fishers, the AdaMerging and LoraHub
weights, the evidence choice and every tuned hyperparameter; the
`samples` records after the first `skip` (≥ `fit`) are held out (seed 0; `resampled` for other seeds), and every loss in the group is on
them (`submerge.diagnostics.evaluate.streamed_losses`: mean next-token cross-entropy over real tokens, nats).

Normalised gain of a model on task t: (L_base,t − L_model,t) / (L_base,t − L_finetune_t,t) — 0 is
the base, 1 the task's own fine-tune; the leaderboard sorts by its mean over tasks.

Streaming: one merged checkpoint at a time is written to a temporary directory, evaluated block by
block over the base (one block's weights at a time, as `diag eval`) and deleted (kept under
``keep/<method>`` when `keep` is given). The group is written one unit at a time, so a killed run
resumes after the last finished unit.

Accuracy (`lm_eval`: `submerge.diagnostics.harness.HarnessSettings`): each reference and each merge is also scored
with lm-evaluation-harness on the held-out records (built in memory from its checkpoint, before that is deleted),
into the group ``compare_accuracy`` one (model, task) at a time; the returned dataset gets ``accuracy``
(method × benchmark) and the leaderboard can rank by it.

This module owns the store group ``compare`` (`COMPARE`): its layout, its summary table (the leaderboard) and its
figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
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
import torch
import xarray as xr
from scipy.stats import spearmanr

from submerge.diagnostics import plot
from submerge.diagnostics.base_model import LoadSettings
from submerge.diagnostics.capture import DEFAULT_CAPTURE_BUDGET
from submerge.diagnostics.checkpoints import open_checkpoint
from submerge.diagnostics.data import TaskData, by_length, read_task_file, tokenize
from submerge.diagnostics.errors import SubmergeError
from submerge.diagnostics.evaluate import (
    LOSS_RULE,
    checkpoint_source,
    scaled_source,
    streamed_losses,
    summed_source,
)
from submerge.diagnostics.execution import LocalEngine, RunSettings, driver_settings
from submerge.diagnostics.experiment import Experiment
from submerge.diagnostics.groups import StoreGroup
from submerge.diagnostics.harness import COMPARE_ACCURACY, AccuracyRunner, accuracy_frame
from submerge.diagnostics.linearity.evidence import block_objectives
from submerge.diagnostics.outputs import (
    MERGE_MARKER,
    OutputError,
    check_output_directory,
    check_output_file,
    is_merge_output,
)
from submerge.diagnostics.placement import process_alive
from submerge.diagnostics.progress import progress_bar
from submerge.diagnostics.provenance import jsonable
from submerge.diagnostics.store import Store, UnitWriter
from submerge.diagnostics.tables import long_frame, strings
from submerge.diagnostics.task_vectors import TaskVectorReader
from submerge.diagnostics.tensors import TensorTable
from submerge.merge.learned import LEARNED_METHODS, learn
from submerge.merge.plan import (
    LEVELS_OF,
    PLAN_CANDIDATES,
    Plan,
    PlanError,
    SteeredPart,
    check_evidence_options,
    evidence_plan,
    gram_ruled,
    interference_ranking,
    is_plan_file,
    make_plan,
    steered_matrices,
    tuned_plan,
    with_rest,
)
from submerge.merge.recipe import Recipe, same_model
from submerge.merge.rules import regmean_rule
from submerge.merge.strategies import STRATEGIES
from submerge.merge.tuning import (
    GRIDS,
    SCALE,
    check_search,
    check_tune_by,
    criterion_weights,
    grid_search,
    lambdas_of,
    search_function,
    settings_of,
)
from submerge.merge.tuning import label as tuning_label
from submerge.merge.tuning import record as tuning_record
from submerge.merge.writer import ParameterRule, write_merges

DEFAULT_LAMBDAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TUNED = "task-arithmetic-tuned"
CLOSED_FORM = ("closed-form-layer", "closed-form-attn-mlp")
PLAN = "plan"
#: The δ of a method's settings are written in one pass (`merge.writer.write_merges`: each tensor read once, KnOTS's
#: and CART's SVDs taken once for all settings) where all of those checkpoints take at most this many bytes together
#: and the scratch disk has room for them (SmolLM2-135M: 0.54 GB a setting; a 7B's 13.5 GB do not fit), else one
#: after another, each deleted once beaten, as before.
TOGETHER_BYTES = 8 * 2**30


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


def default_methods(tuned: bool = False) -> list[str]:
    """Every registered strategy, closed form at layer and attn-mlp, the plan; untuned (`tuned` False) also the
    task arithmetic with λ tuned on the fit records (tuned, every method is, `task-arithmetic` among them)."""

    strategies = [name for name, method in STRATEGIES.items() if not method.needs_data or name in DATA_STEPS]
    return [*strategies, *([] if tuned else [TUNED]), *CLOSED_FORM, PLAN]


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
    steering: PlanSteering | None = None  # the evidence plan: its matrices may be steered when tuned
    plan: Plan | None = None  # the plan merged (label "plan", the closed forms)


@dataclass
class PlanSteering:
    """How compare's tuning steers the evidence plan (the `Merge`'s ``plan``): a share of its block matrices (most
    colliding first by the store's interference group, `ranking`; without one, none or all) merged by `method` at
    their own scale μ, the rest by the plan at λ (`SteeredPart`)."""

    infos: list
    ranking: list[str] | None
    method: str

    def shares(self, grid) -> list[float]:
        """The shares of `grid` this plan can steer (all of them with a ranking; else 0 and 1)."""
        return [float(q) for q in grid if self.ranking is not None or float(q) in (0.0, 1.0)]

    def parts(self, plan: Plan, share: float, gram_matrices: Callable | None = None) -> tuple[Merge, Merge]:
        """(`plan` without the steered matrices, the steered matrices by `method` at scaling 1); `gram_matrices`:
        the plan's Grams (its RegMean rules)."""
        steered = steered_matrices(self.infos, share, self.ranking)
        record = {"method": PLAN, "steer_share": share, "steer_method": self.method, "steered": sorted(steered)}
        return tuple(Merge(SteeredPart(plan, steered, self.method, part), f"{part} of the steered plan",
                           {**record, "part": part}, gram_matrices if part == "rest" else None)
                     for part in ("rest", "steered"))


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


def check_method_options(method_options: dict | None, methods: list[str], *, tuned: bool,
                         grids: dict | None = None) -> dict[str, dict]:
    """Fixed options per method (``--option METHOD.KEY=VALUE``), checked and coerced by the registry: only
    registered strategies among `methods`, only their own options, and (when tuning) no knob that the method's
    grid tunes (`merge.tuning.GRIDS`, with compare's `grids` in place of their methods' rows), nor λ
    (``scaling``), which tuning chooses."""
    checked: dict[str, dict] = {}
    for method, given in (method_options or {}).items():
        if method not in STRATEGIES:
            raise CompareError(f"--option {method}.…: options are for registered strategies ({', '.join(STRATEGIES)})"
                               f"; {method!r} is not one")
        if method not in methods:
            raise CompareError(f"--option {method}.…: {method!r} is not among the compared methods")
        try:
            resolved = STRATEGIES[method].resolve_options(given)
        except ValueError as exc:
            raise CompareError(f"--option: {exc}") from None
        tuned_knobs = {*settings_of(method, grids)[0], SCALE} & set(given) if tuned else set()
        if tuned_knobs:
            raise CompareError(f"--option {method}.{min(tuned_knobs)}: compare tunes it on the fit records; "
                               "give it with --tune none, or change its grid (merge/tuning.py GRIDS, compare's grids=)")
        checked[method] = {key: resolved[key] for key in given}
    return checked


def parse_method_options(values: list[str] | None) -> dict[str, dict[str, str]]:
    """Repeated ``METHOD.KEY=VALUE`` (``adamerging.steps=50``) as {method: {key: value}} (values coerced later)."""
    parsed: dict[str, dict[str, str]] = {}
    for value in values or []:
        name, sep, setting = value.partition("=")
        method, dot, key = name.rpartition(".")
        if not sep or not dot or not method or not key or not setting:
            raise CompareError(f"--option expects METHOD.KEY=VALUE (e.g. adamerging.steps=50), got '{value}'")
        if key in parsed.setdefault(method, {}):
            raise CompareError(f"--option {method}.{key} given twice")
        parsed[method][key] = setting
    return parsed


@contextlib.contextmanager
def _timed(seconds: dict, key: str):
    """Adds the wall time of the block to ``seconds[key]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] = time.perf_counter() - start


def _strategy(name: str, given: dict | None = None) -> Merge:
    rule = ParameterRule(method=name, options=dict(given or {}))
    options = STRATEGIES[name].resolve_options(given or {})
    return Merge(lambda info: rule, f"defaults {options}" if options else "no options",
                 {"method": name, "options": options})


def _regmean(experiment, given: dict | None = None) -> Merge:
    """RegMean on every linear map inside the blocks (Grams of the fit records on the base); TA elsewhere."""

    grams = experiment.input_grams()
    options = STRATEGIES["regmean"].resolve_options(given or {})
    return Merge(regmean_rule(dict(given or {}), grams.names),
                 f"off_diagonal_scale {options['off_diagonal_scale']:g} on {len(grams.names)} linear maps, "
                 "task arithmetic elsewhere", {"method": "regmean", "options": dict(given or {})}, grams)


def _learned(name: str, experiment, progress: bool, given: dict | None = None) -> Merge:
    """Fisher, AdaMerging or LoraHub at their defaults updated by `given` (compare's ``--option``), their inputs
    learned on the fit records (as `diag merge --method M --data` does, `submerge.merge.learned.learn`)."""
    options, data_options = STRATEGIES[name].split_options(given or {})
    learned = learn(name, experiment, options, data_options, progress=progress)
    return Merge(learned.rule_for, learned.detail, {"method": name, "options": {}, name: learned.record},
                 learned.tensor_inputs)


def _plan_merge(plan, label: str, experiment=None) -> Merge:
    """A plan's `Merge`; a plan with RegMean rules (`gram_ruled`) gets the Grams of the `experiment`'s (fit) records,
    as compare's RegMean does."""
    counts: dict[str, int] = {}
    for granularity in (plan.layer_granularity or {}).values():
        counts[granularity] = counts.get(granularity, 0) + 1
    detail = plan.granularity if not counts else "per layer: " + ", ".join(f"{n} × {g}" for g, n in counts.items())
    ruled = gram_ruled(plan)
    if len(plan.matrix_rules) > len(ruled):
        detail += f"; {len(plan.matrix_rules) - len(ruled)} matrices steered"
    grams = None
    if ruled:
        if experiment is None:
            raise CompareError(f"{label}: its RegMean rules need the Grams of the fit records")
        grams = experiment.input_grams()
        detail += f"; {len(ruled)} matrices by RegMean"
    return Merge(plan.rule_for, detail, {"method": label, "granularity": plan.granularity, "alpha": plan.alpha,
                                         "layer_granularity": plan.layer_granularity,
                                         "matrix_rules": plan.matrix_rules, "decision": plan.decision}, grams,
                 plan=plan)


def prepare(experiment, finetuned: dict[str, str], methods: list[str], *, plan=None, choose: str = "evidence",
            store: Store | None = None, evidence_options: dict | None = None, progress: bool = True,
            command: str | None = None, force: bool = False, record_evidence: bool = True,
            method_options: dict | None = None, seconds: dict | None = None,
            capture_budget: int = DEFAULT_CAPTURE_BUDGET) -> tuple[dict[str, Merge], object]:
    """The `Merge` of every method except the tuned task arithmetic, fitted on the experiment's records.

    Runs before any merged weights are loaded: capture needs the base model's own weights. The evidence step
    writes (or, resumed, reads) the group ``evidence`` of `store` (recomputed with `force`; not written with
    `record_evidence` False: compare's other subsets and seeds, whose evidence would replace the full set's).
    Returns (merges, the plan used or None); `seconds` (a dict) receives each data step's wall time (RegMean's
    Grams, the learned methods, the evidence step). `capture_budget`: bytes of recorded inputs the evidence step
    holds at once (memory only: the evidence is bitwise the same at any budget).
    """

    given, seconds = method_options or {}, {} if seconds is None else seconds
    merges = {name: _strategy(name, given.get(name)) for name in methods if name in STRATEGIES
              and name not in DATA_STEPS}
    if "regmean" in methods:
        with _timed(seconds, "regmean"):
            merges["regmean"] = _regmean(experiment, given.get("regmean"))
    for name in LEARNED_METHODS:
        if name in methods:
            with _timed(seconds, name):
                merges[name] = _learned(name, experiment, progress, given.get(name))
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
        among = list(options.pop("candidates", None) or PLAN_CANDIDATES)
        candidates = list(dict.fromkeys(among + [m.removeprefix("closed-form-") for m in wanted_closed]))
        interference = store.dataset("interference") if store is not None and store.is_complete("interference") else None
        run = RunSettings(store=store if record_evidence else None, force=force, progress=progress, command=command,
                          capture_budget=capture_budget)
        with _timed(seconds, "evidence"):
            evidence = evidence_plan(experiment, finetuned, candidates=tuple(candidates), interference=interference,
                                     run=run, **options)
        for name in wanted_closed:
            merges[name] = _plan_merge(evidence.single(name.removeprefix("closed-form-")), name)
        if PLAN in methods and plan is None:
            plan = evidence.plan(among=among, command=command)
            merges[PLAN] = dataclasses.replace(_plan_merge(plan, PLAN, experiment), steering=PlanSteering(
                evidence.infos, interference_ranking(interference) if interference is not None else None,
                evidence.settings["steer_method"]))
    if PLAN in methods and PLAN not in merges:
        merges[PLAN] = _plan_merge(plan, PLAN, experiment)
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
        self.held_experiment = None  # set to score the block objective of each merge on the held-out records
        self.shared = None  # a directory keeping what every merge's block objective shares (`block_objectives`)
        self.fit_weights = None  # task weights of the tuning criterion (`merge.tuning.criterion_weights`); None: mean
        self.load(None)

    def losses(self, batches: dict | None = None, tasks: list[str] | None = None) -> np.ndarray:
        """Mean loss per task of `tasks` (default: every task of the evaluator) on `batches` (default: held out)."""
        batches, tasks = batches or self.held_out, tasks or self.tasks
        results = streamed_losses(self.source, self.arch, {t: batches[t] for t in tasks}, self.variant)
        return np.array([results[t][0] for t in tasks])

    def fit_criterion(self, terms) -> float:
        """The tuning criterion of θ0 + Σ scale·(θ_reader − θ0) over `terms`: Σ_t w_t L_t on the fit records, w
        `fit_weights` (the mean without)."""
        self.load_terms(terms)
        losses = self.losses(self.fit)
        return float(np.mean(losses) if self.fit_weights is None else np.dot(self.fit_weights, losses))

    def load(self, spec: str | None) -> None:
        """The checkpoint `spec` (None: the base) is the model the next `losses` measure."""

        self.source, self.variant = checkpoint_source(self.base, spec, self.compute, allow_pickle=self.allow_pickle)

    def objective(self, reader, scale: float = 1.0) -> float:
        """Σ over blocks of the Eq. 10 objective (Eq. 33 balanced) of θ0 + scale·(θ_reader − θ0) on the held-out
        records (`submerge.diagnostics.linearity.evidence.block_objectives`); NaN without `held_experiment`."""
        return self.objective_of(((reader, scale),))

    def objective_of(self, terms) -> float:
        """`objective` of θ0 + Σ scale·(θ_reader − θ0) over `terms` ((reader, scale) pairs)."""
        if self.held_experiment is None:
            return math.nan
        delta = CheckpointDelta(tuple((TaskVectorReader(f"merged-{k}", self.base.reader, reader), float(scale))
                                      for k, (reader, scale) in enumerate(terms)))
        return float(sum(block_objectives(self.held_experiment, delta, shared=self.shared).values()))

    def load_scaled(self, reader, scale: float, *, name: str = "scaled") -> None:
        """θ0 + scale · (θ_reader − θ0) is the model the next `losses` measure."""

        self.source, self.variant = scaled_source(self.base, reader, scale, self.compute, name=name)

    def load_terms(self, terms) -> None:
        """θ0 + Σ scale·(θ_reader − θ0) over `terms` ((reader, scale) pairs) is the model the next `losses` measure."""
        self.source, self.variant = summed_source(self.base, {f"term-{k}": term for k, term in enumerate(terms)},
                                                  self.compute)


def _tune_lambda(evaluator: _Evaluator, write: Callable, lambdas) -> tuple[float, dict[float, float]]:
    """λ of θ0 + λ Σ τ with the lowest fit loss (the tuning criterion); all fit losses."""

    summed = ParameterRule(method="task-arithmetic", options={"scaling": 1.0})
    directory = write("task-arithmetic-sum", Merge(lambda info: summed, "", {"method": "task-arithmetic"}), False)
    try:
        reader = open_checkpoint(str(directory), base=evaluator.base.reader)
        best, fit_loss = grid_search(lambdas, lambda value: _fit_loss(evaluator, reader, value))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return best, fit_loss


def _fit_loss(evaluator: _Evaluator, reader, scale: float) -> float:
    """The tuning criterion (`_Evaluator.fit_criterion`) of θ0 + scale·(θ_reader − θ0) on the fit records."""
    return evaluator.fit_criterion(((reader, scale),))


@dataclass(frozen=True)
class CheckpointDelta:
    """Written merges' updates, scaled and summed, as a `TensorDelta` of the evidence driver: Σ scale · (θ_merge −
    θ0) of each tensor in float32 (the block objective of any method, not only of α-weighted plans); `terms`:
    (update reader, scale) pairs."""

    terms: tuple

    def __call__(self, info, vectors: list) -> torch.Tensor:
        total = None
        for reader, scale in self.terms:
            value = scale * reader.get(info.name, device=vectors[0].device)
            total = value if total is None else total + value
        return total


# ------------------------------------------------------------------ tuning every method on the fit records


@dataclass
class Tuned:
    """The chosen candidate of one method: its options, λ, mean fit loss, and every candidate's fit loss."""

    setting: dict
    scale: float
    scale_name: str
    fit_loss: float
    searched: dict[str, float]
    objective: float = math.nan

    @property
    def label(self) -> str:
        return tuning_label(self.setting, self.scale, self.scale_name)


def _candidates(method: str, merge: Merge, grids: dict | None = None, fixed: dict | None = None
                ) -> tuple[list[tuple[dict, Merge]], str]:
    """(setting, the Merge writing δ at λ = 1) per setting of the method's other knobs (with its `fixed` options);
    the name of its λ."""
    registered = method in STRATEGIES and method not in DATA_STEPS
    has_scaling = method in STRATEGIES and SCALE in STRATEGIES[method].resolve_options({})
    scale_name = SCALE if has_scaling else "λ"
    if method == PLAN and merge.steering is not None:  # the evidence plan: each rest rule of its grid
        rests = (GRIDS | (grids or {})).get(PLAN, {}).get("rest") or ("mean",)
        return [({"rest": rest}, _with_rest(merge, rest)) for rest in rests], scale_name
    if not registered:
        return [({}, merge)], scale_name
    unit = {SCALE: 1.0} if has_scaling else {}
    return [(setting, _strategy(method, {**(fixed or {}), **setting, **unit}))
            for setting in settings_of(method, grids)], scale_name


def _plan_at(merge: Merge, setting: dict) -> Plan:
    """The evidence plan under a tuning `setting`: with its ``rest`` rule where the setting names one."""
    return with_rest(merge.plan, setting["rest"]) if "rest" in setting else merge.plan


def _with_rest(merge: Merge, rest: str) -> Merge:
    """The evidence plan's `Merge` with its rest rule replaced (`merge.plan.with_rest`)."""
    plan = with_rest(merge.plan, rest)
    return dataclasses.replace(merge, rule_for=plan.rule_for, plan=plan,
                               record={**merge.record, "rest": plan.rest}, detail=f"{merge.detail}; rest: {rest}")


def _tune(method: str, merge: Merge, evaluator: _Evaluator, write: Callable, *, search: str, lambdas,
          on_candidate: Callable[[str], None], grids: dict | None = None, fixed: dict | None = None,
          write_together: Callable | None = None) -> tuple[np.ndarray, Tuned]:
    """Held-out losses of `method` at the candidate (setting × λ) with the lowest mean fit loss (`merge.tuning`:
    each setting's δ written once, each λ evaluated as θ0 + λ·δ). The evidence plan (`merge.steering`) also tries
    each steer share of its grid (`_tune_steering`). `write_together([(label, merge) …])` writes the settings' δ in
    one pass, or returns None where they do not fit (`TOGETHER_BYTES`); then `write` writes each in turn."""
    candidates, scale_name = _candidates(method, merge, grids, fixed)
    values = lambdas_of(method, lambdas, grids)
    best: tuple | None = None  # (fit loss, setting, λ, directories, terms)
    searched: dict[str, float] = {}
    steering = merge.steering if method == PLAN else None
    try:
        labels = [f"{method}-candidate-{index}" for index in range(len(candidates))]
        written = None  # the settings' δ in one pass, where they share their data input and fit
        if len(candidates) > 1 and write_together is not None and \
                len({id(candidate.gram_matrices) for _, candidate in candidates}) == 1:
            on_candidate(f"the δ of {len(candidates)} settings")
            written = write_together(list(zip(labels, (candidate for _, candidate in candidates))))
        for index, (setting, candidate) in enumerate(candidates):
            if steering is not None:
                setting = {**setting, "steer_share": 0.0}
            on_candidate(tuning_label(setting, math.nan, scale_name).replace(f"{scale_name}=nan", "") or "δ")
            directory = written[index] if written else write(labels[index], candidate, False)
            reader = open_checkpoint(str(directory), base=evaluator.base.reader)

            def loss(value: float, setting=setting, reader=reader) -> float:
                on_candidate(tuning_label(setting, value, scale_name))
                return _fit_loss(evaluator, reader, value)

            chosen, losses = search_function(search)(values, loss, start=None if best is None else best[2])
            searched.update({tuning_label(setting, v, scale_name): value for v, value in losses.items()})
            if best is None or losses[chosen] < best[0]:  # ties keep the earlier (the grid's first) setting
                if best is not None:
                    _remove(best[3])
                best = (losses[chosen], setting, chosen, [directory], ((reader, chosen),))
            else:
                shutil.rmtree(directory, ignore_errors=True)
        if steering is not None:
            best = _tune_steering(_plan_at(merge, best[1]), steering, evaluator, write, best, searched, merge.gram_matrices,
                                  search=search, lambdas=values,
                                  shares=(GRIDS | (grids or {})).get(PLAN, {}).get("steer_share", ()),
                                  on_candidate=on_candidate)
        fit_loss, setting, scale, _, terms = best
        evaluator.load_terms(terms)
        held = evaluator.losses()
        objective = evaluator.objective_of(terms)
    finally:
        if best is not None:
            _remove(best[3])
    return held, Tuned(setting, scale, scale_name, fit_loss, searched, objective)


def _tuned_plan(merge: Merge, tuned: Tuned) -> Plan:
    """The plan as compare tuned it (`merge.plan.tuned_plan`): what ``--plan-out`` writes, so that `diag merge` of
    the file gives the model compare scored."""
    share = float(tuned.setting.get("steer_share", 0.0))
    steering = merge.steering
    steered = steered_matrices(steering.infos, share, steering.ranking) if share > 0 else frozenset()
    record = {**tuned.setting, "λ": tuned.scale, "fit_loss": tuned.fit_loss}
    return tuned_plan(_plan_at(merge, tuned.setting), tuned.scale, steered=steered, steer_method=steering.method if share > 0 else None,
                      steer_scale=tuned.setting.get("steer_scale"), record=record)


def _remove(directories) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def _tune_steering(plan: Plan, steering: PlanSteering, evaluator: _Evaluator, write: Callable, best: tuple,
                   searched: dict, gram_matrices: Callable | None = None, *, search: str, lambdas, shares,
                   on_candidate: Callable[[str], None]) -> tuple:
    """The evidence `plan` with each share q > 0 of `shares` of its block matrices steered (`PlanSteering.parts`):
    θ0 + λ·rest + μ·steered, μ searched over the steering method's λ grid at the plan's best λ, then λ at that μ
    (one pass of coordinate descent, each a `search_function(search)` over its grid). Returns the best of
    `best` (the unsteered plan's) and these, as `_tune` keeps it; every fit loss goes into `searched`."""
    scales = lambdas_of(steering.method)
    fixed = {key: value for key, value in best[1].items() if key not in ("steer_scale", "steer_share")}  # its rest
    for share in steering.shares(shares):
        if share == 0.0:
            continue
        rest, steered = steering.parts(plan, share, gram_matrices)
        directories = [write(f"{PLAN}-steer-{share:g}-{part}", merge, False)
                       for part, merge in (("rest", rest), ("steered", steered))]
        readers = [open_checkpoint(str(d), base=evaluator.base.reader) for d in directories]
        plan_scale = best[2]

        def loss(plan_scale: float, steer_scale: float, share=share, readers=readers) -> float:
            # the keys in JSON's order
            key = tuning_label({**fixed, "steer_scale": steer_scale, "steer_share": share}, plan_scale, "λ")
            if key not in searched:  # the point both searches share is evaluated once
                on_candidate(key)
                searched[key] = evaluator.fit_criterion(((readers[0], plan_scale), (readers[1], steer_scale)))
            return searched[key]

        steer_scale, _ = search_function(search)(scales, lambda mu, at=plan_scale: loss(at, mu))
        scale, losses = search_function(search)(lambdas, lambda value, mu=steer_scale: loss(value, mu),
                                                 start=plan_scale)
        if losses[scale] < best[0]:
            _remove(best[3])
            best = (losses[scale], {**fixed, "steer_scale": steer_scale, "steer_share": share}, scale, directories,
                    ((readers[0], scale), (readers[1], steer_scale)))
        else:
            _remove(directories)
    return best


# ------------------------------------------------------------------ subsets, seeds and the store's units

SUBSETS = ("full", "pairs", "all")
UNIT = "unit"


def task_subsets(tasks: list[str], which: str = "full") -> list[tuple[str, ...]]:
    """The task subsets to merge: ``full`` (all tasks), ``pairs`` (every pair) or ``all`` (the full set, then
    every pair); with two tasks the only pair is the full set."""
    if which not in SUBSETS:
        raise CompareError(f"--subsets must be one of {', '.join(SUBSETS)}; got {which!r}")
    full = [tuple(tasks)]
    pairs = list(itertools.combinations(tasks, 2))
    chosen = {"full": full, "pairs": pairs, "all": full + pairs}[which]
    return list(dict.fromkeys(chosen)) or full


def subset_label(tasks) -> str:
    """"math+code": the label of a task subset along the store's ``subset`` coordinate."""
    return "+".join(tasks)


def unit_label(subset: str, seed: int, method: str) -> str:
    """The store's unit label of one (subset, seed, method): "math+code|0|ties"."""
    return f"{subset}|{seed}|{method}"


def resampled(task: str, path, *, fit: int, skip: int, samples: int, seed: int) -> tuple[TaskData, TaskData]:
    """(fit records, held-out records) of `task` for data-sample seed `seed`: seed 0 takes the first `fit` records
    and the `samples` after the first `skip`; seed s > 0 the same positions of the first skip + samples records
    permuted by numpy's default_rng(s) (fit and held out stay disjoint)."""
    pool = read_task_file(task, path, samples=skip + samples)
    count = len(pool.texts)
    order = np.arange(count) if seed == 0 else np.random.default_rng(seed).permutation(count)
    if count <= skip:
        raise CompareError(f"task '{task}': {path} has {count} records, none after the first {skip} to hold out")

    def pick(rows) -> TaskData:
        return dataclasses.replace(pool, texts=[pool.texts[i] for i in rows], indices=[pool.indices[i] for i in rows])

    return pick(order[:fit]), pick(order[skip:skip + samples])


def restricted(experiment, tasks, data: dict | None = None, batches: dict | None = None):
    """The experiment on `tasks` only (and on other fit records: `data`, `batches` of every task)."""
    data = experiment.data if data is None else data
    batches = experiment.batches if batches is None else batches
    return dataclasses.replace(experiment, task_vectors={t: experiment.task_vectors[t] for t in tasks},
                               data={t: data[t] for t in tasks}, batches={t: batches[t] for t in tasks},
                               settings={**experiment.settings, "tasks": list(tasks)})


def _piece(unit: str, kind: str, detail: str, losses: np.ndarray, references: dict, tasks: list[str],
           seconds: float, *, all_tasks: list[str] | None = None, subset: str | None = None, seed: int = 0,
           method: str | None = None, tuned: Tuned | None = None, objective: float = math.nan) -> xr.Dataset:
    """One unit of the group: `losses` on `tasks` (the subset's), NaN on the other tasks of `all_tasks`."""
    all_tasks = list(tasks) if all_tasks is None else list(all_tasks)
    where = [all_tasks.index(t) for t in tasks]
    base = np.asarray(references["base"])[where]
    own = np.array([references[f"finetuned:{t}"][all_tasks.index(t)] for t in tasks])
    gain = normalised_gain(base, losses, own)
    loss_row, gain_row = np.full(len(all_tasks), math.nan), np.full(len(all_tasks), math.nan)
    loss_row[where], gain_row[where] = losses, gain
    return xr.Dataset(
        {
            "loss": ((UNIT, "task"), loss_row[None]),
            "gain": ((UNIT, "task"), gain_row[None]),
            "mean_gain": ((UNIT,), np.array([np.nanmean(gain) if np.isfinite(gain).any() else math.nan])),
            "seconds": ((UNIT,), np.array([seconds])),
            "fit_loss": ((UNIT,), np.array([tuned.fit_loss if tuned is not None else math.nan])),
            "objective": ((UNIT,), np.array([objective], dtype=np.float64)),
        },
        coords={UNIT: np.array([unit], dtype=object), "task": np.array(all_tasks, dtype=object),
                "subset": (UNIT, np.array([subset or subset_label(tasks)], dtype=object)),
                "seed": (UNIT, np.array([seed], dtype=np.int64)),
                "method": (UNIT, np.array([method or unit], dtype=object)),
                "kind": (UNIT, np.array([kind], dtype=object)),
                "detail": (UNIT, np.array([detail], dtype=object)),
                "hyperparameters": (UNIT, np.array([tuning_record(tuned.setting, tuned.scale, tuned.scale_name)
                                                    if tuned is not None else ""], dtype=object))},
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


def _stored_references(writer: UnitWriter, seed: int, labels: dict, tasks: list[str], subsets) -> dict | None:
    """The reference losses (label → loss per task of `tasks`) of `seed` from a resumed run's units, when every
    reference unit of the seed is stored; else None."""
    wanted = [unit_label(subset_label(s), seed, label) for s in subsets
              for label in ["base", *(f"finetuned:{t}" for t in s)]]
    if not writer.pieces or not all(unit in writer.done for unit in wanted):
        return None
    done = writer.pieces[0]
    references = {label: np.full(len(tasks), math.nan) for label in labels}
    for unit in wanted:
        row = done.sel({UNIT: unit})
        label = str(row.method.values)
        losses = row.loss.sel(task=tasks).values.astype(np.float64)
        references[label] = np.where(np.isnan(references[label]), losses, references[label])
    return references


def _references(evaluator: _Evaluator, writer: UnitWriter, finetuned: dict[str, str], tasks: list[str],
                seed: int, subsets) -> dict:
    """Held-out losses (seed `seed`) of the base and of each fine-tune on every task (from the store when a
    resumed run has them all), written as each subset's reference units."""
    labels = {"base": None, **{f"finetuned:{t}": spec for t, spec in finetuned.items()}}
    references = _stored_references(writer, seed, labels, tasks, subsets)
    seconds = dict.fromkeys(labels, math.nan)
    if references is None:
        references = {}
        for label, spec in labels.items():
            with _timed(seconds, label):
                evaluator.load(spec)
                references[label] = evaluator.losses()
    for subset in subsets:
        name = subset_label(subset)
        for label in ["base", *(f"finetuned:{t}" for t in subset)]:
            unit = unit_label(name, seed, label)
            if unit in writer.done:
                continue
            spec = labels[label]
            kind, detail = ("base", "the base model") if spec is None else ("finetune", spec)
            losses = np.array([references[label][tasks.index(t)] for t in subset])
            writer.add(_piece(unit, kind, detail, losses, references, list(subset), seconds[label],
                              all_tasks=tasks, subset=name, seed=seed, method=label), unit)
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
    subsets: str = "full",
    tune: str | None = "line",
    tune_by: str = "gain",
    seeds: int = 1,
    grids: dict | None = None,
    method_options: dict | None = None,
    objective: bool = True,
    plan=None,
    choose: str = "evidence",
    evidence_options: dict | None = None,
    plan_out: str | Path | None = None,
    keep: str | Path | None = None,
    vocab: str = "base",
    recipes: dict | None = None,
    lm_eval=None,
    load: LoadSettings | None = None,
    run: RunSettings | None = None,
    **options,
) -> xr.Dataset:
    """Merge with every method in turn and evaluate each on held-out records (see the module docstring).

    Returns the ``compare`` dataset: units (subset × seed × method) × task loss and normalised gain, mean gain,
    seconds, the chosen candidate's fit loss, with ``method`` indexed (``dataset.sel({"method": "plan"})``); with
    `store`, writes it as group ``compare`` unit by unit (resumable). `subsets`: full, pairs or all (`task_subsets`);
    `tune`: line, grid or None (`submerge.merge.tuning`; None: every method at its paper's defaults); `tune_by`: the
    tuning criterion, gain (the mean normalised gain on the fit records, the leaderboard's measure) or loss (the mean
    fit loss), `merge.tuning.criterion_weights`; `seeds`:
    data-sample seeds (`resampled`); `grids` (method → {option: values}) replaces rows of `merge.tuning.GRIDS`;
    `method_options` (method → {option: value}, the CLI's ``--option METHOD.KEY=VALUE``) fixes options of registered
    strategies that are not tuned, such as AdaMerging's ``steps``; `objective`: also score each merge's block objective
    (Σ Eq. 10 over blocks) on the held-out records, and its Spearman rank correlation with the held-out loss across
    methods per subset and seed (attrs ``rank_correlation``). `recipes` (label → mergekit config file or `Recipe`) adds users' recipes,
    ranked under their labels (full set only). `lm_eval` (`HarnessSettings`) also scores every model's task accuracy
    (group ``compare_accuracy``; ``accuracy`` in the result; untuned, full set, one seed). ``load`` (or its fields
    as keywords: ``dtype``, ``device``, ``offload``, ``allow_pickle``, ``trust_remote_code``) reads the models;
    ``run`` (or its fields as keywords: ``store``, ``force``, ``progress``, ``command``, ``on_unit``,
    ``capture_budget``): `submerge.diagnostics.execution.RunSettings`, in this process and in float32. A `store`
    that holds a comparison with the same other settings gains the methods it lacks (`with_earlier_methods`).
    """
    load, settings = driver_settings(load, run, options)
    if not isinstance(settings.engine, LocalEngine) or settings.compute_dtype not in (None, "float32"):
        raise CompareError("compare runs in this process and in float32: no Ray engine, no other compute dtype")
    request = CompareRequest.checked(
        base_spec, settings, methods=methods, fit=fit, skip=skip, samples=samples, lambdas=lambdas, subsets=subsets,
        tune=tune, tune_by=tune_by, seeds=seeds, grids=grids, method_options=method_options, objective=objective,
        plan=plan, choose=choose, evidence_options=evidence_options, plan_out=plan_out, keep=keep, recipes=recipes,
        lm_eval=lm_eval)
    experiment = Experiment.load(base_spec, finetuned, data, samples=fit, max_tokens=max_tokens,
                                 batch_size=batch_size, vocab=vocab, **load.keywords())
    _check_given_plan(request.plan, finetuned, experiment)
    records = {seed: {t: resampled(t, data[t], fit=fit, skip=request.skip, samples=samples, seed=seed)
                      for t in experiment.tasks} for seed in range(seeds)}
    _check_before_the_group(settings.store, experiment, request)
    writer = _compare_writer(settings, {**experiment.settings, **request.settings()}, experiment, records)
    _check_outputs_of_pending(writer, request, experiment.tasks, settings)
    run = _Run(experiment, finetuned, request, writer, load=load, settings=settings, base_spec=base_spec,
               vocab=vocab, max_tokens=max_tokens, batch_size=batch_size)
    scorer = None if request.lm_eval is None else _accuracy_scorer(
        experiment, request.lm_eval, data, request.skip, store=settings.store, force=settings.force,
        command=settings.command, progress=settings.progress, allow_pickle=load.allow_pickle)
    scores = _run_all(run, scorer, finetuned, records, task_subsets(experiment.tasks, subsets), settings.progress)
    return _finish(writer, run, experiment.tasks, fit, request.skip, samples, settings.store, scores)


@dataclass(frozen=True)
class CompareRequest:
    """What one `compare` call asks for beyond the models and data, checked before any work (`checked`): the methods
    (an earlier run's first, `with_earlier_methods`), users' recipes (label → `Recipe`), ``--option`` values, tuning,
    protocol, the evidence step's options and the outputs. `settings()` is what the group's numbers depend on beyond
    the experiment and the records (a resumed run must match)."""

    methods: list[str]
    recipes: dict
    method_options: dict
    fit: int
    skip: int
    samples: int
    lambdas: tuple
    subsets: str
    tune: str | None
    tune_by: str
    seeds: int
    grids: dict | None
    objective: bool
    plan: Plan | None
    plan_file: str | Path | None
    choose: str
    evidence_options: dict | None
    plan_out: str | Path | None
    keep: str | Path | None
    lm_eval: object

    @classmethod
    def checked(cls, base_spec: str, settings: RunSettings, *, methods, fit, skip, samples, lambdas, subsets, tune,
                tune_by, seeds, grids, method_options, objective, plan, choose, evidence_options, plan_out, keep,
                recipes, lm_eval) -> CompareRequest:
        tune, tune_by = check_search(tune), check_tune_by(tune_by)
        methods = check_methods(list(methods) if methods else default_methods(tuned=tune is not None))
        plan_file, plan = plan, Plan.load(plan) if isinstance(plan, (str, Path)) else plan
        loaded_recipes = load_recipes(recipes, base_spec, methods)
        methods += list(loaded_recipes)
        method_options = check_method_options(method_options, methods, tuned=tune is not None, grids=grids)
        methods, method_options = with_earlier_methods(settings.store, methods, method_options, loaded_recipes,
                                                       force=settings.force)
        skip = fit if skip is None else skip
        _check_protocol(fit=fit, skip=skip, seeds=seeds, subsets=subsets, tune=tune, keep=keep, lm_eval=lm_eval,
                        plan=plan, choose=choose)
        if lm_eval is not None and lm_eval.samples is None:  # the local tasks score compare's held-out records
            lm_eval = dataclasses.replace(lm_eval, samples=samples)
        if not all(math.isfinite(float(value)) for value in lambdas):
            raise CompareError(f"--lambdas must be finite numbers, got {list(lambdas)}")
        return cls(methods, loaded_recipes, method_options, fit, skip, samples, tuple(lambdas), subsets, tune,
                   tune_by, seeds, grids, objective, plan, plan_file, choose, evidence_options, plan_out, keep, lm_eval)

    def settings(self) -> dict:
        methods, tuned, grids = self.methods, self.tune is not None, self.grids
        return {"fit": self.fit, "held_out_skip": self.skip, "held_out_samples": self.samples,
                "methods": methods, "lambdas": [float(v) for v in self.lambdas], "choose": self.choose,
                "subsets": self.subsets, "tune": self.tune or "none",
                **({"tune_by": self.tune_by} if tuned or TUNED in methods else {}),
                "seeds": self.seeds, "objective": self.objective, "loss": LOSS_RULE,
                **({"grids": {m: {k: list(v) for k, v in g.items()} for m, g in grids.items()}} if grids else {}),
                **({"method_options": self.method_options} if self.method_options else {}),
                **({"tuning": {m: {"settings": settings_of(m, grids),
                                   "lambdas": list(lambdas_of(m, self.lambdas, grids))}
                               for m in methods if m not in self.recipes}} if tuned else {}),
                "plan": str(self.plan_file) if isinstance(self.plan_file, (str, Path)) else None,
                **({"plan_sha256": hashlib.sha256(Path(self.plan_file).read_bytes()).hexdigest()}  # an edited plan
                   if isinstance(self.plan_file, (str, Path)) else {}),
                "evidence": {k: (list(v) if isinstance(v, tuple) else v)
                             for k, v in (self.evidence_options or {}).items()},
                **({"recipes": {label: r.to_mergekit() for label, r in self.recipes.items()}} if self.recipes else {}),
                **({"lm_eval": self.lm_eval.record()} if self.lm_eval is not None else {})}


#: Settings of group ``compare`` that a later run may extend: it adds methods (`with_earlier_methods`).
GROWING_SETTINGS = ("methods", "tuning", "method_options")


def with_earlier_methods(store: Store | None, methods: list[str], method_options: dict, recipes: dict, *,
                         force: bool) -> tuple[list[str], dict]:
    """The methods (and ``--option`` values) of the comparison `store` holds, then the new ones. A run that asks for
    methods the store lacks adds them to its comparison, with every other setting the same (`Store.begin` with
    ``grows``), and merges only what the store lacks; the leaderboard has them all. A method both runs name keeps
    its options: other ones are a CompareError. A store made with other settings is refused as before."""
    if store is None or force or not store.has(COMPARE.name):
        return methods, method_options
    earlier = store.group_attrs(COMPARE.name).get("settings") or {}
    known = {*default_methods(), *recipes}
    old = [m for m in earlier.get("methods") or [] if m in known]
    old_options = earlier.get("method_options") or {}
    for method in [m for m in methods if m in old]:
        if jsonable(method_options.get(method, {})) != old_options.get(method, {}):
            raise CompareError(f"{store.path} compared {method!r} with options {old_options.get(method, {})}, this "
                               f"run gives {method_options.get(method, {})}: give the same --option values to add "
                               "methods to that comparison, or --force to compare afresh")
    return [*old, *(m for m in methods if m not in old)], {**old_options, **method_options}


def _check_outputs_of_pending(writer, request: CompareRequest, tasks: list[str], settings: RunSettings) -> None:
    """The outputs (--keep, --plan-out) of the full set's methods not yet in the store, checked before any work; a
    plan compared by an earlier run is not built again, so --plan-out is not written (a warning says so)."""
    methods, plan_out = request.methods, request.plan_out
    full_pending = [m for m in methods if unit_label(subset_label(tasks), 0, m) not in writer.done]
    _check_outputs(full_pending, request.keep, plan_out, settings.store, settings.force)
    if plan_out is not None and PLAN in methods and PLAN not in full_pending:
        warnings.warn(f"'{PLAN}' was compared by an earlier run of this store, so no plan was built and {plan_out} "
                      f"is not written: run with --force to recompute, or write a plan with `diag plan`")


def _check_before_the_group(store, experiment, request: CompareRequest) -> None:
    """What `compare` refuses before its group exists (a refused run leaves none): a store of other models, the
    evidence step's options."""
    methods, plan, choose = request.methods, request.plan, request.choose
    _refuse_other_models(store, experiment.inputs, methods, plan=plan, choose=choose)
    if _needs_evidence(methods, plan, choose):
        check_evidence_options(experiment, request.evidence_options)


def _check_given_plan(plan, finetuned: dict[str, str], experiment) -> None:
    """A given plan merges compare's fine-tunes, and its units are the model's (before any work)."""
    if plan is None:
        return
    if sorted(plan.finetuned) != sorted(finetuned):
        raise CompareError(f"the plan merges {sorted(plan.finetuned)}, compare was given {sorted(finetuned)}")
    plan.check_units(TensorTable.from_model(experiment.base.model, experiment.base.checkpoint_names, experiment.arch))


def _fit_references(evaluator: _Evaluator, finetuned: dict[str, str], tasks: list[str]) -> dict:
    """The base's fit loss on every task and each fine-tune's on its own task (what `criterion_weights` needs)."""
    evaluator.load(None)
    base = dict(zip(tasks, map(float, evaluator.losses(evaluator.fit))))
    own = {}
    for task in tasks:
        evaluator.load(finetuned[task])
        own[task] = float(evaluator.losses(evaluator.fit, [task])[0])
    return {"base": base, "finetuned": own}


def _compare_writer(run: RunSettings, settings: dict, experiment, records: dict) -> UnitWriter:
    """The writer of group ``compare`` (`settings`), its attrs naming the held-out files and the records each seed
    drew."""
    store, force, on_unit, command = run.store, run.force, run.on_unit, run.command
    held_provenance = {t: d.provenance() for t, (_, d) in records[0].items()}
    drawn = {str(seed): {t: {"fit": fit_data.indices, "held_out": held.indices}
                         for t, (fit_data, held) in by_task.items()} for seed, by_task in records.items()}
    return UnitWriter(store, COMPARE.name, settings, dim=UNIT, force=force, on_unit=on_unit, grows=GROWING_SETTINGS,
                      root=experiment.root_attrs(command),
                      attrs=experiment.group_attrs(command, held_out=held_provenance, drawn_records=drawn))


def _check_protocol(*, fit: int, skip: int, seeds: int, subsets: str, tune, keep, lm_eval, plan, choose: str) -> None:
    """The combinations of compare's options it refuses, before any work."""
    if skip < fit:
        raise CompareError(f"--skip {skip} < --fit {fit}: held-out records would include fit records")
    if seeds < 1:
        raise CompareError(f"--seeds must be at least 1, got {seeds}")
    protocol = subsets != "full" or seeds > 1
    if (keep is not None or lm_eval is not None) and (protocol or tune is not None):
        raise CompareError("--keep and --lm-eval score the merges at their paper defaults on the full set: give "
                           "them with --tune none, --subsets full and one seed")
    if protocol and (plan is not None or choose == "thresholds"):
        raise CompareError("a given plan (--plan, --choose thresholds) merges the full set once: use --subsets full "
                           "and one seed")


def _run_all(run: _Run, scorer, finetuned: dict[str, str], records: dict, subsets, progress: bool):
    """Every seed's units under one progress bar (the harness scores of the references first, with --lm-eval);
    returns the harness scores or None."""
    try:
        if scorer is not None:
            for label, spec in {"base": None, **{f"finetuned:{t}": s for t, s in finetuned.items()}}.items():
                scorer.run(label, spec)
        run.accuracy = scorer.run if scorer is not None else None
        with progress_bar(progress) as bar:
            run.bar, run.job = bar, bar.add_task("Comparing merges",
                                                total=len(records) * sum(len(run.methods_of(s)) for s in subsets))
            for seed in range(len(records)):
                run.seed_run(seed, records[seed], subsets)
        return scorer.finish() if scorer is not None else None
    finally:
        if scorer is not None:
            scorer.close()


def _finish(writer: UnitWriter, run, tasks, fit, skip, samples, store, scores) -> xr.Dataset:
    """The whole group (units concatenated, `method` indexed); base and fine-tune losses of seed 0 in attrs."""
    result = writer.finish({
        "loss": "mean next-token cross-entropy over real tokens on held-out records, nats",
        "gain": "(loss_base - loss_model) / (loss_base - loss_finetune_of_the_task): 0 = base, 1 = own fine-tune",
        "fit_loss": "the chosen candidate's tuning criterion on the fit records, sum_t w_t loss_t (nats): w in "
                    "attrs 'fit_weights <subset>|<seed>' (tune_by gain: w_t proportional to 1 / the fine-tune's "
                    "fit-record gain on task t), the plain mean over tasks without them",
        "records": f"fit: the first {fit} records of each task file; held out: {samples} records after the "
                   f"first {skip} (seed s > 0: the same positions of the first {skip + samples} records permuted "
                   f"by numpy default_rng(s); the drawn indices are in attrs 'drawn_records')",
        **run.notes,
    })
    correlation = rank_correlations(result)
    if correlation:
        result.attrs["rank_correlation"] = correlation
        if store is not None:
            store.finish(COMPARE.name, {"rank_correlation": correlation})
    references = run.references.get(0)
    if references is not None:
        result.attrs.update({"base_loss": dict(zip(tasks, map(float, references["base"]))),
                             "finetuned_loss": {t: float(references[f"finetuned:{t}"][i])
                                                for i, t in enumerate(tasks)}})
        if store is not None:
            store.finish(COMPARE.name, {key: result.attrs[key] for key in ("base_loss", "finetuned_loss")})
    if scores is not None:
        frame = accuracy_frame(scores).reindex([str(m) for m in result.method.values])
        result["accuracy"] = xr.DataArray(frame.to_numpy(dtype=np.float64), dims=(UNIT, "benchmark"),
                                          coords={"benchmark": np.array(frame.columns, dtype=object)})
    return indexed(result)


def rank_correlations(dataset: xr.Dataset) -> dict:
    """{subset: {seed: ρ}}: Spearman's rank correlation, across the merges of one subset and seed (every unit with
    a block objective), between Σ_blocks Eq. 10 on the held-out records and the mean held-out loss over the subset's
    tasks. ρ near 1: the objective orders the merges as the loss does, so it can choose among them. NaN with fewer
    than three merges or a constant column."""
    if "objective" not in dataset or UNIT not in dataset.dims:
        return {}
    result: dict = {}
    objective, loss = dataset.objective.values, np.nanmean(dataset.loss.values, axis=1)
    subsets, seeds = strings(dataset.subset.values), dataset.seed.values
    for subset in dict.fromkeys(subsets):
        for seed in dict.fromkeys(int(s) for s in seeds):
            rows = (np.array(subsets) == subset) & (seeds == seed) & np.isfinite(objective) & np.isfinite(loss)
            if rows.sum() >= 3 and np.ptp(objective[rows]) > 0 and np.ptp(loss[rows]) > 0:
                rho = float(spearmanr(objective[rows], loss[rows]).statistic)
            elif rows.any():
                rho = math.nan
            else:
                continue
            result.setdefault(subset, {})[str(seed)] = rho
    return result


def _title(dataset: xr.Dataset) -> str:
    """The leaderboard's title, with the rank correlation of block objective and held-out loss per subset."""
    title = "Held-out loss and normalised gain (0 = base, 1 = the task's own fine-tune), best mean gain first"
    settings = dataset.attrs.get("settings")
    if isinstance(settings, dict) and settings.get("tune", "none") != "none":  # stores before stop 36: by the loss
        by = "mean normalised gain" if settings.get("tune_by", "loss") == "gain" else "mean loss"
        title += f"; each method tuned ({settings['tune']}) by its {by} on the fit records"
    correlation = dataset.attrs.get("rank_correlation") or rank_correlations(dataset)
    if correlation:
        shown = "; ".join(f"{subset} " + ", ".join(f"{rho:.2f}" for rho in by_seed.values())
                          for subset, by_seed in correlation.items())
        title += f". Spearman ρ(Σ block Eq. 10, held-out loss) across merges: {shown}"
    spent = time_spent(dataset)
    if spent:
        title += ". Time (units and data steps summed): " + "; ".join(
            f"{subset} {_minutes(seconds)}" for subset, seconds in spent.items())
    return title


def time_spent(dataset: xr.Dataset) -> dict[str, float]:
    """{subset: seconds} of the runs that wrote the group: every unit's wall (references, and each method's tuning
    and held-out evaluation; ``seconds``) and every data step's (RegMean's Grams, Fisher, AdaMerging, LoraHub, the
    evidence step: attrs ``data_step_seconds <subset>|<seed>``), over all seeds; a board grown over several runs sums
    them all. Empty for a dataset without units (one subset's board by method) or without times."""
    if UNIT not in dataset.dims or "seconds" not in dataset or "subset" not in dataset.coords:
        return {}
    spent: dict[str, float] = {}
    for subset, seconds in zip(strings(dataset.subset.values), dataset.seconds.values):
        if np.isfinite(seconds):
            spent[subset] = spent.get(subset, 0.0) + float(seconds)
    for key, steps in dataset.attrs.items():
        if key.startswith("data_step_seconds ") and isinstance(steps, dict):
            subset = key.removeprefix("data_step_seconds ").rpartition("|")[0]
            spent[subset] = spent.get(subset, 0.0) + sum(float(v) for v in steps.values())
    return spent


def _minutes(seconds: float) -> str:
    """1234.5 → "20 min 34 s"; under a minute, "42 s"."""
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60:02d} s" if whole >= 60 else f"{whole} s"


def indexed(dataset: xr.Dataset) -> xr.Dataset:
    """The group with its ``method`` coordinate indexed: ``dataset.sel({"method": "plan"})`` (every subset and seed's
    unit of that method; one unit when the group has one subset and one seed)."""
    if UNIT in dataset.dims and "method" in dataset.coords and "method" not in dataset.xindexes:
        return dataset.set_xindex("method")
    return dataset


class _Run:
    """One `compare` call: each seed's records, then each subset's methods, unit by unit into `writer`."""

    def __init__(self, experiment, finetuned, request: CompareRequest, writer, *, load: LoadSettings,
                 settings: RunSettings, base_spec: str, vocab: str, max_tokens: int, batch_size: int):
        self.experiment, self.finetuned, self.request, self.writer = experiment, finetuned, request, writer
        self.settings, self.store, self.allow_pickle = settings, settings.store, load.allow_pickle
        self.base_spec, self.vocab, self.max_tokens, self.batch_size = base_spec, vocab, max_tokens, batch_size
        self.notes: dict = {}
        self.references: dict[int, dict] = {}
        self.fit_references: dict[int, dict] = {}  # seed → {"base": {task: loss}, "finetuned": {task: loss}}
        self.accuracy = self.bar = self.job = None

    def note(self, notes: dict) -> None:
        """Attrs of the group: kept in `notes` and written at once (a killed run keeps them)."""
        self.notes.update(notes)
        self.writer.note(notes)

    def methods_of(self, subset) -> list[str]:
        """The methods merged on `subset` (users' recipes bind every fine-tune: on the full set only)."""
        full = list(subset) == self.experiment.tasks
        return self.request.methods if full else [m for m in self.request.methods if m not in self.request.recipes]

    def tokenized(self, data: TaskData):
        return tokenize(data, self.experiment.base.tokenizer, max_tokens=self.max_tokens, batch_size=self.batch_size)

    def seed_run(self, seed: int, records: dict, subsets) -> None:
        """Every pending unit of `seed`: the references once, then each subset's merges."""
        tasks = self.experiment.tasks
        pending = {s: [m for m in self.methods_of(s) if unit_label(subset_label(s), seed, m) not in self.writer.done]
                   for s in subsets}
        self.bar.advance(self.job, sum(len(self.methods_of(s)) - len(p) for s, p in pending.items()))
        references_done = all(unit_label(subset_label(s), seed, label) in self.writer.done for s in subsets
                              for label in ["base", *(f"finetuned:{t}" for t in s)])
        if not any(pending.values()) and references_done:
            return
        if seed == 0:
            experiment = self.experiment  # loaded on the first `fit` records: seed 0's
        else:
            data = {t: fit_data for t, (fit_data, _) in records.items()}
            experiment = dataclasses.replace(self.experiment, data=data,
                                             batches={t: self.tokenized(d) for t, d in data.items()})
        held_out = {t: self.tokenized(held) for t, (_, held) in records.items()}
        self.bar.update(self.job, description=f"Comparing · seed {seed} · base and fine-tunes")
        everything = _Evaluator(experiment, held_out, allow_pickle=self.allow_pickle)
        self.references[seed] = _references(everything, self.writer, self.finetuned, tasks, seed, subsets)
        _warn_undefined_gain(self.references[seed], tasks)
        request = self.request
        tuned = request.tune is not None or TUNED in request.methods
        if request.tune_by == "gain" and tuned and any(pending.values()):
            self.bar.update(self.job, description=f"Comparing · seed {seed} · base and fine-tunes on the fit records")
            key = f"fit_references {seed}"  # a resumed run reads them back (its models and records are checked)
            stored = self.store.group_attrs(COMPARE.name).get(key) if self.store is not None and self.writer.done else None
            self.fit_references[seed] = stored or _fit_references(everything, self.finetuned, tasks)
            self.note({key: self.fit_references[seed]})
        for subset in subsets:
            if pending[subset]:
                self.subset_run(seed, subset, experiment, held_out, pending[subset])

    def subset_run(self, seed: int, subset: tuple[str, ...], experiment, held_out: dict, pending: list[str]) -> None:
        name = subset_label(subset)
        full = list(subset) == self.experiment.tasks
        finetuned = {t: self.finetuned[t] for t in subset}
        part = restricted(experiment, subset)
        recipes = {label: r for label, r in self.request.recipes.items() if label in pending} if full else {}
        self.bar.update(self.job, description=f"Comparing · {name} · seed {seed} · fitting the data-driven merges")
        request, settings = self.request, self.settings
        merges, _ = prepare(part, finetuned, [m for m in pending if m != TUNED and m not in request.recipes],
                            plan=request.plan, choose=request.choose, store=self.store,
                            evidence_options=request.evidence_options, progress=settings.progress,
                            command=settings.command, force=settings.force, record_evidence=full and seed == 0,
                            method_options=request.method_options, seconds=(seconds := {}),
                            capture_budget=settings.capture_budget)
        if seconds:  # the data steps' wall time, outside every unit's `seconds`; a grown board keeps earlier ones
            key = f"data_step_seconds {name}|{seed}"
            earlier = self.notes.get(key) or (self.store.group_attrs(self.writer.group).get(key, {})
                                              if self.store is not None and self.store.has(self.writer.group) else {})
            self.note({key: {**earlier, **seconds}})
        merges.update({label: _recipe_merge(label, recipe, self.base_spec, finetuned, self.allow_pickle)
                       for label, recipe in recipes.items()})
        evaluator = _Evaluator(part, {t: held_out[t] for t in subset}, allow_pickle=self.allow_pickle)
        if seed in self.fit_references:
            references = self.fit_references[seed]
            weights = criterion_weights(self.request.tune_by, [references["base"][t] for t in subset],
                                        [references["finetuned"][t] for t in subset], subset)
            evaluator.fit_weights = weights
            self.note({f"fit_weights {name}|{seed}": dict(zip(subset, map(float, weights)))})
        if self.request.objective:
            evaluator.held_experiment = dataclasses.replace(part, batches={t: by_length(held_out[t]) for t in subset})
        pending = [m for m in pending if m in merges or m == TUNED]
        self.notes.update(_run_methods(pending, merges, evaluator, self.writer, self.references[seed],
                                       self.base_spec, finetuned, self, subset=name, seed=seed,
                                       all_tasks=self.experiment.tasks))


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


def checkpoint_bytes(reader) -> int:
    """Bytes of the tensors of a checkpoint (`reader`): what a merge written in its dtypes takes on disk."""
    return sum(math.prod(reader.shape(name)) * reader.dtype(name).itemsize for name in reader.names())


def _fit_together(count: int, reader, scratch: Path) -> bool:
    """Whether `count` merges of the checkpoint `reader` may be written in one pass: they take at most
    `TOGETHER_BYTES` together and less than half the scratch disk's free space."""
    size = count * checkpoint_bytes(reader)
    return size <= TOGETHER_BYTES and size < shutil.disk_usage(scratch).free // 2


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


def _run_methods(pending, merges, evaluator, writer, references, base_spec, finetuned, run, *, subset: str,
                 seed: int, all_tasks: list[str]) -> dict:
    """Write, load, evaluate and (unless kept) delete each pending method's merge, tuned on the fit records
    unless ``run.request.tune`` is None; returns notes for attrs."""

    notes = {}
    scratch = _scratch_directory()
    evaluator.shared = scratch / "block-targets"  # the fine-tunes' block outputs, replayed once for every merge
    keep = Path(run.request.keep) if run.request.keep is not None else None
    store, bar, job = run.store, run.bar, run.job

    def write_all(labeled: list[tuple[str, Merge]], kept: bool = False) -> list[Path]:
        """Write the merges (label, merge), which share their per-tensor data input, in one pass."""
        outputs = [((keep if (keep is not None and kept) else scratch) / label, merge.rule_for,
                    {**merge.record, "compare": {"method": label, "store": str(Path(store.path).resolve())
                                                 if store is not None else None}}) for label, merge in labeled]
        # force: scratch is this run's; keep/<label> was checked by _check_outputs before any work
        return write_merges(base_spec, finetuned, outputs, force=True, allow_pickle=run.allow_pickle,
                            vocab=run.vocab, gram_matrices=labeled[0][1].gram_matrices, progress=False)

    def write(label: str, merge: Merge, kept: bool = True) -> Path:
        return write_all([(label, merge)], kept)[0]

    def write_together(labeled: list[tuple[str, Merge]]) -> list[Path] | None:
        return write_all(labeled) if _fit_together(len(labeled), evaluator.base.reader, scratch) else None

    try:
        for label in pending:
            where = f"{subset} · seed {seed} · {label}"
            bar.update(job, description=f"Comparing · {where}")
            start = time.perf_counter()
            if label == TUNED:
                best, fit_loss = _tune_lambda(evaluator, write, run.request.lambdas)
                key = "lambda_search" if (subset, seed) == (subset_label(all_tasks), 0) else f"lambda_search {where}"
                notes[key] = {f"{v:g}": loss for v, loss in fit_loss.items()}
                writer.note({key: notes[key]})  # kept if the run is killed later
                rule = ParameterRule(method="task-arithmetic", options={"scaling": best})
                merges[label] = Merge(lambda info, rule=rule: rule, f"λ = {best:g} (fit loss "
                                      f"{fit_loss[best]:.4g})", {"method": "task-arithmetic",
                                                                "options": {"scaling": best}})
            merge, tuned = merges[label], None
            kind = merge.kind or ("plan" if label == PLAN else "closed-form" if label in CLOSED_FORM else "strategy")
            if run.request.tune is not None and label != TUNED and kind != "recipe":
                request = run.request
                losses, tuned = _tune(label, merge, evaluator, write, search=request.tune, lambdas=request.lambdas,
                                      grids=request.grids, fixed=request.method_options.get(label),
                                      write_together=write_together,
                                      on_candidate=lambda text, where=where: bar.update(
                                          job, description=f"Comparing · {where} · {text}"))
                notes[f"search {unit_label(subset, seed, label)}"] = tuned.searched
                writer.note({f"search {unit_label(subset, seed, label)}": tuned.searched})
                detail, objective = f"tuned ({run.request.tune}): {tuned.label}; {merge.detail}", tuned.objective
            else:
                directory = write(label, merge)
                evaluator.load(str(directory))
                losses = evaluator.losses()
                objective = evaluator.objective(open_checkpoint(str(directory), base=evaluator.base.reader))
                if run.accuracy is not None:  # before the loss unit: a killed run redoes this merge and resumes here
                    run.accuracy(label, str(directory))
                if keep is None:
                    shutil.rmtree(directory, ignore_errors=True)
                detail = merge.detail
            if label == PLAN and run.request.plan_out is not None and (subset, seed) == (subset_label(all_tasks), 0):
                # checked by _check_outputs; tuned, the plan as tuned, so that diag merge of it writes this model
                saved = merge.plan if tuned is None else _tuned_plan(merge, tuned)
                if gram_ruled(saved):  # what `diag merge` needs to measure its RegMean rules' Grams again
                    saved.decision["fit_data"] = {
                        "data": {t: str(run.experiment.data[t].path) for t in run.experiment.tasks},
                        "samples": min(len(run.experiment.data[t].texts) for t in run.experiment.tasks),
                        "max_tokens": run.max_tokens}
                saved.save(run.request.plan_out, force=True)
            unit = unit_label(subset, seed, label)
            writer.add(_piece(unit, kind, detail, losses, references, list(evaluator.tasks),
                              time.perf_counter() - start, all_tasks=all_tasks, subset=subset, seed=seed,
                              method=label, tuned=tuned, objective=objective), unit)
            bar.advance(job)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return notes


# ------------------------------------------------------------------ the store group


def by_subset(dataset: xr.Dataset) -> list[tuple[str, xr.Dataset]]:
    """(subset label, its method × task dataset) per subset of the group, in the group's order: loss, gain and
    mean gain averaged over seeds, ``mean_gain_std`` their standard deviation over seeds (ddof 1; NaN with one
    seed), the subset's own tasks only; ``hyperparameters`` the chosen ones per seed joined by "; ".
    A dataset already by method (no ``unit`` dimension) is one subset as it is."""
    if UNIT not in dataset.dims:
        return [(str(dataset.attrs.get("subset", "")), dataset)]
    dataset = dataset.drop_indexes([name for name in dataset.xindexes if name != UNIT])
    subsets = list(dict.fromkeys(strings(dataset.subset.values)))
    parts = []
    for subset in subsets:
        part = dataset.isel({UNIT: np.array(strings(dataset.subset.values)) == subset})
        methods = list(dict.fromkeys(strings(part.method.values)))
        tasks = [t for t in strings(dataset.task.values) if np.isfinite(part.loss.sel(task=t).values).any()]
        rows = {m: np.array(strings(part.method.values)) == m for m in methods}
        mean = {v: np.stack([part[v].values[rows[m]].mean(axis=0) for m in methods])
                for v in ("loss", "gain", "mean_gain", "seconds", "fit_loss") if v in part}
        std = np.array([part.mean_gain.values[rows[m]].std(ddof=1) if rows[m].sum() > 1 else math.nan
                        for m in methods])

        def first(name: str, joined: bool = False, part=part, methods=methods, rows=rows) -> np.ndarray:
            values = []
            for m in methods:
                chosen = strings(part[name].values[rows[m]])
                values.append("; ".join(dict.fromkeys(chosen)) if joined else chosen[0])
            return np.array(values, dtype=object)

        task_index = [strings(dataset.task.values).index(t) for t in tasks]
        by_method = xr.Dataset(
            {"loss": (("method", "task"), mean["loss"][:, task_index]),
             "gain": (("method", "task"), mean["gain"][:, task_index]),
             "mean_gain": (("method",), mean["mean_gain"]), "mean_gain_std": (("method",), std),
             "seconds": (("method",), mean["seconds"])},
            coords={"method": np.array(methods, dtype=object), "task": np.array(tasks, dtype=object),
                    "kind": ("method", first("kind")), "detail": ("method", first("detail")),
                    "seeds": ("method", np.array([int(rows[m].sum()) for m in methods]))},
            attrs={"subset": subset})
        if "hyperparameters" in part.coords:
            by_method.coords["hyperparameters"] = ("method", first("hyperparameters", joined=True))
        if "accuracy" in part:
            by_method["accuracy"] = xr.DataArray(part.accuracy.values, dims=("method", "benchmark"),
                                                 coords={"benchmark": part.benchmark.values})
        parts.append((subset, by_method))
    return parts


def summary(dataset: xr.Dataset, rank_by: str = "gain") -> pd.DataFrame:
    """The leaderboard of every subset (`by_subset`), each sorted by `rank_by`, best first, one after the other
    (with several subsets a first column ``subset`` says which): one row per method, its loss and normalised gain
    per task and the mean gain (± its standard deviation over seeds with several seeds), the tuned hyperparameters
    (``tuned``) when the run tuned, and with ``accuracy`` (``compare`` with ``lm_eval``) each benchmark's accuracy and
    their mean. `rank_by`: ``gain`` (the mean gain), ``accuracy`` (the mean accuracy) or one benchmark's column
    (e.g. ``"demo_gsm8k exact_match"``)."""
    parts = by_subset(dataset)
    frames = []
    for subset, part in parts:
        frame = _ranked(part, rank_by)
        if len(parts) > 1:
            frame.insert(0, "subset", subset)
        frames.append(frame)
    frame = pd.concat(frames) if len(frames) > 1 else frames[0]
    if "rank_correlation" in dataset.attrs:
        frame.attrs["rank_correlation"] = dataset.attrs["rank_correlation"]
    return frame


def _ranked(dataset: xr.Dataset, rank_by: str) -> pd.DataFrame:
    """One subset's leaderboard (a method × task dataset)."""
    tasks = strings(dataset.task.values)
    frame = pd.DataFrame(index=pd.Index(strings(dataset.method.values), name="method"))
    for task in tasks:
        frame[f"loss {task}"] = dataset.loss.sel(task=task).values
    for task in tasks:
        frame[f"gain {task}"] = dataset.gain.sel(task=task).values
    frame["mean gain"] = dataset.mean_gain.values
    if "mean_gain_std" in dataset and np.isfinite(dataset.mean_gain_std.values).any():
        frame["± std"] = dataset.mean_gain_std.values
    if "hyperparameters" in dataset.coords and any(strings(dataset.hyperparameters.values)):
        frame["tuned"] = [_short(text) for text in strings(dataset.hyperparameters.values)]
    if "seconds" in dataset and np.isfinite(dataset.seconds.values).any():
        frame["seconds"] = dataset.seconds.values  # the unit's wall (tuning and held-out evaluation; mean over seeds)
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


def _short(hyperparameters: str) -> str:
    """'{"scaling": 0.6, "top_k": 0.2}' → "scaling=0.6 top_k=0.2" (each seed's, "; " between seeds)."""
    import json

    shown = []
    for text in hyperparameters.split("; "):
        try:
            values = json.loads(text) if text else {}
        except ValueError:
            shown.append(text)
            continue
        shown.append(" ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()))
    return "; ".join(shown)


leaderboard = summary  # the name the Python API has used


_KIND_COLOURS = {"plan": "#c0392b", "closed-form": "#e67e22", "strategy": "#7f8c8d", "base": "#34495e",
                 "finetune": "#2980b9"}


def compare_leaderboard(comparison: xr.Dataset, about: str = ""):
    """The leaderboard as a figure, one panel per subset: mean normalised gain per method (bars, best on top; over
    seeds with several) and each task's gain (dots). 0 is the base, 1 the task's own fine-tune (dashed lines)."""
    parts = [(subset, part) for subset, part in by_subset(comparison) if part.sizes.get("method", 0)]
    if not parts:
        return None
    with plot.styled() as (plt, _):
        heights = [0.38 * part.sizes["method"] + 1.2 for _, part in parts]
        fig, axes = plt.subplots(len(parts), 1, figsize=(8.5, sum(heights) + 0.6), layout="constrained",
                                 gridspec_kw={"height_ratios": heights}, squeeze=False)
        for ax, (subset, part) in zip(axes[:, 0], parts):
            _leaderboard_panel(ax, part, subset if len(parts) > 1 else "")
        plot.title(fig, "Held-out leaderboard of merges (group compare)", about)
    return fig


def _leaderboard_panel(ax, comparison: xr.Dataset, subset: str) -> None:
    methods = strings(comparison.method.values)
    mean = pd.Series(comparison.mean_gain.values, index=methods).sort_values(ascending=True, na_position="first")
    frame = long_frame(comparison.gain)
    kinds = dict(zip(methods, strings(comparison.kind.values))) if "kind" in comparison.coords else {}
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
    if subset:
        ax.set_title(f"subset {subset}", fontsize=9)
    ax.set_xlabel("normalised gain (base − model) / (base − fine-tune); bars: mean over tasks")
    ax.legend(title="task", loc="lower right", frameon=True, fontsize=8)


COMPARE = StoreGroup(
    name="compare",
    dim=UNIT,
    variables={"loss": (UNIT, "task"), "gain": (UNIT, "task"), "mean_gain": (UNIT,), "seconds": (UNIT,),
               "fit_loss": (UNIT,), "objective": (UNIT,)},
    title=_title,
    summary=summary,
    figures={"compare": compare_leaderboard},
)

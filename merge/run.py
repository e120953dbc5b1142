"""The merge driver behind `diag merge`: a plan, a mergekit recipe or a registered method → rules → the streaming writer.

`run_merge` takes a plan file (`submerge.merge.plan.Plan`), a mergekit config (`submerge.merge.recipe.Recipe`:
its models, its rule per tensor, its output dtype) or a method name (any of
``submerge.merge.strategies.STRATEGIES`` or a mergekit alias). Methods that need data (``inputs`` in the
registry) get them here, on the base model θ0 and the task data:

- ``closed-form``: α per unit solved by `submerge.diagnostics.linearity.alpha` (seed 002 Eq. 12–14, 33–34)
  at the option ``granularity``; every tensor of a unit gets θ0 + Σ_t α_t τ_t (the plan's rules);
- ``regmean``: the Gram matrix of each linear map's inputs per task (`submerge.diagnostics.capture.GramsByLayer`:
  computed block by block as the writer reaches each block), RegMean on those maps and task arithmetic elsewhere;
- ``fisher``: the diagonal Fisher of each fine-tune on its task's records (`submerge.merge.learned.fisher_diagonals`,
  kept on disk), Fisher merging on every parameter;
- ``adamerging`` / ``lorahub``: weights per task (and tensor) learned on the records
  (`submerge.merge.learned.adamerging_coefficients`, `lorahub_coefficients`), θ0 + Σ_t w_t τ_t per tensor.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from submerge.diagnostics.capture import GramsByLayer
from submerge.diagnostics.checkpoints import local_path, model_fingerprints, open_checkpoint
from submerge.diagnostics.execution import Engine
from submerge.diagnostics.experiment import Experiment
from submerge.diagnostics.linearity import alpha
from submerge.diagnostics.provenance import identity_changes, input_identity
from submerge.diagnostics.tensors import TensorTable
from submerge.merge.learned import LEARNED_METHODS, learn
from submerge.merge.plan import Plan, PlanError, gram_ruled, plan_from_alpha
from submerge.merge.recipe import Recipe
from submerge.merge.rules import RuleFunction, checked_method, method_rule, regmean_rule
from submerge.merge.strategies import STRATEGIES
from submerge.merge.writer import MergeError, check_not_an_input, check_output, parse_size, write_merge


@dataclass
class MergeSetup:
    """What the writer needs besides the checkpoints: a rule per tensor, RegMean's Grams, what to record."""

    rule_for: RuleFunction
    record: dict
    gram_matrices: Callable[[str], list[torch.Tensor] | None] | None = None


@dataclass
class DataSettings:
    """Task data for the methods that need it (closed-form, regmean, fisher, adamerging, lorahub): records read
    per task and their length."""

    data: dict[str, str] = field(default_factory=dict)
    samples: int = 30
    max_tokens: int = 512
    batch_size: int = 8

    def experiment(self, base: str, finetuned: dict[str, str], *, device: str, offload: bool, allow_pickle: bool,
                   vocab: str) -> Experiment:
        """These records of each task on `base` and its `finetuned` (the base loaded on `device`, or with `offload`
        streamed to it block by block), as the data steps fit on them."""
        return Experiment.load(base, finetuned, self.data, samples=self.samples, max_tokens=self.max_tokens,
                               batch_size=self.batch_size, dtype="auto", device=device, offload=offload,
                               allow_pickle=allow_pickle, trust_remote_code=False, vocab=vocab)


def needs_data(method: str) -> bool:
    """Whether `method` (a name or mergekit alias) needs task data; unknown names are a MergeError."""
    return STRATEGIES[checked_method(method)[0]].needs_data


def run_merge(
    out_dir: str | Path,
    *,
    plan: str | Path | None = None,
    method: str | None = None,
    recipe: str | Path | None = None,
    options: dict | None = None,
    base: str | None = None,
    finetuned: dict[str, str] | None = None,
    data: DataSettings | None = None,
    shard_size: str | int = "2GB",
    device: str = "cpu",
    offload: bool = False,
    allow_pickle: bool = False,
    vocab: str = "base",
    force: bool = False,
    progress: bool = True,
    out_dtype: str | torch.dtype | None = None,
    engine: Engine | None = None,
) -> Path:
    """Write the merged checkpoint of a plan file, of a mergekit config (`recipe`: it names the models) or of
    `method` (+ `options`) on `base` + `finetuned`.

    Every setting is checked before any work (output, shard size, out dtype, outputs that would
    overwrite an input); tensors are written in `out_dtype` ("base": each base tensor's dtype; None: a
    recipe's ``out_dtype`` / ``dtype``, else each base tensor's).
    ``engine``: where the tensors are merged (`submerge.diagnostics.execution`; default this process).
    """
    out_dir = Path(out_dir)
    if sum(given is not None for given in (plan, method, recipe)) != 1:
        raise ValueError("give one of a plan, a mergekit recipe or a method")
    parse_size(shard_size)
    if recipe is not None:
        the_recipe = recipe if isinstance(recipe, Recipe) else Recipe.load(recipe)
        base, finetuned = the_recipe.base, the_recipe.finetuned()
        setup = recipe_setup(the_recipe, allow_pickle=allow_pickle, path=None if isinstance(recipe, Recipe) else recipe)
        out_dtype = the_recipe.output_dtype() if out_dtype is None else out_dtype
    dtype = parse_out_dtype(out_dtype)
    if plan is not None:
        the_plan = Plan.load(plan)
        base, finetuned = the_plan.base_model, the_plan.finetuned
        _check_plan(the_plan, allow_pickle)
        setup = MergeSetup(the_plan.rule_for, {"plan": str(plan), "granularity": the_plan.granularity},
                           _plan_grams(the_plan, plan, data, device=device, offload=offload,
                                       allow_pickle=allow_pickle, vocab=vocab))
    _refuse_inputs(out_dir, base, finetuned, allow_pickle)
    check_output(out_dir, force)
    if method is not None:
        setup = method_setup(method, options or {}, base, finetuned, data or DataSettings(), device=device,
                             offload=offload, allow_pickle=allow_pickle, vocab=vocab, progress=progress)
    setup.record["out_dtype"] = str(dtype).removeprefix("torch.") if dtype else "base"
    return write_merge(base, finetuned, out_dir, setup.rule_for, record=setup.record, force=force,
                       allow_pickle=allow_pickle, vocab=vocab, shard_size=shard_size, dtype=dtype, device=device,
                       gram_matrices=setup.gram_matrices, progress=progress, engine=engine)


OUT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
              "float64": torch.float64}


def parse_out_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """None for "base"/"auto"/None (each tensor keeps the base's dtype), else one of OUT_DTYPES."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if value in ("base", "auto"):
        return None
    if value not in OUT_DTYPES:
        raise MergeError(f"--out-dtype: unknown dtype '{value}' (base, {', '.join(OUT_DTYPES)})")
    return OUT_DTYPES[value]


def _refuse_inputs(out_dir: Path, base: str, finetuned: dict[str, str], allow_pickle: bool) -> None:
    """`check_not_an_input` on the inputs' local paths, before any data step (the writer checks again)."""

    inputs = {}
    for what, spec in {"base model": base, **{f"fine-tune '{t}'": s for t, s in (finetuned or {}).items()}}.items():
        with contextlib.suppress(Exception):  # an input that cannot be resolved fails with its own message later
            inputs[what] = local_path(spec, allow_pickle=allow_pickle)
    check_not_an_input(out_dir, inputs)


def _check_plan(plan: Plan, allow_pickle: bool) -> None:
    """Before anything is written: the plan's α units fit the base model, and the models it names hold the
    weights it was made for (`diag plan` records their content hashes; a retrained fine-tune is refused)."""
    base_reader = open_checkpoint(plan.base_model, allow_pickle=allow_pickle, role="base model")
    plan.check_units(TensorTable.from_reader(base_reader))
    recorded = (plan.provenance or {}).get("models") or {}
    if not recorded.get("finetuned"):
        return
    current = {"base_model": base_reader.fingerprint(),
               "finetuned": model_fingerprints(plan.finetuned, base_reader, allow_pickle=allow_pickle)}
    changes = identity_changes(input_identity(recorded), input_identity(current))
    if changes:
        raise PlanError(f"the plan was made for other weights than its models hold now: {'; '.join(changes)}. "
                        "Measure α of these models again (diag alpha, then diag plan)")


def _plan_grams(plan: Plan, path, data: DataSettings | None, *, device: str, offload: bool, allow_pickle: bool,
                vocab: str) -> GramsByLayer | None:
    """The input Grams a plan's RegMean rules (`gram_ruled`: blocks the evidence merged by RegMean) need, on the
    records of `data` (`diag merge PLAN --data …`, as `--method regmean` takes them); None for a plan without."""
    ruled = gram_ruled(plan)
    if not ruled:
        if data is not None and data.data:
            _unused_data(f"{path}: the plan merges no matrix by a method that needs data")
        return None
    if data is None or not data.data:
        fit = (plan.decision or {}).get("fit_data")
        if fit:
            flags = " ".join(f"--data {t}={spec}" for t, spec in fit["data"].items())
            on = f"; diag compare fitted it with {flags} --samples {fit['samples']} --max-tokens {fit['max_tokens']}"
        else:
            fitted = (plan.decision or {}).get("fit_records")
            on = f" (it was fitted on {fitted} records per task)" if fitted else ""
        raise PlanError(f"{path}: the plan merges {len(ruled)} matrices by RegMean ({ruled[0]} …), which needs the "
                        f"Gram matrices of their inputs on task data: give --data TASK=FILE for "
                        f"{', '.join(plan.finetuned)}, with --samples and --max-tokens{on}")
    experiment = data.experiment(plan.base_model, plan.finetuned, device=device, offload=offload,
                                 allow_pickle=allow_pickle, vocab=vocab)
    return experiment.input_grams(plan.finetuned)


def _unused_data(why: str) -> None:
    readers = ", ".join(name for name, method in STRATEGIES.items() if method.needs_data)
    warnings.warn(f"--data is not used: {why} (task data is read by {readers} and by plans with RegMean blocks)",
                  UserWarning, stacklevel=3)


def recipe_setup(recipe: Recipe, *, allow_pickle: bool = False, path: str | Path | None = None) -> MergeSetup:
    """Rules of a mergekit recipe over its base model's tensor table (every tensor's rule is checked now)."""
    table = TensorTable.from_checkpoint(recipe.base, allow_pickle=allow_pickle)
    record = {"recipe": str(path) if path is not None else None, "mergekit": recipe.to_mergekit(),
              "notes": recipe.notes()}
    return MergeSetup(recipe.rules(table), record)


def method_setup(method: str, options: dict, base: str, finetuned: dict[str, str], data: DataSettings, *,
                 device: str = "cpu", offload: bool = False, allow_pickle: bool = False, vocab: str = "base",
                 progress: bool = True) -> MergeSetup:
    """Rules (and data inputs) of a registered method; a method with ``inputs`` gets them from `data` (the base
    loaded on `device`, or with `offload` streamed to it block by block)."""
    name, options = checked_method(method, options)
    record = {"method": method, "options": options}
    registered = STRATEGIES[name]
    if not registered.needs_data:
        if data.data:
            _unused_data(f"--method {method} needs no data")
        return MergeSetup(method_rule(name, options), record)

    experiment = data.experiment(base, finetuned, device=device, offload=offload, allow_pickle=allow_pickle,
                                 vocab=vocab)
    return data_step(name, experiment, base, finetuned, options, record=record, progress=progress)


def data_step(method: str, experiment, base: str, finetuned: dict[str, str], options: dict | None = None, *,
              record: dict | None = None, progress: bool = True) -> MergeSetup:
    """The rules and data inputs of the data method `method` (a registered name with ``inputs``), fitted on the
    records of `experiment` (`diag merge --method M --data …` and `diag compare` alike)."""
    name, options = checked_method(method, options)
    _, data_options = STRATEGIES[name].split_options(options)
    record = {"method": method, "options": options} if record is None else record
    return _DATA_STEPS[name](experiment, base, finetuned, record, options, data_options, progress)


def _closed_form(experiment, base, finetuned, record, options, data_options, progress) -> MergeSetup:
    solved = alpha(experiment, granularity=data_options["granularity"], balance=data_options["balance"],
                   progress=progress)
    the_plan = plan_from_alpha(solved, base, finetuned)
    record.update({"granularity": data_options["granularity"], "alpha": the_plan.alpha})
    return MergeSetup(the_plan.rule_for, record)


def _regmean(experiment, base, finetuned, record, options, data_options, progress) -> MergeSetup:
    grams = experiment.input_grams(finetuned)
    return MergeSetup(regmean_rule(options, grams.names), record, grams)


def _learned(name: str):
    """The data step of a method whose inputs `submerge.merge.learned.learn` fits (Fisher, AdaMerging, LoraHub)."""
    def step(experiment, base, finetuned, record, options, data_options, progress) -> MergeSetup:
        learned = learn(name, experiment, options, data_options, progress=progress)
        record[name] = learned.record
        return MergeSetup(learned.rule_for, record, learned.tensor_inputs)
    return step


#: The data step of each registered method that has ``inputs`` (tests check every such method has one).
_DATA_STEPS = {"closed-form": _closed_form, "regmean": _regmean, **{name: _learned(name) for name in LEARNED_METHODS}}

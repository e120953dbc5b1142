"""mergekit recipes in: a mergekit YAML config → the project's merge rules, one `ParameterRule` per tensor.

`Recipe.load` reads a mergekit config (the ``models:`` form) for the methods the two tools share —
``linear``, ``task_arithmetic``, ``ties``, ``dare_ties``, ``dare_linear``, ``breadcrumbs``, ``della`` —
with per-model ``weight`` / ``density`` (and ``gamma``, ``epsilon``), ``parameters`` at the top level
and per model, ``dtype``, ``out_dtype`` and ``tokenizer_source: base``. `Recipe.rules` maps it onto the
tensor table (`submerge.diagnostics.tensors.TensorTable`): each tensor gets the rule mergekit 0.1.5's
equations give it, so `submerge.merge.writer.write_merge` merges a recipe unchanged. What it does not
support is refused with a `RecipeError` naming the key: ``slices`` / ``modules``, gradient lists that
are not one value per layer, other tokenizer sources, ``tokenizer`` / ``chat_template``, other methods,
unknown or misplaced keys.

How mergekit resolves a parameter for one tensor (``mergekit/config.py``, ``parameter_resolver.py``):
the model's own ``parameters`` first, then the top-level ones; a setting is a number, a gradient (a list:
mergekit interpolates it over the layers at t = layer / (L − 1); only one value, or one value per layer,
is accepted here, so the interpolation lands on a value exactly), or a list of ``{filter, value}`` whose
first entry with no filter, ``*`` or a filter contained in the tensor's name decides (none: the next
scope). Tensors outside the blocks are at t = 0 (the first value of a gradient). Merge-wide parameters
(``normalize``, ``lambda``, ``rescale``, ``int8_mask``) are read from the top level only.

The equations, per tensor, with w_t the models' weights and τ_t = θ_t − θ0 (``base_model`` is θ0; a
model equal to it is the base, not a task):

- ``linear``: Σ_i w_i θ_i / Σ_i w_i over the models and the base (mergekit adds the base when it is
  named, with the top-level weight) = θ0 + Σ_t (w_t / Σ_i w_i) τ_t; without ``normalize`` the weights
  must sum to 1 (Σ w_i θ_i would scale θ0 itself);
- ``task_arithmetic``: θ0 + λ Σ_t w_t τ_t (divided by Σ_t w_t with ``normalize``): `weights_rule`;
- ``ties``: `submerge.merge.strategies.ties` with top_k = density per model, the weights, ``normalize``
  (default true: the disjoint mean) and scaling = λ;
- ``dare_ties`` / ``dare_linear``: `submerge.merge.strategies.dare` over TIES (no trim) or task arithmetic
  with drop_rate = 1 − density per model, the weights and ``normalize`` (default false: the sum);
- ``breadcrumbs``: `submerge.merge.strategies.breadcrumbs` with each model's mask set to mergekit's
  counts for the tensor (keep ⌊density·n⌋ entries after dropping the ⌊gamma·n⌋ largest);
- ``della``: `submerge.merge.strategies.della` with drop_rate = 1 − density and ε = 2·epsilon (mergekit's
  keep probabilities span density ± epsilon, ours p ± ε/2), the weights and ``normalize`` (default true).

Where the equations do not decide, the tools differ (see docs/ARCHITECTURE.md): which of equal magnitudes
a trim keeps, the sign of an entry whose weighted sum is exactly 0 (mergekit elects +), and every random
mask (DARE, DELLA: ours are seeded, mergekit's are not). DARE and DELLA rescale the kept entries by
1/(1 − p) as their papers do (mergekit's ``rescale`` matches each tensor's L1 norm instead); ``rescale:
false`` is refused. Merges are computed in float32 whatever ``dtype`` says (mergekit computes in it) and
written in ``out_dtype``, else ``dtype``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from submerge.diagnostics.errors import SubmergeError
from submerge.diagnostics.tensors import TensorInfo, TensorTable
from submerge.merge.rules import ParameterRule, weights_rule

REQUIRED = object()  # a parameter without a default


class RecipeError(SubmergeError):
    """A mergekit config that cannot be read or that asks for something submerge does not do."""


@dataclass(frozen=True)
class MethodSpec:
    """A mergekit method's parameters: per model (``weight``, ``density`` …) and merge-wide, with mergekit's
    defaults (REQUIRED: none)."""

    per_model: Mapping[str, object]
    shared: Mapping[str, object]


def _gta(normalize: bool, rescale: bool, **extra) -> MethodSpec:
    """mergekit's generalised task arithmetic methods: weight (required), density (1) and `extra` per model."""
    return MethodSpec({"weight": REQUIRED, "density": 1.0, **extra},
                      {"normalize": normalize, "rescale": rescale, "lambda": 1.0, "int8_mask": False})


#: The methods both tools have, with mergekit 0.1.5's parameters and defaults.
METHODS: dict[str, MethodSpec] = {
    "linear": MethodSpec({"weight": REQUIRED}, {"normalize": True}),
    "task_arithmetic": _gta(False, False),
    "ties": _gta(True, False),
    "dare_ties": _gta(False, True),
    "dare_linear": _gta(False, True),
    "breadcrumbs": _gta(False, False, gamma=0.01),
    "della": _gta(True, True, epsilon=0.15),
}
#: mergekit methods with no counterpart here (refused by name).
MERGEKIT_ONLY = ("slerp", "nuslerp", "multislerp", "karcher", "model_stock", "passthrough", "sce",
                 "breadcrumbs_ties", "della_linear", "nearswap", "arcee_fusion", "ram", "ramplus_tl")
_TOP_KEYS = ("merge_method", "base_model", "models", "parameters", "dtype", "out_dtype", "tokenizer_source")
_REFUSED_TOP_KEYS = {
    "slices": "slices (layer ranges stacked from several models) are not supported: merge whole models with "
              "'models:'",
    "modules": "modules are not supported: merge whole models with 'models:'",
    "tokenizer": "a tokenizer configuration (vocabulary union or added tokens) is not supported: submerge writes "
                 "the base model's tokenizer",
    "chat_template": "chat_template is not supported: submerge writes the base model's tokenizer files as they are",
}
_DTYPES = ("float32", "float16", "bfloat16", "float64")
_BOOLEAN = ("normalize", "rescale", "int8_mask")


# ---------------------------------------------------------------------------------------------- reading


def is_recipe_file(path: str | Path) -> bool:
    """Whether `path` is a YAML mapping with a ``merge_method`` (a mergekit config), not a submerge plan."""
    try:
        content = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(content, dict) and "merge_method" in content and "submerge_plan" not in content


@dataclass
class RecipeModel:
    """One entry of ``models:``: the model as written (``PATH`` or ``BASE+LORA``) and its own parameters."""

    model: str
    parameters: dict = field(default_factory=dict)


@dataclass
class Recipe:
    """A mergekit config submerge can merge (see the module docstring)."""

    merge_method: str
    models: list[RecipeModel]
    base_model: str | None = None
    parameters: dict = field(default_factory=dict)
    dtype: str | None = None
    out_dtype: str | None = None
    tokenizer_source: str | None = None
    directory: Path | None = None  # the file's folder: relative model paths that exist there resolve against it

    @classmethod
    def load(cls, path: str | Path) -> Recipe:
        path = Path(path)
        if not path.exists():
            raise RecipeError(f"mergekit config {path} not found")
        try:
            content = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise RecipeError(f"{path} is not valid YAML: {exc}") from None
        return cls.from_config(content, where=str(path), directory=path.parent)

    @classmethod
    def from_config(cls, config: dict, *, where: str = "mergekit config", directory: Path | None = None) -> Recipe:
        """The recipe of a mergekit config (a dict as read from its YAML); anything unsupported is a RecipeError."""
        if not isinstance(config, dict):
            raise RecipeError(f"{where}: a mergekit config is a mapping with merge_method and models")
        for key in config:
            if key in _REFUSED_TOP_KEYS:
                raise RecipeError(f"{where}: '{key}': {_REFUSED_TOP_KEYS[key]}")
            if key not in _TOP_KEYS:
                raise RecipeError(f"{where}: unknown key '{key}' (submerge reads: {', '.join(_TOP_KEYS)})")
        method = config.get("merge_method")
        spec = _method_spec(method, where)
        models = config.get("models")
        if not isinstance(models, list) or not models:
            raise RecipeError(f"{where}: 'models' must list the models to merge (each with 'model:')")
        recipe = cls(method, [_read_model(entry, i, spec, where) for i, entry in enumerate(models)],
                     base_model=_model_text(config.get("base_model"), "base_model", where, lora=False),
                     parameters=_read_parameters(config.get("parameters"), "parameters", spec, where, shared=True),
                     dtype=_dtype(config.get("dtype"), "dtype", where),
                     out_dtype=_dtype(config.get("out_dtype"), "out_dtype", where),
                     tokenizer_source=config.get("tokenizer_source"), directory=directory)
        if recipe.tokenizer_source not in (None, "base"):
            raise RecipeError(f"{where}: 'tokenizer_source: {recipe.tokenizer_source}' is not supported: submerge "
                              "writes the base model's tokenizer ('tokenizer_source: base', or leave it out)")
        recipe._check(spec, where)
        return recipe

    def _check(self, spec: MethodSpec, where: str) -> None:
        if self.base_model is None and self.merge_method != "linear":
            raise RecipeError(f"{where}: '{self.merge_method}' needs 'base_model' (its task vectors are θ_t − θ0)")
        if self.base_model is None and "+" in self.models[0].model:
            raise RecipeError(f"{where}: models[0].model: a linear merge without base_model uses the first model as "
                              "the reference, which cannot be a LoRA adapter: name base_model")
        for i, model in enumerate(self.models):
            if "+" in model.model and model.model.split("+", 1)[0] != self.base_model:
                raise RecipeError(f"{where}: models[{i}].model '{model.model}': a LoRA adapter is read on the "
                                  f"recipe's base_model; this one names another base")
        for key, value in self.parameters.items():
            if key == "rescale" and value != spec.shared["rescale"]:
                raise RecipeError(f"{where}: parameters.rescale: {value} is not supported for {self.merge_method} "
                                  f"({_RESCALE_REASON[self.merge_method]})")

    # ------------------------------------------------------------------ what it merges

    def to_mergekit(self) -> dict:
        """The mergekit config again (export → import → export is the identity)."""
        config: dict = {"merge_method": self.merge_method}
        if self.base_model is not None:
            config["base_model"] = self.base_model
        config["models"] = [{"model": m.model, **({"parameters": m.parameters} if m.parameters else {})}
                            for m in self.models]
        for key in ("parameters", "dtype", "out_dtype", "tokenizer_source"):
            value = getattr(self, key)
            if value:
                config[key] = value
        return config

    def resolve(self, spec: str) -> str:
        """A model path as written, resolved next to the recipe file when it exists there (else unchanged)."""
        path = Path(spec).expanduser()
        if self.directory is not None and not path.is_absolute() and (self.directory / path).exists():
            return str((self.directory / path).resolve())
        return spec

    @property
    def base(self) -> str:
        """The base model θ0 (a linear merge without base_model: its first model)."""
        return self.resolve(self.base_model if self.base_model is not None else self.models[0].model)

    def entries(self) -> list[tuple[str | None, RecipeModel]]:
        """(task name, entry) of every model; the task is None for an entry that is the base itself."""
        named, seen = [], set()
        for index, model in enumerate(self.models):
            if self._is_base(model, index):
                named.append((None, model))
                continue
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(self._task_spec(model).rstrip("/")).name) or f"model{index}"
            name, suffix = stem, 2
            while name in seen:
                name, suffix = f"{stem}-{suffix}", suffix + 1
            seen.add(name)
            named.append((name, model))
        return named

    def finetuned(self) -> dict[str, str]:
        """Task name → fine-tune spec (a LoRA adapter's folder for ``BASE+LORA``), in the recipe's order."""
        return {task: self.resolve(self._task_spec(model)) for task, model in self.entries() if task is not None}

    def _task_spec(self, model: RecipeModel) -> str:
        return model.model.split("+", 1)[1] if "+" in model.model else model.model

    def _is_base(self, model: RecipeModel, index: int) -> bool:
        if self.base_model is None:
            return index == 0
        return model.model == self.base_model or same_model(self.resolve(model.model), self.base)

    def bind(self, finetuned: Mapping[str, str]) -> dict[str, str | None]:
        """The recipe's task for each of `finetuned` (task → spec, e.g. `diag compare`'s), matched by path; None for
        a fine-tune the recipe does not merge (it gets weight 0). A recipe model that is not among them is an error."""
        own = self.finetuned()
        bound = {task: next((name for name, mine in own.items() if same_model(mine, spec)), None)
                 for task, spec in finetuned.items()}
        missing = [f"{name} ({spec})" for name, spec in own.items() if name not in bound.values()]
        if missing:
            raise RecipeError(f"the recipe merges {', '.join(missing)}, which is not among the given fine-tunes "
                              f"({', '.join(f'{t}={s}' for t, s in finetuned.items())})")
        return bound

    def output_dtype(self) -> str | None:
        """The dtype mergekit writes: ``out_dtype``, else ``dtype`` (None: each base tensor's)."""
        return self.out_dtype or self.dtype

    def notes(self) -> list[str]:
        """Where this merge differs from mergekit's on purpose (recorded with the merge)."""
        notes = []
        if self.merge_method in ("dare_ties", "dare_linear", "della"):
            notes.append("random masks are drawn from a seeded generator (seed 0), mergekit's are not; kept entries "
                         "are rescaled by 1/(1 - p) as the paper says (mergekit matches each tensor's L1 norm)")
        if self.dtype in ("float16", "bfloat16"):
            notes.append(f"computed in float32 (mergekit computes in {self.dtype}), written in {self.output_dtype()}")
        if self.parameters.get("int8_mask"):
            notes.append("int8_mask only changes mergekit's mask dtype: no effect on the merge")
        return notes

    def rules(self, table: TensorTable, tasks: Mapping[str, str | None] | None = None) -> RecipeRules:
        """The rule of every tensor of `table` (computed now: a recipe that fails for some tensor fails here).

        `tasks` maps the writer's task names (its fine-tunes, in order) to the recipe's (`bind`; default: the
        recipe's own fine-tunes); a writer task mapped to None gets weight 0.
        """
        order = dict(tasks) if tasks is not None else {t: t for t in self.finetuned()}
        return RecipeRules(self, table, order)


_RESCALE_REASON = {
    "linear": "linear has no rescale",
    "task_arithmetic": "task arithmetic drops nothing, so there is nothing to rescale",
    "ties": "TIES' trimmed entries are not rescaled",
    "breadcrumbs": "Breadcrumbs' masked entries are not rescaled",
    "dare_ties": "DARE rescales what it keeps by 1/(1 - p); rescale: false is not DARE",
    "dare_linear": "DARE rescales what it keeps by 1/(1 - p); rescale: false is not DARE",
    "della": "DELLA rescales what it keeps by 1/(1 - p_i); rescale: false is not DELLA",
}


def same_model(first: str, second: str) -> bool:
    """Whether two model specs name the same model (equal, or existing paths that resolve to one folder)."""
    if first == second:
        return True
    a, b = Path(first).expanduser(), Path(second).expanduser()
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def _method_spec(method, where: str) -> MethodSpec:
    if method in METHODS:
        return METHODS[method]
    if method in MERGEKIT_ONLY:
        raise RecipeError(f"{where}: merge_method '{method}' has no counterpart in submerge (supported: "
                          f"{', '.join(METHODS)})")
    raise RecipeError(f"{where}: unknown merge_method {method!r} (supported: {', '.join(METHODS)})")


def _model_text(value, key: str, where: str, *, lora: bool = True) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RecipeError(f"{where}: {key} must be a model path or hub id, got {value!r}")
    if "@" in value:
        raise RecipeError(f"{where}: {key} '{value}': revisions (@REV) are not supported; download that revision "
                          "and give its folder")
    if value.count("+") > (1 if lora else 0):
        raise RecipeError(f"{where}: {key} '{value}' cannot be read (one MODEL or MODEL+LORA)")
    return value


def _read_model(entry, index: int, spec: MethodSpec, where: str) -> RecipeModel:
    key = f"models[{index}]"
    if not isinstance(entry, dict) or "model" not in entry:
        raise RecipeError(f"{where}: {key} must be a mapping with 'model:' (and 'parameters:')")
    unknown = [k for k in entry if k not in ("model", "parameters")]
    if unknown:
        raise RecipeError(f"{where}: {key}: unknown key '{unknown[0]}' (a model has 'model' and 'parameters')")
    parameters = _read_parameters(entry.get("parameters"), f"{key}.parameters", spec, where, shared=False)
    return RecipeModel(_model_text(entry["model"], f"{key}.model", where), parameters)


def _read_parameters(parameters, key: str, spec: MethodSpec, where: str, *, shared: bool) -> dict:
    """A ``parameters`` mapping, each setting checked for shape and type (gradient lengths are checked per model
    depth in `RecipeRules`)."""
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise RecipeError(f"{where}: {key} must be a mapping of parameter names to values")
    for name, setting in parameters.items():
        if name not in spec.per_model and name not in spec.shared:
            known = ", ".join([*spec.per_model, *spec.shared])
            raise RecipeError(f"{where}: {key}.{name}: unknown parameter for {_method_name(spec)} (it takes {known})")
        if name in spec.shared and not shared:
            raise RecipeError(f"{where}: {key}.{name}: '{name}' applies to the whole merge; mergekit reads it only "
                              "from the top-level parameters (it would ignore it here)")
        _check_setting(setting, f"{key}.{name}", where, boolean=name in _BOOLEAN)
    return dict(parameters)


def _method_name(spec: MethodSpec) -> str:
    return next(name for name, known in METHODS.items() if known is spec)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_setting(setting, key: str, where: str, *, boolean: bool) -> None:
    """A scalar, a gradient (list of scalars) or conditionals ({filter, value} or a list of them)."""
    if boolean and not isinstance(setting, bool):
        raise RecipeError(f"{where}: {key} must be true or false, got {setting!r}")

    def scalar(value, at: str) -> None:
        if boolean and not isinstance(value, bool):
            raise RecipeError(f"{where}: {at} must be true or false, got {value!r}")
        if not boolean and not _is_number(value):
            raise RecipeError(f"{where}: {at} must be a number, got {value!r}")

    def plain(value, at: str) -> None:
        if isinstance(value, list):
            if boolean or not value:
                raise RecipeError(f"{where}: {at}: {'a flag takes one value' if boolean else 'an empty gradient'}")
            for i, item in enumerate(value):
                scalar(item, f"{at}[{i}]")
        else:
            scalar(value, at)

    conditions = [setting] if isinstance(setting, dict) else setting
    if isinstance(conditions, list) and conditions and all(isinstance(c, dict) for c in conditions):
        for i, condition in enumerate(conditions):
            at = key if isinstance(setting, dict) else f"{key}[{i}]"
            if "value" not in condition or any(k not in ("filter", "value") for k in condition):
                raise RecipeError(f"{where}: {at}: a conditional setting has 'value' and optionally 'filter'")
            if not isinstance(condition.get("filter"), (str, type(None))):
                raise RecipeError(f"{where}: {at}.filter must be a string (part of a tensor name)")
            plain(condition["value"], f"{at}.value")
    elif isinstance(setting, list) and any(isinstance(c, dict) for c in setting):
        raise RecipeError(f"{where}: {key}: a list mixes conditional settings and values")
    else:
        plain(setting, key)


def _dtype(value, key: str, where: str) -> str | None:
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise RecipeError(f"{where}: {key} '{value}' is not supported (one of {', '.join(_DTYPES)})")
    return name


# ---------------------------------------------------------------------------------------------- rules


def evaluate(setting, tensor: str, layer: int, layers: int, key: str):
    """mergekit's value of `setting` for the tensor `tensor` in block `layer` (−1: outside the blocks) of a model
    with `layers` blocks; None when no conditional matches. A gradient must have one value or one per layer."""
    if isinstance(setting, (bool, int, float)):
        return setting
    conditions = [setting] if isinstance(setting, dict) else setting
    if conditions and all(isinstance(c, dict) for c in conditions):
        for i, condition in enumerate(conditions):
            wanted = condition.get("filter")
            if wanted in (None, "*") or wanted in tensor:
                at = f"{key}.value" if isinstance(setting, dict) else f"{key}[{i}].value"
                return evaluate(condition["value"], tensor, layer, layers, at)
        return None
    if len(setting) not in (1, layers):
        raise RecipeError(f"{key}: a gradient of {len(setting)} values over {layers} layers; submerge takes one value "
                          f"or one value per layer ({layers})")
    return setting[layer] if (len(setting) == layers and layer >= 0) else setting[0]


class RecipeRules:
    """The rule function of a recipe over a tensor table: ``rules(info)`` → `ParameterRule`."""

    def __init__(self, recipe: Recipe, table: TensorTable, tasks: Mapping[str, str]):
        self.recipe, self.spec = recipe, METHODS[recipe.merge_method]
        self.layers = 1 + max((info.layer for info in table), default=-1)
        entries = recipe.entries()
        by_name = {name: (index, model) for index, (name, model) in enumerate(entries) if name is not None}
        unknown = [name for name in tasks.values() if name is not None and name not in by_name]
        if unknown:
            raise RecipeError(f"the recipe has no model '{unknown[0]}' (its models: {', '.join(by_name)})")
        # writer task → (index, entry) of its recipe model, None for a task the recipe does not merge
        self.tasks = {task: None if name is None else by_name[name] for task, name in tasks.items()}
        self.base_entries = [(index, model) for index, (name, model) in enumerate(entries) if name is None]
        self._rules = {info.name: self._rule(info) for info in table}

    def __call__(self, info: TensorInfo) -> ParameterRule:
        rule = self._rules.get(info.name)
        return rule if rule is not None else self._rule(info)

    def _value(self, name: str, info: TensorInfo, index: int | None, model: RecipeModel | None):
        scopes = [] if model is None else [(model.parameters, f"models[{index}].parameters")]
        scopes.append((self.recipe.parameters, "parameters"))
        for parameters, key in scopes:
            if name in parameters:
                value = evaluate(parameters[name], info.name, info.layer, self.layers, f"{key}.{name}")
                if value is not None:
                    return value
        default = self.spec.per_model.get(name, self.spec.shared.get(name, REQUIRED))
        if default is REQUIRED:
            where = f"models[{index}] ({model.model})" if model is not None else "the base model"
            raise RecipeError(f"{where}: no '{name}' for tensor {info.name} ({self.recipe.merge_method} needs one "
                              "for every model: give it in the model's parameters or the top-level ones)")
        return default

    def _per_task(self, name: str, info: TensorInfo, absent) -> list:
        return [absent if entry is None else self._value(name, info, *entry) for entry in self.tasks.values()]

    def _rule(self, info: TensorInfo) -> ParameterRule:
        method = self.recipe.merge_method
        weights = self._per_task("weight", info, 0.0)
        shared = {name: self._value(name, info, None, None) for name in self.spec.shared}
        if method == "linear":
            return self._linear(info, weights, shared["normalize"])
        scale = float(shared["lambda"])
        if method == "task_arithmetic":
            if any(d != 1 for d in self._per_task("density", info, 1.0)):
                raise RecipeError("task_arithmetic: 'density' has no effect in mergekit's task_arithmetic (it "
                                  "sparsifies nothing): use ties or dare_linear to drop entries")
            total = math.fsum(weights) if shared["normalize"] else 1.0
            divisor = total if abs(total) >= 1e-8 else 1.0
            return weights_rule({task: scale * w / divisor for task, w in zip(self.tasks, weights)})
        options = {"scaling": scale, "weights": None if all(w == 1 for w in weights) else weights,
                   "normalize": bool(shared["normalize"])}
        densities = self._per_task("density", info, 1.0)
        return _METHOD_RULES[method](self, info, densities, options)

    def _linear(self, info: TensorInfo, weights: list[float], normalize: bool) -> ParameterRule:
        base_weights = [self._value("weight", info, index, model) for index, model in self.base_entries]
        if self.recipe.base_model is not None and not self.base_entries:
            base_weights.append(self._value("weight", info, None, None))  # mergekit adds the named base
        total = math.fsum([*weights, *base_weights])
        if normalize:
            if total == 0:
                raise RecipeError(f"linear: the weights of tensor {info.name} sum to 0 (normalize divides by them)")
            return weights_rule({task: w / total for task, w in zip(self.tasks, weights)})
        if abs(total - 1) > 1e-9:
            raise RecipeError(f"linear with normalize: false: the weights of tensor {info.name} sum to {total:g}, not "
                              "1, so the merge would scale the base itself (Σ w_i θ_i); use normalize: true")
        return weights_rule(dict(zip(self.tasks, weights)))


def _scalar_or_list(values: list[float]) -> float | list[float]:
    return values[0] if len(set(values)) == 1 else values


def _ties_rule(rules: RecipeRules, info, densities, options) -> ParameterRule:
    top_k = [min(1.0, max(0.0, d)) for d in densities]
    return ParameterRule(method="ties", options={"top_k": _scalar_or_list(top_k), **options})


def _dare_rule(rules: RecipeRules, info, densities, options) -> ParameterRule:
    if any(d <= 0 for d in densities):
        raise RecipeError(f"{rules.recipe.merge_method}: density must be > 0 (tensor {info.name}: {densities})")
    base = "ties" if rules.recipe.merge_method == "dare_ties" else "task-arithmetic"
    drop = [max(0.0, 1.0 - d) for d in densities]
    return ParameterRule(method="dare", options={"base": base, "drop_rate": _scalar_or_list(drop), "top_k": 1.0,
                                                 **options})


def _per_model_pair(densities: list[float], extras: list[float], whole: tuple[float, float],
                    pair) -> tuple[list[float], list[float]]:
    """Per model, two option values: `whole` where its density is ≥ 1 (the model is kept whole), else
    ``pair(density, extra)``."""
    values = [whole if density >= 1 else pair(density, extra) for density, extra in zip(densities, extras)]
    return [first for first, _ in values], [second for _, second in values]


def _breadcrumbs_rule(rules: RecipeRules, info, densities, options) -> ParameterRule:
    """mergekit's magnitude_outliers counts as Breadcrumbs' β, γ for this tensor's n entries: keep the ascending
    ranks [n_bot, n_bot + ⌊density·n⌋) with n_bot = max(0, n − ⌊density·n⌋ − ⌊gamma·n⌋)."""
    n = math.prod(info.shape) or 1

    def kept_ranks(density: float, gamma: float) -> tuple[float, float]:
        target, top = int(density * n), int(gamma * n)
        bottom = max(0, n - target - top)
        return bottom / n, (bottom + target) / n

    betas, uppers = _per_model_pair(densities, rules._per_task("gamma", info, 0.0), (0.0, 1.0), kept_ranks)
    return ParameterRule(method="breadcrumbs", options={"beta": _scalar_or_list(betas),
                                                        "gamma": _scalar_or_list(uppers), **options})


def _della_rule(rules: RecipeRules, info, densities, options) -> ParameterRule:
    def drop_and_spread(density: float, epsilon: float) -> tuple[float, float]:
        if not (0 < density - epsilon and density + epsilon < 1):
            raise RecipeError(f"della: density ± epsilon must lie in (0, 1), got {density} ± {epsilon} "
                              f"(tensor {info.name})")
        return 1.0 - density, 2.0 * epsilon

    drop, spread = _per_model_pair(densities, rules._per_task("epsilon", info, 0.0), (0.0, 0.0), drop_and_spread)
    return ParameterRule(method="della", options={"drop_rate": _scalar_or_list(drop),
                                                  "epsilon": _scalar_or_list(spread), **options})


_METHOD_RULES = {"ties": _ties_rule, "dare_ties": _dare_rule, "dare_linear": _dare_rule,
                 "breadcrumbs": _breadcrumbs_rule, "della": _della_rule}

"""The schema of a plan file, checked before anything runs (issue 26): a hand-edited plan is refused with every
problem named by its key path and line, instead of merging a typo with weight 0 or failing at merge time.

`validate_plan` checks what a plan file can say without the model: known keys, types, finite numbers, methods and
their options that exist, α keys ⊆ the plan's fine-tunes with a weight for each, unit names of the granularity.
`missing_units` checks the units against the model's tensor table (at merge time, before any tensor is written):
every unit of the granularity has α, or the plan says ``fallback: mean``.
"""

from __future__ import annotations

import math
import re

from submerge.diagnostics.errors import SubmergeError
from submerge.diagnostics.modules import GRANULARITIES
from submerge.diagnostics.safe_yaml import YamlDocument
from submerge.merge.strategies import resolve_method

PER_LAYER = "per-layer"
REST_WEIGHTS = ("mean-task-vector", "weights")  # the rest rules that are not a registered method
FIELDS = ("base_model", "finetuned", "granularity", "alpha", "rest", "attention", "decision", "provenance",
          "layer_granularity", "matrix_rules", "fallback")
UNIT_PATTERNS = {
    "model": r"model",
    "layer": r"layers\.\d+",
    "attn-mlp": r"layers\.\d+\.(attn|mlp)",
    "head-mlp": r"layers\.\d+\.(attn\.head\.\d+|mlp)",
    PER_LAYER: r"layers\.\d+(\.(attn|mlp|attn\.head\.\d+))?",
}


class PlanSchemaError(SubmergeError):
    """A plan file that does not follow the schema (every problem, with its line)."""


class _Problems:
    def __init__(self, document: YamlDocument):
        self.document, self.found = document, []

    def add(self, keys: tuple, message: str) -> None:
        line = self.document.line(*keys)
        where = ".".join(str(key) for key in keys)
        self.found.append(f"line {line}: {where}: {message}" if line is not None else f"{where}: {message}")

    def number(self, keys: tuple, value) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.add(keys, f"expected a finite number, got {value!r}")

    def mapping(self, keys: tuple, value, what: str) -> bool:
        if not isinstance(value, dict):
            self.add(keys, f"expected a mapping of {what}, got {type(value).__name__}")
            return False
        return True


def _check_method(problems: _Problems, keys: tuple, rule) -> None:
    """A rule ``{method, options}``: the method exists and takes those options."""
    if not problems.mapping(keys, rule, "method and options"):
        return
    try:
        method, options = resolve_method(str(rule.get("method")), rule.get("options") or {})
        method.resolve_options(options)
    except (ValueError, TypeError) as exc:
        problems.add((*keys, "method"), str(exc))


def _check_alpha(problems: _Problems, alpha, tasks: set[str], granularity) -> None:
    if not problems.mapping(("alpha",), alpha, "unit → {fine-tune: α}"):
        return
    pattern = UNIT_PATTERNS.get(granularity)
    for unit, weights in alpha.items():
        if pattern is not None and not re.fullmatch(pattern, str(unit)):
            problems.add(("alpha", unit), f"{unit!r} is no unit of granularity {granularity}")
        if not problems.mapping(("alpha", unit), weights, "fine-tune → α"):
            continue
        for task, value in weights.items():
            if task not in tasks:
                problems.add(("alpha", unit, task), f"{task!r} is no fine-tune of this plan ({sorted(tasks)})")
            else:
                problems.number(("alpha", unit, task), value)
        missing = sorted(tasks - set(weights))
        if missing:
            problems.add(("alpha", unit), f"no weight for fine-tune(s) {missing}")


def validate_plan(document: YamlDocument) -> dict:
    """The fields of the plan in `document` (``submerge_plan`` removed), or a `PlanSchemaError` listing every
    problem with its key path and line."""
    content = dict(document.data)
    content.pop("submerge_plan", None)
    problems = _Problems(document)
    unknown = sorted(str(key) for key in content if key not in FIELDS)
    if unknown:
        problems.found.append(f"unknown key(s) {unknown} (a plan has {', '.join(FIELDS)})")
    for key in ("base_model", "finetuned", "granularity", "alpha"):
        if key not in content:
            problems.found.append(f"{key}: missing")
    if "base_model" in content and not isinstance(content["base_model"], str):
        problems.add(("base_model",), f"expected a model path or hub id, got {content['base_model']!r}")
    finetuned = content.get("finetuned", {})
    tasks: set[str] = set()
    if not isinstance(finetuned, dict) or not all(isinstance(v, str) for v in finetuned.values()):
        problems.add(("finetuned",), f"expected a mapping of fine-tune name → model, got {finetuned!r}")
    else:
        tasks = {str(task) for task in finetuned}
    granularity = content.get("granularity")
    if "granularity" in content and granularity not in (*GRANULARITIES, PER_LAYER):
        problems.add(("granularity",), f"unknown granularity {granularity!r} ({', '.join(GRANULARITIES)}, "
                                       f"{PER_LAYER})")
    if tasks:
        _check_alpha(problems, content.get("alpha", {}), tasks, granularity)
    for layer, chosen in (content.get("layer_granularity") or {}).items():
        if chosen not in GRANULARITIES:
            problems.add(("layer_granularity", layer), f"unknown granularity {chosen!r}")
    rest = content.get("rest") or {"method": "mean-task-vector"}
    if problems.mapping(("rest",), rest, "method and options") and rest.get("method") not in REST_WEIGHTS:
        _check_method(problems, ("rest",), rest)
    elif isinstance(rest, dict) and rest.get("method") == "weights" and tasks:
        weights = rest.get("weights")
        if problems.mapping(("rest", "weights"), weights, "fine-tune → weight"):
            for task in sorted(tasks):
                problems.number(("rest", "weights", task), weights.get(task))
    if problems.mapping(("matrix_rules",), content.get("matrix_rules") or {}, "tensor name → rule"):
        for name, rule in (content.get("matrix_rules") or {}).items():
            _check_method(problems, ("matrix_rules", name), rule)
    if content.get("fallback") not in (None, "mean"):
        problems.add(("fallback",), f"expected mean (the mean task vector for units without α), got "
                                    f"{content['fallback']!r}")
    if problems.found:
        raise PlanSchemaError(f"plan {document.path} does not follow the plan schema: " + "; ".join(problems.found))
    return content


def unit_problems(alpha: dict, expected: set[str], granularity: str, blocks: int, fallback: str | None) -> list[str]:
    """What is wrong with the units of `alpha` against the `expected` units of the model (`blocks` blocks)."""
    problems = []
    extra = sorted(set(alpha) - expected)
    if extra:
        problems.append(f"α for unit(s) the model does not have at this granularity: {extra} ({blocks} blocks)")
    missing = sorted(expected - set(alpha), key=lambda unit: [int(p) if p.isdigit() else p for p in unit.split(".")])
    if missing and fallback != "mean":
        problems.append(f"no α for {len(missing)} unit(s) of the granularity: {missing[:8]}"
                        f"{' …' if len(missing) > 8 else ''}; add them, or write `fallback: mean` in the plan to "
                        "merge them with the mean task vector")
    return problems

"""Merge rules: how each checkpoint tensor is merged, and every way a rule is made.

A rule is a `ParameterRule`: a registered method with options (``submerge.merge.strategies.STRATEGIES``),
or fixed per-task weights θ0 + Σ_t w_t τ_t (the closed-form merge, seed 002). A *rule function*
maps a tensor's `submerge.diagnostics.tensors.TensorInfo` (the tensor table's entry) to its rule; the
writer calls it once per tensor. Rule functions come from

- `method_rule`: one registered method (or a mergekit alias) for every tensor;
- `regmean_rule`: RegMean on the linear maps whose input Grams were recorded, task arithmetic elsewhere;
- `fisher_rule`: Fisher merging on the tensors with diagonal Fishers, the mean elsewhere;
- `submerge.merge.plan.Plan.rule_for`: α per unit of a plan, built with `weights_rule` / `mean_rule` /
  `head_rule` below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from submerge.diagnostics.errors import SubmergeError
from submerge.diagnostics.tensors import TensorInfo
from submerge.merge.strategies import resolve_method

RuleFunction = Callable[[TensorInfo], "ParameterRule"]


class MergeError(SubmergeError):
    """The merge cannot be written (output exists, bad method options ...)."""


@dataclass
class ParameterRule:
    """How one tensor is merged: a registered method with options, or fixed per-task weights."""

    method: str = "task-arithmetic"
    options: dict | None = None
    weights: dict[str, float | torch.Tensor] | None = None  # θ0 + Σ_t w_t τ_t (closed-form α)

    def describe(self) -> str:
        if self.weights is not None:
            return "weights " + ", ".join(
                f"{t}={w:.4g}" if isinstance(w, (int, float)) else f"{t}=per-head" for t, w in self.weights.items()
            )
        return self.method + (f" {self.options}" if self.options else "")


def checked_method(method: str, options: Mapping[str, object] | None = None) -> tuple[str, dict]:
    """(registered name, options) of a method name or mergekit alias; unknown names or options are a MergeError."""
    try:
        registered, options = resolve_method(method, options)
        registered.resolve_options(options)
    except ValueError as exc:
        raise MergeError(str(exc)) from exc
    return registered.name, options


def method_rule(method: str, options: dict | None = None) -> RuleFunction:
    """The same registered method (or mergekit alias, e.g. ``dare_ties``) for every tensor."""
    name, options = checked_method(method, options)
    rule = ParameterRule(method=name, options=options or {})
    return lambda info: rule


def regmean_rule(options: dict | None, linear_names: set[str]) -> RuleFunction:
    """RegMean for the linear maps with recorded input Grams (`linear_names`), task arithmetic elsewhere (at RegMean's
    ``scaling``, when given: λ scales the whole update)."""
    regmean = ParameterRule(method="regmean", options=options)
    scaling = (options or {}).get("scaling")
    elsewhere = ParameterRule(method="task-arithmetic", options={} if scaling is None else {"scaling": scaling})
    return lambda info: regmean if info.name in linear_names else elsewhere


def fisher_rule(options: dict | None, names: set[str]) -> RuleFunction:
    """Fisher merging for the tensors with diagonal Fishers (`names`), the plain mean elsewhere (the Fisher
    average with no information: equal Fishers)."""
    fisher = ParameterRule(method="fisher", options=options)
    elsewhere = ParameterRule(method="weight-average", options={})
    return lambda info: fisher if info.name in names else elsewhere


def weights_rule(weights: Mapping[str, float | torch.Tensor]) -> ParameterRule:
    """θ0 + Σ_t w_t τ_t with the given weight per task (a number, or a tensor broadcasting to the tensor)."""
    return ParameterRule(weights=dict(weights))


def mean_rule(tasks: Sequence[str]) -> ParameterRule:
    """θ0 + (1/T) Σ_t τ_t: the plan's default for tensors outside every unit."""
    return weights_rule({t: 1.0 / len(tasks) for t in tasks})


def head_rule(info: TensorInfo, tasks: Sequence[str], head_alphas: np.ndarray, kv_heads: int,
              head_dim: int) -> ParameterRule:
    """Per-head weights for one attention tensor from α per head (`head_alphas`: heads × tasks).

    q rows and o columns take their head's α, k/v rows the mean α of their GQA group (exact for
    plain multi-head attention), o's bias and any other attention tensor (q/k norms) the mean α of
    the layer's heads. A fused q/k/v projection cannot be split and is refused.
    """
    heads = head_alphas.shape[0]
    is_bias = len(info.shape) == 1
    if info.head_split == "fused":
        raise ValueError(f"head-mlp plan: '{info.name}' is a fused q/k/v projection; heads cannot be merged apart")
    if info.head_split not in ("q", "kv", "o") or (info.head_split == "o" and is_bias):
        return weights_rule({t: float(head_alphas[:, i].mean()) for i, t in enumerate(tasks)})
    if info.head_split == "o":
        per_column = np.repeat(head_alphas, head_dim, axis=0)  # (in,) along columns
        return weights_rule({t: torch.tensor(per_column[:, i], dtype=torch.float32)[None, :]
                             for i, t in enumerate(tasks)})
    if info.head_split == "q":
        per_row = np.repeat(head_alphas, head_dim, axis=0)
    else:
        kv_alphas = head_alphas.reshape(kv_heads, heads // kv_heads, len(tasks)).mean(axis=1)
        per_row = np.repeat(kv_alphas, head_dim, axis=0)
    if per_row.shape[0] != info.shape[0]:
        raise ValueError(
            f"head-mlp plan: '{info.name}' has {info.shape[0]} rows, heads give {per_row.shape[0]} "
            "(fused q/k/v projections are not supported at head level)"
        )
    column = (lambda v: v) if is_bias else (lambda v: v[:, None])
    return weights_rule({t: column(torch.tensor(per_row[:, i], dtype=torch.float32)) for i, t in enumerate(tasks)})

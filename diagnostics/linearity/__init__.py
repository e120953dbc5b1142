"""Linearity diagnostics of fine-tuning updates, submodule by submodule (seed 002).

- `equations`: the pure equations (Non-linearity Score, Projection Distance and cosines, closed-form α,
  objectives), each citing its seed 002 equation;
- `sweep`: the capture → replay → per-sample features → store loop every driver runs on;
- `nonlinearity`, `projection`, `alpha`: one driver per diagnostic, each the owner of its store group
  (`LINEARITY`, `PROJECTION`, `ALPHA`: layout, summary table, figures; `submerge.diagnostics.groups`);
  `evidence`: the evidence plan's cross-validated block objectives (group `EVIDENCE`, read by
  `submerge.merge.plan.choose_by_evidence`).
"""

from submerge.diagnostics.capture import DEFAULT_CAPTURE_BUDGET
from submerge.diagnostics.linearity.alpha import ALPHA, alpha
from submerge.diagnostics.linearity.equations import (
    AlphaSolution,
    alpha_system,
    balance_denominator,
    cosine_base,
    cosine_merge,
    linearized_objective,
    mean_std,
    merge_objective,
    nonlinearity_score,
    nonlinearity_scores,
    nonlinearity_scores_of_points,
    pairwise_task_cosine,
    projection_distance,
    projection_terms,
    projection_terms_of_batch,
    solve_alpha,
    task_gram,
)
from submerge.diagnostics.linearity.evidence import EVIDENCE, evidence
from submerge.diagnostics.linearity.nonlinearity import LINEARITY, nonlinearity
from submerge.diagnostics.linearity.projection import PROJECTION, projection
from submerge.diagnostics.modules import GRANULARITIES

__all__ = [
    "ALPHA", "DEFAULT_CAPTURE_BUDGET", "EVIDENCE", "GRANULARITIES", "LINEARITY", "PROJECTION", "AlphaSolution", "alpha",
    "alpha_system", "balance_denominator", "cosine_base", "cosine_merge", "evidence", "linearized_objective",
    "mean_std", "merge_objective", "nonlinearity", "nonlinearity_score", "nonlinearity_scores",
    "nonlinearity_scores_of_points", "pairwise_task_cosine", "projection", "projection_distance", "projection_terms",
    "projection_terms_of_batch", "solve_alpha", "task_gram",
]

"""`diag alpha`: closed-form merge coefficients α per submodule (seed 002 Eq. 12–14; balanced Eq. 33–34)."""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from submerge.diagnostics.execution import RunSettings
from submerge.diagnostics.linearity.equations import (
    alpha_system,
    balance_denominator,
    linearized_objective,
    merge_objective,
    solve_alpha,
    task_gram,
)
from submerge.diagnostics.linearity.sweep import Sweep
from submerge.diagnostics.modules import GRANULARITIES
from submerge.diagnostics.replay import Outputs, Unit, module_coords

_RESULTS = {  # store variable → key of a module's result
    "condition_number": "cond", "least_squares": "lstsq", "objective_alpha": "obj_alpha",
    "objective_uniform": "obj_uniform", "linearized_objective_alpha": "lin_alpha",
    "linearized_objective_uniform": "lin_uniform",
}


def _grams(outputs: dict[str, Outputs], tasks):
    """Per input task a: the (n_a, T, T) Grams of Eq. 14 and per sample (f(x; θ0), [Δf_t(x)]) in float64."""
    grams, features = [], []
    for a in tasks:
        per_sample, deltas = [], []
        for sample in outputs[a].per_sample():
            base = sample[0]
            d = [tuned - base for tuned in sample[1:]]
            per_sample.append(task_gram(d).numpy())
            deltas.append((base, d))
        grams.append(np.stack(per_sample))
        features.append(deltas)
    return grams, features


def _true_objective(merged: dict[str, Outputs], features, grams, tasks, balance: bool) -> float:
    """Eq. 10 (Eq. 33 when balanced) on the merged replays against each input task's own fine-tune."""
    merged_features, tuned, denominators = [], [], []
    for a, task in enumerate(tasks):
        merged_features.append(list(merged[task].features(0)))
        tuned.append([base + d[a] for base, d in features[a]])
        denominators.append([balance_denominator(g) for g in grams[a]])
    return merge_objective(merged_features, tuned, denominators if balance else None)


def alpha(
    experiment,
    *,
    granularity: str = "layer",
    balance: bool = True,
    max_condition: float = 1e12,
    run: RunSettings | None = None,
    **run_options,
) -> xr.Dataset:
    """Closed-form merge coefficients α per submodule (seed 002 Eq. 12–14; balanced Eq. 33–34).

    For each module i, Δf_t(x) = f(x; θ0^i + τ_t^i) − f(x; θ0^i) on the inputs of
    every task; α = A⁻¹b in float64, least squares when A is singular or
    ill-conditioned (flagged, with the condition number). The Eq. 10 objective
    (true module outputs) is stored at the solved α and at uniform weights 1/T,
    and the linearised objective (Eq. 22 / 33) at both.
    ``run`` (or its fields as keywords: ``store``, ``force``, ``progress``, ``command``, ``on_unit``,
    ``capture_budget``, ``compute_dtype``, ``engine``): `submerge.diagnostics.execution.RunSettings`; with a
    ``RayEngine`` the layers are measured by a pipeline of Ray workers, and this process alone writes the store.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity '{granularity}' (choose from {list(GRANULARITIES)})")
    run = RunSettings.of(run, **run_options)
    tasks = experiment.tasks
    uniform = np.full(len(tasks), 1.0 / len(tasks))
    sweep = Sweep(experiment, GRANULARITIES[granularity], f"alpha/{granularity}",
                  {"granularity": granularity, "balance": balance, "max_condition": max_condition},
                  run)

    def measure(unit: Unit) -> dict:
        replays = {task: unit.run(task, [{}] + [{t: 1.0} for t in tasks]) for task in tasks}
        results = {}
        for module in unit.modules:
            grams, features = _grams({task: replays[task].of(module) for task in tasks}, tasks)
            solution = solve_alpha(*alpha_system(grams, balance=balance), max_condition=max_condition)
            objectives = [math.nan, math.nan]
            if module.level != "head":  # heads are solved on their own outputs only
                objectives = [_true_objective({task: unit.run(task, [dict(zip(tasks, map(float, weights)))]).of(module)
                                               for task in tasks}, features, grams, tasks, balance)
                              for weights in (solution.alpha, uniform)]
            results[module.name] = {
                "alpha": solution.alpha, "cond": solution.condition_number, "lstsq": solution.used_least_squares,
                "obj_alpha": objectives[0], "obj_uniform": objectives[1],
                "lin_alpha": linearized_objective(solution.alpha, grams, balance),
                "lin_uniform": linearized_objective(uniform, grams, balance)}
        return results

    def piece(modules, results) -> xr.Dataset:
        per_module = {name: (("granularity", "module"), np.array([[results[m.name][key] for m in modules]]))
                      for name, key in _RESULTS.items()}
        return xr.Dataset(
            {"alpha": (("granularity", "module", "task"), np.stack([results[m.name]["alpha"] for m in modules])[None]),
             **per_module},
            coords={"granularity": np.array([granularity], dtype=object), "task": np.array(tasks, dtype=object),
                    **module_coords(modules)},
        )

    sweep.run(f"Closed-form α ({granularity})", measure, piece)
    notes = {"equations": "seed 002 Eq. 12-14 (α = A⁻¹b), balanced Eq. 33-34" if balance else "seed 002 Eq. 12-14",
             "b_vector": "b_j = Σ_a B_aja (seed 002 Eq. 13)",
             "objective": "Eq. 10 on replayed module outputs (balanced by Eq. 33's denominator when balance)",
             "uniform": "α_t = 1/T", "head_objective": "NaN: heads are solved on their own outputs only",
             "gqa": "a k/v group shared by heads gets the mean α of its heads when merging (exact for plain MHA)"}
    return sweep.writer.finish(notes)

"""`diag projection`: Projection Distance (seed 002 Eq. 8), cosine_merge (Eq. 16), cosine_base (Eq. 17)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import xarray as xr

from submerge.diagnostics.execution import RunSettings
from submerge.diagnostics.linearity.equations import cosine_base, cosine_merge, projection_distance, projection_terms
from submerge.diagnostics.linearity.sweep import Sweep
from submerge.diagnostics.modules import DEFAULT_LEVELS
from submerge.diagnostics.replay import Outputs, Unit, module_coords

COMBOS_PER_REPLAY = 8  # merged variants replayed together (the model level runs them block by block together)


def projection_grid(size: int, values: Sequence[float] | None) -> list[tuple[float, ...]]:
    """Default α grids of seed 002 Fig. 3: {0.2,…,1}² for two models, {0.3,0.5,0.7}^T beyond."""
    if values is None:
        values = (0.2, 0.4, 0.6, 0.8, 1.0) if size == 2 else (0.3, 0.5, 0.7)
    return list(itertools.product(values, repeat=size))


def _metrics(tasks, subsets, combos, deltas: dict[str, Outputs], merged: list[dict[str, Outputs]]):
    """PD and cosine_merge per combo, cosine_base per subset, over the samples of the subset's tasks.

    ``deltas[a].values[t]`` is Δf_t on task a's inputs; ``merged[c][a].values[0]`` is Δ_merge of combo c.
    """
    base_values = np.full(len(subsets), np.nan)
    for s, subset in enumerate(subsets):
        chosen = [tasks.index(t) for t in subset]
        base_values[s] = cosine_base([[sample[t] for t in chosen] for a in subset for sample in deltas[a].per_sample()])
    pd_values, cos_values = np.full(len(combos), np.nan), np.full(len(combos), np.nan)
    for c, (subset, alpha) in enumerate(combos):
        ratios, cosines = [], []
        for a in subset:
            for sample, merge in zip(deltas[a].per_sample(), merged[c][a].features(0)):
                linear = sum(weight * sample[tasks.index(t)] for t, weight in zip(subset, alpha))
                ratio, cosine = projection_terms(merge, linear)
                ratios.append(ratio)
                cosines.append(cosine)
        pd_values[c] = projection_distance(ratios)
        cos_values[c] = cosine_merge(cosines)
    return pd_values, cos_values, base_values


def projection(
    experiment,
    *,
    levels: Sequence[str] = DEFAULT_LEVELS,
    alphas: Sequence[float] | None = None,
    run: RunSettings | None = None,
    **run_options,
) -> xr.Dataset:
    """Projection Distance (Eq. 8), cosine_merge (Eq. 16) and cosine_base (Eq. 17) per module.

    For every subset S of two or more fine-tunes and every α in its grid (seed 002
    Fig. 3 unless `alphas`), over x in the union of S's task data:
    Δ_merge = f(x; θ0 + Σ α_t τ_t) − f(x; θ0), Δ_lin = Σ α_t Δf_t(x).
    ``run`` (or its fields as keywords: ``store``, ``force``, ``progress``, ``command``, ``on_unit``,
    ``capture_budget``, ``compute_dtype``, ``engine``): `submerge.diagnostics.execution.RunSettings`; with a
    ``RayEngine`` the layers are measured by a pipeline of Ray workers, and this process alone writes the store.
    """
    run = RunSettings.of(run, **run_options)
    tasks = experiment.tasks
    if len(tasks) < 2:
        raise ValueError("the Projection Distance needs at least two fine-tunes")
    if "head" in levels:
        raise ValueError("projection supports levels model, layer, attn, mlp (head outputs: use `diag linearity`)")
    subsets = [s for size in range(2, len(tasks) + 1) for s in itertools.combinations(tasks, size)]
    combos = [(subset, alpha) for subset in subsets for alpha in projection_grid(len(subset), alphas)]
    combo_alpha = np.full((len(combos), len(tasks)), np.nan)
    for c, (subset, alpha) in enumerate(combos):
        for task, value in zip(subset, alpha):
            combo_alpha[c, tasks.index(task)] = value
    sweep = Sweep(experiment, levels, "projection", {"levels": list(levels),
                                                     "alphas": None if alphas is None else list(alphas)},
                  run)

    def measure(unit: Unit) -> dict:
        results = {}
        for module in unit.modules:
            deltas, merged = {}, [{} for _ in combos]
            for a in tasks:
                outs = unit.run(a, [{}] + [{t: 1.0} for t in tasks]).of(module)
                base = outs.values[0]
                deltas[a] = Outputs(outs.values[1:], outs.masks, outs.indices).minus(base)
                wanted = [c for c, (subset, _) in enumerate(combos) if a in subset]
                for start in range(0, len(wanted), COMBOS_PER_REPLAY):
                    group = wanted[start:start + COMBOS_PER_REPLAY]
                    replayed = unit.run(a, [dict(zip(*combos[c])) for c in group]).of(module)
                    for v, c in enumerate(group):
                        merged[c][a] = Outputs([replayed.values[v]], replayed.masks, replayed.indices).minus(base)
                del outs
            results[module.name] = _metrics(tasks, subsets, combos, deltas, merged)
        return results

    def piece(modules, values) -> xr.Dataset:
        return xr.Dataset(
            {
                "projection_distance": (("module", "combo"), np.stack([values[m.name][0] for m in modules])),
                "cosine_merge": (("module", "combo"), np.stack([values[m.name][1] for m in modules])),
                "cosine_base": (("module", "subset"), np.stack([values[m.name][2] for m in modules])),
            },
            coords={
                **module_coords(modules),
                "combo": np.arange(len(combos)),
                "task": np.array(tasks, dtype=object),
                "subset": np.array(["+".join(s) for s in subsets], dtype=object),
                "combo_subset": ("combo", np.array(["+".join(s) for s, _ in combos], dtype=object)),
                "combo_alpha": (("combo", "task"), combo_alpha),
            },
        )

    sweep.run("Projection Distance", measure, piece)
    return sweep.writer.finish({"equations": "seed 002 Eq. 8 (PD), Eq. 16 (cosine_merge), Eq. 17 (cosine_base)",
                                "cosine_base": "mean over pairs t<t' (Eq. 17 prints 1/(T(T-1)) over t<t', half a mean)",
                                "data": "x ranges over the union of the subset's task data"})

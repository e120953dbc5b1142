"""Benchmark: a lower bound on the wall of seed 002's protocol (`diag compare --subsets all`, every method tuned,
one seed) on the demo kit, from this machine's measured forward times, against the compare issue's 60-minute budget.

The protocol's arithmetic is fixed by what it asks for: each of the four subsets (the full set and every pair) merges
every method of `merge.compare.default_methods(tuned=True)`, tunes it on the fit records over its grid
(`merge.tuning.GRIDS`), evaluates the chosen merge on the held-out records, and runs the data steps of LoraHub (its
paper's 40 evaluations) and AdaMerging (its paper's 500 steps; the README's boards ran 10). Each of those is a
forward of the 135M model over the records (a backward too for AdaMerging), whatever the code around it does.
So this script measures, on this machine and in one run, compare's own evaluator on the demo kit at compare's
defaults (8 fit and 16 held-out records per task, ≤ 256 tokens):

    F_fit(task)   one fit-criterion evaluation on task's fit records (`merge.compare._Evaluator.losses`)
    F_held(task)  one held-out evaluation on task's held-out records
    A(subset)     one AdaMerging step on the subset's fit records (`learned.adamerging_coefficients(steps=1)`)

and counts the fewest evaluations the tuning can make (`fewest_tuning_evaluations`: `tuning.line_search`'s fewest
over unimodal and random losses for a method's first setting, 2 for each later one, which starts from the best λ so
far; the plan's rests and its two steering shares included). The bound leaves out everything else a run does: the evidence step, forming each method's δ (TIES' trims, the SVDs), writing
checkpoints, the block objectives, Fisher's data step and the closed forms' fits.

    python benchmarks/protocol_budget.py [--rounds 2] [--adamerging-steps 500,10]
"""

from __future__ import annotations

import argparse
import inspect
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUDGET_MINUTES = 60.0


def fewest_first_search(values, draws: int = 20_000) -> int:
    """The fewest fit evaluations `tuning.line_search` makes over `values` from scratch (no start): the minimum over
    losses with their minimum at each position (unimodal) and over `draws` random losses (any order of outcomes)."""
    from submerge.merge.tuning import line_search

    points = sorted(float(v) for v in values)
    generator = random.Random(0)
    losses = [{v: abs(v - at) for v in points} for at in points]
    losses += [{v: generator.random() for v in points} for _ in range(draws)]
    return min(len(line_search(points, loss.__getitem__)[1]) for loss in losses)


def fewest_tuning_evaluations(method: str) -> int:
    """The fewest fit evaluations compare's ``--tune line`` makes for `method`: its first setting searched from
    scratch (`fewest_first_search`), every later setting from the best λ so far, which costs at least 2 (the start
    and one neighbour). The plan: its rests as settings, then each steering share > 0: μ searched from scratch over
    the steering method's grid (compare's default ``--steer``, TSV-M), then λ from the plan's best, whose start
    the μ search has already evaluated (at least 1 more)."""
    from submerge.merge.compare import PLAN
    from submerge.merge.tuning import GRIDS, STEER_SHARES, lambdas_of, settings_of

    values = lambdas_of(method)
    settings = len(GRIDS[PLAN]["rest"]) if method == PLAN else len(settings_of(method))
    evaluations = fewest_first_search(values) + 2 * (settings - 1)
    if method == PLAN:
        shares = sum(1 for share in STEER_SHARES if share > 0)
        evaluations += shares * (fewest_first_search(lambdas_of("tsv-m")) + 1)
    return evaluations


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds of each evaluation (the fastest counts)")
    parser.add_argument("--adamerging-steps", default=None,
                        help="AdaMerging step counts to project (default: its paper's, the signature's, and 10)")
    args = parser.parse_args(argv)

    import torch

    from submerge.diagnostics.data import read_task_file, tokenize
    from submerge.diagnostics.demo import demo_adapters, ensure_demo_base, ensure_demo_data
    from submerge.diagnostics.experiment import Experiment
    from submerge.merge.compare import _Evaluator, default_methods, restricted, subset_label, task_subsets
    from submerge.merge.learned import adamerging_coefficients, lorahub_coefficients

    lorahub_steps = inspect.signature(lorahub_coefficients).parameters["steps"].default

    data = {task: str(path) for task, path in ensure_demo_data().items()}
    adapters = {task: str(path) for task, path in demo_adapters().items()}
    experiment = Experiment.load(str(ensure_demo_base()), adapters, data, samples=8, max_tokens=256)
    held_out = {task: tokenize(read_task_file(task, path, samples=16, skip=8), experiment.base.tokenizer,
                               max_tokens=256) for task, path in data.items()}
    tasks = experiment.tasks
    evaluator = _Evaluator(experiment, held_out)
    evaluator.load_terms(())  # the base: every candidate is a forward of the same size
    print(f"demo kit: {len(tasks)} tasks, 8 fit + 16 held-out records each, ≤ 256 tokens; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    evaluator.losses(experiment.batches)  # warm-up: a process's first forward pays one-time costs

    fit, held = {}, {}
    for task in tasks:
        fit[task] = min(timed(lambda task=task: evaluator.losses(experiment.batches, [task])) for _ in range(args.rounds))
        held[task] = min(timed(lambda task=task: evaluator.losses(None, [task])) for _ in range(args.rounds))
        print(f"  {task}: F_fit {fit[task]:.2f} s, F_held {held[task]:.2f} s", flush=True)

    subsets = task_subsets(tasks, "all")
    step = {}
    for subset in subsets:
        part = restricted(experiment, subset)
        step[subset] = timed(lambda part=part: adamerging_coefficients(part, steps=1, progress=False))
        print(f"  one AdaMerging step on {subset_label(subset)}: {step[subset]:.2f} s", flush=True)

    methods = default_methods(tuned=True)
    evaluations = {method: fewest_tuning_evaluations(method) for method in methods}
    tuning_per_subset = sum(evaluations.values())
    print(f"\n{len(methods)} methods per subset; the fewest tuning evaluations per subset: {tuning_per_subset} "
          f"({', '.join(f'{m} {n}' for m, n in evaluations.items())})")

    references = (1 + len(tasks)) * sum(fit[t] + held[t] for t in tasks)
    parts = {"references (base and fine-tunes, fit and held out)": references}
    for subset in subsets:
        f_fit, f_held = sum(fit[t] for t in subset), sum(held[t] for t in subset)
        name = subset_label(subset)
        parts[f"{name}: tuning"] = tuning_per_subset * f_fit
        parts[f"{name}: held-out evaluations"] = len(methods) * f_held
        parts[f"{name}: LoraHub ({lorahub_steps} evaluations)"] = lorahub_steps * f_fit
    without_adamerging = sum(parts.values())
    print("\nlower bound, in minutes, without AdaMerging:")
    for name, seconds in parts.items():
        print(f"  {name:<55} {seconds / 60:6.1f}")
    print(f"  {'sum':<55} {without_adamerging / 60:6.1f}")
    paper = inspect.signature(adamerging_coefficients).parameters["steps"].default
    for steps in (int(s) for s in (args.adamerging_steps or f"{paper},10").split(",")):
        adamerging = steps * sum(step.values())
        total = (without_adamerging + adamerging) / 60
        print(f"with AdaMerging at {steps} steps (+{adamerging / 60:.1f} min): {total:.1f} min = "
              f"{total / BUDGET_MINUTES:.2f}× the {BUDGET_MINUTES:.0f}-minute budget")


if __name__ == "__main__":
    main()

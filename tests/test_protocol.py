"""Issue 21 item 3: the seeds' protocol in `diag compare` (merge/compare.py, merge/tuning.py).

Known answers for the λ search (a quadratic and a staircase whose minimiser is known), the grid table, task
subsets and their labels, the data-sample seeds; then `compare` on three tiny trained fine-tunes: every subset
scored on its own tasks, the evidence fitted per subset, each tuned choice the argmin of independently written
merges' fit losses, the store layout, a kill mid-way resuming to the uninterrupted result, and `diag report`
drawing one leaderboard per subset.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from submerge.merge.compare import CompareError, resampled, subset_label, task_subsets, unit_label
from submerge.merge.tuning import (
    CALIBRATED,
    GRIDS,
    LAMBDAS,
    LAMBDAS_WIDE,
    TuningError,
    check_search,
    grid_search,
    lambdas_of,
    line_search,
    settings_of,
)

# ----------------------------------------------------------------------- the λ search


def _counted(function):
    calls = []

    def loss(value):
        calls.append(value)
        return function(value)

    return loss, calls


@pytest.mark.parametrize("minimum", [0.1, 0.3, 0.6, 0.7, 1.0])
def test_line_search_finds_the_minimum_of_a_unimodal_loss_with_fewer_evaluations(minimum):
    loss, calls = _counted(lambda v: (v - minimum) ** 2 + 2.0)
    best, losses = line_search(LAMBDAS, loss)
    assert best == pytest.approx(minimum)
    assert losses[best] == pytest.approx(2.0)
    assert len(calls) == len(set(calls)) < len(LAMBDAS)  # each value at most once, fewer than the grid
    assert grid_search(LAMBDAS, lambda v: (v - minimum) ** 2)[0] == pytest.approx(minimum)


@pytest.mark.parametrize("minimum", [0.1, 0.3, 0.6, 1.0])
@pytest.mark.parametrize("start", [0.1, 0.5, 0.6, 1.0])
def test_line_search_from_a_start_walks_downhill_to_the_same_minimum(minimum, start):
    """Known counts: from a start d grid steps from the minimum of a unimodal loss, the descent evaluates the start,
    its neighbours (one at an edge of the grid) and then one value per further step: 3 + max(d − 1, 0) + … in
    all, 3 where the start is the minimum inside the grid; always the golden-section search's answer."""
    loss, calls = _counted(lambda v: (v - minimum) ** 2 + 2.0)
    best, _ = line_search(LAMBDAS, loss, start=start)
    assert best == pytest.approx(minimum) and best == line_search(LAMBDAS, lambda v: (v - minimum) ** 2)[0]
    assert len(calls) == len(set(calls))
    here, target = LAMBDAS.index(start), LAMBDAS.index(minimum)
    neighbours = sum(0 <= i < len(LAMBDAS) for i in (here - 1, here + 1))
    beyond = 1 if 0 <= target + (1 if target > here else -1) < len(LAMBDAS) else 0  # the rise that stops it
    expected = 1 + neighbours if here == target else 1 + neighbours + (abs(target - here) - 1) + beyond
    assert len(calls) == expected
    assert line_search(LAMBDAS, lambda v: (v - minimum) ** 2, start=0.55)[0] == pytest.approx(minimum)  # not a value
    assert grid_search(LAMBDAS, loss, start=start)[0] == pytest.approx(minimum)


def test_grid_search_every_value_ties_to_the_smaller_and_nan_never_wins():
    best, losses = grid_search([0.5, 0.2, 0.8], lambda v: {0.2: 1.0, 0.5: 1.0, 0.8: 3.0}[v])
    assert best == 0.2 and set(losses) == {0.2, 0.5, 0.8}
    best, losses = line_search([0.2, 0.4, 0.6], lambda v: math.nan if v == 0.2 else v)
    assert best == 0.4 and losses[0.2] == math.inf
    assert line_search([1.0], lambda v: 5.0) == (1.0, {1.0: 5.0})


def test_grid_table_and_its_settings():
    assert lambdas_of("task-arithmetic") == LAMBDAS  # seed 002 Table 12: 0.1 … 1.0
    assert lambdas_of("dare") == (0.6, 0.8, 1.0)  # seed 002 App. A.3.4
    assert settings_of("dare") == [{"drop_rate": p} for p in (0.6, 0.7, 0.8, 0.9)]
    assert settings_of("consensus") == [{"mask_lambda": v} for v in (0.2, 0.3, 0.4, 0.5, 0.6)]
    assert settings_of("ties") == [{"top_k": 0.1}, {"top_k": 0.2}, {"top_k": 0.3}, {"top_k": 0.5}]
    # a merge at its natural scale brackets λ = 1 (0.2 … 2.0) whatever --lambdas says; CART has no λ grid of its own
    assert settings_of("iso-c") == [{}] and lambdas_of("iso-c", (0.5, 1.0)) == LAMBDAS_WIDE
    assert lambdas_of("plan") == lambdas_of("closed-form-attn-mlp") == lambdas_of("regmean") == LAMBDAS_WIDE
    assert lambdas_of("cart", (0.5, 1.0)) == (0.5, 1.0) and lambdas_of("task-arithmetic-tuned") == LAMBDAS
    assert settings_of("x", {"x": {"a": (1, 2), "b": (3,)}}) == [{"a": 1, "b": 3}, {"a": 2, "b": 3}]
    from submerge.merge.strategies import STRATEGIES

    # the plan's own knobs: the share of its matrices steered (compare._tune_steering), none, half or all, and its
    # rest as the mean or the sum of the task vectors (merge.plan.with_rest)
    assert settings_of("plan") == [{"steer_share": q, "rest": rest} for q in (0.0, 0.5, 1.0)
                                   for rest in ("mean", "sum")]
    for method, grid in GRIDS.items():  # every knob of the table is an option of the registered strategy
        knobs = set(grid) - ({"scaling"} if method in CALIBRATED else set())  # there: λ, a global scale
        knobs -= {"steer_share", "rest"} if method == "plan" else set()
        assert method in STRATEGIES or (method in CALIBRATED and not knobs), method
        assert knobs <= set(STRATEGIES[method].resolve_options({}) if knobs else ()), method
    assert check_search("none") is None and check_search(None) is None and check_search("grid") == "grid"
    with pytest.raises(TuningError, match="--tune must be one of none, line, grid"):
        check_search("random")


def test_gain_criterion_weights_are_the_inverse_fine_tune_gains_and_rank_as_the_mean_gain():
    from submerge.merge.tuning import check_tune_by, criterion_weights

    tasks = ["math", "code", "trivia"]
    base, own = [2.0, 1.5, 3.0], [1.0, 1.4, 2.5]  # gains 1.0, 0.1, 0.5 → w ∝ 1, 10, 2
    weights = criterion_weights("gain", base, own, tasks)
    assert weights == pytest.approx([1 / 13, 10 / 13, 2 / 13])
    assert criterion_weights("loss", base, own, tasks) == pytest.approx([1 / 3] * 3)
    # ranking candidates by Σ w_t L_t is ranking them by their mean normalised gain, best first, and here not by
    # their mean loss: A gains on code (small denominator), B on math
    candidates = {"A": np.array([1.9, 1.45, 2.9]), "B": np.array([1.5, 1.5, 2.9])}
    gain = {c: float(np.mean((np.array(base) - x) / (np.array(base) - np.array(own)))) for c, x in candidates.items()}
    weighted = {c: float(weights @ x) for c, x in candidates.items()}
    assert gain["A"] > gain["B"] and weighted["A"] < weighted["B"]
    assert np.mean(candidates["A"]) > np.mean(candidates["B"])  # the plain mean would choose B
    rng = np.random.default_rng(0)  # property: the order is the mean gain's order for any candidates
    losses = rng.uniform(1.0, 3.0, size=(50, 3))
    gains = ((np.array(base) - losses) / (np.array(base) - np.array(own))).mean(axis=1)
    assert np.array_equal(np.argsort(-gains), np.argsort(losses @ weights))
    # a fine-tune that does not improve on its task's fit records: no ratio, the plain mean, and a warning naming it
    with pytest.warns(UserWarning, match=r"code \(-0.1000 nats\)"):
        assert criterion_weights("gain", base, [1.0, 1.6, 2.5], tasks) == pytest.approx([1 / 3] * 3)
    with pytest.raises(TuningError, match="--tune-by must be one of gain, loss"):
        check_tune_by("accuracy")


# ----------------------------------------------------------------------- subsets and seeds


def test_task_subsets_and_labels():
    tasks = ["math", "code", "trivia"]
    assert [subset_label(s) for s in task_subsets(tasks)] == ["math+code+trivia"]
    assert [subset_label(s) for s in task_subsets(tasks, "pairs")] == ["math+code", "math+trivia", "code+trivia"]
    assert [subset_label(s) for s in task_subsets(tasks, "all")] == ["math+code+trivia", "math+code", "math+trivia",
                                                                     "code+trivia"]
    assert task_subsets(["a", "b"], "all") == task_subsets(["a", "b"], "pairs") == [("a", "b")]  # the pair is the set
    assert unit_label("math+code", 2, "ties") == "math+code|2|ties"
    with pytest.raises(CompareError, match="--subsets must be one of full, pairs, all"):
        task_subsets(tasks, "triples")


def test_seeds_resample_fit_and_held_out_records(tmp_path):
    from submerge.diagnostics import toy

    path = toy.write_task_data(tmp_path / "math.jsonl", "math", count=12)
    fit0, held0 = resampled("math", path, fit=3, skip=4, samples=5, seed=0)
    assert fit0.indices == [0, 1, 2] and held0.indices == [4, 5, 6, 7, 8]  # seed 0: today's first records
    fit1, held1 = resampled("math", path, fit=3, skip=4, samples=5, seed=1)
    again = resampled("math", path, fit=3, skip=4, samples=5, seed=1)
    assert (fit1.indices, held1.indices) == (again[0].indices, again[1].indices)  # a seed gives one draw
    assert not set(fit1.indices) & set(held1.indices)  # fit and held out stay disjoint
    assert set(fit1.indices) | set(held1.indices) <= set(range(9))  # drawn from the first skip + samples
    assert (fit1.indices, held1.indices) != (fit0.indices, held0.indices)
    texts = toy.task_texts("math", 12)
    assert held1.texts == [texts[i] for i in held1.indices]


# ----------------------------------------------------------------------- compare on three tiny fine-tunes

TASKS = ("math", "code", "prose")
FIT = 3
PROTOCOL = {"fit": FIT, "samples": 3, "max_tokens": 40, "batch_size": 4, "dtype": "float32", "device": "cpu",
            "progress": False, "evidence_options": {"folds": 3}, "subsets": "all", "seeds": 2, "tune": "line",
            "methods": ["task-arithmetic", "ties", "plan"], "lambdas": (0.5, 1.0), "objective": False,
            "grids": {"task-arithmetic": {"scaling": (0.3, 0.6, 0.9)}, "ties": {"top_k": (0.1, 0.3),
                                                                             "scaling": (0.5, 1.0, 1.5)}}}


@pytest.fixture(scope="session")  # its tests share one xdist group ("protocol"), so one worker builds it, usually once
def kit(tmp_path_factory):
    from submerge.diagnostics import toy

    root = tmp_path_factory.mktemp("protocol")
    base, finetuned, data = toy.trained_kit(root, TASKS, records=8)
    return root, base, finetuned, data


@pytest.fixture(scope="session")
def protocol(kit):
    """The full protocol (every subset, two seeds, tuned) into a store; the evidence calls it made."""
    from submerge.diagnostics.store import Store
    from submerge.merge import compare as module

    root, base, finetuned, data = kit
    fitted = []
    evidence_plan = module.evidence_plan

    def recorded(experiment, chosen, **kwargs):
        fitted.append((tuple(chosen), tuple(experiment.tasks), kwargs["run"].store is not None))
        return evidence_plan(experiment, chosen, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "evidence_plan", recorded)
        dataset = module.compare(base, finetuned, data, store=Store(root / "store.zarr"), **PROTOCOL)
    return dataset, root / "store.zarr", fitted


@pytest.mark.xdist_group("protocol")
def test_protocol_layout_every_subset_on_its_own_tasks(protocol):
    from submerge.diagnostics.store import Store
    from submerge.merge.compare import COMPARE

    dataset, store_path, fitted = protocol
    subsets = ["math+code+prose", "math+code", "math+prose", "code+prose"]
    methods = PROTOCOL["methods"]
    expected = []
    for seed in (0, 1):
        expected += [unit_label(s, seed, m) for s in subsets for m in ["base", *(f"finetuned:{t}" for t in s.split("+"))]]
        expected += [unit_label(s, seed, m) for s in subsets for m in methods]
    assert list(dataset.unit.values) == expected  # references of a seed first, then each subset's merges
    COMPARE.check(dataset)
    COMPARE.check(Store(store_path).dataset("compare"))
    assert Store(store_path).is_complete("compare")
    for unit in dataset.unit.values:
        row = dataset.sel(unit=unit)
        own = str(row.subset.values).split("+")
        finite = [str(t) for t in dataset.task.values if np.isfinite(float(row.loss.sel(task=t)))]
        assert finite == own, unit  # scored on its own tasks only
        np.testing.assert_allclose(float(row.mean_gain), np.nanmean(row.gain.values))
    # one evidence fit per subset and seed, on that subset's tasks (only the full set's seed 0 in the store)
    assert sorted(fitted) == sorted((tuple(s.split("+")), tuple(s.split("+")), s == subsets[0] and seed == 0)
                                    for seed in (0, 1) for s in subsets)
    # seeds: other held-out records, so other base losses
    base = dataset.sel({"method": "base"})
    full = base.where((base.subset == subsets[0]).compute(), drop=True)
    assert not np.allclose(full.loss.values[0], full.loss.values[1])
    records = Store(store_path).group_attrs("compare")["drawn_records"]
    for task in TASKS:
        assert records["0"][task]["fit"] == [0, 1, 2] and records["0"][task]["held_out"] == [3, 4, 5]
        assert not set(records["1"][task]["fit"]) & set(records["1"][task]["held_out"])


@pytest.mark.xdist_group("protocol")
def test_protocol_tuned_choice_is_the_argmin_of_independently_written_merges(protocol, kit, tmp_path):
    """Every tuned unit's hyperparameters are the lowest fit loss it searched; for task arithmetic and TIES on the
    full set (seed 0) the searched fit losses (each task's weighted by 1 / its fine-tune's fit-record gain, measured
    here) and the held-out loss equal those of merges written with the option itself (scaling = λ), not as
    θ0 + λ·δ."""
    from submerge.diagnostics.evaluate import checkpoint_source, streamed_losses
    from submerge.diagnostics.experiment import Experiment
    from submerge.merge.writer import ParameterRule, write_merge

    dataset, _, _ = protocol
    _, base, finetuned, data = kit
    tuned = dataset.where((dataset.kind == "strategy").compute() | (dataset.kind == "plan").compute(), drop=True)
    for unit in tuned.unit.values:
        search = dataset.attrs[f"search {unit}"]
        row = dataset.sel(unit=unit)
        assert float(row.fit_loss) == pytest.approx(min(search.values()))
        chosen = json.loads(str(row.hyperparameters.values))
        label = " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in chosen.items()
                         if k not in ("scaling", "λ"))
        scale_name = "scaling" if "scaling" in chosen else "λ"
        assert search[f"{label} {scale_name}={chosen[scale_name]:g}".strip()] == pytest.approx(float(row.fit_loss))
    fit = Experiment.load(base, finetuned, data, samples=FIT, max_tokens=40, batch_size=4, dtype="float32",
                          device="cpu")
    held = Experiment.load(base, finetuned, data, samples=3, skip=FIT, max_tokens=40, batch_size=4,
                           dtype="float32", device="cpu")

    def losses(experiment, method, options):
        directory = tmp_path / f"{method}-{json.dumps(options, sort_keys=True)}"
        if not directory.exists():
            write_merge(base, finetuned, directory, lambda info: ParameterRule(method=method, options=options),
                        progress=False)
        source, variant = checkpoint_source(experiment.base, str(directory), experiment.compute_dtype)
        result = streamed_losses(source, experiment.arch, experiment.batches, variant)
        return np.array([result[t][0] for t in experiment.tasks])

    def model_losses(experiment, spec):  # the base (None) or a fine-tune, as it is
        source, variant = checkpoint_source(experiment.base, spec, experiment.compute_dtype)
        result = streamed_losses(source, experiment.arch, experiment.batches, variant)
        return np.array([result[t][0] for t in experiment.tasks])

    full = subset_label(TASKS)
    # the criterion (tune_by gain, the default): fit losses weighted by 1 / each fine-tune's gain on the fit records
    gains = model_losses(fit, None) - np.array([model_losses(fit, finetuned[t])[i] for i, t in enumerate(TASKS)])
    weights = (1 / gains) / (1 / gains).sum()
    assert list(dataset.attrs[f"fit_weights {full}|0"].values()) == pytest.approx(list(weights), rel=1e-4)
    for method in ("task-arithmetic", "ties"):
        unit = unit_label(full, 0, method)
        search = dataset.attrs[f"search {unit}"]
        chosen = json.loads(str(dataset.sel(unit=unit).hyperparameters.values))
        for candidate, fit_loss in list(search.items())[:3]:
            options = {k: float(v) for k, v in (part.split("=") for part in candidate.split())}
            assert float(weights @ losses(fit, method, options)) == pytest.approx(fit_loss, rel=1e-4)
        np.testing.assert_allclose(losses(held, method, chosen), dataset.sel(unit=unit).loss.values, rtol=1e-4)


@pytest.mark.xdist_group("protocol")
def test_killed_protocol_resumes_to_the_uninterrupted_result(protocol, kit, tmp_path):
    from submerge.diagnostics.store import Store
    from submerge.merge.compare import compare

    uninterrupted, _, _ = protocol
    _, base, finetuned, data = kit

    class Killed(Exception):
        pass

    kills = [unit_label("math+code+prose", 0, "ties"), unit_label("code+prose", 1, "ties")]
    for kill in kills:
        def on_unit(unit, kill=kill):
            if unit == kill:
                raise Killed(unit)

        with pytest.raises(Killed):
            compare(base, finetuned, data, store=Store(tmp_path / "store.zarr"), on_unit=on_unit, **PROTOCOL)
        assert not Store(tmp_path / "store.zarr").is_complete("compare")
    seen = []
    resumed = compare(base, finetuned, data, store=Store(tmp_path / "store.zarr"), on_unit=seen.append, **PROTOCOL)
    assert seen == [unit_label("code+prose", 1, "plan")]  # only what the last kill left
    assert list(resumed.unit.values) == list(uninterrupted.unit.values)
    np.testing.assert_allclose(resumed.loss.values, uninterrupted.loss.values, rtol=1e-6)
    np.testing.assert_allclose(resumed.gain.values, uninterrupted.gain.values, rtol=1e-6, atol=1e-9)
    assert list(resumed.hyperparameters.values) == list(uninterrupted.hyperparameters.values)


def test_protocol_refuses_what_it_cannot_do(kit):
    from submerge.merge.compare import compare

    _, base, finetuned, data = kit
    with pytest.raises(CompareError, match="--keep and --lm-eval .* --tune none"):
        compare(base, finetuned, data, keep="somewhere", **PROTOCOL)
    with pytest.raises(CompareError, match="a given plan .* --subsets full"):
        compare(base, finetuned, data, **{**PROTOCOL, "choose": "thresholds"})
    with pytest.raises(CompareError, match="--seeds must be at least 1"):
        compare(base, finetuned, data, **{**PROTOCOL, "seeds": 0})


@pytest.mark.xdist_group("protocol")
def test_report_draws_one_leaderboard_per_subset_with_mean_std_and_tuned(protocol, tmp_path):
    from typer.testing import CliRunner

    from submerge.cli.main import app
    from submerge.merge.compare import summary

    dataset, store_path, _ = protocol
    frame = summary(dataset)
    assert list(dict.fromkeys(frame.subset)) == ["math+code+prose", "math+code", "math+prose", "code+prose"]
    for subset, rows in frame.groupby("subset", sort=False):
        assert list(rows.index) == list(rows.sort_values("mean gain", ascending=False).index)  # each ranked
        assert set(rows.index) == {"base", *(f"finetuned:{t}" for t in subset.split("+")), *PROTOCOL["methods"]}
        assert rows[[f"gain {t}" for t in TASKS if t not in subset.split("+")]].isna().all().all()
    assert "± std" in frame and "tuned" in frame
    ties = frame[(frame.subset == "math+code") & (frame.index == "ties")].iloc[0]
    values = dataset.sel({"method": "ties"}).where((dataset.sel({"method": "ties"}).subset == "math+code").compute(), drop=True)
    chosen = list(dict.fromkeys(str(h) for h in values.hyperparameters.values))  # seed 0's, seed 1's if other
    assert ties["tuned"].count("top_k=") == len(chosen) and ties["tuned"].count("; ") == len(chosen) - 1
    assert ties["mean gain"] == pytest.approx(float(values.mean_gain.mean()))
    assert ties["± std"] == pytest.approx(float(values.mean_gain.std(ddof=1)))
    result = CliRunner().invoke(app, ["report", str(store_path), "--out", str(tmp_path / "figures")],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert all(s in result.output for s in ("math+code+prose", "math+prose", "code+prose", "± std", "tuned"))
    assert "each method tuned (line) by its mean normalised gain on the fit records" in result.output  # the criterion
    assert (tmp_path / "figures" / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_block_objective_of_each_merge_and_its_rank_correlation_with_the_loss(kit, tmp_path):
    """The stored objective of the plan is `merge.plan.block_objectives` of the saved plan on the held-out records,
    summed over blocks; ρ is scipy's Spearman over the merges of the subset; the CLI prints it under the table."""
    from scipy.stats import spearmanr
    from typer.testing import CliRunner

    from submerge.cli.main import app
    from submerge.diagnostics.experiment import Experiment
    from submerge.merge.compare import compare
    from submerge.merge.plan import Plan, block_objectives

    _, base, finetuned, data = kit
    methods = ["task-arithmetic", "weight-average", "ties", "plan"]
    run = {**PROTOCOL, "subsets": "full", "seeds": 1, "tune": None, "objective": True, "methods": methods}
    dataset = compare(base, finetuned, data, plan_out=tmp_path / "plan.yaml", **run)
    held = Experiment.load(base, finetuned, data, samples=3, skip=FIT, max_tokens=40, batch_size=4,
                           dtype="float32", device="cpu")
    fit = Experiment.load(base, finetuned, data, samples=FIT, max_tokens=40, batch_size=4, dtype="float32",
                          device="cpu")
    expected = sum(block_objectives(held, Plan.load(tmp_path / "plan.yaml"), fit=fit).values())
    assert float(dataset.sel({"method": "plan"}).objective) == pytest.approx(expected, rel=1e-4)
    merged = dataset.sel({"method": methods})
    assert np.isfinite(merged.objective.values).all()
    assert np.isnan(dataset.sel({"method": "base"}).objective.values).all()  # references have none
    rho = spearmanr(merged.objective.values, np.nanmean(merged.loss.values, axis=1)).statistic
    assert dataset.attrs["rank_correlation"] == {subset_label(TASKS): {"0": pytest.approx(rho)}}
    arguments = ["compare", "--model", base, "--out", tmp_path / "cli.zarr", "--methods", ",".join(methods),
                 "--tune", "none", "--fit", FIT, "--samples", 3, "--max-tokens", 40, "--batch-size", 4, "--folds", 3,
                 "--dtype", "float32", "--device", "cpu", "--no-progress"]
    for task in TASKS:
        arguments += ["--finetuned", f"{task}={finetuned[task]}", "--data", f"{task}={data[task]}"]
    result = CliRunner().invoke(app, [str(a) for a in arguments], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert f"Spearman ρ(Σ block Eq. 10, held-out loss) across merges, {subset_label(TASKS)}: seed 0 {rho:.3f}" in (
        " ".join(result.output.split()))

"""Issue 22 item 2: the evidence step as a driver on the shared sweep (`submerge.diagnostics.linearity.evidence`).

Known answers on the hand-made kit of tests/test_compare.py (attention and MLP want different α by construction),
the store group ``evidence`` (dims, resume after a kill, settings checks, provenance, --force), its α against
`diag alpha`'s and its objectives against the block objectives, the block forwards counted for L and 2L blocks
(linear in depth: each chunk continues where the last stopped), Ray equal to one process bit for bit, and
`diag compare` resuming its evidence step.
"""

from __future__ import annotations

import importlib
import warnings
import weakref
from collections import Counter

import numpy as np
import pytest
import torch

from submerge.diagnostics import replay as replay_module
from submerge.diagnostics import toy
from submerge.diagnostics.errors import StoreError
from submerge.diagnostics.execution import RayEngine
from submerge.diagnostics.experiment import Experiment
from submerge.diagnostics.linearity import alpha
from submerge.diagnostics.linearity.evidence import EvidenceError, evidence, parts_of, unit_of
from submerge.diagnostics.store import Store
from submerge.merge.plan import PlanDelta, block_objectives, candidate_merge, choose_by_evidence, evidence_plan
from tests.test_compare import HAND_FIT, _hand_experiment, hand_kit  # noqa: F401 (the hand-made kit, a fixture)

# the module (`submerge.diagnostics.linearity.evidence` as an attribute is the driver function)
evidence_module = importlib.import_module("submerge.diagnostics.linearity.evidence")


class Killed(RuntimeError):
    pass


@pytest.fixture(scope="module")
def hand_fit(hand_kit):  # noqa: F811
    return _hand_experiment(hand_kit, skip=0)


def _merge(experiment, **options):
    return candidate_merge(experiment, {t: t for t in experiment.tasks}, **options)


def assert_same(dataset, reference) -> None:
    assert dict(dataset.sizes) == dict(reference.sizes)
    for name in ("layer", "candidate", "fold", "part", "task"):
        assert list(dataset[name].values) == list(reference[name].values), name
    for name, variable in reference.data_vars.items():
        assert variable.dims == dataset[name].dims, name
        assert np.array_equal(variable.values, dataset[name].values, equal_nan=True), name


# ------------------------------------------------------------------ known answers, by construction


def test_evidence_group_holds_the_known_answer_of_the_hand_kit(hand_fit, tmp_path):
    store = Store(tmp_path / "store.zarr")
    merge = _merge(hand_fit)
    result = evidence(hand_fit, merge, candidates=("layer", "attn-mlp", "head-mlp"), folds=2, store=store,
                      progress=False)
    stored = store.dataset("evidence")
    assert store.is_complete("evidence") and stored.attrs["unit_dim"] == "layer"
    assert_same(stored, result)
    assert result.fold_objective.dims == ("layer", "candidate", "fold")
    assert result.alpha.dims == ("layer", "part", "task") and result.fold_alpha.dims == ("layer", "part", "fold", "task")
    assert list(result.layer.values) == [0, 1] and list(result.fold.values) == [0, 1]
    assert list(result.part.values) == ["block", "attn", "mlp"] + [f"attn.head.{h}" for h in range(4)]
    # attention: each task's update acts on its own records only → α = (1, 1) on every fold and on all records;
    # MLP: the same update in both → α_A + α_B = 1, minimum norm (0.5, 0.5); every head carries its task's update
    for part, expected in (("attn", [1.0, 1.0]), ("mlp", [0.5, 0.5]), ("attn.head.2", [1.0, 1.0])):
        np.testing.assert_allclose(result.alpha.sel(layer=0, part=part).values, expected, atol=1e-6)
        np.testing.assert_allclose(result.fold_alpha.sel(layer=0, part=part).values, [expected] * 2, atol=1e-6)
    scores = result.fold_objective.sel(layer=0)
    assert (scores.sel(candidate="layer") > 1e-3).all()
    assert (scores.sel(candidate="attn-mlp") < 1e-6 * scores.sel(candidate="layer")).all()
    assert (scores.sel(candidate="head-mlp") < 1e-6 * scores.sel(candidate="layer")).all()
    assert (result.fold_objective.sel(layer=1).values == 0.0).all()  # no fine-tune changed block 1
    # provenance, settings and notes on the group
    attrs = store.group_attrs("evidence")
    assert attrs["settings"]["candidates"] == ["layer", "attn-mlp", "head-mlp"] and attrs["settings"]["folds"] == 2
    assert attrs["settings"]["merge"] == merge.settings and attrs["provenance"]["engine"]["engine"] == "local"
    assert attrs["fit_records"] == HAND_FIT and "fold i mod 2" in attrs["folds"]
    # the plan is read from the store group alone, and it is the hand kit's answer
    evidence_read = choose_by_evidence(stored, merge, base_model="base", infos=[])
    assert evidence_read.plan().layer_granularity == {0: "attn-mlp", 1: "layer"}
    assert evidence_read.layers[0].alpha["head-mlp"]["layers.0.attn.head.3"] == pytest.approx({"left": 1.0,
                                                                                              "right": 1.0})


def test_alpha_equals_diag_alpha_and_objectives_equal_block_objectives(hand_kit, tmp_path):  # noqa: F811
    """Property: α on all fit records is `diag alpha`'s (same Grams, same solve); the layer candidate's plan
    scored on every record is `diag alpha`'s Eq. 10 objective at its α (balanced) — up to float32 rounding: the
    plan merges θ0 + (Σ_t α_t τ_t), `diag alpha` replays (θ0 + α_1 τ_1) + α_2 τ_2."""
    experiment = _hand_experiment(hand_kit, skip=0)
    result = evidence(experiment, _merge(experiment), candidates=("layer", "attn-mlp", "head-mlp"), folds=2,
                      progress=False)
    solved = {g: alpha(experiment, granularity=g, progress=False) for g in ("layer", "attn-mlp", "head-mlp")}
    for layer in (0, 1):
        for part in parts_of(("layer", "attn-mlp", "head-mlp"), 4):
            unit = unit_of(layer, part)
            granularity = "layer" if part == "block" else "head-mlp" if "head" in part else "attn-mlp"
            expected = solved[granularity].alpha.sel(module=unit).isel(granularity=0).values
            np.testing.assert_allclose(result.alpha.sel(layer=layer, part=part).values, expected, rtol=1e-12,
                                       atol=1e-15, err_msg=unit)
    plan = evidence_plan(experiment, hand_kit[1], folds=2, progress=False).single("layer")
    objectives = block_objectives(experiment, plan)
    expected = solved["layer"].objective_alpha.isel(granularity=0).values
    np.testing.assert_allclose([objectives[0], objectives[1]], expected, rtol=1e-6, atol=1e-15)
    assert objectives[0] > 1e-3


def test_block_objectives_sharing_the_finetunes_replays_are_bitwise_the_same(hand_kit, tmp_path, monkeypatch):  # noqa: F811
    """`shared`: the first merge's call replays the base and each fine-tune per block and keeps them with the
    block's input stream; later merges on the same records neither capture nor replay anything but their own
    merged block, with the objectives of a fresh call bit for bit."""
    experiment = _hand_experiment(hand_kit, skip=0)
    evidence_result = evidence_plan(experiment, hand_kit[1], folds=2, progress=False)
    plans = [PlanDelta(evidence_result.single(g)) for g in ("layer", "attn-mlp", "layer")]
    fresh = [evidence_module.block_objectives(experiment, delta) for delta in plans]
    replays = Counter()
    original = evidence_module._block_data

    def counted(layer, tasks):
        replays[layer.index] += 1
        return original(layer, tasks)

    monkeypatch.setattr(evidence_module, "_block_data", counted)
    captures = Counter()
    capture = replay_module.record_inputs

    def counted_capture(*args, **kwargs):
        captures["forward"] += 1
        return capture(*args, **kwargs)

    monkeypatch.setattr(replay_module, "record_inputs", counted_capture)
    shared = tmp_path / "shared"
    kept = []
    for delta in plans:
        kept.append(evidence_module.block_objectives(experiment, delta, shared=shared))
        assert captures["forward"] == len(experiment.tasks)  # the first call's capture (one per task), no other
    assert kept == fresh and fresh[0] != fresh[1]  # bitwise, and the merges differ
    assert replays == {0: 1, 1: 1}  # once per block, for the first merge only
    assert sorted(p.name for p in shared.iterdir()) == ["layer-0.safetensors", "layer-1.safetensors"]


def test_a_block_rule_candidate_is_scored_as_the_block_merged_by_that_strategy(hand_fit):
    """``--candidates layer,attn-mlp,task-arithmetic,ties``: a strategy merges the whole block, no α. Its fold
    objectives average to the block objective of θ0 + Σ τ computed apart (equal folds); it loses block 0 of the hand
    kit, where the MLP wants α_A + α_B = 1 and Σ τ doubles the MLP's update, and ties at 0 in the unchanged block 1.
    A plan whose block took a rule carries it on every tensor of the block, and merges as that strategy does."""
    from submerge.merge.plan import BLOCK_RULES, PlanError
    from submerge.merge.strategies import merge_parameter

    candidates = ("layer", "attn-mlp", "task-arithmetic", "ties")
    result = evidence_plan(hand_fit, hand_kit_finetuned(hand_fit), candidates=candidates, folds=2, progress=False)
    scores = {c: np.mean(result.layers[0].fold_objective[c]) for c in candidates}
    summed = evidence_module.block_objectives(hand_fit, lambda info, vectors: vectors[0] + vectors[1])
    assert scores["task-arithmetic"] == pytest.approx(summed[0], rel=1e-6)
    assert scores["attn-mlp"] < 1e-6 * scores["task-arithmetic"]
    assert result.layers[1].fold_objective["ties"] == [0.0, 0.0]
    plan = result.plan()
    assert plan.layer_granularity == {0: "attn-mlp", 1: "layer"} and not plan.matrix_rules

    forced = result._plan({0: "ties", 1: "layer"}, steered=False)
    block0 = [info for info in result.infos if info.layer == 0]
    assert sorted(forced.matrix_rules) == sorted(info.name for info in block0)
    assert all(rule["method"] == "ties" and rule["options"] == {} for rule in forced.matrix_rules.values())
    assert forced.layer_granularity == {0: "layer", 1: "layer"} and "layers.0" in forced.alpha
    weight = next(info for info in block0 if info.kind == "matrix")
    vectors = [torch.randn(weight.shape, generator=torch.Generator().manual_seed(t)) for t in range(2)]
    assert torch.equal(PlanDelta(forced)(weight, vectors), merge_parameter(weight.name, vectors, "ties", {},
                                                                             kind=weight.kind))
    assert "ties" in BLOCK_RULES and "regmean" in BLOCK_RULES
    assert "closed-form" not in BLOCK_RULES and "nan" not in BLOCK_RULES  # NAN reads θ0, which a candidate lacks
    with pytest.raises(PlanError, match=r"unknown block rule\(s\) \['fisher'\]: a block can be merged by"):
        evidence_plan(hand_fit, hand_kit_finetuned(hand_fit), candidates=("layer", "fisher"), folds=2,
                      progress=False)
    with pytest.raises(PlanError, match="unknown block rule"):
        _merge(hand_fit, block_rules=("fisher",))


def hand_kit_finetuned(experiment) -> dict[str, str]:
    return {t: t for t in experiment.tasks}


def test_bad_options_are_clear_errors(hand_fit):
    merge = _merge(hand_fit)
    with pytest.raises(EvidenceError, match="--folds must be at least 2"):
        evidence(hand_fit, merge, folds=1, progress=False)
    with pytest.raises(EvidenceError, match="9-fold cross-validation needs at least 9 fit records per task"):
        evidence(hand_fit, merge, folds=9, progress=False)
    with pytest.raises(EvidenceError, match="candidate .model. is neither a granularity choosable per layer"):
        evidence(hand_fit, merge, candidates=("layer", "model"), progress=False)


# ------------------------------------------------------------------ store: resume, settings, force


def test_killed_evidence_resumes_to_the_same_values_and_settings_are_checked(hand_fit, tmp_path):
    merge = _merge(hand_fit)
    fresh = evidence(hand_fit, merge, folds=2, progress=False)
    store = Store(tmp_path / "store.zarr")

    def kill(label):
        raise Killed(label)

    with pytest.raises(Killed, match="0"):
        evidence(hand_fit, merge, folds=2, store=store, progress=False, on_unit=kill)
    assert not store.is_complete("evidence") and store.group_attrs("evidence")["units_done"] == 1
    measured = []
    original = evidence_module._EvidenceOfLayer.__call__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(evidence_module._EvidenceOfLayer, "__call__",
                      lambda self, layer: measured.append(layer.index) or original(self, layer))
        resumed = evidence(hand_fit, merge, folds=2, store=store, progress=False, capture_budget=1)
    assert measured == [1]  # only the block not in the store
    assert_same(resumed, fresh)
    assert_same(store.dataset("evidence"), fresh)
    # other settings (folds, the merge's steering rules) are refused, the group kept; --force recomputes
    for options, changed in (({"folds": 3}, "folds"), ({"merge": _merge(hand_fit, steer_method="iso-c")},
                                                       "steer_method")):
        with pytest.raises(StoreError, match=changed):
            evidence(hand_fit, options.get("merge", merge), folds=options.get("folds", 2), store=store,
                     progress=False)
    assert_same(store.dataset("evidence"), fresh)
    recomputed = evidence(hand_fit, merge, folds=3, store=store, force=True, progress=False)
    assert recomputed.sizes["fold"] == 3 and store.group_attrs("evidence")["settings"]["folds"] == 3


# ------------------------------------------------------------------ linear in depth


@pytest.fixture(scope="module")
def depth_kits(tmp_path_factory):
    """The same toy Llama at L = 2 and 2L = 4 blocks, two perturbed fine-tunes each, shared task data."""
    root = tmp_path_factory.mktemp("depth")
    data = {task: str(toy.write_task_data(root / f"{task}.jsonl", task, count=4)) for task in ("math", "code")}
    kits = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for layers in (2, 4):
            base = toy.build_model(root / f"L{layers}" / "base", "llama", layers=layers, hidden=32)
            tuned = toy.perturbed_finetunes(base, ["math", "code"])
            kits[layers] = Experiment.load(str(base), {t: str(p) for t, p in tuned.items()}, data, samples=4,
                                           max_tokens=32, batch_size=2, dtype="float32", device="cpu")
    return kits


def _count_block_forwards(monkeypatch, experiment) -> tuple[Counter, Counter]:
    """Counters of the computed forwards of each block (the block class's `forward`: a block a capture skips
    returns its saved output without computing, and is not counted): all of them, and those of captures."""
    blocks = {id(experiment.base.model.get_submodule(experiment.arch.layer_path(j))): j
              for j in range(experiment.arch.num_layers)}
    block_class = type(experiment.base.model.get_submodule(experiment.arch.layer_path(0)))
    forward, record = block_class.forward, replay_module.record_inputs
    every, captured, capturing = Counter(), Counter(), []

    def counted_forward(self, *args, **kwargs):
        if id(self) in blocks:
            every[blocks[id(self)]] += 1
            captured[blocks[id(self)]] += bool(capturing)
        return forward(self, *args, **kwargs)

    def counted_record(*args, **kwargs):
        capturing.append(1)
        try:
            return record(*args, **kwargs)
        finally:
            capturing.pop()

    monkeypatch.setattr(block_class, "forward", counted_forward)
    monkeypatch.setattr(replay_module, "record_inputs", counted_record)
    return every, captured


@pytest.mark.parametrize("step", ["evidence", "block_objectives"])
def test_block_forwards_grow_linearly_with_depth(depth_kits, monkeypatch, step):
    """One layer per chunk (capture budget 1 byte): each block is captured once per batch in all, and every
    block costs the same replays, so 2L blocks cost exactly twice the forwards of L. (Before, capture re-ran
    blocks 0..j for every chunk and for every layer of `block_objectives`: block j ran L − j times, O(L²).)"""
    totals = {}
    for layers, experiment in depth_kits.items():
        batches = sum(len(experiment.batches[t]) for t in experiment.tasks)
        with monkeypatch.context() as patch:
            every, captured = _count_block_forwards(patch, experiment)
            if step == "evidence":
                evidence(experiment, _merge(experiment), folds=2, progress=False, capture_budget=1)
            else:
                plan = evidence_plan(experiment, {t: t for t in experiment.tasks}, folds=2,
                                     progress=False).single("attn-mlp")
                every.clear(), captured.clear()
                block_objectives(experiment, plan)
        assert sorted(every) == list(range(layers))
        assert set(captured.values()) == {batches}, captured  # every block captured once per batch, no re-runs
        assert len(set(every.values())) == 1, every  # the same work for every block
        totals[layers] = sum(every.values())
    assert totals[4] == 2 * totals[2]


# ------------------------------------------------------------------ Ray


@pytest.mark.xdist_group("ray")  # one xdist worker runs every Ray test (conftest: --dist loadgroup)
def test_evidence_on_ray_equals_one_process(depth_kits, tmp_path):
    """2 Ray workers (blocks 0–1 and 2–3) give bitwise the single-process evidence, in the store too, though the
    driver is killed after its first block and the run resumed on Ray (RegMean's fold Grams measured in the
    workers)."""
    ray = pytest.importorskip("ray")
    experiment = depth_kits[4]
    merge = _merge(experiment, block_rules=("regmean",))
    candidates = ("layer", "attn-mlp", "head-mlp", "regmean")
    fresh = evidence(experiment, merge, candidates=candidates, folds=2, progress=False)
    store, report = Store(tmp_path / "ray.zarr"), {}

    def kill(label):
        raise Killed(label)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        options = {"candidates": candidates, "folds": 2, "progress": False, "store": store}
        with pytest.raises(Killed):
            evidence(experiment, merge, **options, engine=RayEngine(workers=2), on_unit=kill)
        resumed = evidence(experiment, merge, **options, engine=RayEngine(workers=2, report=report))
    finally:
        ray.shutdown()
    assert [worker["layers"] for worker in report["workers"]] == [[0, 1], [2, 3]]
    assert_same(resumed, fresh)
    assert_same(store.dataset("evidence"), fresh)
    assert store.group_attrs("evidence")["provenance"]["engine"]["workers"] == 2


# ------------------------------------------------------------------ diag compare resumes its evidence step


def test_killed_compare_resumes_its_evidence_step(hand_kit, tmp_path):  # noqa: F811
    from submerge.merge.compare import compare

    base, finetuned, data = hand_kit
    options = {"methods": ["plan"], "tune": None, "fit": HAND_FIT, "samples": 4, "max_tokens": 48, "batch_size": 4,
               "evidence_options": {"folds": 2}, "dtype": "float32", "device": "cpu", "progress": False}
    original = evidence_module._EvidenceOfLayer.__call__
    measured = []

    def dies_at_block_1(self, layer):
        measured.append(layer.index)
        if layer.index == 1 and len(measured) == 2:
            raise Killed("block 1")
        return original(self, layer)

    store = Store(tmp_path / "store.zarr")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(evidence_module._EvidenceOfLayer, "__call__", dies_at_block_1)
        with pytest.raises(Killed):
            compare(base, finetuned, data, store=store, **options)
        assert store.group_attrs("evidence")["units_done"] == 1
        result = compare(base, finetuned, data, store=Store(tmp_path / "store.zarr"), plan_out=tmp_path / "plan.yaml",
                         **options)
    assert measured == [0, 1, 1]  # the resumed compare measured block 1 only
    uninterrupted = compare(base, finetuned, data, store=Store(tmp_path / "other.zarr"), **options)
    assert_same(Store(tmp_path / "store.zarr").dataset("evidence"), Store(tmp_path / "other.zarr").dataset("evidence"))
    np.testing.assert_array_equal(result.loss.values, uninterrupted.loss.values)
    assert "plan" in [str(m) for m in result.method.values]


def test_plan_delta_is_the_plans_rule(hand_fit):
    """`PlanDelta` (what the driver replays) merges each tensor with the plan's own rule."""
    import torch

    evidence_found = evidence_plan(hand_fit, {t: t for t in hand_fit.tasks}, folds=2, progress=False)
    plan = evidence_found.plan()
    info = next(i for i in evidence_found.infos if i.name.endswith("layers.0.mlp.down_proj.weight"))
    vectors = [torch.ones(info.shape), 2 * torch.ones(info.shape)]
    weights = plan.rule_for(info).weights
    expected = weights["left"] * vectors[0] + weights["right"] * vectors[1]
    torch.testing.assert_close(PlanDelta(plan)(info, vectors), expected)


# ------------------------------------------------------------------ RegMean as a block candidate


@pytest.fixture(scope="module")
def random_kit(tmp_path_factory):
    """A toy Llama (2 blocks) with two random full fine-tunes (every tensor changed) and 8 records per task."""
    root = tmp_path_factory.mktemp("regmean-candidate")
    data = {task: str(toy.write_task_data(root / f"{task}.jsonl", task, count=8)) for task in ("math", "code")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = toy.build_model(root / "base", "llama", layers=2, hidden=32)
        tuned = toy.perturbed_finetunes(base, ["math", "code"])
    return str(base), {t: str(p) for t, p in tuned.items()}, data


def _records_experiment(kit, positions: list[int], directory, batch_size: int = 3,
                        dtype: str = "float32", max_tokens: int = 32) -> Experiment:
    """The kit's experiment on its records at `positions` only (written to their own data files)."""
    import json

    base, finetuned, data = kit
    subset = {}
    for task, path in data.items():
        lines = [json.loads(line) for line in open(path).read().splitlines()]
        subset[task] = directory / f"{task}-{'-'.join(map(str, positions))}.jsonl"
        subset[task].write_text("".join(json.dumps(lines[i]) + "\n" for i in positions))
    return Experiment.load(base, finetuned, {t: str(p) for t, p in subset.items()}, samples=len(positions),
                           max_tokens=max_tokens, batch_size=batch_size, dtype=dtype, device="cpu")


def test_a_regmean_candidate_is_regmean_fitted_on_the_other_folds_and_scored_on_its_own(random_kit, tmp_path):
    """``--candidates …,regmean``: per fold k, the block's weight matrices merged by RegMean on the input Grams of
    the other folds' records, its other tensors (norms) by the block's α of the other folds, scored on fold k. The
    reference is computed apart: the Grams by `input_gram_matrices` (a forward of the base) over an experiment of
    the training records alone, `strategies.regmean`, and `block_objectives` over an experiment of fold k's records.
    Batches of 3 records mix the folds."""
    from submerge.diagnostics.capture import input_gram_matrices
    from submerge.merge.strategies import regmean

    folds, records = 3, 8
    fit = _records_experiment(random_kit, list(range(records)), tmp_path)
    tasks = list(fit.tasks)
    result = evidence(fit, _merge(fit, block_rules=("regmean",)), candidates=("layer", "regmean"), folds=folds,
                      progress=False)
    scores = result.fold_objective.sel(candidate="regmean").values  # (layer, fold)
    for k in range(folds):
        train = _records_experiment(random_kit, [i for i in range(records) if i % folds != k], tmp_path)
        held = _records_experiment(random_kit, [i for i in range(records) if i % folds == k], tmp_path)
        names = train.base.checkpoint_names
        grams = {t: {names.get(key, key): g for key, g in input_gram_matrices(
            train.base.model, train.arch, train.batches[t]).items()} for t in tasks}
        alpha = result.fold_alpha.sel(part="block", fold=k).values  # (layer, task)

        def delta(info, vectors, alpha=alpha, grams=grams):
            if info.kind == "matrix" and info.layer >= 0:
                return regmean(vectors, gram_matrices=[grams[t][info.name] for t in tasks])
            return sum(float(w) * v for w, v in zip(alpha[info.layer], vectors))

        expected = evidence_module.block_objectives(held, delta)
        for layer in (0, 1):
            assert scores[layer, k] == pytest.approx(expected[layer], rel=1e-5), (layer, k)
    assert np.all(scores > 0) and np.all(np.isfinite(scores))
    # the fit leaves fold k out: RegMean on every record's Grams scores fold 0 otherwise
    names = fit.base.checkpoint_names
    leaky = {t: {names.get(key, key): g for key, g in input_gram_matrices(fit.base.model, fit.arch,
                                                                            fit.batches[t]).items()} for t in tasks}
    alpha = result.fold_alpha.sel(part="block", fold=0).values
    held = _records_experiment(random_kit, [i for i in range(records) if i % folds == 0], tmp_path)
    with_leak = evidence_module.block_objectives(held, lambda info, vectors: (
        regmean(vectors, gram_matrices=[leaky[t][info.name] for t in tasks]) if info.kind == "matrix"
        else sum(float(w) * v for w, v in zip(alpha[info.layer], vectors))))
    assert with_leak[0] != pytest.approx(scores[0, 0], rel=1e-3)


def test_regmean_fold_grams_are_the_other_folds_grams_shared_by_maps_fed_the_same_input(random_kit, tmp_path,
                                                                                         monkeypatch):
    """The Grams each fold's RegMean is fitted on (`training_grams`, from the block's map inputs kept once per task,
    not T × folds Grams) are the Grams of a base forward over the other folds' records alone; q/k/v share one tensor,
    gate/up another. Batches of 3 records mix the folds."""
    from submerge.diagnostics.capture import input_gram_matrices

    folds, records = 3, 8
    fit = _records_experiment(random_kit, list(range(records)), tmp_path)
    tasks, seen = list(fit.tasks), {}
    real = evidence_module.training_grams

    def spy(inputs, count, fold):
        found = real(inputs, count, fold)
        for name, per_task in found.items():
            assert (name, fold) not in seen or "layers.0." not in name  # each block asks once per fold
            seen[(name, fold)] = per_task
        return found

    monkeypatch.setattr(evidence_module, "training_grams", spy)
    evidence(fit, _merge(fit, block_rules=("regmean",)), candidates=("layer", "regmean"), folds=folds, progress=False)
    names = fit.base.checkpoint_names
    for k in range(folds):
        train = _records_experiment(random_kit, [i for i in range(records) if i % folds != k], tmp_path)
        expected = {t: {names.get(key, key): g for key, g in input_gram_matrices(
            train.base.model, train.arch, train.batches[t]).items()} for t in tasks}
        checked = [(name, per_task) for (name, fold), per_task in seen.items() if fold == k]
        assert sorted(name for name, _ in checked) == sorted(expected[tasks[0]])
        for name, per_task in checked:
            for t, gram in zip(tasks, per_task):
                torch.testing.assert_close(gram, expected[t][name].to(gram.dtype), rtol=1e-5, atol=1e-5)
        q, k_, v = (seen[(f"model.layers.0.self_attn.{m}_proj.weight", k)] for m in "qkv")
        assert q is k_ is v
        gate, up = (seen[(f"model.layers.0.mlp.{m}_proj.weight", k)] for m in ("gate", "up"))
        assert gate is up and q is not gate
        # computed when asked for, one task at a time, and not kept (a 7B down-projection's is 0.5 GB)
        first = weakref.ref(q[0])
        assert first() is None and len(q) == len(tasks) and torch.equal(q[-1], q[len(tasks) - 1])
        with pytest.raises(IndexError):
            q[len(tasks)]


def test_regmean_fold_grams_are_kept_for_the_blocks_folds_only_below_the_threshold(random_kit, tmp_path, monkeypatch):
    """Both sides of `FOLD_GRAMS_KEPT_BYTES`: below it each fold's Gram G_f (per task and group of maps) is computed
    once and kept for the block's other folds; above it (a 7B block) folds − 1 times, kept nowhere; the evidence is
    bit for bit the same."""
    folds, records = 3, 7
    fit = _records_experiment(random_kit, list(range(records)), tmp_path)
    calls, real = [], evidence_module.FoldGrams._fold_gram
    monkeypatch.setattr(evidence_module.FoldGrams, "_fold_gram",
                        lambda self, task, fold: calls.append((task, self.lead, fold)) or real(self, task, fold))
    results, counts = {}, {}
    for threshold in (1 << 30, 0):
        monkeypatch.setattr(evidence_module, "FOLD_GRAMS_KEPT_BYTES", threshold)
        calls.clear()
        results[threshold] = evidence(fit, _merge(fit, block_rules=("regmean",)), candidates=("layer", "regmean"),
                                      folds=folds, progress=False)
        counts[threshold] = len(calls)
    layers, tasks = fit.arch.num_layers, len(fit.tasks)
    assert len({lead for _, lead, _ in calls}) == 4 * layers  # groups fed one tensor: q/k/v, o, gate/up, down
    assert counts[1 << 30] == tasks * 4 * layers * folds  # each G_f of a group once
    # not kept: each of the 7 maps' RegMean indexes its group's Grams, each the sum of the other folds' G_f
    assert counts[0] == tasks * 7 * layers * folds * (folds - 1)
    for name in ("fold_objective", "alpha", "fold_alpha"):
        np.testing.assert_array_equal(results[1 << 30][name].values, results[0][name].values)


def test_the_regmean_inputs_replay_lets_the_base_blocks_pooled_parameters_go(random_kit, tmp_path, monkeypatch):
    """`map_inputs` replays the base block, which forms θ0 in the compute dtype in the source's pool (a float16 7B
    block: 0.8 GB in float32); the candidates' merges that follow never use it, so it is let go on return."""
    fit = _records_experiment(random_kit, list(range(6)), tmp_path, dtype="bfloat16")  # θ0 formed in float32
    real, pooled = evidence_module.map_inputs, []

    def watched(layer, tasks, folds_by_task):
        inputs = real(layer, tasks, folds_by_task)
        pooled.append(len(layer.source._pool))
        return inputs

    monkeypatch.setattr(evidence_module, "map_inputs", watched)
    evidence(fit, _merge(fit, block_rules=("regmean",)), candidates=("layer", "regmean"), folds=2, progress=False)
    assert pooled == [0, 0]


def test_the_candidates_merges_read_the_blocks_task_vectors_tensor_by_tensor(random_kit, tmp_path, monkeypatch):
    """Both sides of `placement.TAU_KEPT_BYTES`. Above it (a 7B block's τ of three tasks is 2.4 GB in float32) each
    candidate's merge of a block (`merged_block`) starts with no τ kept by the source and keeps none: it reads the T
    tasks' τ of one tensor at a time. Below it the first merge of a block reads the block's τ and keeps it for the
    block's other merges, which read none; the sweep lets it go after the block. The evidence is bit for bit the
    same; the scores are those of the τ kept
    (`test_a_regmean_candidate_is_regmean_fitted_on_the_other_folds_and_scored_on_its_own`)."""
    from submerge.diagnostics import placement

    fit = _records_experiment(random_kit, list(range(6)), tmp_path)
    real, kept = evidence_module.merged_block, []

    def watched(source, path, delta, table, tasks):
        before = len(source._cache)
        params = real(source, path, delta, table, tasks)
        kept.append((path, before, len(source._cache)))
        return params

    monkeypatch.setattr(evidence_module, "merged_block", watched)
    results = {}
    for threshold in (0, placement.TAU_KEPT_BYTES):
        monkeypatch.setattr(placement, "TAU_KEPT_BYTES", threshold)
        kept.clear()
        results[threshold] = evidence(fit, _merge(fit, block_rules=("regmean", "ties")),
                                      candidates=("layer", "regmean", "ties"), folds=2, progress=False)
        assert len(kept) == 2 * (2 + 2 + 1), kept
        if threshold == 0:
            assert all(before == after == 0 for _, before, after in kept), kept
        else:
            for path in {p for p, _, _ in kept}:
                counts = [(before, after) for p, before, after in kept if p == path]
                assert counts[0][0] == 0 and counts[0][1] > 0  # the block's first merge reads and keeps τ
                assert all(before == after == counts[0][1] for before, after in counts[1:])  # the others read none
    for name in ("fold_objective", "alpha", "fold_alpha"):
        np.testing.assert_array_equal(results[0][name].values, results[placement.TAU_KEPT_BYTES][name].values)


def test_regmean_recovers_each_fine_tune_where_their_inputs_are_disjoint(hand_fit):
    """The hand kit: each fine-tune's attention update reads only its own task's input dimensions and the MLP update
    is shared, so RegMean on each block's input Grams gives every task its own fine-tune's block: objective 0 (to
    rounding), far below Σ τ's. A plan whose block chose RegMean carries it on the block's weight matrices only; its
    norms keep the block's α."""
    from submerge.merge.plan import gram_ruled

    result = evidence_plan(hand_fit, hand_kit_finetuned(hand_fit), candidates=("layer", "attn-mlp", "regmean"),
                           folds=2, progress=False)
    summed = evidence_module.block_objectives(hand_fit, lambda info, vectors: vectors[0] + vectors[1])
    assert max(result.layers[0].fold_objective["regmean"]) < 1e-9 * summed[0]
    forced = result._plan({0: "regmean", 1: "layer"}, steered=False)
    block0 = [info for info in result.infos if info.layer == 0]
    assert sorted(gram_ruled(forced)) == sorted(info.name for info in block0 if info.kind == "matrix")
    norm = next(info for info in block0 if info.kind == "norm")
    assert forced.rule_for(norm).weights == result.layers[0].alpha["layer"]["layers.0"]


def test_folds_are_by_position_among_the_fit_records_not_by_file_index(hand_fit):
    """Resampled fit records (`diag compare --seeds`) are any positions of their files: record indices 0, 2, 4 …
    would all fall in fold 0 of 2 by index. Folds go by position among the fit records, so the evidence (RegMean's
    fold Grams included) is bitwise the same whatever the records' indices in their files."""
    import dataclasses

    relabelled = dataclasses.replace(hand_fit, batches={
        task: [dataclasses.replace(batch, sample_index=[2 * i for i in batch.sample_index]) for batch in batches]
        for task, batches in hand_fit.batches.items()}, data={
        task: dataclasses.replace(data, indices=[2 * i for i in data.indices]) for task, data in hand_fit.data.items()})
    merge = _merge(hand_fit, block_rules=("regmean",))
    options = {"candidates": ("layer", "attn-mlp", "regmean"), "folds": 2, "progress": False}
    assert_same(evidence(relabelled, merge, **options), evidence(hand_fit, merge, **options))


def test_evidence_on_records_regrouped_by_length_keeps_its_folds_and_values(random_kit, tmp_path, monkeypatch):
    """The evidence replays each task's fit records regrouped by length within each fold (`Experiment.regrouped`:
    sorted, cut where padding is saved, no batch holding two folds), and its folds stay those of the records as
    read (record i → fold i mod k): every fold objective and α, RegMean's fitted per fold included, is the file
    order's (one batch of every fold, replayed whole for each fold) to float64 rounding."""
    from submerge.diagnostics import data as data_module
    from submerge.diagnostics.data import regrouped_rule

    # toy records are short: without the per-batch overhead, regrouping splits them where padding is saved
    monkeypatch.setattr(data_module, "BATCH_OVERHEAD_TOKENS", 0)
    fit = _records_experiment(random_kit, list(range(8)), tmp_path, batch_size=8, dtype="float64", max_tokens=256)
    regrouped = fit.regrouped(0)
    assert all(len(regrouped.batches[task]) > 1 for task in fit.tasks)
    assert any([i for b in regrouped.batches[task] for i in b.sample_index] != fit.data[task].indices
               for task in fit.tasks)  # sorted by length: not the order read
    merge = _merge(fit, block_rules=("regmean",))
    options = {"candidates": ("layer", "attn-mlp", "regmean"), "folds": 3, "progress": False}
    new = evidence(fit, merge, **options)
    with monkeypatch.context() as patch:
        patch.setattr(Experiment, "regrouped", lambda self, overhead=None, folds=None: self)
        old = evidence(fit, merge, **options)
    assert new.attrs["settings"]["batches"] == regrouped_rule(0, 3) and "batches" not in old.attrs["settings"]
    for name in ("fold_objective", "alpha", "fold_alpha"):
        np.testing.assert_allclose(new[name].values, old[name].values, rtol=1e-9, atol=1e-12, err_msg=name)


def test_a_folds_candidates_replay_only_its_own_batches_and_score_as_the_whole_replay(random_kit, tmp_path,
                                                                                        monkeypatch):
    """The evidence cuts each task's batches within folds, and each fold's merges (α of the other folds, RegMean
    fitted on them) replay only that fold's batches: every fold objective and α is bit for bit what replaying every
    batch for every fold gives, in a quarter of the candidates' batch replays at 4 folds."""
    from submerge.diagnostics import data as data_module

    monkeypatch.setattr(data_module, "BATCH_OVERHEAD_TOKENS", 0)  # short toy records: batches cut by padding alone
    fit = _records_experiment(random_kit, list(range(8)), tmp_path, batch_size=8, dtype="float32", max_tokens=64)
    merge = _merge(fit, block_rules=("regmean",))
    options = {"candidates": ("layer", "attn-mlp", "regmean"), "folds": 4, "progress": False}
    regrouped = fit.regrouped(0, folds=4)
    for task in fit.tasks:  # no batch holds two folds' records
        fold = data_module.folds_of(fit.data[task].indices, 4)
        assert all(len({fold[i] for i in batch.sample_index}) == 1 for batch in regrouped.batches[task])
    original = evidence_module._merged_features
    replayed = Counter()

    def counted(layer, delta, table, tasks, samples=None, *, whole=False):
        merged = original(layer, delta, table, tasks, None if whole else samples)
        replayed["whole" if whole else "own"] += sum(value is not None for per_task in merged for value in per_task)
        return merged

    monkeypatch.setattr(evidence_module, "_merged_features", counted)
    own = evidence(fit, merge, **options)
    monkeypatch.setattr(evidence_module, "_merged_features", lambda *args, **kw: counted(*args, **kw, whole=True))
    whole = evidence(fit, merge, **options)
    assert_same(own, whole)
    layers, candidates, samples = fit.arch.num_layers, 3, sum(len(fit.data[t].indices) for t in fit.tasks)
    assert replayed["whole"] == layers * candidates * 4 * samples  # every merge on every record
    assert replayed["own"] == layers * candidates * samples  # each fold's merges on its own records


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gemma3", "gpt2"])
def test_the_evidence_takes_the_bases_unit_outputs_from_the_capture_bit_for_bit_on_every_toy_architecture(
        toy_kit, monkeypatch, name):
    """Every causal toy architecture: the block data's outputs on θ0 (block, attention, MLP) come from the capture
    (`Recorded.output`) instead of a replay of the base, and every fold objective and α is bit for bit the replayed
    base's, with one variant fewer replayed per unit and task; an attention that serves heads (which need W_o's
    input per variant) still replays θ0, and so does every unit where a layer's inputs and outputs do not fit the
    capture budget together."""
    experiment = toy_kit(name).experiment()
    merge = _merge(experiment)
    original, captured_base = replay_module.replay_variants, evidence_module._captured_base
    variants = Counter()

    def counted(source, arch, path, recorded, chosen, **kw):
        variants[path] += len(chosen)
        return original(source, arch, path, recorded, chosen, **kw)

    monkeypatch.setattr(replay_module, "replay_variants", counted)
    runs = [(("layer", "attn-mlp"), 3), (("layer", "attn-mlp", "head-mlp"), 2)]
    for candidates, units in runs[:1] if name == "gpt2" else runs:  # GPT-2's fused q/k/v: no head-level merge
        options = {"candidates": candidates, "folds": 2, "progress": False}
        monkeypatch.setattr(evidence_module, "_captured_base", captured_base)
        variants.clear()
        captured = evidence(experiment, merge, **options)
        taken = sum(variants.values())
        monkeypatch.setattr(evidence_module, "_captured_base", lambda layer, path, task: None)
        variants.clear()
        replayed = evidence(experiment, merge, **options)
        assert_same(captured, replayed)
        assert sum(variants.values()) - taken == experiment.arch.num_layers * units * len(experiment.tasks)
    monkeypatch.setattr(evidence_module, "_captured_base", captured_base)
    without = variants.copy()
    variants.clear()  # a budget that a layer's inputs and outputs do not fit together: no outputs kept, θ0 replayed
    assert_same(evidence(experiment, merge, **options, capture_budget=1), replayed)
    assert variants == without


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gemma3", "gpt2"])
def test_block_objectives_on_kept_inputs_are_bitwise_the_captured_ones_on_every_toy_architecture(
        toy_kit, tmp_path, monkeypatch, name):
    """Every causal toy architecture: the objectives of later merges, computed on the block inputs the first call
    kept (each block's stream read back, its masks and positions rebuilt from the tokens), equal a fresh call's
    bit for bit, and no forward of the base runs for them."""
    from submerge.diagnostics import capture as capture_module

    experiment = toy_kit(name).experiment()
    merges = [lambda info, vectors, c=c: c * vectors[0] for c in (0.7, 0.3, 1.2)]
    fresh = [evidence_module.block_objectives(experiment, delta) for delta in merges]
    shared = tmp_path / "shared"
    first = evidence_module.block_objectives(experiment, merges[0], shared=shared)
    forwards = Counter()
    for module in (replay_module, capture_module):
        original = module.record_inputs

        def counted(*args, original=original, **kwargs):
            forwards["capture"] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, "record_inputs", counted)
    later = [evidence_module.block_objectives(experiment, delta, shared=shared) for delta in merges[1:]]
    assert [first, *later] == fresh and fresh[1] != fresh[2]
    assert forwards["capture"] == 0

"""Issue 13: `diag compare` and the plan chosen by evidence (merge/compare.py, merge/plan.py).

Known answers first (normalised gain, the one-standard-error rule, α solved on the other folds,
interference marks and steering, the plan YAML round trip), then the evidence choice on hand-made
fine-tunes of a tiny Llama whose answer is known by construction, then `compare` end to end
(Python API, resume, keep, errors, CLI and `diag report`) on tiny trained fine-tunes.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

from submerge.diagnostics.linearity import task_gram
from submerge.diagnostics.linearity.evidence import EvidenceError, fold_alphas
from submerge.diagnostics.tensors import TensorInfo, TensorTable
from submerge.merge.compare import indexed, normalised_gain
from submerge.merge.plan import PER_LAYER, Plan, PlanError, interference_marks, one_se_choice, steer

# ----------------------------------------------------------------------- normalised gain


def test_normalised_gain_known_values():
    base, tuned = np.array([2.0, 3.0]), np.array([1.0, 2.0])
    assert np.array_equal(normalised_gain(base, base, tuned), [0.0, 0.0])  # the base: exactly 0
    assert np.array_equal(normalised_gain(base, tuned, tuned), [1.0, 1.0])  # the fine-tune: exactly 1
    np.testing.assert_allclose(normalised_gain(base, [1.5, 3.5], tuned), [0.5, -0.5])  # worse than base: < 0
    np.testing.assert_allclose(normalised_gain(base, [0.5, 2.0], tuned), [1.5, 1.0])  # better than fine-tune: > 1
    # broadcasting: methods × tasks
    models = np.array([[2.0, 3.0], [1.0, 2.0], [1.5, 2.5]])
    np.testing.assert_allclose(normalised_gain(base, models, tuned), [[0, 0], [1, 1], [0.5, 0.5]])


def test_normalised_gain_is_nan_when_the_finetune_did_not_improve():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division warning, no inf
        gain = normalised_gain([2.0, 2.0, 3.0], [1.0, 2.0, 1.0], [2.0, 2.5, 1.0])
    assert np.isnan(gain[0]) and np.isnan(gain[1])  # base == fine-tune; fine-tune worse than the base
    assert gain[2] == 1.0
    assert not np.isinf(gain).any()


def test_normalised_gain_property_affine_in_the_model_loss():
    rng = np.random.default_rng(0)
    for _ in range(50):
        base = rng.uniform(1, 5, 4)
        tuned = base - rng.uniform(0.01, 1, 4)
        t = rng.uniform(-1, 2, 4)
        gain = normalised_gain(base, base + t * (tuned - base), tuned)  # the point t of the way to the fine-tune
        np.testing.assert_allclose(gain, t, atol=1e-12)


# ----------------------------------------------------------------------- one standard error rule


def test_one_se_choice_clear_win_of_the_finer_candidate():
    # attn-mlp lower on every fold by the same amount: zero spread, any tolerance → attn-mlp
    scores = {"layer": [1.0, 1.0, 1.0, 1.0], "attn-mlp": [0.5, 0.5, 0.5, 0.5]}
    assert one_se_choice(scores) == "attn-mlp"
    assert one_se_choice(scores, tolerance=100.0) == "attn-mlp"


def test_one_se_choice_keeps_the_coarsest_within_one_standard_error():
    # paired differences layer − attn-mlp = [0.1, −0.1, 0.2, 0]: mean 0.05, SE = sd/√4 = 0.0645
    scores = {"layer": [1.0, 1.2, 0.8, 1.0], "attn-mlp": [0.9, 1.3, 0.6, 1.0]}
    assert one_se_choice(scores) == "layer"  # 0.05 ≤ 1 · 0.0645
    assert one_se_choice(scores, tolerance=0.8) == "layer"  # 0.05 ≤ 0.8 · 0.0645 = 0.0516
    assert one_se_choice(scores, tolerance=0.7) == "attn-mlp"  # 0.05 > 0.7 · 0.0645 = 0.0452
    assert one_se_choice(scores, tolerance=0) == "attn-mlp"  # plain lower mean
    assert one_se_choice(dict(reversed(list(scores.items())))) == "layer"  # order of the dict does not matter


def test_one_se_choice_three_candidates_and_ties():
    # head-mlp best; attn-mlp within 1 SE of it (diffs [0, .1, −.1, .1]: mean .025, SE .048); layer far off
    scores = {"head-mlp": [1.0, 1.0, 1.0, 1.0], "attn-mlp": [1.0, 1.1, 0.9, 1.1], "layer": [2.0, 2.0, 2.0, 2.1]}
    assert one_se_choice(scores) == "attn-mlp"
    assert one_se_choice(scores, tolerance=0) == "head-mlp"
    # the coarsest is the best: chosen whatever the tolerance
    assert one_se_choice({"layer": [0.1, 0.2], "attn-mlp": [0.3, 0.4]}, tolerance=0) == "layer"
    # exact tie (e.g. a block no fine-tune changed): the coarsest
    assert one_se_choice({"attn-mlp": [0.0, 0.0, 0.0], "layer": [0.0, 0.0, 0.0]}) == "layer"
    assert one_se_choice({"attn-mlp": [0.0, 0.0, 0.0], "layer": [0.0, 0.0, 0.0]}, tolerance=0) == "layer"


# ----------------------------------------------------------------------- α on the other folds


def _weighted_least_squares_alpha(deltas, folds, fold, balance):
    """α minimising Σ_a mean_{x∈H_a, fold(x)≠fold} w(x) ‖Σ_t α_t δ_t(x) − δ_a(x)‖² by plain lstsq on
    stacked rows (seed 002 Eq. 11 / 33 written out, independent of `alpha_system`);
    w = 1/((1/T) Σ_t ‖δ_t(x)‖²) if balanced."""
    rows, targets = [], []
    tasks = len(deltas)
    for a in range(tasks):
        kept = [s for s in range(len(deltas[a])) if folds[a][s] != fold]
        for s in kept:
            sample = deltas[a][s]  # (T, d)
            weight = tasks / float((sample ** 2).sum()) if balance else 1.0
            scale = math.sqrt(weight / len(kept))
            rows.append(scale * sample.T)  # (d, T)
            targets.append(scale * sample[a])
    alpha, *_ = np.linalg.lstsq(np.concatenate(rows), np.concatenate(targets), rcond=None)
    return alpha


def _random_deltas(rng, tasks=3, samples=(7, 5, 6), dim=12):
    # task-specific structure: on task a's inputs δ_a is larger, so α differs from 1/T
    deltas = []
    for a in range(tasks):
        stack = rng.normal(size=(samples[a], tasks, dim))
        stack[:, a] *= 3.0
        deltas.append(stack)
    return deltas


@pytest.mark.parametrize("balance", [True, False])
def test_fold_alphas_is_the_closed_form_alpha_of_the_other_folds(balance):
    rng = np.random.default_rng(3)
    deltas = _random_deltas(rng)
    grams = [np.stack([task_gram([torch.from_numpy(d) for d in sample]).numpy() for sample in stack])
             for stack in deltas]
    folds = [np.arange(len(stack)) % 3 for stack in deltas]
    for fold in (0, 1, 2, -1):
        got = fold_alphas(grams, folds, fold, balance=balance)
        np.testing.assert_allclose(got, _weighted_least_squares_alpha(deltas, folds, fold, balance), rtol=1e-9)
    # the held-out fold's samples do not enter: change them arbitrarily, α stays
    changed = [g.copy() for g in grams]
    for g, f in zip(changed, folds):
        g[f == 1] *= 7.0
        g[f == 1] += np.eye(3)
    np.testing.assert_array_equal(fold_alphas(changed, folds, 1, balance=balance),
                                  fold_alphas(grams, folds, 1, balance=balance))
    assert not np.allclose(fold_alphas(changed, folds, 0, balance=balance),
                           fold_alphas(grams, folds, 0, balance=balance))


def test_fold_alphas_known_answer_and_empty_fold():
    # input-specific orthogonal deltas: δ_t(x) = 0 for x outside H_t → α = 1 for every task, on any fold
    deltas = []
    for a in range(2):
        stack = np.zeros((4, 2, 3))
        stack[:, a, a] = np.arange(1.0, 5.0)
        deltas.append(stack)
    grams = [np.stack([task_gram([torch.from_numpy(d) for d in s]).numpy() for s in stack]) for stack in deltas]
    folds = [np.array([0, 1, 0, 1]), np.array([0, 1, 0, 1])]
    for fold in (0, 1, -1):
        np.testing.assert_allclose(fold_alphas(grams, folds, fold), [1.0, 1.0])
    with pytest.raises(EvidenceError, match="fold 0 leaves no fit record"):
        fold_alphas(grams, [np.zeros(4, dtype=int), folds[1]], 0)


# ----------------------------------------------------------------------- interference marks and steering

MATRICES = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.up_proj.weight",
            "model.layers.1.input_layernorm.weight", "model.layers.0.mlp.gate_proj.weight"]


def _interference(sti, sar) -> xr.Dataset:
    return xr.Dataset({"sti_normalized": (("matrix",), np.array(sti, dtype=float)),
                       "sar": (("matrix", "task"), np.array(sar, dtype=float))},
                      coords={"matrix": MATRICES, "task": ["a", "b"]})


HAND_MADE = _interference(
    sti=[5.0, 1.0, 3.0, 4.0, 9.0, math.nan],
    sar=[[0.9, 0.9], [0.2, 0.6], [0.5, 0.5], [0.1, 0.3], [0.1, 0.1], [math.nan, math.nan]],
)


def test_interference_marks_exactly_the_matrices_over_the_thresholds():
    marks = interference_marks(HAND_MADE)
    assert marks == {
        MATRICES[0]: "STI/Σσ 5 > 3.0",
        MATRICES[1]: "mean SAR 0.4 < 0.5",
        MATRICES[3]: "STI/Σσ 4 > 3.0; mean SAR 0.2 < 0.5",
        MATRICES[4]: "STI/Σσ 9 > 3.0; mean SAR 0.1 < 0.5",
    }  # 3.0 and 0.5 exactly are not over the thresholds; NaN never marks
    assert set(interference_marks(HAND_MADE, sti_max=4.5, sar_min=0.0)) == {MATRICES[0], MATRICES[4]}
    assert interference_marks(HAND_MADE, sti_max=math.inf, sar_min=0.15) == {
        MATRICES[4]: "mean SAR 0.1 < 0.15"}
    assert interference_marks(None) == {}


def _info(name: str, layer: int, level: str, kind: str = "matrix") -> TensorInfo:
    return TensorInfo(name=name, parameter=name, module=name, layer=layer, level=level, kind=kind, shape=(4, 4))


INFOS = [_info(MATRICES[0], 0, "attn"), _info(MATRICES[1], 0, "mlp"), _info(MATRICES[2], 1, "attn"),
         _info(MATRICES[3], 1, "mlp"), _info(MATRICES[4], 1, "norm", "norm"), _info(MATRICES[5], 0, "mlp"),
         _info("model.embed_tokens.weight", -1, "embed", "embedding")]
ALPHA = {"layers.0.attn": {"a": 0.2, "b": 0.6}, "layers.0.mlp": {"a": 1.0, "b": 0.5}, "layers.1": {"a": 0.3, "b": 0.9}}


def _per_layer_plan() -> Plan:
    return Plan(base_model="/models/base", finetuned={"a": "/models/a", "b": "/models/b"}, granularity=PER_LAYER,
                alpha={k: dict(v) for k, v in ALPHA.items()}, layer_granularity={0: "attn-mlp", 1: "layer"})


def test_steer_gives_marked_matrices_the_method_at_their_units_mean_alpha():
    plan = steer(_per_layer_plan(), INFOS, interference_marks(HAND_MADE))
    # the norm is marked but is not a matrix; q_proj, down_proj, up_proj are steered, the rest keeps α
    assert set(plan.matrix_rules) == {MATRICES[0], MATRICES[1], MATRICES[3]}
    assert plan.matrix_rules[MATRICES[0]] == {"method": "tsv-m", "options": {"scaling": pytest.approx(0.4)},
                                             "reason": "STI/Σσ 5 > 3.0"}
    assert plan.matrix_rules[MATRICES[1]]["options"]["scaling"] == pytest.approx(0.75)  # layers.0.mlp
    assert plan.matrix_rules[MATRICES[3]]["options"]["scaling"] == pytest.approx(0.6)  # layers.1 (layer level)
    assert plan.matrix_rules[MATRICES[3]]["reason"] == "STI/Σσ 4 > 3.0; mean SAR 0.2 < 0.5"
    by_name = {i.name: i for i in INFOS}
    assert plan.rule_for(by_name[MATRICES[0]]).method == "tsv-m"
    assert plan.rule_for(by_name[MATRICES[2]]).weights == ALPHA["layers.1"]
    assert plan.rule_for(by_name[MATRICES[5]]).weights == ALPHA["layers.0.mlp"]
    assert plan.rule_for(by_name[MATRICES[4]]).weights == ALPHA["layers.1"]  # norm of a layer-level block
    assert plan.rule_for(by_name["model.embed_tokens.weight"]).weights == {"a": 0.5, "b": 0.5}  # rest
    # steering again (e.g. with Iso-C) replaces the rules, scaling still from α (not from the old rule)
    again = steer(plan, INFOS, interference_marks(HAND_MADE), "iso-c")
    assert {r["method"] for r in again.matrix_rules.values()} == {"iso-c"}
    assert again.matrix_rules[MATRICES[0]]["options"]["scaling"] == pytest.approx(0.4)
    with pytest.raises(PlanError, match="unknown steering method"):
        steer(plan, INFOS, {}, "ties")


def test_steered_matrices_are_the_most_colliding_share_of_the_block_matrices():
    from submerge.merge.plan import interference_ranking, steered_matrices

    ranking = interference_ranking(HAND_MADE)  # STI/Σσ 9, 5, 4, 3, 1, then NaN
    assert ranking == [MATRICES[i] for i in (4, 0, 3, 2, 1, 5)]
    # block matrices only (not the norm, not the embedding), in ranking order: q_proj, up_proj, o_proj, down, gate
    assert steered_matrices(INFOS, 0.0, ranking) == frozenset()
    assert steered_matrices(INFOS, 0.2, ranking) == {MATRICES[0]}  # ⌈0.2 · 5⌉ = 1
    assert steered_matrices(INFOS, 0.5, ranking) == {MATRICES[0], MATRICES[3], MATRICES[2]}  # ⌈2.5⌉ = 3
    assert steered_matrices(INFOS, 1.0, ranking) == {MATRICES[i] for i in (0, 1, 2, 3, 5)}
    assert steered_matrices(INFOS, 1.0, None) == steered_matrices(INFOS, 1.0, ranking)  # all need no ranking
    assert steered_matrices(INFOS, 0.0, None) == frozenset()
    with pytest.raises(PlanError, match="ranks them by interference"):
        steered_matrices(INFOS, 0.5, None)
    with pytest.raises(PlanError, match="within 0 … 1"):
        steered_matrices(INFOS, 1.5, ranking)


def test_steered_parts_add_up_to_the_plan_with_its_steered_matrices_by_the_method():
    """rest + μ·steered is the plan's α-weighted sum on every tensor but the steered matrices, and Iso-C at
    scaling μ on those (known answer from the strategy itself)."""
    from submerge.merge.plan import SteeredPart, rule_delta
    from submerge.merge.strategies import iso_c

    plan, steered = _per_layer_plan(), frozenset({MATRICES[0], MATRICES[3]})
    rest, moved = (SteeredPart(plan, steered, "iso-c", part) for part in ("rest", "steered"))
    generator = torch.Generator().manual_seed(0)
    tasks, mu = list(plan.finetuned), 1.7
    for info in INFOS:
        vectors = [torch.randn(4, 4, generator=generator, dtype=torch.float64) for _ in tasks]
        total = rule_delta(rest(info), info, vectors, tasks) + mu * rule_delta(moved(info), info, vectors, tasks)
        if info.name in steered:
            expected = iso_c(vectors, scaling=mu)
            assert rest(info).weights == {"a": 0.0, "b": 0.0}
        else:
            expected = rule_delta(plan.rule_for(info), info, vectors, tasks)
            assert moved(info).weights == {"a": 0.0, "b": 0.0}
        torch.testing.assert_close(total, expected, rtol=1e-12, atol=1e-12)


def test_tuned_plan_scales_every_weight_and_rule_and_steers_at_its_own_scale():
    from submerge.merge.plan import block_rule, tuned_plan

    plan = steer(_per_layer_plan(), INFOS, {MATRICES[1]: "test"}, "iso-c")  # down_proj at scaling 0.75 (its α)
    plan.matrix_rules[MATRICES[2]] = block_rule("ties", 1)  # a block rule at the strategy's default scaling
    tuned = tuned_plan(plan, 2.0, steered=frozenset({MATRICES[0]}), steer_method="iso-c", steer_scale=1.5,
                       record={"λ": 2.0, "steer_share": 0.5, "steer_scale": 1.5})
    by_name = {i.name: i for i in INFOS}
    assert tuned.alpha == {u: {t: 2 * w for t, w in v.items()} for u, v in ALPHA.items()}
    assert tuned.rule_for(by_name["model.embed_tokens.weight"]).weights == {"a": 1.0, "b": 1.0}  # 2 · ½
    assert tuned.matrix_rules[MATRICES[0]]["method"] == "iso-c"
    assert tuned.matrix_rules[MATRICES[0]]["options"] == {"scaling": 1.5}  # μ, not times λ
    assert tuned.matrix_rules[MATRICES[1]]["options"] == {"scaling": pytest.approx(1.5)}  # 2 · 0.75
    from submerge.merge.strategies import STRATEGIES

    assert tuned.matrix_rules[MATRICES[2]]["options"] == {"scaling": 2 * STRATEGIES["ties"].options["scaling"]}
    assert tuned.decision["tuned"] == {"λ": 2.0, "steer_share": 0.5, "steer_scale": 1.5}
    assert plan.alpha == ALPHA and MATRICES[0] not in plan.matrix_rules  # the plan itself is unchanged
    for method in ("star", "weight-average"):  # strategies whose paper has no λ take one (1: the paper's merge)
        plan.matrix_rules[MATRICES[3]] = block_rule(method, 1)
        assert tuned_plan(plan, 2.0).matrix_rules[MATRICES[3]]["options"]["scaling"] == 2.0


def test_with_rest_gives_the_tensors_outside_the_blocks_the_mean_or_the_sum():
    """The evidence plan's rest rules (`PLAN_RESTS`): the embedding, final norm and head get weights 1/T (the mean
    task vector) or 1 (Σ_t τ_t); the blocks keep their α; an unknown name is refused."""
    from submerge.merge.plan import PLAN_RESTS, tuned_plan, with_rest

    plan, by_name = _per_layer_plan(), {i.name: i for i in INFOS}
    outside = [i for i in INFOS if i.layer < 0]
    assert outside and PLAN_RESTS == ("mean", "sum")
    for rest, weight in (("mean", 0.5), ("sum", 1.0)):
        changed = with_rest(plan, rest)
        for info in INFOS:
            rule = changed.rule_for(info)
            if info.layer < 0:
                assert rule.weights == {"a": weight, "b": weight}
            else:
                assert rule == plan.rule_for(info)
        assert tuned_plan(changed, 1.5).rule_for(by_name[outside[0].name]).weights == {"a": 1.5 * weight,
                                                                                        "b": 1.5 * weight}
    assert plan.rest == {"method": "mean-task-vector"}  # the plan itself is unchanged
    with pytest.raises(PlanError, match="unknown rest rule 'median'"):
        with_rest(plan, "median")


def test_plan_yaml_round_trip_keeps_layer_granularity_rules_and_reasons(tmp_path):
    plan = steer(_per_layer_plan(), INFOS, interference_marks(HAND_MADE))
    plan.decision = {"choose": "evidence", "layers": {0: {"granularity": "attn-mlp", "reason": "attn-mlp: lower"}},
                     "steered": {n: r["reason"] for n, r in plan.matrix_rules.items()}}
    path = plan.save(tmp_path / "plan.yaml")
    text = path.read_text()
    assert "STI/Σσ 5 > 3.0" in text and "mean SAR 0.4 < 0.5" in text and "layer_granularity" in text
    loaded = Plan.load(path)
    assert loaded == plan
    assert loaded.layer_granularity == {0: "attn-mlp", 1: "layer"}
    assert loaded.granularity_of(0) == "attn-mlp" and loaded.granularity_of(1) == "layer"
    for info in INFOS:
        assert loaded.rule_for(info) == plan.rule_for(info)
    # a per-layer plan without a block's granularity is refused, not silently merged as "rest"
    loaded.layer_granularity = {0: "attn-mlp"}
    with pytest.raises(PlanError, match="no granularity for layer 1"):
        loaded.rule_for(INFOS[2])


# ----------------------------------------------------------------------- the evidence choice, known by construction
#
# A tiny Llama (2 blocks, hidden 32) whose embedding puts the bytes of task A's texts in dimensions 0..15 and
# those of task B's texts in dimensions 16..31 (texts of one length: no padding, no special tokens). Block 0's
# inputs on task A records then have no component in 16..31 and vice versa (RMSNorm keeps the support).
# Hand-made fine-tunes change block 0 only:
#   - attention: task A adds a random update to the v_proj columns 0..15, task B to the columns 16..31, so each
#     attention update acts on its own task's records only (exactly 0 on the other task's): the attention α is
#     (1, 1);
#   - MLP: both tasks add the same update F to down_proj, so only α_A + α_B = 1 fits the MLP (minimum norm:
#     (0.5, 0.5)).
# One α per task for the whole block cannot be both; α per attention and MLP reproduces each fine-tune's block 0
# on its own records exactly. So block 0 must choose attn-mlp with a far lower (≈ 0) held-out objective, while
# block 1, which no fine-tune changed, ties at 0 and keeps the coarsest candidate, layer.

HAND_TASKS = {"left": "abcdefgh", "right": "qrstuvwx"}
HAND_FIT = 8


@pytest.fixture(scope="module")
def hand_kit(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from submerge.diagnostics import toy

    root = tmp_path_factory.mktemp("evidence")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = toy.build_model(root / "base", "llama", layers=2, hidden=32, heads=4, kv_heads=2)
    tokenizer = toy.byte_tokenizer()
    generator = torch.Generator().manual_seed(5)
    weights = load_file(str(base / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    for offset, letters in zip((0, 16), HAND_TASKS.values()):
        for token in tokenizer(letters)["input_ids"]:
            embed[token] = 0.0
            embed[token, offset:offset + 16] = torch.randn(16, generator=generator)
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    shared = 1.5 * torch.randn(weights["model.layers.0.mlp.down_proj.weight"].shape, generator=generator)
    finetuned, data = {}, {}
    for offset, (task, letters) in zip((0, 16), HAND_TASKS.items()):
        tuned = {name: value.clone() for name, value in weights.items()}
        v_proj = tuned["model.layers.0.self_attn.v_proj.weight"]
        v_proj[:, offset:offset + 16] += 0.2 * torch.randn(v_proj.shape[0], 16, generator=generator)
        tuned["model.layers.0.mlp.down_proj.weight"] += shared
        folder = root / task
        folder.mkdir()
        save_file(tuned, str(folder / "model.safetensors"), metadata={"format": "pt"})
        for file in base.iterdir():
            if file.name != "model.safetensors":
                (folder / file.name).write_bytes(file.read_bytes())
        rng = np.random.default_rng(len(letters) + offset)
        path = root / f"{task}.jsonl"
        path.write_text("".join(json.dumps({"text": "".join(rng.choice(list(letters), 12))}) + "\n"
                                for _ in range(2 * HAND_FIT)))
        finetuned[task], data[task] = str(folder), str(path)
    return str(base), finetuned, data


def _hand_experiment(hand_kit, skip: int):
    from submerge.diagnostics.experiment import Experiment

    base, finetuned, data = hand_kit
    return Experiment.load(base, finetuned, data, samples=HAND_FIT, skip=skip, max_tokens=48, batch_size=4,
                           dtype="float32", device="cpu")


def test_evidence_chooses_attn_mlp_only_where_attention_and_mlp_want_different_alpha(hand_kit, tmp_path):
    from submerge.merge.plan import block_objectives, evidence_plan

    fit = _hand_experiment(hand_kit, skip=0)
    evidence = evidence_plan(fit, hand_kit[1], candidates=("layer", "attn-mlp"), progress=False)
    plan = evidence.plan()
    assert plan.granularity == PER_LAYER
    assert plan.layer_granularity == {0: "attn-mlp", 1: "layer"}
    # the α the construction implies (solved on all fit records)
    np.testing.assert_allclose(list(plan.alpha["layers.0.attn"].values()), [1.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(list(plan.alpha["layers.0.mlp"].values()), [0.5, 0.5], atol=1e-6)
    layer_alpha = evidence.single("layer").alpha["layers.0"]
    assert all(0.55 < a < 0.95 for a in layer_alpha.values()), layer_alpha  # a compromise between 1 and 0.5
    cv = evidence.layers[0].cv_objective
    assert cv["attn-mlp"] < 1e-6 * cv["layer"] and cv["layer"] > 1e-3
    assert evidence.layers[1].cv_objective == {"layer": 0.0, "attn-mlp": 0.0}
    # out of sample: the evidence plan lowers block 0's objective on held-out records and ties elsewhere
    held = _hand_experiment(hand_kit, skip=HAND_FIT)
    chosen = block_objectives(held, plan)
    single = block_objectives(held, evidence.single("layer"))
    assert chosen[0] < 1e-6 * single[0] and single[0] > 1e-3
    assert chosen[1] == single[1] == 0.0
    assert sum(chosen.values()) < sum(single.values())
    # each choice and its reason are in the plan YAML
    loaded = Plan.load(plan.save(tmp_path / "plan.yaml"))
    assert loaded.layer_granularity == {0: "attn-mlp", 1: "layer"}
    reasons = {layer: entry["reason"] for layer, entry in loaded.decision["layers"].items()}
    assert reasons[0].startswith("attn-mlp: held-out Eq. 10 objective") and reasons[1].startswith("layer:")
    assert loaded.decision["choose"] == "evidence" and loaded.decision["folds"] == 4


# ----------------------------------------------------------------------- compare end to end

TASKS = ("math", "code")
FIT = 4  # records 0..3 of each task file fit α, λ and the evidence plan; records 4..7 are held out
METHODS = ["task-arithmetic", "ties", "task-arithmetic-tuned", "closed-form-layer", "plan"]
LAMBDAS = (0.2, 0.6, 1.0)
RUN = {"fit": FIT, "samples": FIT, "max_tokens": 48, "batch_size": 4, "lambdas": LAMBDAS,
       "evidence_options": {"folds": 2}, "dtype": "float32", "device": "cpu", "progress": False, "tune": None}


class Killed(Exception):
    """Stands for the process being killed between two methods."""


@pytest.fixture(scope="module")
def trained_kit(tmp_path_factory):
    """A tiny Llama 'pre-trained' on mixed text and fine-tuned on two tasks (real gradient updates)."""
    from submerge.diagnostics import toy

    root = tmp_path_factory.mktemp("compare")
    base, finetuned, data = toy.trained_kit(root, TASKS, records=2 * FIT)
    return root, base, finetuned, data


@pytest.fixture(scope="module")
def compared(trained_kit):
    """One full `compare` into a store, temporary files redirected to a folder we can inspect."""
    from submerge.diagnostics.store import Store
    from submerge.merge.compare import compare

    root, base, finetuned, data = trained_kit
    scratch = root / "scratch"
    scratch.mkdir()
    on_disk = {}  # method → checkpoints on disk when its result is written

    def look(label):  # merged checkpoints on disk; the block objectives' shared replays are counted apart
        found = sorted(str(p.relative_to(scratch)) for p in scratch.rglob("*.safetensors"))
        on_disk[label] = [p for p in found if "/block-targets/" not in p]
        on_disk.setdefault("block-targets", set()).update(p for p in found if "/block-targets/" in p)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tempfile.tempdir", str(scratch))
        dataset = compare(base, finetuned, data, methods=METHODS, store=Store(root / "store.zarr"), on_unit=look,
                          **RUN)
    dataset.attrs["test_shared_replays"] = sorted(p.rsplit("/", 1)[1] for p in on_disk.pop("block-targets", ()))
    dataset.attrs["test_on_disk"] = on_disk
    return dataset, root / "store.zarr", scratch


def _experiment(trained_kit, skip: int):
    from submerge.diagnostics.experiment import Experiment

    _, base, finetuned, data = trained_kit
    return Experiment.load(base, finetuned, data, samples=FIT, skip=skip, max_tokens=48, batch_size=4,
                           dtype="float32", device="cpu")


@torch.no_grad()
def _losses_of(experiment, state: dict[str, torch.Tensor]) -> np.ndarray:
    """Mean loss per task of the model with parameters `state` (parameter name → tensor)."""
    from submerge.diagnostics.evaluate import task_loss

    model = experiment.base.model
    for name, parameter in model.named_parameters():
        parameter.copy_(state[name])
    return np.array([task_loss(model, experiment.batches[t])[0] for t in experiment.tasks])


def _task_sum_state(trained_kit, experiment, scale: float) -> dict[str, torch.Tensor]:
    """θ0 + scale · Σ_t τ_t from the checkpoint files (parameter names of the model)."""
    from safetensors.torch import load_file

    _, base, finetuned, _ = trained_kit
    base_weights = load_file(str(Path(base) / "model.safetensors"))
    tuned = [load_file(str(Path(finetuned[t]) / "model.safetensors")) for t in experiment.tasks]
    state = {}
    for name, _ in experiment.base.model.named_parameters():
        key = experiment.base.checkpoint_name(name)
        state[name] = base_weights[key] + scale * sum(w[key] - base_weights[key] for w in tuned)
    return state


def test_compare_group_dims_and_reference_gains(compared):
    from submerge.diagnostics.store import Store

    dataset, store_path, _ = compared
    labels = ["base", "finetuned:math", "finetuned:code", *METHODS]
    assert list(dataset.method.values) == labels
    assert list(dataset.task.values) == list(TASKS)
    assert dataset.loss.dims == dataset.gain.dims == ("unit", "task")
    assert dataset.mean_gain.dims == dataset.seconds.dims == dataset.fit_loss.dims == ("unit",)
    assert list(dataset.unit.values) == [f"math+code|0|{label}" for label in labels]
    assert set(dataset.subset.values) == {"math+code"} and set(dataset.seed.values) == {0}
    assert list(dataset.kind.values) == ["base", "finetune", "finetune", "strategy", "strategy", "strategy",
                                         "closed-form", "plan"]
    stored = Store(store_path).dataset("compare")
    assert list(stored.method.values) == labels
    np.testing.assert_array_equal(stored.loss.values, dataset.loss.values)
    assert Store(store_path).is_complete("compare")
    assert np.isfinite(dataset.loss.values).all()
    # every fine-tune learned its task (else the gain would be NaN by design)
    base_loss = dataset.loss.sel({"method": "base"}).values
    for task in TASKS:
        assert dataset.loss.sel({"method": f"finetuned:{task}", "task": task}) < base_loss[TASKS.index(task)]
        assert float(dataset.gain.sel({"method": f"finetuned:{task}", "task": task})) == 1.0
    assert (dataset.gain.sel({"method": "base"}).values == 0.0).all()
    np.testing.assert_allclose(dataset.gain.values, normalised_gain(
        base_loss, dataset.loss.values,
        [float(dataset.loss.sel({"method": f"finetuned:{t}", "task": t})) for t in TASKS]))
    np.testing.assert_allclose(dataset.mean_gain.values, np.nanmean(dataset.gain.values, axis=1))
    assert dataset.attrs["base_loss"] == pytest.approx(dict(zip(TASKS, base_loss)))


def test_compare_losses_are_on_held_out_records(compared, trained_kit):
    dataset, _, _ = compared
    held = _experiment(trained_kit, skip=FIT)
    np.testing.assert_allclose(_losses_of(held, _task_sum_state(trained_kit, held, 0.0)),
                               dataset.loss.sel({"method": "base"}).values, rtol=1e-5)
    np.testing.assert_allclose(_losses_of(held, _task_sum_state(trained_kit, held, 1.0)),
                               dataset.loss.sel({"method": "task-arithmetic"}).values, rtol=1e-5)  # scaling 1 default


def test_tuned_lambda_is_the_argmin_of_the_fit_loss(compared, trained_kit):
    """The criterion is the fit records' mean normalised gain (`tune_by="gain"`, the default): each task's fit loss
    weighted by 1 / its fine-tune's gain there, the references measured here from the checkpoint files."""
    dataset, store_path, _ = compared
    from safetensors.torch import load_file

    from submerge.diagnostics.store import Store

    attrs = Store(store_path).group_attrs("compare")
    search = attrs["lambda_search"]
    assert set(search) == {"0.2", "0.6", "1"}
    fit = _experiment(trained_kit, skip=0)
    _, base, finetuned, _ = trained_kit
    names = {name: fit.base.checkpoint_name(name) for name, _ in fit.base.model.named_parameters()}
    base_loss = _losses_of(fit, {n: load_file(str(Path(base) / "model.safetensors"))[k] for n, k in names.items()})
    own_loss = [_losses_of(fit, {n: load_file(str(Path(finetuned[t]) / "model.safetensors"))[k]
                                 for n, k in names.items()})[i] for i, t in enumerate(fit.tasks)]
    assert attrs["fit_references 0"]["base"] == pytest.approx(dict(zip(fit.tasks, base_loss)), rel=1e-5)
    assert attrs["fit_references 0"]["finetuned"] == pytest.approx(dict(zip(fit.tasks, own_loss)), rel=1e-5)
    inverse = 1 / (base_loss - np.array(own_loss))
    weights = inverse / inverse.sum()
    assert list(attrs[f"fit_weights {'+'.join(TASKS)}|0"].values()) == pytest.approx(list(weights), rel=1e-5)
    assert not np.allclose(weights, 0.5)  # the two fine-tunes gain unequally: not the plain mean in disguise
    independent = {value: float(weights @ _losses_of(fit, _task_sum_state(trained_kit, fit, value)))
                   for value in LAMBDAS}
    for value in LAMBDAS:
        assert search[f"{value:g}"] == pytest.approx(independent[value], rel=1e-5)
    best = min(independent, key=independent.get)
    assert str(dataset.detail.sel({"method": "task-arithmetic-tuned"}).values).startswith(f"λ = {best:g} ")
    held = _experiment(trained_kit, skip=FIT)
    np.testing.assert_allclose(_losses_of(held, _task_sum_state(trained_kit, held, best)),
                               dataset.loss.sel({"method": "task-arithmetic-tuned"}).values, rtol=1e-5)


def test_compare_leaves_nothing_on_disk_without_keep(compared):
    dataset, store_path, scratch = compared
    # streaming: each merged checkpoint is deleted once evaluated, before the next method is merged
    assert dataset.attrs["test_on_disk"] == {unit: [] for unit in dataset.unit.values}
    # the fine-tunes' block outputs shared by every merge's objective: one file per block, gone with the scratch
    assert dataset.attrs["test_shared_replays"] == ["layer-0.safetensors", "layer-1.safetensors"]
    assert list(scratch.iterdir()) == []  # every merged checkpoint (and the Σ τ of the λ search) deleted
    assert not (store_path.parent / "keep").exists()


def _counting(monkeypatch) -> dict[str, list]:
    """Count merged checkpoints written (by label), evidence choices and reference evaluations."""
    from submerge.merge import compare as module

    calls: dict[str, list] = {"written": [], "evidence": [], "loaded": []}
    write_merges, choose, load = module.write_merges, module.evidence_plan, module._Evaluator.load

    def counted_write(base, finetuned, outputs, *args, **kwargs):
        calls["written"].extend(Path(directory).name for directory, _, _ in outputs)
        return write_merges(base, finetuned, outputs, *args, **kwargs)

    def counted_choose(*args, **kwargs):
        calls["evidence"].append(1)
        return choose(*args, **kwargs)

    def counted_load(self, spec):
        calls["loaded"].append(spec)
        return load(self, spec)

    monkeypatch.setattr(module, "write_merges", counted_write)  # the name compare calls
    monkeypatch.setattr(module, "evidence_plan", counted_choose)
    monkeypatch.setattr(module._Evaluator, "load", counted_load)
    return calls


def _units(*methods, subset: str = "math+code", seed: int = 0) -> list[str]:
    """The store's unit labels of `methods` (one subset and seed)."""
    return [f"{subset}|{seed}|{method}" for method in methods]


def test_killed_compare_resumes_after_the_last_finished_method(compared, trained_kit, tmp_path, monkeypatch):
    from submerge.diagnostics.store import Store
    from submerge.merge.compare import compare

    _, base, finetuned, data = trained_kit
    store = Store(tmp_path / "store.zarr")
    seen = []

    def kill_after_tuned(label):
        seen.append(label)
        if label.endswith("|task-arithmetic-tuned"):
            raise Killed(label)

    with pytest.raises(Killed):
        compare(base, finetuned, data, methods=METHODS, store=store, on_unit=kill_after_tuned, **RUN)
    assert seen == _units("base", "finetuned:math", "finetuned:code", "task-arithmetic", "ties", "task-arithmetic-tuned")
    assert not store.is_complete("compare")
    calls = _counting(monkeypatch)
    seen.clear()
    resumed = compare(base, finetuned, data, methods=METHODS, store=Store(tmp_path / "store.zarr"),
                      on_unit=seen.append, **RUN)
    assert seen == _units("closed-form-layer", "plan")  # only the methods not finished
    assert calls["written"] == ["closed-form-layer", "plan"]  # no λ search again
    assert calls["evidence"] == [1]
    assert not any(spec in finetuned.values() for spec in calls["loaded"])  # references read from the store
    full = compared[0]
    assert list(resumed.method.values) == list(full.method.values)
    np.testing.assert_allclose(resumed.loss.values, full.loss.values, rtol=1e-6)
    np.testing.assert_allclose(resumed.gain.values, full.gain.values, rtol=1e-6, atol=1e-9)
    assert Store(tmp_path / "store.zarr").is_complete("compare")
    # the λ search of the killed run is kept in the group's attrs (and in the result)
    search = Store(compared[1]).group_attrs("compare")["lambda_search"]
    assert Store(tmp_path / "store.zarr").group_attrs("compare")["lambda_search"] == pytest.approx(search)
    assert resumed.attrs["lambda_search"] == pytest.approx(search)
    # a finished comparison run again computes nothing
    for values in calls.values():
        values.clear()
    with pytest.warns(UserWarning, match="compared by an earlier run.*not written"):
        again = compare(base, finetuned, data, methods=METHODS, store=Store(tmp_path / "store.zarr"),
                        plan_out=tmp_path / "again.yaml", **RUN)
    assert calls["written"] == [] and calls["evidence"] == []
    assert not (tmp_path / "again.yaml").exists()
    np.testing.assert_array_equal(again.loss.values, resumed.loss.values)


def test_a_run_with_other_methods_adds_them_to_the_stores_comparison(compared, trained_kit, tmp_path, monkeypatch):
    from submerge.diagnostics.store import Store, StoreError
    from submerge.merge.compare import CompareError, compare

    _, base, finetuned, data = trained_kit
    path = tmp_path / "store.zarr"
    compare(base, finetuned, data, methods=["ties", "task-arithmetic"], store=Store(path), **RUN)
    calls, seen = _counting(monkeypatch), []

    def kill_after_closed_form(label):
        seen.append(label)
        if label.endswith("|closed-form-layer"):
            raise Killed(label)

    with pytest.raises(Killed):  # the store's board grows: it is incomplete until the new methods are in
        compare(base, finetuned, data, methods=["task-arithmetic", "closed-form-layer", "plan"], store=Store(path),
                on_unit=kill_after_closed_form, **RUN)
    assert seen == _units("closed-form-layer")  # the references and the methods it has are not run again
    assert not Store(path).is_complete("compare")
    seen.clear()
    grown = compare(base, finetuned, data, methods=["plan"], store=Store(path), on_unit=seen.append, **RUN)
    assert seen == _units("plan")
    assert calls["written"] == ["closed-form-layer", "plan"]
    assert Store(path).is_complete("compare")
    assert Store(path).group_attrs("compare")["settings"]["methods"] == [
        "ties", "task-arithmetic", "closed-form-layer", "plan"]
    assert list(grown.method.values) == ["base", "finetuned:math", "finetuned:code", "ties", "task-arithmetic",
                                         "closed-form-layer", "plan"]
    full = compared[0]  # one run of all of them: the same numbers
    rows = {str(method): row for method, row in zip(full.method.values, full.loss.values)}
    np.testing.assert_allclose(grown.loss.values, [rows[str(m)] for m in grown.method.values], rtol=1e-6)
    # any other setting changed is refused as before, naming it; a method it has keeps its options
    with pytest.raises(StoreError, match="lambdas"):
        compare(base, finetuned, data, methods=["weight-average"], store=Store(path), **{**RUN, "lambdas": (0.5,)})
    with pytest.raises(CompareError, match="compared 'ties' with options {}, this run gives {'top_k': 0.5}"):
        compare(base, finetuned, data, methods=["ties"], store=Store(path), method_options={"ties": {"top_k": 0.5}},
                **RUN)
    assert Store(path).is_complete("compare")
    assert list(Store(path).dataset("compare").method.values) == list(grown.method.values)


def test_a_methods_settings_written_in_one_pass_tune_to_the_same_board_as_written_one_by_one(trained_kit,
                                                                                             tmp_path, monkeypatch):
    """Compare writes the δ of a method's settings (KnOTS's top-k, CART's rank ratio) in one pass where they fit
    `TOGETHER_BYTES`, and one after another where they do not (the budget lowered to 0): the same searched fit losses,
    choices and held-out losses to the last bit, in one write per method instead of one per setting."""
    from submerge.diagnostics.store import Store
    from submerge.merge import compare as module

    _, base, finetuned, data = trained_kit
    grids = {"knots": {"top_k": (0.2, 0.5), "scaling": (0.6, 1.0)}, "cart": {"rank_ratio": (0.1, 0.3)}}
    run = {**RUN, "methods": ["knots", "cart"], "grids": grids, "objective": False, "lambdas": (0.5, 1.0), "tune": "line"}
    passes = []
    write_merges = module.write_merges

    def counted(base_spec, tuned, outputs, *args, **kwargs):
        passes.append(sorted(Path(directory).name for directory, _, _ in outputs))
        return write_merges(base_spec, tuned, outputs, *args, **kwargs)

    monkeypatch.setattr(module, "write_merges", counted)
    together = module.compare(base, finetuned, data, store=Store(tmp_path / "together.zarr"), **run)
    assert passes == [["knots-candidate-0", "knots-candidate-1"], ["cart-candidate-0", "cart-candidate-1"]]
    passes.clear()
    monkeypatch.setattr(module, "TOGETHER_BYTES", 0)
    apart = module.compare(base, finetuned, data, store=Store(tmp_path / "apart.zarr"), **run)
    assert passes == [[f"{method}-candidate-{index}"] for method in ("knots", "cart") for index in (0, 1)]
    assert np.array_equal(together.loss.values, apart.loss.values)
    assert np.array_equal(together.hyperparameters.values, apart.hyperparameters.values)
    for unit in together.unit.values:
        if f"search {unit}" in together.attrs:
            assert together.attrs[f"search {unit}"] == apart.attrs[f"search {unit}"]


def test_compare_keep_leaves_loadable_checkpoints(compared, trained_kit, tmp_path):
    import transformers
    from safetensors.torch import load_file

    from submerge.diagnostics.capture import input_gram_matrices
    from submerge.merge.compare import compare
    from submerge.merge.rules import regmean_rule
    from submerge.merge.writer import write_merge

    _, base, finetuned, data = trained_kit
    kept = compare(base, finetuned, data, methods=["ties", "plan", "regmean"], keep=tmp_path / "keep", **RUN)
    assert sorted(p.name for p in (tmp_path / "keep").iterdir()) == ["plan", "regmean", "ties"]
    held = _experiment(trained_kit, skip=FIT)
    for method in ("ties", "plan", "regmean"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "keep" / method, dtype=torch.float32)
        state = {name: p.detach() for name, p in model.named_parameters()}
        np.testing.assert_allclose(_losses_of(held, state), kept.loss.sel({"method": method}).values, rtol=1e-5)
        if method != "regmean":  # the same merge as in the run without keep
            np.testing.assert_allclose(kept.loss.sel({"method": method}).values,
                                       compared[0].loss.sel({"method": method}).values, rtol=1e-6)
    # RegMean's Grams, computed block by block during the write, are those of one pass on the fit records (regrouped
    # by length, as every Gram of the fit records is: a sum over tokens)
    fit = _experiment(trained_kit, skip=0)
    whole = {t: input_gram_matrices(fit.base.model, fit.arch, fit.regrouped().batches[t]) for t in fit.tasks}
    linear = set(whole[fit.tasks[0]])
    one_pass = write_merge(base, finetuned, tmp_path / "regmean-one-pass", regmean_rule({}, linear), progress=False,
                           gram_matrices=lambda name: [whole[t][name] for t in fit.tasks] if name in linear else None)
    expected, got = load_file(one_pass / "model.safetensors"), load_file(tmp_path / "keep" / "regmean" /
                                                                         "model.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_compare_keep_and_plan_out_never_delete_what_the_user_owns(trained_kit, tmp_path):
    """Issue 26: `--keep DIR` deleted what the user had in DIR/<method>/ without --force. Now a user's folder is
    refused before any work, with or without --force; an earlier kept merge is replaced only with --force; a
    killed run's own kept merge is replaced by its resume; `--plan-out` follows the same rule for files."""
    from submerge.diagnostics.outputs import OutputError
    from submerge.diagnostics.store import Store
    from submerge.merge.compare import compare

    _, base, finetuned, data = trained_kit
    keep = tmp_path / "keep"
    (keep / "ties").mkdir(parents=True)
    (keep / "ties" / "notes.txt").write_text("my notes")
    for force in (False, True):
        with pytest.raises(OutputError, match=r"--keep .*ties holds files that are not a submerge merge"
                                              if force else r"keep.*ties exists and is not empty"):
            compare(base, finetuned, data, methods=["ties"], keep=keep, force=force, **RUN)
    assert (keep / "ties" / "notes.txt").read_text() == "my notes"
    mine = tmp_path / "plan.yaml"
    mine.write_text("my own yaml\n")
    for force in (False, True):
        with pytest.raises(OutputError, match="--plan-out"):
            compare(base, finetuned, data, methods=["ties"], plan_out=mine, force=force, **RUN)
    assert mine.read_text() == "my own yaml\n"
    # an earlier kept merge (another run's): refused without --force, replaced with it
    other = tmp_path / "other"
    compare(base, finetuned, data, methods=["ties"], keep=other, **RUN)
    with pytest.raises(OutputError, match="exists and is not empty"):
        compare(base, finetuned, data, methods=["ties"], keep=other, **RUN)
    compare(base, finetuned, data, methods=["ties"], keep=other, force=True, **RUN)
    # a run killed after writing a kept merge, before the store took it: the resume replaces it, no --force
    class Killed(Exception):
        pass

    store = Store(tmp_path / "store.zarr")
    resumed_keep = tmp_path / "resumed"
    import submerge.merge.compare as compare_module

    original = compare_module._piece

    def killed_piece(label, *args, **kwargs):
        if label.endswith("|ties"):
            raise Killed
        return original(label, *args, **kwargs)

    compare_module._piece = killed_piece
    try:
        with pytest.raises(Killed):
            compare(base, finetuned, data, methods=["ties"], keep=resumed_keep, store=store, **RUN)
    finally:
        compare_module._piece = original
    assert (resumed_keep / "ties" / "submerge_merge.yaml").is_file()
    result = compare(base, finetuned, data, methods=["ties"], keep=resumed_keep, store=Store(tmp_path / "store.zarr"),
                     **RUN)
    assert "ties" in [str(m) for m in result.method.values]


def test_compare_takes_its_settings_as_objects_or_keywords_not_both_and_runs_here_in_float32(tmp_path):
    """`compare` takes load=/run= settings objects or their fields as keywords, like the other drivers; a Ray engine
    or another compute dtype is refused before any model is read (the paths do not exist)."""
    from submerge.diagnostics.base_model import LoadSettings
    from submerge.diagnostics.execution import RayEngine, RunSettings
    from submerge.merge.compare import CompareError, compare

    missing = str(tmp_path / "no-such-model")
    with pytest.raises(TypeError, match="not both"):
        compare(missing, {}, {}, run=RunSettings(), progress=False)
    with pytest.raises(TypeError, match="not both"):
        compare(missing, {}, {}, load=LoadSettings(), device="cpu")
    with pytest.raises(TypeError, match="unknown run setting"):
        compare(missing, {}, {}, stor=None)
    for run in (RunSettings(engine=RayEngine("auto", 2)), RunSettings(compute_dtype="float64")):
        with pytest.raises(CompareError, match="in this process and in float32"):
            compare(missing, {}, {}, run=run)
    assert not list(tmp_path.iterdir())


def test_compare_refuses_unknown_methods_and_overlapping_records(trained_kit, tmp_path):
    from submerge.merge.compare import CompareError, compare

    _, base, finetuned, data = trained_kit
    with pytest.raises(CompareError, match=r"unknown method\(s\) \['task-arithmetc'\].*known: .*task-arithmetic"):
        compare(base, finetuned, data, methods=["task-arithmetc", "ties"], **RUN)
    with pytest.raises(CompareError, match="lists a method twice"):
        compare(base, finetuned, data, methods=["ties", "ties"], **RUN)
    with pytest.raises(CompareError, match="--skip 2 < --fit 4: held-out records would include fit records"):
        compare(base, finetuned, data, methods=["ties"], **{**RUN, "skip": 2})
    other = Plan(base_model=base, finetuned={"math": finetuned["math"]}, granularity="layer", alpha={})
    with pytest.raises(CompareError, match="the plan merges"):
        compare(base, finetuned, data, methods=["plan"], plan=other, **RUN)
    with pytest.raises(CompareError, match="--choose must be evidence or thresholds"):
        compare(base, finetuned, data, methods=["plan"], choose="vibes", **RUN)
    with pytest.raises(CompareError, match="--choose thresholds reads linearity and alpha from the store"):
        compare(base, finetuned, data, methods=["plan"], choose="thresholds", **RUN)
    assert not list(tmp_path.iterdir())


def test_cli_compare_prints_the_leaderboard_and_report_draws_it(trained_kit, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from submerge.cli.main import app
    from submerge.diagnostics.store import Store
    from submerge.merge import compare as compare_module

    _, base, finetuned, data = trained_kit
    store, plan_out = tmp_path / "store.zarr", tmp_path / "plan.yaml"
    # --capture-budget 1e-9 GiB (one byte): the evidence step captures one block per chunk
    arguments = ["compare", "--model", base, "--out", store, "--methods", "ties,closed-form-attn-mlp,plan",
                 "--fit", FIT, "--samples", FIT, "--folds", 2, "--lambdas", "0.5,1", "--max-tokens", 48,
                 "--batch-size", 4, "--dtype", "float32", "--device", "cpu", "--no-progress", "--plan-out", plan_out,
                 "--capture-budget", "1e-9"]
    for task in TASKS:
        arguments += ["--finetuned", f"{task}={finetuned[task]}", "--data", f"{task}={data[task]}"]
    budgets, evidence_plan = [], compare_module.evidence_plan
    monkeypatch.setattr(compare_module, "evidence_plan",
                        lambda *args, run, **keywords: budgets.append(run.capture_budget)
                        or evidence_plan(*args, run=run, **keywords))
    runner = CliRunner()
    result = runner.invoke(app, [str(a) for a in arguments], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert budgets == [1]  # the budget reached the evidence step; it bounds memory, so the store does not record it
    assert "capture_budget" not in Store(store).dataset("compare").attrs["settings"]["evidence"]
    output = " ".join(result.output.split())
    assert "Held-out loss and normalised gain" in output and "Wrote group compare" in output
    printed = result.stdout.split("Wrote group")[0].strip("\n")
    for label in ("base", "finetuned:math", "ties", "closed-form-attn-mlp", "plan", "mean gain"):
        assert label in output, label
    plan = Plan.load(plan_out)
    assert plan.granularity == PER_LAYER and set(plan.layer_granularity) == {0, 1}
    assert all(entry["reason"] for entry in plan.decision["layers"].values())
    # the report draws the leaderboard from the store
    report = runner.invoke(app, ["report", str(store), "--out", str(tmp_path / "figures")], env={"COLUMNS": "400"})
    assert report.exit_code == 0, report.output
    assert printed.count("\n") > len(TASKS) + 4 and printed in report.stdout  # the command's table is the report's
    figure = tmp_path / "figures" / "compare.png"
    assert figure.exists() and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # an unknown method is a user error (exit 2, no traceback)
    bad = runner.invoke(app, [str(a) for a in arguments[:5] + ["--methods", "nope"] + arguments[7:]],
                        env={"COLUMNS": "400"})
    assert bad.exit_code == 2 and "unknown method(s) ['nope']" in " ".join(bad.output.split())
    assert "Traceback" not in bad.output


def test_leaderboard_sorts_by_mean_gain_nan_last_and_the_figure_handles_it():
    from submerge.merge.compare import COMPARE, compare_leaderboard

    gain = np.array([[0.0, 0.0], [1.0, math.nan], [0.2, 0.4], [math.nan, math.nan], [0.9, 0.7]])
    methods = ["base", "finetuned:a", "ties", "broken", "plan"]
    dataset = xr.Dataset(
        {"loss": (("method", "task"), np.arange(10.0).reshape(5, 2)), "gain": (("method", "task"), gain),
         "mean_gain": (("method",), np.array([0.0, 1.0, 0.3, math.nan, 0.8]))},
        coords={"method": methods, "task": ["a", "b"],
                "kind": ("method", ["base", "finetune", "strategy", "strategy", "plan"])})
    frame = COMPARE.summary(dataset)
    assert list(frame.index) == ["finetuned:a", "plan", "ties", "base", "broken"]
    assert list(frame.columns) == ["loss a", "loss b", "gain a", "gain b", "mean gain"]
    assert frame.loc["ties", "loss b"] == 5.0 and frame.loc["plan", "gain a"] == 0.9
    figure = compare_leaderboard(dataset)
    assert figure is not None and [t.get_text() for t in figure.axes[0].get_yticklabels()] == [
        "broken", "base", "ties", "plan", "finetuned:a"]  # best on top
    assert compare_leaderboard(dataset.isel(method=slice(0, 0))) is None


def test_the_leaderboard_says_what_each_method_and_the_whole_board_took():
    """Each method's unit wall is a column of the leaderboard; the title sums, per subset, every unit's wall and
    every data step's (attrs), over seeds: known sums by hand."""
    from submerge.merge.compare import COMPARE, time_spent

    methods = ["base", "ties", "plan", "base", "ties", "plan"]
    dataset = xr.Dataset(
        {"loss": (("unit", "task"), np.ones((6, 2))), "gain": (("unit", "task"), np.full((6, 2), 0.5)),
         "mean_gain": (("unit",), np.array([0.0, 0.4, 0.6, 0.0, 0.5, 0.7])),
         "seconds": (("unit",), np.array([10.0, 100.0, 200.0, 12.0, 110.0, math.nan]))},
        coords={"unit": [f"full|{s}|{m}" for s, m in zip([0, 0, 0, 1, 1, 1], methods)], "task": ["a", "b"],
                "method": ("unit", methods), "subset": ("unit", ["a+b"] * 6), "seed": ("unit", [0, 0, 0, 1, 1, 1]),
                "kind": ("unit", ["base", "strategy", "plan"] * 2), "detail": ("unit", [""] * 6)},
        attrs={"data_step_seconds a+b|0": {"evidence": 30.0, "fisher": 5.0},
               "data_step_seconds a+b|1": {"evidence": 40.0}})
    assert time_spent(dataset) == {"a+b": 10 + 100 + 200 + 12 + 110 + 30 + 5 + 40}
    assert "Time (units and data steps summed): a+b 8 min 27 s" in COMPARE.table_title(dataset)
    frame = COMPARE.summary(dataset)
    assert frame.loc["ties", "seconds"] == 105.0 and frame.loc["base", "seconds"] == 11.0  # mean over seeds
    assert time_spent(dataset.drop_vars("seconds")) == {}


def test_compare_plan_steers_the_matrices_the_store_interference_marks(trained_kit, tmp_path):
    from submerge.diagnostics.checkpoints import open_checkpoint
    from submerge.diagnostics.interference import interference
    from submerge.diagnostics.store import Store
    from submerge.merge.compare import compare

    _, base, finetuned, data = trained_kit
    store = Store(tmp_path / "store.zarr")
    measured = interference(open_checkpoint(base), {t: open_checkpoint(s) for t, s in finetuned.items()},
                            rank_fracs=(0.25,), device="cpu", progress=False, store=store)
    in_blocks = measured.where(measured.layer >= 0, drop=True)
    sti = dict(zip(in_blocks.matrix.values.tolist(), in_blocks.sti_normalized.values.tolist()))
    threshold = float(np.median(list(sti.values())))
    expected = {name for name, value in sti.items() if value > threshold}
    assert 0 < len(expected) < len(sti)
    compare(base, finetuned, data, methods=["plan"], store=store, plan_out=tmp_path / "plan.yaml",
            **{**RUN, "evidence_options": {"folds": 2, "sti_max": threshold, "sar_min": 0.0,
                                           "candidates": ("layer", "attn-mlp")}})  # a RegMean block is not steered
    plan = Plan.load(tmp_path / "plan.yaml")
    assert set(plan.matrix_rules) == expected
    for name, rule in plan.matrix_rules.items():
        assert rule["method"] == "tsv-m" and rule["reason"] == f"STI/Σσ {sti[name]:.3g} > {threshold}"
    assert plan.decision["steered"] == {name: rule["reason"] for name, rule in plan.matrix_rules.items()}
    assert plan.decision["sti_max"] == threshold
    # the plan file given back to compare is the plan compared (same held-out losses as the steered plan)
    again = compare(base, finetuned, data, methods=["plan"], plan=tmp_path / "plan.yaml", **RUN)
    np.testing.assert_allclose(again.loss.sel({"method": "plan"}).values,
                               indexed(store.dataset("compare")).loss.sel({"method": "plan"}).values, rtol=1e-6)


def test_summed_source_is_the_sum_of_its_scaled_updates(trained_kit):
    """θ0 + ½δ + ½δ (two terms of one checkpoint) has the losses of θ0 + δ, and of the model built by hand."""
    from submerge.diagnostics.checkpoints import open_checkpoint
    from submerge.merge.compare import _Evaluator
    from submerge.merge.writer import ParameterRule, write_merge

    _, base, finetuned, _ = trained_kit
    held = _experiment(trained_kit, skip=FIT)
    directory = Path(trained_kit[0]) / "sum-for-terms"
    write_merge(base, finetuned, directory, lambda info: ParameterRule(method="task-arithmetic"), progress=False)
    evaluator = _Evaluator(held, held.batches)
    reader = open_checkpoint(str(directory), base=evaluator.base.reader)
    evaluator.load_terms(((reader, 0.5), (reader, 0.5)))
    halves = evaluator.losses()
    evaluator.load_scaled(reader, 1.0)
    np.testing.assert_allclose(halves, evaluator.losses(), rtol=1e-6)
    np.testing.assert_allclose(halves, _losses_of(held, _task_sum_state(trained_kit, held, 1.0)), rtol=1e-5)


def test_tuned_plan_steers_the_share_of_matrices_with_the_lowest_fit_loss(trained_kit, tmp_path):
    """Tuned, the evidence plan tries its rest as the mean and the sum of the task vectors, then steering ½ and all
    of its block matrices (most colliding first) to Iso-C at its own scale μ: the choice is the lowest fit loss
    searched, and --plan-out writes the plan so tuned (α and the rest times λ, the steered matrices by Iso-C at
    scaling μ), whose merge has compare's held-out losses."""
    from submerge.diagnostics.checkpoints import open_checkpoint
    from submerge.diagnostics.interference import interference
    from submerge.diagnostics.store import Store
    from submerge.merge.compare import _Evaluator, compare
    from submerge.merge.plan import interference_ranking, steered_matrices
    from submerge.merge.writer import write_merge

    _, base, finetuned, data = trained_kit
    store = Store(tmp_path / "store.zarr")
    measured = interference(open_checkpoint(base), {t: open_checkpoint(s) for t, s in finetuned.items()},
                            rank_fracs=(0.25,), device="cpu", progress=False, store=store)
    options = {"folds": 2, "sti_max": 1e9, "sar_min": 0.0, "steer_method": "iso-c"}  # no threshold marks
    dataset = compare(base, finetuned, data, methods=["plan"], store=store, plan_out=tmp_path / "plan.yaml",
                      **{**RUN, "tune": "line", "evidence_options": options})
    search = dataset.attrs["search " + str(dataset.unit.values[dataset.method.values.tolist().index("plan")])]
    row = indexed(dataset).sel({"method": "plan"})
    chosen = json.loads(str(row.hyperparameters.values))
    assert float(row.fit_loss) == pytest.approx(min(search.values()))
    assert {" ".join(key.split()[:2]) for key in search} >= {"rest=mean steer_share=0", "rest=sum steer_share=0"}
    assert all(key.startswith(f"rest={chosen['rest']} ") for key in search if "steer_scale=" in key)  # the better
    assert any("steer_scale=" in key and "steer_share=0.5" in key for key in search)
    assert any("steer_scale=" in key and "steer_share=1" in key for key in search)
    share = chosen["steer_share"]
    assert share > 0  # on this kit a steered plan has the lowest fit loss, so the check below covers μ and λ apart
    plan = Plan.load(tmp_path / "plan.yaml")
    assert plan.decision["tuned"] == {**chosen, "fit_loss": pytest.approx(float(row.fit_loss))}
    infos = list(TensorTable.from_reader(open_checkpoint(base)))
    assert set(plan.matrix_rules) == steered_matrices(infos, share, interference_ranking(measured))
    assert {rule["method"] for rule in plan.matrix_rules.values()} == {"iso-c"}
    assert {rule["options"]["scaling"] for rule in plan.matrix_rules.values()} == {chosen["steer_scale"]}
    weight = chosen["λ"] * (1.0 if chosen["rest"] == "sum" else 1 / len(finetuned))  # the rest tried better
    assert plan.rest == {"method": "weights", "weights": {t: pytest.approx(weight) for t in finetuned}}
    written = tmp_path / "tuned-plan"
    write_merge(base, finetuned, written, plan.rule_for, progress=False)
    held = _experiment(trained_kit, skip=FIT)
    evaluator = _Evaluator(held, held.batches)
    evaluator.load(str(written))
    np.testing.assert_allclose(evaluator.losses(), row.loss.values, rtol=1e-5)


def test_a_plan_of_regmean_blocks_is_tuned_written_and_merged_with_the_data_it_needs(trained_kit, tmp_path):
    """The evidence plan with RegMean as its block candidate: every block matrix merged by RegMean on the fit
    records' input Grams, the norms by the block's α, tuned at λ (RegMean's ``scaling``). ``--plan-out`` writes it
    tuned; `diag merge` of the file refuses to run without --data, and with the fit records gives compare's
    held-out losses."""
    from submerge.diagnostics.checkpoints import open_checkpoint
    from submerge.merge.compare import _Evaluator, compare
    from submerge.merge.plan import gram_ruled
    from submerge.merge.run import DataSettings, run_merge
    from submerge.merge.tuning import LAMBDAS_WIDE

    _, base, finetuned, data = trained_kit
    dataset = compare(base, finetuned, data, methods=["plan"], plan_out=tmp_path / "plan.yaml",
                      grids={"plan": {"scaling": LAMBDAS_WIDE, "steer_share": (0.0,)}},  # no steering over it
                      **{**RUN, "tune": "line", "evidence_options": {"folds": 2, "candidates": ("regmean",)}})
    row = indexed(dataset).sel({"method": "plan"})
    plan = Plan.load(tmp_path / "plan.yaml")
    infos = list(TensorTable.from_reader(open_checkpoint(base)))
    assert sorted(gram_ruled(plan)) == sorted(i.name for i in infos if i.layer >= 0 and i.kind == "matrix")
    scale = plan.decision["tuned"]["λ"]
    assert {rule["options"]["scaling"] for rule in plan.matrix_rules.values()} == {scale}
    assert plan.decision["fit_data"] == {"data": data, "samples": FIT, "max_tokens": 48}
    flags = " ".join(f"--data {t}={spec}" for t, spec in data.items())
    with pytest.raises(PlanError, match=r"merges \d+ matrices by RegMean .* give --data .*"
                       + re.escape(f"fitted it with {flags} --samples {FIT} --max-tokens 48")):
        run_merge(tmp_path / "refused", plan=tmp_path / "plan.yaml", progress=False)
    assert not (tmp_path / "refused").exists()
    written = run_merge(tmp_path / "merged", plan=tmp_path / "plan.yaml", progress=False,
                        data=DataSettings(data, samples=FIT, max_tokens=48, batch_size=4))
    held = _experiment(trained_kit, skip=FIT)
    evaluator = _Evaluator(held, held.batches)
    evaluator.load(str(written))
    np.testing.assert_allclose(evaluator.losses(), row.loss.values, rtol=1e-5)


def test_evidence_with_heads_ties_attn_mlp_and_keeps_the_coarser(hand_kit):
    from submerge.merge.plan import block_objectives, evidence_plan

    fit = _hand_experiment(hand_kit, skip=0)
    evidence = evidence_plan(fit, hand_kit[1], candidates=("layer", "attn-mlp", "head-mlp"), folds=2,
                             progress=False)
    # every head of block 0 carries its task's update on that task's records only: α = 1 per head, exact too
    cv = evidence.layers[0].cv_objective
    assert cv["head-mlp"] < 1e-6 * cv["layer"] and cv["attn-mlp"] < 1e-6 * cv["layer"]
    for head in range(4):
        np.testing.assert_allclose(list(evidence.layers[0].alpha["head-mlp"][f"layers.0.attn.head.{head}"].values()),
                                   [1.0, 1.0], atol=1e-6)
    plan = evidence.plan()
    assert plan.layer_granularity == {0: "attn-mlp", 1: "layer"}  # a tie goes to the coarser candidate
    held = _hand_experiment(hand_kit, skip=HAND_FIT)
    heads = block_objectives(held, evidence.single("head-mlp"), layers=[0])
    assert heads[0] < 1e-6 * block_objectives(held, evidence.single("layer"), layers=[0])[0]


def test_compare_plan_by_thresholds_reads_the_store(trained_kit, tmp_path):
    from submerge.diagnostics.linearity import alpha as solve_alpha_per_module
    from submerge.diagnostics.linearity import nonlinearity
    from submerge.diagnostics.store import Store
    from submerge.merge.compare import compare
    from submerge.merge.plan import make_plan

    _, base, finetuned, data = trained_kit
    store = Store(tmp_path / "store.zarr")
    fit = _experiment(trained_kit, skip=0)
    nonlinearity(fit, levels=("layer", "attn", "mlp"), steps=2, store=store, progress=False)
    for granularity in ("layer", "attn-mlp"):
        solve_alpha_per_module(fit, granularity=granularity, store=store, progress=False)
    expected = make_plan(store.path)
    result = compare(base, finetuned, data, methods=["plan"], choose="thresholds", store=store,
                     plan_out=tmp_path / "plan.yaml", **RUN)
    plan = Plan.load(tmp_path / "plan.yaml")
    assert plan.granularity == expected.granularity and plan.alpha == expected.alpha
    assert plan.decision["reasons"] == expected.decision["reasons"]
    assert str(result.detail.sel({"method": "plan"}).values) == expected.granularity


def test_compare_ranks_a_users_mergekit_recipe(trained_kit, tmp_path):
    """--recipe NAME=FILE: a mergekit TIES recipe with TIES' defaults is the registered ties merge (the same loss,
    bitwise); a weighted task-arithmetic recipe on one fine-tune is θ0 + w τ; both ranked, kind 'recipe'."""
    import yaml

    from submerge.merge.compare import CompareError, compare
    from submerge.merge.recipe import RecipeError

    _, base, finetuned, data = trained_kit
    ties = {"merge_method": "ties", "base_model": base, "parameters": {"lambda": 1.0},
            "models": [{"model": finetuned[t], "parameters": {"weight": 1.0, "density": 0.2}} for t in TASKS]}
    single = {"merge_method": "task_arithmetic", "base_model": base,
              "models": [{"model": finetuned["math"], "parameters": {"weight": 0.5}}]}
    paths = {}
    for name, config in (("my-ties", ties), ("half-math", single)):
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config))
    dataset = compare(base, finetuned, data, methods=["ties"], recipes=paths, **RUN)
    assert list(dataset.method.values)[-3:] == ["ties", "my-ties", "half-math"]
    assert list(dataset.kind.values)[-2:] == ["recipe", "recipe"]
    np.testing.assert_array_equal(dataset.loss.sel({"method": "my-ties"}).values,
                                  dataset.loss.sel({"method": "ties"}).values)
    held = _experiment(trained_kit, skip=FIT)
    state = _task_sum_state(trained_kit, held, 0.0)
    math_only = _task_sum_state(trained_kit, held, 0.5)  # θ0 + 0.5 (τ_math + τ_code) − 0.5 τ_code below
    code_half = {n: v for n, v in _task_sum_state(trained_kit, held, 0.0).items()}
    from safetensors.torch import load_file

    code = load_file(str(Path(finetuned["code"]) / "model.safetensors"))
    for name in state:
        key = held.base.checkpoint_name(name)
        code_half[name] = math_only[name] - 0.5 * (code[key] - state[name])
    np.testing.assert_allclose(_losses_of(held, code_half), dataset.loss.sel({"method": "half-math"}).values,
                               rtol=1e-5)
    with pytest.raises(CompareError, match="the label names a method"):
        compare(base, finetuned, data, methods=["ties"], recipes={"ties": paths["my-ties"]}, **RUN)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({**single, "models": [{"model": str(tmp_path), "parameters": {"weight": 1}}]}))
    with pytest.raises(RecipeError, match="not among the given fine-tunes"):
        compare(base, finetuned, data, methods=["ties"], recipes={"other": other}, **RUN)


def test_compare_fixes_a_methods_untuned_options_and_refuses_tuned_or_unknown_ones(trained_kit, tmp_path):
    """``--option METHOD.KEY=VALUE``: AdaMerging's budget and TIES' top-k reach the merge (its detail and the store's
    settings say so); a tuned knob, an unknown option or method, or a method not compared is refused before any
    work."""
    from submerge.diagnostics.store import Store
    from submerge.merge.compare import CompareError, compare, parse_method_options

    _, base, finetuned, data = trained_kit
    given = parse_method_options(["adamerging.steps=1", "adamerging.learning_rate=0.02", "ties.top_k=0.3"])
    assert given == {"adamerging": {"steps": "1", "learning_rate": "0.02"}, "ties": {"top_k": "0.3"}}
    store = Store(tmp_path / "store.zarr")
    dataset = compare(base, finetuned, data, methods=["ties", "adamerging"], store=store, method_options=given,
                      **{**RUN, "tune": None})
    detail = dict(zip(dataset.method.values, dataset.detail.values))
    assert "'top_k': 0.3" in detail["ties"], detail["ties"]
    assert "1 steps" in detail["adamerging"], detail["adamerging"]
    settings = store.dataset("compare").attrs["settings"]
    assert settings["method_options"] == {"adamerging": {"steps": 1, "learning_rate": 0.02}, "ties": {"top_k": 0.3}}
    data_steps = store.group_attrs("compare")["data_step_seconds math+code|0"]  # outside the units' seconds
    assert set(data_steps) == {"adamerging"} and data_steps["adamerging"] > 0
    # the board grown by a method with another data step keeps the first run's data-step times beside the new
    compare(base, finetuned, data, methods=["ties", "adamerging", "fisher"], store=store, method_options=given,
            **{**RUN, "tune": None})
    grown = store.group_attrs("compare")["data_step_seconds math+code|0"]
    assert grown["adamerging"] == data_steps["adamerging"] and grown["fisher"] > 0 and set(grown) == {
        "adamerging", "fisher"}

    for values, message in [(["ties.top_k=0.3"], r"--option ties.top_k: compare tunes it"),
                            (["task-arithmetic.scaling=0.5"], r"--option task-arithmetic.scaling: compare tunes it"),
                            (["ties.bogus=1"], r"unknown option 'bogus' for merge method 'ties'"),
                            (["plan.x=1"], r"'plan' is not one"),
                            (["dare.drop_rate=0.5"], r"'dare' is not among the compared methods"),
                            (["adamerging.steps=many"], r"cannot read 'many' as int")]:
        with pytest.raises(CompareError, match=message):
            compare(base, finetuned, data, methods=["ties", "task-arithmetic", "adamerging"],
                    store=Store(tmp_path / "refused.zarr"), method_options=parse_method_options(values),
                    **{**RUN, "tune": "line"})
    assert not (tmp_path / "refused.zarr").exists()
    # a caller's grids decide what is tuned: with TIES' row holding only λ, its top-k may be fixed; a knob that a
    # caller's row adds (AdaMerging's steps) is refused
    from submerge.merge.compare import check_method_options

    assert check_method_options({"ties": {"top_k": "0.3"}}, ["ties"], tuned=True,
                                grids={"ties": {"scaling": (0.5, 1.0)}}) == {"ties": {"top_k": 0.3}}
    with pytest.raises(CompareError, match=r"--option adamerging.steps: compare tunes it"):
        check_method_options({"adamerging": {"steps": "2"}}, ["adamerging"], tuned=True,
                             grids={"adamerging": {"steps": (1, 2)}})
    for text in ["ties.top_k", "top_k=0.3", ".x=1", "ties.=1"]:
        with pytest.raises(CompareError, match="METHOD.KEY=VALUE"):
            parse_method_options([text])


def test_data_that_a_merge_does_not_read_is_named_in_a_warning(trained_kit, tmp_path):
    """`diag merge --method task-arithmetic --data …` and a plan without RegMean blocks with --data: the data is not
    read, and a warning says so (the merge is written as without it)."""
    from submerge.merge.run import DataSettings, run_merge

    _, base, finetuned, data = trained_kit
    settings = DataSettings(data, samples=FIT, max_tokens=48, batch_size=4)
    with pytest.warns(UserWarning, match=r"--data is not used: --method task-arithmetic needs no data \(task data "
                                         r"is read by closed-form, .*regmean"):
        run_merge(tmp_path / "ta", method="task-arithmetic", base=base, finetuned=finetuned, data=settings,
                  progress=False)
    plan = Plan(base_model=base, finetuned=dict(finetuned), granularity="model",
                alpha={"model": dict.fromkeys(finetuned, 0.5)})
    plan.save(tmp_path / "plan.yaml")
    with pytest.warns(UserWarning, match="--data is not used: .*plan.yaml: the plan merges no matrix by a method"):
        run_merge(tmp_path / "plan", plan=tmp_path / "plan.yaml", data=settings, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        run_merge(tmp_path / "plain", plan=tmp_path / "plan.yaml", progress=False)

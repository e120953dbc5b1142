"""The merge engine end to end on tiny real models: writer, plans, closed-form α, RegMean, CLI.

One tiny Llama (2 layers, hidden 32, 4 heads, 2 key/value heads) is "pre-trained" by a few
optimizer steps on mixed text, then fine-tuned on three task texts with different numbers of
steps (`submerge.diagnostics.toy`), so the task vectors are real gradient updates that differ in
direction and size. Everything is built once per module in a temporary directory (no network).
Reference numbers come from the strategies applied directly to the checkpoints' tensors, from
the capture/replay engine and from plain Hugging Face forwards.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from submerge.diagnostics import toy
from submerge.diagnostics.capture import ParameterSource, input_gram_matrices, record_inputs, replay, sample_features
from submerge.diagnostics.execution import RayEngine
from submerge.diagnostics.experiment import Experiment
from submerge.diagnostics.linearity import alpha as solve_alpha_per_module
from submerge.diagnostics.linearity import balance_denominator, merge_objective, nonlinearity, task_gram
from submerge.diagnostics.modules import find_submodules, get_module
from submerge.diagnostics.store import Store
from submerge.diagnostics.tensors import TensorTable
from submerge.merge import strategies
from submerge.merge.plan import AUTO_ORDER, Plan, PlanError, choose_granularity, make_plan, plan_from_alpha
from submerge.merge.rules import regmean_rule
from submerge.merge.run import DataSettings, run_merge
from submerge.merge.tensor_merge import merge_tensor
from submerge.merge.writer import MergeError, ParameterRule, method_rule, write_merge, write_merges, writing_order

TASKS = ("math", "code", "story")
STEPS = {"math": 12, "code": 4, "story": 8}  # different training lengths → task vectors of different size
FIT = 8  # records 0..7 of each task file fit α; records 8..15 are held out
HEADS, KV_HEADS, HIDDEN, LAYERS = 4, 2, 32, 2
HEAD_DIM = HIDDEN // HEADS
SETTINGS = {"max_tokens": 48, "batch_size": 4, "dtype": "float32", "device": "cpu"}


@dataclass
class Kit:
    root: Path
    base: str
    finetuned: dict[str, str]
    data: dict[str, str]
    store: Path  # linearity (attn, mlp) + alpha/attn-mlp of the fit records

    def experiment(self, *, skip: int = 0) -> Experiment:
        return Experiment.load(self.base, self.finetuned, self.data, samples=FIT, skip=skip, **SETTINGS)


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Kit:
    root = tmp_path_factory.mktemp("merge_engine")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        random_init = toy.build_model(root / "random", "llama", layers=LAYERS, hidden=HIDDEN, heads=HEADS,
                                      kv_heads=KV_HEADS)
        base = toy.finetune(random_init, root / "base", "mix", steps=20, lr=3e-3, seed=9)
        finetuned = {task: str(toy.finetune(base, root / task, task, steps=STEPS[task], lr=1e-3, seed=index))
                     for index, task in enumerate(TASKS)}
        data = {task: str(toy.write_task_data(root / f"{task}.jsonl", task, count=2 * FIT, seed=7)) for task in TASKS}
        result = Kit(root, str(base), finetuned, data, root / "store.zarr")
        fit = result.experiment()
        store = Store(result.store)
        nonlinearity(fit, levels=("attn", "mlp"), steps=4, store=store, progress=False)
        solve_alpha_per_module(fit, granularity="attn-mlp", balance=False, store=store, progress=False)
    return result


def _tensors(directory: Path | str) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _task_vectors(kit: Kit, name: str) -> list[torch.Tensor]:
    base = load_file(str(Path(kit.base) / "model.safetensors"))[name]
    return [load_file(str(Path(kit.finetuned[t]) / "model.safetensors"))[name] - base for t in TASKS]


def _load_and_generate(directory: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    prompt = tokenizer(["Q: what is 2 plus 3? A:"], return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 4)
    return model


def _layer(index: int, part: str) -> str:
    return f"model.layers.{index}.{part}.weight"


# ----------------------------------------------------------------------- 1. the streaming writer

CHECKED = [_layer(0, "self_attn.q_proj"), _layer(1, "self_attn.v_proj"), _layer(1, "mlp.down_proj"),
           _layer(0, "input_layernorm"), "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]


@pytest.mark.parametrize(
    "method, options, direct",
    [
        ("task-arithmetic", {"scaling": 0.5}, lambda vectors: strategies.task_arithmetic(vectors, scaling=0.5)),
        ("ties", {"top_k": 0.3, "scaling": 0.8}, lambda vectors: strategies.ties(vectors, top_k=0.3, scaling=0.8)),
    ],
)
def test_method_merge_loads_generates_and_equals_the_strategy(kit, tmp_path, method, options, direct):
    out = write_merge(kit.base, kit.finetuned, tmp_path / method, method_rule(method, options),
                      record={"method": method, "options": options}, progress=False)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "submerge_merge.yaml", "model.safetensors"):
        assert (out / name).exists(), name
    assert not list(out.glob("*.partial"))
    record = yaml.safe_load((out / "submerge_merge.yaml").read_text())
    assert record["method"] == method and record["options"] == options
    assert any(rule.startswith(method) for rule in record["rules"])
    assert set(record["provenance"]["finetuned"]) == set(TASKS)
    _load_and_generate(out)
    merged = _tensors(out)
    base = load_file(str(Path(kit.base) / "model.safetensors"))
    assert set(merged) == set(base)
    for name in CHECKED:
        expected = base[name] + direct(_task_vectors(kit, name))
        assert merged[name].dtype == base[name].dtype
        assert (merged[name] - expected).abs().max().item() <= 1e-6, name
    # the merge did something: every fine-tune differs from it
    for task in TASKS:
        finetuned = load_file(str(Path(kit.finetuned[task]) / "model.safetensors"))
        assert (merged[CHECKED[0]] - finetuned[CHECKED[0]]).abs().max() > 1e-4


def test_small_shards_write_a_correct_index_and_load(kit, tmp_path):
    rule = method_rule("task-arithmetic", {"scaling": 0.5})
    single = write_merge(kit.base, kit.finetuned, tmp_path / "single", rule, progress=False)
    sharded = write_merge(kit.base, kit.finetuned, tmp_path / "sharded", rule, shard_size="40KB", progress=False)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) >= 3
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert not (sharded / "model.safetensors").exists() and not list(sharded.glob("*.partial"))
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    base_names = set(load_file(str(Path(kit.base) / "model.safetensors")))
    assert set(index["weight_map"]) == base_names
    assert set(index["weight_map"].values()) == set(files)
    for file in files:
        with safe_open(str(sharded / file), "pt") as handle:
            assert set(handle.keys()) == {n for n, f in index["weight_map"].items() if f == file}
    assert index["metadata"]["total_size"] == sum((sharded / f).stat().st_size for f in files)
    whole, pieces = _tensors(single), _tensors(sharded)
    assert all(torch.equal(whole[name], pieces[name]) for name in whole)
    model_whole, model_pieces = _load_and_generate(single), _load_and_generate(sharded)
    ids = torch.tensor([[5, 70, 80, 90, 33]])
    with torch.no_grad():
        assert torch.equal(model_whole(ids).logits, model_pieces(ids).logits)


def test_existing_output_is_refused_without_force_and_only_an_earlier_merge_is_replaced_with_it(kit, tmp_path):
    from submerge.diagnostics.outputs import OutputError

    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("not a model")
    rule = method_rule("task-arithmetic")
    with pytest.raises(OutputError, match="not empty.*--force"):
        write_merge(kit.base, kit.finetuned, out, rule, progress=False)
    with pytest.raises(OutputError, match="not a submerge merge.*not even with --force"):  # the user's files
        write_merge(kit.base, kit.finetuned, out, rule, force=True, progress=False)
    assert (out / "keep.txt").read_text() == "not a model" and not (out / "model.safetensors").exists()
    earlier = write_merge(kit.base, kit.finetuned, tmp_path / "earlier", rule, progress=False)
    write_merge(kit.base, kit.finetuned, earlier, method_rule("ties"), force=True, progress=False)  # replaced
    assert "ties" in (earlier / "submerge_merge.yaml").read_text()
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    for force in (False, True):  # a file is never taken for an output directory, nor deleted
        with pytest.raises(OutputError, match="is a file, not a directory"):
            write_merge(kit.base, kit.finetuned, a_file, rule, force=force, progress=False)
    assert a_file.read_text() == "mine"


def test_unknown_method_or_option_is_a_merge_error():
    with pytest.raises(MergeError, match="unknown merge method 'tie'"):
        method_rule("tie")
    with pytest.raises(MergeError, match="unknown option 'topk'"):
        method_rule("ties", {"topk": 0.2})


def test_plan_merge_applies_alpha_per_module_and_the_mean_elsewhere(kit, tmp_path):
    plan = make_plan(kit.store, granularity="attn-mlp")
    out = write_merge(plan.base_model, plan.finetuned, tmp_path / "plan", plan.rule_for,
                      record={"granularity": plan.granularity}, progress=False)
    _load_and_generate(out)
    merged = _tensors(out)
    base = load_file(str(Path(kit.base) / "model.safetensors"))
    for name, key in [(_layer(0, "self_attn.o_proj"), "layers.0.attn"), (_layer(1, "self_attn.k_proj"),
                      "layers.1.attn"), (_layer(0, "mlp.gate_proj"), "layers.0.mlp"),
                      (_layer(1, "mlp.up_proj"), "layers.1.mlp")]:
        weights = [plan.alpha[key][t] for t in TASKS]
        expected = base[name] + sum(w * v for w, v in zip(weights, _task_vectors(kit, name)))
        assert (merged[name] - expected).abs().max().item() <= 1e-6, name
    for name in ("model.embed_tokens.weight", _layer(1, "post_attention_layernorm"), "lm_head.weight"):
        expected = base[name] + sum(_task_vectors(kit, name)) / len(TASKS)
        assert (merged[name] - expected).abs().max().item() <= 1e-6, name
    assert len({round(plan.alpha[k]["math"], 6) for k in plan.alpha}) > 1  # α really differ per module


def test_the_tensor_table_gives_the_kind_each_strategy_route_uses(kit):
    """The merge reads a tensor's kind from the table only (no name regex): matrices, norms, embeddings."""
    table = TensorTable.from_checkpoint(kit.base)
    kinds = {name: table[name].kind for name in (_layer(0, "self_attn.q_proj"), _layer(1, "mlp.down_proj"),
                                                _layer(0, "input_layernorm"), "model.norm.weight",
                                                "model.embed_tokens.weight", "lm_head.weight")}
    assert kinds == {_layer(0, "self_attn.q_proj"): "matrix", _layer(1, "mlp.down_proj"): "matrix",
                     _layer(0, "input_layernorm"): "norm", "model.norm.weight": "norm",
                     "model.embed_tokens.weight": "embedding", "lm_head.weight": "embedding"}
    # so a matrix-only method takes the mean for norms and task arithmetic for embeddings (DEFAULT_FALLBACK)
    base = load_file(str(Path(kit.base) / "model.safetensors"))
    for name, expected in (("model.norm.weight", lambda v: sum(v) / 3), ("lm_head.weight", lambda v: sum(v))):
        vectors = _task_vectors(kit, name)
        merged = merge_tensor(table[name], base[name], dict(zip(TASKS, vectors)), ParameterRule("tsv-m"))
        assert (merged - base[name] - expected(vectors)).abs().max().item() <= 1e-6, name


def test_merge_tensor_is_a_pure_function_of_one_tensor(kit):
    table = TensorTable.from_checkpoint(kit.base)
    info = table[_layer(0, "mlp.up_proj")]
    base = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    vectors = {"math": torch.tensor([[1.0, 0.0], [0.0, -2.0]]), "code": torch.tensor([[0.5, 0.5], [1.0, 1.0]])}
    weighted = merge_tensor(info, base, vectors, ParameterRule(weights={"math": 2.0, "code": -1.0}))
    assert torch.equal(weighted, torch.tensor([[2.5, 1.5], [2.0, -1.0]]))
    # a task the weights do not name counts 0; per-row weights broadcast
    per_row = ParameterRule(weights={"code": torch.tensor([[1.0], [0.0]])})
    assert torch.equal(merge_tensor(info, base, vectors, per_row), torch.tensor([[1.5, 2.5], [3.0, 4.0]]))
    summed = merge_tensor(info, base.to(torch.bfloat16), vectors, ParameterRule("task-arithmetic", {"scaling": 2.0}))
    assert summed.dtype == torch.bfloat16 and torch.equal(summed.float(), torch.tensor([[4.0, 3.0], [5.0, 2.0]]))
    assert merge_tensor(info, base, vectors, ParameterRule(), dtype=torch.float16).dtype == torch.float16
    integers = torch.arange(4)
    assert merge_tensor(info, integers, vectors, ParameterRule()) is integers  # buffers pass through
    with pytest.raises(MergeError, match=r"merged tensor 'model.layers.0.mlp.up_proj.weight' has NaN/Inf"):
        merge_tensor(info, base, {"math": torch.full((2, 2), float("inf")), "code": -torch.full((2, 2), float("inf"))},
                     ParameterRule())
    with pytest.raises(MergeError, match=r"merging 'model.layers.0.mlp.up_proj.weight' \(2, 2\): .*unknown option"):
        merge_tensor(info, base, vectors, ParameterRule("ties", {"k": 1}))


def test_mergekit_spelling_through_the_writer(kit, tmp_path):
    out = write_merge(kit.base, kit.finetuned, tmp_path / "alias", method_rule("dare_ties", {"drop_rate": 0.0}),
                      progress=False)
    name = _layer(0, "self_attn.q_proj")
    base = load_file(str(Path(kit.base) / "model.safetensors"))[name]
    expected = base + strategies.ties(_task_vectors(kit, name), top_k=1.0)
    assert (_tensors(out)[name] - expected).abs().max().item() <= 1e-6
    assert method_rule("task_arithmetic")(None) == ParameterRule("task-arithmetic", {})


# ------------------------------------------------------- 2. closed-form α versus task arithmetic


def _held_out_objective(experiment: Experiment, weights_for, *, balance: bool) -> float:
    """Σ_i Σ_t E_{x∈H_t} ‖f_i(x; θ0 + Σ w_i,t' τ_t') − f_i(x; θ_t)‖² over every attn / MLP module i.

    seed 002 Eq. 10 on the held-out records (Eq. 33 when `balance`), with module inputs
    recorded on θ0 and modules replayed with each variant's parameters.
    """
    model, arch = experiment.base.model, experiment.arch
    source = ParameterSource(experiment.base, experiment.task_vectors)
    modules = find_submodules(model, ("attn", "mlp"), arch=arch)
    recorded = {t: record_inputs(model, arch, [m.path for m in modules], experiment.batches[t]) for t in TASKS}

    def features(module, path, task, coefficients):
        parameters = source.variant(path, coefficients)
        return [f for r in recorded[task][path] for f in sample_features(replay(module, r, parameters), r.token_mask)]

    total = 0.0
    for submodule in modules:
        module = get_module(model, submodule.path)
        merged, finetuned, denominators = [], [], []
        for task in TASKS:
            merged.append(features(module, submodule.path, task, weights_for(submodule.name)))
            finetuned.append(features(module, submodule.path, task, {task: 1.0}))
            if balance:
                base = features(module, submodule.path, task, {})
                deltas = [[f - b for f, b in zip(features(module, submodule.path, task, {s: 1.0}), base)]
                          for s in TASKS]
                denominators.append([balance_denominator(task_gram([d[i] for d in deltas]))
                                     for i in range(len(base))])
        total += merge_objective(merged, finetuned, denominators if balance else None)
        source.clear()
    return total


@pytest.mark.parametrize("balance", [False, True], ids=["eq10", "eq33"])
def test_closed_form_alpha_beats_the_best_task_arithmetic_on_held_out_records(kit, balance):
    fit, held_out = kit.experiment(), kit.experiment(skip=FIT)
    assert held_out.data["math"].indices[0] == FIT
    solved = solve_alpha_per_module(fit, granularity="attn-mlp", balance=balance, progress=False)
    alpha = solved.alpha.isel(granularity=0)
    closed_form = _held_out_objective(
        held_out, lambda name: {t: float(alpha.sel(module=name, task=t)) for t in TASKS}, balance=balance)
    task_arithmetic = {
        scaling: _held_out_objective(held_out, lambda name, s=scaling: {t: s for t in TASKS}, balance=balance)
        for scaling in np.round(np.arange(0.05, 1.0001, 0.05), 2)
    }
    best = min(task_arithmetic, key=task_arithmetic.get)
    assert 0.05 < best < 1.0, "the best λ should be inside the grid, else the grid is unfair to TA"
    assert closed_form < task_arithmetic[best], (closed_form, best, task_arithmetic[best])


# ------------------------------------------------------------------------------------ 3. plans


def _stats(attn=0.1, mlp=0.2, layer=0.3, model=2.0, pd=None):
    stats = {level: {"nonlinearity_score": value} for level, value in
             (("attn", attn), ("mlp", mlp), ("layer", layer), ("model", model))}
    for level, value in (pd or {}).items():
        stats[level]["projection_distance"] = value
    return stats


@pytest.mark.parametrize(
    "stats, expected",
    [
        (_stats(), "attn-mlp"),
        (_stats(attn=0.5, mlp=0.5), "attn-mlp"),  # thresholds are inclusive
        (_stats(mlp=0.5000001), "layer"),
        (_stats(attn=0.7), "layer"),
        (_stats(pd={"attn": 0.21, "layer": 0.05}), "layer"),
        (_stats(pd={"attn": 0.2, "mlp": 0.19}), "attn-mlp"),
        (_stats(mlp=0.9, layer=0.51), "model"),
        (_stats(mlp=0.9, pd={"layer": 0.3}), "model"),
        (_stats(attn=float("nan")), "layer"),  # NaN never passes
        ({"layer": {"nonlinearity_score": 0.1}}, "layer"),  # no attn / mlp figures
        ({}, "model"),
    ],
)
def test_choose_granularity_picks_the_finest_level_under_the_thresholds(stats, expected):
    chosen, reasons = choose_granularity(stats)
    assert chosen == expected, reasons
    assert reasons[-1].startswith(f"{expected}: chosen")
    assert len(reasons) == AUTO_ORDER.index(expected) + 1


def test_choose_granularity_respects_custom_thresholds_and_availability():
    assert choose_granularity(_stats(attn=0.7), nl_max=0.8)[0] == "attn-mlp"
    assert choose_granularity(_stats(pd={"attn": 0.3}), pd_max=0.35)[0] == "attn-mlp"
    chosen, reasons = choose_granularity(_stats(), available={"layer", "model"})
    assert chosen == "layer" and "no alpha/attn-mlp" in reasons[0]
    with pytest.raises(PlanError, match="diag alpha"):
        choose_granularity(_stats(), available=set())


def test_auto_never_chooses_head_level():
    perfect = {level: {"nonlinearity_score": 0.0, "projection_distance": 0.0}
               for level in ("head", "attn", "mlp", "layer", "model")}
    assert "head-mlp" not in AUTO_ORDER
    assert choose_granularity(perfect, available={"head-mlp", "model"})[0] == "model"
    assert choose_granularity(perfect)[0] == "attn-mlp"


def _alpha_dataset(granularity: str, values: dict[str, dict[str, float]]) -> xr.Dataset:
    modules = list(values)
    return xr.Dataset(
        {
            "alpha": (("granularity", "module", "task"), np.array([[[values[m][t] for t in TASKS] for m in modules]])),
            "condition_number": (("granularity", "module"), np.ones((1, len(modules)))),
            "least_squares": (("granularity", "module"), np.zeros((1, len(modules)), dtype=bool)),
        },
        coords={"granularity": np.array([granularity], dtype=object), "module": np.array(modules, dtype=object),
                "task": np.array(TASKS, dtype=object)},
    )


def test_head_mlp_rule_splits_q_o_by_head_and_averages_k_v_over_the_gqa_group(kit, tmp_path):
    values = {}
    for layer in range(LAYERS):
        for head in range(HEADS):
            values[f"layers.{layer}.attn.head.{head}"] = {t: 0.1 * (head + 1) + 0.3 * i + 0.05 * layer
                                                          for i, t in enumerate(TASKS)}
        values[f"layers.{layer}.mlp"] = {t: 0.2 + 0.1 * i for i, t in enumerate(TASKS)}
    plan = plan_from_alpha(_alpha_dataset("head-mlp", values), kit.base, kit.finetuned)
    assert plan.granularity == "head-mlp"
    assert plan.attention == {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM}
    out = write_merge(kit.base, kit.finetuned, tmp_path / "heads", plan.rule_for, progress=False)
    _load_and_generate(out)
    merged = _tensors(out)
    base = load_file(str(Path(kit.base) / "model.safetensors"))
    group = HEADS // KV_HEADS
    for layer in range(LAYERS):
        head_alpha = np.array([[values[f"layers.{layer}.attn.head.{h}"][t] for t in TASKS] for h in range(HEADS)])
        for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
            name = _layer(layer, f"self_attn.{projection}")
            vectors = _task_vectors(kit, name)
            units = HEADS if projection in ("q_proj", "o_proj") else KV_HEADS
            for unit in range(units):
                weights = head_alpha[unit] if units == HEADS else head_alpha[unit * group:(unit + 1) * group].mean(0)
                span = slice(unit * HEAD_DIM, (unit + 1) * HEAD_DIM)

                def cut(weight, span=span, columns=projection == "o_proj"):
                    return weight[:, span] if columns else weight[span]

                expected = cut(base[name]) + sum(float(w) * cut(v) for w, v in zip(weights, vectors))
                assert (cut(merged[name]) - expected).abs().max().item() <= 1e-6, (name, unit)
        name = _layer(layer, "mlp.down_proj")
        expected = base[name] + sum(values[f"layers.{layer}.mlp"][t] * v
                                    for t, v in zip(TASKS, _task_vectors(kit, name)))
        assert (merged[name] - expected).abs().max().item() <= 1e-6
    # the rule objects themselves: q rows and o columns per head, k rows per group
    table = TensorTable.from_checkpoint(kit.base)
    q_rule = plan.rule_for(table[_layer(0, "self_attn.q_proj")])
    o_rule = plan.rule_for(table[_layer(0, "self_attn.o_proj")])
    k_rule = plan.rule_for(table[_layer(0, "self_attn.k_proj")])
    assert q_rule.weights["code"].shape == (HEADS * HEAD_DIM, 1)
    assert o_rule.weights["code"].shape == (1, HEADS * HEAD_DIM)
    assert k_rule.weights["code"].shape == (KV_HEADS * HEAD_DIM, 1)
    assert q_rule.weights["code"][HEAD_DIM * 3, 0].item() == pytest.approx(values["layers.0.attn.head.3"]["code"])
    assert k_rule.weights["code"][HEAD_DIM, 0].item() == pytest.approx(
        (values["layers.0.attn.head.2"]["code"] + values["layers.0.attn.head.3"]["code"]) / 2)
    with pytest.raises(PlanError, match="rows"):
        plan.rule_for(replace(table[_layer(0, "self_attn.q_proj")], shape=(HEADS * HEAD_DIM + 1, HIDDEN)))


def test_plan_save_load_round_trip(kit, tmp_path):
    plan = make_plan(kit.store, granularity="auto", nl_max=1e9, pd_max=1e9, rest={"method": "ties",
                                                                                     "options": {"top_k": 0.5}})
    assert plan.granularity == "attn-mlp"
    assert plan.decision["reasons"] == ["attn-mlp: chosen"]
    assert set(plan.decision["level_stats"]) == {"attn", "mlp"}
    loaded = Plan.load(plan.save(tmp_path / "plan.yaml"))
    assert loaded == plan
    norm = TensorTable.from_checkpoint(kit.base)["model.norm.weight"]
    assert loaded.rule_for(norm) == ParameterRule(method="ties", options={"top_k": 0.5})
    (tmp_path / "other.yaml").write_text("a: 1\n")
    with pytest.raises(PlanError, match="not a submerge plan"):
        Plan.load(tmp_path / "other.yaml")
    with pytest.raises(PlanError, match="not found"):
        Plan.load(tmp_path / "missing.yaml")


def test_auto_plan_without_passing_levels_explains_why(kit):
    with pytest.raises(PlanError, match="attn-mlp: rejected"):
        make_plan(kit.store, granularity="auto", nl_max=-1.0)


def test_to_mergekit_gives_per_layer_values_for_attention_and_mlp(kit):
    plan = make_plan(kit.store, granularity="attn-mlp")
    config, notes = plan.to_mergekit(LAYERS)
    assert config["merge_method"] == "task_arithmetic" and config["base_model"] == kit.base
    assert config["parameters"] == {"normalize": False}
    assert [m["model"] for m in config["models"]] == [kit.finetuned[t] for t in TASKS]
    for task, model in zip(TASKS, config["models"]):
        weight = model["parameters"]["weight"]
        by_filter = {entry.get("filter"): entry["value"] for entry in weight}
        assert set(by_filter) == {"self_attn", "mlp", None}
        assert by_filter["self_attn"] == [plan.alpha[f"layers.{j}.attn"][task] for j in range(LAYERS)]
        assert by_filter["mlp"] == [plan.alpha[f"layers.{j}.mlp"][task] for j in range(LAYERS)]
        assert by_filter[None] == pytest.approx(1 / len(TASKS))
    # block norms match neither filter and take the filter-less rest weight, as the plan does: the export is
    # exact (checked by hand with mergekit 0.1.5: max |plan merge − mergekit merge| = 0), so nothing to note
    assert notes == []
    yaml.safe_dump(config)  # plain YAML types only

    layer_plan = Plan(kit.base, kit.finetuned, "layer", {f"layers.{j}": {t: 0.1 * j + 0.2 for t in TASKS}
                                                          for j in range(LAYERS)})
    weight = layer_plan.to_mergekit(LAYERS)[0]["models"][0]["parameters"]["weight"]
    # the per-layer list is filtered to the blocks, so embeddings / final norm / lm_head take the rest weight
    # (checked with mergekit 0.1.5 on a toy llama: max |plan merge − mergekit merge| = 0)
    assert weight == [{"filter": "layers.", "value": [0.1 * j + 0.2 for j in range(LAYERS)]},
                      {"value": pytest.approx(1 / 3)}]
    model_plan = Plan(kit.base, kit.finetuned, "model", {"model": {"math": 0.4, "code": 0.3, "story": 0.2}})
    assert [m["parameters"]["weight"] for m in model_plan.to_mergekit(LAYERS)[0]["models"]] == [0.4, 0.3, 0.2]


def test_missing_alpha_group_is_a_plan_error_with_the_diag_alpha_hint(kit, tmp_path):
    with pytest.raises(PlanError, match=r"no alpha/layer.*diag alpha --granularity layer"):
        make_plan(kit.store, granularity="layer")
    with pytest.raises(PlanError, match="unknown granularity"):
        make_plan(kit.store, granularity="heads")
    with pytest.raises(PlanError, match="no store"):
        make_plan(tmp_path / "nothing.zarr")


# ------------------------------------------------------------------------------ 4. RegMean


def test_regmean_through_the_writer_equals_regmean_on_one_linear_map(kit, tmp_path):
    fit = kit.experiment()
    grams = {t: input_gram_matrices(fit.base.model, fit.arch, fit.batches[t]) for t in TASKS}
    linear = set(grams[TASKS[0]])
    assert _layer(0, "self_attn.q_proj") in linear and _layer(1, "mlp.down_proj") in linear
    # q, k and v read the attention's input (the normed hidden states): G = Σ over real tokens of x xᵀ
    recorded = record_inputs(fit.base.model, fit.arch, [fit.arch.attn_path(1)], fit.batches["math"])
    inputs = torch.cat([(r.args[0] if r.args else r.kwargs["hidden_states"])[r.token_mask]
                        for r in recorded[fit.arch.attn_path(1)]])
    assert inputs.shape[0] == sum(int(b.attention_mask.sum()) for b in fit.batches["math"])
    for projection in ("q_proj", "k_proj", "v_proj"):
        torch.testing.assert_close(grams["math"][_layer(1, f"self_attn.{projection}")], inputs.T @ inputs,
                                   rtol=1e-5, atol=1e-5)
    assert grams["math"][_layer(0, "mlp.down_proj")].shape == (2 * HIDDEN, 2 * HIDDEN)
    out = write_merge(kit.base, kit.finetuned, tmp_path / "regmean", regmean_rule({"off_diagonal_scale": 0.9}, linear),
                      gram_matrices=lambda name: [grams[t][name] for t in TASKS] if name in linear else None,
                      progress=False)
    _load_and_generate(out)
    merged = _tensors(out)
    base = load_file(str(Path(kit.base) / "model.safetensors"))
    for name in (_layer(0, "self_attn.q_proj"), _layer(1, "self_attn.o_proj"), _layer(1, "mlp.down_proj")):
        vectors = _task_vectors(kit, name)
        expected = base[name] + strategies.regmean(vectors, gram_matrices=[grams[t][name] for t in TASKS],
                                                   off_diagonal_scale=0.9)
        assert (merged[name] - expected).abs().max().item() <= 1e-6, name
        assert (merged[name] - base[name] - sum(vectors)).abs().max() > 1e-5  # not plain task arithmetic
    name = "model.embed_tokens.weight"
    assert (merged[name] - base[name] - sum(_task_vectors(kit, name))).abs().max().item() <= 1e-6


def test_regmean_merge_streams_grams_block_by_block(kit, tmp_path, monkeypatch):
    """`diag merge --method regmean` (run_merge's data step) holds one block's Grams at a time and computes each
    block once, in order; its checkpoint is bitwise the one from all Grams computed in one pass."""
    import submerge.diagnostics.capture

    fit = kit.experiment()
    # a Gram sums over tokens: the merge takes the records regrouped by length, the file order's Grams to rounding
    whole = {t: input_gram_matrices(fit.base.model, fit.arch, fit.regrouped().batches[t]) for t in TASKS}
    for t in TASKS:
        in_file_order = input_gram_matrices(fit.base.model, fit.arch, fit.batches[t])
        for key, gram in whole[t].items():
            torch.testing.assert_close(gram, in_file_order[key], rtol=1e-5, atol=1e-5)
    linear = set(whole[TASKS[0]])
    expected = write_merge(kit.base, kit.finetuned, tmp_path / "one-pass", regmean_rule({"off_diagonal_scale": 0.9},
                                                                                         linear),
                           gram_matrices=lambda name: [whole[t][name] for t in TASKS] if name in linear else None,
                           progress=False)
    layers_computed, original = [], submerge.diagnostics.capture.input_gram_matrices

    def counted(*args, layers=None, **kwargs):
        layers_computed.append(list(layers))
        return original(*args, layers=layers, **kwargs)

    monkeypatch.setattr(submerge.diagnostics.capture, "input_gram_matrices", counted)
    out = run_merge(tmp_path / "streamed", method="regmean", base=kit.base, finetuned=kit.finetuned,
                    data=DataSettings(kit.data, samples=FIT, max_tokens=SETTINGS["max_tokens"],
                                      batch_size=SETTINGS["batch_size"]), progress=False)
    assert layers_computed == [[layer] for layer in range(LAYERS) for _ in TASKS]  # one block, all tasks, in order
    one_pass, streamed = _tensors(expected), _tensors(out)
    assert list(streamed) == writing_order(list(streamed))  # written block after block
    assert one_pass.keys() == streamed.keys()
    for name, tensor in one_pass.items():
        assert torch.equal(tensor, streamed[name]), name
    assert yaml.safe_load((out / "submerge_merge.yaml").read_text())["method"] == "regmean"


def test_writing_order_compares_layer_numbers_as_numbers():
    names = ["model.norm.weight", "model.layers.10.mlp.up_proj.weight", "lm_head.weight",
             "model.layers.2.self_attn.q_proj.weight", "model.layers.2.mlp.up_proj.weight", "model.embed_tokens.weight"]
    assert writing_order(names) == ["lm_head.weight", "model.embed_tokens.weight", "model.layers.2.mlp.up_proj.weight",
                                    "model.layers.2.self_attn.q_proj.weight", "model.layers.10.mlp.up_proj.weight",
                                    "model.norm.weight"]


def test_regmean_transposes_conv1d_weights_even_when_square(tmp_path):
    """GPT-2 stores Conv1D weights (in, out); the attention output map is square, so shapes cannot tell."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = toy.build_model(tmp_path / "gpt2", "gpt2", layers=1, hidden=16, heads=2)
        finetuned = {t: str(toy.finetune(base, tmp_path / f"gpt2_{t}", t, steps=3, seed=i))
                     for i, t in enumerate(("math", "code"))}
    generator = torch.Generator().manual_seed(0)
    grams = {}
    for name, size in (("transformer.h.0.attn.c_proj.weight", 16), ("transformer.h.0.attn.c_attn.weight", 16),
                       ("transformer.h.0.mlp.c_fc.weight", 16), ("transformer.h.0.mlp.c_proj.weight", 32)):
        inputs = [torch.randn(20, size, generator=generator) * torch.linspace(0.2, 3.0, size) for _ in range(2)]
        grams[name] = [x.T @ x for x in inputs]
    out = write_merge(str(base), finetuned, tmp_path / "merged",
                      lambda info: ParameterRule("regmean") if info.name in grams else ParameterRule(),
                      gram_matrices=grams.get, progress=False)
    merged = _tensors(out)
    base_tensors = load_file(str(Path(base) / "model.safetensors"))
    for name, task_grams in grams.items():
        vectors = [load_file(str(Path(finetuned[t]) / "model.safetensors"))[name] - base_tensors[name]
                   for t in ("math", "code")]
        expected = base_tensors[name] + strategies.regmean([v.T for v in vectors], gram_matrices=task_grams).T
        assert (merged[name] - expected).abs().max().item() <= 1e-6, name


# ---------------------------------------------------------------------------------- 5. the CLI


def _invoke(arguments: list[str]):
    from typer.testing import CliRunner

    from submerge.cli.main import app

    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def _finetuned_options(kit: Kit) -> list[str]:
    return [option for t in TASKS for option in ("-f", f"{t}={kit.finetuned[t]}")]


def test_cli_merge_with_a_method_writes_a_loadable_checkpoint(kit, tmp_path):
    out = tmp_path / "ta"
    _invoke(["merge", "--method", "task-arithmetic", "--option", "scaling=0.5", "-m", kit.base,
             *_finetuned_options(kit), "--out", str(out), "--no-progress"])
    _load_and_generate(out)
    name = _layer(1, "mlp.up_proj")
    base = load_file(str(Path(kit.base) / "model.safetensors"))[name]
    assert (_tensors(out)[name] - base - 0.5 * sum(_task_vectors(kit, name))).abs().max().item() <= 1e-6
    record = yaml.safe_load((out / "submerge_merge.yaml").read_text())
    assert record["method"] == "task-arithmetic" and record["options"] == {"scaling": "0.5"}
    from typer.testing import CliRunner

    from submerge.cli.main import app

    again = CliRunner().invoke(app, ["merge", "--method", "task-arithmetic", "-m", kit.base,
                                     *_finetuned_options(kit), "--out", str(out), "--no-progress"])
    assert again.exit_code == 2 and "--force" in again.output


def test_cli_plan_merge_and_eval(kit, tmp_path):
    plan_path, mergekit_path, merged = tmp_path / "plan.yaml", tmp_path / "mk.yaml", tmp_path / "merged"
    _invoke(["plan", str(kit.store), "--out", str(plan_path), "--nl-max", "1e9", "--pd-max", "1e9",
             "--export-mergekit", str(mergekit_path)])
    plan = Plan.load(plan_path)
    assert plan.granularity == "attn-mlp" and set(plan.finetuned) == set(TASKS)
    mergekit = yaml.safe_load(mergekit_path.read_text())
    assert len(mergekit["models"][0]["parameters"]["weight"][0]["value"]) == LAYERS
    _invoke(["merge", str(plan_path), "--out", str(merged), "--no-progress"])
    _load_and_generate(merged)
    name = _layer(0, "mlp.down_proj")
    base = load_file(str(Path(kit.base) / "model.safetensors"))[name]
    expected = base + sum(plan.alpha["layers.0.mlp"][t] * v for t, v in zip(TASKS, _task_vectors(kit, name)))
    assert (_tensors(merged)[name] - expected).abs().max().item() <= 1e-6
    assert yaml.safe_load((merged / "submerge_merge.yaml").read_text())["granularity"] == "attn-mlp"

    store_path = tmp_path / "eval.zarr"
    _invoke(["eval", "-m", kit.base, *_finetuned_options(kit), "--merged", f"plan={merged}",
             *[o for t in TASKS for o in ("-d", f"{t}={kit.data[t]}")], "--out", str(store_path),
             "--skip", str(FIT), "--samples", "4", "--max-tokens", "48", "--device", "cpu", "--no-progress"])
    evaluated = Store(store_path).dataset("eval")
    assert list(evaluated.model.values) == ["base", *TASKS, "plan"]
    assert list(evaluated.task.values) == list(TASKS)
    loss = evaluated.loss.values
    assert np.isfinite(loss).all() and (loss > 0).all()
    np.testing.assert_allclose(evaluated.perplexity.values, np.exp(loss), rtol=1e-12)
    assert (evaluated.tokens.values > 0).all()

    def by(model: str, task: str) -> float:
        return float(evaluated.loss.sel(model=model, task=task))

    assert by("math", "math") < by("base", "math")  # the fine-tune learnt its task
    # base loss on math by hand: plain Hugging Face forward per held-out record, token-weighted mean
    import transformers

    from submerge.diagnostics.data import read_task_file

    model = transformers.AutoModelForCausalLM.from_pretrained(kit.base, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(kit.base)
    total, count = 0.0, 0
    for text in read_task_file("math", kit.data["math"], samples=4, skip=FIT).texts:
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=48)["input_ids"]
        with torch.no_grad():
            total += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    assert by("base", "math") == pytest.approx(total / count, rel=1e-5)
    assert int(evaluated.tokens.sel(model="base", task="math")) == count
    assert math.isclose(float(evaluated.perplexity.sel(model="plan", task="code")),
                        math.exp(by("plan", "code")), rel_tol=1e-12)


def test_cli_closed_form_is_the_plan_of_the_alpha_solved_on_the_same_data(kit, tmp_path):
    """`--method closed-form` goes through the registry and submerge.merge.run like every method: α solved on the fit
    records at --granularity, applied per unit; the same as a plan built from diag alpha's dataset."""
    out = tmp_path / "closed"
    data = [o for t in TASKS for o in ("-d", f"{t}={kit.data[t]}")]
    _invoke(["merge", "--method", "closed-form", "--granularity", "layer", "-m", kit.base, *_finetuned_options(kit),
             *data, "--samples", str(FIT), "--max-tokens", str(SETTINGS["max_tokens"]), "--device", "cpu",
             "--out", str(out), "--no-progress"])
    record = yaml.safe_load((out / "submerge_merge.yaml").read_text())
    assert record["method"] == "closed-form" and record["granularity"] == "layer"
    solved = solve_alpha_per_module(Experiment.load(kit.base, kit.finetuned, kit.data, samples=FIT, batch_size=8,
                                                    max_tokens=SETTINGS["max_tokens"], dtype="auto", device="cpu"),
                                    granularity="layer", progress=False)
    plan = plan_from_alpha(solved, kit.base, kit.finetuned)
    assert set(record["alpha"]) == set(plan.alpha) == {"layers.0", "layers.1"}
    for unit, weights in plan.alpha.items():
        assert record["alpha"][unit] == pytest.approx(weights, rel=1e-12)
    merged = _tensors(out)
    base = load_file(str(Path(kit.base) / "model.safetensors"))
    for name, unit in ((_layer(0, "self_attn.q_proj"), "layers.0"), (_layer(1, "mlp.down_proj"), "layers.1")):
        expected = base[name] + sum(plan.alpha[unit][t] * v for t, v in zip(TASKS, _task_vectors(kit, name)))
        assert (merged[name] - expected).abs().max().item() <= 1e-6, name


def test_run_merge_needs_data_for_data_methods_and_one_of_plan_or_method(kit, tmp_path):
    with pytest.raises(ValueError, match="one of a plan, a mergekit recipe or a method"):
        run_merge(tmp_path / "x", base=kit.base, finetuned=kit.finetuned)
    with pytest.raises(MergeError, match="unknown merge method 'slerp'"):
        run_merge(tmp_path / "x", method="slerp", base=kit.base, finetuned=kit.finetuned)
    out = run_merge(tmp_path / "ta", method="task_arithmetic", options={"scaling": "0.5"}, base=kit.base,
                    finetuned=kit.finetuned, data=DataSettings(), progress=False)
    name = _layer(1, "mlp.up_proj")
    base = load_file(str(Path(kit.base) / "model.safetensors"))[name]
    assert (_tensors(out)[name] - base - 0.5 * sum(_task_vectors(kit, name))).abs().max().item() <= 1e-6


# --------------------------------------------------------- 6. output safety, dtypes, options


def _digest(directory: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(directory).rglob("*")) if p.is_file()}


def test_a_failing_merge_with_force_keeps_the_old_output(kit, tmp_path):
    out = write_merge(kit.base, kit.finetuned, tmp_path / "merged", method_rule("task-arithmetic"), progress=False)
    before = _digest(out)

    def fails_in_layer_1(info):
        return ParameterRule("ties", {"k": 1}) if info.layer == 1 else ParameterRule()

    with pytest.raises(MergeError, match=r"merging 'model.layers.1\..*unknown option 'k'"):
        write_merge(kit.base, kit.finetuned, out, fails_in_layer_1, force=True, shard_size="20KB", progress=False)
    assert _digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no .partial-<pid> or .old-<pid> left
    # a successful --force replaces it, again without leftovers
    write_merge(kit.base, kit.finetuned, out, method_rule("task-arithmetic", {"scaling": 0.5}), force=True,
                progress=False)
    assert _digest(out) != before and sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


def test_out_that_is_inside_or_around_an_input_is_refused_and_the_inputs_are_untouched(kit, tmp_path):
    from typer.testing import CliRunner

    from submerge.cli.main import app

    base, math = Path(kit.base), Path(kit.finetuned["math"])
    before = {path: _digest(path) for path in (base, math)}
    for out, what in ((base, "base model"), (base / "merged", "base model"), (math, "fine-tune 'math'"),
                      (base.parent, "base model")):
        result = CliRunner().invoke(app, ["merge", "--method", "task-arithmetic", "-m", kit.base,
                                          *_finetuned_options(kit), "--out", str(out), "--force", "--no-progress"])
        assert result.exit_code == 2, (out, result.output)
        assert f"would overwrite the {what}" in " ".join(result.output.split()), result.output
        with pytest.raises(MergeError, match="would overwrite"):
            write_merge(kit.base, kit.finetuned, out, method_rule("task-arithmetic"), force=True, progress=False)
    assert {path: _digest(path) for path in (base, math)} == before
    assert not (base / "merged").exists()


def test_cli_force_checks_everything_before_touching_the_old_output(kit, tmp_path):
    """`diag merge --force` used to delete --out first: a bad method, size or fine-tune then lost the old merge."""
    from typer.testing import CliRunner

    from submerge.cli.main import app

    out = write_merge(kit.base, kit.finetuned, tmp_path / "merged", method_rule("task-arithmetic"), progress=False)
    before = _digest(out)
    missing = ["-f", f"math={kit.finetuned['math']}", "-f", f"code={tmp_path / 'nope'}"]
    for finetuned, extra, message in (
        (_finetuned_options(kit), ["--method", "nosuch"], "unknown merge method 'nosuch'"),
        (_finetuned_options(kit), ["--method", "ties", "--shard-size", "2XB"], "--shard-size: cannot read '2XB'"),
        (missing, ["--method", "ties"], f"fine-tune 'code' not found: {tmp_path / 'nope'}"),
    ):
        result = CliRunner().invoke(app, ["merge", "-m", kit.base, *finetuned, "--out", str(out), "--force",
                                          "--no-progress", *extra], env={"COLUMNS": "400"})
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        assert message in " ".join(result.output.split()) and "Traceback" not in result.output, result.output
        assert _digest(out) == before, extra
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


@pytest.mark.parametrize("option, value, message", [("--shard-size", "2XB", "--shard-size: cannot read '2XB'"),
                                                     ("--shard-size", "-1GB", "--shard-size: cannot read"),
                                                     ("--out-dtype", "float8", "--out-dtype: unknown dtype 'float8'")])
def test_bad_size_or_dtype_is_a_clear_error(kit, tmp_path, option, value, message):
    from typer.testing import CliRunner

    from submerge.cli.main import app

    result = CliRunner().invoke(app, ["merge", "--method", "ties", "-m", kit.base, *_finetuned_options(kit),
                                      "--out", str(tmp_path / "m"), option, value, "--no-progress"])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "m").exists()


def test_out_dtype_rounds_once_and_mergekit_spelling_on_the_command_line(kit, tmp_path):
    _invoke(["merge", "--method", "task_arithmetic", "--option", "scaling=0.5", "-m", kit.base,
             *_finetuned_options(kit), "--out", str(tmp_path / "bf16"), "--out-dtype", "bfloat16", "--no-progress"])
    _invoke(["merge", "--method", "task-arithmetic", "--option", "scaling=0.5", "-m", kit.base,
             *_finetuned_options(kit), "--out", str(tmp_path / "f32"), "--no-progress"])
    rounded, full = _tensors(tmp_path / "bf16"), _tensors(tmp_path / "f32")
    assert set(rounded) == set(full)
    for name, tensor in rounded.items():
        assert tensor.dtype == torch.bfloat16 and full[name].dtype == torch.float32
        assert torch.equal(tensor, full[name].to(torch.bfloat16)), name
    record = yaml.safe_load((tmp_path / "bf16" / "submerge_merge.yaml").read_text())
    assert record["out_dtype"] == "bfloat16" and record["method"] == "task_arithmetic"
    assert any(rule.startswith("task-arithmetic") for rule in record["rules"])


# ----------------------------------------------------------------------- scale-out: tensors as Ray tasks


@pytest.mark.xdist_group("ray")  # one xdist worker runs every Ray test (conftest: --dist loadgroup)
def test_merge_on_ray_writes_the_one_process_checkpoint_though_a_worker_is_killed(kit, tmp_path,
                                                                                 kill_first_ray_worker):
    """A method merge (ties), a plan merge, RegMean (Grams block by block) and two KnOTS settings in one pass
    (`write_merges`) on 2 local Ray workers: the one-process tensors bit for bit and the same rules record, though the
    first worker is killed after its first group."""
    from submerge.diagnostics.capture import GramsByLayer

    ray = pytest.importorskip("ray")
    plan = make_plan(kit.store, granularity="attn-mlp")
    fit = kit.experiment()

    def grams():
        return GramsByLayer(fit.base.model, fit.arch, fit.batches, checkpoint_names=fit.base.checkpoint_names)

    merges = {"ties": (kit.base, kit.finetuned, method_rule("ties", {"top_k": 0.3}), None),
              "plan": (plan.base_model, plan.finetuned, plan.rule_for, None),
              "regmean": (kit.base, kit.finetuned, regmean_rule({}, grams().names), grams)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for name, (base, finetuned, rule_for, gram_matrices) in merges.items():
            write_merge(base, finetuned, tmp_path / f"{name}-one", rule_for, progress=False,
                        gram_matrices=gram_matrices and gram_matrices())
            write_merge(base, finetuned, tmp_path / f"{name}-ray", rule_for, progress=False,
                        engine=RayEngine(workers=2), shard_size="64KB", gram_matrices=gram_matrices and gram_matrices())
        settings = {f"knots-{k}": method_rule("knots", {"top_k": k}) for k in (0.1, 0.3)}  # one pass, as compare
        for name, rule_for in settings.items():
            write_merge(kit.base, kit.finetuned, tmp_path / f"{name}-one", rule_for, progress=False)
        write_merges(kit.base, kit.finetuned, [(tmp_path / f"{name}-ray", rule_for, None)
                                               for name, rule_for in settings.items()],
                     progress=False, engine=RayEngine(workers=2), shard_size="64KB")
    finally:
        ray.shutdown()
    assert len(kill_first_ray_worker) == 1
    assert (_tensors(tmp_path / "regmean-one")["model.layers.1.mlp.down_proj.weight"]
            != _tensors(tmp_path / "ties-one")["model.layers.1.mlp.down_proj.weight"]).any()
    for name in [*merges, *settings]:
        one, spread = _tensors(tmp_path / f"{name}-one"), _tensors(tmp_path / f"{name}-ray")
        assert list(one) == list(spread)
        for tensor in one:
            assert one[tensor].dtype == spread[tensor].dtype and torch.equal(one[tensor], spread[tensor]), tensor
        records = [yaml.safe_load((tmp_path / f"{name}-{mode}" / "submerge_merge.yaml").read_text())
                   for mode in ("one", "ray")]
        assert records[0]["rules"] == records[1]["rules"]
        assert records[1]["provenance"]["engine"]["engine"] == "ray"


@pytest.mark.xdist_group("ray")  # one xdist worker runs every Ray test (conftest: --dist loadgroup)
def test_eval_on_ray_equals_one_process_and_resumes_a_killed_driver(kit, tmp_path):
    """Models as tasks of 2 local Ray workers: the eval store equals the one-process one bit for bit, also when
    the driver was killed after its first model and the run resumed on Ray."""
    ray = pytest.importorskip("ray")
    from submerge.diagnostics.evaluate import evaluate

    options = {"skip": FIT, "samples": 4, "max_tokens": 48, "batch_size": 4, "dtype": "float32", "device": "cpu",
               "progress": False}
    fresh = evaluate(kit.base, kit.finetuned, kit.data, **options)

    class Killed(RuntimeError):
        pass

    def kill_the_driver(label):
        raise Killed(label)

    store = Store(tmp_path / "eval.zarr")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(Killed):
            evaluate(kit.base, kit.finetuned, kit.data, **options, store=store, engine=RayEngine(workers=2),
                     on_unit=kill_the_driver)
        resumed = evaluate(kit.base, kit.finetuned, kit.data, **options, store=store, engine=RayEngine(workers=2))
    finally:
        ray.shutdown()
    for dataset in (resumed, store.dataset("eval")):
        assert list(dataset.model.values) == list(fresh.model.values)
        for name, variable in fresh.data_vars.items():
            assert np.array_equal(variable.values, dataset[name].values), name
    assert store.dataset("eval").attrs["provenance"]["engine"]["workers"] == 2


@pytest.mark.parametrize("method, options, streamed, embedding_streamed", [
    ("task-arithmetic", {"scaling": 0.5}, True, True),
    ("weight-average", {}, True, True),
    ("ties", {"top_k": 0.2}, False, False),  # its trim threshold is over the whole tensor
    ("tsv-m", {}, False, True),  # matrices by SVD; its embedding fallback (task arithmetic) is row-local
])
def test_row_local_merges_stream_row_blocks_and_equal_the_whole_tensor_merge(kit, tmp_path, monkeypatch, method,
                                                                               options, streamed, embedding_streamed):
    """Above the threshold a row-local rule reads, merges and writes blocks of rows: bitwise the whole merge."""
    from submerge.merge import tensor_merge

    whole = write_merge(kit.base, kit.finetuned, tmp_path / "whole", method_rule(method, options), progress=False)
    calls = []
    original = tensor_merge.merge_row_blocks

    def spy(name, *args, **kwargs):
        result = original(name, *args, **kwargs)
        calls.append((name, result is not None))
        return result

    monkeypatch.setattr(tensor_merge, "STREAM_THRESHOLD", 100)
    monkeypatch.setattr(tensor_merge, "STREAM_ELEMENTS", 3 * HIDDEN + 5)  # 3 rows a block: blocks end mid-tensor
    monkeypatch.setattr(tensor_merge, "merge_row_blocks", spy)
    blocks = write_merge(kit.base, kit.finetuned, tmp_path / "blocks", method_rule(method, options), progress=False)
    expected, got = _tensors(whole), _tensors(blocks)
    assert set(expected) == set(got)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    streamed_names = {name for name, done in calls if done}
    table = TensorTable.from_checkpoint(kit.base)
    matrices = {name for name, _ in calls if table.get(name).kind == "matrix"}
    assert ("model.embed_tokens.weight" in streamed_names) == embedding_streamed
    assert matrices and (matrices <= streamed_names if streamed else not matrices & streamed_names)


#: Several settings of each method whose candidates share work, and methods of every other kind, in one pass.
ONE_PASS = [("knots", {"top_k": 0.1}), ("knots", {"top_k": 0.3}), ("cart", {"rank_ratio": 0.1}),
            ("cart", {"rank_ratio": 0.3}), ("ties", {"top_k": 0.2}), ("dare", {"drop_rate": 0.5}),
            ("tsv-m", {}), ("iso-cts", {}), ("sftm", {"top_k": 0.3}), ("nan", {}), ("task-arithmetic", {})]


@pytest.mark.parametrize("streamed", [False, True])
def test_write_merges_writes_each_merge_bytewise_as_write_merge_alone_and_shares_the_svds(kit, tmp_path, monkeypatch,
                                                                                         streamed):
    """`write_merges` (compare's candidates of one method, written in one pass): every output's shards are byte for
    byte those `write_merge` writes for it alone, below and above the row-block threshold, although the tensors are
    read once and KnOTS and CART take their SVDs once for both settings (one SVD of [τ_1 … τ_T] per matrix for
    KnOTS, one per task and matrix for CART, where separate merges take one per setting)."""
    from submerge.merge import tensor_merge

    if streamed:
        monkeypatch.setattr(tensor_merge, "STREAM_THRESHOLD", 100)
        monkeypatch.setattr(tensor_merge, "STREAM_ELEMENTS", 3 * HIDDEN + 5)
    svds = []
    original = strategies._thin_svd

    def counted(matrix):
        svds.append(tuple(matrix.shape))
        return original(matrix)

    monkeypatch.setattr(strategies, "_thin_svd", counted)
    alone = []
    for index, (method, options) in enumerate(ONE_PASS):
        svds.clear()
        alone.append((write_merge(kit.base, kit.finetuned, tmp_path / f"alone-{index}", method_rule(method, options),
                                  progress=False), len(svds)))
    svds.clear()
    together = write_merges(kit.base, kit.finetuned, [(tmp_path / f"together-{index}", method_rule(method, options),
                                                       {"index": index})
                                                      for index, (method, options) in enumerate(ONE_PASS)],
                            progress=False)
    for (directory, _), written in zip(alone, together):
        files = sorted(path.name for path in directory.glob("*.safetensors"))
        assert files and files == sorted(path.name for path in written.glob("*.safetensors"))
        for name in files:
            assert (directory / name).read_bytes() == (written / name).read_bytes(), (written, name)
        assert yaml.safe_load((written / "submerge_merge.yaml").read_text())["index"] == together.index(written)
    matrices = sum(info.kind == "matrix" for info in TensorTable.from_checkpoint(kit.base))
    knots_svds, cart_svds = alone[0][1], alone[2][1]
    assert knots_svds == matrices and cart_svds == len(TASKS) * matrices  # one per matrix (and task) alone
    assert len(svds) == sum(count for _, count in alone) - knots_svds - cart_svds  # the second settings' are shared


def test_write_merges_checks_every_output_before_writing_and_puts_none_in_place_on_failure(kit, tmp_path):
    """An output that exists (without --force) is refused before any merge is written; a merge that fails part-way
    (one output's rule fails in the last block) leaves no output and no staging directory."""
    from submerge.diagnostics.outputs import OutputError

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="taken"):
        write_merges(kit.base, kit.finetuned, [(tmp_path / "first", method_rule("task-arithmetic"), None),
                                               (tmp_path / "taken", method_rule("ties"), None)], progress=False)
    assert not (tmp_path / "first").exists() and (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    rule = method_rule("task-arithmetic")

    def fails_in_the_last_block(info):
        if f"layers.{LAYERS - 1}." in info.name:
            raise MergeError(f"no rule for {info.name}")
        return rule(info)

    with pytest.raises(MergeError, match=f"no rule for model.layers.{LAYERS - 1}"):
        write_merges(kit.base, kit.finetuned, [(tmp_path / "good", rule, None),
                                               (tmp_path / "bad", fails_in_the_last_block, None)], progress=False)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["taken"]


def test_plan_weights_stream_and_a_nan_in_a_row_block_names_the_tensor_and_rows(kit, tmp_path, monkeypatch):
    from submerge.merge import tensor_merge

    plan = make_plan(kit.store, granularity="attn-mlp")
    whole = write_merge(kit.base, kit.finetuned, tmp_path / "whole", plan.rule_for, progress=False)
    monkeypatch.setattr(tensor_merge, "STREAM_THRESHOLD", 100)
    monkeypatch.setattr(tensor_merge, "STREAM_ELEMENTS", 2 * HIDDEN)
    blocks = write_merge(kit.base, kit.finetuned, tmp_path / "blocks", plan.rule_for, progress=False)
    expected, got = _tensors(whole), _tensors(blocks)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in Path(kit.finetuned["code"]).iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][40, 3] = float("nan")
    from safetensors.torch import save_file

    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"model.layers.1.mlp.up_proj.weight.*NaN/Inf values in rows 40:42"):
        write_merge(kit.base, {**kit.finetuned, "code": str(broken)}, tmp_path / "nan", plan.rule_for,
                    progress=False)

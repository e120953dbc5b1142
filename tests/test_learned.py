"""The data steps of Fisher merging, AdaMerging and LoraHub (`submerge.merge.learned`) and the block-by-block
backward they run on (`submerge.diagnostics.gradients`), on tiny real models.

- The backward's gradients equal autograd through the whole model (the fine-tune loaded whole, or θ0 + Σ λ τ
  built whole), for an untied (Llama) and a tied (GPT-2) output head.
- The Fisher is the per-record squared gradient of sampled labels, as a whole-model computation gives it.
- AdaMerging and LoraHub pick the weight that minimises their objective where a grid shows the optimum.
- Each runs through `run_merge` (`diag merge --method M --data …`) and through `compare`.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.func import functional_call

from submerge.diagnostics import capture, toy
from submerge.diagnostics.data import predicting
from submerge.diagnostics.evaluate import streamed_losses
from submerge.diagnostics.experiment import Experiment
from submerge.diagnostics.gradients import backward_by_blocks
from submerge.merge import learned, strategies
from submerge.merge.learned import (
    _MergedWeights,
    _records,
    adamerging_coefficients,
    fisher_diagonals,
    lorahub_coefficients,
    lorahub_objective,
    next_token_entropy,
    sampled_negative_log_likelihood,
)
from submerge.merge.run import DataSettings, run_merge

TASKS = ("math", "code")


_KITS: dict[str, tuple] = {}


def _kit(architecture: str, root: Path) -> tuple:
    """(architecture, base, full fine-tunes, data) of a 2-block model, built once per architecture."""
    if architecture not in _KITS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base = toy.build_model(root / "base", architecture, layers=2, hidden=16, heads=2, kv_heads=1)
            finetuned = {t: str(toy.finetune(base, root / t, t, steps=4, seed=i)) for i, t in enumerate(TASKS)}
            data = {t: str(toy.write_task_data(root / f"{t}.jsonl", t, count=8)) for t in TASKS}
        _KITS[architecture] = (architecture, str(base), finetuned, data)
    return _KITS[architecture]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def kit(request, tmp_path_factory):
    """Llama (a separate output head) or GPT-2 (the head tied to the token embedding)."""
    return _kit(request.param, tmp_path_factory.mktemp(f"learned-{request.param}"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _kit("llama", tmp_path_factory.mktemp("learned-llama"))


@pytest.fixture
def unreleased(monkeypatch):
    """The toy's weights are a few KiB, but giving their pages back after every block (as every forward of
    `streamed_losses` does) reads /proc/self/smaps each time: most of a LoraHub search's time here. Off for the
    tests that run many forwards; the release is tested in tests/test_models.py and above."""
    monkeypatch.setattr(capture, "release_mapped_pages", lambda module: 0)


def _experiment(kit, tasks=TASKS, samples=3, compute="float64"):
    _, base, finetuned, data = kit
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Experiment.load(base, {t: finetuned[t] for t in tasks}, {t: data[t] for t in tasks}, samples=samples,
                               max_tokens=24, batch_size=2, dtype="float32", compute_dtype=compute, device="cpu")


def _whole(directory: str) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).eval()
    model.requires_grad_(False)
    return model


def _logits(model, params, batch):
    return functional_call(model, params, (), {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
                           ).logits


# ------------------------------------------------------------------ the backward against whole-model autograd


@pytest.mark.parametrize("granularity", ["task", "layer"])
def test_entropy_gradient_equals_autograd_through_the_whole_merged_model(kit, granularity):
    experiment = _experiment(kit)
    base, tasks = experiment.base, experiment.tasks
    rows = learned._coefficient_rows(base.model, base, granularity)
    generator = torch.Generator().manual_seed(3)
    raw = (0.1 + 0.8 * torch.rand(max(rows.values()) + 1, len(tasks), generator=generator)).requires_grad_(True)
    batches = [b for t in tasks for b in experiment.batches[t]]
    owner = [t for t in tasks for _ in experiment.batches[t]]
    tokens = {t: sum(int(b.attention_mask[:, 1:].sum()) for b in experiment.batches[t]) for t in tasks}
    weights = _MergedWeights(experiment.parameter_source(), tasks, raw, rows)
    value = backward_by_blocks(experiment.parameter_source(), experiment.arch, batches, weights,
                               lambda b, logits, batch: next_token_entropy(logits) / tokens[owner[b]])

    model = _whole(kit[1])  # a tied head and embedding are one parameter (named once)
    deltas = {t: {name: experiment.task_vectors[t].get(base.checkpoint_name(name), torch.float64)
                  for name, _ in model.named_parameters()} for t in tasks}
    leaf = raw.detach().double().requires_grad_(True)
    params = {name: p + sum(leaf.clamp(0, 1)[rows[base.checkpoint_name(name)], i] * deltas[t][name]
                            for i, t in enumerate(tasks))
              for name, p in model.named_parameters()}
    total = sum(next_token_entropy(predicting(_logits(model, params, batch), batch)) / tokens[owner[b]]
                for b, batch in enumerate(batches))
    (expected,) = torch.autograd.grad(total, leaf)
    assert value == pytest.approx(float(total.detach()), rel=1e-10)
    torch.testing.assert_close(weights.grad.double(), expected, rtol=1e-6, atol=1e-10)
    assert float(expected.abs().sum()) > 0


def _reference_fisher(kit, experiment, task, index, seed):
    """Per record, the squared gradient of the sampled labels' log-likelihood of the whole fine-tune, summed and
    divided by the predicted tokens (the definition `fisher_diagonals` computes block by block)."""
    model = _whole(kit[2][task])
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    names = {name: experiment.base.checkpoint_name(name) for name, _ in model.named_parameters()}
    squares, tokens = {}, 0
    for record in _records(experiment.batches[task]):
        params = {name: p.detach().clone().requires_grad_(True) for name, p in model.named_parameters()}
        loss = sampled_negative_log_likelihood(predicting(_logits(model, params, record), record), generator)
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        for name, grad in zip(params, grads):
            if grad is not None:
                squares[names[name]] = squares.get(names[name], 0) + grad * grad
        tokens += int(record.attention_mask.sum()) - 1
    return {name: square / tokens for name, square in squares.items()}


def test_fisher_is_the_per_record_squared_gradient_of_sampled_labels(kit):
    """Block by block (one stage's θ_t built at a time) equals whole-model autograd, the tied head included."""
    architecture = kit[0]
    experiment = _experiment(kit)
    diagonals = fisher_diagonals(experiment, seed=5, progress=False)
    stages = experiment.arch.num_layers + 2 + (architecture != "gpt2")  # embedding, blocks, final norm, head
    for index, task in enumerate(experiment.tasks):
        expected = _reference_fisher(kit, experiment, task, index, seed=5)
        assert set(expected) == diagonals.names
        for name, value in expected.items():
            got = diagonals(name)[index].double()
            assert bool((got >= 0).all()), name
            # float32 gradients, summed in another order block by block: a squared entry moves by a few 1e-5 relative
            torch.testing.assert_close(got, value, rtol=1e-4, atol=1e-12, msg=name)
        assert len(set(diagonals.files[task].values())) <= stages  # written stage by stage
    if architecture == "gpt2":  # one checkpoint tensor for the tied head and embedding
        assert "lm_head.weight" not in diagonals.names and "transformer.wte.weight" in diagonals.names
    directory = Path(diagonals._directory.name)
    diagonals.close()
    assert not directory.exists()


def test_the_backward_releases_mapped_pages_per_block_only_above_release_bytes(kit, monkeypatch):
    """Both sides of capture.RELEASE_BYTES: the same gradients; per stage above it, never below it."""
    experiment = _experiment(kit, compute="float32")
    calls = []
    original = capture.release_mapped_pages
    monkeypatch.setattr(capture, "release_mapped_pages", lambda module: calls.append(1) or original(module))
    results = {}
    for threshold in (2**40, 0):
        monkeypatch.setattr(capture, "RELEASE_BYTES", threshold)
        calls.clear()
        diagonals = fisher_diagonals(experiment, seed=1, progress=False)
        results[threshold] = {name: diagonals(name) for name in sorted(diagonals.names)}
        released = len(calls)
        diagonals.close()
        if threshold:
            assert released == 0
        else:  # every stage's clear, for each task
            assert released >= len(TASKS) * (experiment.arch.num_layers * 2 + 3)
    for name, tensors in results[0].items():
        for expected, got in zip(results[2**40][name], tensors):
            assert torch.equal(expected, got), name


# ------------------------------------------------------------------ the learned weights minimise their objective


def _entropy_at(experiment, value: float) -> float:
    tasks = experiment.tasks
    rows = learned._coefficient_rows(experiment.base.model, experiment.base, "task")
    raw = torch.full((1, len(tasks)), value, requires_grad=True)
    tokens = sum(int(b.attention_mask[:, 1:].sum()) for b in experiment.batches[tasks[0]])
    return backward_by_blocks(experiment.parameter_source(), experiment.arch, experiment.batches[tasks[0]],
                              _MergedWeights(experiment.parameter_source(), tasks, raw, rows),
                              lambda b, logits, batch: next_token_entropy(logits) / tokens)


def test_adamerging_finds_the_entropy_minimum_on_a_grid(llama):
    experiment = _experiment(llama, tasks=("math",), compute="float32")
    grid = np.linspace(0.0, 1.0, 21)
    entropies = [_entropy_at(experiment, float(value)) for value in grid]
    found = adamerging_coefficients(experiment, granularity="task", steps=40, learning_rate=0.05, initial=0.5,
                                    progress=False)
    value = found.shared["math"]
    assert 0.0 <= value <= 1.0
    assert _entropy_at(experiment, value) <= min(entropies) + 1e-4
    assert abs(value - grid[int(np.argmin(entropies))]) <= 0.05 + 1e-9
    assert found.record["entropy"]["last"] < found.record["entropy"]["first"]


def test_adamerging_layer_wise_has_one_weight_per_tensor_and_task(llama):
    experiment = _experiment(llama, compute="float32")
    found = adamerging_coefficients(experiment, steps=2, progress=False)
    names = {experiment.base.checkpoint_name(n) for n, _ in experiment.base.model.named_parameters()}
    assert set(found.per_tensor) == names
    moved = [w for weights in found.per_tensor.values() for w in weights.values() if w != 0.3]
    assert moved and all(abs(w - 0.3) <= 2 * 1e-3 + 1e-6 for w in moved)  # two Adam steps of 1e-3
    zero = adamerging_coefficients(experiment, steps=0, progress=False)
    assert all(w == pytest.approx(0.3) for weights in zero.per_tensor.values() for w in weights.values())
    with pytest.raises(ValueError, match="granularity"):
        adamerging_coefficients(experiment, granularity="block", steps=1, progress=False)


def test_adamerging_on_records_regrouped_by_length_learns_what_file_order_learns(llama, monkeypatch):
    """The objective sums over tokens (per task, over its token count), so regrouping the records by length (fewer
    padded positions) moves only rounding: the same entropies and weights in float64 whether every record is cut
    into batches of its own length (overhead 0) or the batches are kept as large as allowed (a huge overhead), and
    the two runs really batch differently."""
    from submerge.diagnostics import data as data_module

    experiment = _experiment(llama, samples=5, compute="float64")
    seen, original = [], learned.backward_by_blocks
    monkeypatch.setattr(learned, "backward_by_blocks",
                        lambda source, arch, batches, *rest, **options: seen.append(
                            [tuple(b.input_ids.shape) for b in batches]) or original(source, arch, batches, *rest,
                                                                                       **options))
    found = {}
    for overhead in (0, 10**6):
        monkeypatch.setattr(data_module, "BATCH_OVERHEAD_TOKENS", overhead)
        found[overhead] = adamerging_coefficients(experiment, steps=2, learning_rate=0.01, progress=False)
    assert seen[0] != seen[-1]  # other batches
    assert sum(h * w for h, w in seen[-1]) <= sum(b.input_ids.numel() for t in experiment.tasks
                                                   for b in experiment.batches[t])  # no more padding than as read
    for key in ("first", "last"):
        assert found[0].record["entropy"][key] == pytest.approx(found[10**6].record["entropy"][key], rel=1e-12)
    for name, weights in found[0].per_tensor.items():
        for task, weight in weights.items():
            # λ is a float32 leaf: an Adam step whose gradient moved by rounding lands within an ulp or two (3e-8)
            assert weight == pytest.approx(found[10**6].per_tensor[name][task], abs=1e-7), (name, task)
    assert "regrouped" in found[0].record["batches"]


def test_lorahub_finds_the_objective_minimum_on_a_grid(llama, unreleased):
    experiment = _experiment(llama, tasks=("code",), compute="float32")
    source = experiment.parameter_source()

    def objective(w: float) -> float:
        results = streamed_losses(source, experiment.arch, experiment.batches, {"code": w})
        return lorahub_objective([results["code"][0]], [w], 0.05)

    grid = np.linspace(-1.5, 1.5, 13)
    values = [objective(float(w)) for w in grid]
    found = lorahub_coefficients(experiment, progress=False)
    weight = found.shared["code"]
    assert -1.5 <= weight <= 1.5 and found.record["evaluations"] == 40
    assert found.record["objective"] == pytest.approx(objective(weight), rel=1e-6)
    assert found.record["objective"] <= min(values) + 1e-3
    assert abs(weight - grid[int(np.argmin(values))]) <= 0.25


def test_lorahub_objective_is_the_mean_loss_plus_the_authors_l1():
    assert lorahub_objective([1.0, 3.0], [0.5, -1.5], 0.05) == pytest.approx(2.0 + 0.05 * 1.0)
    assert lorahub_objective([2.0], [0.0], 0.05) == 2.0


# ------------------------------------------------------------------ through run_merge and compare


def _tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.parametrize("method, options", [("fisher", {"seed": 2}), ("adamerging", {"steps": 2}),
                                             ("adamerging", {"steps": 1, "granularity": "task"}),
                                             ("lorahub", {"steps": 6})])
def test_run_merge_writes_the_learned_merge(llama, tmp_path, method, options, unreleased):
    _, base, finetuned, data = llama
    settings = DataSettings(data=data, samples=3, max_tokens=24, batch_size=2)
    out = run_merge(tmp_path / method, method=method, options=options, base=base, finetuned=finetuned, data=settings,
                    progress=False)
    record = yaml.safe_load((out / "submerge_merge.yaml").read_text())
    assert record["method"] == method
    merged, base_tensors = _tensors(out), _tensors(base)
    vectors = {t: {n: tensor - base_tensors[n] for n, tensor in _tensors(finetuned[t]).items()} for t in TASKS}
    if method == "fisher":
        experiment = Experiment.load(base, finetuned, data, samples=3, max_tokens=24, batch_size=2, device="cpu")
        diagonals = fisher_diagonals(experiment, seed=2, progress=False)
        assert record["fisher"]["seed"] == 2
    for name, tensor in merged.items():
        if method == "fisher" and name in diagonals.names:
            expected = strategies.fisher([vectors[t][name] for t in TASKS], fisher_diagonals=diagonals(name))
        elif method == "fisher":
            expected = sum(vectors[t][name] for t in TASKS) / len(TASKS)
        else:
            weights = record[method]["weights"] if method == "lorahub" else (
                record[method]["coefficients"] if options.get("granularity") == "task"
                else record[method]["coefficients"][name])
            expected = sum(weights[t] * vectors[t][name] for t in TASKS)
        torch.testing.assert_close(tensor, base_tensors[name] + expected, rtol=1e-6, atol=1e-6, msg=name)


def test_compare_runs_the_learned_methods_on_its_fit_records(llama, monkeypatch, unreleased):
    from submerge.merge.compare import compare, default_methods

    _, base, finetuned, data = llama
    assert {"fisher", "adamerging", "lorahub", "pcb", "consensus", "nan", "knots"} <= set(default_methods())
    fast = dataclasses.replace(strategies.STRATEGIES["adamerging"],
                               data_options={**strategies.STRATEGIES["adamerging"].data_options, "steps": 3})
    monkeypatch.setitem(strategies.STRATEGIES, "adamerging", fast)
    result = compare(base, finetuned, data, methods=["fisher", "adamerging", "lorahub"], fit=3, samples=2,
                     max_tokens=24, batch_size=2, dtype="float32", device="cpu", progress=False, tune=None)
    assert np.isfinite(result.loss.sel({"method": ["fisher", "adamerging", "lorahub"]}).values).all()
    details = dict(zip(result.method.values, result.detail.values))
    assert details["lorahub"].startswith("w math=") and "3 steps" in details["adamerging"]
    assert "diagonal Fishers" in details["fisher"]


def test_cli_merge_with_a_learned_method_and_its_options(llama, tmp_path):
    """`diag merge --method adamerging --option …`: the data step's options reach it (the closed form's
    --granularity does not); a bad option value is a user error."""
    from typer.testing import CliRunner

    from submerge.cli.main import app

    _, base, finetuned, data = llama
    common = ["-m", base, *[part for t, p in finetuned.items() for part in ("-f", f"{t}={p}")],
              *[part for t, p in data.items() for part in ("--data", f"{t}={p}")], "--samples", "2", "--max-tokens",
              "16", "--no-progress"]
    out = tmp_path / "ada"
    result = CliRunner().invoke(app, ["merge", "--method", "adamerging", "--option", "steps=1", "--option",
                                      "granularity=task", *common, "--out", str(out)])
    assert result.exit_code == 0, result.output
    record = yaml.safe_load((out / "submerge_merge.yaml").read_text())
    assert record["adamerging"]["granularity"] == "task" and record["adamerging"]["steps"] == 1
    bad = CliRunner().invoke(app, ["merge", "--method", "lorahub", "--option", "steps=many", *common, "--out",
                                   str(tmp_path / "bad")])
    assert bad.exit_code != 0 and "cannot read 'many' as int" in bad.output

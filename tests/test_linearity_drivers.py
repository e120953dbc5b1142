"""The linearity drivers (Non-linearity Score, Projection Distance, closed-form α) on real module replays.

Models are the tiny float32 Llama of tests/conftest.py (`llama_kit`, a real 3-step fine-tune on
"math") plus a second fine-tune on "code" and a hand-edited checkpoint that changes layer 0 only,
all loaded in float64. Reference numbers are computed here without the capture engine: full
forwards of models whose weights are set by hand to θ0 + (k/N)τ (`load_state_dict`), closed forms,
and a direct least-squares solve. τ is the float32 difference of the float32 checkpoints, as the
task-vector reader defines it.
"""

from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from submerge.diagnostics import toy
from submerge.diagnostics.base_model import BaseModel
from submerge.diagnostics.capture import ParameterSource, Recorded, record_inputs, replay
from submerge.diagnostics.checkpoints import StateDictReader
from submerge.diagnostics.execution import EngineError, LocalEngine, RayEngine, RunSettings
from submerge.diagnostics.experiment import Experiment
from submerge.diagnostics.linearity import (
    LINEARITY,
    alpha,
    nonlinearity,
    nonlinearity_score,
    projection,
)
from submerge.diagnostics.modules import Submodule, find_submodules, get_module
from submerge.diagnostics.replay import replay_variants
from submerge.diagnostics.store import Store
from submerge.diagnostics.task_vectors import TaskVectorReader

SAMPLES = 3
STEPS = 10
TASKS = ("math", "code")


@pytest.fixture(scope="module")
def kit(llama_kit, tmp_path_factory):
    """Base, fine-tunes {math, code}, a fine-tune that changes only layer 0, and task data."""
    root = tmp_path_factory.mktemp("linearity_drivers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code_dir = toy.finetune(llama_kit.base_dir, root / "code", "code", steps=3, seed=1)
    code_data = toy.write_task_data(root / "code.jsonl", "code", count=6)
    edited_dir = root / "layer0_only"
    shutil.copytree(llama_kit.base_dir, edited_dir)
    tensors = load_file(edited_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in tensors:
        if ".layers.0." in name:
            tensors[name] = tensors[name] + 0.02 * torch.randn(tensors[name].shape, generator=generator)
    save_file(tensors, edited_dir / "model.safetensors", metadata={"format": "pt"})
    return SimpleNamespace(base=llama_kit.base_dir, finetuned={"math": llama_kit.finetuned_dir, "code": code_dir},
                           edited=edited_dir, data={"math": llama_kit.data_path, "code": code_data})


def load(kit, finetuned: dict[str, Path], **options) -> Experiment:
    data = {task: str(kit.data[task]) for task in finetuned}
    settings = {"samples": SAMPLES, "max_tokens": 48, "batch_size": 2, "dtype": "float64", "device": "cpu"}
    settings.update(options)
    return Experiment.load(str(kit.base), {t: str(p) for t, p in finetuned.items()}, data, **settings)


@pytest.fixture(scope="module")
def two_tasks(kit) -> Experiment:
    return load(kit, kit.finetuned)


@pytest.fixture(scope="module")
def math_only(kit) -> Experiment:
    experiment = load(kit, {"math": kit.finetuned["math"]})
    assert any(bool((b.attention_mask == 0).any()) for b in experiment.batches["math"]), "math data should pad"
    return experiment


# ------------------------------------------------------------------ references without the engine


def eq19_by_hand(rows: list[np.ndarray]) -> float:
    """Seed 002 Eq. 19 written out: Σ_i Σ_j (‖F_i − F_j‖ / ‖F_N − F_0‖ − |i − j|/N)²."""
    steps = len(rows) - 1
    end = np.linalg.norm(rows[steps] - rows[0])
    return float(sum((np.linalg.norm(rows[i] - rows[j]) / end - abs(i - j) / steps) ** 2
                     for i in range(steps + 1) for j in range(steps + 1)))


def checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(Path(directory) / "model.safetensors")


def task_vector(base: dict, tuned: dict) -> dict[str, torch.Tensor]:
    """τ = θ_t − θ0 in float32 (as TaskVectorReader computes it), then float64."""
    return {name: (tuned[name] - base[name]).double() for name in base}


def interpolated_model(base_dir: Path):
    """A second, independent float64 copy of the base model whose weights the tests set by hand."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64).eval()
    model.requires_grad_(False)
    return model


def set_weights(model, base: dict, deltas: dict[str, torch.Tensor], coefficient: float, selected) -> None:
    """load_state_dict(θ0 + coefficient·τ on the names `selected` accepts, θ0 elsewhere)."""
    state = {name: base[name].double() + coefficient * deltas[name] if selected(name) else base[name].double()
             for name in base}
    model.load_state_dict(state, strict=True)


def real_token_features(output: torch.Tensor, mask: torch.Tensor, row: int) -> np.ndarray:
    return output[row][mask[row].bool()].reshape(-1).double().numpy()


def scores_of(dataset, task: str, module: str) -> np.ndarray:
    return dataset.nonlinearity_score.sel(task=task, module=module).values


# ------------------------------------------------------------------ 1. linear maps are exactly linear


@pytest.fixture(scope="module")
def every_level(two_tasks):
    """The driver at every level, both fine-tunes (also the toy table of the last test)."""
    return nonlinearity(two_tasks, levels=("model", "layer", "attn", "mlp", "head", "linear"), steps=STEPS,
                        progress=False)


@pytest.fixture
def tasks_held(monkeypatch) -> list[int]:
    """After every `ParameterSource.deltas` call, how many tasks' τ the source holds (appended to this list)."""
    held: list[int] = []
    deltas = ParameterSource.deltas

    def counted(self, path, task, names=None):
        out = deltas(self, path, task, names)
        held.append(len({key[0] for key in self._cache}))
        return out

    monkeypatch.setattr(ParameterSource, "deltas", counted)
    return held


def test_linearity_holds_one_tasks_vectors_at_a_time_with_the_same_scores(two_tasks, every_level, tasks_held,
                                                                          monkeypatch):
    """`diag linearity` keeps the task vectors of one task at a time where a block's τ is large
    (`ParameterSource(tasks_kept=1)`: a 7B block's τ is 0.8 GB a task, and the layer's units read it again per
    task; here the budget `TAU_KEPT_BYTES` is lowered to nothing); its scores and noise floors are bitwise those of
    a source that keeps every task's τ for the whole layer, which is what the default budget does for small
    blocks."""
    from submerge.diagnostics import placement

    held = tasks_held
    levels = ("model", "layer", "attn", "mlp", "head", "linear")
    default = nonlinearity(two_tasks, levels=levels, steps=STEPS, progress=False)
    assert max(held) == len(TASKS)  # the toy's blocks are small: every task's τ kept
    held.clear()
    monkeypatch.setattr(placement, "TAU_KEPT_BYTES", 0)
    one = nonlinearity(two_tasks, levels=levels, steps=STEPS, progress=False)
    assert held and max(held) == 1
    held.clear()
    monkeypatch.setattr(ParameterSource, "_ask_for", lambda self, task: None)  # keeps every task's τ
    every = nonlinearity(two_tasks, levels=levels, steps=STEPS, progress=False)
    assert max(held) == len(TASKS)  # the count above could have failed
    for name in ("nonlinearity_score", "nonlinearity_floor"):
        np.testing.assert_array_equal(one[name].values, every[name].values)
        np.testing.assert_array_equal(one[name].values, every_level[name].values)
        np.testing.assert_array_equal(one[name].values, default[name].values)


def test_a_gpu_keeps_the_task_vectors_its_free_memory_allows(monkeypatch):
    """On a GPU the kept τ lives on the device: the budget is a quarter of its free memory where that is more than
    the host's `TAU_KEPT_BYTES` (a 7B block's τ is 0.8 GB a task); on the CPU it is `TAU_KEPT_BYTES`."""
    from submerge.diagnostics.placement import TAU_KEPT_BYTES, tau_kept_bytes

    gib = 1 << 30
    assert tau_kept_bytes(torch.device("cpu")) == TAU_KEPT_BYTES
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * gib, 141 * gib))
    assert tau_kept_bytes(torch.device("cuda", 0)) == 10 * gib  # an H200 with a 7B base loaded: every task's τ
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * gib, 24 * gib))
    assert tau_kept_bytes(torch.device("cuda", 0)) == TAU_KEPT_BYTES  # a full card: no less than on the host


def test_each_ray_worker_keeps_the_task_vectors_its_own_device_allows(two_tasks, monkeypatch):
    """A Ray worker asks `tasks_kept_on` for its own device, from the driver's minimum: a CPU driver that keeps one
    task's τ hands its GPU workers the minimum, not its own count (the worker built in this process here)."""
    from submerge.diagnostics import pipeline, placement
    from submerge.diagnostics.execution import RunSettings
    from submerge.diagnostics.linearity.sweep import Sweep

    class InProcess:  # what `RayEngine.actor_class` gives, without Ray
        def __init__(self, cls):
            self.cls = cls

        def remote(self, *args):
            return self.cls(*args)

    class Engine:
        report, workers, device, threads = None, 1, "cpu", torch.get_num_threads()

        def actor_class(self, cls):
            return InProcess(cls)

    monkeypatch.setattr(placement, "TAU_KEPT_BYTES", 0)  # the driver's device: room for none, so the minimum
    sweep = Sweep(two_tasks, ("layer",), "linearity", {}, RunSettings(progress=False), tasks_kept=1)
    assert sweep.tasks_kept == 1 and sweep.source.tasks_kept == 1
    block = two_tasks.base.model.get_submodule(two_tasks.arch.layer_path(0))
    block_bytes = 4 * sum(p.numel() for p in block.parameters())
    monkeypatch.setattr(placement, "tau_kept_bytes", lambda device: 5 * block_bytes)  # the worker's: room for five
    (worker,) = pipeline.Pipeline(sweep, Engine()).actors
    assert worker.source.tasks_kept == 5
    monkeypatch.setattr(placement, "tau_kept_bytes", lambda device: 0)
    assert pipeline.Pipeline(sweep, Engine()).actors[0].source.tasks_kept == 1
    unbounded = Sweep(two_tasks, ("layer",), "linearity", {}, RunSettings(progress=False))  # a driver keeping all
    assert unbounded.source.tasks_kept is None and pipeline.Pipeline(unbounded, Engine()).actors[0].source.tasks_kept is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_linearity_on_a_gpu_with_room_keeps_every_tasks_vectors_with_the_same_scores(kit, tasks_held, monkeypatch):
    """On CUDA the layer's units share every task's τ even where the host budget would keep one (lowered to
    nothing here), and the scores are bitwise those of a run that keeps one."""
    from submerge.diagnostics import placement

    held = tasks_held
    monkeypatch.setattr(placement, "TAU_KEPT_BYTES", 0)
    experiment = load(kit, kit.finetuned, dtype="float32", device="cuda")
    roomy = nonlinearity(experiment, levels=("layer", "attn", "mlp"), steps=STEPS, progress=False, floor_samples=0)
    assert max(held) == len(TASKS)
    held.clear()
    monkeypatch.setattr(placement, "tau_kept_bytes", lambda device: 0)
    one = nonlinearity(experiment, levels=("layer", "attn", "mlp"), steps=STEPS, progress=False, floor_samples=0)
    assert max(held) == 1
    np.testing.assert_array_equal(roomy.nonlinearity_score.values, one.nonlinearity_score.values)


def test_linear_maps_score_zero_through_replay(two_tasks, every_level):
    experiment = two_tasks
    source = experiment.parameter_source()
    linears = find_submodules(experiment.base.model, ("linear",), arch=experiment.arch)
    assert {m.name.rsplit(".", 1)[1] for m in linears} >= {"q_proj", "o_proj", "down_proj"}
    positions = {index: index for index in range(SAMPLES)}
    for task in TASKS:
        recorded = record_inputs(experiment.base.model, experiment.arch, [m.path for m in linears],
                                 experiment.batches[task])
        for module in linears:
            replayed = replay_variants(source, experiment.arch, module.path, recorded[module.path],
                                       [{task: k / STEPS} for k in range(STEPS + 1)])
            seen = 0
            for index, trajectory in replayed.of(module).trajectories():
                assert index in positions
                assert float(torch.linalg.vector_norm(trajectory[-1] - trajectory[0])) > 1e-6, module.name
                assert nonlinearity_score(trajectory) <= 1e-9, (task, module.name)
                seen += 1
            assert seen == SAMPLES
    # the driver itself, same modules
    linear_scores = every_level.nonlinearity_score.where(every_level.level == "linear", drop=True)
    assert linear_scores.sizes["module"] == len(linears)
    assert np.all(np.isfinite(linear_scores.values))
    assert float(linear_scores.max()) <= 1e-9


def test_projection_distance_of_linear_maps_is_zero(two_tasks):
    result = projection(two_tasks, levels=("linear", "mlp"), alphas=(0.5, 1.0), progress=False)
    linear = result.where(result.level == "linear", drop=True)
    assert linear.sizes["module"] == 7 * two_tasks.arch.num_layers  # q k v o gate up down
    assert linear.sizes["combo"] == 4  # {0.5, 1}²
    assert float(np.abs(linear.projection_distance).max()) <= 1e-9
    np.testing.assert_allclose(linear.cosine_merge.values, 1.0, atol=1e-9)
    # the gated MLP (a product of two maps of the parameters) is not linear: the test can fail
    mlp = result.where(result.level == "mlp", drop=True)
    assert float(mlp.projection_distance.min()) > 1e-9


def test_float64_models_are_interpolated_in_float64(kit, math_only):
    # θ0 + aτ of a float64 model is formed in float64 (rounding it to float32 moves a weight by ~1e-9,
    # which would put a ~1e-14 floor under the scores of exactly linear maps)
    path = f"{math_only.arch.mlp_path(1)}.down_proj"
    base = checkpoint(kit.base)
    deltas = task_vector(base, checkpoint(kit.finetuned["math"]))
    params = math_only.parameter_source().variant(path, {"math": 0.3})
    expected = base[f"{path}.weight"].double() + 0.3 * deltas[f"{path}.weight"]
    assert params["weight"].dtype == torch.float64
    torch.testing.assert_close(params["weight"], expected, rtol=0, atol=1e-15)


# ------------------------------------------------------------------ 2. a module with a known curve


class Squared(nn.Module):
    """f(x; w) = x ⊙ w²: along w0 + aτ the output moves on a parabola."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)

    def forward(self, x):
        return x * self.weight**2


def squared_scores(base_weight: torch.Tensor, tuned_weight: torch.Tensor, inputs: torch.Tensor,
                   mask: torch.Tensor, steps: int) -> list[float]:
    """Scores of the Squared module through ParameterSource + replay_variants + Outputs.trajectories."""
    holder = nn.Module()
    holder.squared = Squared(base_weight)
    base_reader = StateDictReader("base", Path("base"), {"squared.weight": base_weight})
    tuned_reader = StateDictReader("tuned", Path("tuned"), {"squared.weight": tuned_weight})
    base = BaseModel(model=holder, tokenizer=None, reader=base_reader, spec="base")
    source = ParameterSource(base, {"t": TaskVectorReader("t", base_reader, tuned_reader)})
    recorded = [Recorded((inputs,), {}, mask, list(range(inputs.shape[0])))]
    replayed = replay_variants(source, None, "squared", recorded, [{"t": k / steps} for k in range(steps + 1)])
    module = Submodule("squared", "linear", 0, "squared")
    return [nonlinearity_score(trajectory) for _, trajectory in replayed.of(module).trajectories()]


def test_parabola_by_hand():
    # w0 = 0, τ = 1, N = 2: F = a² ∈ {0, 1/4, 1}, ‖F_2 − F_0‖ = 1;
    # pairs (0,1): (1/4 − 1/2)², (1,2): (3/4 − 1/2)², (0,2): 0; both orders: 4/16
    inputs = torch.ones(1, 1, 1, dtype=torch.float64)
    scores = squared_scores(torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64), inputs,
                            torch.ones(1, 1, dtype=torch.bool), steps=2)
    assert scores == [pytest.approx(0.25, abs=1e-15)]


def test_parabola_closed_form():
    # F(a) = (w0 + aτ)² = w0² + a·u + a²·v with u = 2 w0 τ, v = τ², so
    # F_i − F_j = (a_i − a_j)(u + (a_i + a_j) v) and Eq. 19 becomes
    # Σ_ij (|i−j|/N)² (‖u + s_ij v‖ / ‖u + v‖ − 1)², s_ij = (i + j)/N.
    base_weight = torch.tensor([1.0, -0.5, 2.0, 0.25], dtype=torch.float64)  # exact in float32: τ is exact
    delta = torch.tensor([0.5, 1.0, -0.75, 2.0], dtype=torch.float64)
    u, v = (2 * base_weight * delta).numpy(), (delta**2).numpy()

    def norm_along(s):
        return math.sqrt(u @ u + 2 * s * (u @ v) + s * s * (v @ v))

    expected = sum((abs(i - j) / STEPS) ** 2 * (norm_along((i + j) / STEPS) / norm_along(1.0) - 1) ** 2
                   for i in range(STEPS + 1) for j in range(STEPS + 1))
    # sample 0: three real tokens of ones; sample 1: two real tokens and a padded one whose input
    # would bend the curve differently (so it must be masked out)
    inputs = torch.ones(2, 3, 4, dtype=torch.float64)
    inputs[1, 2] = torch.tensor([1.0, 0.0, 0.0, 5.0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    scores = squared_scores(base_weight, base_weight + delta, inputs, mask, STEPS)
    assert expected > 1e-3
    np.testing.assert_allclose(scores, [expected, expected], rtol=1e-12)
    unmasked = squared_scores(base_weight, base_weight + delta, inputs, torch.ones(2, 3, dtype=torch.bool), STEPS)
    assert abs(unmasked[1] - expected) > 1e-6


# ------------------------------------------------------------------ 3. unchanged modules


def test_unchanged_modules_are_nan_and_flagged(kit, tmp_path):
    data = {"edited": str(kit.data["math"])}
    experiment = Experiment.load(str(kit.base), {"edited": str(kit.edited)}, data, samples=SAMPLES, max_tokens=48,
                                 batch_size=2, dtype="float64", device="cpu")
    store = Store(tmp_path / "edited.zarr")
    result = nonlinearity(experiment, levels=("layer", "attn", "head", "mlp", "model"), steps=4, store=store,
                          progress=False)
    for written in (result, store.dataset("linearity")):
        scores = written.nonlinearity_score.sel(task="edited")
        flags = written.unchanged.sel(task="edited")
        layer = written.layer.values
        later = layer >= 1
        assert later.sum() == (experiment.arch.num_layers - 1) * (3 + experiment.arch.num_heads)
        assert bool(flags.values[later].all())
        assert np.isnan(scores.values[later]).all()
        touched = ~later  # layer 0 and the model (layer −1)
        assert not bool(flags.values[touched].any())
        assert np.isfinite(scores.values[touched]).all()
    assert store.is_complete("linearity")


# ------------------------------------------------------------------ 4. heads


def test_head_scores_match_full_forwards(kit, math_only):
    experiment = math_only
    layer = 1
    result = nonlinearity(experiment, levels=("head",), steps=STEPS, progress=False)
    arch = experiment.arch
    base = checkpoint(kit.base)
    deltas = task_vector(base, checkpoint(kit.finetuned["math"]))
    prefix = f"model.layers.{layer}.self_attn."
    model = interpolated_model(kit.base)
    o_proj = model.model.layers[layer].self_attn.o_proj
    seen = {}
    handle = o_proj.register_forward_pre_hook(lambda module, args: seen.__setitem__("x", args[0]))
    dim = arch.head_dim
    features = {}  # (record index, head) -> list over k
    try:
        for k in range(STEPS + 1):
            set_weights(model, base, deltas, k / STEPS, lambda name: name.startswith(prefix))
            weight = model.state_dict()[prefix + "o_proj.weight"]
            for batch in experiment.batches["math"]:
                model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
                for h in range(arch.num_heads):
                    contribution = seen["x"][..., h * dim:(h + 1) * dim] @ weight[:, h * dim:(h + 1) * dim].T
                    for row, index in enumerate(batch.sample_index):
                        features.setdefault((index, h), []).append(
                            real_token_features(contribution, batch.attention_mask, row))
    finally:
        handle.remove()
    checked = 0
    for (index, h), rows in features.items():
        driver = scores_of(result, "math", f"layers.{layer}.attn.head.{h}")[list(result.sample.values).index(index)]
        expected = eq19_by_hand(rows)
        assert expected > 1e-6
        assert abs(driver - expected) <= 1e-6, (index, h, driver, expected)
        checked += 1
    assert checked == SAMPLES * arch.num_heads


# ------------------------------------------------------------------ 5. closed-form α


def brute_force_alpha(deltas_by_input: dict[str, list[list[np.ndarray]]], balance: bool) -> np.ndarray:
    """argmin_α Σ_a E_{x∈H_a} w(x) ‖Σ_b α_b Δf_b(x) − Δf_a(x)‖² by np.linalg.lstsq on the stacked vectors.

    Eq. 22 (w = 1) or Eq. 33 linearised (w = 1 / ((1/T) Σ_t ‖Δf_t(x)‖²)).
    deltas_by_input[a][s][b] = Δf_b(x_s), x_s the s-th input of task a.
    """
    design, target = [], []
    for a, (input_task, samples) in enumerate(deltas_by_input.items()):
        for sample in samples:
            weight = 1.0 / np.mean([d @ d for d in sample]) if balance else 1.0
            scale = math.sqrt(weight / len(samples))
            design.append(scale * np.stack(sample, axis=1))  # (D, T)
            target.append(scale * sample[a])
    solution, *_ = np.linalg.lstsq(np.concatenate(design), np.concatenate(target), rcond=None)
    return solution


def module_deltas(kit, experiment, path: str) -> dict[str, list[list[np.ndarray]]]:
    """Δf_t(x) = f(x; θ0 + τ_t) − f(x; θ0) of the module at `path`, replayed with hand-built parameters."""
    base = checkpoint(kit.base)
    tuned = {t: task_vector(base, checkpoint(kit.finetuned[t])) for t in TASKS}
    module = get_module(experiment.base.model, path)
    out = {}
    for input_task in TASKS:
        recorded = record_inputs(experiment.base.model, experiment.arch, [path], experiment.batches[input_task])
        samples = []
        for rec in recorded[path]:
            base_output = replay(module, rec)
            per_task = []
            for t in TASKS:
                params = {local: p + tuned[t][f"{path}.{local}"] for local, p in module.named_parameters()}
                per_task.append(replay(module, rec, params) - base_output)
            for row in range(base_output.shape[0]):
                samples.append([real_token_features(d, rec.token_mask, row) for d in per_task])
        out[input_task] = samples
    return out


def model_deltas(kit, experiment) -> dict[str, list[list[np.ndarray]]]:
    """Δf_t(x) of the whole model (final hidden states) by full forwards of θ0 and θ0 + τ_t."""
    base = checkpoint(kit.base)
    tuned = {t: task_vector(base, checkpoint(kit.finetuned[t])) for t in TASKS}
    model = interpolated_model(kit.base)
    hidden = {}
    for variant in (None, *TASKS):
        set_weights(model, base, tuned[variant] if variant else {}, 1.0, lambda name, v=variant: v is not None)
        hidden[variant] = {t: [model.model(input_ids=b.input_ids, attention_mask=b.attention_mask,
                                           use_cache=False).last_hidden_state for b in experiment.batches[t]]
                           for t in TASKS}
    out = {}
    for input_task in TASKS:
        samples = []
        for b, batch in enumerate(experiment.batches[input_task]):
            for row in range(batch.input_ids.shape[0]):
                samples.append([real_token_features(hidden[t][input_task][b] - hidden[None][input_task][b],
                                                    batch.attention_mask, row) for t in TASKS])
        out[input_task] = samples
    return out


@pytest.mark.parametrize("balance", [False, True], ids=["eq22", "eq33"])
def test_alpha_is_the_least_squares_minimiser(kit, two_tasks, balance):
    experiment = two_tasks
    modules = alpha(experiment, granularity="attn-mlp", balance=balance, progress=False)
    whole = alpha(experiment, granularity="model", balance=balance, progress=False)
    checked = 0
    for name, path in zip(modules.module.values, [m.path for m in find_submodules(
            experiment.base.model, ("attn", "mlp"), arch=experiment.arch)]):
        expected = brute_force_alpha(module_deltas(kit, experiment, path), balance)
        np.testing.assert_allclose(modules.alpha.sel(granularity="attn-mlp", module=name).values, expected,
                                   rtol=0, atol=1e-8, err_msg=name)
        assert not bool(modules.least_squares.sel(granularity="attn-mlp", module=name))
        checked += 1
    assert checked == 2 * experiment.arch.num_layers
    expected = brute_force_alpha(model_deltas(kit, experiment), balance)
    np.testing.assert_allclose(whole.alpha.sel(granularity="model", module="model").values, expected,
                               rtol=0, atol=1e-8)
    # the driver's linearised objective at its α is no larger than at the uniform weights
    assert bool((modules.linearized_objective_alpha <= modules.linearized_objective_uniform + 1e-12).all())


# ------------------------------------------------------------------ 6. resume; the model level


class Killed(RuntimeError):
    pass


def test_killed_run_resumes_to_the_same_values(math_only, tmp_path):
    levels = ("layer", "attn", "mlp", "model")
    calls = []

    def kill_after_two(unit):
        calls.append(unit)
        if len(calls) == 2:
            raise Killed(unit)

    store = Store(tmp_path / "resumed.zarr")
    with pytest.raises(Killed):
        nonlinearity(math_only, levels=levels, steps=4, store=store, progress=False, on_unit=kill_after_two)
    assert not store.is_complete("linearity")
    calls.clear()
    resumed = nonlinearity(math_only, levels=levels, steps=4, store=store, progress=False,
                           on_unit=calls.append)
    assert calls == [f"layers.{i}.mlp" for i in range(2, math_only.arch.num_layers)] + ["model"]  # only the rest
    # a single run, recording one layer at a time (capture budget of 1 byte: one layer per chunk)
    single = nonlinearity(math_only, levels=levels, steps=4, progress=False, capture_budget=1)
    for dataset in (resumed, store.dataset("linearity")):
        assert list(dataset.module.values) == list(single.module.values)
        np.testing.assert_array_equal(dataset.nonlinearity_score.values, single.nonlinearity_score.values)
        np.testing.assert_array_equal(dataset.unchanged.values, single.unchanged.values)
    assert store.is_complete("linearity")


def test_model_level_matches_full_forwards_of_interpolated_models(kit, math_only):
    result = nonlinearity(math_only, levels=("model",), steps=STEPS, progress=False)
    base = checkpoint(kit.base)
    deltas = task_vector(base, checkpoint(kit.finetuned["math"]))
    model = interpolated_model(kit.base)
    features = {}
    for k in range(STEPS + 1):
        set_weights(model, base, deltas, k / STEPS, lambda name: True)
        for batch in math_only.batches["math"]:
            hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 use_cache=False).last_hidden_state
            for row, index in enumerate(batch.sample_index):
                features.setdefault(index, []).append(real_token_features(hidden, batch.attention_mask, row))
    driver = scores_of(result, "math", "model")
    assert len(features) == SAMPLES
    for index, rows in features.items():
        expected = eq19_by_hand(rows)
        assert expected > 1e-3
        assert abs(driver[list(result.sample.values).index(index)] - expected) <= 1e-6


# ------------------------------------------------------------------ 7. the toy table


def test_toy_table(every_level):
    table = LINEARITY.summary(every_level)
    print("\nNon-linearity Score, mean ± std over modules and samples (toy Llama, float64, N = 10)")
    for level, row in table.iterrows():
        print(f"  {level:7s}" + "".join(f"  {task}: {row[(task, 'mean')]:.3e} ± {row[(task, 'std')]:.1e}"
                                        for task in TASKS))
    assert list(table.columns) == [(task, stat) for task in TASKS for stat in ("mean", "std", "floor", "flag")]
    assert table.xs("floor", axis=1, level=1).isna().all().all()  # float64 compute: no floor to measure
    assert list(table.index) == ["model", "layer", "attn", "mlp", "head", "linear"]
    scores = every_level.nonlinearity_score.values
    assert np.isfinite(scores).all() and (scores >= 0).all()
    assert not bool(every_level.unchanged.any())
    # the one ordering that is exact: linear maps are linear in their weights, nothing else is
    for task in TASKS:
        assert table.loc["linear", (task, "mean")] <= 1e-9
        for level in ("model", "layer", "attn", "mlp", "head"):
            assert table.loc[level, (task, "mean")] > 1e-6, (level, task)


# ------------------------------------------------------------------ scale-out: the pipeline over blocks on Ray


def assert_same_dataset(dataset, reference) -> None:
    assert [str(m) for m in dataset.module.values] == [str(m) for m in reference.module.values]
    for name, variable in reference.data_vars.items():
        assert variable.dtype == dataset[name].dtype, name
        assert np.array_equal(variable.values, dataset[name].values, equal_nan=True), name


@pytest.mark.xdist_group("ray")  # one xdist worker runs every Ray test (conftest: --dist loadgroup)
def test_linearity_and_alpha_on_ray_equal_one_process(two_tasks, tmp_path, monkeypatch):
    """2 local Ray workers (blocks 0–1 and 2) give bitwise the single-process linearity and α, in the store too,
    though the driver is killed after its first unit and, on resuming, a worker is killed mid-run; the
    Projection Distance too."""
    ray = pytest.importorskip("ray")
    import os
    import signal

    from submerge.diagnostics import pipeline as scale_out

    levels = ("model", "layer", "attn", "head", "mlp")
    options = {"levels": levels, "steps": 3, "progress": False}
    fresh = nonlinearity(two_tasks, **options)
    fresh_alpha = {granularity: alpha(two_tasks, granularity=granularity, progress=False)
                   for granularity in ("head-mlp", "model")}
    grid = {"levels": ("model", "layer", "mlp"), "alphas": (0.5, 1.0), "progress": False}
    fresh_projection = projection(two_tasks, **grid)
    killed, submit = [], scale_out.Pipeline.submit

    def submit_then_kill_the_last_worker(self, measure):
        pid = ray.get(self.actors[-1].stats.remote())["pid"]
        submitted = submit(self, measure)  # its layers are now queued or running on that process
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        return submitted

    def kill_the_driver(label):
        raise Killed(label)

    store, report = Store(tmp_path / "ray.zarr"), {}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(Killed):
            nonlinearity(two_tasks, **options, store=store, engine=RayEngine("auto", workers=2), on_unit=kill_the_driver)
        monkeypatch.setattr(scale_out.Pipeline, "submit", submit_then_kill_the_last_worker)
        resumed = nonlinearity(two_tasks, **options, store=store, engine=RayEngine("auto", workers=2, report=report))
        monkeypatch.setattr(scale_out.Pipeline, "submit", submit)
        spread_alpha = {granularity: alpha(two_tasks, granularity=granularity, progress=False, engine=RayEngine(workers=2))
                        for granularity in fresh_alpha}
        spread_projection = projection(two_tasks, **grid, engine=RayEngine(workers=2))
        with pytest.raises(EngineError, match="3 Ray workers need 3 CPUs"):  # would wait forever for a third CPU
            nonlinearity(two_tasks, **options, engine=RayEngine(workers=3))
        assert ray.is_initialized()  # a Ray this process started itself is left running
    finally:
        ray.shutdown()
    assert len(killed) == 1 and killed[0] not in [worker["pid"] for worker in report["workers"]]  # restarted
    assert [worker["layers"] for worker in report["workers"]] == [[0, 1], [2, 2]]
    for dataset in (resumed, store.dataset("linearity")):
        assert_same_dataset(dataset, fresh)
    assert store.is_complete("linearity")
    assert store.dataset("linearity").attrs["provenance"]["engine"]["workers"] == 2
    for granularity, dataset in spread_alpha.items():
        assert_same_dataset(dataset, fresh_alpha[granularity])
    assert_same_dataset(spread_projection, fresh_projection)


def test_run_settings_are_checked(math_only):
    with pytest.raises(TypeError, match=r"unknown run setting\(s\) \['workers'\]"):
        nonlinearity(math_only, levels=("layer",), workers=2, progress=False)
    with pytest.raises(TypeError, match="not both"):
        nonlinearity(math_only, levels=("layer",), run=RunSettings(), progress=False)
    for bad in ({"workers": 0}, {"workers": 1.5}, {"threads": 0}, {"gpus_per_worker": -1}):
        with pytest.raises(EngineError):
            RayEngine(**bad)
    with pytest.raises(EngineError, match="threads=0"):
        LocalEngine(threads=0)


def test_a_base_without_weights_needs_ray(kit):
    experiment = load(kit, {"math": kit.finetuned["math"]}, weights=False)
    assert experiment.device.type == "meta"
    with pytest.raises(ValueError, match="without weights"):
        nonlinearity(experiment, levels=("layer",), progress=False)


def test_drivers_on_records_regrouped_by_length_give_what_file_order_gives(kit, tmp_path, monkeypatch):
    """Linearity, the Projection Distance and α run on each task's records regrouped by length (fewer padded
    positions, the same records): per sample and module the values of the same drivers on the records in file
    order, to float64 rounding, and their groups say so in their settings. A store made in file order (before
    the regrouping) is not resumed with regrouped values: the setting is named."""
    from submerge.diagnostics import experiment as experiment_module
    from submerge.diagnostics.data import regrouped_rule
    from submerge.diagnostics.store import StoreError

    # the toy records are short: without the per-batch overhead, regrouping splits them where padding is saved
    monkeypatch.setattr(experiment_module, "REPLAY_BATCH_OVERHEAD_TOKENS", 0)
    experiment = load(kit, kit.finetuned, samples=6, batch_size=6)
    regrouped = experiment.regrouped()
    padded = {name: sum(b.input_ids.numel() for task in e.batches for b in e.batches[task])
              for name, e in (("file", experiment), ("regrouped", regrouped))}
    assert padded["regrouped"] < padded["file"]  # the data's lengths vary: regrouping drops padding
    assert len(regrouped.batches["math"]) > len(experiment.batches["math"])
    assert regrouped.regrouped() is regrouped and regrouped.settings["batches"] == regrouped_rule(0)
    assert sorted(i for b in regrouped.batches["math"] for i in b.sample_index) == experiment.data["math"].indices

    def run_all(**options):
        return (nonlinearity(experiment, levels=("model", "layer", "attn", "mlp", "head"), steps=4, progress=False,
                             **options),
                projection(experiment, levels=("model", "layer", "mlp"), alphas=(0.5, 1.0), progress=False),
                alpha(experiment, granularity="attn-mlp", progress=False))

    new = run_all()
    with monkeypatch.context() as patch:
        patch.setattr(Experiment, "regrouped", lambda self, overhead=None: self)
        old = run_all(store=Store(tmp_path / "file_order.zarr"))
    for after, before in zip(new, old):
        assert after.attrs["settings"]["batches"] == regrouped_rule(0) and "batches" not in before.attrs["settings"]
        for name, variable in before.data_vars.items():
            if variable.dtype.kind == "f":
                np.testing.assert_allclose(after[name].values, variable.values, rtol=1e-9, atol=1e-12,
                                           err_msg=name)
            else:
                np.testing.assert_array_equal(after[name].values, variable.values, err_msg=name)
    with pytest.raises(StoreError, match="batches"):
        nonlinearity(experiment, levels=("model", "layer", "attn", "mlp", "head"), steps=4, progress=False,
                     store=Store(tmp_path / "file_order.zarr"))

"""`--offload`: a base larger than the GPU stays in host memory and is streamed to the device block by block.

The mechanism is the one that computes a half-precision base in float32: hooks place each stage of a forward
(the embedding stage, a block, the final norm, the head) in the compute dtype *and* on the execution device when
it starts and give it its stored tensors back when it ends; replays build each unit's θ0 + Σ c·τ on the execution
device from the host's base tensors. On this CPU-only machine the CUDA tests skip; what runs everywhere is that
the stage hooks hold one stage at a time, that `--offload` on the CPU changes nothing, and the option's plumbing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from submerge.cli.main import app
from submerge.diagnostics import capture, toy
from submerge.diagnostics.base_model import load_base_model
from submerge.diagnostics.experiment import Experiment
from submerge.diagnostics.linearity import alpha, nonlinearity
from submerge.diagnostics.modules import find_architecture
from submerge.diagnostics.placement import execution_device, is_offloaded

TASKS = ("math", "code")
LEVELS = ("model", "layer", "attn", "mlp", "head")


@pytest.fixture(scope="module")
def deep_kit(tmp_path_factory):
    """A Llama of 8 blocks whose blocks outweigh its embeddings, two fine-tunes, data for both tasks."""
    root = tmp_path_factory.mktemp("offload")
    base = toy.build_model(root / "base", "llama", layers=8, hidden=128, heads=4, kv_heads=2, intermediate=512)
    tuned = {task: str(toy.finetune(base, root / task, task, steps=2, seed=s)) for s, task in enumerate(TASKS)}
    data = {task: str(toy.write_task_data(root / f"{task}.jsonl", task, count=4)) for task in TASKS}
    return str(base), tuned, data


def _load(kit, **options) -> Experiment:
    base, tuned, data = kit
    settings = {"samples": 2, "max_tokens": 16, "batch_size": 2, "dtype": "bfloat16", "device": "cpu"} | options
    return Experiment.load(base, tuned, data, **settings)


def test_capture_places_one_stage_at_a_time(deep_kit):
    """While block i runs, block i alone is in the compute dtype (on the execution device, for an offloaded base);
    every other block is as stored: the device holds one block, not the model."""
    experiment = _load(deep_kit)
    model, arch = experiment.base.model, experiment.arch
    blocks = [model.get_submodule(arch.layer_path(i)) for i in range(arch.num_layers)]
    placed_while_running: list[list[int]] = []

    def watch(module, args):
        placed_while_running.append([j for j, block in enumerate(blocks)
                                     if any(p.dtype == torch.float32 for p in block.parameters())])

    handles = [block.register_forward_pre_hook(watch) for block in blocks]
    try:
        capture.record_inputs(model, arch, [arch.layer_path(arch.num_layers - 1)], experiment.batches["math"],
                              compute=torch.float32)
    finally:
        for handle in handles:
            handle.remove()
    batches = len(experiment.batches["math"])
    assert placed_while_running == [[i] for _ in range(batches) for i in range(arch.num_layers)]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # all given back


def test_offload_on_the_cpu_changes_nothing(deep_kit):
    plain, offloaded = _load(deep_kit), _load(deep_kit, offload=True)
    assert not is_offloaded(offloaded.base.model) and offloaded.inputs["offload"] is False
    assert execution_device(offloaded.base.model) == offloaded.device == torch.device("cpu")
    first = nonlinearity(plain, levels=("layer", "mlp"), steps=2, progress=False)
    second = nonlinearity(offloaded, levels=("layer", "mlp"), steps=2, progress=False)
    np.testing.assert_array_equal(first.nonlinearity_score.values, second.nonlinearity_score.values)


def test_offload_option_is_offered_and_recorded(deep_kit, tmp_path):
    from submerge.diagnostics.store import Store

    base, tuned, data = deep_kit
    runner = CliRunner()
    for command in ("linearity", "projection", "alpha", "eval", "compare", "merge"):
        assert "--offload" in runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output, command
    out = tmp_path / "run.zarr"
    result = runner.invoke(app, ["linearity", "-m", base, "-f", f"math={tuned['math']}", "-d", f"math={data['math']}",
                                 "-o", str(out), "--samples", "2", "--max-tokens", "16", "--steps", "2", "--levels",
                                 "layer", "--device", "cpu", "--offload", "--no-progress"])
    assert result.exit_code == 0, result.output
    provenance = Store(out).dataset("linearity").attrs["provenance"]
    assert provenance["offload"] is False and provenance["device"] == "cpu"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_offloaded_base_stays_on_the_host_and_scores_as_on_the_cpu(deep_kit):
    on_cpu = _load(deep_kit)
    expected = nonlinearity(on_cpu, levels=LEVELS, steps=4, progress=False)
    expected_alpha = alpha(on_cpu, granularity="attn-mlp", progress=False)
    offloaded = _load(deep_kit, device="cuda", offload=True)
    model = offloaded.base.model
    assert is_offloaded(model) and offloaded.device.type == "cuda" and offloaded.inputs["offload"] is True
    assert all(p.device.type == "cpu" for p in model.parameters())
    scores = nonlinearity(offloaded, levels=LEVELS, steps=4, progress=False)
    solved = alpha(offloaded, granularity="attn-mlp", progress=False)
    np.testing.assert_allclose(scores.nonlinearity_score.values, expected.nonlinearity_score.values, rtol=1e-3)
    np.testing.assert_allclose(solved.alpha.values, expected_alpha.alpha.values, rtol=1e-3)
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in model.parameters())  # given back


@needs_cuda
def test_offloaded_capture_holds_about_one_block_on_the_gpu(deep_kit):
    """Peak GPU memory of a capture and a model-level sweep: loaded whole, over the model; offloaded, lower by most of
    the model's bytes."""
    base, _, _ = deep_kit
    model_bytes = sum(p.numel() * 4 for p in load_base_model(base, dtype="float32", device="cpu").model.parameters())
    peaks = {}
    for offload in (True, False):
        experiment = _load(deep_kit, dtype="float32", device="cuda", offload=offload)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # the peak starts at what is allocated now: the model, unless offloaded
        arch = find_architecture(experiment.base.model)
        capture.record_inputs(experiment.base.model, arch, [arch.layer_path(arch.num_layers - 1)],
                              experiment.batches["math"], device=experiment.device, compute=torch.float32)
        nonlinearity(experiment, levels=("model",), steps=2, progress=False)
        peaks[offload] = torch.cuda.max_memory_allocated()
        del experiment
        torch.cuda.empty_cache()
    # what both share (recorded inputs, activations, the CUDA workspace) outweighs this small model; offloading must
    # take the model off the device but about one of its 8 blocks and the embedding stage
    assert peaks[False] >= model_bytes
    assert peaks[False] - peaks[True] >= 0.6 * model_bytes, (peaks, model_bytes)


def test_an_offloaded_units_base_weights_go_to_the_device_once_per_unit_not_once_per_point(deep_kit):
    """`ParameterSource.variant` copies an offloaded base's weights to the execution device once per unit (the
    N + 1 points of a line share the copy) and drops the copies at `clear`. Measured on the H100 before this: the
    per-point copies made offloaded linearity 2.2× the plain run at one 7B-width block. Here the "device" is the
    meta device, so the test runs on any machine; the values are checked by the CUDA tests."""
    experiment = _load(deep_kit, dtype="float32")
    source = experiment.parameter_source()
    source.device = torch.device("meta")  # weights on the host, computing elsewhere: what offload does
    path = experiment.arch.layer_path(1)
    first, again = source.variant(path, {}), source.variant(path, {})
    assert first and all(value.device.type == "meta" for value in first.values())
    assert all(again[name] is first[name] for name in first)  # the same copies: nothing moved a second time
    assert len(source._placed) == len(first)
    source.clear()
    assert not source._placed and all(source.variant(path, {})[name] is not first[name] for name in first)

"""The shared replay of a line θ0 + a·τ (`replay_line`) against the straightforward one (every point replayed on
its own θ0 + (k/N)τ), on every toy architecture: the Non-linearity Score agrees to 1e-6 relative (in float64, where
rounding is far below it), and the point a = 0 the capture keeps is bitwise the base replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from submerge.diagnostics.capture import model_outputs, record_inputs
from submerge.diagnostics.linearity import nonlinearity, projection
from submerge.diagnostics.modules import find_submodules, get_module
from submerge.diagnostics.replay import SharedMap, replay_combos, replay_line, replay_variants, shared_maps
from submerge.diagnostics.toy import ARCHITECTURES

LEVELS = ("model", "layer", "attn", "mlp", "linear")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_shared_replay_scores_match_plain_replay(toy_kit, architecture):
    experiment = toy_kit(architecture).experiment(dtype="float64")
    shared = nonlinearity(experiment, levels=LEVELS, steps=6, progress=False)
    plain = nonlinearity(experiment, levels=LEVELS, steps=6, progress=False, plain_replay=True)
    fast, slow = shared.nonlinearity_score.values, plain.nonlinearity_score.values
    assert np.isfinite(slow).sum() > 0
    np.testing.assert_array_equal(np.isnan(fast), np.isnan(slow))
    # a linear module scores 0 up to float64 rounding (≈ 1e-30), where relative agreement means nothing
    np.testing.assert_allclose(fast, slow, rtol=1e-6, atol=1e-24)


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_line_points_match_variants_and_a0_is_the_captured_output(toy_kit, architecture):
    experiment = toy_kit(architecture).experiment()
    arch, source, task = experiment.arch, experiment.parameter_source(), experiment.tasks[0]
    modules = find_submodules(experiment.base.model, ("layer", "attn", "mlp"), layers=[1], arch=arch)
    paths = [m.path for m in modules]
    recorded = record_inputs(experiment.base.model, arch, paths, experiment.batches[task], outputs=True)
    coefficients = [0.0, 0.25, 1.0, 1.5]
    for path in paths:
        line = replay_line(source, arch, path, recorded[path], task, coefficients)
        plain = replay_variants(source, arch, path, recorded[path], [{task: a} for a in coefficients])
        for a, got, want in zip(coefficients, line.outputs, plain.outputs):
            for g, w in zip(got, want):
                if a == 0:
                    assert torch.equal(g, w), path  # the capture's output is the base replay, bit for bit
                else:
                    torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-6)


def test_shared_maps_found_per_level(toy_kit):
    experiment = toy_kit("llama").experiment()
    arch, model, task = experiment.arch, experiment.base.model, experiment.tasks[0]
    paths = {"layer": arch.layer_path(0), "attn": arch.attn_path(0), "mlp": arch.mlp_path(0)}
    recorded = record_inputs(model, arch, list(paths.values()), experiment.batches[task])
    found = {level: shared_maps(get_module(model, path), recorded[path][0]) for level, path in paths.items()}
    norm = "input_layernorm"
    assert set(found["layer"]) == {SharedMap(f"self_attn.{p}", norm) for p in ("q_proj", "k_proj", "v_proj")}
    assert set(found["attn"]) == {SharedMap(p, None) for p in ("q_proj", "k_proj", "v_proj")}
    assert set(found["mlp"]) == {SharedMap(p, None) for p in ("gate_proj", "up_proj")}


@pytest.mark.parametrize("architecture", ["llama", "gemma3", "gpt2"])
def test_final_norm_output_kept_by_the_capture_is_the_base_forward(toy_kit, architecture):
    """The model level's a = 0 (the final norm's output the capture keeps) is bitwise the block-by-block base
    forward the model level replays."""
    experiment = toy_kit(architecture).experiment()
    arch, source, task = experiment.arch, experiment.parameter_source(), experiment.tasks[0]
    batches = experiment.batches[task]
    kept = record_inputs(experiment.base.model, arch, [arch.layer_path(0), arch.final_norm_path], batches,
                         outputs=True, compute=source.compute_dtype)[arch.final_norm_path]
    replayed = model_outputs(source, arch, batches, [{task: 0.0}])[0]
    for rec, want in zip(kept, replayed):
        assert torch.equal(rec.output, want)


@pytest.mark.parametrize("architecture", ["llama", "bert"])
def test_attention_points_come_from_the_block_replay_where_they_coincide(toy_kit, tmp_path, monkeypatch,
                                                                         architecture):
    """A fine-tune that leaves the block's input norm as it is (Llama: norms restored to the base's; BERT's
    attention takes the block's input itself): the attention level's points are the block replay's, and score as
    the plain replay does."""
    import shutil

    from safetensors.torch import load_file, save_file

    from submerge.diagnostics import replay as replay_module
    from submerge.diagnostics.experiment import Experiment

    kit = toy_kit(architecture)
    base = load_file(str(kit.base_dir / "model.safetensors"))
    tuned = load_file(str(kit.finetuned_dir / "model.safetensors"))
    tuned = {name: base[name] if "norm" in name.lower() else value for name, value in tuned.items()}
    folder = tmp_path / "norms_kept"
    shutil.copytree(kit.finetuned_dir, folder)
    save_file(tuned, str(folder / "model.safetensors"), metadata={"format": "pt"})
    experiment = Experiment.load(str(kit.base_dir), {"math": str(folder)}, {"math": str(kit.data_path)}, samples=4,
                                 max_tokens=48, batch_size=2, dtype="float64", device="cpu")
    taken = []
    original = replay_module._attention_from_block
    monkeypatch.setattr(replay_module, "_attention_from_block", lambda *args: taken.append(1) or original(*args))
    shared = nonlinearity(experiment, levels=("layer", "attn", "mlp"), steps=6, progress=False)
    assert len(taken) == experiment.arch.num_layers
    plain = nonlinearity(experiment, levels=("layer", "attn", "mlp"), steps=6, progress=False, plain_replay=True)
    np.testing.assert_allclose(shared.nonlinearity_score.values, plain.nonlinearity_score.values, rtol=1e-6,
                               atol=1e-24)


def test_a_points_shared_map_output_written_into_a_kept_tensor_is_bitwise_the_new_one():
    """`_at` into the tensor a line keeps for a map's output (overwritten point after point) gives what a new
    tensor holds, and that is P0 + a·P1 (+ a²·P2) to float32 rounding."""
    from submerge.diagnostics.replay import _at

    generator = torch.Generator().manual_seed(0)
    terms = tuple(torch.randn(3, 5, 7, generator=generator) * scale for scale in (1.0, 1e-3, 1e-6))
    kept = torch.empty_like(terms[0])
    for count in (2, 3):
        for a in (0.1, 0.7, 1.0):
            fresh = _at(terms[:count], a)
            assert _at(terms[:count], a, kept) is kept
            assert torch.equal(kept, fresh)
            exact = sum((a ** k) * term.double() for k, term in enumerate(terms[:count]))
            torch.testing.assert_close(fresh.double(), exact, rtol=2e-7, atol=0)


def _counted_rotary(monkeypatch, architecture: str) -> list:
    """Count the calls of the true rotary embedding of `architecture`'s modeling module (whoever stands in)."""
    import importlib

    site = importlib.import_module(f"transformers.models.{architecture}.modeling_{architecture}")
    calls, true = [], site.apply_rotary_pos_emb
    monkeypatch.setattr(site, "apply_rotary_pos_emb", lambda *args, **kwargs: calls.append(1) or true(*args, **kwargs))
    return calls


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mistral"])
def test_rotary_embedding_runs_once_per_term_and_every_point_agrees_with_the_plain_line(toy_kit, monkeypatch,
                                                                                        architecture):
    """At the layer and attention levels q and k are shared maps, so the line applies the rotary embedding to each
    of their polynomial terms once per batch (plus the first point's check) instead of at every point, and every
    point agrees with the line that applies it at every point to float32 rounding."""
    experiment = toy_kit(architecture).experiment()
    arch, source, task = experiment.arch, experiment.parameter_source(), experiment.tasks[0]
    paths = [arch.layer_path(1), arch.attn_path(1)]
    recorded = record_inputs(experiment.base.model, arch, paths, experiment.batches[task], outputs=True)
    coefficients = [k / 10 for k in range(11)]
    calls = _counted_rotary(monkeypatch, architecture)
    for path in paths:
        module = get_module(experiment.base.model, path)
        terms = max(3 if m.norm is not None else 2 for m in shared_maps(module, recorded[path][0]))
        batches = len(recorded[path])
        calls.clear()
        plain = replay_line(source, arch, path, recorded[path], task, coefficients, shared_rotary=False)
        assert len(calls) == 10 * batches  # a = 0 is the capture's output
        calls.clear()
        line = replay_line(source, arch, path, recorded[path], task, coefficients)
        assert len(calls) == (terms + 1) * batches, path
        for got, want in zip(line.outputs, plain.outputs):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-6)


def test_rotary_check_replays_plainly_where_q_and_k_are_normed_before_the_embedding(toy_kit, monkeypatch):
    """Gemma 3 normalises each head's q and k before the embedding, so they are not polynomials in a there:
    `LineRotary.of` declines it, and a LineRotary forced on it fails its first-point check and stands aside, the
    points then bitwise the plain line's."""
    from submerge.diagnostics import replay as replay_module

    experiment = toy_kit("gemma3").experiment()
    arch, source, task = experiment.arch, experiment.parameter_source(), experiment.tasks[0]
    path = arch.layer_path(1)
    recorded = record_inputs(experiment.base.model, arch, [path], experiment.batches[task], outputs=True)[path]
    module = get_module(experiment.base.model, path)
    assert replay_module.LineRotary.of(module, shared_maps(module, recorded[0])) is None
    forced = []

    def force(module, maps):
        import sys

        attention = next(sub for sub in module.modules() if "attention" in type(sub).__name__.lower())
        forced.append(replay_module.LineRotary(sys.modules[type(attention).__module__]))
        return forced[-1]

    monkeypatch.setattr(replay_module.LineRotary, "of", staticmethod(force))
    coefficients = [0.0, 0.5, 1.0]
    line = replay_line(source, arch, path, recorded, task, coefficients)
    assert forced and not forced[0].on
    plain = replay_line(source, arch, path, recorded, task, coefficients, shared_rotary=False)
    for got, want in zip(line.outputs, plain.outputs):
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_a_rotary_points_values_do_not_depend_on_which_point_is_replayed_first(toy_kit):
    """The first point replayed of a batch is where the formed embedding is checked; it gets the formed values too,
    so a point is bitwise the same whichever comes first (a Ray worker, whose capture keeps no a = 0 output,
    replays a = 0 first; one process starts at the first a > 0)."""
    experiment = toy_kit("llama").experiment()
    arch, source, task = experiment.arch, experiment.parameter_source(), experiment.tasks[0]
    path = arch.layer_path(1)
    recorded = record_inputs(experiment.base.model, arch, [path], experiment.batches[task], outputs=True)[path]
    forward = replay_line(source, arch, path, recorded, task, [0.25, 0.5, 1.0])
    backward = replay_line(source, arch, path, recorded, task, [1.0, 0.5, 0.25])
    for got, want in zip(forward.outputs, reversed(backward.outputs)):
        for g, w in zip(got, want):
            assert torch.equal(g, w)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_attention_line_takes_its_qkv_terms_from_the_block_line(toy_kit, architecture):
    """Where the block's input norm moves with τ (the toy full fine-tunes change every tensor), the attention
    level's points are not the block's, but its q/k/v terms on its own input are the block line's P0 and τ·z0: the
    block line hands them over (`ChildTerms`) and the attention's line, taking them, is bitwise the line that
    computes them, at every point, on every toy architecture; the terms go only where the inputs are bitwise equal."""
    from submerge.diagnostics.replay import attention_points_coincide, block_unit

    experiment = toy_kit(architecture).experiment()
    arch, source, task = experiment.arch, experiment.parameter_source(), experiment.tasks[0]
    modules = find_submodules(experiment.base.model, ("layer", "attn"), layers=[1], arch=arch)
    layer_path, attention = arch.layer_path(1), arch.attn_path(1)
    recorded = {task: record_inputs(experiment.base.model, arch, [layer_path, attention], experiment.batches[task],
                                    outputs=True, compute=source.compute_dtype)}
    coefficients = [0.0, 0.25, 0.5, 1.0]
    from_block: dict = {}
    served = {path: [m for m in modules if m.path == path] for path in (layer_path, attention)}
    if attention_points_coincide(source, layer_path, arch.attn_child, task, recorded[task][layer_path]):
        assert architecture == "bert"  # its attention takes the block's input: the points themselves are handed
        pytest.skip("the attention's points are the block's (test_attention_points_come_from_the_block_replay...)")
    block_unit(source, arch, layer_path, served[layer_path], recorded, from_block).points(task, coefficients)
    handed = from_block.get(("terms", task))
    assert handed, "the block's line handed no terms over"
    attention_maps = {m.name for m in shared_maps(get_module(experiment.base.model, attention),
                                                   recorded[task][attention][0])}
    assert set(handed) == attention_maps
    taken = block_unit(source, arch, attention, served[attention], recorded, from_block).points(task, coefficients)
    assert ("terms", task) not in from_block
    own = replay_line(source, arch, attention, recorded[task][attention], task, coefficients)
    for got, want in zip(taken.outputs, own.outputs):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_model_level_carried_beside_the_sweep_scores_bitwise_as_replayed_after_it(toy_kit, architecture,
                                                                                    monkeypatch, tmp_path):
    """`diag linearity` carries its model level's points through each block right after the layer's units
    (`replay.ModelStreams`), and the layer's units and the model level form each point's block variant once
    (`ParameterSource`'s kept variants): the scores and floors are bitwise those of the model level replayed after
    the sweep with every variant formed anew, on every toy architecture, with fewer entries formed. A resumed run
    (killed after its first layer: the model level and the other layers left) carries it through every block
    again, to the same scores."""
    from submerge.diagnostics import placement, replay
    from submerge.diagnostics.capture import ParameterSource
    from submerge.diagnostics.store import Store

    experiment = toy_kit(architecture).experiment()
    levels = ("model", "layer", "attn", "mlp")
    formed = []
    form = ParameterSource._form

    def counted(self, value, base, terms):
        formed.append(value.numel())
        return form(self, value, base, terms)

    monkeypatch.setattr(ParameterSource, "_form", counted)
    replayed_after, replay_model = [], replay.replay_model
    monkeypatch.setattr(replay, "replay_model", lambda *args, **kwargs: replayed_after.append(1) or replay_model(
        *args, **kwargs))
    carried = nonlinearity(experiment, levels=levels, steps=4, progress=False)
    carried_formed = sum(formed)
    assert not replayed_after  # every point of the model level came with the sweep (the floor's pass too)
    formed.clear()
    with monkeypatch.context() as before:
        before.setattr(replay.LocalLayers, "_model_variants", lambda self: None)
        before.setattr(placement, "VARIANTS_KEPT_BYTES", 0)
        after = nonlinearity(experiment, levels=levels, steps=4, progress=False)
    assert sum(formed) > carried_formed > 0 and replayed_after
    for name in ("nonlinearity_score", "nonlinearity_floor"):
        assert np.isfinite(carried[name].values).any()
        np.testing.assert_array_equal(carried[name].values, after[name].values)

    def killed_after_the_first_layer(label):
        raise KeyboardInterrupt(label)

    store = Store(tmp_path / "resumed.zarr")
    with pytest.raises(KeyboardInterrupt):
        nonlinearity(experiment, levels=levels, steps=4, progress=False, store=store,
                     on_unit=killed_after_the_first_layer)
    assert 0 < len(Store(tmp_path / "resumed.zarr").dataset("linearity").module) < carried.sizes["module"]
    replayed_after.clear()
    resumed = nonlinearity(experiment, levels=levels, steps=4, progress=False, store=store)
    assert not replayed_after
    np.testing.assert_array_equal(resumed.nonlinearity_score.values, carried.nonlinearity_score.values)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_shared_maps_first_term_is_the_captured_map_output(toy_kit, monkeypatch, architecture, dtype):
    """P0 = W0·z0 + b0 of every shared map (q/k/v of a block or an attention, gate/up of an MLP, a linear module)
    is the base's own map output the capture kept (`Recorded.maps`, `Recorded.output`): the scores of every level
    are bitwise those of a run whose capture keeps no map outputs (which computes P0 again), in fewer products."""
    from torch.utils.flop_counter import FlopCounterMode

    from submerge.diagnostics import replay as replay_module

    experiment = toy_kit(architecture).experiment(dtype=dtype)
    results, flops = {}, {}
    for kept in (True, False):
        if not kept:  # the capture keeps no map outputs (P0 computed by the line), nor does the module's output serve
            monkeypatch.setattr(replay_module, "linear_maps_in", lambda model, path: [])
            monkeypatch.setattr(replay_module, "_captured_term", lambda rec, name, compute: None)
        with FlopCounterMode(display=False) as counter:
            results[kept] = nonlinearity(experiment, levels=LEVELS, steps=4, floor_samples=0, progress=False)
        flops[kept] = counter.get_total_flops()
    scores = results[True].nonlinearity_score.values
    assert np.isfinite(scores).sum() > 0
    np.testing.assert_array_equal(scores, results[False].nonlinearity_score.values)
    assert flops[True] < flops[False], flops


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_map_outputs_are_kept_only_where_a_layers_capture_fits_the_budget(toy_kit, monkeypatch, architecture):
    """Both sides of the capture budget for the map outputs (`Sweep.keeps_map_outputs`): with a budget below one
    layer's inputs, outputs and map outputs the capture keeps none (and captures layer by layer), above it it keeps
    them; the scores are bit for bit the same, in more products without them."""
    from torch.utils.flop_counter import FlopCounterMode

    from submerge.diagnostics import replay as replay_module
    from submerge.diagnostics.linearity import sweep as sweep_module

    experiment = toy_kit(architecture).experiment()
    kept_maps, real = [], sweep_module.Sweep.keeps_map_outputs
    monkeypatch.setattr(sweep_module.Sweep, "keeps_map_outputs", lambda self: kept_maps.append(real(self)) or
                        kept_maps[-1])
    maps_seen, keep = [], replay_module.keep_shared_map_outputs
    monkeypatch.setattr(replay_module, "keep_shared_map_outputs",
                        lambda model, recorded, compute: maps_seen.append(1) or keep(model, recorded, compute))
    results, flops = {}, {}
    for budget in (1 << 30, 1):
        kept_maps.clear()
        maps_seen.clear()
        with FlopCounterMode(display=False) as counter:
            results[budget] = nonlinearity(experiment, levels=LEVELS, steps=4, floor_samples=0, progress=False,
                                           capture_budget=budget)
        flops[budget] = counter.get_total_flops()
        assert kept_maps and all(kept_maps) == (budget > 1)
        assert bool(maps_seen) == (budget > 1)
    np.testing.assert_array_equal(results[1 << 30].nonlinearity_score.values, results[1].nonlinearity_score.values)
    assert flops[1 << 30] < flops[1]


# ------------------------------------------------------------------ merged variants (`replay_combos`)


def _two_tasks(toy_kit, toy_root, architecture: str, **options):
    """The kit's base with two fine-tunes (its own, and a second trained from another seed), both on its data."""
    import warnings

    from submerge.diagnostics import toy
    from submerge.diagnostics.experiment import Experiment

    kit = toy_kit(architecture)
    second = toy_root / f"{architecture}_second"
    if not (second / "model.safetensors").exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            toy.finetune(kit.base_dir, second, "code", steps=3, seed=1)
    settings = {"samples": 3, "max_tokens": 48, "batch_size": 2, "dtype": "float32", "device": "cpu", **options}
    return Experiment.load(str(kit.base_dir), {"math": str(kit.finetuned_dir), "code": str(second)},
                           {"math": str(kit.data_path), "code": str(kit.data_path)}, **settings)


@pytest.mark.parametrize("budget", ["default", "below"])
@pytest.mark.parametrize("architecture", [a for a in ARCHITECTURES if a != "bert"])
def test_merged_variants_with_shared_maps_match_their_plain_replays(toy_kit, toy_root, architecture, budget,
                                                                     monkeypatch):
    """Both sides of `COMBO_TERMS_BYTES`: within it the shared maps' terms are formed (equal to the plain replays to
    float32 rounding); above it (the budget lowered to 0) every unit replays plainly, bit for bit."""
    from submerge.diagnostics import replay as replay_module

    if budget == "below":
        monkeypatch.setattr(replay_module, "COMBO_TERMS_BYTES", 0)
    formed = []
    terms = replay_module._combo_terms
    monkeypatch.setattr(replay_module, "_combo_terms", lambda *args, **kwargs: formed.append(1) or terms(*args, **kwargs))
    experiment = _two_tasks(toy_kit, toy_root, architecture)
    arch, source = experiment.arch, experiment.parameter_source()
    modules = find_submodules(experiment.base.model, ("layer", "attn", "mlp", "linear"), layers=[1], arch=arch)
    paths = [m.path for m in modules]
    recorded = record_inputs(experiment.base.model, arch, paths, experiment.batches["math"], outputs=True)
    variants = [{"math": 0.3, "code": 0.7}, {"math": 1.0}, {"code": 0.5}, {"math": 0.5, "code": 1.5}]
    shared_somewhere = False
    for path in paths:
        module = get_module(experiment.base.model, path)
        shared_somewhere |= bool(shared_maps(module, recorded[path][0]))
        merged = replay_combos(source, arch, path, recorded[path], variants)
        plain = replay_variants(source, arch, path, recorded[path], variants)
        for got, want in zip(merged.outputs, plain.outputs, strict=True):
            for g, w in zip(got, want, strict=True):
                if budget == "below":
                    assert torch.equal(g, w), path
                else:
                    torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-6, msg=path)
    assert shared_somewhere
    assert bool(formed) == (budget == "default")  # the shared path ran within the budget, and only there


@pytest.mark.parametrize("architecture", [a for a in ARCHITECTURES if a != "bert"])
def test_projection_with_shared_maps_matches_plain_replay(toy_kit, toy_root, architecture):
    experiment = _two_tasks(toy_kit, toy_root, architecture, dtype="float64")
    levels = ("model", "layer", "attn", "mlp", "linear")
    shared = projection(experiment, levels=levels, alphas=(0.5, 1.0), progress=False)
    plain = projection(experiment, levels=levels, alphas=(0.5, 1.0), progress=False, plain_replay=True)
    for name in ("projection_distance", "cosine_merge", "cosine_base"):
        fast, slow = shared[name].values, plain[name].values
        assert np.isfinite(slow).sum() > 0
        np.testing.assert_array_equal(np.isnan(fast), np.isnan(slow))
        # an exactly linear map has PD 0 up to float64 rounding, where relative agreement means nothing
        np.testing.assert_allclose(fast, slow, rtol=1e-6, atol=1e-12, err_msg=name)

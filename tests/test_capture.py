"""Capture/replay engine against real forwards of tiny models of six architectures.

Reference numbers come from the models themselves: forward hooks in a normal forward of the
base model, the fine-tuned model instantiated whole, and its full forward.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from submerge.diagnostics.capture import (
    CaptureState,
    GramsByLayer,
    ParameterSource,
    block_kwargs,
    head_output,
    input_gram_matrices,
    model_outputs,
    record_inputs,
    replay,
    replay_with_heads,
    sample_features,
    split_heads,
)
from submerge.diagnostics.data import read_task_file, tokenize
from submerge.diagnostics.modules import find_architecture, find_submodules, get_module, module_parameter_names
from submerge.merge.writer import writing_order

TASK = "math"  # the toy fine-tunes' task (tests/conftest.py)
ARCHITECTURES = ["llama", "qwen2", "gemma3", "gpt2", "bert"]  # mistral: llama's structure, left out for time
TOLERANCE = 1e-5


@dataclass
class Engine:
    name: str
    base: object
    task_vectors: dict
    arch: object
    submodules: list
    batches: list
    recorded: dict
    finetuned: torch.nn.Module
    source: ParameterSource


@pytest.fixture(scope="module", params=ARCHITECTURES)
def engine(request, toy_kit) -> Engine:
    kit = toy_kit(request.param)
    base, task_vectors = kit.load()
    arch = find_architecture(base.model)
    submodules = find_submodules(base.model, ("layer", "attn", "mlp"), arch=arch)
    data = read_task_file(TASK, kit.data_path, samples=4)
    batches = tokenize(data, base.tokenizer, max_tokens=48, batch_size=2)
    assert any(bool((b.attention_mask == 0).any()) for b in batches), "the test data should need padding"
    recorded = record_inputs(base.model, arch, [s.path for s in submodules], batches)
    return Engine(request.param, base, task_vectors, arch, submodules, batches, recorded, kit.finetuned_model(),
                  ParameterSource(base, task_vectors))


def _hooked_outputs(model, arch, submodules, batch) -> dict[str, torch.Tensor]:
    """Outputs of every submodule in one normal forward of `model` (BERT's MLP: its `output` part)."""
    outputs: dict[str, torch.Tensor] = {}
    handles = []
    for submodule in submodules:
        path = submodule.path
        if "+" in path:  # intermediate+output: the MLP's output is the `output` module's
            parent, _, joined = path.rpartition(".")
            path = f"{parent}.{joined.split('+')[-1]}"

        def hook(module, args, output, name=submodule.name):
            outputs[name] = output[0] if isinstance(output, tuple) else output

        handles.append(model.get_submodule(path).register_forward_hook(hook))
    try:
        with torch.no_grad():
            get_module(model, arch.backbone_path)(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def _max_error(first: torch.Tensor, second: torch.Tensor, mask: torch.Tensor) -> float:
    return (first - second)[mask].abs().max().item()


def test_replay_with_base_parameters_reproduces_the_forward(engine):
    for b, batch in enumerate(engine.batches):
        reference = _hooked_outputs(engine.base.model, engine.arch, engine.submodules, batch)
        mask = batch.attention_mask.bool()
        for submodule in engine.submodules:
            module = get_module(engine.base.model, submodule.path)
            replayed = replay(module, engine.recorded[submodule.path][b])
            assert replayed.shape == reference[submodule.name].shape
            assert _max_error(replayed, reference[submodule.name], mask) <= TOLERANCE, submodule.name


def test_replay_with_finetuned_parameters_reproduces_the_finetuned_modules(engine):
    checked = 0
    for b, batch in enumerate(engine.batches):
        mask = batch.attention_mask.bool()
        for submodule in engine.submodules:
            recorded = engine.recorded[submodule.path][b]
            parameters = engine.source.variant(submodule.path, {TASK: 1.0})
            assert parameters is not None
            replayed = replay(get_module(engine.base.model, submodule.path), recorded, parameters)
            with torch.no_grad():
                expected = get_module(engine.finetuned, submodule.path)(*recorded.args, **recorded.kwargs)
            expected = expected[0] if isinstance(expected, tuple) else expected
            base_output = replay(get_module(engine.base.model, submodule.path), recorded)
            assert _max_error(replayed, expected, mask) <= TOLERANCE, submodule.name
            # the fine-tune really moved this module, so the check above can fail
            assert _max_error(base_output, expected, mask) > 100 * TOLERANCE, submodule.name
            checked += 1
    assert checked == len(engine.batches) * len(engine.submodules)


def _same(first, second) -> bool:
    """Recorded inputs (tensors, tuples, dicts, None, numbers) equal bit for bit."""
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and first.dtype == second.dtype and torch.equal(first, second)
    if isinstance(first, (tuple, list)):
        return type(first) is type(second) and len(first) == len(second) and all(map(_same, first, second))
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(_same(first[k], second[k]) for k in first)
    return first == second


def test_chunked_capture_continues_where_the_previous_chunk_stopped(engine):
    """One layer per chunk with a CaptureState: the same inputs bit for bit as one pass, and block 0 runs once."""
    model, arch = engine.base.model, engine.arch
    calls = []
    first_attention = model.get_submodule(arch.attn_path(0))
    handle = first_attention.register_forward_pre_hook(lambda module, args: calls.append(1))
    state = CaptureState()
    try:
        for layer in range(arch.num_layers):
            paths = [s.path for s in engine.submodules if s.layer == layer]
            chunk = record_inputs(model, arch, paths, engine.batches, state=state)
            for path in paths:
                for got, want in zip(chunk[path], engine.recorded[path], strict=True):
                    assert _same(got.args, want.args) and _same(got.kwargs, want.kwargs), path
    finally:
        handle.remove()
    assert len(calls) == len(engine.batches)  # the prefix is never re-run
    assert state.layer == arch.num_layers - 2  # the last chunk runs to the end: nothing left to resume


def test_grams_streamed_by_layer_equal_the_grams_of_one_pass(engine):
    """RegMean's Grams one block at a time (what `diag merge --method regmean` holds) equal one pass over all
    blocks; asked for in the merge writer's order, each block is computed once and alone is held."""
    model, arch, base = engine.base.model, engine.arch, engine.base
    whole = input_gram_matrices(model, arch, engine.batches)
    grams = GramsByLayer(model, arch, {"a": engine.batches, "b": engine.batches[:1]},
                         checkpoint_names=base.checkpoint_names)
    assert grams.names == {base.checkpoint_name(key) for key in whole} and len(whole) >= 4 * arch.num_layers
    first_only = input_gram_matrices(model, arch, engine.batches[:1])
    for name in writing_order(base.reader.names()):
        got = grams(name)
        if name not in grams.names:
            assert got is None, name
            continue
        key = next(k for k in whole if base.checkpoint_name(k) == name)
        assert torch.equal(got[0], whole[key]) and torch.equal(got[1], first_only[key]), name
        held = {k for task in grams.held.values() for k in task}
        assert all(k.startswith(arch.layer_path(grams.layer) + ".") for k in held), name  # one block at a time
    assert grams.computed == list(range(arch.num_layers))  # block after block, each once
    name = next(n for n in writing_order(list(grams.names)))  # asked for again: recomputed, the same
    assert torch.equal(grams(name)[0], whole[next(k for k in whole if base.checkpoint_name(k) == name)])
    assert grams.computed == [*range(arch.num_layers), 0]


def test_grams_are_sums_of_outer_products_of_each_maps_input_and_shared_where_the_input_is(engine):
    """Known answer: each linear map's Gram is Σ x xᵀ over the real tokens of the input it was called with,
    recorded here by a hook of our own; maps called with the same tensor hold one shared Gram, bitwise that sum."""
    from submerge.diagnostics.capture import linear_maps

    model, arch = engine.base.model, engine.arch
    maps = [pair for layer in range(arch.num_layers) for pair in linear_maps(model, arch, layer)]
    seen: dict[str, list[torch.Tensor]] = {key: [] for key, _ in maps}
    handles = [module.register_forward_pre_hook(lambda m, args, key=key: seen[key].append(args[0].detach().clone()))
               for key, module in maps]
    try:
        grams = input_gram_matrices(model, arch, engine.batches)
    finally:
        for handle in handles:
            handle.remove()
    assert set(grams) == set(seen)
    for key, inputs in seen.items():
        want = None
        for x, batch in zip(inputs, engine.batches, strict=True):
            real = x[batch.attention_mask.bool()].float()
            want = real.T @ real if want is None else want + real.T @ real
        assert torch.equal(grams[key], want), key
    block = [key for key, _ in linear_maps(model, arch, 0)]
    pairs = [(key, other) for i, key in enumerate(block) for other in block[i + 1:]]
    fed_alike = [(k, o) for k, o in pairs if all(torch.equal(a, b) for a, b in zip(seen[k], seen[o]))]
    shared = [(k, o) for k, o in pairs if grams[k] is grams[o]]
    assert set(shared) <= set(fed_alike)  # a Gram is shared only by maps fed the same values
    assert bool(shared) == bool(fed_alike), (shared, fed_alike)  # q/k/v and gate/up share; GPT-2's fused maps do not


def test_variant_is_base_plus_scaled_task_vector(engine):
    path = engine.arch.attn_path(1)
    assert engine.source.variant(path, {TASK: 0.0}) is None
    half = engine.source.variant(path, {TASK: 0.5})
    base_parameters = engine.source.base_parameters(path)
    deltas = engine.source.deltas(path, TASK)
    for local, weight in base_parameters.items():
        torch.testing.assert_close(half[local], weight + 0.5 * deltas[local], rtol=0, atol=1e-7)
    assert engine.source.changed(path, TASK)


def test_task_vectors_are_taken_against_the_loaded_base_each_read_from_its_file_once(engine, monkeypatch):
    """τ against the base parameter the model holds is bitwise τ against the base's file, and the file is read
    once per tensor (to check that the loaded parameter is the stored one), not once per task and unit."""
    reader = engine.base.reader
    reads: dict[str, int] = {}
    get = type(reader).get

    def counted(self, name, *args, **kwargs):
        if self is reader:
            reads[name] = reads.get(name, 0) + 1
        return get(self, name, *args, **kwargs)

    monkeypatch.setattr(type(reader), "get", counted)
    source = ParameterSource(engine.base, engine.task_vectors)
    path = engine.arch.layer_path(1)
    names = module_parameter_names(engine.base.model, path)
    for _ in range(3):  # three units of a layer, say, each reading τ again
        deltas = source.deltas(path, TASK)
        source.clear()
    stored = [engine.base.checkpoint_name(names[local]) for local in deltas]
    assert reads == dict.fromkeys(stored, 1)
    assert all(source._as_stored[name] for name in stored)
    for local, delta in deltas.items():  # the file's τ, bitwise
        assert torch.equal(delta, engine.task_vectors[TASK].get(engine.base.checkpoint_name(names[local])))


def test_a_loaded_base_parameter_that_is_not_the_stored_one_is_not_used(toy_kit):
    """A base whose loaded parameter differs from its file (changed in memory here; a base loaded in another
    dtype, in practice) has τ read against the file, as before."""
    base, task_vectors = toy_kit("llama").load()
    arch = find_architecture(base.model)
    path = arch.mlp_path(0)
    module = get_module(base.model, path)
    local, parameter = next(iter(module.named_parameters()))
    with torch.no_grad():
        parameter.add_(1e-3)
    name = base.checkpoint_name(module_parameter_names(base.model, path)[local])
    source = ParameterSource(base, task_vectors)
    delta = source.deltas(path, TASK)[local]
    assert source._as_stored[name] is False
    assert torch.equal(delta, task_vectors[TASK].get(name))
    assert not torch.equal(delta, task_vectors[TASK].get(name, base=parameter.detach()))


@pytest.mark.parametrize("coefficient", [0.0, 1.0])
def test_model_outputs_equal_full_forward(engine, coefficient):
    reference_model = engine.base.model if coefficient == 0.0 else engine.finetuned
    outputs = model_outputs(engine.source, engine.arch, engine.batches, [{TASK: coefficient}])
    backbone = get_module(reference_model, engine.arch.backbone_path)
    for b, batch in enumerate(engine.batches):
        with torch.no_grad():
            expected = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        assert _max_error(outputs[0][b], expected, batch.attention_mask.bool()) <= TOLERANCE


def test_model_outputs_of_several_variants_at_once(engine):
    """Variants computed together equal variants computed one by one (no state leaks between them)."""
    together = model_outputs(engine.source, engine.arch, engine.batches, [{TASK: 0.0}, {TASK: 0.5}, {TASK: 1.0}])
    alone = model_outputs(engine.source, engine.arch, engine.batches, [{TASK: 0.5}])
    for b, batch in enumerate(engine.batches):
        mask = batch.attention_mask.bool()
        assert _max_error(together[1][b], alone[0][b], mask) <= TOLERANCE
        assert _max_error(together[0][b], together[2][b], mask) > 100 * TOLERANCE


def test_model_logits_equal_full_forward(engine):
    if engine.name == "bert":
        with pytest.raises(ValueError, match="no output head"):
            model_outputs(engine.source, engine.arch, engine.batches[:1], [{TASK: 1.0}], output="logits")
        return
    outputs = model_outputs(engine.source, engine.arch, engine.batches, [{TASK: 1.0}], output="logits")
    for b, batch in enumerate(engine.batches):
        with torch.no_grad():
            expected = engine.finetuned(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        assert outputs[0][b].shape[-1] == engine.finetuned.config.vocab_size
        assert _max_error(outputs[0][b], expected, batch.attention_mask.bool()) <= TOLERANCE


@pytest.mark.parametrize("coefficient", [0.0, 1.0])
def test_heads_sum_to_output_projection_minus_bias(engine, coefficient):
    arch = engine.arch
    for layer in range(arch.num_layers):
        path = arch.attn_path(layer)
        attention = get_module(engine.base.model, path)
        o_proj = attention.get_submodule(arch.o_proj)
        parameters = engine.source.variant(path, {TASK: coefficient})
        seen: dict[str, torch.Tensor] = {}
        handle = o_proj.register_forward_hook(lambda module, args, output, seen=seen: seen.__setitem__("y", output))
        try:
            output, o_input, o_weight = replay_with_heads(attention, arch, engine.recorded[path][0], parameters)
        finally:
            handle.remove()
        if parameters is not None:
            assert torch.equal(o_weight, parameters[f"{arch.o_proj}.weight"])
        bias = (parameters or {}).get(f"{arch.o_proj}.bias", o_proj.bias)
        expected = seen["y"] - (bias if bias is not None else 0)
        heads = split_heads(o_input, o_weight, arch)
        assert heads.shape == (*o_input.shape[:-1], arch.num_heads, expected.shape[-1])
        assert (heads.sum(-2) - expected).abs().max().item() <= TOLERANCE
        for head in range(arch.num_heads):
            assert torch.allclose(head_output(o_input, o_weight, arch, head), heads[..., head, :],
                                  rtol=0, atol=1e-6)
        # one head is not the whole: the split is a real split
        assert (heads[..., 0, :] - expected).abs().max().item() > 100 * TOLERANCE
        assert output.shape[:-1] == o_input.shape[:-1]


def test_recording_stops_after_the_deepest_requested_block(llama_kit):
    base, _ = llama_kit.load()
    arch = find_architecture(base.model)
    data = read_task_file(TASK, llama_kit.data_path, samples=2)
    batches = tokenize(data, base.tokenizer, max_tokens=48, batch_size=2)
    calls = []
    handle = base.model.get_submodule(arch.layer_path(arch.num_layers - 1)).register_forward_pre_hook(
        lambda module, args: calls.append(1))
    try:
        recorded = record_inputs(base.model, arch, [arch.attn_path(0)], batches)
    finally:
        handle.remove()
    assert calls == []
    assert len(recorded[arch.attn_path(0)]) == len(batches)
    assert recorded[arch.attn_path(0)][0].sample_index == [0, 1]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _without_stream(recorded):
    if recorded.args:
        return recorded.args[1:], recorded.kwargs
    return recorded.args, {k: v for k, v in recorded.kwargs.items() if k != "hidden_states"}


def test_block_kwargs_are_what_a_real_forward_gives_each_block(engine):
    """Masks and positions of every block (gemma3: sliding and global layers differ) without running a block:
    the same tensors a real forward hands each block; the stream is left out except block 0's (the embedding)."""
    arch, layers = engine.arch, range(engine.arch.num_layers)
    calls = []
    handle = engine.base.model.get_submodule(arch.layer_path(0)).register_forward_hook(lambda *a: calls.append(1))
    try:
        cheap = block_kwargs(engine.base.model, arch, layers, engine.batches)
    finally:
        handle.remove()
    real = record_inputs(engine.base.model, arch, [arch.layer_path(i) for i in layers], engine.batches)
    assert len(calls) == len(engine.batches)  # block 0's hook ran, its computation did not (passed through)
    for i in layers:
        path = arch.layer_path(i)
        assert len(cheap[path]) == len(engine.batches)
        for got, want in zip(cheap[path], real[path]):
            assert _same(_without_stream(got), _without_stream(want)), path
            stream = got.args[0] if got.args else got.kwargs["hidden_states"]
            if i == 0:
                assert torch.equal(stream, want.args[0] if want.args else want.kwargs["hidden_states"])
            else:
                assert stream is None
            assert torch.equal(got.token_mask, want.token_mask) and got.sample_index == want.sample_index


def test_block_kwargs_falls_back_to_a_real_forward_when_blocks_cannot_pass_through(llama_kit, monkeypatch):
    """A backbone that does not hand a block's returned tensor on as it is (older transformers: tuples)."""
    from submerge.diagnostics import capture

    base, _ = llama_kit.load()
    arch = find_architecture(base.model)
    batches = tokenize(read_task_file(TASK, llama_kit.data_path, samples=2), base.tokenizer, max_tokens=16,
                       batch_size=2)
    monkeypatch.setattr(capture, "_pass_through", lambda *args, **kwargs: (args[0] if args else
                                                                          kwargs["hidden_states"])[..., :1])
    recorded = block_kwargs(base.model, arch, [1], batches)
    real = record_inputs(base.model, arch, [arch.layer_path(1)], batches)
    assert torch.equal(recorded[arch.layer_path(1)][0].args[0], real[arch.layer_path(1)][0].args[0])
    assert not any("forward" in vars(base.model.get_submodule(arch.layer_path(i))) for i in range(arch.num_layers))


# --------------------------------------------------------------------------- padding


SHORT = "Q: what is 2 plus 3?"
LONG = "Q: what is 17 plus 25? A: 17 + 25 = 42. Then 42 plus 8 is 50, and 50 plus 50 is 100."


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_padding_does_not_change_module_features(toy_kit, name):
    from submerge.diagnostics.data import TokenBatch

    kit = toy_kit(name)
    base, task_vectors = kit.load()
    arch = find_architecture(base.model)
    source = ParameterSource(base, task_vectors)
    paths = [s.path for s in find_submodules(base.model, ("layer", "attn", "mlp"), arch=arch)]
    alone = base.tokenizer([SHORT], return_tensors="pt", padding=True)
    together = base.tokenizer([SHORT, LONG], return_tensors="pt", padding=True)
    assert together["input_ids"].shape[1] >= 3 * alone["input_ids"].shape[1]
    batches = {
        "alone": [TokenBatch(alone["input_ids"], alone["attention_mask"], [0])],
        "together": [TokenBatch(together["input_ids"], together["attention_mask"], [0, 1])],
    }
    features = {}
    for key, batch in batches.items():
        recorded = record_inputs(base.model, arch, paths, batch)
        for path in paths:
            rec = recorded[path][0]
            output = replay(get_module(base.model, path), rec, source.variant(path, {TASK: 0.5}))
            features[key, path] = sample_features(output, rec.token_mask)[0]
        final = model_outputs(source, arch, batch, [{TASK: 0.5}])[0][0]
        features[key, "model"] = sample_features(final, batch[0].attention_mask.bool())[0]
    for path in [*paths, "model"]:
        first, second = features["alone", path], features["together", path]
        assert first.shape == second.shape
        assert (first - second).abs().max().item() <= TOLERANCE, path


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_padding_does_not_change_nonlinearity_score(toy_kit, tmp_path, name):
    import json

    from submerge.diagnostics.linearity import nonlinearity

    data_path = tmp_path / "mixed.jsonl"
    data_path.write_text(json.dumps({"text": SHORT}) + "\n" + json.dumps({"text": LONG}) + "\n")
    kit = toy_kit(name)
    scores = {}
    for batch_size in (1, 2):
        experiment = kit.experiment(data_path, batch_size=batch_size, samples=2, max_tokens=128)
        assert len(experiment.batches[TASK]) == 3 - batch_size
        dataset = nonlinearity(experiment, levels=("model", "layer", "attn", "mlp", "head"), steps=4,
                               progress=False)
        scores[batch_size] = dataset.nonlinearity_score.sel(task=TASK).values
    assert scores[1].shape == scores[2].shape
    assert np.isfinite(scores[1]).all()
    np.testing.assert_allclose(scores[2], scores[1], rtol=1e-4, atol=1e-7)


def test_capture_in_float32_gives_each_half_precision_weight_its_own_storage_back(toy_kit):
    """A bfloat16 base captured in float32: every weight ends in the very tensor it started with (same storage,
    same bits), so weights memory-mapped from a checkpoint are not turned into private copies by a capture."""
    base, _ = toy_kit("llama").load()
    model = base.model.to(torch.bfloat16)
    arch = find_architecture(model)
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    batches = tokenize(read_task_file(TASK, toy_kit("llama").data_path, samples=2), base.tokenizer, max_tokens=16,
                       batch_size=2)
    recorded = record_inputs(model, arch, [arch.layer_path(1)], batches, compute=torch.float32)
    assert recorded[arch.layer_path(1)][0].args[0].dtype == torch.float32  # the forward ran in float32
    for name, parameter in model.named_parameters():
        pointer, values = before[name]
        assert parameter.dtype == torch.bfloat16 and parameter.data_ptr() == pointer, name
        assert torch.equal(parameter, values), name


def test_summed_token_loss_known_answers_on_the_predicting_positions_in_chunks_of_any_size():
    """Uniform logits cost log V per predicted token; the positions that predict a real token are counted (not the
    padding, not the last position); a row-by-row hand sum of −log softmax agrees, and chunks of 1, 2 or 3 rows
    (the threshold `LOSS_CHUNK_ENTRIES` lowered below one batch's rows) give the unchunked total."""
    from submerge.diagnostics.data import TokenBatch
    from submerge.diagnostics.evaluate import predicting, summed_token_loss

    vocabulary = 7
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 0, 2, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    batch = TokenBatch(ids, mask, [0, 1])
    total, count = summed_token_loss(predicting(torch.zeros(2, 5, vocabulary), batch), batch)
    assert count == 4 + 2 and total == pytest.approx(6 * math.log(vocabulary), rel=1e-6)  # float32 per token

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 4, generator=generator)
    head = torch.randn(vocabulary, 4, generator=generator)
    by_hand = 0.0
    for b in range(2):
        for i in range(4):
            if mask[b, i + 1]:
                by_hand -= float(torch.log_softmax((hidden[b, i] @ head.T).double(), dim=-1)[ids[b, i + 1]])
    rows = predicting(hidden, batch)
    assert rows.shape == (6, 4)
    whole, _ = summed_token_loss(rows, batch, lambda x: x @ head.T, vocabulary=vocabulary)
    assert whole == pytest.approx(by_hand, rel=1e-6)
    for per_chunk in (1, 2, 3):
        chunked, counted = summed_token_loss(rows, batch, lambda x: x @ head.T, vocabulary=vocabulary,
                                             chunk_entries=per_chunk * vocabulary)
        assert counted == 6 and chunked == pytest.approx(whole, rel=1e-6), per_chunk


def test_streamed_losses_are_the_same_with_the_head_in_small_chunks(toy_kit, monkeypatch):
    """`streamed_losses` with the head's logits formed a few rows at a time (the chunk threshold lowered) equals
    its losses with each batch's rows in one chunk."""
    from submerge.diagnostics import evaluate

    kit = toy_kit("llama")
    base, _ = kit.load()
    arch = find_architecture(base.model)
    batches = {"a": tokenize(read_task_file(TASK, kit.data_path, samples=6), base.tokenizer, max_tokens=40,
                             batch_size=4)}
    whole, _ = evaluate.model_losses(base, arch, str(kit.finetuned_dir), ["a"], batches, torch.float32)
    vocabulary = base.model.config.vocab_size
    assert sum(int(b.attention_mask.sum()) for b in batches["a"]) > 3 * len(batches["a"])  # several chunks each
    monkeypatch.setattr(evaluate, "LOSS_CHUNK_ENTRIES", 3 * vocabulary)
    chunked, _ = evaluate.model_losses(base, arch, str(kit.finetuned_dir), ["a"], batches, torch.float32)
    assert chunked[0] == pytest.approx(whole[0], rel=1e-6)


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt2"])
def test_eval_streamed_block_by_block_is_the_whole_models_loss(toy_kit, name):
    """`diag eval`'s losses (θ0 + τ block by block, every task's batches through a block at once) against the
    fine-tune loaded whole and run by Hugging Face; the base's weights are read, never written."""
    from submerge.diagnostics.evaluate import model_losses, task_loss

    kit = toy_kit(name)
    base, _ = kit.load()
    arch = find_architecture(base.model)
    data = read_task_file(TASK, kit.data_path, samples=6)
    batches = {"a": tokenize(data, base.tokenizer, max_tokens=40, batch_size=4),
               "b": tokenize(read_task_file(TASK, kit.data_path, samples=2, skip=6), base.tokenizer, max_tokens=24,
                             batch_size=2)}
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in base.model.named_parameters()}
    losses, counts = model_losses(base, arch, str(kit.finetuned_dir), ["a", "b"], batches, torch.float32)
    finetuned = kit.finetuned_model()
    for task, loss, count in zip(["a", "b"], losses, counts):
        expected, tokens = task_loss(finetuned, batches[task])
        assert count == tokens and loss == pytest.approx(expected, rel=1e-5), task
    base_losses, _ = model_losses(base, arch, None, ["a", "b"], batches, torch.float32)
    assert base_losses[0] == pytest.approx(task_loss(base.model, batches["a"])[0], rel=1e-5)
    assert abs(base_losses[0] - losses[0]) > 1e-4  # the fine-tune is a different model
    for n, p in base.model.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]), n


def _padded(lengths: list[int], batch_size: int, first_index: int = 0) -> list:
    """Right-padded batches of records whose tokens are (index × 1000 + position), in file order."""
    from submerge.diagnostics.data import TokenBatch

    batches = []
    for start in range(0, len(lengths), batch_size):
        part = lengths[start:start + batch_size]
        ids = torch.zeros((len(part), max(part)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, length in enumerate(part):
            index = first_index + start + row
            ids[row, :length] = index * 1000 + torch.arange(length)
            mask[row, :length] = 1
        batches.append(TokenBatch(ids, mask, list(range(first_index + start, first_index + start + len(part)))))
    return batches


def test_by_length_regroups_records_with_the_least_padding_known_answers():
    """Known partitions: lengths 10, 100, 12, 98 in one batch pad to 400 positions; regrouped at overhead 64 they
    are {10, 12} and {98, 100} (24 + 200 padded + 2 × 64 = 352, against 464 for one batch, 414 for three, 476 for
    four); at overhead 200 one batch (400 + 200) beats two (224 + 400). With overhead 0 every record is alone."""
    from submerge.diagnostics.data import by_length

    batches = _padded([10, 100, 12, 98], batch_size=4)
    two = by_length(batches, overhead=64)
    assert [b.sample_index for b in two] == [[0, 2], [3, 1]]
    assert [tuple(b.input_ids.shape) for b in two] == [(2, 12), (2, 100)]
    one = by_length(batches, overhead=200)
    assert [b.sample_index for b in one] == [[0, 2, 3, 1]] and one[0].input_ids.shape == (4, 100)
    alone = by_length(batches, overhead=0)
    assert [b.sample_index for b in alone] == [[0], [2], [3], [1]]
    assert by_length([]) == []


@pytest.mark.parametrize("seed", range(5))
def test_by_length_keeps_every_record_whole_and_within_the_largest_batch(seed):
    """Property: every record comes back once with the same real tokens and mask, right-padded; no batch is larger
    (records × longest) than the largest given; at overhead 0 (least padding) the padded total never exceeds file
    order's. Cut within folds (`group_of`): no batch holds two folds' records, and the folds follow one another in
    order, each sorted by length."""
    from submerge.diagnostics.data import by_length, folds_of

    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (int(torch.randint(1, 30, (1,), generator=generator)),), generator=generator)
    batches = _padded(lengths.tolist(), batch_size=int(torch.randint(1, 9, (1,), generator=generator)))
    for folds, overhead in itertools.product((None, 2, 3), (0, 16, 64, 10_000)):
        group_of = folds_of(range(len(lengths)), folds) if folds else None
        regrouped = by_length(batches, overhead=overhead, group_of=group_of)
        budget = max(b.input_ids.numel() for b in batches)
        assert all(b.input_ids.numel() <= budget for b in regrouped)
        if overhead == 0 and folds is None:
            assert sum(b.input_ids.numel() for b in regrouped) <= sum(b.input_ids.numel() for b in batches)
        seen = {}
        for batch in regrouped:
            for row, index in enumerate(batch.sample_index):
                length = int(batch.attention_mask[row].sum())
                assert batch.attention_mask[row, :length].all()  # right-padded
                seen[index] = batch.input_ids[row, :length].tolist()
        assert seen == {i: [i * 1000 + p for p in range(n)] for i, n in enumerate(lengths.tolist())}
        if folds:
            of_batch = [{group_of[i] for i in batch.sample_index} for batch in regrouped]
            assert all(len(fold) == 1 for fold in of_batch)
            order = [fold.pop() for fold in of_batch]
            assert order == sorted(order)
            for fold in set(order):  # within a fold, sorted by length as without folds
                widths = [b.input_ids.shape[1] for b, k in zip(regrouped, order) if k == fold]
                assert widths == sorted(widths)


def test_streamed_losses_regrouped_by_length_equal_file_order_to_rounding(toy_kit, monkeypatch):
    """The regrouping moves the losses by float rounding only: with `by_length` replaced by file order, the same
    losses to 1e-6 relative, and the same token counts."""
    from submerge.diagnostics import evaluate
    from submerge.diagnostics.data import by_length

    kit = toy_kit("llama")
    base, _ = kit.load()
    arch = find_architecture(base.model)
    batches = {"a": tokenize(read_task_file(TASK, kit.data_path, samples=7), base.tokenizer, max_tokens=40,
                             batch_size=4)}
    lengths = [int(n) for b in batches["a"] for n in b.attention_mask.sum(1)]
    assert len(set(lengths)) > 2  # records of several lengths: the regrouping differs from file order
    assert [b.sample_index for b in by_length(batches["a"], overhead=0)] != [b.sample_index for b in batches["a"]]
    monkeypatch.setattr(evaluate, "by_length", lambda given: by_length(given, overhead=0))
    regrouped, counted = evaluate.model_losses(base, arch, str(kit.finetuned_dir), ["a"], batches, torch.float32)
    monkeypatch.setattr(evaluate, "by_length", lambda given: given)
    file_order, counted_before = evaluate.model_losses(base, arch, str(kit.finetuned_dir), ["a"], batches,
                                                       torch.float32)
    assert counted == counted_before and regrouped[0] == pytest.approx(file_order[0], rel=1e-6)

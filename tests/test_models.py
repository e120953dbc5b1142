"""Model and data input: lazy readers, LoRA adapters, task vectors, pre-flight checks and clear errors."""

from __future__ import annotations

import inspect
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from submerge.diagnostics.base_model import checkpoint_name_map, load_base_model, pick_dtype
from submerge.diagnostics.checkpoints import LoraReader, SafetensorsReader, StateDictReader, open_checkpoint
from submerge.diagnostics.data import parse_named, read_task_file, tokenize
from submerge.diagnostics.errors import (
    ArchitectureError,
    CheckpointMismatch,
    DataInputError,
    ModelInputError,
    NonFiniteWeights,
)
from submerge.diagnostics.experiment import Experiment
from submerge.diagnostics.modules import find_architecture
from submerge.diagnostics.placement import release_mapped_pages
from submerge.diagnostics.task_vectors import TaskVectorReader, open_finetunes, preflight

TASK = "math"


def _state_dict(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def _write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], config_from: Path | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors", metadata={"format": "pt"})
    if config_from is not None:
        for file in config_from.glob("*.json"):
            if file.name != "model.safetensors.index.json":
                shutil.copy(file, directory / file.name)
    return directory


# --------------------------------------------------------------------------- lazy readers


def test_safetensors_reader_reads_each_tensor(llama_kit):
    reader = open_checkpoint(str(llama_kit.base_dir))
    assert isinstance(reader, SafetensorsReader)
    expected = _state_dict(llama_kit.base_dir)
    assert sorted(reader.names()) == sorted(expected)
    for name, tensor in expected.items():
        assert reader.shape(name) == tuple(tensor.shape)
        assert torch.equal(reader.get(name), tensor)
    name = "model.layers.0.mlp.down_proj.weight"
    assert reader.get(name, torch.float64).dtype == torch.float64
    assert name in reader and "model.layers.9.mlp.down_proj.weight" not in reader
    with pytest.raises(ModelInputError, match="model.layers.9.mlp.down_proj.weight"):
        reader.get("model.layers.9.mlp.down_proj.weight")
    fingerprint = reader.fingerprint()
    assert len(fingerprint["content_sha256"]) == 64 and fingerprint["path"] == str(llama_kit.base_dir)


def test_sharded_safetensors_are_read_through_the_index(llama_kit, tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_kit.base_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    reader = open_checkpoint(str(tmp_path / "sharded"))
    expected = _state_dict(llama_kit.base_dir)
    assert sorted(reader.names()) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(reader.get(name), tensor)
    assert reader.source_of("model.norm.weight").endswith(".safetensors")


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelInputError, match="not found"):
        open_checkpoint(str(tmp_path / "no_such_model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelInputError, match="no model weights"):
        open_checkpoint(str(tmp_path / "empty"))


def test_unknown_dtype_is_a_clear_error():
    assert pick_dtype("bf16") == torch.bfloat16
    with pytest.raises(ModelInputError, match="unknown dtype 'float8'"):
        pick_dtype("float8")


def test_base_model_loads_in_eval_mode_with_right_padding(llama_kit):
    base = load_base_model(str(llama_kit.base_dir), dtype="float32", device="cpu")
    assert not base.model.training
    assert not any(p.requires_grad for p in base.model.parameters())
    assert base.tokenizer.padding_side == "right" and base.tokenizer.pad_token is not None
    assert base.checkpoint_name("model.layers.0.self_attn.q_proj.weight") == "model.layers.0.self_attn.q_proj.weight"


def _resident_bytes_of(file: Path) -> int:
    """Resident bytes of this process's mappings of `file` (/proc/self/smaps)."""
    total, counting = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            counting = len(fields) > 5 and fields[5] == str(file)
        elif counting and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
def test_released_base_pages_leave_the_rss_and_read_back_the_same(llama_kit, tmp_path):
    """`release_mapped_pages` drops the resident pages of a base memory-mapped from its checkpoint; the weights
    read back bit for bit and the model computes the same; a mapping with a written page is left alone."""
    directory = tmp_path / "base"
    shutil.copytree(llama_kit.base_dir, directory)
    file = (directory / "model.safetensors").resolve()
    base = load_base_model(str(directory), dtype="float32", device="cpu")
    ids = torch.tensor([[1, 5, 7, 9]])
    before = base.model(input_ids=ids).logits
    assert _resident_bytes_of(file) > 0  # the forward read every weight: resident in the file mapping
    released = release_mapped_pages(base.model)
    assert released > 0 and _resident_bytes_of(file) == 0
    stored = _state_dict(directory)
    for name, parameter in base.model.named_parameters():
        assert torch.equal(parameter, stored[base.checkpoint_name(name)]), name
    assert torch.equal(base.model(input_ids=ids).logits, before)
    # a written page (copy on write) makes its mapping private memory: it is not released, the write stays
    weight = base.model.get_submodule("model.layers.0.mlp.down_proj").weight
    weight.data[0, 0] += 1.0
    written = float(weight[0, 0])
    assert release_mapped_pages(base.model) == 0 and _resident_bytes_of(file) > 0
    assert float(weight[0, 0]) == written


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
def test_capture_of_a_large_model_gives_each_blocks_pages_back(llama_kit, tmp_path, monkeypatch):
    """Above RELEASE_BYTES, a capture forward releases the mapped weights after every block: nothing of the
    checkpoint stays resident when it stops after a block, and the recorded inputs are the same."""
    from submerge.diagnostics import capture

    directory = tmp_path / "base"
    shutil.copytree(llama_kit.base_dir, directory)
    file = (directory / "model.safetensors").resolve()
    experiment = llama_kit.experiment()
    base = load_base_model(str(directory), dtype="float32", device="cpu")
    arch = find_architecture(base.model)
    path = arch.mlp_path(arch.num_layers - 1)  # every block runs (the last one stops the forward)
    block = sum(p.nbytes for p in base.model.get_submodule(arch.layer_path(0)).parameters())
    kept = capture.record_inputs(base.model, arch, [path], experiment.batches[TASK])
    resident = _resident_bytes_of(file)
    assert resident > arch.num_layers * block  # every block passed stays resident
    monkeypatch.setattr(capture, "RELEASE_BYTES", 0)
    released = capture.record_inputs(base.model, arch, [path], experiment.batches[TASK])
    # left: the pages the final norm read after the last block (the kernel faults in 64 KiB around a read)
    assert _resident_bytes_of(file) <= 2 * 64 * 1024 < resident
    assert len(kept[path]) == len(released[path]) == len(experiment.batches[TASK])
    for first, second in zip(kept[path], released[path], strict=True):
        assert torch.equal(first.args[0], second.args[0])
    # a capture that continues from block 0's saved output releases after the blocks that run, not the skipped one
    calls = []
    monkeypatch.setattr(capture, "release_mapped_pages", lambda model: calls.append(model))
    state = capture.CaptureState()
    capture.record_inputs(base.model, arch, [arch.mlp_path(0)], experiment.batches[TASK], state=state)
    calls.clear()
    capture.record_inputs(base.model, arch, [path], experiment.batches[TASK], state=state)
    assert len(calls) == (arch.num_layers - 1) * len(experiment.batches[TASK])
    assert torch.equal(base.model(input_ids=experiment.batches[TASK][0].input_ids).logits,
                       load_base_model(str(directory), dtype="float32", device="cpu").model(
                           input_ids=experiment.batches[TASK][0].input_ids).logits)


def test_a_units_clear_gives_pages_back_at_the_threshold_and_not_below(llama_kit, monkeypatch):
    """`ParameterSource.clear` (after every unit of a replay) releases the base's mapped pages for a base of
    RELEASE_BYTES or more, and below it does not read /proc/self/smaps at all (at the demo base's 0.5 GB that read
    cost 7 % of `diag linearity`). Both sides, the threshold lowered for the first."""
    from submerge.diagnostics import capture

    experiment = llama_kit.experiment()
    source = experiment.parameter_source()
    calls = []
    monkeypatch.setattr(capture, "release_mapped_pages", lambda model: calls.append(model))
    source.clear()
    assert calls == []  # a toy base is far below the threshold
    monkeypatch.setattr(capture, "RELEASE_BYTES", sum(p.nbytes for p in experiment.base.model.parameters()))
    source.clear()
    assert calls == [experiment.base.model]
    source.clear(release_pages=False)
    assert len(calls) == 1


def test_tied_and_unprefixed_names_are_mapped_to_checkpoint_tensors(toy_kit):
    gpt2 = load_base_model(str(toy_kit("gpt2").base_dir), dtype="float32", device="cpu")
    assert gpt2.checkpoint_name("lm_head.weight") == "transformer.wte.weight"
    llama_dir = toy_kit("llama").base_dir
    model = load_base_model(str(llama_dir), dtype="float32", device="cpu").model
    unprefixed = {name.removeprefix("model."): t for name, t in _state_dict(llama_dir).items()}
    mapping = checkpoint_name_map(model, StateDictReader("bare", llama_dir, unprefixed))
    assert mapping["model.layers.2.mlp.up_proj.weight"] == "layers.2.mlp.up_proj.weight"
    assert mapping["lm_head.weight"] == "lm_head.weight"


# --------------------------------------------------------------------------- task vectors and pre-flight


def test_task_vector_is_finetuned_minus_base(llama_kit):
    base = open_checkpoint(str(llama_kit.base_dir))
    task_vectors, report = open_finetunes(base, {TASK: str(llama_kit.finetuned_dir)})
    assert report == {TASK: {"vocab_rows": {}}}
    tuned = _state_dict(llama_kit.finetuned_dir)
    for name, weight in _state_dict(llama_kit.base_dir).items():
        delta = task_vectors[TASK].get(name)
        assert torch.equal(delta, tuned[name] - weight)
    assert task_vectors[TASK].get("model.norm.weight", torch.float64).dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_task_vector_against_a_base_tensor_in_hand_is_bitwise_the_files(tmp_path, dtype):
    """`TaskVectorReader.get(..., base=t)`: the base's stored tensor, held already, in place of its file; the
    difference is taken in float32 either way (a half-precision base promoted exactly), so τ is bitwise the same."""
    generator = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(64, 48, generator=generator).to(dtype)}
    tuned = {"w": (base["w"].float() + 1e-3 * torch.randn(64, 48, generator=generator)).to(dtype)}
    for name, tensors in (("base", base), ("tuned", tuned)):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors")
    reader = TaskVectorReader("t", open_checkpoint(str(tmp_path / "base")), open_checkpoint(str(tmp_path / "tuned")))
    from_file = reader.get("w")
    assert from_file.dtype == torch.float32 and bool(from_file.abs().max() > 0)
    assert torch.equal(reader.get("w", base=base["w"]), from_file)
    assert torch.equal(from_file, tuned["w"].float() - base["w"].float())


def test_finetune_of_another_shape_lists_the_differing_tensors(toy_kit, tmp_path):
    from submerge.diagnostics import toy

    kit = toy_kit("llama")
    other = toy.build_model(tmp_path / "wide", "llama", layers=3, hidden=32, intermediate=48)
    base = open_checkpoint(str(kit.base_dir))
    with pytest.raises(CheckpointMismatch) as error:
        open_finetunes(base, {"wide": str(other)})
    message = str(error.value)
    for layer in range(3):
        for projection in ("gate_proj", "up_proj", "down_proj"):
            assert f"'model.layers.{layer}.mlp.{projection}.weight' has shape" in message
    assert "q_proj" not in message  # only the differing tensors are listed
    assert "same architecture" in message


def test_finetune_of_another_architecture_is_refused(toy_kit):
    base = open_checkpoint(str(toy_kit("llama").base_dir))
    with pytest.raises(CheckpointMismatch) as error:
        open_finetunes(base, {"gpt": str(toy_kit("gpt2").finetuned_dir)})
    message = str(error.value)
    assert "gpt: missing 'model.layers.0.self_attn.q_proj.weight'" in message
    assert "gpt: extra 'transformer.h.0.attn.c_attn.weight'" in message
    assert "more" in message  # long lists are cut, with a count


def test_missing_tensor_is_named(llama_kit, tmp_path):
    tensors = _state_dict(llama_kit.finetuned_dir)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    partial = _write_checkpoint(tmp_path / "partial", tensors)
    base = open_checkpoint(str(llama_kit.base_dir))
    with pytest.raises(CheckpointMismatch, match=r"missing 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        open_finetunes(base, {TASK: str(partial)})
    reader = TaskVectorReader(TASK, base, open_checkpoint(str(partial)))
    with pytest.raises(CheckpointMismatch, match=r"no tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        reader.get("model.layers.1.self_attn.k_proj.weight")


def test_nan_weights_name_the_tensor_and_file(llama_kit, tmp_path):
    tensors = _state_dict(llama_kit.finetuned_dir)
    tensors["model.layers.2.mlp.up_proj.weight"][3, 5] = float("nan")
    tensors["model.layers.0.self_attn.o_proj.weight"][0, 0] = float("inf")
    broken = _write_checkpoint(tmp_path / "broken", tensors)
    base = open_checkpoint(str(llama_kit.base_dir))
    task_vectors, _ = open_finetunes(base, {TASK: str(broken)})  # headers only: pre-flight passes
    with pytest.raises(NonFiniteWeights) as error:
        task_vectors[TASK].get("model.layers.2.mlp.up_proj.weight")
    assert "model.layers.2.mlp.up_proj.weight" in str(error.value)
    assert str(broken / "model.safetensors") in str(error.value)
    assert "1 NaN/Inf" in str(error.value)
    with pytest.raises(NonFiniteWeights, match="o_proj"):
        task_vectors[TASK].get("model.layers.0.self_attn.o_proj.weight")
    task_vectors[TASK].get("model.layers.0.self_attn.q_proj.weight")  # the rest reads fine


def _grown_vocab_finetune(kit, directory: Path, extra_rows: int = 4) -> Path:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(kit.finetuned_dir, dtype=torch.float32)
    model.resize_token_embeddings(model.config.vocab_size + extra_rows)
    model.save_pretrained(directory)
    return directory


def test_added_vocabulary_rows_are_cropped_to_the_base_with_a_warning(llama_kit, tmp_path):
    grown = _grown_vocab_finetune(llama_kit, tmp_path / "grown")
    base = open_checkpoint(str(llama_kit.base_dir))
    with pytest.warns(UserWarning, match="vocabulary rows"):
        task_vectors, report = open_finetunes(base, {TASK: str(grown)}, vocab="base")
    assert report[TASK]["vocab_rows"] == {"model.embed_tokens.weight": [258, 262], "lm_head.weight": [258, 262]}
    with pytest.warns(UserWarning, match="using the base's 258 vocabulary rows"):
        delta = task_vectors[TASK].get("model.embed_tokens.weight")
    assert delta.shape == (258, 32)
    expected = _state_dict(grown)["model.embed_tokens.weight"][:258] - base.get("model.embed_tokens.weight")
    assert torch.equal(delta, expected)
    assert task_vectors[TASK].cropped == {"model.embed_tokens.weight": (258, 262)}


def test_added_vocabulary_rows_are_an_error_under_policy_error(llama_kit, tmp_path):
    grown = _grown_vocab_finetune(llama_kit, tmp_path / "grown")
    base = open_checkpoint(str(llama_kit.base_dir))
    with pytest.raises(CheckpointMismatch, match=r"'model\.embed_tokens\.weight' has shape \(262, 32\), base \(258, 32\)"):
        open_finetunes(base, {TASK: str(grown)}, vocab="error")
    reader = TaskVectorReader(TASK, base, open_checkpoint(str(grown)), vocab="error")
    with pytest.raises(CheckpointMismatch, match="lm_head.weight"):
        reader.get("lm_head.weight")
    with pytest.raises(ModelInputError, match="unknown vocab policy"):
        preflight(base, {}, vocab="crop")


def test_no_finetunes_is_a_clear_error(llama_kit):
    with pytest.raises(ModelInputError, match="--finetuned"):
        open_finetunes(open_checkpoint(str(llama_kit.base_dir)), {})


# --------------------------------------------------------------------------- pickles and remote code


def test_pickled_checkpoint_needs_allow_pickle(llama_kit, tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_kit.base_dir, dtype=torch.float32)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    for file in llama_kit.base_dir.glob("*.json"):
        shutil.copy(file, pickled / file.name)
    with pytest.raises(ModelInputError, match="pickled checkpoint") as error:
        open_checkpoint(str(pickled))
    assert "--allow-pickle" in str(error.value)
    with pytest.raises(ModelInputError, match="pickled checkpoint"):
        load_base_model(str(pickled), dtype="float32", device="cpu")
    reader = open_checkpoint(str(pickled), allow_pickle=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reader.get(name), tensor)
    base = load_base_model(str(pickled), dtype="float32", device="cpu", allow_pickle=True)
    assert torch.equal(base.model.model.norm.weight, model.model.norm.weight)


def test_trust_remote_code_is_off_by_default(llama_kit, tmp_path):
    assert inspect.signature(load_base_model).parameters["trust_remote_code"].default is False
    assert inspect.signature(Experiment.load).parameters["trust_remote_code"].default is False
    remote = tmp_path / "remote"
    shutil.copytree(llama_kit.base_dir, remote)
    marker = tmp_path / "code_ran"
    (remote / "configuration_custom.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'custom_remote'\n"
    )
    config = json.loads((remote / "config.json").read_text())
    config.update(model_type="custom_remote", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelInputError, match="--trust-remote-code"):
        load_base_model(str(remote), dtype="float32", device="cpu")
    assert not marker.exists()


# --------------------------------------------------------------------------- architecture


def test_unknown_architecture_lists_what_was_found():
    from transformers import PretrainedConfig

    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8), nn.ReLU()]))
    model.config = PretrainedConfig(num_attention_heads=2)
    with pytest.raises(ArchitectureError) as error:
        find_architecture(model)
    message = str(error.value)
    assert "Sequential" in message
    assert "0: Embedding" in message and "1: Linear" in message
    assert "2 (2 x Linear)" in message


# --------------------------------------------------------------------------- LoRA adapters


def _lora_adapter(kit, directory: Path, **lora_options):
    """A PEFT LoRA adapter on the kit's base with random non-zero B; returns (dir, merged state dict)."""
    import peft
    import transformers

    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(kit.base_dir, dtype=torch.float32)
    config = peft.LoraConfig(**lora_options)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    peft_model.save_pretrained(directory)
    merged = peft_model.merge_and_unload()
    return directory, {k: v.detach().clone() for k, v in merged.state_dict().items()}


@pytest.mark.parametrize("options", [
    {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    {"r": 4, "lora_alpha": 16, "use_rslora": True, "target_modules": ["o_proj", "up_proj"],
     "rank_pattern": {"up_proj": 2}, "alpha_pattern": {"up_proj": 3}},
], ids=["plain", "rslora-patterns"])
def test_lora_adapter_reads_as_merged_weights(llama_kit, tmp_path, options):
    adapter_dir, merged = _lora_adapter(llama_kit, tmp_path / "adapter", **options)
    base = open_checkpoint(str(llama_kit.base_dir))
    reader = open_checkpoint(str(adapter_dir), base=base)
    assert isinstance(reader, LoraReader)
    assert sorted(reader.names()) == sorted(base.names())
    adapted = [n for n in base.names() if any(t in n for t in options["target_modules"])]
    assert reader.adapted_names() == sorted(adapted)
    for name in base.names():
        torch.testing.assert_close(reader.get(name), merged[name], rtol=0, atol=1e-6)
    task_vectors, _ = open_finetunes(base, {"lora": str(adapter_dir)})
    adapter = {k.removeprefix("base_model.model."): v for k, v in load_file(adapter_dir / "adapter_model.safetensors").items()}
    for name in base.names():
        delta = task_vectors["lora"].get(name)
        if name not in adapted:
            assert torch.equal(delta, torch.zeros(base.shape(name)))
            continue
        stem = name.removesuffix(".weight")
        a, b = adapter[f"{stem}.lora_A.weight"], adapter[f"{stem}.lora_B.weight"]
        rank = a.shape[0]
        alpha = options.get("alpha_pattern", {}).get(stem.rsplit(".", 1)[-1], options["lora_alpha"])
        scale = alpha / rank**0.5 if options.get("use_rslora") else alpha / rank
        assert torch.equal(delta, (b @ a) * scale), name
        assert delta.abs().max() > 0


def test_lora_adapter_on_conv1d_fan_in_fan_out(toy_kit, tmp_path):
    kit = toy_kit("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapter_dir, merged = _lora_adapter(kit, tmp_path / "adapter", r=4, lora_alpha=8,
                                            target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    base = open_checkpoint(str(kit.base_dir))
    reader = open_checkpoint(str(adapter_dir), base=base)
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.2.mlp.c_fc.weight"):
        torch.testing.assert_close(reader.get(name), merged[name], rtol=0, atol=1e-6)
        assert not torch.equal(reader.get(name), base.get(name))


def test_lora_adapter_errors(llama_kit, tmp_path):
    adapter_dir, _ = _lora_adapter(llama_kit, tmp_path / "adapter", r=2, lora_alpha=2, target_modules=["q_proj"])
    with pytest.raises(ModelInputError, match="needs the base model"):
        open_checkpoint(str(adapter_dir))
    config_path = adapter_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "use_dora": True}))
    base = open_checkpoint(str(llama_kit.base_dir))
    with pytest.raises(ModelInputError, match="DoRA"):
        open_checkpoint(str(adapter_dir), base=base)
    config_path.write_text(json.dumps(config))
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.0.cross_attn.q_proj.lora_A.weight"] = torch.zeros(2, 32)
    save_file(tensors, adapter_dir / "adapter_model.safetensors")
    with pytest.raises(CheckpointMismatch, match="cross_attn"):
        open_checkpoint(str(adapter_dir), base=base)


# --------------------------------------------------------------------------- task data


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_task_file_records_in_order(tmp_path):
    lines = [{"text": "first"}, {"prompt": "Q: 1+1?", "completion": "2"}, {"question": "why", "answer": "because"},
             {"text": "fourth"}]
    path = _write(tmp_path / "task.jsonl", "\n".join(json.dumps(r) for r in lines) + "\n\n")
    data = read_task_file("t", path, samples=3, skip=1)
    assert data.texts == ["Q: 1+1?\n2", "why\nbecause", "fourth"]
    assert data.indices == [1, 2, 3]
    assert len(data.sha256) == 64 and data.provenance()["first_record"] == 1
    plain = read_task_file("t", _write(tmp_path / "task.txt", "one line\n\nanother line\n"), samples=None)
    assert plain.texts == ["one line", "another line"] and plain.indices == [0, 1]


@pytest.mark.parametrize("content, message", [
    ("", "has no records"),
    ("\n  \n\n", "has no records"),
    ('{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n', r"task\.jsonl:3: not valid JSON"),
    ('{"text": "fine"}\n\n{"label": 3}\n', r"task\.jsonl:3: no 'text' field .*label"),
    ('{"text": "fine"}\n[1, 2]\n', r"task\.jsonl:2: expected a JSON object"),
    ('{"text": "   "}\n', r"task\.jsonl:1: record 0 has empty text"),
])
def test_bad_task_files_name_file_and_line(tmp_path, content, message):
    path = _write(tmp_path / "task.jsonl", content)
    with pytest.raises(DataInputError, match=message):
        read_task_file("t", path)


def test_missing_task_file_and_skip_past_the_end(tmp_path):
    with pytest.raises(DataInputError, match="not found"):
        read_task_file("t", tmp_path / "nope.jsonl")
    path = _write(tmp_path / "task.jsonl", '{"text": "a"}\n{"text": "b"}\n')
    with pytest.raises(DataInputError, match="no records after the first 5"):
        read_task_file("t", path, skip=5)


def test_tokenize_pads_right_and_truncates(llama_kit, tmp_path):
    from submerge.diagnostics.toy import byte_tokenizer

    path = _write(tmp_path / "task.txt", "ab\nabcdefgh\nabcd\n")
    batches = tokenize(read_task_file("t", path), byte_tokenizer(), max_tokens=6, batch_size=2)
    assert [b.sample_index for b in batches] == [[0, 1], [2]]
    assert batches[0].attention_mask.tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert batches[0].input_ids[0, 2:].tolist() == [256] * 4
    with pytest.raises(DataInputError, match="max_tokens"):
        tokenize(read_task_file("t", path), byte_tokenizer(), max_tokens=0)


def test_parse_named_options():
    assert parse_named(["math=a.jsonl", "code=b=c.jsonl"], "data") == {"math": "a.jsonl", "code": "b=c.jsonl"}
    with pytest.raises(DataInputError, match="NAME=PATH"):
        parse_named(["math"], "data")
    with pytest.raises(DataInputError, match="given twice"):
        parse_named(["math=a", "math=b"], "data")


def test_experiment_needs_data_for_every_finetune(llama_kit):
    with pytest.raises(DataInputError, match=r"no --data for fine-tune\(s\) \['code'\]"):
        Experiment.load(str(llama_kit.base_dir), {TASK: str(llama_kit.finetuned_dir), "code": "x"},
                        {TASK: str(llama_kit.data_path)})


def test_content_hash_tells_a_fine_tune_from_its_base(llama_kit):
    base = open_checkpoint(str(llama_kit.base_dir)).fingerprint()
    tuned = open_checkpoint(str(llama_kit.finetuned_dir)).fingerprint()
    assert base["content_sha256"] != tuned["content_sha256"]


def test_all_finite_is_exact_also_when_the_sum_overflows_or_infinities_cancel():
    from submerge.diagnostics.task_vectors import all_finite

    big = torch.full((4,), 3e38)  # finite entries whose float32 sum overflows to inf
    assert all_finite(big) and all_finite(torch.zeros(0)) and all_finite(torch.arange(5))
    assert all_finite(torch.tensor([1e38, -3e38, 3e38, 3e38]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        tensor = torch.randn(1000)
        tensor[417] = bad
        assert not all_finite(tensor), bad
    assert not all_finite(torch.tensor([float("inf"), -float("inf"), 1.0]))  # sum NaN, not a false pass
    assert not all_finite(torch.tensor([3e38, 3e38, float("nan")]))

"""Architecture discovery and the project's naming scheme, on real tiny models of six architectures."""

from __future__ import annotations

import pytest
import torch

from submerge.diagnostics.modules import (
    FeedForward,
    find_architecture,
    find_submodules,
    get_module,
    input_module_path,
    module_parameter_names,
)
from submerge.diagnostics.tensors import TensorTable

ALL_LEVELS = ("layer", "attn", "head", "mlp", "linear", "model")

# architecture -> (layers path, attention child, MLP path of layer 1, output projection, transposed, final norm,
#                  backbone path, linear names of layer 1)
EXPECTED = {
    "llama": ("model.layers", "self_attn", "model.layers.1.mlp", "o_proj", False, "model.norm", "model",
              ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj"]),
    "qwen2": ("model.layers", "self_attn", "model.layers.1.mlp", "o_proj", False, "model.norm", "model",
              ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj"]),
    "mistral": ("model.layers", "self_attn", "model.layers.1.mlp", "o_proj", False, "model.norm", "model",
                ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj"]),
    "gemma3": ("model.layers", "self_attn", "model.layers.1.mlp", "o_proj", False, "model.norm", "model",
               ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj"]),
    "gpt2": ("transformer.h", "attn", "transformer.h.1.mlp", "c_proj", True, "transformer.ln_f", "transformer",
             ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]),
    "bert": ("encoder.layer", "attention", "encoder.layer.1.intermediate+output", "output.dense", False, None, "",
             ["attn.self.query", "attn.self.key", "attn.self.value", "attn.output.dense", "mlp.intermediate.dense",
              "mlp.output.dense"]),
}


@pytest.fixture(scope="module")
def base_models(toy_kit):
    from submerge.diagnostics.base_model import load_base_model

    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = load_base_model(str(toy_kit(name).base_dir), dtype="float32", device="cpu").model
        return loaded[name]

    return get


@pytest.mark.parametrize("name", list(EXPECTED))
def test_architecture_is_found_from_structure(base_models, name):
    layers_path, attn_child, mlp_path, o_proj, transposed, final_norm, backbone, _ = EXPECTED[name]
    arch = find_architecture(base_models(name))
    assert arch.layers_path == layers_path
    assert arch.num_layers == 3
    assert arch.attn_child == attn_child
    assert arch.mlp_path(1) == mlp_path
    assert arch.attn_path(2) == f"{layers_path}.2.{attn_child}"
    assert (arch.o_proj, arch.o_proj_transposed) == (o_proj, transposed)
    assert arch.final_norm_path == final_norm
    assert arch.backbone_path == backbone
    assert (arch.num_heads, arch.head_dim) == (4, 8)
    assert arch.num_kv_heads == (2 if name in ("llama", "qwen2", "mistral", "gemma3") else 4)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_submodule_names_follow_one_scheme(base_models, name):
    layers_path, attn_child, mlp_path, _, _, _, backbone, linears = EXPECTED[name]
    model = base_models(name)
    found = find_submodules(model, ALL_LEVELS, layers=[1])
    expected_names = (["layers.1", "layers.1.attn"] + [f"layers.1.attn.head.{h}" for h in range(4)]
                      + ["layers.1.mlp"] + [f"layers.1.{linear}" for linear in linears] + ["model"])
    assert [s.name for s in found] == expected_names
    by_name = {s.name: s for s in found}
    assert by_name["layers.1"].path == f"{layers_path}.1"
    assert by_name["layers.1.attn"].path == f"{layers_path}.1.{attn_child}"
    assert by_name["layers.1.attn.head.3"].path == f"{layers_path}.1.{attn_child}"
    assert by_name["layers.1.attn.head.3"].head == 3
    assert by_name["layers.1.mlp"].path == mlp_path
    assert by_name["model"].path == backbone and by_name["model"].layer == -1
    assert {s.level for s in found} == set(ALL_LEVELS)
    assert all(s.layer == 1 for s in found if s.level != "model")
    for submodule in found:
        if submodule.level == "linear":
            module = model.get_submodule(submodule.path)
            assert isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
            # a linear map's tensor is named like the same submodule in the tensor table
            assert TensorTable.from_model(model)[f"{submodule.path}.weight"].module == submodule.name


def test_default_levels_and_layer_order(base_models):
    found = find_submodules(base_models("llama"))
    assert [s.name for s in found] == [
        "layers.0", "layers.0.attn", "layers.0.mlp", "layers.1", "layers.1.attn", "layers.1.mlp",
        "layers.2", "layers.2.attn", "layers.2.mlp", "model"]
    with pytest.raises(ValueError, match="unknown levels \\['neuron'\\]"):
        find_submodules(base_models("llama"), ("layer", "neuron"))


def test_bert_mlp_is_intermediate_then_output(base_models):
    model = base_models("bert")
    path = find_architecture(model).mlp_path(0)
    module = get_module(model, path)
    assert isinstance(module, FeedForward)
    assert input_module_path(path) == "encoder.layer.0.intermediate"
    names = module_parameter_names(model, path)
    assert names["intermediate.dense.weight"] == "encoder.layer.0.intermediate.dense.weight"
    assert names["output.LayerNorm.bias"] == "encoder.layer.0.output.LayerNorm.bias"
    x = torch.randn(2, 5, 32)
    layer = model.encoder.layer[0]
    expected = layer.output(layer.intermediate(x), x)
    assert torch.equal(module(x), expected)


def test_module_parameter_names_are_full_model_names(base_models):
    model = base_models("llama")
    names = module_parameter_names(model, "model.layers.2.self_attn")
    assert names == {f"{p}.weight": f"model.layers.2.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    parameters = dict(model.named_parameters())
    assert all(full in parameters for full in module_parameter_names(model, "model").values())


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gemma3", "gpt2", "bert"])
def test_every_block_parameter_is_located_in_its_layer_and_replay_unit(base_models, name):
    """The table's level is the replay unit that runs the tensor (BERT's output.LayerNorm is in the MLP unit)."""
    model = base_models(name)
    arch = find_architecture(model)
    table = TensorTable.from_model(model)
    for layer in range(arch.num_layers):
        units = {"attn": get_module(model, arch.attn_path(layer)), "mlp": get_module(model, arch.mlp_path(layer))}
        inside = {level: {id(p) for p in unit.parameters()} for level, unit in units.items()}
        for parameter_name, parameter in model.get_submodule(arch.layer_path(layer)).named_parameters(
                prefix=arch.layer_path(layer)):
            info = table[parameter_name]
            assert info.layer == layer, parameter_name
            expected = next((level for level, ids in inside.items() if id(parameter) in ids), "norm")
            assert info.level == expected, parameter_name


EXPECTED_INFO = {
    # name -> (module, layer, level, kind, head_split, transposed)
    "llama": {
        "model.layers.1.self_attn.q_proj.weight": ("layers.1.attn.q_proj", 1, "attn", "matrix", "q", False),
        "model.layers.1.self_attn.k_proj.weight": ("layers.1.attn.k_proj", 1, "attn", "matrix", "kv", False),
        "model.layers.1.self_attn.o_proj.weight": ("layers.1.attn.o_proj", 1, "attn", "matrix", "o", False),
        "model.layers.1.mlp.down_proj.weight": ("layers.1.mlp.down_proj", 1, "mlp", "matrix", None, False),
        "model.layers.0.input_layernorm.weight": ("layers.0.input_layernorm", 0, "norm", "norm", None, False),
        "model.embed_tokens.weight": ("embed_tokens", -1, "embed", "embedding", None, False),
        "model.norm.weight": ("norm", -1, "final", "norm", None, False),
    },
    "qwen2": {
        "model.layers.0.self_attn.q_proj.bias": ("layers.0.attn.q_proj", 0, "attn", "bias", "q", False),
        "model.layers.0.self_attn.v_proj.bias": ("layers.0.attn.v_proj", 0, "attn", "bias", "kv", False),
    },
    "gemma3": {
        "model.layers.0.self_attn.q_norm.weight": ("layers.0.attn.q_norm", 0, "attn", "norm", None, False),
        "model.layers.0.pre_feedforward_layernorm.weight":
            ("layers.0.pre_feedforward_layernorm", 0, "norm", "norm", None, False),
    },
    "gpt2": {
        "transformer.h.1.attn.c_attn.weight": ("layers.1.attn.c_attn", 1, "attn", "matrix", "fused", True),
        "transformer.h.1.attn.c_proj.bias": ("layers.1.attn.c_proj", 1, "attn", "bias", "o", False),
        "transformer.h.1.mlp.c_fc.weight": ("layers.1.mlp.c_fc", 1, "mlp", "matrix", None, True),
        "transformer.h.1.ln_1.bias": ("layers.1.ln_1", 1, "norm", "norm", None, False),
        "transformer.wte.weight": ("wte", -1, "embed", "embedding", None, False),
        "transformer.wpe.weight": ("wpe", -1, "embed", "embedding", None, False),
        "transformer.ln_f.weight": ("ln_f", -1, "final", "norm", None, False),
    },
    "bert": {
        "encoder.layer.1.attention.self.query.weight": ("layers.1.attn.self.query", 1, "attn", "matrix", "q", False),
        "encoder.layer.1.attention.output.dense.weight":
            ("layers.1.attn.output.dense", 1, "attn", "matrix", "o", False),
        "encoder.layer.1.attention.output.LayerNorm.weight":
            ("layers.1.attn.output.LayerNorm", 1, "attn", "norm", None, False),
        "encoder.layer.1.intermediate.dense.weight":
            ("layers.1.mlp.intermediate.dense", 1, "mlp", "matrix", None, False),
        "encoder.layer.1.output.LayerNorm.weight": ("layers.1.mlp.output.LayerNorm", 1, "mlp", "norm", None, False),
        "embeddings.word_embeddings.weight": ("embeddings.word_embeddings", -1, "embed", "embedding", None, False),
        "embeddings.LayerNorm.weight": ("embeddings.LayerNorm", -1, "final", "norm", None, False),
        "pooler.dense.weight": ("pooler.dense", -1, "final", "matrix", None, False),
    },
}


@pytest.mark.parametrize("name", list(EXPECTED_INFO))
def test_tensor_table_entries(base_models, name):
    table = TensorTable.from_model(base_models(name))
    for tensor, expected in EXPECTED_INFO[name].items():
        info = table[tensor]
        assert (info.module, info.layer, info.level, info.kind, info.head_split, info.transposed) == expected, tensor


def test_tensor_table_units_and_ties(base_models):
    model = base_models("gpt2")  # GPT-2 ties lm_head to wte
    table = TensorTable.from_model(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert table["lm_head.weight"].tied_to == "transformer.wte.weight" and table["lm_head.weight"].kind == "embedding"
    assert table["transformer.wte.weight"].tied_to is None
    # a checkpoint that stores the tied tensor once has one entry for it
    stored_once = TensorTable.from_model(model, {"lm_head.weight": "transformer.wte.weight"})
    assert "lm_head.weight" not in stored_once.names() and "transformer.wte.weight" in stored_once.names()
    q = table["transformer.h.1.attn.c_attn.weight"]
    assert [q.unit(g) for g in ("model", "layer", "attn-mlp", "head-mlp")] == [
        "model", "layers.1", "layers.1.attn", "layers.1.attn"]
    norm = table["transformer.h.1.ln_1.weight"]
    assert [norm.unit(g) for g in ("model", "layer", "attn-mlp")] == ["model", "layers.1", None]
    assert table["transformer.wte.weight"].unit("layer") is None
    with pytest.raises(ValueError, match="unknown granularity"):
        q.unit("neuron")
    with pytest.raises(KeyError, match="not a parameter"):
        table["transformer.h.9.attn.c_attn.weight"]

"""Architecture discovery and the project's naming scheme, on real tiny models of six architectures."""

from __future__ import annotations

import pytest
import torch

from diagnostics.modules import (
    FeedForward,
    ParameterLocation,
    find_architecture,
    find_submodules,
    get_module,
    input_module_path,
    module_parameter_names,
    parameter_location,
)

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
    from diagnostics.models import load_base_model

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
            # a linear map's checkpoint name locates back to the same submodule name
            assert parameter_location(f"{submodule.path}.weight").module == submodule.name


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


@pytest.mark.parametrize("name, expected", [
    # llama / mistral / qwen
    ("model.layers.3.self_attn.q_proj.weight", ("layers.3.attn.q_proj", 3, "attn")),
    ("model.layers.3.self_attn.q_proj.bias", ("layers.3.attn.q_proj", 3, "attn")),
    ("model.layers.12.mlp.down_proj.weight", ("layers.12.mlp.down_proj", 12, "mlp")),
    ("model.layers.0.input_layernorm.weight", ("layers.0.input_layernorm", 0, "norm")),
    ("model.layers.0.post_attention_layernorm.weight", ("layers.0.post_attention_layernorm", 0, "norm")),
    ("model.embed_tokens.weight", ("embed_tokens", -1, "embed")),
    ("model.norm.weight", ("norm", -1, "norm")),
    ("lm_head.weight", ("lm_head", -1, "embed")),
    # gpt2
    ("transformer.h.2.attn.c_attn.weight", ("layers.2.attn.c_attn", 2, "attn")),
    ("transformer.h.2.attn.c_proj.bias", ("layers.2.attn.c_proj", 2, "attn")),
    ("transformer.h.2.mlp.c_fc.weight", ("layers.2.mlp.c_fc", 2, "mlp")),
    ("transformer.h.2.ln_1.weight", ("layers.2.ln_1", 2, "norm")),
    ("transformer.wte.weight", ("wte", -1, "embed")),
    ("transformer.wpe.weight", ("wpe", -1, "embed")),
    ("transformer.ln_f.bias", ("ln_f", -1, "norm")),
    # bert (with or without the `bert.` prefix)
    ("bert.encoder.layer.1.attention.self.query.weight", ("layers.1.attn.self.query", 1, "attn")),
    ("encoder.layer.1.attention.output.dense.weight", ("layers.1.attn.output.dense", 1, "attn")),
    ("encoder.layer.1.intermediate.dense.weight", ("layers.1.mlp.intermediate.dense", 1, "mlp")),
    ("encoder.layer.1.output.dense.bias", ("layers.1.mlp.output.dense", 1, "mlp")),
    ("encoder.layer.1.output.LayerNorm.weight", ("layers.1.output.LayerNorm", 1, "norm")),
    ("bert.embeddings.word_embeddings.weight", ("word_embeddings", -1, "embed")),
    ("pooler.dense.weight", ("pooler.dense", -1, "other")),
])
def test_parameter_location(name, expected):
    assert parameter_location(name) == ParameterLocation(*expected)


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma3"])
def test_every_block_parameter_is_located_in_its_layer_and_part(base_models, name):
    model = base_models(name)
    arch = find_architecture(model)
    for layer in range(arch.num_layers):
        attn_prefix = arch.attn_path(layer) + "."
        mlp_prefix = arch.mlp_path(layer) + "."
        for parameter_name, _ in model.get_submodule(arch.layer_path(layer)).named_parameters(
                prefix=arch.layer_path(layer)):
            location = parameter_location(parameter_name)
            assert location.layer == layer, parameter_name
            expected = "attn" if parameter_name.startswith(attn_prefix) else (
                "mlp" if parameter_name.startswith(mlp_prefix) else "norm")
            assert location.level == expected, parameter_name

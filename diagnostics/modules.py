"""Submodules of a transformer at every granularity, found by the model's structure.

One naming scheme for the whole project:

    model                      the whole network (final hidden state, or logits)
    layers.3                   decoder / encoder block 3
    layers.3.attn              its attention module
    layers.3.attn.head.5       head 5 of it (its slice of the output projection)
    layers.3.mlp               its MLP (BERT: intermediate + output)
    layers.3.attn.q_proj       a single linear map (path relative to attn / mlp)
    layers.3.mlp.down_proj

Blocks are found as the longest `nn.ModuleList` whose every element has an
attention child and an MLP child; no list of model names is needed, so Llama,
Mistral, Qwen2/3, Gemma/Gemma3, GPT-2 and BERT (and their relatives) work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from submerge.diagnostics.errors import ArchitectureError

LEVELS = ("model", "layer", "attn", "mlp", "head", "linear")
DEFAULT_LEVELS = ("model", "layer", "attn", "mlp")
# merge granularity -> the levels whose units get their own α
GRANULARITIES = {"model": ("model",), "layer": ("layer",), "attn-mlp": ("attn", "mlp"), "head-mlp": ("head", "mlp")}

_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention", "mixer")
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe")


@dataclass(frozen=True)
class Submodule:
    """One unit the diagnostics measure. `path` is the module's dotted path in the model."""

    name: str
    level: str
    layer: int
    path: str
    head: int | None = None


@dataclass(frozen=True)
class Architecture:
    """Where the parts of a transformer live, found from its structure."""

    backbone_path: str
    layers_path: str
    num_layers: int
    attn_child: str
    mlp_children: tuple[str, ...]
    o_proj: str  # path of the attention output projection, relative to the attention module
    o_proj_transposed: bool  # GPT-2 Conv1D stores (in, out)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    final_norm_path: str | None

    def layer_path(self, layer: int) -> str:
        return f"{self.layers_path}.{layer}"

    def attn_path(self, layer: int) -> str:
        return f"{self.layer_path(layer)}.{self.attn_child}"

    def mlp_path(self, layer: int) -> str:
        return f"{self.layer_path(layer)}.{'+'.join(self.mlp_children)}"


class FeedForward(nn.Module):
    """BERT's MLP as one module: output(intermediate(x), x) (dense, act, dense, dropout, LayerNorm(+x))."""

    def __init__(self, intermediate: nn.Module, output: nn.Module):
        super().__init__()
        self.intermediate = intermediate
        self.output = output

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.output(self.intermediate(hidden_states), hidden_states)


def is_linear(module: nn.Module) -> bool:
    """A linear map: `nn.Linear`, or transformers' `Conv1D` (GPT-2), which stores its weight (in, out)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _find_child(block: nn.Module, names: tuple[str, ...], class_word: str) -> str | None:
    children = dict(block.named_children())
    for name in names:
        if name in children:
            return name
    for name, child in children.items():
        if class_word.lower() in type(child).__name__.lower():
            return name
    return None


def _mlp_children(block: nn.Module) -> tuple[str, ...] | None:
    found = _find_child(block, _MLP_NAMES, "MLP")
    if found:
        return (found,)
    children = dict(block.named_children())
    if "intermediate" in children and "output" in children:
        return ("intermediate", "output")
    return None


def _config_value(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def find_architecture(model: nn.Module) -> Architecture:
    """Locate blocks, attention, MLP, output projection and final norm of `model`."""
    best: tuple[str, nn.ModuleList] | None = None
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if all(_find_child(b, _ATTN_NAMES, "Attention") and _mlp_children(b) for b in module):
                if best is None or len(module) > len(best[1]):
                    best = (path, module)
    if best is None:
        top = ", ".join(f"{n}: {type(m).__name__}" for n, m in model.named_children())
        lists = [f"{p} ({len(m)} x {type(m[0]).__name__})" for p, m in model.named_modules()
                 if isinstance(m, nn.ModuleList) and len(m)]
        raise ArchitectureError(
            f"could not find transformer blocks in {type(model).__name__}: no ModuleList whose elements all have "
            f"an attention child and an MLP child. Top-level modules: {top or 'none'}; module lists: {lists or 'none'}"
        )
    layers_path, layers = best
    block = layers[0]
    attn_child = _find_child(block, _ATTN_NAMES, "Attention")
    mlp_children = _mlp_children(block)
    attention = getattr(block, attn_child)
    linears = [(name, m) for name, m in attention.named_modules() if is_linear(m)]
    if not linears:
        raise ArchitectureError(f"{layers_path}.0.{attn_child} ({type(attention).__name__}) has no linear maps")
    o_proj, o_module = linears[-1]
    config = getattr(model, "config", None)
    num_heads = int(_config_value(config, "num_attention_heads", "n_head", default=0))
    if num_heads <= 0:
        raise ArchitectureError(f"{type(model).__name__}: config has no num_attention_heads")
    transposed = type(o_module).__name__ == "Conv1D"
    o_in = o_module.weight.shape[0] if transposed else o_module.weight.shape[1]
    head_dim = int(_config_value(config, "head_dim", default=o_in // num_heads))
    if head_dim * num_heads != o_in:
        head_dim = o_in // num_heads
    num_kv_heads = int(_config_value(config, "num_key_value_heads", default=num_heads))
    backbone_path = _backbone_path(model, layers_path)
    backbone = model.get_submodule(backbone_path) if backbone_path else model
    final_norm = None
    for name, child in backbone.named_children():
        if "norm" in type(child).__name__.lower() and "embed" not in name:
            final_norm = f"{backbone_path}.{name}" if backbone_path else name
    return Architecture(
        backbone_path=backbone_path, layers_path=layers_path, num_layers=len(layers), attn_child=attn_child,
        mlp_children=mlp_children, o_proj=o_proj, o_proj_transposed=transposed, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, final_norm_path=final_norm,
    )


def _backbone_path(model: nn.Module, layers_path: str) -> str:
    """The nearest ancestor of the blocks that also holds the token embedding (it takes input_ids)."""
    parts = layers_path.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        path = ".".join(parts[:cut])
        ancestor = model.get_submodule(path) if path else model
        for name, module in ancestor.named_modules():
            if isinstance(module, nn.Embedding) and not (f"{path}.{name}" if path else name).startswith(layers_path):
                return path
    return ""


def find_submodules(
    model: nn.Module, levels=DEFAULT_LEVELS, *, layers: list[int] | None = None, arch: Architecture | None = None
) -> list[Submodule]:
    """All submodules of the requested levels, ordered by layer then level."""
    arch = arch or find_architecture(model)
    unknown = set(levels) - set(LEVELS)
    if unknown:
        raise ValueError(f"unknown levels {sorted(unknown)}; choose from {LEVELS}")
    chosen = range(arch.num_layers) if layers is None else layers
    found: list[Submodule] = []
    for layer in chosen:
        if "layer" in levels:
            found.append(Submodule(f"layers.{layer}", "layer", layer, arch.layer_path(layer)))
        if "attn" in levels:
            found.append(Submodule(f"layers.{layer}.attn", "attn", layer, arch.attn_path(layer)))
        if "head" in levels:
            for head in range(arch.num_heads):
                found.append(Submodule(f"layers.{layer}.attn.head.{head}", "head", layer, arch.attn_path(layer), head))
        if "mlp" in levels:
            found.append(Submodule(f"layers.{layer}.mlp", "mlp", layer, arch.mlp_path(layer)))
        if "linear" in levels:
            block = model.get_submodule(arch.layer_path(layer))
            for name, module in block.named_modules():
                if not is_linear(module):
                    continue
                part, _, rest = name.partition(".")
                kind = "attn" if part == arch.attn_child else "mlp" if part in arch.mlp_children else None
                if kind is None:
                    continue
                local = rest if kind == "attn" or len(arch.mlp_children) == 1 else name
                found.append(Submodule(f"layers.{layer}.{kind}.{local}", "linear", layer, f"{arch.layer_path(layer)}.{name}"))
    if "model" in levels:
        found.append(Submodule("model", "model", -1, arch.backbone_path))
    return found


def get_module(model: nn.Module, path: str) -> nn.Module:
    """The module at `path`; a `+`-joined path (BERT's MLP) becomes a `FeedForward` over its parts."""
    if "+" in path:
        parent, _, joined = path.rpartition(".")
        first, second = joined.split("+")
        return FeedForward(model.get_submodule(f"{parent}.{first}"), model.get_submodule(f"{parent}.{second}"))
    return model.get_submodule(path) if path else model


def input_module_path(path: str) -> str:
    """The module whose forward pre-hook sees `path`'s input (BERT MLP: its intermediate)."""
    if "+" in path:
        parent, _, joined = path.rpartition(".")
        return f"{parent}.{joined.split('+')[0]}"
    return path


def module_parameter_names(model: nn.Module, path: str) -> dict[str, str]:
    """Local parameter name (as `functional_call` sees it) → full parameter name in `model`."""
    module = get_module(model, path)
    if "+" in path:
        parent = path.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
    else:
        prefix = f"{path}." if path else ""
    return {local: prefix + local for local, _ in module.named_parameters(remove_duplicate=False)}

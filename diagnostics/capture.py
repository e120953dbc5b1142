"""Capture inputs on the base model, replay modules on any parameters.

Inputs H_t^i of module i on task t are recorded on the base model θ0 with
forward pre-hooks (``with_kwargs=True``; seed 002 §A.3.3): attention gets the
block's normed hidden states plus its kwargs (position embeddings, mask), the
MLP its own input, a block the previous block's output. A variant of the module
(base, fine-tuned, θ0 + aτ, merged) is evaluated by replaying the module on the
recorded inputs with `torch.func.functional_call` and the variant's parameters:
no forward per variant, no second model.

Memory: `record_inputs` records only the modules it is given and stops the
forward after the deepest of them, so callers capture and consume a few layers
at a time (`layer_chunks`). The model level (`model_outputs`) runs the network
block by block for all variants together, building each block's θ0 + Σ c_t τ_t
from the base block and lazily read task vectors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

from diagnostics.data import TokenBatch
from diagnostics.models import BaseModel, TaskVectorReader
from diagnostics.modules import Architecture, get_module, input_module_path, module_parameter_names

Variant = dict[str, float]  # task -> coefficient c_t in θ0 + Σ_t c_t τ_t
_DROPPED_KWARGS = ("past_key_values", "past_key_value", "layer_past", "use_cache", "output_attentions")


@dataclass
class Recorded:
    """The inputs of one module for one batch, as its forward received them."""

    args: tuple
    kwargs: dict
    token_mask: torch.Tensor  # (batch, seq) bool, real tokens
    sample_index: list[int]


class _StopForward(Exception):
    pass


def _call_backbone(backbone: nn.Module, batch: TokenBatch, device) -> None:
    kwargs = {"input_ids": batch.input_ids.to(device), "attention_mask": batch.attention_mask.to(device)}
    parameters = inspect.signature(backbone.forward).parameters
    if "use_cache" in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        kwargs["use_cache"] = False
    backbone(**kwargs)


def _clean_kwargs(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k not in _DROPPED_KWARGS}


@contextmanager
def hooks():
    """Collect hook handles in the yielded list; every one is removed on exit, also on an error."""
    handles: list = []
    try:
        yield handles
    finally:
        for handle in handles:
            handle.remove()


def _stop_forward(*_args) -> None:
    raise _StopForward


def _until_stop(call: Callable[[], object]) -> None:
    """Run `call`, treating `_StopForward` (raised by a stop hook) as its normal end."""
    try:
        call()
    except _StopForward:
        pass


@dataclass
class CaptureState:
    """Where the last partial forward over some batches stopped: block `layer`'s output for each batch.

    A later capture of deeper blocks starts from there instead of re-running the prefix: the blocks up to
    `layer` return their saved output without computing (the backbone still embeds the tokens and builds
    the masks and position embeddings each block needs, which is cheap), so capture over consecutive
    chunks costs about one forward per batch in all.
    """

    layer: int = -1
    outputs: list = field(default_factory=list)


@contextmanager
def _skipped_blocks(model: nn.Module, arch: Architecture, state: CaptureState | None, batch_index: int, first: int):
    """Blocks 0..state.layer return their saved output instead of running, if none of them is needed (< first)."""
    skipped = []
    if state is not None and 0 <= state.layer < first and batch_index < len(state.outputs):
        saved = state.outputs[batch_index]
        skipped = [model.get_submodule(arch.layer_path(i)) for i in range(state.layer + 1)]
    try:
        for block in skipped:
            block.forward = lambda *args, saved=saved, **kwargs: saved
        yield
    finally:
        for block in skipped:
            del block.forward


def _partial_forward(model, arch, batches, device, deepest: int, first: int, register, state) -> None:
    """Run the backbone on each batch with `register(handles, b, batch, mask)`'s hooks, stopping after `deepest`.

    With a `state`, starts from where the previous partial forward stopped (when that is before `first`, the
    shallowest block needed) and leaves `deepest`'s output per batch in it.
    """
    backbone = get_module(model, arch.backbone_path)
    stops = 0 <= deepest < arch.num_layers - 1
    outputs = []
    for b, batch in enumerate(batches):
        mask = batch.attention_mask.to(device).bool()
        with hooks() as handles, _skipped_blocks(model, arch, state, b, first):
            register(handles, b, batch, mask)
            if stops:
                def stop(module, args, output):
                    outputs.append(output)
                    raise _StopForward
                handles.append(model.get_submodule(arch.layer_path(deepest)).register_forward_hook(stop))
            _until_stop(lambda batch=batch: _call_backbone(backbone, batch, device))
    if state is not None and stops:
        state.layer, state.outputs = deepest, outputs


@torch.no_grad()
def record_inputs(
    model: nn.Module,
    arch: Architecture,
    paths: Iterable[str],
    batches: list[TokenBatch],
    *,
    device: torch.device | str = "cpu",
    state: CaptureState | None = None,
) -> dict[str, list[Recorded]]:
    """Record the inputs of the modules at `paths` on every batch (one partial forward per batch).

    The forward stops after the last block that holds a requested module. With a `state` (one per list of
    batches), consecutive calls over deeper and deeper blocks continue from where the previous one stopped.
    """
    paths = list(dict.fromkeys(paths))
    recorded: dict[str, list[Recorded]] = {path: [] for path in paths}
    layers = [_layer_of(arch, p) for p in paths]

    def register(handles, b, batch, mask):
        for path in paths:
            def hook(module, args, kwargs, path=path):
                recorded[path].append(Recorded(tuple(args), _clean_kwargs(kwargs), mask, batch.sample_index))
            handles.append(model.get_submodule(input_module_path(path)).register_forward_pre_hook(
                hook, with_kwargs=True))

    _partial_forward(model, arch, batches, device, max(layers, default=-1), min(layers, default=-1), register, state)
    return recorded


def _layer_of(arch: Architecture, path: str) -> int:
    prefix = arch.layers_path + "."
    if not path.startswith(prefix):
        return arch.num_layers - 1
    return int(path[len(prefix):].split(".", 1)[0])


def layer_chunks(num_layers: int, bytes_per_layer: int, budget_bytes: int) -> list[list[int]]:
    """Split layers into consecutive groups whose recorded inputs fit in `budget_bytes`."""
    size = max(1, int(budget_bytes // max(1, bytes_per_layer)))
    return [list(range(start, min(num_layers, start + size))) for start in range(0, num_layers, size)]


def first_output(output):
    """Module outputs: tensors as they are; tuples (attention) → element 0."""
    if isinstance(output, (tuple, list)):
        return output[0]
    if hasattr(output, "last_hidden_state"):
        return output.last_hidden_state
    return output


@torch.no_grad()
def replay(module: nn.Module, recorded: Recorded, parameters: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Run `module` on recorded inputs with `parameters` (local names) replacing its own; base if None."""
    if parameters:
        output = functional_call(module, parameters, recorded.args, recorded.kwargs, strict=False)
    else:
        output = module(*recorded.args, **recorded.kwargs)
    return first_output(output)


@torch.no_grad()
def replay_with_heads(
    attention: nn.Module,
    arch: Architecture,
    recorded: Recorded,
    parameters: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replay an attention module; also return its output projection's input and weight.

    Heads do not mix before the output projection W_o, so head h contributes
    x_h · W_o[:, h·d:(h+1)·d]ᵀ, with x_h head h's slice of W_o's input (`split_heads`,
    `head_output`); the heads sum to W_o's output minus its bias.
    """
    o_proj = attention.get_submodule(arch.o_proj)
    seen: dict[str, torch.Tensor] = {}

    def hook(module, args):
        seen["x"] = args[0]

    with hooks() as handles:
        handles.append(o_proj.register_forward_pre_hook(hook))
        output = replay(attention, recorded, parameters)
    weight = (parameters or {}).get(f"{arch.o_proj}.weight", o_proj.weight)
    return output, seen["x"], weight


def split_heads(o_proj_input: torch.Tensor, o_proj_weight: torch.Tensor, arch: Architecture) -> torch.Tensor:
    """Per-head contributions to the output projection: (..., heads, out)."""
    heads, dim = arch.num_heads, arch.head_dim
    x = o_proj_input.reshape(*o_proj_input.shape[:-1], heads, dim)
    if arch.o_proj_transposed:  # Conv1D: y = x W, W (in, out)
        return torch.einsum("...hd,hdo->...ho", x, o_proj_weight.reshape(heads, dim, -1).to(x.dtype))
    return torch.einsum("...hd,ohd->...ho", x, o_proj_weight.reshape(-1, heads, dim).to(x.dtype))


def head_output(o_proj_input: torch.Tensor, o_proj_weight: torch.Tensor, arch: Architecture, head: int) -> torch.Tensor:
    """Head `head`'s contribution x_h · W_o[:, h·d:(h+1)·d]ᵀ, shape (..., out)."""
    lo, hi = head * arch.head_dim, (head + 1) * arch.head_dim
    x = o_proj_input[..., lo:hi]
    if arch.o_proj_transposed:
        return x @ o_proj_weight[lo:hi, :].to(x.dtype)
    return x @ o_proj_weight[:, lo:hi].to(x.dtype).T


def sample_features(output: torch.Tensor, token_mask: torch.Tensor) -> list[torch.Tensor]:
    """One flattened float64 vector per sequence, real tokens only."""
    return [output[i][token_mask[i]].reshape(-1).double() for i in range(output.shape[0])]


# --------------------------------------------------------------------------- parameters of variants


class ParameterSource:
    """Base parameters of modules and their task vectors, read lazily, combined into variants."""

    def __init__(self, base: BaseModel, task_vectors: dict[str, TaskVectorReader]):
        self.base = base
        self.task_vectors = task_vectors
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

    def base_parameters(self, path: str) -> dict[str, torch.Tensor]:
        module = get_module(self.base.model, path)
        return dict(module.named_parameters(remove_duplicate=False))

    def deltas(self, path: str, task: str) -> dict[str, torch.Tensor]:
        """τ_task of every parameter of the module at `path` (local names), float32, on the model's device."""
        reader = self.task_vectors[task]
        device = next(self.base.model.parameters()).device
        out = {}
        for local, full in module_parameter_names(self.base.model, path).items():
            key = (task, full)
            if key not in self._cache:
                self._cache[key] = reader.get(self.base.checkpoint_name(full), torch.float32, device)
            out[local] = self._cache[key]
        return out

    def variant(self, path: str, coefficients: Variant) -> dict[str, torch.Tensor] | None:
        """θ0 + Σ_t c_t τ_t for the module at `path`, in the module's dtype (None = the base itself)."""
        active = {t: c for t, c in coefficients.items() if c != 0}
        if not active:
            return None
        params = {}
        base_params = self.base_parameters(path)
        deltas = {t: self.deltas(path, t) for t in active}
        for local, weight in base_params.items():
            compute = torch.promote_types(weight.dtype, torch.float32)  # float64 models stay float64
            value = weight.to(compute)
            for task, coefficient in active.items():
                value = value + coefficient * deltas[task][local].to(compute)
            params[local] = value.to(weight.dtype)
        return params

    def changed(self, path: str, task: str) -> bool:
        return any(bool(d.abs().max() > 0) for d in self.deltas(path, task).values() if d.numel())

    def clear(self) -> None:
        self._cache.clear()


# --------------------------------------------------------------------------- the model level


@torch.no_grad()
def model_outputs(
    source: ParameterSource,
    arch: Architecture,
    batches: list[TokenBatch],
    variants: list[Variant],
    *,
    output: str = "hidden",
    on_layer: Callable[[int], None] | None = None,
) -> list[list[torch.Tensor]]:
    """Final hidden states (after the final norm) or logits of every variant, block by block.

    Returns outputs[variant][batch] of shape (batch, seq, hidden | vocab). Only one block's
    parameters per variant exist at a time, never a second model.
    """
    model = source.base.model
    device = next(model.parameters()).device
    backbone = get_module(model, arch.backbone_path)
    layer_paths = [arch.layer_path(i) for i in range(arch.num_layers)]
    # 1. the inputs of every block on the base (kwargs: masks, positions do not depend on weights)
    block_inputs = record_inputs(model, arch, layer_paths, batches, device=device)
    # 2. the embedding stage per variant: backbone parameters outside blocks and final norm
    prefix = f"{arch.backbone_path}." if arch.backbone_path else ""
    embed_locals = [n for n, _ in backbone.named_parameters(remove_duplicate=False)
                    if not (prefix + n).startswith(arch.layers_path + ".")
                    and not (arch.final_norm_path and (prefix + n).startswith(arch.final_norm_path + "."))]
    hidden: list[list[torch.Tensor]] = []
    for variant in variants:
        params = _subset_variant(source, arch.backbone_path, variant, embed_locals)
        per_batch = []
        for b, batch in enumerate(batches):
            first = block_inputs[layer_paths[0]][b]
            if params is None:
                per_batch.append(_hidden_of(first))
                continue
            per_batch.append(_embed_with(backbone, params, model, layer_paths[0], batch, device))
        hidden.append(per_batch)
    # 3. the blocks
    for i, path in enumerate(layer_paths):
        block = model.get_submodule(path)
        for v, variant in enumerate(variants):
            params = source.variant(path, variant)
            for b in range(len(batches)):
                rec = block_inputs[path][b]
                args, kwargs = _with_hidden(rec, hidden[v][b])
                out = functional_call(block, params, args, kwargs, strict=False) if params else block(*args, **kwargs)
                hidden[v][b] = first_output(out)
        source.clear()
        if on_layer:
            on_layer(i)
    del block_inputs
    # 4. final norm and, on request, the output head
    heads = []
    if arch.final_norm_path:
        heads.append(arch.final_norm_path)
    if output == "logits":
        head_path = _output_head_path(model)
        heads.append(head_path)
    for path in heads:
        module = model.get_submodule(path)
        for v, variant in enumerate(variants):
            params = source.variant(path, variant)
            for b in range(len(batches)):
                x = hidden[v][b]
                hidden[v][b] = functional_call(module, params, (x,), strict=False) if params else module(x)
        source.clear()
    return hidden


def _output_head_path(model: nn.Module) -> str:
    embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embeddings is None:
        raise ValueError(f"{type(model).__name__} has no output head; use --model-output hidden")
    for name, module in model.named_modules():
        if module is embeddings:
            return name
    raise ValueError("output head not found among the model's modules")


def _hidden_of(recorded: Recorded) -> torch.Tensor:
    return recorded.args[0] if recorded.args else recorded.kwargs["hidden_states"]


def _with_hidden(recorded: Recorded, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if recorded.args:
        return (hidden, *recorded.args[1:]), recorded.kwargs
    return recorded.args, {**recorded.kwargs, "hidden_states": hidden}


def _subset_variant(source: ParameterSource, path: str, variant: Variant, locals_: list[str]):
    """θ0 + Σ c τ restricted to some parameters of the module at `path`; None when they do not change."""
    if not locals_ or not any(variant.values()):
        return None
    device = next(source.base.model.parameters()).device
    module = get_module(source.base.model, path)
    names = module_parameter_names(source.base.model, path)
    own = dict(module.named_parameters(remove_duplicate=False))
    params, changed = {}, False
    for local in locals_:
        compute = torch.promote_types(own[local].dtype, torch.float32)  # float64 models stay float64
        value = own[local].to(compute)
        for task, coefficient in variant.items():
            if coefficient:
                delta = source.task_vectors[task].get(source.base.checkpoint_name(names[local]), torch.float32, device)
                changed = changed or bool(delta.abs().max() > 0)
                value = value + coefficient * delta.to(compute)
        params[local] = value.to(own[local].dtype)
    return params if changed else None


def _embed_with(backbone, params, model, first_layer_path, batch, device) -> torch.Tensor:
    seen = {}

    def hook(module, args, kwargs):
        seen["hidden"] = args[0] if args else kwargs["hidden_states"]
        raise _StopForward

    kwargs = {"input_ids": batch.input_ids.to(device), "attention_mask": batch.attention_mask.to(device)}
    with hooks() as handles:
        handles.append(model.get_submodule(first_layer_path).register_forward_pre_hook(hook, with_kwargs=True))
        _until_stop(lambda: functional_call(backbone, params, (), kwargs, strict=False))
    return seen["hidden"]


# --------------------------------------------------------------------------- Gram matrices (RegMean)


@torch.no_grad()
def input_gram_matrices(model: nn.Module, arch: Architecture, batches: list[TokenBatch], *, device=None,
                        layers: Iterable[int] | None = None, dtype: torch.dtype = torch.float32,
                        state: CaptureState | None = None) -> dict[str, torch.Tensor]:
    """Σ_x x xᵀ over real tokens of the input of every linear map inside the blocks (`dtype`, CPU).

    Keys are the linear maps' weight names (e.g. ``model.layers.0.self_attn.q_proj.weight``). Recorded on
    the base model θ0, as the capture engine does; RegMean's paper uses each fine-tune's own activations.
    `layers` restricts it to some blocks (the forward stops after the deepest; a `state` continues where
    the previous call stopped). Memory: one in×in matrix per linear map of the chosen blocks (all blocks
    of a 7B model ≈ 14 GB in float32: use `input_grams_by_layer` to hold one block's at a time).
    """
    device = device or next(model.parameters()).device
    chosen = sorted(set(range(arch.num_layers) if layers is None else layers))
    grams: dict[str, torch.Tensor] = {}

    def register(handles, b, batch, mask):
        for layer in chosen:
            for name, module in model.get_submodule(arch.layer_path(layer)).named_modules():
                if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
                    key = f"{arch.layer_path(layer)}.{name}.weight"

                    def hook(module, args, key=key):
                        x = args[0][mask].to(dtype)
                        gram = x.T @ x
                        grams[key] = gram.cpu() if key not in grams else grams[key] + gram.cpu()

                    handles.append(module.register_forward_pre_hook(hook))

    _partial_forward(model, arch, batches, device, max(chosen, default=-1), min(chosen, default=-1), register, state)
    return grams


def input_grams_by_layer(model: nn.Module, arch: Architecture, batches: list[TokenBatch], *, device=None,
                         dtype: torch.dtype = torch.float32) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(layer, `input_gram_matrices` of that block) block after block, about one forward per batch in all."""
    state = CaptureState()
    for layer in range(arch.num_layers):
        yield layer, input_gram_matrices(model, arch, batches, device=device, layers=[layer], dtype=dtype, state=state)

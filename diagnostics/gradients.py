"""Gradients of a loss on the logits, block by block: the backward of `capture.model_outputs`.

The model is the base's architecture with every module's parameters built by a `Weights` object — θ_t =
θ0 + τ_t for a fine-tune's Fisher, θ0 + Σ_t λ_t τ_t for AdaMerging's coefficients — from the base block and
task vectors read lazily (`ParameterSource`). `backward_by_blocks` differentiates a loss on its logits with
respect to whatever the parameters are built from (the "leaves": the weights themselves, or λ):

1. forward, stage by stage as `model_outputs` does (every batch through a block before the next; one block's
   parameters built at a time), keeping each block's input stream per batch;
2. backward from the top: the final norm and the head are run with gradients on the last stream's positions that
   predict a real token (`data.predicting`: not the padding, not the last position) and the loss is
   differentiated; then each block, from the last to the first, is run again on its kept input with
   gradients on, and autograd gives the gradient with respect to its input (passed down) and to the leaves
   its parameters were built from (handed to `Weights.gradients`, per batch); finally the embedding stage.

A batch's gradients are its own, so a `Weights` object that sees batches of one record gets per-record
gradients (a diagonal Fisher squares them). Memory: one stage's parameters and their graph at a time, and the
block inputs of every batch (L × tokens × hidden in the compute dtype) — the activations a backward through
L blocks needs, kept at block boundaries (block-level gradient checkpointing). Never a second model: after
each stage the task vectors read for it are dropped, and for a base of at least `capture.RELEASE_BYTES` the
pages of its memory-mapped weights are given back too, as a capture forward does (below it they are not: each
release reads /proc/self/smaps, which costs more than a small model's block). TF32 is off throughout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from submerge.diagnostics import capture
from submerge.diagnostics.capture import (
    ParameterSource,
    block_kwargs,
    embed,
    embedding_stage_names,
    no_tf32,
    output_head_path,
    run_block,
    upcast,
)
from submerge.diagnostics.data import TokenBatch, predicting
from submerge.diagnostics.modules import Architecture

__all__ = ["Weights", "backward_by_blocks", "top_stage"]

#: The loss of one batch: loss(batch index, logits (n, vocab) in the compute dtype at the n positions that predict a
#: real token (`data.predicting`), the batch) → a scalar.
Loss = Callable[[int, torch.Tensor, TokenBatch], torch.Tensor]


class Weights:
    """How the model's parameters are built, and where their gradients go (subclass and override).

    ``parameters(path, names)`` → (the parameters of the module at `path` by local name — `names`, or all —
    in the compute dtype, plus any buffers to substitute; the leaf tensors they are built from, with
    ``requires_grad``). ``gradients(path, batch, grads)``: the loss's gradient with respect to each leaf that
    `parameters(path)` returned (None where a leaf is unused), for one batch. ``done(path)``: every batch of
    the stage at `path` has had its gradients.
    """

    def parameters(self, path: str, names: Sequence[str] | None = None
                   ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        raise NotImplementedError

    def gradients(self, path: str, batch: int, grads: Sequence[torch.Tensor | None]) -> None:
        raise NotImplementedError

    def done(self, path: str) -> None:
        """Every batch of the stage at `path` has had its gradients (nothing to do by default)."""


def top_stage(model: torch.nn.Module, arch: Architecture) -> list[str]:
    """The modules after the last block, in order: the final norm (if any) and the output head."""
    return ([arch.final_norm_path] if arch.final_norm_path else []) + [output_head_path(model)]


def _grad(output: torch.Tensor, inputs: list[torch.Tensor], grad_output: torch.Tensor | None):
    return torch.autograd.grad(output, inputs, grad_output, retain_graph=True, allow_unused=True)


def backward_by_blocks(source: ParameterSource, arch: Architecture, batches: list[TokenBatch], weights: Weights,
                       loss: Loss, *, on_stage: Callable[[str], None] | None = None) -> float:
    """Σ_b loss(b, logits_b, batch_b) of the model `weights` builds, and its gradients delivered to `weights`
    stage by stage from the head down (see the module docstring). Returns the summed loss.

    ``on_stage(path)`` is called after each stage's backward (progress). The base model is not modified.
    """
    model, device, compute = source.base.model, source.device, source.compute_dtype
    release = capture.releases_pages(model)
    layers = range(arch.num_layers)
    paths = [arch.layer_path(i) for i in layers]
    embed_names = embedding_stage_names(model, arch)
    with no_tf32():
        block_inputs = block_kwargs(model, arch, layers, batches, device=device, compute=compute)
        kept = _forward(source, arch, batches, weights, block_inputs, embed_names, release)
        total, streams = _top_backward(source, arch, batches, weights, loss, kept.pop(), release)
        _notify(weights, on_stage, *top_stage(model, arch))
        for path in reversed(paths):
            block = model.get_submodule(path)
            with torch.enable_grad():  # parameters built from leaves keep their graph
                params, leaves = weights.parameters(path)
            for b in range(len(batches)):
                with torch.enable_grad():
                    stream = kept[-1][b].detach().requires_grad_(True)
                    output = run_block(block, params, block_inputs[path][b].upcast(source.dtype_for(path)), stream)
                    grads = _grad(output, [stream, *leaves], streams[b])
                streams[b], kept[-1][b] = grads[0], None
                weights.gradients(path, b, grads[1:])
            kept.pop()
            del params, leaves
            source.clear(release_pages=release)
            _notify(weights, on_stage, path)
        with torch.enable_grad():
            params, leaves = weights.parameters(arch.backbone_path, embed_names)
        for b, batch in enumerate(batches):
            with torch.enable_grad():
                stream = upcast(embed(model, arch, params, batch, device), source.dtype_for(paths[0]))
                grads = _grad(stream, list(leaves), streams[b]) if leaves else []
            weights.gradients(arch.backbone_path, b, grads)
            streams[b] = None
        del params, leaves
        source.clear(release_pages=release)
        _notify(weights, on_stage, arch.backbone_path)
    return total


def _notify(weights: Weights, on_stage, *paths: str) -> None:
    for path in paths:
        weights.done(path)
        if on_stage is not None:
            on_stage(path)


@torch.no_grad()
def _forward(source: ParameterSource, arch: Architecture, batches, weights: Weights, block_inputs,
             embed_names: list[str], release: bool) -> list[list[torch.Tensor]]:
    """The input stream of every block per batch, and the last block's output: kept[l][b], l = 0 … L."""
    model, device = source.base.model, source.device
    params, _ = weights.parameters(arch.backbone_path, embed_names)
    first = source.dtype_for(arch.layer_path(0))
    streams = [upcast(embed(model, arch, params, batch, device), first) for batch in batches]
    del params
    source.clear(release_pages=release)
    kept = []
    for i in range(arch.num_layers):
        path = arch.layer_path(i)
        block, compute = model.get_submodule(path), source.dtype_for(path)
        params, _ = weights.parameters(path)
        kept.append(list(streams))
        streams = [run_block(block, params, block_inputs[path][b].upcast(compute), streams[b])
                   for b in range(len(batches))]
        del params
        source.clear(release_pages=release)
    kept.append(streams)
    return kept


def _top_backward(source: ParameterSource, arch: Architecture, batches, weights: Weights, loss: Loss,
                  last: list[torch.Tensor], release: bool) -> tuple[float, list[torch.Tensor]]:
    """The final norm and head on the last block's outputs, the loss and its gradients: (Σ loss, ∂loss/∂stream
    per batch); the leaves' gradients go to `weights`."""
    model = source.base.model
    with torch.enable_grad():
        stages = [(path, model.get_submodule(path), *weights.parameters(path)) for path in top_stage(model, arch)]
    total, streams = 0.0, []
    for b, batch in enumerate(batches):
        with torch.enable_grad():
            stream = last[b].detach().requires_grad_(True)
            value = predicting(stream, batch)  # the final norm and head run on the positions the loss reads only
            for path, module, params, _ in stages:
                value = torch.func.functional_call(module, params, (upcast(value, source.dtype_for(path)),),
                                                   strict=False)
            batch_loss = loss(b, value, batch)
            leaves = list({id(leaf): leaf for *_, stage_leaves in stages for leaf in stage_leaves}.values())
            grads = _grad(batch_loss, [stream, *leaves], None)
        last[b] = None
        total += float(batch_loss.detach())
        streams.append(grads[0])
        unsent = {id(leaf): grad for leaf, grad in zip(leaves, grads[1:])}  # a leaf two modules share: its one gradient
        for path, _, _, stage_leaves in stages:
            weights.gradients(path, b, [unsent.pop(id(leaf), None) for leaf in stage_leaves])
    del stages
    source.clear(release_pages=release)
    return total, streams

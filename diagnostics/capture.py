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
at a time (`layer_chunks`); with a `CaptureState` each chunk starts from the
hidden state where the previous one stopped, so capture stays about one forward
per batch whatever the budget. The model level (`model_outputs`) runs the
network block by block for all variants together, building each block's
θ0 + Σ c_t τ_t from the base block and lazily read task vectors.

Precision: the base is kept in its storage dtype (`--dtype`); capture forwards,
task vectors, variants and replays run in the compute dtype (the storage dtype
promoted to `--compute-dtype`, float32 by default) and are never rounded back.

Offload: a base loaded with ``offload=True`` keeps its weights in host memory
and computes on `execution_device`: each stage of a capture forward is copied
there while it runs (the same hooks that upcast it), and every variant is built
there from the host's base tensors and task vectors read onto the device.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

from submerge.diagnostics.base_model import BaseModel
from submerge.diagnostics.data import TokenBatch
from submerge.diagnostics.errors import ArchitectureError
from submerge.diagnostics.modules import Architecture, get_module, input_module_path, module_parameter_names
from submerge.diagnostics.placement import canonical_device, execution_device, release_mapped_pages
from submerge.diagnostics.task_vectors import TaskVectorReader

Variant = dict[str, float]  # task -> coefficient c_t in θ0 + Σ_t c_t τ_t
_DROPPED_KWARGS = ("past_key_values", "past_key_value", "layer_past", "use_cache", "output_attentions")


@dataclass
class Recorded:
    """The inputs of one module for one batch, as its forward received them."""

    args: tuple
    kwargs: dict
    token_mask: torch.Tensor  # (batch, seq) bool, real tokens
    sample_index: list[int]
    output: torch.Tensor | None = None  # the module's output on θ0, when the capture kept it (``outputs=True``)
    maps: dict[str, torch.Tensor] | None = None  # outputs on θ0 of linear maps inside it, by local name (the capture's)

    @property
    def hidden(self) -> torch.Tensor | None:
        """The hidden state among these inputs: the first argument, or the keyword ``hidden_states`` (None: neither)."""
        return self.args[0] if self.args else self.kwargs.get("hidden_states")

    def with_hidden(self, hidden: torch.Tensor) -> Recorded:
        """These inputs with `hidden` as the hidden state (`block_kwargs`' inputs, given a recorded stream)."""
        return Recorded(*_with_hidden(self, hidden), self.token_mask, self.sample_index, self.output, self.maps)

    def upcast(self, dtype: torch.dtype) -> Recorded:
        """These inputs (and the kept output) with every floating tensor of lower precision than `dtype` in `dtype`
        (never rounded down)."""
        return Recorded(upcast(self.args, dtype), upcast(self.kwargs, dtype), self.token_mask, self.sample_index,
                        upcast(self.output, dtype), upcast(self.maps, dtype))


def upcast(value, dtype: torch.dtype | None, device: torch.device | None = None):
    """`value` (a tensor, or tuples, lists and dicts of them) with floating tensors below `dtype` in `dtype`, and
    with every tensor on `device` (None: where it is).

    Tensors already in `dtype` (or wider, or `dtype` None) and on `device`, integer and boolean tensors on
    `device` and other objects come back as they are (the same objects).
    """
    if isinstance(value, torch.Tensor):
        wider, moved = _widened(value, dtype), device is not None and value.device != device
        if not (wider or moved):
            return value
        return value.to(device=device if moved else value.device, dtype=dtype if wider else value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(upcast(item, dtype, device) for item in value)
    if isinstance(value, dict):
        return {key: upcast(item, dtype, device) for key, item in value.items()}
    return value


def _widened(tensor: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """Whether `tensor` is floating and narrower than `dtype` (what `upcast` changes)."""
    return (dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype
            and torch.promote_types(tensor.dtype, dtype) == dtype)


def _placed(tensor: torch.Tensor, dtype: torch.dtype | None, device: torch.device | None) -> bool:
    """Whether `upcast(tensor, dtype, device)` is `tensor` itself (checked without copying it)."""
    return not _widened(tensor, dtype) and (device is None or tensor.device == device)


@contextmanager
def no_tf32():
    """TF32 matmuls and convolutions off (CUDA) inside the block, restored after: replays compute in full float32."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


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
        yield skipped
    finally:
        for block in skipped:
            del block.forward


def _compute_stages(model: nn.Module, arch: Architecture) -> list[nn.Module]:
    """The modules a forward runs: the backbone's children (embedding stage, final norm …), every block, the head."""
    backbone = get_module(model, arch.backbone_path)
    prefix = f"{arch.backbone_path}." if arch.backbone_path else ""
    layers = model.get_submodule(arch.layers_path)
    stages = [child for name, child in backbone.named_children()
              if not (arch.layers_path + ".").startswith(prefix + name + ".")]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return stages + [layers[i] for i in range(arch.num_layers)] + ([head] if head is not None else [])


def _in_compute_dtype(handles: list, model: nn.Module, arch: Architecture, compute: torch.dtype | None,
                      skipped: list[nn.Module], device: torch.device | None = None) -> None:
    """Hooks that run each stage of the forward in `compute` on `device` (its tensors upcast and moved there on
    entry, restored on exit; None: as they are).

    On exit each weight gets its own stored tensor back (the very same storage, not a rounded copy, so
    weights memory-mapped from the checkpoint stay mapped pages instead of becoming private memory);
    the stage's floating inputs are upcast and its outputs stay in `compute`, so a base stored in bfloat16 is
    captured as the float32 forward of the same weights. With an offloaded base (weights in host memory,
    `device` an accelerator) a stage's weights are on the device only while it runs: the device holds one
    block, not the model. Nothing is hooked when nothing would change, nor on the `skipped` blocks.
    """
    if compute is None and device is None:
        return
    device = None if device is None else canonical_device(device)
    for stage in _compute_stages(model, arch):
        if any(stage is block for block in skipped):
            continue
        tensors = [t for t in (*stage.parameters(), *stage.buffers()) if not _placed(t, compute, device)]
        if not tensors:
            continue
        stored: list[torch.Tensor] = []

        def enter(module, args, kwargs, tensors=tensors, stored=stored):
            stored[:] = [tensor.data for tensor in tensors]
            for tensor in tensors:
                tensor.data = upcast(tensor.data, compute, device)
            return upcast(args, compute, device), upcast(kwargs, compute, device)

        def leave(module, args, output, tensors=tensors, stored=stored):
            for tensor, original in zip(tensors, stored):
                tensor.data = original
            stored.clear()

        handles.append(stage.register_forward_pre_hook(enter, with_kwargs=True, prepend=True))
        handles.append(stage.register_forward_hook(leave, prepend=True, always_call=True))


#: Bytes of recorded inputs held at once (--capture-budget). Capture costs one forward whatever the budget (each
#: chunk continues from the hidden state where the previous one stopped), so the budget only bounds memory: 512 MiB
#: keeps the chunk's share of a 7B run's peak small (a Llama-2-7B block's inputs are ≈ 75 MB at 3 tasks × 8 records
#: × 64 tokens, so a chunk of 6 blocks) while a small model's chunk still holds several blocks.
DEFAULT_CAPTURE_BUDGET = 512 * 1024**2
#: Models whose weights take at least this many bytes give the pages of their memory-mapped weights back after
#: every block of a capture forward (one ``/proc/self/smaps`` read, ≈ 20 ms, per block and batch): the RSS then
#: holds about one stored block, not every block the forward passed (≈ 400 MiB each at Llama-2-7B width).
RELEASE_BYTES = 2**30


def releases_pages(model: nn.Module) -> bool:
    """Whether `model` gives its mapped weights' pages back after each block or unit: at RELEASE_BYTES and above.
    Below it the whole model's pages are small, and reading ``/proc/self/smaps`` costs more than a small block."""
    return sum(p.nbytes for p in model.parameters()) >= RELEASE_BYTES


def _releasing(model: nn.Module) -> Callable:
    """A forward hook that gives `model`'s mapped weights' pages back (and leaves the output as it is)."""
    def hook(*_) -> None:
        release_mapped_pages(model)
    return hook


def _partial_forward(model, arch, batches, device, deepest: int, first: int, register, state,
                     compute: torch.dtype | None = None) -> None:
    """Run the backbone on each batch with `register(handles, b, batch, mask)`'s hooks, stopping after `deepest`.

    With a `state`, starts from where the previous partial forward stopped (when that is before `first`, the
    shallowest block needed) and leaves `deepest`'s output per batch in it. With `compute`, every stage runs
    in that dtype (see `_in_compute_dtype`).
    """
    backbone = get_module(model, arch.backbone_path)
    stops = 0 <= deepest < arch.num_layers - 1
    outputs = []
    release = releases_pages(model)
    for b, batch in enumerate(batches):
        mask = batch.attention_mask.to(device).bool()
        with hooks() as handles, _skipped_blocks(model, arch, state, b, first) as skipped:
            _in_compute_dtype(handles, model, arch, compute, skipped, device)
            if release:  # each block's stored weights leave the RSS once it has run (`release_mapped_pages`)
                ran = [model.get_submodule(arch.layer_path(i)) for i in range(len(skipped), arch.num_layers)]
                handles += [block.register_forward_hook(_releasing(model)) for block in ran]
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
    compute: torch.dtype | None = None,
    outputs: bool = False,
    maps: dict[str, Iterable[str]] | None = None,
) -> dict[str, list[Recorded]]:
    """Record the inputs of the modules at `paths` on every batch (one partial forward per batch).

    The forward stops after the last block that holds a requested module. With a `state` (one per list of
    batches), consecutive calls over deeper and deeper blocks continue from where the previous one stopped.
    With `compute` (e.g. float32 for a bfloat16 base), the forward runs in that dtype stage by stage and the
    inputs are recorded in it. With `outputs`, each module's output on θ0 is kept too (`Recorded.output`: the
    point a = 0 of a replayed line, so it is never replayed; a joined path such as BERT's ``intermediate+output``
    has no single module whose output to keep and gets none), and so are the outputs of the linear maps inside it
    that the forward calls once, that `maps` (path → local names) names (`Recorded.maps`: the term W0·z0 + b0 of
    a line's shared map is the base's own map output, never computed again). A map both a module and the block
    holding it name is one tensor, kept once.
    """
    paths = list(dict.fromkeys(paths))
    recorded: dict[str, list[Recorded]] = {path: [] for path in paths}
    layers = [_layer_of(arch, p) for p in paths]
    wanted = {path: list(names) for path, names in (maps or {}).items() if outputs and path in recorded}

    def register(handles, b, batch, mask):
        for path in paths:
            def hook(module, args, kwargs, path=path):
                recorded[path].append(Recorded(tuple(args), _clean_kwargs(kwargs), mask, batch.sample_index,
                                               maps={} if path in wanted else None))
            handles.append(model.get_submodule(input_module_path(path)).register_forward_pre_hook(
                hook, with_kwargs=True))
            if outputs and "+" not in path:
                def keep(module, args, output, path=path):
                    recorded[path][-1].output = first_output(output)
                handles.append(model.get_submodule(path).register_forward_hook(keep))
            for name in wanted.get(path, ()):
                def keep_map(module, args, output, path=path, name=name):
                    kept = recorded[path][-1].maps
                    kept[name] = None if name in kept else first_output(output)  # called twice: not a line's map
                handles.append(model.get_submodule(f"{path}.{name}").register_forward_hook(keep_map))

    _partial_forward(model, arch, batches, device, max(layers, default=-1), min(layers, default=-1), register, state,
                     compute)
    return recorded


class _NotPassedThrough(Exception):
    """A backbone that does not hand a block's returned tensor to the next block as it is (an older layout)."""


def _stream(args: tuple, kwargs: dict):
    """The hidden state among a block's inputs: its first argument, or the keyword ``hidden_states``."""
    return args[0] if args else kwargs["hidden_states"]


def _pass_through(*args, **kwargs):
    return _stream(args, kwargs)


@torch.no_grad()
def block_kwargs(
    model: nn.Module,
    arch: Architecture,
    layers: Iterable[int],
    batches: list[TokenBatch],
    *,
    device: torch.device | str = "cpu",
    compute: torch.dtype | None = None,
) -> dict[str, list[Recorded]]:
    """What each block of `layers` receives besides its hidden state (mask, positions …), per batch, cheaply.

    These inputs depend on the tokens, not on the weights, so no block runs: each passes its input on, and
    only the embedding stage computes. The hidden state is left out (None; `_with_hidden` puts a stream in),
    except for block 0, whose input is the base's embedding. Memory is the masks, not L hidden states.
    Backbones whose block loop does not take a block's tensor as it is get `record_inputs` instead.
    """
    layers = sorted(set(layers))
    paths = [arch.layer_path(i) for i in layers]
    blocks = [model.get_submodule(arch.layer_path(i)) for i in range(arch.num_layers)]
    backbone = get_module(model, arch.backbone_path)
    recorded: dict[str, list[Recorded]] = {path: [] for path in paths}

    def keep(layer, path, batch, mask, embedded):
        def hook(module, args, kwargs):
            hidden = _stream(args, kwargs)
            if not isinstance(hidden, torch.Tensor) or hidden.shape != embedded[0].shape:
                raise _NotPassedThrough
            inputs = Recorded(tuple(args), _clean_kwargs(kwargs), mask, batch.sample_index)
            if layer != 0:  # any other block's input here is the embedding passed on, not its real stream
                inputs = Recorded(*_with_hidden(inputs, None), mask, batch.sample_index)
            recorded[path].append(inputs)
        return hook

    def note_embedding(embedded):
        def hook(module, args, kwargs):
            embedded[:] = [_stream(args, kwargs)]
        return hook

    try:
        with hooks() as handles:
            _in_compute_dtype(handles, model, arch, compute, blocks, device)
            for block in blocks:
                block.forward = _pass_through
            for b, batch in enumerate(batches):
                mask, embedded = batch.attention_mask.to(device).bool(), []
                with hooks() as batch_handles:
                    batch_handles.append(blocks[0].register_forward_pre_hook(note_embedding(embedded),
                                                                             with_kwargs=True))
                    for layer, path in zip(layers, paths):
                        batch_handles.append(blocks[layer].register_forward_pre_hook(
                            keep(layer, path, batch, mask, embedded), with_kwargs=True))
                    if layers and layers[-1] < arch.num_layers - 1:
                        batch_handles.append(blocks[layers[-1]].register_forward_hook(_stop_forward))
                    _until_stop(lambda batch=batch: _call_backbone(backbone, batch, device))
    except _NotPassedThrough:
        recorded = None
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)
    if recorded is None:
        return record_inputs(model, arch, paths, batches, device=device, compute=compute)
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


def real_tokens(output: torch.Tensor, token_mask: torch.Tensor, i: int) -> torch.Tensor:
    """Sequence i of a batch's `output` (batch, seq, ...), its real tokens only (a view where all are real)."""
    row, real = output[i], token_mask[i]
    return row if bool(real.all()) else row[real]


def sample_features(output: torch.Tensor, token_mask: torch.Tensor) -> list[torch.Tensor]:
    """One flattened float64 vector per sequence, real tokens only."""
    return [real_tokens(output, token_mask, i).reshape(-1).double() for i in range(output.shape[0])]


# --------------------------------------------------------------------------- parameters of variants


SCRATCH_ELEMENTS = 1 << 17  # a pooled variant is formed this many entries at a time (its c·τ scratch's size)


class ParameterSource:
    """Base parameters of modules and their task vectors, read lazily, combined into variants.

    Variants are built and returned in the compute dtype: each parameter's storage dtype promoted to
    `compute_dtype` (float32 by default; a float64 model stays float64), never rounded back to storage, on the
    base's `execution_device` (for an offloaded base: copied there from host memory, unit by unit).
    """

    def __init__(self, base: BaseModel, task_vectors: dict[str, TaskVectorReader],
                 compute_dtype: torch.dtype = torch.float32, *, tasks_kept: int | None = None):
        self.base = base
        self.task_vectors = task_vectors
        self.compute_dtype = compute_dtype
        self.device = execution_device(base.model)
        # τ read so far, kept until `clear`; `tasks_kept`: of at most that many tasks, the least recently asked
        # for dropped first (for drivers whose variants move one task at a time: a 7B block's τ is 0.8 GB a task)
        self.tasks_kept = tasks_kept
        self._cache: dict[tuple[str, str], torch.Tensor] = {}
        self._tasks_read: list[str] = []  # the tasks in `_cache`, the most recently asked for last
        self._placed: dict[tuple[str, torch.dtype], torch.Tensor] = {}  # offloaded base weights on the device
        self._pool: dict[tuple[str, torch.dtype], torch.Tensor] = {}  # pooled variants' tensors (`variant`)
        self._scratches: dict[torch.dtype, torch.Tensor] = {}
        self._as_stored: dict[str, bool] = {}  # `_loaded_as_stored`, per checkpoint tensor
        # pooled variants kept until `clear` (a layer's end), each tensor by parameter, dtype and coefficients, up to
        # `variants_kept_bytes` (0: none): a layer's units and the model level's pass through its block form each
        # point once instead of once per level (`_kept_variants`)
        self.variants_kept_bytes = 0
        self._kept: dict[tuple, torch.Tensor] = {}
        self._kept_bytes = 0
        self._names: dict[str, dict[str, str]] = {}  # `parameter_names` per module path (the base's tree is fixed)

    def _own_on_device(self, path: str, own: dict[str, torch.Tensor], local: str,
                       dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
        """Base parameter `local` of the module at `path` in `dtype` on the execution device, and whether it is a
        fresh copy the caller may change in place. An offloaded base's weights are copied to the device once per
        unit (until `clear`), not once per variant: the N + 1 points of a line share them (not fresh)."""
        tensor = own[local]
        if tensor.device == self.device:
            converted = tensor.to(dtype)
            return converted, converted is not tensor
        key = (self.parameter_names(path)[local], dtype)
        if key not in self._placed:
            self._placed[key] = tensor.to(device=self.device, dtype=dtype)
        return self._placed[key], False

    def parameter_names(self, path: str) -> dict[str, str]:
        """`module_parameter_names` of the base at `path`, walked once per path (a sweep asks for a block's names
        at every point of every level: 10,198 walks of the block's modules in a SmolLM2 linearity run)."""
        if path not in self._names:
            self._names[path] = module_parameter_names(self.base.model, path)
        return self._names[path]

    def base_parameters(self, path: str) -> dict[str, torch.Tensor]:
        module = get_module(self.base.model, path)
        return dict(module.named_parameters(remove_duplicate=False))

    def dtype_for(self, path: str) -> torch.dtype:
        """The dtype the module at `path` is computed in: its storage dtype promoted to the compute dtype."""
        storage = next((p.dtype for p in get_module(self.base.model, path).parameters() if p.is_floating_point()),
                       self.compute_dtype)
        return torch.promote_types(storage, self.compute_dtype)

    def deltas(self, path: str, task: str, names: Iterable[str] | None = None, *,
               keep: bool = True) -> dict[str, torch.Tensor]:
        """τ_task of the parameters of the module at `path` (local names; all or `names`), float32, on its device.
        Kept until `clear` (the points of a line share them); ``keep=False``: read for this call alone where not
        kept already (a caller that reads a block tensor by tensor and lets each go)."""
        reader = self.task_vectors[task]
        device = self.device
        full_names = self.parameter_names(path)
        module = get_module(self.base.model, path)
        if keep:
            self._ask_for(task)
        out = {}
        for local in full_names if names is None else names:
            key = (task, full_names[local])
            found = self._cache.get(key)
            if found is None:
                name = self.base.checkpoint_name(full_names[local])
                loaded = module.get_parameter(local)
                stored = reader.subtracts_base and self._loaded_as_stored(name, loaded)
                found = reader.get(name, torch.float32, device, base=loaded if stored else None)
                if keep:
                    self._cache[key] = found
            out[local] = found
        return out

    def _loaded_as_stored(self, name: str, loaded: torch.Tensor) -> bool:
        """Whether the loaded base parameter `loaded` is checkpoint tensor `name` as stored (dtype, shape and
        values): τ is then taken against it, without reading the base's file for every task and unit (at 7B
        width, 18 reads of each block's base tensors per linearity run; on a GPU also their copies to it). Checked
        once per tensor, by one read of the file; a base loaded in another dtype, or not loaded (meta), is not."""
        known = self._as_stored.get(name)
        if known is None:
            reader = self.base.reader
            known = (loaded.device.type != "meta" and loaded.dtype == reader.dtype(name)
                     and tuple(loaded.shape) == tuple(reader.shape(name))
                     and torch.equal(loaded, reader.get(name).to(loaded.device)))
            self._as_stored[name] = known
        return known

    def _ask_for(self, task: str) -> None:
        """Mark `task` the most recently asked for; beyond `tasks_kept` tasks, drop the τ of the least recent."""
        if task in self._tasks_read:
            self._tasks_read.remove(task)
        self._tasks_read.append(task)
        while self.tasks_kept is not None and len(self._tasks_read) > self.tasks_kept:
            dropped = self._tasks_read.pop(0)
            for key in [key for key in self._cache if key[0] == dropped]:
                del self._cache[key]

    def variant(self, path: str, coefficients: Variant, names: Iterable[str] | None = None, *,
                pooled: bool = False, rows: dict[str, torch.Tensor] | None = None):
        """θ0 + Σ_t c_t τ_t for the module at `path` (all its parameters, or the local `names`) in the compute dtype.

        None means: run the module as it is (no coefficient, storage is already the compute dtype and the
        weights are on the execution device). Floating buffers stored in a narrower dtype come upcast too (and
        buffers elsewhere than the execution device, moved there).

        ``pooled``: the tensors are written into this source's buffers for those parameters (one per parameter and
        dtype, kept until `clear`) instead of new ones: the same values, bitwise, without allocating, but valid
        only until the next pooled variant of the same parameters. For callers that use a variant and let it go
        before asking for the next (a line's points, the model level's blocks). ``rows`` ({local name: row
        indices}, pooled only): only those rows of the parameter are formed, and its other rows hold whatever the
        buffer held: for a table read at those rows alone (a token embedding on the batches' tokens).
        """
        if rows and not pooled:
            raise ValueError("variant(rows=...) forms part of a pooled buffer: pass pooled=True")
        active = {t: c for t, c in coefficients.items() if c != 0}
        own = self.base_parameters(path)
        names = list(own) if names is None else list(names)
        compute = {local: torch.promote_types(own[local].dtype, self.compute_dtype) for local in names}
        if not active and all(own[local].dtype == compute[local] and own[local].device == self.device
                              for local in names):
            return None
        if pooled:
            kept = {} if rows else self._kept_variants(path, names, compute, active)
            missing = [local for local in names if local not in kept]
            deltas = {t: self.deltas(path, t, missing) for t in active} if missing else {}
            formed = self._pooled_variant(path, own, missing, compute, active, deltas, rows or {})
            return kept | formed | self.upcast_buffers(path)
        deltas = {t: self.deltas(path, t, names) for t in active}
        params = {}
        for local in names:
            value, fresh = self._own_on_device(path, own, local, compute[local])
            for task, coefficient in active.items():
                delta = deltas[task][local]
                if not fresh:  # the stored (or shared) tensor: a new one
                    value, fresh = value + coefficient * delta.to(compute[local]), True
                elif delta.dtype != value.dtype:  # float64 (the floor's pass): τ promoted inside the kernel
                    value.add_(delta, alpha=coefficient)
                else:  # the same rounding as value + coefficient * delta, one tensor fewer
                    value.add_(coefficient * delta)
            params[local] = value
        return params | self.upcast_buffers(path)

    def _kept_key(self, name: str, dtype: torch.dtype, active: dict) -> tuple:
        return name, dtype, tuple(sorted(active.items()))

    def _kept_variants(self, path: str, names: list[str], compute: dict, active: dict) -> dict[str, torch.Tensor]:
        """The pooled variants of `names` (local) at `active` that a caller before formed and kept (`_kept`)."""
        if not self._kept:
            return {}
        full_names = self.parameter_names(path)
        found = {local: self._kept.get(self._kept_key(full_names[local], compute[local], active)) for local in names}
        return {local: value for local, value in found.items() if value is not None}

    def _pooled_variant(self, path: str, own: dict, names: list[str], compute: dict, active: dict,
                        deltas: dict, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`variant`'s sums written into pooled tensors: θ0 + c_1 τ_1 (+ c_2 τ_2 …) with each product c·τ rounded
        in the compute dtype before it is added, as `variant` rounds them (float32: bitwise its values); for a
        parameter in `rows`, only those rows (the others are left as they were). A whole parameter goes into a tensor
        of its own, kept until `clear`, while `variants_kept_bytes` allows (`_kept_variants` finds it again)."""
        full_names = self.parameter_names(path)
        params = {}
        for local in names:
            dtype, tensor = compute[local], own[local]
            if tensor.device != self.device:  # offloaded: its copy on the device, once per unit
                tensor = self._own_on_device(path, own, local, dtype)[0]
            size = tensor.numel() * dtype.itemsize
            if self.variants_kept_bytes and local not in rows and self._kept_bytes + size <= self.variants_kept_bytes:
                value = torch.empty(tensor.shape, dtype=dtype, device=self.device)
                self._kept[self._kept_key(full_names[local], dtype, active)] = value
                self._kept_bytes += size
            else:
                key = (full_names[local], dtype)
                value = self._pool.get(key)
                if value is None or value.shape != tensor.shape:
                    value = self._pool[key] = torch.empty(tensor.shape, dtype=dtype, device=self.device)
            terms = [(deltas[task][local], coefficient) for task, coefficient in active.items()]
            if local in rows:
                index = rows[local].to(self.device)
                formed = torch.empty((len(index), *tensor.shape[1:]), dtype=dtype, device=self.device)
                self._form(formed, tensor.index_select(0, index), [(d.index_select(0, index), c) for d, c in terms])
                value.index_copy_(0, index, formed)
            else:
                self._form(value, tensor, terms)
            params[local] = value
        return params

    def _form(self, value: torch.Tensor, base: torch.Tensor, terms: list[tuple[torch.Tensor, float]]) -> None:
        """value = θ0 + c_1 τ_1 (+ c_2 τ_2 …), in order, each c·τ rounded in value's dtype before it is added (τ
        converted to it first where it differs: the floor's float64 pass), `SCRATCH_ELEMENTS` entries at a time:
        each piece's products and sums stay in the cache instead of passing over the whole tensor once per step
        (a 28M-entry float64 build: 2.8× faster in a micro-benchmark taken beside another job; a whole `diag
        linearity` on SmolLM2 did not move), and a 7B embedding in float64 gets no second copy beside its variant."""
        flat_value, flat_base = value.view(-1), base.reshape(-1)
        flat_terms = [(delta.reshape(-1), coefficient) for delta, coefficient in terms]
        for start in range(0, flat_value.numel(), SCRATCH_ELEMENTS):
            piece = flat_value[start:start + SCRATCH_ELEMENTS]
            base_piece = flat_base[start:start + SCRATCH_ELEMENTS]
            if not flat_terms:
                piece.copy_(base_piece)
            for i, (delta, coefficient) in enumerate(flat_terms):
                part = delta[start:start + SCRATCH_ELEMENTS]
                if i == 0 and part.dtype == piece.dtype:  # c·τ + θ0: the rounding of θ0 + c·τ (a sum commutes)
                    torch.mul(part, coefficient, out=piece).add_(base_piece)
                    continue
                if i == 0:
                    piece.copy_(base_piece)
                scaled = self._scratch(part.numel(), piece.dtype)
                if part.dtype == piece.dtype:
                    torch.mul(part, coefficient, out=scaled)
                else:
                    scaled.copy_(part).mul_(coefficient)
                piece.add_(scaled)

    def _scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat scratch tensor of `numel` elements of `dtype` (one buffer per dtype, grown as asked)."""
        flat = self._scratches.get(dtype)
        if flat is None or flat.numel() < numel:
            flat = self._scratches[dtype] = torch.empty(numel, dtype=dtype, device=self.device)
        return flat[:numel]

    def upcast_buffers(self, path: str) -> dict[str, torch.Tensor]:
        """The floating buffers of the module at `path` stored below the compute dtype, upcast, and the buffers
        off the execution device, moved there (local names)."""
        buffers = get_module(self.base.model, path).named_buffers(remove_duplicate=False)
        return {local: upcast(buffer, self.compute_dtype, self.device) for local, buffer in buffers
                if not _placed(buffer, self.compute_dtype, self.device)}

    def changed(self, path: str, task: str) -> bool:
        return any(bool(d.abs().max() > 0) for d in self.deltas(path, task).values() if d.numel())

    def drop_pooled(self) -> None:
        """Let the pooled variants' tensors go (`variant` with ``pooled``): a unit done, before the next one."""
        self._pool.clear()
        self._scratches.clear()

    def clear(self, release_pages: bool = True) -> None:
        """Drop the cached task vectors, unmap the checkpoints' files (their pages read so far stop counting in the
        RSS; a file is reopened on its next read) and, unless `release_pages` is False, release the memory-mapped
        base weights' pages (`release_mapped_pages`; a base of `RELEASE_BYTES` or more), so memory does not grow
        with the units done."""
        self._cache.clear()
        self._tasks_read.clear()
        self._placed.clear()
        self._kept.clear()
        self._kept_bytes = 0
        self.drop_pooled()
        for reader in self.task_vectors.values():
            reader.release()
        if release_pages and releases_pages(self.base.model):
            release_mapped_pages(self.base.model)


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
    layers: range | None = None,
    hidden: list[list[torch.Tensor]] | None = None,
    clear: bool = True,
) -> list[list[torch.Tensor]]:
    """Final hidden states (after the final norm) or logits of every variant, block by block.

    Returns outputs[variant][batch] of shape (batch, seq, hidden | vocab), in the compute dtype
    (`source.dtype_for`). Only one block's parameters per variant exist at a time, never a second model.

    A pipeline stage (`submerge.diagnostics.pipeline`) runs only the blocks `layers`: `hidden` holds the
    variants' streams entering the first of them (None: the embedding stage runs here, `embedded_streams`); the
    final norm and head run only when `layers` ends at the last block, else the streams leaving `layers` come back
    (`hidden` itself, its tensors replaced). ``clear=False``: the source is not cleared after each block (a caller
    that runs other variants of the same block next, sharing its τ and kept variants, clears it after them).
    """
    model = source.base.model
    device = source.device
    layers = range(arch.num_layers) if layers is None else layers
    layer_paths = [arch.layer_path(i) for i in layers]
    # 1. what every block receives besides the stream (masks, positions: they do not depend on weights)
    block_inputs = block_kwargs(model, arch, layers, batches, device=device, compute=source.compute_dtype)
    # 2. the embedding stage per variant, 3. the blocks, 4. the final norm and, on request, the output head
    if hidden is None:
        hidden = embedded_streams(source, arch, batches, variants, block_inputs[layer_paths[0]])
    for i, path in zip(layers, layer_paths):
        block, compute = model.get_submodule(path), source.dtype_for(path)
        for v, variant in enumerate(variants):
            params = source.variant(path, variant, pooled=True)
            for b in range(len(batches)):
                hidden[v][b] = run_block(block, params, block_inputs[path][b].upcast(compute), hidden[v][b])
        params = None  # the pooled tensors go with the pool: held here, they would outlive it into the next block
        if clear:
            source.clear()
        if on_layer:
            on_layer(i)
    del block_inputs
    if layers[-1] == arch.num_layers - 1:
        _final_stages(source, arch, hidden, variants, output)
    return hidden


def embedded_streams(source: ParameterSource, arch: Architecture, batches: list[TokenBatch], variants: list[Variant],
                     first_inputs: list[Recorded] | None = None) -> list[list[torch.Tensor]]:
    """Block 0's input stream of every variant per batch: the embedding stage, its τ read once for all variants
    (`first_inputs`: block 0's `block_kwargs`, computed here when not given)."""
    model = source.base.model
    if first_inputs is None:
        first_inputs = block_kwargs(model, arch, [0], batches, device=source.device,
                                    compute=source.compute_dtype)[arch.layer_path(0)]
    rows = token_rows(model, arch, batches)  # the same tokens and stage for every variant
    stage = embedding_stage_names(model, arch)
    hidden = [_embedded(source, arch, batches, variant, first_inputs, stage, rows) for variant in variants]
    source.clear()
    return hidden


def _final_stages(source: ParameterSource, arch: Architecture, hidden: list[list[torch.Tensor]],
                  variants: list[Variant], output: str) -> None:
    """The final norm and, for ``output="logits"``, the output head, applied to every stream in place."""
    model = source.base.model
    heads = [arch.final_norm_path] if arch.final_norm_path else []
    if output == "logits":
        heads.append(output_head_path(model))
    for path in heads:
        module = model.get_submodule(path)
        for v, variant in enumerate(variants):
            params = source.variant(path, variant, pooled=True)
            for b in range(len(hidden[v])):
                x = upcast(hidden[v][b], source.dtype_for(path))
                hidden[v][b] = functional_call(module, params, (x,), strict=False) if params else module(x)
        params = None  # as in `model_outputs`: freed with the pool
        source.clear()


def embedding_stage_names(model: nn.Module, arch: Architecture) -> list[str]:
    """The embedding stage's parameters: the backbone's outside the blocks and the final norm (local names)."""
    backbone = get_module(model, arch.backbone_path)
    prefix = f"{arch.backbone_path}." if arch.backbone_path else ""
    return [n for n, _ in backbone.named_parameters(remove_duplicate=False)
            if not (prefix + n).startswith(arch.layers_path + ".")
            and not (arch.final_norm_path and (prefix + n).startswith(arch.final_norm_path + "."))]


def embed(model: nn.Module, arch: Architecture, params: dict[str, torch.Tensor], batch: TokenBatch,
          device) -> torch.Tensor:
    """Block 0's input stream for `batch` under the embedding stage's `params` (backbone-local names): the
    backbone runs with them until block 0 is called (differentiable in `params` when gradients are on)."""
    return _embed_with(get_module(model, arch.backbone_path), params, model, arch.layer_path(0), batch, device)


def _embedded(source: ParameterSource, arch: Architecture, batches, variant: Variant, first_inputs,
              stage: list[str], rows: dict[str, torch.Tensor]) -> list:
    """Block 0's input hidden state per batch under `variant`'s embedding stage (`stage`: its parameters'
    backbone-local names, `embedding_stage_names`), in the compute dtype; the recorded base input when the stage
    has none. `rows`: the batches' `token_rows`, the only rows of the token embedding formed."""
    model = source.base.model
    device = source.device
    params = source.variant(arch.backbone_path, variant, stage, pooled=True, rows=rows) if stage else None
    compute = source.dtype_for(arch.layer_path(0))
    if params is None:
        return [upcast(_hidden_of(first), compute) for first in first_inputs]
    return [upcast(embed(model, arch, params, batch, device), compute) for batch in batches]


def token_rows(model: nn.Module, arch: Architecture, batches) -> dict[str, torch.Tensor]:
    """{backbone-local name of the token embedding's weight: the token ids in `batches`}: the only rows of the
    table an embedding stage reads on them (`ParameterSource.variant`'s ``rows``: a point forms those rows, not a
    49,152-row table per point). Empty (the whole table formed) where the embedding is not a plain lookup
    (``max_norm`` renormalises the rows it reads) or lies outside the backbone."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embedding, nn.Embedding) or embedding.max_norm is not None:
        return {}
    backbone = get_module(model, arch.backbone_path)
    name = next((name for name, module in backbone.named_modules() if module is embedding), None)
    if name is None or not batches:
        return {}
    ids = torch.unique(torch.cat([batch.input_ids.reshape(-1) for batch in batches]))
    return {f"{name}.weight" if name else "weight": ids}


def output_head_path(model: nn.Module) -> str:
    embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embeddings is None:
        raise ValueError(f"{type(model).__name__} has no output head; use --model-output hidden")
    for name, module in model.named_modules():
        if module is embeddings:
            return name
    raise ValueError("output head not found among the model's modules")


def _hidden_of(recorded: Recorded) -> torch.Tensor:
    return _stream(recorded.args, recorded.kwargs)


def run_block(block: nn.Module, params: dict[str, torch.Tensor] | None, recorded: Recorded,
              hidden: torch.Tensor) -> torch.Tensor:
    """Block `block` with `params` (local names; None: its own) on `hidden`, given the rest of its inputs as
    `block_kwargs` recorded them (masks, positions): the block's output stream (differentiable when gradients
    are on)."""
    args, kwargs = _with_hidden(recorded, hidden)
    return first_output(functional_call(block, params, args, kwargs, strict=False) if params else block(*args, **kwargs))


def _with_hidden(recorded: Recorded, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if recorded.args:
        return (hidden, *recorded.args[1:]), recorded.kwargs
    return recorded.args, {**recorded.kwargs, "hidden_states": hidden}


def _embed_with(backbone, params, model, first_layer_path, batch, device) -> torch.Tensor:
    seen = {}

    def hook(module, args, kwargs):
        seen["hidden"] = _stream(args, kwargs)
        raise _StopForward

    kwargs = {"input_ids": batch.input_ids.to(device), "attention_mask": batch.attention_mask.to(device)}
    with hooks() as handles:
        handles.append(model.get_submodule(first_layer_path).register_forward_pre_hook(hook, with_kwargs=True))
        _until_stop(lambda: functional_call(backbone, params, (), kwargs, strict=False))
    return seen["hidden"]


# --------------------------------------------------------------------------- Gram matrices (RegMean)


def linear_maps(model: nn.Module, arch: Architecture, layer: int) -> Iterator[tuple[str, nn.Module]]:
    """(weight name, module) of every linear map inside block `layer` (``nn.Linear`` and GPT-2's ``Conv1D``)."""
    for name, module in model.get_submodule(arch.layer_path(layer)).named_modules():
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            yield f"{arch.layer_path(layer)}.{name}.weight", module


@torch.no_grad()
def input_gram_matrices(model: nn.Module, arch: Architecture, batches: list[TokenBatch], *, device=None,
                        layers: Iterable[int] | None = None, dtype: torch.dtype = torch.float32,
                        state: CaptureState | None = None) -> dict[str, torch.Tensor]:
    """Σ_x x xᵀ over real tokens of the input of every linear map inside the blocks (`dtype`, CPU).

    Keys are the linear maps' weight names (e.g. ``model.layers.0.self_attn.q_proj.weight``). Recorded on
    the base model θ0, as the capture engine does; RegMean's paper uses each fine-tune's own activations.
    `layers` restricts it to some blocks (the forward stops after the deepest; a `state` continues where
    the previous call stopped). Maps fed the same tensor (q/k/v, gate/up: the same object in the forward) share
    one Gram, computed once: their keys hold the same tensor, so a consumer must not change it in place. Memory:
    one in×in matrix per distinct input of the chosen blocks (a Llama-2-7B block: 4 of them, 0.7 GB in float32
    per task; all 32 blocks ≈ 22 GB: `GramsByLayer` holds one block's at a time).
    """
    device = device or execution_device(model)
    chosen = sorted(set(range(arch.num_layers) if layers is None else layers))
    grams: dict[str, torch.Tensor] = {}  # per leading map: the Gram of its input
    lead_of: dict[str, str] = {}  # every map → the first map fed the same tensor (itself when none was)

    def register(handles, b, batch, mask):
        last = {"input": None, "key": None}  # the previous map's input in this forward, and the map that led it

        for layer in chosen:
            for key, module in linear_maps(model, arch, layer):
                def hook(module, args, key=key):
                    shared = args[0] is last["input"]
                    lead = last["key"] if shared else key
                    if lead_of.setdefault(key, lead) != lead:
                        raise ArchitectureError(f"{key}: fed the same tensor as {lead_of[key]} in the first batch "
                                                f"but not in batch {b}; its Gram cannot be shared")
                    if not shared:
                        x = args[0][mask].to(dtype)
                        gram = (x.T @ x).cpu()
                        grams[key] = gram if key not in grams else grams[key].add_(gram)
                        last["input"], last["key"] = args[0], key

                handles.append(module.register_forward_pre_hook(hook))

    _partial_forward(model, arch, batches, device, max(chosen, default=-1), min(chosen, default=-1), register, state,
                     dtype)
    return {key: grams[lead] for key, lead in lead_of.items()}


class GramsByLayer:
    """RegMean's input Grams per task, computed one block at a time when a linear map of that block is asked for.

    ``grams(checkpoint_name)`` → [its Gram for each task of `batches`] for a linear map inside a block, None for
    any other tensor (the merge writer's ``gram_matrices``). Only the Grams of the block asked for last are held:
    T × that block's in×in matrices, one per distinct input (≈ 0.7 GB per task for a Llama-2-7B block, instead
    of 22 GB for its 32 blocks). Each task's forward continues from where it stopped (`CaptureState`), so blocks
    asked for in order cost about one forward per batch in all; a block asked for again or out of order is
    recomputed from the embeddings (the merge writer asks in layer order, `submerge.merge.writer.writing_order`).
    """

    def __init__(self, model: nn.Module, arch: Architecture, batches: dict[str, list[TokenBatch]], *,
                 checkpoint_names: dict[str, str] | None = None, device=None, dtype: torch.dtype = torch.float32):
        self.model, self.arch, self.batches, self.device, self.dtype = model, arch, batches, device, dtype
        names = checkpoint_names or {}
        self.where = {names.get(key, key): (layer, key) for layer in range(arch.num_layers)
                      for key, _ in linear_maps(model, arch, layer)}
        self.states = {task: CaptureState() for task in batches}
        self.layer: int | None = None
        self.held: dict[str, dict[str, torch.Tensor]] = {}
        self.computed: list[int] = []  # the blocks computed, in order (a block computed twice is listed twice)

    @property
    def names(self) -> set[str]:
        """The checkpoint names of the linear maps that have Grams."""
        return set(self.where)

    def __call__(self, name: str) -> list[torch.Tensor] | None:
        if name not in self.where:
            return None
        layer, key = self.where[name]
        if layer != self.layer:
            self.held = {}  # the previous block's Grams go before the next block's are computed
            self.held = {task: input_gram_matrices(self.model, self.arch, batches, device=self.device, layers=[layer],
                                                   dtype=self.dtype, state=self.states[task])
                         for task, batches in self.batches.items()}
            self.layer = layer
            self.computed.append(layer)
        return [self.held[task][key] for task in self.batches]

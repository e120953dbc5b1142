"""A sweep's layers on Ray: a pipeline of workers over contiguous block ranges, results written by the driver alone.

`submerge.diagnostics.execution.RayEngine.sweep` runs it for `diag linearity`, `projection` and `alpha` (and any
driver on `submerge.diagnostics.linearity.sweep.Sweep`); Ray is the optional extra ``pip install "submerge[ray]"``.

Work split.  The blocks are cut into ``workers`` contiguous ranges (`split_layers`).  Worker k (a Ray actor,
`BlockWorker`) builds the base on the meta device and reads from the checkpoint only the tensors of its
blocks, plus the stages outside the blocks that every forward runs (token embedding, position embeddings,
final norm; the output head only on the last worker, for ``model_output="logits"``).  It receives, per
task, the base forward's hidden states entering its first block (a `CaptureState`), forwards them through
its blocks and sends the hidden states leaving its last block on to worker k+1 (`BlockWorker.outgoing`),
then captures its own units' inputs chunk by chunk (the capture budget, continuing from those hidden
states) and replays them with the driver's per-unit ``measure``.  Only hidden states and each layer's
results (small arrays) cross the network, never weights or recorded inputs.  The model level runs the
same pipeline with its streams: the V variants' hidden states go from worker to worker
(`BlockWorker.model_stream`), the first embedding them, the last applying the final norm (and head).

Store.  Results come back per layer, in layer order, and the driver writes them through the sweep's
`UnitWriter` exactly as one process does: resume (only the layers not in the store are submitted),
locks, settings checks and provenance are the same, and a run resumes across one process and Ray.
A worker that dies (killed, out of memory, a lost node) is restarted by Ray (``max_retries``): it reloads
its blocks, takes the same incoming hidden states and redoes the layers it had not returned.  An exception
raised by the measurement itself is not retried and reaches the caller as it would in one process.

Memory per worker: its blocks (about 1/workers of the blocks' weights) plus the embedding stage, the
recorded inputs of one chunk of its layers, and one unit's variants; the driver holds the results only.

Bitwise equality with one process: the same code (`submerge.diagnostics.replay`) runs on the same tensors with the
engine's thread count; the arrays are equal bit for bit on the same torch build.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map

from submerge.diagnostics.base_model import BaseModel, checkpoint_name_map, meta_model
from submerge.diagnostics.capture import (
    CaptureState,
    ParameterSource,
    layer_chunks,
    model_outputs,
    no_tf32,
    record_inputs,
)
from submerge.diagnostics.checkpoints import checkpoint_spec, reopen_checkpoint
from submerge.diagnostics.errors import EngineError, SubmergeError
from submerge.diagnostics.modules import Submodule, find_architecture
from submerge.diagnostics.placement import (
    hold_threads,
    offload_to,
    offloads,
    pick_device,
    process_stats,
    tasks_kept_on,
)
from submerge.diagnostics.replay import Unit, measure_layer, model_replayed, units_of
from submerge.diagnostics.task_vectors import reopen_task_vectors, task_vector_specs

__all__ = ["BlockWorker", "Pipeline", "load_blocks", "split_layers"]


def split_layers(num_layers: int, workers: int) -> list[range]:
    """``min(workers, num_layers)`` contiguous ranges of blocks, sizes differing by at most one."""
    count = max(1, min(workers, num_layers))
    sizes = [num_layers // count + (1 if k < num_layers % count else 0) for k in range(count)]
    starts = [sum(sizes[:k]) for k in range(count)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def _to(value, device):
    """`value` (tensors, or tuples, lists and dicts of them) with every tensor on `device`."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def load_blocks(spec: dict, layers: range, *, head: bool, device, offload: bool = False) -> object:
    """A `BaseModel` whose parameters outside blocks `layers` stay on the meta device (never read).

    The stages outside the blocks are read too (embedding, final norm), the output head only with `head`;
    ``spec``: the base's `checkpoint_spec` (``reader``), storage ``dtype`` and ``trust_remote_code``. With
    `offload` (and an accelerator `device`) they are read into host memory and stream to `device` stage by stage
    (`submerge.diagnostics.placement.execution_device`), as a base loaded with ``offload=True`` does.
    """
    from pathlib import Path

    dtype = getattr(torch, spec["dtype"])
    model = meta_model(Path(spec["reader"]["path"]), trust_remote_code=spec["trust_remote_code"], buffers=False,
                       dtype=dtype)
    model.eval().requires_grad_(False)
    if offloads(offload, device):
        offload_to(model, device)
        device = "cpu"  # where the weights are read to; they compute on the offload device
    reader = reopen_checkpoint(spec["reader"])
    names, arch = checkpoint_name_map(model, reader), find_architecture(model)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skipped = {f"{name}." for name, module in model.named_modules() if output is not None and module is output}
    blocks = arch.layers_path + "."
    loaded: dict[int, nn.Parameter] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if name.startswith(blocks):
            if int(name[len(blocks):].split(".", 1)[0]) not in layers:
                continue
        elif not head and any(name.startswith(prefix) for prefix in skipped):
            continue
        if id(parameter) not in loaded:  # tied parameters stay one tensor
            loaded[id(parameter)] = nn.Parameter(reader.get(names[name], dtype, device), requires_grad=False)
        owner, _, local = name.rpartition(".")
        model.get_submodule(owner)._parameters[local] = loaded[id(parameter)]
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta:
                module._buffers[key] = buffer.to(device)
    return BaseModel(model=model, tokenizer=None, reader=reader, spec=spec["reader"]["path"], checkpoint_names=names)


class BlockWorker:
    """One pipeline stage (a Ray actor): blocks `layers` of the base and the units of `modules` in them.

    ``incoming``: ``[reference]`` to {task: `CaptureState`} of the base forward just before the first of
    `layers` (``[]`` for the first stage), fetched when first needed: in a list, the reference does not hold
    back the worker's start, so every stage loads its blocks while the stages before it run. ``job``: what
    every stage shares (see `Pipeline`).
    """

    def __init__(self, job: dict, layers: list[int], modules: dict[int, list[Submodule]], incoming: list):
        hold_threads(job["threads"])
        self.device = pick_device(job["device"])
        self.layers = range(layers[0], layers[-1] + 1)
        last = self.layers[-1] == job["num_layers"] - 1
        self.base = load_blocks(job["base"], self.layers, head=last and job["model_output"] == "logits",
                                device=self.device, offload=job.get("offload", False))
        self.arch = find_architecture(self.base.model)
        self.source = ParameterSource(self.base, reopen_task_vectors(self.base.reader, job["task_vectors"]),
                                      compute_dtype=job["compute_dtype"],
                                      tasks_kept=tasks_kept_on(self.device, self.base.model.get_submodule(
                                          self.arch.layer_path(self.layers[0])), job.get("tasks_kept")))
        self.batches, self.modules = job["batches"], modules
        self.pending, self.incoming = incoming, None
        self.chunks = [[self.layers[0] + i for i in chunk]
                       for chunk in layer_chunks(len(self.layers), job["layer_bytes"], job["capture_budget"])]
        self.states: dict[str, CaptureState] = {}
        self.recorded: tuple = (None, None)

    def _start(self, task: str) -> CaptureState:
        """A fresh `CaptureState` at the hidden states entering this stage (the embedding for the first)."""
        if not self.pending:
            return CaptureState()
        if self.incoming is None:
            import ray

            self.incoming = _to(ray.get(self.pending[0]), self.device)
        return CaptureState(self.incoming[task].layer, self.incoming[task].outputs)

    def _record(self, paths: list[str], task: str, state: CaptureState) -> dict:
        return record_inputs(self.base.model, self.arch, paths, self.batches[task], device=self.device, state=state,
                             compute=self.source.compute_dtype)

    def outgoing(self) -> dict:
        """{task: `CaptureState`} of the base forward after this stage's last block (on the CPU), for the next."""
        states = {}
        with no_tf32():
            for task in self.batches:
                state = self._start(task)
                self._record([self.arch.layer_path(self.layers[-1])], task, state)
                states[task] = CaptureState(state.layer, _to(state.outputs, "cpu"))
        return states

    def measure(self, layer: int, measure: Callable[[Unit], dict]) -> dict:
        """{module name: result} of `layer`'s units; captures the chunk that holds `layer` when needed."""
        chunk = next(chunk for chunk in self.chunks if layer in chunk)
        with no_tf32():
            if self.recorded[0] != chunk:
                self.recorded = (None, None)
                paths = list(units_of([m for i in chunk for m in self.modules.get(i, [])]))
                recorded = {}
                for task in self.batches:
                    if task not in self.states or self.states[task].layer >= chunk[0]:
                        self.states[task] = self._start(task)
                    recorded[task] = self._record(paths, task, self.states[task])
                self.recorded = (chunk, recorded)
            return measure_layer(self.source, self.arch, self.modules[layer], self.recorded[1], measure)

    def model_stream(self, task: str, variants: list, hidden, output: str) -> list:
        """The variants' streams through this stage (`model_outputs` on its blocks), on the CPU."""
        with no_tf32():
            hidden = None if hidden is None else _to(hidden, self.device)
            streams = model_outputs(self.source, self.arch, self.batches[task], variants, output=output,
                                    layers=self.layers, hidden=hidden)
        return _to(streams, "cpu")

    def stats(self) -> dict:
        """This worker process: pid, host, peak resident memory (MiB), the blocks it holds and their weights (MiB)."""
        held = sum(p.numel() * p.element_size() for p in self.base.model.parameters() if not p.is_meta)
        return {**process_stats(), "layers": [self.layers[0], self.layers[-1]], "weights_mib": held / 2**20}


class Pipeline:
    """The Ray actors of one `Sweep` on a `submerge.diagnostics.execution.RayEngine`, as a context manager: worker k
    holds the blocks ``ranges[k]``. The engine is joined already (`RayEngine.running`); its ``report`` (a dict)
    receives ``workers``: each worker's `BlockWorker.stats` at the end."""

    def __init__(self, sweep, engine):
        import ray as ray_api

        experiment = sweep.experiment
        self.sweep, self.report, self.ray = sweep, engine.report, ray_api
        self.ranges = split_layers(experiment.arch.num_layers, engine.workers)
        base = {"reader": checkpoint_spec(experiment.base.reader), "dtype": experiment.settings["dtype"],
                "trust_remote_code": experiment.inputs.get("trust_remote_code", False)}
        job = {"base": base,
               "task_vectors": task_vector_specs(experiment.task_vectors), "batches": experiment.batches,
               "device": engine.device, "threads": engine.threads,
               "compute_dtype": sweep.source.compute_dtype, "tasks_kept": sweep.tasks_kept,
               "layer_bytes": sweep.layer_bytes(),
               "capture_budget": sweep.capture_budget, "model_output": sweep.model_output,
               "num_layers": experiment.arch.num_layers, "offload": bool(experiment.inputs.get("offload"))}
        remote = engine.actor_class(BlockWorker)
        self.by_layer = sweep.by_layer()
        self.actors, self.incoming = [], [[]]  # the references are kept: a restarted worker takes its own again
        for layers in self.ranges:
            modules = {layer: self.by_layer[layer] for layer in layers if layer in self.by_layer}
            self.actors.append(remote.remote(job, list(layers), modules, self.incoming[-1]))
            if layers[-1] < experiment.arch.num_layers - 1:
                self.incoming.append([self.actors[-1].outgoing.remote()])  # what the next stage starts from

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> None:
        try:
            if kind is None and self.report is not None:
                self.report["workers"] = self.ray.get([actor.stats.remote() for actor in self.actors])
        finally:
            for actor in self.actors:
                self.ray.kill(actor)
        if isinstance(error, (self.ray.exceptions.RayTaskError, self.ray.exceptions.RayActorError)):
            replaced = remote_error(error)
            if replaced is not error:
                raise replaced from None

    def submit(self, measure: Callable[[Unit], dict]) -> list[tuple[list[Submodule], object]]:
        """Every layer still to do, submitted to the worker that holds it: (its modules, a Ray reference)."""
        shared = self.ray.put(measure)
        return [(self.by_layer[layer], actor.measure.remote(layer, shared))
                for actor, layers in zip(self.actors, self.ranges) for layer in layers if layer in self.by_layer]

    def layer_results(self, measure: Callable[[Unit], dict], describe) -> Iterator[tuple[list[Submodule], dict]]:
        """(modules, {module name: result}) per layer still to do, in layer order, as the workers return them."""
        describe(f"{len(self.actors)} Ray worker(s)")
        for modules, reference in self.submit(measure):
            yield modules, self.ray.get(reference)

    def model_unit(self, modules: list[Submodule]) -> Unit:
        """The model level: the variants' streams through the workers in turn, the measure here."""
        experiment = self.sweep.experiment

        def run(task, variants):
            streams = None
            for actor in self.actors:
                streams = actor.model_stream.remote(task, list(variants), streams, self.sweep.model_output)
            return model_replayed(self.ray.get(streams), experiment.batches[task], "cpu")

        return Unit(experiment.arch.backbone_path, modules, run, lambda task: True)


def remote_error(error: Exception) -> Exception:
    """What the user sees of a Ray worker's failure: the project's own error inside a task error (its message,
    not a remote traceback); a worker that died (killed, its node lost) or ran out of memory as an `EngineError`
    that says so and that the run resumes; any other error (a bug) as it is, with its traceback."""
    import ray

    cause = getattr(error, "cause", None)
    if isinstance(cause, SubmergeError):
        return cause
    if isinstance(error, ray.exceptions.RayActorError) or isinstance(cause, ray.exceptions.RayActorError):
        return EngineError(f"a Ray worker died ({type(error).__name__}: killed, or its node was lost) more often than "
                           "its restarts allow; finished units are saved: run the same command again to resume")
    memory = (torch.OutOfMemoryError, MemoryError, getattr(ray.exceptions, "OutOfMemoryError", MemoryError))
    if isinstance(cause, memory) or isinstance(error, memory):
        return EngineError(f"a Ray worker ran out of memory ({cause or error}); use fewer --workers per node, "
                           "--offload, or a smaller --capture-budget, then run the same command to resume")
    return error

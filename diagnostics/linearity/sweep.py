"""The one sweep under every linearity driver: capture, replay, per-sample features, one store unit per layer.

For each chunk of layers whose recorded inputs fit the capture budget, the
inputs of the chunk's modules are recorded on the base θ0 (`record_inputs`);
then, layer by layer, each *unit* (a replayed module path: an attention path
also serves its heads) is handed to the driver's `measure`, which replays the
variants it needs (`Unit.run`) and turns them into per-sample features
(`Outputs`). The layer's results become one store unit through `UnitWriter`, so
a killed run resumes after the last finished layer. The model level is one more
unit whose replays run the whole network block by block (`model_outputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import xarray as xr

from submerge.diagnostics.capture import (
    CaptureState,
    Variant,
    head_output,
    layer_chunks,
    model_outputs,
    no_tf32,
    record_inputs,
    replay,
    replay_with_heads,
    sample_features,
)
from submerge.diagnostics.modules import Submodule, find_submodules, get_module
from submerge.diagnostics.progress import progress_bar
from submerge.diagnostics.provenance import run_attrs
from submerge.diagnostics.scale_out import check_workers
from submerge.diagnostics.store import Store, UnitWriter

DEFAULT_CAPTURE_BUDGET = 2 * 1024**3  # bytes of recorded inputs held at once
PRECISION_NOTE = {
    "storage": "settings.dtype: the dtype the base is loaded and its recorded inputs are kept in",
    "compute": "settings.compute_dtype: τ, every θ0 + Σ c_t τ_t, the replayed module or block and its inputs are "
               "upcast to it per unit and never rounded back; metrics in float64",
    "tf32": False,
}


@dataclass
class Outputs:
    """One module's outputs for V variants on one task's batches: ``values[v][b]`` is (batch, seq, ...)."""

    values: list[list[torch.Tensor]]
    masks: list[torch.Tensor]  # per batch: (batch, seq) bool, real tokens
    indices: list[list[int]]  # per batch: the record index of each row

    def sample_indices(self) -> Iterator[int]:
        for batch_indices in self.indices:
            yield from batch_indices

    def features(self, v: int) -> Iterator[torch.Tensor]:
        """Variant v's features, one per sample in order: float64, real tokens only, flattened."""
        for output, mask in zip(self.values[v], self.masks):
            yield from sample_features(output, mask)

    def per_sample(self) -> Iterator[tuple[torch.Tensor, ...]]:
        """Per sample, the features of variants 0..V−1."""
        return zip(*(self.features(v) for v in range(len(self.values))))

    def minus(self, base: list[torch.Tensor]) -> Outputs:
        """Every variant minus per-batch ``base`` outputs, in the outputs' own dtype (Δf = f(x; θ) − f(x; θ0))."""
        values = [[o - b for o, b in zip(per_batch, base)] for per_batch in self.values]
        return Outputs(values, self.masks, self.indices)


@dataclass
class Replayed:
    """Raw replays of one unit for a list of variants on one task's batches; `of` gives a served module's outputs."""

    outputs: list[list[torch.Tensor]]
    masks: list[torch.Tensor]
    indices: list[list[int]]
    o_inputs: list[list[torch.Tensor]] = field(default_factory=list)  # heads: W_o's input per [v][b]
    o_weights: list[torch.Tensor] = field(default_factory=list)  # heads: W_o per variant
    arch: object = None

    def of(self, module: Submodule) -> Outputs:
        if module.head is None:
            return Outputs(self.outputs, self.masks, self.indices)
        values = [[head_output(x, weight, self.arch, module.head) for x in per_batch]
                  for per_batch, weight in zip(self.o_inputs, self.o_weights)]
        return Outputs(values, self.masks, self.indices)


def replay_variants(source, arch, path: str, recorded, variants: Sequence[Variant], *, heads: bool = False) -> Replayed:
    """The module at `path` replayed on every recorded batch for each variant (parameters built by `source`).

    With `heads`, also keeps the output projection's input and weight of each variant for head outputs.
    Inputs and parameters are upcast to the compute dtype (`source.dtype_for`) and the outputs stay in it.
    """
    module = get_module(source.base.model, path)
    recorded = [rec.upcast(source.dtype_for(path)) for rec in recorded]  # the compute dtype, per unit
    result = Replayed([], [rec.token_mask for rec in recorded], [rec.sample_index for rec in recorded], arch=arch)
    for variant in variants:
        params = source.variant(path, variant)
        per_batch, per_batch_x = [], []
        for rec in recorded:
            if heads:
                out, x, weight = replay_with_heads(module, arch, rec, params)
                per_batch_x.append(x)
            else:
                out = replay(module, rec, params)
            per_batch.append(out)
        result.outputs.append(per_batch)
        if heads:
            result.o_inputs.append(per_batch_x)
            result.o_weights.append(weight)
    return result


def replay_model(source, arch, batches, variants: Sequence[Variant], *, output: str = "hidden") -> Replayed:
    """The whole network run block by block for each variant (`model_outputs`) on `batches`."""
    device = source.device
    return model_replayed(model_outputs(source, arch, batches, list(variants), output=output), batches, device)


def model_replayed(outputs: list[list[torch.Tensor]], batches, device) -> Replayed:
    """The model level's `Replayed`: `model_outputs`' outputs[variant][batch] with the batches' masks."""
    return Replayed(outputs, [batch.attention_mask.to(device).bool() for batch in batches],
                    [batch.sample_index for batch in batches])


@dataclass
class Unit:
    """What one replay serves: a module path (or the whole model) and the modules measured on it."""

    path: str
    modules: list[Submodule]
    run: Callable[[str, Sequence[Variant]], Replayed]  # (input task, variants) → replays on that task's inputs
    changed: Callable[[str], bool]  # whether task's fine-tune changes this unit's parameters


def module_coords(modules: Sequence[Submodule]) -> dict:
    """The ``module`` coordinate with its ``level``, ``layer`` (−1: the model) and ``head`` (−1: none) labels."""
    return {
        "module": np.array([m.name for m in modules], dtype=object),
        "level": ("module", np.array([m.level for m in modules], dtype=object)),
        "layer": ("module", np.array([m.layer for m in modules])),
        "head": ("module", np.array([-1 if m.head is None else m.head for m in modules])),
    }


def units_of(modules: Sequence[Submodule]) -> dict[str, list[Submodule]]:
    """Modules grouped by the module path whose replay serves them (an attention serves its heads)."""
    units: dict[str, list[Submodule]] = {}
    for module in modules:
        units.setdefault(module.path, []).append(module)
    return units


def modules_for(experiment, levels: Sequence[str]) -> list[Submodule]:
    """Submodules of the requested levels, blocks first, the model level last."""
    block_levels = tuple(level for level in levels if level != "model")
    modules = find_submodules(experiment.base.model, block_levels, arch=experiment.arch) if block_levels else []
    if "model" in levels:
        modules.append(Submodule("model", "model", -1, experiment.arch.backbone_path))
    return modules


def block_unit(source, arch, path: str, served: list[Submodule], recorded: dict) -> Unit:
    """The `Unit` of the module at `path` (serving `served`) replayed on `recorded` ({task: {path: inputs}})."""
    heads = any(m.level == "head" for m in served)

    def run(task, variants):
        return replay_variants(source, arch, path, recorded[task][path], variants, heads=heads)

    return Unit(path, served, run, lambda task: source.changed(path, task))


def measure_layer(source, arch, modules: list[Submodule], recorded: dict, measure: Callable[[Unit], dict],
                  describe: Callable[[str], None] = lambda text: None) -> dict:
    """{module name: result} of one layer's `modules`: ``measure`` on each unit, replayed on `recorded`."""
    results = {}
    for path, served in units_of(modules).items():
        describe(served[0].name)
        results.update(measure(block_unit(source, arch, path, served, recorded)))
        source.clear()
    return results


def _bytes_per_layer(experiment, paths_per_layer: int, compute: torch.dtype) -> int:
    """Bytes of one layer's recorded inputs (kept in the storage dtype promoted to `compute`)."""
    hidden = experiment.base.model.config.get_text_config().hidden_size
    element = torch.finfo(torch.promote_types(next(experiment.base.model.parameters()).dtype, compute)).bits // 8
    padded = max(sum(b.input_ids.numel() for b in batches) for batches in experiment.batches.values())
    return padded * hidden * element * max(1, paths_per_layer)


class Sweep:
    """One driver's pass over the modules of `levels`, writing store group `group` one layer at a time.

    With ``ray`` (``"auto"`` or a cluster address) the layers are measured by a pipeline of ``workers`` Ray
    processes, each holding a contiguous range of blocks (`submerge.diagnostics.linearity.scale_out`, ``ray_options``
    its options); this process alone writes the store, in layer order, as in one process.
    """

    def __init__(self, experiment, levels: Sequence[str], group: str, settings: dict, *, store: Store | None,
                 force: bool, command: str | None, on_unit, capture_budget: int, model_output: str = "hidden",
                 compute_dtype: str | None = None, ray: str | None = None, workers: int = 1,
                 ray_options: dict | None = None):
        check_workers(ray, workers)
        if ray is None and experiment.device.type == "meta":
            raise ValueError("this experiment's base was loaded without weights (weights=False): only Ray workers, "
                             "which read their own blocks, can measure it; pass ray='auto' or an address")
        self.experiment = experiment
        self.tasks = experiment.tasks
        self.source = experiment.parameter_source(compute_dtype)
        compute = {"compute_dtype": str(self.source.compute_dtype).removeprefix("torch.")}
        self.modules = modules_for(experiment, levels)
        self.capture_budget = capture_budget
        self.model_output = model_output
        self.scale_out = None if ray is None else {"ray": ray, "workers": workers}
        inputs = experiment.inputs if ray is None else {**experiment.inputs, "scale_out": self.scale_out}
        root, attrs = run_attrs(command, inputs)  # scale_out: provenance only, a run resumes across both
        self.ray_options = ray_options or {}
        self.writer = UnitWriter(store, group, {**experiment.settings, **compute, **settings}, force=force,
                                 root=root, attrs={**attrs, "precision": PRECISION_NOTE}, on_unit=on_unit)

    def run(self, title: str, measure: Callable[[Unit], dict], piece: Callable[[list[Submodule], dict], xr.Dataset],
            progress: bool) -> None:
        """``measure(unit)`` → {module name: result}; ``piece(modules, results)`` → one store unit."""
        done = self.writer.done
        with progress_bar(progress) as bar, no_tf32(), self._engine() as engine:
            job = bar.add_task(title, total=len(self.modules))
            bar.advance(job, sum(1 for m in self.modules if m.name in done))

            def describe(text):
                bar.update(job, description=f"{title} · {text}")

            for layer_modules, results in engine.layer_results(measure, describe):
                self.writer.add(piece(layer_modules, results), layer_modules[-1].name)
                bar.advance(job, len(layer_modules))
            model = [m for m in self.modules if m.level == "model" and m.name not in done]
            if model:
                describe("model")
                self.writer.add(piece(model, measure(engine.model_unit(model))), model[-1].name)
                bar.advance(job)

    def _engine(self):
        """This sweep (one process), or the Ray pipeline when asked for and something is left to measure."""
        if self.scale_out is None or all(m.name in self.writer.done for m in self.modules):
            return nullcontext(self)
        from submerge.diagnostics.linearity.scale_out import Pipeline

        return Pipeline(self, **self.scale_out, **self.ray_options)

    def by_layer(self) -> dict[int, list[Submodule]]:
        """The block modules not yet in the store, by layer."""
        by_layer: dict[int, list[Submodule]] = {}
        for module in self.modules:
            if module.level != "model" and module.name not in self.writer.done:
                by_layer.setdefault(module.layer, []).append(module)
        return by_layer

    def layer_bytes(self) -> int:
        """Bytes of one layer's recorded inputs over all tasks (what `layer_chunks` splits the budget by)."""
        paths_per_layer = max((len(units_of([m for m in self.modules if m.layer == layer]))
                               for layer in {m.layer for m in self.modules if m.level != "model"}), default=1)
        return _bytes_per_layer(self.experiment, paths_per_layer, self.source.compute_dtype) * len(self.tasks)

    def layer_results(self, measure: Callable[[Unit], dict], describe) -> Iterator[tuple[list[Submodule], dict]]:
        """(modules, {module name: result}) per layer still to do, in layer order, measured here."""
        for layer_modules, recorded in self._layers(describe):
            yield layer_modules, measure_layer(self.source, self.experiment.arch, layer_modules, recorded, measure,
                                               describe)

    def _layers(self, describe) -> Iterator[tuple[list[Submodule], dict]]:
        """Per layer with modules not yet done: (those modules, recorded inputs by task and path)."""
        experiment, by_layer = self.experiment, self.by_layer()
        chunks = layer_chunks(experiment.arch.num_layers, self.layer_bytes(), self.capture_budget)
        states = {task: CaptureState() for task in self.tasks}  # each chunk starts where the previous one stopped
        for chunk in chunks:
            chunk_modules = [m for layer in chunk for m in by_layer.get(layer, [])]
            if not chunk_modules:
                continue
            describe(f"capturing layers {chunk[0]}–{chunk[-1]}")
            recorded = {task: record_inputs(experiment.base.model, experiment.arch, list(units_of(chunk_modules)),
                                            experiment.batches[task], device=experiment.device, state=states[task],
                                            compute=self.source.compute_dtype)
                        for task in self.tasks}
            for layer in chunk:
                if layer in by_layer:
                    yield by_layer[layer], recorded
            del recorded

    def model_unit(self, modules: list[Submodule]) -> Unit:
        """The model level: the whole network replayed here, block by block, for the variants asked."""
        experiment = self.experiment

        def run(task, variants):
            return replay_model(self.source, experiment.arch, experiment.batches[task], variants,
                                output=self.model_output)

        return Unit(experiment.arch.backbone_path, modules, run, lambda task: True)

"""The one sweep under every data-driven linearity driver: capture, replay, per-sample features, one store unit
per layer.

For each chunk of layers whose recorded inputs fit the capture budget, the inputs of the chunk's modules are
recorded on the base θ0; then, layer by layer, each *unit* (a replayed module path: an attention path also serves
its heads) is handed to the driver's `measure`, which replays the variants it needs (`Unit.run`) and turns them
into per-sample features (`Outputs`); a driver whose units need each other measures the whole layer at once
(`LayerMeasure`). The layer's results become one store unit through `UnitWriter` (labelled by its modules, or by
the layer: ``unit_dim="layer"``), so a killed run resumes after the last finished layer. The model level is one more
unit whose replays run the whole network block by block: after the layers, or, where the driver names its variants
(``model_variants``) and the engine is local, carried through each block right after the layer's units, which then
share the block's τ reads and formed variants with it. Where the layers are measured — this process, or a pipeline of Ray workers — is the run's engine
(`submerge.diagnostics.execution`); the per-unit code is `submerge.diagnostics.replay`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import xarray as xr

from submerge.diagnostics.capture import no_tf32
from submerge.diagnostics.execution import LocalEngine, RunSettings
from submerge.diagnostics.modules import Submodule
from submerge.diagnostics.placement import tasks_kept_on, variants_kept_bytes
from submerge.diagnostics.progress import progress_bar
from submerge.diagnostics.provenance import run_attrs
from submerge.diagnostics.replay import (
    LayerMeasure,
    Unit,
    bytes_per_layer,
    map_output_bytes,
    modules_for,
    units_of,
)
from submerge.diagnostics.store import UnitWriter

PRECISION_NOTE = {
    "storage": "settings.dtype: the dtype the base is loaded and its recorded inputs are kept in",
    "compute": "settings.compute_dtype: τ, every θ0 + Σ c_t τ_t, the replayed module or block and its inputs are "
               "upcast to it per unit and never rounded back; metrics in float64",
    "tf32": False,
}



class Sweep:
    """One driver's pass over the modules of `levels`, writing store group `group` one layer at a time, on the
    engine of `run` (`submerge.diagnostics.execution.RunSettings`): this process alone writes the store, in layer
    order, whatever the engine.

    ``unit_dim``: the store dimension a layer's piece is appended along — ``"module"`` (a row per module, labelled
    by its name) or ``"layer"`` (one row per layer, labelled by its index: for results of the layer as a whole).
    ``layers``: only these blocks (default all). ``capture_outputs``: the capture also keeps each module's output on
    θ0 (`Recorded.output`, twice the recorded bytes), which `Unit.points` serves as the point a = 0, and, unless
    ``capture_maps`` is false, the outputs of the linear maps a line shares (`keeps_map_outputs`); ``"within
    budget"``: the same where one layer's inputs and outputs fit the capture budget together, else no outputs.
    ``tasks_kept``: the task vectors of at most that many tasks are held at a time (`ParameterSource`; None: all
    of a layer's), for drivers whose variants each move one task (a layer's units then read τ again per unit);
    more where more tasks' τ of a block fit (`submerge.diagnostics.placement.tasks_kept_on`).
    ``model_variants`` ({task: [variant, ...]}): what the model level's measure will ask for, task by task; a local
    engine then carries them through each block right after the layer's units (`replay.ModelStreams`), and the
    source keeps a layer's formed variants for both where they fit (`placement.variants_kept_bytes`).
    ``regroup``: the sweep runs on each task's records regrouped by length (`Experiment.regrouped`: less padding,
    the same records), for drivers whose results are per record (keyed by its index) or sums over records; the
    group's settings then say so. True: at `data.REPLAY_BATCH_OVERHEAD_TOKENS` a batch; a number: at that many.
    """

    def __init__(self, experiment, levels: Sequence[str], group: str, settings: dict, run: RunSettings, *,
                 model_output: str = "hidden", unit_dim: str = "module", layers: Sequence[int] | None = None,
                 capture_outputs: bool | str = False, tasks_kept: int | None = None,
                 model_variants: dict[str, list] | None = None, regroup: bool | int = False,
                 capture_maps: bool = True):
        if unit_dim not in ("module", "layer"):
            raise ValueError(f"unit_dim must be 'module' or 'layer', got {unit_dim!r}")
        if isinstance(run.engine, LocalEngine) and experiment.device.type == "meta":
            raise ValueError("this experiment's base was loaded without weights (weights=False): only Ray workers, "
                             "which read their own blocks, can measure it; run it with a RayEngine")
        if regroup is not False:
            experiment = experiment.regrouped(None if regroup is True else int(regroup))
        self.experiment, self.run_settings = experiment, run
        self.tasks = experiment.tasks
        self.source = experiment.parameter_source(run.compute_dtype)
        arch = experiment.arch
        block = experiment.base.model.get_submodule(arch.layer_path(0)) if arch.num_layers else None
        self.tasks_kept = tasks_kept  # the driver's minimum; each engine's sources keep what fits on their device
        # this process's device: a layer's units share the τ kept instead of reading it again unit by unit
        self.source.tasks_kept = tasks_kept if block is None else tasks_kept_on(self.source.device, block, tasks_kept)
        compute = {"compute_dtype": str(self.source.compute_dtype).removeprefix("torch.")}
        self.modules = modules_for(experiment, levels, layers)
        self.capture_budget = run.capture_budget
        self.model_output, self.unit_dim = model_output, unit_dim
        self.capture_outputs, self.capture_maps = bool(capture_outputs), capture_maps
        if capture_outputs == "within budget":  # kept only where one layer's inputs and outputs fit together
            self.capture_outputs = self._recorded_bytes() <= self.capture_budget
        self.model_variants = model_variants
        if model_variants and block is not None:
            points = sum(len(variants) for variants in model_variants.values())
            self.source.variants_kept_bytes = variants_kept_bytes(points, block, self.compute_dtype)
        # the engine is provenance only: a run resumes across engines
        root, attrs = run_attrs(run.command, {**experiment.inputs, "engine": run.engine.provenance()})
        self.writer = UnitWriter(run.store, group, {**experiment.settings, **compute, **settings}, dim=unit_dim,
                                 force=run.force, root=root, attrs={**attrs, "precision": PRECISION_NOTE},
                                 on_unit=run.on_unit)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the replays compute in: the storage dtype promoted to the compute dtype."""
        return torch.promote_types(getattr(torch, self.experiment.settings["dtype"]), self.source.compute_dtype)

    def finished(self) -> bool:
        """Whether the store holds every unit of this sweep already (a resumed run with nothing left)."""
        return all(self.label(m) in self.writer.done for m in self.modules)

    def label(self, module: Submodule) -> str:
        """The store label of the unit that holds `module` (its name, or its layer's index)."""
        return str(module.layer) if self.unit_dim == "layer" else module.name

    def run(self, title: str, measure: Callable[[Unit], dict] | LayerMeasure,
            piece: Callable[[list[Submodule], dict], xr.Dataset], progress: bool | None = None) -> None:
        """``measure(unit)`` (or a `LayerMeasure`'s function of a layer) → {module name: result};
        ``piece(modules, results)`` → one store unit."""
        done, engine = self.writer.done, self.run_settings.engine
        progress = self.run_settings.progress if progress is None else progress
        if self.finished():
            return
        model = [m for m in self.modules if m.level == "model" and self.label(m) not in done]
        if model and isinstance(measure, LayerMeasure):
            raise ValueError("a LayerMeasure measures blocks; the model level needs a per-unit measure")
        with progress_bar(progress) as bar, engine.running(), no_tf32(), engine.sweep(self) as layers:
            job = bar.add_task(title, total=len(self.modules))
            bar.advance(job, sum(1 for m in self.modules if self.label(m) in done))

            def describe(text):
                bar.update(job, description=f"{title} · {text}")

            for layer_modules, results in layers.layer_results(measure, describe):
                self.writer.add(piece(layer_modules, results), self.label(layer_modules[-1]))
                bar.advance(job, len(layer_modules))
            if model:
                describe("model")
                self.writer.add(piece(model, measure(layers.model_unit(model))), self.label(model[-1]))
                bar.advance(job)

    def by_layer(self) -> dict[int, list[Submodule]]:
        """The block modules not yet in the store, by layer."""
        by_layer: dict[int, list[Submodule]] = {}
        for module in self.modules:
            if module.level != "model" and self.label(module) not in self.writer.done:
                by_layer.setdefault(module.layer, []).append(module)
        return by_layer

    def layer_bytes(self) -> int:
        """Bytes of one layer's recorded inputs over all tasks (what `layer_chunks` splits the budget by)."""
        recorded = self._recorded_bytes()
        return recorded + self._map_bytes() if self.keeps_map_outputs() else recorded

    def keeps_map_outputs(self) -> bool:
        """Whether the capture also keeps the outputs of the shared linear maps inside each unit (their P0 on θ0:
        `replay.keep_shared_map_outputs`): where it keeps outputs, and one layer's inputs, outputs and those map
        outputs fit in the capture budget together (SmolLM2-135M, 3 tasks × 30 records × ≤ 512 tokens: 0.50 GB of
        0.54). Beyond it (a Llama-2-7B block at 3 × 8 × 128: 0.30 GB of inputs and outputs, 0.47 GB of map outputs)
        the line computes P0 itself, as before: the same values, bit for bit."""
        return (self.capture_outputs and self.capture_maps
                and self._recorded_bytes() + self._map_bytes() <= self.capture_budget)

    def _recorded_bytes(self) -> int:
        """Bytes of one layer's recorded inputs over all tasks, and of its outputs where the capture keeps them."""
        paths_per_layer = max((len(units_of([m for m in self.modules if m.layer == layer]))
                               for layer in {m.layer for m in self.modules if m.level != "model"}), default=1)
        kept = 2 if self.capture_outputs else 1
        return bytes_per_layer(self.experiment, paths_per_layer, self.source.compute_dtype) * len(self.tasks) * kept

    def _map_bytes(self) -> int:
        """The most bytes one layer's kept map outputs take (`replay.map_output_bytes`)."""
        layers = {m.layer for m in self.modules if m.level != "model"}
        return max((map_output_bytes(self.experiment, [m for m in self.modules if m.layer == layer],
                                     self.source.compute_dtype) for layer in layers), default=0)

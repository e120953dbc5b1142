"""The evidence step: per block and candidate granularity, the cross-validated Eq. 10 objective of the block merged
as the plan would merge it (seed 002 Eq. 10–14; balanced Eq. 33–34) — a driver on the shared sweep, store group
``evidence``. `submerge.merge.plan.choose_by_evidence` reads it to choose each block's granularity.

The fit records of each task are split into k folds by record position as read (record i → fold i mod k; the
replays run on the records regrouped by length within each fold, `Experiment.regrouped`, which moves sums by float
rounding only and puts each fold's records in batches of their own, so that what fold k scores replays only fold
k's batches).
For each block j (one store unit per layer, so a killed run resumes after the last finished block):

1. per-sample Grams G(x) (Eq. 14) of every unit the candidates need — the block, its attention and MLP, its heads —
   from replays of each fine-tune on inputs recorded on the base, and the base's outputs as the capture kept them
   (heads, and a Ray worker's capture, which keeps none: a replay of the base);
2. per unit and fold k, α solved on the other k−1 folds (`fold_alphas`: Eq. 12–14, balanced Eq. 33–34), and α on
   all fit records;
3. per candidate c and fold k, the block's parameters merged with fold k's α of c's units by the layer above's rules
   (`merge`: `submerge.merge.plan.CandidateMerge` merges as `diag merge` will — norms, GQA groups, interference-
   steered matrices), the block replayed on fold k's recorded inputs, and the true Eq. 10 objective (divided by
   Eq. 33's denominator when balanced) of its output against each input task's own fine-tune.

A block rule (a strategy that merges the whole block, e.g. ``ties``) has no α: one merge, scored on every fold. A
gram rule (``regmean``, `CandidateMerge.gram_rules`) is fitted per fold like α: its linear maps' input Grams are
measured on the base block's replay of the other folds' records (`map_inputs`, `training_grams`), the block's other tensors take
the block's α of those folds, and fold k scores it.

Scoring every candidate on the same function (the block's output) makes the scores comparable. What the choice
does with them (the mean over folds, the one-standard-error rule) is the plan's, at read time.

The group (dims ``layer`` — the unit dimension —, ``candidate``, ``fold``, ``part``, ``task``):

| variable | dims | what |
|---|---|---|
| ``fold_objective`` | layer, candidate, fold | Eq. 10 of the block merged at the candidate, on held-out fold k |
| ``alpha`` | layer, part, task | α of each unit, solved on all fit records |
| ``fold_alpha`` | layer, part, fold, task | α of each unit, solved without fold k (what fold k's score used) |

``part`` names a unit within its block: ``block`` is unit ``layers.<j>``, any other part p is ``layers.<j>.<p>``
(``attn``, ``mlp``, ``attn.head.<h>``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pandas as pd
import torch
import xarray as xr
from safetensors import safe_open
from safetensors.torch import save_file

from submerge.diagnostics import data as data_module
from submerge.diagnostics import placement
from submerge.diagnostics.capture import DEFAULT_CAPTURE_BUDGET, block_kwargs, hooks, linear_maps, no_tf32
from submerge.diagnostics.errors import SubmergeError
from submerge.diagnostics.execution import LocalEngine, RunSettings
from submerge.diagnostics.groups import StoreGroup
from submerge.diagnostics.linearity.equations import (
    alpha_system,
    balance_denominator,
    merge_objective,
    solve_alpha,
    task_gram,
)
from submerge.diagnostics.linearity.sweep import Sweep
from submerge.diagnostics.modules import GRANULARITIES, get_module, module_parameter_names
from submerge.diagnostics.progress import progress_bar
from submerge.diagnostics.replay import Given, Layer, LayerMeasure, Outputs, measure_layer, modules_for
from submerge.diagnostics.tensors import TensorInfo, TensorTable

GROUP = "evidence"
EVIDENCE_CANDIDATES = ("layer", "attn-mlp")  # head-mlp only when asked: seed 002 Table 3 finds head level unstable
DEFAULT_FOLDS = 4
BLOCK = "block"  # the part that is the whole block (unit layers.<j>)

#: A merged tensor's task vector: (its `TensorInfo`, the task vectors [τ_t] in task order) → δ (θ = θ0 + δ).
TensorDelta = Callable[[TensorInfo, list[torch.Tensor]], torch.Tensor]


class EvidenceError(SubmergeError):
    """The evidence step cannot run as asked (a granularity it cannot choose per block, too few fit records)."""


class CandidateMerge(Protocol):
    """How a block is merged at a candidate granularity (the layer above gives it: `submerge.merge.plan`)."""

    settings: dict  # what the merge depends on (recorded in the group's settings: a change recomputes)
    block_rules: tuple  # candidates that merge the whole block by one rule, without α (e.g. a strategy: "ties")
    gram_rules: tuple  # the block rules among them that need the block's linear maps' input Grams ("regmean")

    def __call__(self, layer: int, granularity: str, alpha: dict[str, dict[str, float]],
                 infos: list[TensorInfo], grams: dict[str, list[torch.Tensor]] | None = None) -> TensorDelta:
        """The merged δ of each tensor of block `layer` (`infos`) with α per unit → task (a gram rule: the block's
        α underneath, and `grams`, checkpoint name → per-task input Gram, for its linear maps)."""


CHOOSABLE = ("layer", "attn-mlp", "head-mlp")  # the granularities a block can take


def unit_names(granularity: str, layer: int, num_heads: int = 0) -> list[str]:
    """The α units of block `layer` at `granularity` (names as in the store and the plan)."""
    if granularity == "layer":
        return [f"layers.{layer}"]
    if granularity == "attn-mlp":
        return [f"layers.{layer}.attn", f"layers.{layer}.mlp"]
    if granularity == "head-mlp":
        return [f"layers.{layer}.attn.head.{h}" for h in range(num_heads)] + [f"layers.{layer}.mlp"]
    raise EvidenceError(f"granularity '{granularity}' cannot be chosen per layer (layer, attn-mlp, head-mlp)")


def part_of(unit: str) -> str:
    """The part of a unit name within its block (``layers.3`` → ``block``, ``layers.3.attn.head.1`` →
    ``attn.head.1``)."""
    rest = unit.split(".", 2)[2:]
    return rest[0] if rest else BLOCK


def unit_of(layer: int, part: str) -> str:
    """The unit name of `part` of block `layer` (inverse of `part_of`)."""
    return f"layers.{layer}" if part == BLOCK else f"layers.{layer}.{part}"


def candidate_units(candidate: str, layer: int, num_heads: int = 0) -> list[str]:
    """The α units of a candidate: a granularity's (`unit_names`), none for a block rule (a strategy)."""
    return unit_names(candidate, layer, num_heads) if candidate in CHOOSABLE else []


def parts_of(candidates: Sequence[str], num_heads: int) -> list[str]:
    """The parts whose α the candidates need, block first (its Grams are always measured: the objective's)."""
    units = [unit for c in candidates for unit in candidate_units(c, 0, num_heads)]
    return list(dict.fromkeys([BLOCK] + [part_of(u) for u in units]))


def fold_of_records(order: Sequence[int], indices: Sequence[int], folds: int) -> np.ndarray:
    """The fold of each record of `indices` (record indices, in the order a replay gives them), where `order` lists
    the task's fit records as they were read: the i-th record read is in fold i mod `folds`. By position, not by the
    record's index in its file: resampled records (`diag compare --seeds`) are any positions of the file, and
    their indices mod k can leave a fold empty; not by the replay's order either, which regrouping by length
    changes (`Experiment.regrouped`)."""
    fold = data_module.folds_of(order, folds)
    return np.array([fold[int(index)] for index in indices], dtype=np.int64)


def fold_alphas(grams_by_task, folds_by_task, fold: int, *, balance: bool = True) -> np.ndarray:
    """α (Eq. 12–14, balanced Eq. 33–34) solved on the samples outside `fold` of every task.

    ``grams_by_task[a]`` is the (n_a, T, T) stack of per-sample Grams on task a's inputs and
    ``folds_by_task[a]`` the (n_a,) fold of each sample; ``fold = -1`` uses every sample.
    """
    train = []
    for a, (grams, folds) in enumerate(zip(grams_by_task, folds_by_task)):
        kept = np.asarray(grams)[np.asarray(folds) != fold]
        if kept.shape[0] == 0:
            raise EvidenceError(f"fold {fold} leaves no fit record of task {a} to solve α on: use fewer folds")
        train.append(kept)
    return solve_alpha(*alpha_system(train, balance=balance)).alpha


def fold_objective(merged, targets, denominators, folds_by_task, fold: int, balance: bool) -> float:
    """Eq. 10 (divided by Eq. 33's denominator when `balance`) on the samples of `fold`: ``merged[a][s]`` the merged
    block's features, ``targets[a][s]`` task a's own fine-tune's, on task a's sample s."""
    chosen, tuned, weights = [], [], []
    for a in range(len(merged)):
        keep = np.flatnonzero(folds_by_task[a] == fold)
        chosen.append([merged[a][s] for s in keep])
        tuned.append([targets[a][s] for s in keep])
        weights.append([denominators[a][s] for s in keep])
    return merge_objective(chosen, tuned, weights if balance else None)


def merged_block(source, path: str, delta: TensorDelta, table: TensorTable, tasks: list[str]) -> dict:
    """Block `path`'s parameters θ0 + δ (local names) in the compute dtype, never rounded back to storage, plus
    the block's floating buffers upcast (as `ParameterSource.variant` gives them). τ is read tensor by tensor; where
    the T tasks' τ of the whole block fit (`placement.tasks_kept_on`; SmolLM2-135M: 42 MB) the source keeps them
    for the block's other candidates and folds (the sweep clears it after the block), else each is let go
    (``keep=False``): one tensor's τ of the T tasks at a time, not the block's (2.4 GB at 7B, T = 3)."""
    params = source.upcast_buffers(path)
    base = source.base_parameters(path)
    keep = placement.tasks_kept_on(source.device, get_module(source.base.model, path), 0) >= len(tasks)
    for local, full in module_parameter_names(source.base.model, path).items():
        weight = base[local]
        info = table.get(source.base.checkpoint_name(full), tuple(weight.shape))
        merged = delta(info, [source.deltas(path, t, [local], keep=keep)[local] for t in tasks])
        compute = torch.promote_types(weight.dtype, source.compute_dtype)
        params[local] = weight.to(device=source.device, dtype=compute) + merged.to(compute)
    return params


def _grams(outputs: Outputs) -> np.ndarray:
    """The (n, T, T) per-sample Grams (Eq. 14) of outputs of variants [base, fine-tune 1 … T]."""
    return np.stack([task_gram([tuned - sample[0] for tuned in sample[1:]]).cpu().numpy()
                     for sample in outputs.per_sample()])


@dataclass
class MapInputs:
    """The inputs of block `layer`'s linear maps on each task's fit records, as the base block computes them
    (`map_inputs`): what RegMean's input Grams are measured on, fold by fold (`training_grams`)."""

    names: dict[str, list[str]]  # per group of maps fed the same tensor: its leader's key → the maps' checkpoint names
    inputs: list[dict[str, list[torch.Tensor]]]  # per task: leader's key → per batch, the maps' input
    masks: list[list[torch.Tensor]]  # per task: per batch (batch, seq) real tokens
    folds: list[torch.Tensor]  # per task: the fold of each record by position among the fit records
    fold_grams: dict | bool | None = None  # (task, leader, fold) → G_f, where they all fit (`FoldGrams`); False: not


@torch.no_grad()
def map_inputs(layer: Layer, tasks: list[str], folds_by_task: list[np.ndarray]) -> MapInputs:
    """The inputs of block `layer`'s linear maps, the base block replayed on each task's recorded inputs (as
    `submerge.diagnostics.capture.input_gram_matrices` records them in a forward of the base). Maps fed the same
    tensor (q/k/v, gate/up) form a group and keep one copy. Memory: T × the records' tokens × the block's distinct
    input widths (Llama-2-7B: 4096 · 3 + 11,008 values per token), not the T × folds Grams of in × in that the
    folds' sums would take (0.68 GB per task and fold for a 7B block). `folds_by_task`: each task's fold per record
    (`fold_of_records`), the evidence's own."""
    source = layer.source
    maps = list(linear_maps(source.base.model, layer.arch, layer.index))
    unit = layer.units[layer.arch.layer_path(layer.index)]
    result = MapInputs({}, [], [], [])
    for task, fold_by_record in zip(tasks, folds_by_task):
        inputs: dict[str, list[torch.Tensor]] = {key: [] for key, _ in maps}
        with hooks() as handles:
            for key, module in maps:
                handles.append(module.register_forward_pre_hook(
                    lambda m, args, key=key, inputs=inputs: inputs[key].append(args[0])))
            replayed = unit.run(task, [{}])
        groups: list[list[str]] = []  # maps fed the same tensor (in the first batch), first of each group leads
        for key, _ in maps:
            group = next((g for g in groups if inputs[g[0]][0] is inputs[key][0]), None)
            if group is None:
                groups.append([key])
            else:
                group.append(key)
        for b in range(len(replayed.masks)):
            for group in groups:
                if any(inputs[key][b] is not inputs[group[0]][b] for key in group):
                    raise EvidenceError(f"block {layer.index}: the linear maps {group} shared their input in the "
                                        f"first batch of task {task} but not in batch {b}")
        names = {group[0]: [source.base.checkpoint_name(key) for key in group] for group in groups}
        if result.names and result.names != names:
            raise EvidenceError(f"block {layer.index}: its linear maps share their inputs otherwise on task {task}")
        result.names = names
        result.inputs.append({group[0]: inputs[group[0]] for group in groups})
        result.masks.append(replayed.masks)
        records = sum(len(rows) for rows in replayed.indices)
        if records != len(fold_by_record):
            raise EvidenceError(f"block {layer.index}: task {task} replayed {records} records "
                                f"for {len(fold_by_record)} fold assignments")
        result.folds.append(torch.from_numpy(fold_by_record))
    source.drop_pooled()  # the base block's θ0 its replays formed in the compute dtype (0.8 GB at 7B in float32)
    return result


#: The per-fold Grams of a block's maps (every task, group and fold) are kept for the block's folds where they all
#: fit in this many bytes (SmolLM2-135M, 3 tasks × 4 folds: 161 MB in float32; a 7B block: 8.2 GB, so not there).
FOLD_GRAMS_KEPT_BYTES = 1 << 30


@dataclass(eq=False)
class FoldGrams(Sequence):
    """Per task, RegMean's input Gram of one group of maps fed the same tensor (`MapInputs.names`, led by `lead`) on
    the records of every fold but `fold` — those fold `fold`'s merge is fitted on — computed when indexed and not
    kept: RegMean takes them in task order and lets each go, so one in × in Gram exists at a time (a 7B
    down-projection's is 0.5 GB in float32, T of them 1.4 GB). Gram t is Σ_{f ≠ fold} G_f in fold order, each
    G_f = Σ x xᵀ over the real tokens of fold f's records of task t, batch by batch, in the compute dtype (the sum
    over every fold is the Gram on all the records, up to rounding). Where every G_f of the block (tasks × groups ×
    folds) fits in `FOLD_GRAMS_KEPT_BYTES`, each is computed once and kept for the block's other folds and the
    group's other maps (`MapInputs.fold_grams`) instead of folds − 1 times for each map of the group that indexes
    it (q, k and v each do): the same sums, bit for bit."""

    inputs: MapInputs
    lead: str
    folds: int
    fold: int

    def __len__(self) -> int:
        return len(self.inputs.inputs)

    @torch.no_grad()
    def __getitem__(self, task: int) -> torch.Tensor:
        task = operator.index(task)  # a position, not a slice
        if not -len(self) <= task < len(self):
            raise IndexError(f"task {task} of {len(self)}")
        kept = self._kept()
        total = None
        for f in range(self.folds):
            if f == self.fold:
                continue
            if kept is None:
                gram = self._fold_gram(task, f)
            else:
                key = (task % len(self), self.lead, f)
                if key not in kept:
                    kept[key] = self._fold_gram(task, f)
                gram = kept[key]
            if total is None:
                total = gram if kept is None else gram.clone()  # a kept G_f is summed into a copy, never changed
            else:
                total.add_(gram)
        return total

    def _fold_gram(self, task: int, fold: int) -> torch.Tensor:
        """G_f = Σ x xᵀ over the real tokens of fold `fold`'s records of task `task`, batch by batch."""
        per_batch, masks = self.inputs.inputs[task][self.lead], self.inputs.masks[task]
        fold_by_record = self.inputs.folds[task]
        width = per_batch[0].shape[-1]
        first, gram = 0, per_batch[0].new_zeros(width, width)  # first: the batch's first record's position
        for x, mask in zip(per_batch, masks):
            rows = (fold_by_record[first:first + mask.shape[0]] == fold).nonzero().flatten()
            first += mask.shape[0]
            if len(rows):
                tokens = x[rows][mask[rows].to(x.device)]
                gram += tokens.T @ tokens
        return gram

    def _kept(self) -> dict | None:
        """The block's kept per-fold Grams, decided on first use: all of them fit in `FOLD_GRAMS_KEPT_BYTES`."""
        inputs = self.inputs
        if inputs.fold_grams is None:
            element = next(iter(inputs.inputs[0].values()))[0].element_size() if inputs.inputs else 4
            widths = sum(per_batch[0].shape[-1] ** 2 for per_batch in inputs.inputs[0].values()) if inputs.inputs else 0
            needed = len(inputs.inputs) * widths * element * self.folds
            inputs.fold_grams = {} if needed <= FOLD_GRAMS_KEPT_BYTES else False
        return inputs.fold_grams if inputs.fold_grams is not False else None


def training_grams(inputs: MapInputs, folds: int, fold: int) -> dict[str, FoldGrams]:
    """Per linear map (checkpoint name), RegMean's per-task input Grams for fold `fold`'s merge (`FoldGrams`, computed
    when a merge asks for them). Maps fed the same tensor share one `FoldGrams`."""
    result: dict[str, FoldGrams] = {}
    for lead, names in inputs.names.items():
        shared = FoldGrams(inputs, lead, folds, fold)
        for name in names:
            result[name] = shared
    return result


@dataclass
class _BlockData:
    """One block's replays on the fit records: Grams per module name (per input task), and on the block itself each
    task's own fine-tune's features, the record indices and Eq. 33's denominators."""

    grams: dict[str, list[np.ndarray]]
    targets: list[list[torch.Tensor]]
    indices: list[np.ndarray]
    denominators: list[list[float]]


def _captured_base(layer: Layer, path: str, task: str) -> list[torch.Tensor] | None:
    """Unit `path`'s outputs on θ0 over task's batches as the capture kept them (`Recorded.output`, in the compute
    dtype, bit for bit what replaying the base gives), or None where it kept none (a Ray worker's capture; a layer
    whose inputs and outputs do not fit the capture budget together, e.g. a 7B block at 3 × 8 × 512 tokens: 1.2 GB)
    or the unit serves heads (which also need W_o's input per variant)."""
    recorded = layer.recorded[task][path] if layer.recorded is not None else []
    if not recorded or any(m.head is not None for m in layer.units[path].modules):
        return None
    outputs = [rec.output for rec in recorded]
    return None if any(output is None for output in outputs) else outputs


def _block_data(layer: Layer, tasks: list[str]) -> _BlockData:
    block_path = layer.arch.layer_path(layer.index)
    grams: dict[str, list[np.ndarray]] = {}
    targets, indices = [], []
    for path, unit in layer.units.items():
        for a, task in enumerate(tasks):
            base = _captured_base(layer, path, task)  # θ0's outputs from the capture: one replay fewer per unit
            replayed = unit.run(task, ([{}] if base is None else []) + [{t: 1.0} for t in tasks])
            if base is not None:
                replayed.outputs.insert(0, base)
            for module in unit.modules:
                outputs = replayed.of(module)
                grams.setdefault(module.name, []).append(_grams(outputs))
                if path == block_path:
                    targets.append(list(outputs.features(1 + a)))
                    indices.append(np.fromiter(outputs.sample_indices(), dtype=np.int64))
            del replayed
    block = grams[f"layers.{layer.index}"]
    return _BlockData(grams, targets, indices, [[balance_denominator(g) for g in stack] for stack in block])


def _table(layer: Layer) -> TensorTable:
    """The tensor table of the model the layer's source replays (a Ray worker's: its blocks, the rest on meta)."""
    return TensorTable.from_model(layer.source.base.model, layer.source.base.checkpoint_names, layer.arch)


def _merged_features(layer: Layer, delta: TensorDelta, table: TensorTable, tasks: list[str],
                     samples: list[np.ndarray] | None = None) -> list[list[torch.Tensor | None]]:
    """Per input task, the features of the block merged by `delta`, replayed on that task's recorded inputs, one per
    sample in replay order. With `samples` (per task, a bool per sample in replay order), only the recorded batches
    holding a chosen sample are replayed, and the other batches' samples are None: a fold's score replays its own
    batches (the evidence sweep cuts batches within folds), a quarter of the records at 4 folds."""
    source, path = layer.source, layer.arch.layer_path(layer.index)
    unit = layer.units[path]
    variant = Given(merged_block(source, path, delta, table, tasks))
    if samples is None:
        return [list(unit.run(task, [variant]).of(unit.modules[0]).features(0)) for task in tasks]
    features = []
    for task, chosen in zip(tasks, samples):
        recorded = layer.recorded[task][path]
        starts = np.cumsum([0] + [len(rec.sample_index) for rec in recorded])
        batches = [b for b in range(len(recorded)) if chosen[starts[b]:starts[b + 1]].any()]
        found = iter(unit.run(task, [variant], batches=batches).of(unit.modules[0]).features(0))
        features.append([next(found) if b in batches else None
                         for b in range(len(recorded)) for _ in range(starts[b], starts[b + 1])])
    return features


@dataclass(frozen=True)
class _EvidenceOfLayer:
    """The evidence of one block (a `LayerMeasure`'s function; picklable, so Ray workers run it)."""

    tasks: list[str]
    candidates: list[str]
    parts: list[str]
    folds: int
    balance: bool
    merge: CandidateMerge
    order: list[list[int]]  # per task: its fit records' indices as read (what the folds are cut by)

    def __call__(self, layer: Layer) -> dict:
        j, tasks, folds = layer.index, self.tasks, self.folds
        data = _block_data(layer, tasks)
        layer.source.clear(release_pages=False)  # the block's τ its replays kept: the merges read it tensor by tensor
        folds_by_task = [fold_of_records(order, index, folds) for order, index in zip(self.order, data.indices)]
        fold_alpha = np.array([[fold_alphas(data.grams[unit_of(j, p)], folds_by_task, k, balance=self.balance)
                                for k in range(folds)] for p in self.parts])  # (part, fold, task)
        alpha = np.array([fold_alphas(data.grams[unit_of(j, p)], folds_by_task, -1, balance=self.balance)
                          for p in self.parts])
        table = _table(layer)
        infos = [info for info in table if info.layer == j]
        scores = np.full((len(self.candidates), folds), np.nan)
        gram_rules = [c for c in self.candidates if c in getattr(self.merge, "gram_rules", ())]
        inputs = map_inputs(layer, tasks, folds_by_task) if gram_rules else None
        for c, candidate in enumerate(self.candidates):
            if candidate in gram_rules:  # fitted per fold: Grams and the block's α of the other folds
                for k in range(folds):
                    solved = {f"layers.{j}": dict(zip(tasks, map(float, fold_alpha[self.parts.index(BLOCK), k])))}
                    delta = self.merge(j, candidate, solved, infos, grams=training_grams(inputs, folds, k))
                    merged = _merged_features(layer, delta, table, tasks, [f == k for f in folds_by_task])
                    scores[c, k] = fold_objective(merged, data.targets, data.denominators, folds_by_task, k,
                                                  self.balance)
                continue
            if candidate not in CHOOSABLE:  # a block rule: no α, one merge for every fold
                merged = _merged_features(layer, self.merge(j, candidate, {}, infos), table, tasks)
                scores[c] = [fold_objective(merged, data.targets, data.denominators, folds_by_task, k, self.balance)
                             for k in range(folds)]
                continue
            units = unit_names(candidate, j, layer.arch.num_heads)
            for k in range(folds):
                solved = {u: dict(zip(tasks, map(float, fold_alpha[self.parts.index(part_of(u)), k])))
                          for u in units}
                merged = _merged_features(layer, self.merge(j, candidate, solved, infos), table, tasks,
                                          [f == k for f in folds_by_task])
                scores[c, k] = fold_objective(merged, data.targets, data.denominators, folds_by_task, k,
                                              self.balance)
        return {f"layers.{j}": {"fold_objective": scores, "alpha": alpha, "fold_alpha": fold_alpha}}


def _levels(candidates: Sequence[str]) -> tuple[str, ...]:
    """The sweep levels whose replays the candidates need (the block always: the objective is on its output)."""
    wanted = {"layer", *(level for candidate in candidates if candidate in CHOOSABLE
                         for level in GRANULARITIES[candidate])}
    return tuple(level for level in ("layer", "attn", "head", "mlp") if level in wanted)


def _checked_candidates(experiment, candidates: Sequence[str], folds: int,
                        block_rules: Sequence[str] = ()) -> tuple[str, ...]:
    """The candidates without repeats; an `EvidenceError` for a candidate that is neither a granularity choosable
    per block nor one of the merge's `block_rules`, fewer than 2 folds, or fewer fit records than folds."""
    candidates = tuple(dict.fromkeys(candidates))
    if not candidates:
        raise EvidenceError("the evidence step needs at least one candidate granularity (layer, attn-mlp, head-mlp)")
    for candidate in candidates:
        if candidate not in CHOOSABLE and candidate not in block_rules:
            rules = f", or a block rule ({', '.join(block_rules)})" if block_rules else ""
            raise EvidenceError(f"candidate '{candidate}' is neither a granularity choosable per layer "
                                f"({', '.join(CHOOSABLE)}){rules}")
    if folds < 2:
        raise EvidenceError(f"--folds must be at least 2 (got {folds})")
    fewest = min(len(data.texts) for data in experiment.data.values())
    if fewest < folds:
        raise EvidenceError(f"{folds}-fold cross-validation needs at least {folds} fit records per task; "
                            f"one task has {fewest} (raise --fit or lower --folds)")
    return candidates


def evidence(
    experiment,
    merge: CandidateMerge,
    *,
    candidates: Sequence[str] = EVIDENCE_CANDIDATES,
    folds: int = DEFAULT_FOLDS,
    balance: bool = True,
    layers: Sequence[int] | None = None,
    run: RunSettings | None = None,
    **run_options,
) -> xr.Dataset:
    """The cross-validated Eq. 10 objective of every block at every candidate granularity (see the module
    docstring); with ``store``, written as group ``evidence`` one block at a time (resumable). `layers`: only these
    blocks (a benchmark's slice; a plan needs every block).

    `merge` merges a block at a candidate with given α exactly as the plan will
    (`submerge.merge.plan.CandidateMerge`; diagnostics never import merge). ``run`` (or its fields as keywords:
    ``store``, ``force``, ``progress``, ``command``, ``on_unit``, ``capture_budget``, ``compute_dtype``,
    ``engine``): `submerge.diagnostics.execution.RunSettings`; with a ``RayEngine`` the blocks are measured by a
    pipeline of Ray workers, and this process alone writes the store.
    """
    candidates = _checked_candidates(experiment, candidates, folds, getattr(merge, "block_rules", ()))
    run = RunSettings.of(run, **run_options)
    if layers is not None and run.store is not None:
        raise EvidenceError("layers= measures a slice of the blocks, which a store would take for the whole group: "
                            "give it without store=")
    tasks, heads = experiment.tasks, experiment.arch.num_heads
    parts = parts_of(candidates, heads)
    settings = {"candidates": list(candidates), "folds": folds, "balance": balance, "merge": merge.settings}
    # regrouped at a loss's 64 tokens a batch, not the replays' 256: on the demo kit (8 fit records × ≤ 256 tokens
    # per task, LoRA fine-tunes) 329.4 / 334.4 s in file order, 284.6 / 317.6 s at 64, 345.7 / 333.1 s at 256
    # cut within folds: fold k's candidate merges replay fold k's batches only (a quarter of the block's replays
    # at 4 folds, where every merge replayed every record before stop 51)
    sweep = Sweep(experiment.regrouped(data_module.BATCH_OVERHEAD_TOKENS, folds=folds), _levels(candidates), GROUP,
                  settings, run, unit_dim="layer", layers=layers, capture_outputs="within budget", capture_maps=False)
    scorer = _EvidenceOfLayer(list(tasks), list(candidates), parts, folds, balance, merge,
                              [list(experiment.data[task].indices) for task in tasks])

    def piece(modules, results) -> xr.Dataset:
        layer = modules[0].layer
        found = results[f"layers.{layer}"]
        return xr.Dataset(
            {"fold_objective": (("layer", "candidate", "fold"), found["fold_objective"][None]),
             "alpha": (("layer", "part", "task"), found["alpha"][None]),
             "fold_alpha": (("layer", "part", "fold", "task"), found["fold_alpha"][None])},
            coords={"layer": np.array([layer]), "candidate": np.array(list(candidates), dtype=object),
                    "fold": np.arange(folds), "part": np.array(parts, dtype=object),
                    "task": np.array(tasks, dtype=object)})

    sweep.run("Evidence: granularity per layer", LayerMeasure(scorer), piece)
    fewest = min(len(data.texts) for data in experiment.data.values())
    return sweep.writer.finish({
        "equations": "seed 002 Eq. 10 (objective of the merged block's output against each input task's own "
                     "fine-tune), α by Eq. 12-14" + (", balanced by Eq. 33-34" if balance else ""),
        "folds": f"record i of each task's fit records is in fold i mod {folds}; fold_alpha[k] and "
                 "fold_objective[k] use α solved on the other folds, scored on fold k",
        "part": "block: unit layers.<layer>; any other part p: unit layers.<layer>.<p>",
        "fit_records": fewest, "balance": balance})


# ------------------------------------------------------------------------------------ the store group


def summary(dataset: xr.Dataset) -> pd.DataFrame:
    """Per block: the held-out Eq. 10 objective of each candidate granularity, mean ± std over the folds (lower is
    better; the plan's choice, with its one-standard-error rule, is `submerge.merge.plan.choose_by_evidence`'s)."""
    objective = dataset.fold_objective
    mean, std = objective.mean("fold").to_pandas(), objective.std("fold", ddof=1).to_pandas()
    frame = pd.concat({"mean": mean, "std": std}, axis=1).swaplevel(0, 1, axis=1)
    frame = frame[[(str(c), part) for c in dataset.candidate.values for part in ("mean", "std")]]
    frame.index.name = "layer"
    return frame


EVIDENCE = StoreGroup(
    name=GROUP,
    dim="layer",
    variables={"fold_objective": ("layer", "candidate", "fold"), "alpha": ("layer", "part", "task"),
               "fold_alpha": ("layer", "part", "fold", "task")},
    title="Evidence: held-out Eq. 10 objective per block and candidate granularity (mean ± std over folds, "
          "lower is better)",
    summary=summary,
)


# ------------------------------------------------------------------------------------ a plan's block objectives


def _targets_file(directory: str, layer: int) -> Path:
    return Path(directory) / f"layer-{layer}.safetensors"


def _save_targets(data: _BlockData, path: Path, inputs: list[list[torch.Tensor]] | None = None) -> None:
    """What every merge's objective of one block shares: each task's own fine-tune's features, the record indices
    and Eq. 33's denominators (not the Grams), and with `inputs` (per task, per batch) the block's input stream on
    θ0, bitwise, in one safetensors file (written whole, then renamed)."""
    tensors = {f"target.{a}.{s}": feature.detach().cpu().contiguous()
               for a, features in enumerate(data.targets) for s, feature in enumerate(features)}
    tensors |= {f"input.{a}.{b}": hidden.detach().cpu().contiguous()
                for a, streams in enumerate(inputs or []) for b, hidden in enumerate(streams)}
    tensors |= {f"indices.{a}": torch.from_numpy(np.asarray(index, dtype=np.int64))
                for a, index in enumerate(data.indices)}
    tensors |= {f"denominators.{a}": torch.tensor(values, dtype=torch.float64)
                for a, values in enumerate(data.denominators)}
    partial = path.with_name(path.name + ".partial")
    metadata = {"tasks": str(len(data.targets))}
    if inputs is not None:
        metadata["input_batches"] = ",".join(str(len(streams)) for streams in inputs)
    save_file(tensors, str(partial), metadata=metadata)
    partial.replace(path)


def _load_inputs(path: Path, device) -> list[list[torch.Tensor]] | None:
    """The block input streams `_save_targets` kept (per task, per batch); None where the file has none."""
    with safe_open(str(path), framework="pt") as file:
        counts = file.metadata().get("input_batches")
        if counts is None:
            return None
        return [[file.get_tensor(f"input.{a}.{b}").to(device) for b in range(int(count))]
                for a, count in enumerate(counts.split(","))]


def _load_targets(path: Path, device) -> _BlockData:
    with safe_open(str(path), framework="pt") as file:
        tasks = int(file.metadata()["tasks"])
        indices = [file.get_tensor(f"indices.{a}").numpy() for a in range(tasks)]
        targets = [[file.get_tensor(f"target.{a}.{s}").to(device) for s in range(len(indices[a]))]
                   for a in range(tasks)]
        denominators = [file.get_tensor(f"denominators.{a}").tolist() for a in range(tasks)]
    return _BlockData({}, targets, indices, denominators)


@dataclass(frozen=True)
class _ObjectiveOfLayer:
    """Eq. 10 of one block merged by a fixed rule (a `LayerMeasure`'s function; picklable). With `shared` (a
    directory), the replays every merge shares — the base's and each fine-tune's, for the targets and Eq. 33's
    denominators — are run once per block and kept there for the next merge's objective on the same records."""

    tasks: list[str]
    balance: bool
    delta: TensorDelta
    shared: str | None = None

    def _data(self, layer: Layer) -> _BlockData:
        if self.shared is None:
            return _block_data(layer, self.tasks)
        path = _targets_file(self.shared, layer.index)
        if path.exists():
            return _load_targets(path, layer.source.device)
        data = _block_data(layer, self.tasks)
        block_path = layer.arch.layer_path(layer.index)
        inputs = ([[recorded.hidden for recorded in layer.recorded[task][block_path]] for task in self.tasks]
                  if layer.recorded is not None else None)
        _save_targets(data, path, inputs)
        return data

    def __call__(self, layer: Layer) -> dict:
        data = self._data(layer)
        layer.source.clear(release_pages=False)  # as in the evidence: the merge reads τ tensor by tensor
        merged = _merged_features(layer, self.delta, _table(layer), self.tasks)
        every = [np.zeros(len(index), dtype=np.int64) for index in data.indices]
        name = f"layers.{layer.index}"
        return {name: fold_objective(merged, data.targets, data.denominators, every, 0, self.balance)}


def block_objectives(experiment, delta: TensorDelta, *, balance: bool = True, layers: Sequence[int] | None = None,
                     progress: bool = False, capture_budget: int = DEFAULT_CAPTURE_BUDGET,
                     engine=None, shared: str | Path | None = None) -> dict[int, float]:
    """Eq. 10 objective (Eq. 33 balanced) of every block (or of `layers`) merged by `delta`, on all of the
    experiment's records; nothing is written. The block's inputs are recorded on the base, chunk after chunk (each
    continuing where the last stopped); its merged output is compared with each input task's own fine-tune. Use an
    experiment on held-out records (``skip``) to check a plan out of sample (`submerge.merge.plan.block_objectives`).

    `shared`: a directory (made if missing) where the first call keeps, per block, what every merge's objective on
    the same experiment shares (the fine-tunes' block outputs and Eq. 33's denominators: T + 1 of the T + 3 block
    replays, and the block's input stream on θ0); later calls with the same directory and experiment read them back
    instead of replaying and capturing (a local engine: no forward of the base at all), with the same result bit
    for bit. The caller owns the directory: one per experiment (records and fine-tunes), deleted
    when done (`diag compare` keeps one per subset and seed in its scratch).
    """
    if shared is not None:
        Path(shared).mkdir(parents=True, exist_ok=True)
    run = RunSettings(progress=progress, capture_budget=capture_budget, engine=engine or LocalEngine())
    measure = _ObjectiveOfLayer(list(experiment.tasks), balance, delta, None if shared is None else str(shared))
    if shared is not None and isinstance(run.engine, LocalEngine):
        kept = _objectives_on_kept_inputs(experiment, measure, run, layers)
        if kept is not None:
            return kept
    sweep = Sweep(experiment, ("layer",), "block_objectives", {"balance": balance}, run, unit_dim="layer",
                  layers=layers)

    def piece(modules, results) -> xr.Dataset:
        return xr.Dataset({"objective": (("layer",), np.array([results[modules[0].name]]))},
                          coords={"layer": np.array([modules[0].layer])})

    sweep.run("Block objectives", LayerMeasure(measure), piece)
    result = sweep.writer.finish({})
    return {int(layer): float(value) for layer, value in zip(result.layer.values, result.objective.values)}


def _objectives_on_kept_inputs(experiment, measure: _ObjectiveOfLayer, run: RunSettings,
                               layers: Sequence[int] | None) -> dict[int, float] | None:
    """`block_objectives` of a later merge, on the block inputs the first call kept in ``measure.shared``: each
    block's stream read back, what the block receives besides it (masks, positions) rebuilt from the tokens
    (`capture.block_kwargs`), the same replays on them as the sweep's; None where a block's file (or its inputs) is
    missing, and the caller captures as before."""
    arch = experiment.arch
    chosen = list(range(arch.num_layers)) if layers is None else sorted(set(layers))
    files = [_targets_file(measure.shared, layer) for layer in chosen]
    if not all(path.exists() for path in files):
        return None
    source = experiment.parameter_source(run.compute_dtype)
    modules = {m.layer: m for m in modules_for(experiment, ("layer",), chosen)}
    kwargs = {task: block_kwargs(experiment.base.model, arch, chosen, experiment.batches[task],
                                 device=experiment.device, compute=source.compute_dtype) for task in experiment.tasks}
    results: dict[int, float] = {}
    with no_tf32(), progress_bar(run.progress) as bar:
        job = bar.add_task("Block objectives (kept inputs)", total=len(chosen))
        for layer, path in zip(chosen, files):
            inputs = _load_inputs(path, experiment.device)
            block_path = arch.layer_path(layer)
            if inputs is None or [len(streams) for streams in inputs] != [len(kwargs[t][block_path]) for t in kwargs]:
                return None  # kept by an older run, or for other records: capture
            recorded = {task: {block_path: [given.with_hidden(hidden)
                                            for given, hidden in zip(kwargs[task][block_path], inputs[a])]}
                        for a, task in enumerate(experiment.tasks)}
            found = measure_layer(source, arch, [modules[layer]], recorded, LayerMeasure(measure))
            results[layer] = float(found[f"layers.{layer}"])
            del recorded, inputs
            bar.advance(job)
    return results

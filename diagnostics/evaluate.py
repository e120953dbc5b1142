"""`diag eval`: mean token loss and perplexity per task, for the base, fine-tunes and merges.

Held-out records: the records after the first `skip` of each task file (the
first ones fit α and the diagnostics). Each model (a directory, hub id or LoRA
adapter) is evaluated as θ0 + τ, block by block like the model level of `diag
linearity` (`capture.model_outputs`): the batches of every task go through one
block before the next, whose weights are then read from the checkpoint in the
compute dtype. The base stays as stored (memory-mapped), and memory is one
block's weights plus the hidden states of the batches, never a second model.

Owner of the store group ``eval`` (`EVAL`): its layout, its summary table and its figure.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pandas as pd
import torch
import xarray as xr
from torch.func import functional_call

from submerge.diagnostics import plot
from submerge.diagnostics.base_model import BaseModel, LoadSettings, load_base_model
from submerge.diagnostics.capture import ParameterSource, model_outputs, no_tf32, output_head_path, upcast
from submerge.diagnostics.checkpoints import model_fingerprints, open_checkpoint
from submerge.diagnostics.data import by_length, predicting, read_task_file, tokenize
from submerge.diagnostics.errors import ModelInputError
from submerge.diagnostics.execution import LocalEngine, RunSettings, driver_settings
from submerge.diagnostics.experiment import check_device, pick_compute_dtype
from submerge.diagnostics.groups import StoreGroup
from submerge.diagnostics.modules import find_architecture
from submerge.diagnostics.placement import process_stats
from submerge.diagnostics.progress import progress_bar
from submerge.diagnostics.store import UnitWriter
from submerge.diagnostics.tables import long_frame, strings
from submerge.diagnostics.task_vectors import TaskVectorReader

LOSS_CHUNK_ENTRIES = 2**25  # logits entries (rows × vocabulary) formed at a time: 128 MiB in float32
#: How a loss is computed, in the settings of the groups that store losses (eval, compare): a store whose losses
#: were computed otherwise is not resumed or grown with these (before stop 46, cross-entropy over the vocabulary
#: on a transposed view of every position's logits, 6e-5 relative below float64 on the demo base; now 5e-6; since
#: stop 47 each task's records are regrouped by length, which moves a loss by float rounding only, ~1e-7).
LOSS_RULE = ("float32 cross-entropy per predicting position, contiguous logits rows, float64 sum; records regrouped "
             "by length")


def summed_token_loss(rows: torch.Tensor, batch, logits_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      *, vocabulary: int = 1, chunk_entries: int | None = None) -> tuple[float, int]:
    """Next-token cross-entropy summed over a batch's real tokens (nats), and their number.

    `rows`: the logits at the predicting positions (`predicting`), or, with `logits_of`, what it maps to them
    (the final hidden states there): the output head then runs on those rows alone, not on the padding or the
    last position, and its logits (`vocabulary` wide) are formed `chunk_entries` (default `LOSS_CHUNK_ENTRIES`) at
    a time. Each token's loss is float32 cross-entropy on its contiguous row of logits, summed in float64."""
    targets = batch.input_ids[:, 1:][batch.attention_mask[:, 1:].bool()].to(rows.device)  # the tokens predicted
    whole = max(1, rows.shape[0])
    step = whole if logits_of is None else max(1, (chunk_entries or LOSS_CHUNK_ENTRIES) // vocabulary)
    total = 0.0
    for start in range(0, rows.shape[0], step):
        logits = rows[start:start + step] if logits_of is None else logits_of(rows[start:start + step])
        total += float(torch.nn.functional.cross_entropy(logits.float(), targets[start:start + step],
                                                         reduction="none").double().sum())
    return total, int(targets.numel())


@torch.no_grad()
def task_loss(model: torch.nn.Module, batches) -> tuple[float, int]:
    """Mean next-token cross-entropy over real tokens (nats) and the number of predicted tokens, of `model` run
    whole as it is (the plain forward `streamed_losses` is checked against)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in batches:
        ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits
        batch_total, batch_count = summed_token_loss(predicting(logits, batch), batch)
        total, count = total + batch_total, count + batch_count
    return (total / count if count else math.nan), count


def scaled_source(base: BaseModel, checkpoint, scale: float, compute: torch.dtype, name: str = "model"):
    """(ParameterSource, variant) of θ0 + scale · (θ_checkpoint − θ0) in `compute`; `checkpoint` (an opened
    reader) None: the base itself."""
    if checkpoint is None:
        return ParameterSource(base, {}, compute_dtype=compute), {}
    return summed_source(base, {name: (checkpoint, scale)}, compute)


def summed_source(base: BaseModel, terms: dict, compute: torch.dtype):
    """(ParameterSource, variant) of θ0 + Σ_k scale_k · (θ_k − θ0) in `compute`; `terms`: name → (opened reader of
    θ_k, scale_k). Each update is read from its checkpoint and scaled where the parameter is built, so a sum of
    merges at several scales is evaluated without writing it."""
    vectors = {name: TaskVectorReader(name, base.reader, reader) for name, (reader, _) in terms.items()}
    return (ParameterSource(base, vectors, compute_dtype=compute),
            {name: float(scale) for name, (_, scale) in terms.items()})


def checkpoint_source(base: BaseModel, spec: str | None, compute: torch.dtype, *, allow_pickle: bool = False):
    """(ParameterSource, variant) of the checkpoint `spec` (None: the base) as θ0 + τ in `compute`."""
    checkpoint = None if spec is None else open_checkpoint(spec, base=base.reader, allow_pickle=allow_pickle)
    return scaled_source(base, checkpoint, 1.0, compute, name=spec or "base")


@torch.no_grad()
def streamed_losses(source: ParameterSource, arch, batches: dict, variant: dict) -> dict[str, tuple[float, int]]:
    """`task_loss` per task of θ0 + Σ c τ (`variant`), computed block by block (`model_outputs`) over the batches
    of every task together (each block's weights are read once per model), each task's records regrouped by length
    (`data.by_length`), the head batch by batch on the positions that predict a real token only
    (`summed_token_loss`); TF32 off."""
    model = source.base.model
    batches = {task: by_length(batches[task]) for task in batches}  # a sum over tokens: the padding trimmed
    tasks = [task for task in batches for _ in batches[task]]
    flat = [batch for task in batches for batch in batches[task]]
    totals = {task: [0.0, 0] for task in batches}
    with no_tf32():
        hidden = model_outputs(source, arch, flat, [variant], output="hidden")[0]
        head_path = output_head_path(model)
        head = model.get_submodule(head_path)
        params = source.variant(head_path, variant)
        vocabulary = getattr(head, "out_features", None) or model.config.get_text_config().vocab_size

        def logits_of(x: torch.Tensor) -> torch.Tensor:
            return functional_call(head, params, (x,), strict=False) if params else head(x)

        for b, (task, batch) in enumerate(zip(tasks, flat)):
            rows = predicting(upcast(hidden[b], source.dtype_for(head_path)), batch)
            hidden[b] = None
            batch_total, batch_count = summed_token_loss(rows, batch, logits_of, vocabulary=vocabulary)
            totals[task][0] += batch_total
            totals[task][1] += batch_count
    source.clear()
    return {task: ((total / count if count else math.nan), count) for task, (total, count) in totals.items()}


def model_losses(base: BaseModel, arch, spec: str | None, tasks: list[str], batches: dict, compute: torch.dtype, *,
                 allow_pickle: bool = False, describe: Callable[[str], None] = lambda text: None) -> tuple[list, list]:
    """(loss per task, predicted tokens per task) of the checkpoint `spec` (None: the base), as θ0 + τ in `compute`.

    Nothing is written into the base model: one block of the checkpoint at a time is read (`streamed_losses`).
    """
    source, variant = checkpoint_source(base, spec, compute, allow_pickle=allow_pickle)
    describe(", ".join(tasks))
    results = streamed_losses(source, arch, {task: batches[task] for task in tasks}, variant)
    return [results[task][0] for task in tasks], [results[task][1] for task in tasks]


class EvalWorker:
    """Runs each model of its groups block by block over the base (memory-mapped): (loss, tokens) per task."""

    def __init__(self, base: BaseModel, tasks: list[str], batches: dict, compute: torch.dtype, allow_pickle: bool):
        self.base, self.arch = base, find_architecture(base.model)
        self.tasks, self.batches, self.compute, self.allow_pickle = tasks, batches, compute, allow_pickle

    def evaluate(self, group: list[str | None]) -> list[tuple[list, list]]:
        return [model_losses(self.base, self.arch, spec, self.tasks, self.batches, self.compute,
                             allow_pickle=self.allow_pickle) for spec in group]

    def stats(self) -> dict:
        return process_stats()


@dataclass
class EvalTask:
    """What a worker of `evaluate` needs: the base (loaded by a Ray worker from its spec; here the one loaded
    already, which is not pickled), the tasks' batches and the compute dtype."""

    method: ClassVar[str] = "evaluate"
    base_spec: str
    load: dict
    tasks: list[str]
    batches: dict
    compute: torch.dtype
    opened: BaseModel | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "opened": None}

    def open(self) -> EvalWorker:
        base = self.opened or load_base_model(self.base_spec, **self.load)
        return EvalWorker(base, self.tasks, self.batches, self.compute, self.load["allow_pickle"])


def learned_positions(model: torch.nn.Module) -> int | None:
    """The number of positions of a model with learned position embeddings (GPT-2's 1,024), else None: a
    longer record would index past the table (rotary models have no such bound)."""
    names = ("wpe", "embed_positions", "position_embeddings")
    if not any(isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in names
               for name, module in model.named_modules()):
        return None
    config = model.config
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def check_scorable(data, batches, positions: int | None, max_tokens: int) -> None:
    """Refuse a task whose loss cannot be computed (no record of two tokens or more: a next-token loss needs
    two) or whose records are longer than the model's learned positions; warn about records too short to count."""
    lengths = {int(index): int(length) for batch in batches
               for index, length in zip(batch.sample_index, batch.attention_mask.sum(dim=1).tolist())}
    short = [index for index, length in lengths.items() if length < 2]
    where = f"task '{data.task}': "
    if len(short) == len(lengths):
        raise ModelInputError(f"{where}none of the {len(lengths)} held-out records of {data.path} has two tokens or "
                              "more (a next-token loss needs at least two): give longer records or more of them")
    if short:
        warnings.warn(f"{where}{len(short)} of the {len(lengths)} held-out records of {data.path} have fewer than "
                      f"two tokens (records {short[:10]}): they add nothing to the loss", UserWarning, stacklevel=3)
    longest = max(lengths.values())
    if positions is not None and longest > positions:
        too_long = [index for index, length in lengths.items() if length > positions]
        raise ModelInputError(f"{where}records {too_long[:10]} of {data.path} have more tokens than the {positions} "
                              f"positions the model has learned (up to {longest} with --max-tokens {max_tokens}): "
                              f"use --max-tokens {positions} or less")


def _piece(label: str, spec: str, tasks: list[str], losses: list[float], counts: list[int]) -> xr.Dataset:
    """One store unit of `eval`: one model's loss, perplexity and token count per task."""
    return xr.Dataset(
        {
            "loss": (("model", "task"), np.array([losses])),
            "perplexity": (("model", "task"), np.exp(np.array([losses]))),
            "tokens": (("model", "task"), np.array([counts])),
        },
        coords={"model": np.array([label], dtype=object), "task": np.array(tasks, dtype=object),
                "spec": ("model", np.array([spec], dtype=object))},
    )


def evaluate(
    base_spec: str,
    models: dict[str, str],
    data: dict[str, str],
    *,
    skip: int = 30,
    samples: int | None = 100,
    max_tokens: int = 512,
    batch_size: int = 8,
    compute_dtype: str = "float32",
    load: LoadSettings | None = None,
    run: RunSettings | None = None,
    **options,
) -> xr.Dataset:
    """Loss and perplexity of 'base' and every model in `models` (label → spec) on each task's held-out records.

    ``load`` (or its fields as keywords: ``dtype``, ``device``, ``offload``, ``allow_pickle``,
    ``trust_remote_code``; `submerge.diagnostics.base_model.LoadSettings`): weights are kept in ``dtype``
    (storage); the forwards run in `compute_dtype` stage by stage, TF32 off (``offload``: the base's weights stay
    in host memory and go to ``device`` one block at a time).
    ``run`` (or its fields as keywords: ``store``, ``force``, ``progress``, ``command``, ``on_unit``, ``engine``;
    `submerge.diagnostics.execution.RunSettings`): with a ``RayEngine`` each model is a task of its Ray workers,
    each holding one model instance; this process loads the base on the meta device only and alone writes the
    store, model by model, in order.
    """
    load, run = driver_settings(load, run, options)
    compute = pick_compute_dtype(compute_dtype)
    check_device(load.device)
    local = isinstance(run.engine, LocalEngine)
    base = load_base_model(base_spec, **load.keywords(), weights=local)  # on Ray, each worker loads the model
    if not hasattr(base.model, "get_output_embeddings") or base.model.get_output_embeddings() is None:
        raise ModelInputError(f"{base_spec}: eval needs a causal language model with an output head")
    task_data = {task: read_task_file(task, path, samples=samples, skip=skip) for task, path in data.items()}
    batches = {
        task: tokenize(d, base.tokenizer, max_tokens=max_tokens, batch_size=batch_size) for task, d in task_data.items()
    }
    for task, task_batches in batches.items():
        check_scorable(task_data[task], task_batches, learned_positions(base.model), max_tokens)
    labels = ["base", *models]
    if len(set(labels)) != len(labels):
        raise ModelInputError(f"model labels must be unique (got {labels}); 'base' is reserved")
    tasks = list(task_data)
    storage = str(next(base.model.parameters()).dtype).removeprefix("torch.")
    settings = {"skip": skip, "samples": samples, "max_tokens": max_tokens, "tasks": tasks, "dtype": storage,
                "loss": LOSS_RULE,
                "compute_dtype": compute_dtype}
    find_architecture(base.model)  # an architecture submerge cannot split fails here, before any work
    inputs = {
        "base_model": base.reader.fingerprint() | {"spec": base_spec},
        "models": model_fingerprints(models, base.reader, allow_pickle=load.allow_pickle),
        "data": {t: d.provenance() for t, d in task_data.items()},
        "engine": run.engine.provenance(),  # provenance only: a run resumes across engines
    }
    writer = UnitWriter(run.store, EVAL.name, settings, dim=EVAL.dim, force=run.force, on_unit=run.on_unit,
                        inputs=inputs, command=run.command)
    todo = [label for label in labels if label not in writer.done]
    specs = {label: None if label == "base" else models[label] for label in labels}
    task = EvalTask(base_spec, load.keywords(), tasks, batches, compute, opened=base if local else None)
    with progress_bar(run.progress) as bar, run.engine.running():
        job = bar.add_task("Evaluating", total=len(labels) * len(tasks))
        bar.advance(job, (len(labels) - len(todo)) * len(tasks))
        if todo:
            bar.update(job, description=f"Evaluating {todo[0]}")
        losses = (result for group in run.engine.map(task, [[specs[label]] for label in todo]) for result in group)
        for index, (label, (loss, counts)) in enumerate(zip(todo, losses)):
            writer.add(_piece(label, specs[label] or base_spec, tasks, loss, counts), label)
            bar.advance(job, len(tasks))
            if index + 1 < len(todo):
                bar.update(job, description=f"Evaluating {todo[index + 1]}")
    notes = {
        "loss": "mean next-token cross-entropy over real tokens, nats",
        "perplexity": "exp(loss)",
        "records": f"records after the first {skip} of each task file",
    }
    return writer.finish(notes)


_SHOWN = ("loss", "perplexity")  # the variables of the table and the figure (tokens: the count behind each loss)


def summary(dataset: xr.Dataset) -> pd.DataFrame:
    """One row per model: its held-out loss on each task, then its perplexity on each task."""
    frame = pd.DataFrame(index=pd.Index(strings(dataset.model.values), name="model"))
    for name in _SHOWN:
        for task in strings(dataset.task.values):
            frame[f"{name} {task}"] = dataset[name].sel(task=task).values
    return frame


def eval_bars(evaluation: xr.Dataset, about: str = ""):
    """Loss and perplexity per model (grouped bars, hue = task), one row each.

    The value axis is zoomed to the data (it need not start at 0) so that merges that differ
    by a few percent can be told apart; each bar is labelled with its value when few.
    """
    if not evaluation.sizes.get("model"):
        return None
    models, tasks = strings(evaluation.model.values), strings(evaluation.task.values)
    with plot.styled() as (plt, sns):
        fig, axes = plt.subplots(len(_SHOWN), 1, figsize=(max(7.5, 0.42 * len(models) * len(tasks) + 3.0),
                                                          3.6 * len(_SHOWN) + 1.6), squeeze=False, layout="constrained")
        for row, (ax, name) in enumerate(zip(axes[:, 0], _SHOWN)):
            frame = long_frame(evaluation[name]).dropna(subset=[name])
            sns.barplot(frame, x="model", y=name, hue="task", order=models, hue_order=tasks, palette="colorblind",
                        ax=ax, legend=row == 0)
            low, high = float(frame[name].min()), float(frame[name].max())
            margin = 0.15 * (high - low) or 0.05 * abs(high) or 1.0
            ax.set_ylim(max(0.0, low - margin) if low >= 0 else low - margin, high + margin)
            if len(models) * len(tasks) <= 30:
                for container in ax.containers:
                    ax.bar_label(container, fmt="%.3g", fontsize=8, padding=2)
            ax.set_xlabel("")
            ax.set_ylabel(name + ("" if ax.get_ylim()[0] == 0 else "\n(axis not from 0)"))
            plot.tilt_labels(ax, 25 if len(models) > 5 else 0)
        plot.legend_outside(axes[0][0], "task")
        plot.title(fig, "Evaluation of the base, the fine-tunes and the merges (group eval)", about)
    return fig


EVAL = StoreGroup(
    name="eval",
    dim="model",
    variables={"loss": ("model", "task"), "perplexity": ("model", "task"), "tokens": ("model", "task")},
    title="Held-out mean token loss (nats) and perplexity, per model and task",
    summary=summary,
    figures={"eval": eval_bars},
)

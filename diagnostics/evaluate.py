"""`diag eval`: mean token loss and perplexity per task, for the base, fine-tunes and merges.

Held-out records: the records after the first `skip` of each task file (the
first ones fit α and the diagnostics). Each model (a directory, hub id or LoRA
adapter) is evaluated as θ0 + τ, block by block like the model level of `diag
linearity` (`capture.model_outputs`): the batches of every task go through one
block before the next, whose weights are then read from the checkpoint in the
compute dtype. The base stays as stored (memory-mapped), and memory is one
block's weights plus the hidden states of the batches, never a second model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
import xarray as xr
from torch.func import functional_call

from submerge.diagnostics.base_model import BaseModel, load_base_model
from submerge.diagnostics.capture import ParameterSource, model_outputs, no_tf32, output_head_path, upcast
from submerge.diagnostics.checkpoints import open_checkpoint
from submerge.diagnostics.data import read_task_file, tokenize
from submerge.diagnostics.errors import ModelInputError
from submerge.diagnostics.experiment import check_device, pick_compute_dtype
from submerge.diagnostics.modules import find_architecture
from submerge.diagnostics.progress import progress_bar
from submerge.diagnostics.scale_out import check_workers, ordered_results, process_stats
from submerge.diagnostics.store import Store, UnitWriter
from submerge.diagnostics.task_vectors import TaskVectorReader


def _summed_token_loss(logits: torch.Tensor, batch, device) -> tuple[float, int]:
    """Next-token cross-entropy summed over a batch's real tokens (nats), and their number."""
    ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    valid = mask[:, 1:].bool()
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    return float(losses[valid].double().sum()), int(valid.sum())


@torch.no_grad()
def task_loss(model: torch.nn.Module, batches) -> tuple[float, int]:
    """Mean next-token cross-entropy over real tokens (nats) and the number of predicted tokens, of `model` run
    whole as it is (the plain forward `streamed_losses` is checked against)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in batches:
        ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
        batch_total, batch_count = _summed_token_loss(model(input_ids=ids, attention_mask=mask).logits, batch, device)
        total, count = total + batch_total, count + batch_count
    return (total / count if count else math.nan), count


def scaled_source(base: BaseModel, checkpoint, scale: float, compute: torch.dtype, name: str = "model"):
    """(ParameterSource, variant) of θ0 + scale · (θ_checkpoint − θ0) in `compute`; `checkpoint` (an opened
    reader) None: the base itself."""
    if checkpoint is None:
        return ParameterSource(base, {}, compute_dtype=compute), {}
    vectors = {name: TaskVectorReader(name, base.reader, checkpoint)}
    return ParameterSource(base, vectors, compute_dtype=compute), {name: scale}


def checkpoint_source(base: BaseModel, spec: str | None, compute: torch.dtype, *, allow_pickle: bool = False):
    """(ParameterSource, variant) of the checkpoint `spec` (None: the base) as θ0 + τ in `compute`."""
    checkpoint = None if spec is None else open_checkpoint(spec, base=base.reader, allow_pickle=allow_pickle)
    return scaled_source(base, checkpoint, 1.0, compute, name=spec or "base")


@torch.no_grad()
def streamed_losses(source: ParameterSource, arch, batches: dict, variant: dict) -> dict[str, tuple[float, int]]:
    """`task_loss` per task of θ0 + Σ c τ (`variant`), computed block by block (`model_outputs`) over the batches
    of every task together (each block's weights are read once per model), the head batch by batch; TF32 off."""
    model = source.base.model
    device = source.device
    tasks = [task for task in batches for _ in batches[task]]
    flat = [batch for task in batches for batch in batches[task]]
    totals = {task: [0.0, 0] for task in batches}
    with no_tf32():
        hidden = model_outputs(source, arch, flat, [variant], output="hidden")[0]
        head_path = output_head_path(model)
        head = model.get_submodule(head_path)
        params = source.variant(head_path, variant)
        for b, (task, batch) in enumerate(zip(tasks, flat)):
            x = upcast(hidden[b], source.dtype_for(head_path))
            hidden[b] = None
            logits = functional_call(head, params, (x,), strict=False) if params else head(x)
            batch_total, batch_count = _summed_token_loss(logits, batch, device)
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
    """A Ray worker of `evaluate`: the base (memory-mapped), over which each model of its groups is run block by block."""

    def __init__(self, base_spec: str, load: dict, tasks: list[str], batches: dict, compute: torch.dtype,
                 threads: int | None):
        if threads:
            torch.set_num_threads(threads)
        self.base = load_base_model(base_spec, **load)
        self.arch, self.tasks, self.batches, self.compute = find_architecture(self.base.model), tasks, batches, compute
        self.allow_pickle = load["allow_pickle"]

    def evaluate(self, group: list[str | None]) -> list[tuple[list, list]]:
        return [model_losses(self.base, self.arch, spec, self.tasks, self.batches, self.compute,
                             allow_pickle=self.allow_pickle) for spec in group]

    def stats(self) -> dict:
        return process_stats()


def _losses(base, arch, specs: list[str | None], tasks, batches, compute, load: dict, scale_out: dict | None,
            describe) -> Iterator[tuple[list, list]]:
    """`model_losses` of every spec in order: here, or one model per task on Ray workers (``scale_out``)."""
    if scale_out is None:
        for spec in specs:
            yield model_losses(base, arch, spec, tasks, batches, compute, allow_pickle=load["allow_pickle"],
                               describe=lambda task, spec=spec: describe(f"{spec or 'base'} on {task}"))
        return

    describe(f"{scale_out['workers']} Ray worker(s)")
    options = dict(scale_out.get("ray_options") or {})
    args = (base.spec, load, tasks, batches, compute, options.pop("threads_per_worker", None))
    for group in ordered_results(scale_out["ray"], EvalWorker, args, "evaluate", [[spec] for spec in specs],
                                 workers=scale_out["workers"], **options):
        yield from group


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
    dtype: str = "auto",
    compute_dtype: str = "float32",
    device: str = "auto",
    offload: bool = False,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    store: Store | None = None,
    force: bool = False,
    progress: bool = True,
    command: str | None = None,
    on_unit: Callable[[str], None] | None = None,
    ray: str | None = None,
    workers: int = 1,
    ray_options: dict | None = None,
) -> xr.Dataset:
    """Loss and perplexity of 'base' and every model in `models` (label → spec) on each task's held-out records.

    Weights are kept in `dtype` (storage); the forwards run in `compute_dtype` stage by stage, TF32 off
    (`offload`: the base's weights stay in host memory and go to `device` one block at a time).
    ``ray`` (``"auto"`` or an address): each model is a task of ``workers`` Ray processes, each holding one
    model instance (``ray_options``: max_retries, gpus_per_worker, threads_per_worker, report); this process
    loads the base on the meta device only and alone writes the store, model by model, in order.
    """
    compute = pick_compute_dtype(compute_dtype)
    check_device(device)
    check_workers(ray, workers)
    load = {"dtype": dtype, "device": device, "allow_pickle": allow_pickle, "trust_remote_code": trust_remote_code,
            "offload": offload}
    base = load_base_model(base_spec, **load, weights=ray is None)  # on Ray, each worker loads the model
    if not hasattr(base.model, "get_output_embeddings") or base.model.get_output_embeddings() is None:
        raise ModelInputError(f"{base_spec}: eval needs a causal language model with an output head")
    task_data = {task: read_task_file(task, path, samples=samples, skip=skip) for task, path in data.items()}
    batches = {
        task: tokenize(d, base.tokenizer, max_tokens=max_tokens, batch_size=batch_size) for task, d in task_data.items()
    }
    labels = ["base", *models]
    if len(set(labels)) != len(labels):
        raise ModelInputError(f"model labels must be unique (got {labels}); 'base' is reserved")
    tasks = list(task_data)
    storage = str(next(base.model.parameters()).dtype).removeprefix("torch.")
    settings = {"skip": skip, "samples": samples, "max_tokens": max_tokens, "tasks": tasks, "dtype": storage,
                "compute_dtype": compute_dtype}
    arch = find_architecture(base.model)
    inputs = {
        "base_model": base.reader.fingerprint() | {"spec": base_spec},
        "models": models,
        "data": {t: d.provenance() for t, d in task_data.items()},
        **({} if ray is None else {"scale_out": {"ray": ray, "workers": workers}}),
    }
    writer = UnitWriter(store, "eval", settings, dim="model", force=force, on_unit=on_unit, inputs=inputs,
                        command=command)
    todo = [label for label in labels if label not in writer.done]
    specs = {label: None if label == "base" else models[label] for label in labels}
    scale_out = None if ray is None else {"ray": ray, "workers": workers, "ray_options": ray_options}
    with progress_bar(progress) as bar:
        job = bar.add_task("Evaluating", total=len(labels) * len(tasks))
        bar.advance(job, (len(labels) - len(todo)) * len(tasks))
        losses = _losses(base, arch, [specs[label] for label in todo], tasks, batches, compute, load, scale_out,
                         lambda text: bar.update(job, description=f"Evaluating {text}"))
        for label, (loss, counts) in zip(todo, losses):
            writer.add(_piece(label, specs[label] or base_spec, tasks, loss, counts), label)
            bar.advance(job, len(tasks))
    notes = {
        "loss": "mean next-token cross-entropy over real tokens, nats",
        "perplexity": "exp(loss)",
        "records": f"records after the first {skip} of each task file",
    }
    return writer.finish(notes)

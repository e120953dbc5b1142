"""`diag eval`: mean token loss and perplexity per task, for the base, fine-tunes and merges.

Held-out records: the records after the first `skip` of each task file (the
first ones fit α and the diagnostics). One model instance is kept; each model
evaluated has its weights copied in tensor by tensor from its checkpoint (a
directory, hub id or LoRA adapter), so only one model is ever in memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import xarray as xr

from diagnostics.capture import computing_in, no_tf32
from diagnostics.data import read_task_file, tokenize
from diagnostics.errors import ModelInputError
from diagnostics.experiment import check_device, pick_compute_dtype
from diagnostics.models import BaseModel, load_base_model, open_checkpoint
from diagnostics.modules import find_architecture
from diagnostics.progress import progress_bar
from diagnostics.store import Store, UnitWriter


@torch.no_grad()
def task_loss(model: torch.nn.Module, batches) -> tuple[float, int]:
    """Mean next-token cross-entropy over real tokens (nats) and the number of predicted tokens."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in batches:
        ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        targets = ids[:, 1:]
        valid = mask[:, 1:].bool()
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        total += float(losses[valid].double().sum())
        count += int(valid.sum())
    return (total / count if count else math.nan), count


@torch.no_grad()
def load_weights(base: BaseModel, spec: str | None, *, allow_pickle: bool = False) -> None:
    """Copy a checkpoint's tensors into the base model instance (None: the base's own)."""
    reader = base.reader if spec is None else open_checkpoint(spec, base=base.reader, allow_pickle=allow_pickle)
    for name, parameter in base.model.named_parameters():
        checkpoint_name = base.checkpoint_name(name)
        if checkpoint_name not in reader:
            raise ModelInputError(f"{spec}: no tensor '{checkpoint_name}' for parameter '{name}'")
        tensor = reader.get(checkpoint_name, parameter.dtype, parameter.device)
        if tensor.shape != parameter.shape:
            if tensor.shape[1:] == parameter.shape[1:] and tensor.shape[0] > parameter.shape[0]:
                tensor = tensor[: parameter.shape[0]]  # added vocabulary rows (vocab policy 'base')
            else:
                raise ModelInputError(
                    f"{spec}: tensor '{checkpoint_name}' has shape {tuple(tensor.shape)}, "
                    f"the base {tuple(parameter.shape)}"
                )
        parameter.copy_(tensor)


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
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    store: Store | None = None,
    force: bool = False,
    progress: bool = True,
    command: str | None = None,
    on_unit: Callable[[str], None] | None = None,
) -> xr.Dataset:
    """Loss and perplexity of 'base' and every model in `models` (label → spec) on each task's held-out records.

    Weights are kept in `dtype` (storage); the forwards run in `compute_dtype` stage by stage, TF32 off.
    """
    compute = pick_compute_dtype(compute_dtype)
    check_device(device)
    base = load_base_model(
        base_spec, dtype=dtype, device=device, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code
    )
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
    }
    writer = UnitWriter(store, "eval", settings, dim="model", force=force, on_unit=on_unit, inputs=inputs,
                        command=command)
    with progress_bar(progress) as bar:
        job = bar.add_task("Evaluating", total=len(labels) * len(tasks))
        for label in labels:
            if label in writer.done:
                bar.advance(job, len(tasks))
                continue
            load_weights(base, None if label == "base" else models[label], allow_pickle=allow_pickle)
            losses, counts = [], []
            for task in tasks:
                bar.update(job, description=f"Evaluating {label} on {task}")
                with computing_in(base.model, arch, compute), no_tf32():
                    loss, count = task_loss(base.model, batches[task])
                losses.append(loss)
                counts.append(count)
                bar.advance(job)
            writer.add(_piece(label, base_spec if label == "base" else models[label], tasks, losses, counts), label)
    load_weights(base, None)
    notes = {
        "loss": "mean next-token cross-entropy over real tokens, nats",
        "perplexity": "exp(loss)",
        "records": f"records after the first {skip} of each task file",
    }
    return writer.finish(notes)

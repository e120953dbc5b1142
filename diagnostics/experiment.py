"""Everything a data-driven diagnostic needs, loaded once: base, task vectors, task data.

`Experiment.load` is the "load" step of load → capture → metrics → store: the
base model is instantiated, fine-tunes are opened lazily and pre-flight checked,
task files are read (first `samples` records) and tokenised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diagnostics.capture import ParameterSource
from diagnostics.data import TaskData, TokenBatch, read_task_file, tokenize
from diagnostics.errors import DataInputError
from diagnostics.models import BaseModel, TaskVectorReader, load_base_model, open_finetunes
from diagnostics.modules import Architecture, find_architecture
from diagnostics.store import run_attrs


@dataclass
class Experiment:
    base: BaseModel
    arch: Architecture
    task_vectors: dict[str, TaskVectorReader]
    data: dict[str, TaskData]
    batches: dict[str, list[TokenBatch]]
    settings: dict
    inputs: dict = field(default_factory=dict)

    @property
    def tasks(self) -> list[str]:
        return list(self.task_vectors)

    @property
    def device(self) -> torch.device:
        return next(self.base.model.parameters()).device

    @property
    def max_samples(self) -> int:
        return max(len(d.texts) for d in self.data.values())

    def parameter_source(self) -> ParameterSource:
        return ParameterSource(self.base, self.task_vectors)

    def tokens(self, task: str) -> int:
        return int(sum(b.attention_mask.sum() for b in self.batches[task]))

    @classmethod
    def load(
        cls,
        model: str,
        finetuned: dict[str, str],
        data: dict[str, str],
        *,
        samples: int = 30,
        skip: int = 0,
        max_tokens: int = 512,
        batch_size: int = 8,
        dtype: str = "auto",
        device: str = "auto",
        revision: str | None = None,
        allow_pickle: bool = False,
        trust_remote_code: bool = False,
        vocab: str = "base",
        need_data_for_every_task: bool = True,
    ) -> "Experiment":
        if not data:
            raise DataInputError("no task data given (use --data NAME=PATH, one per fine-tune)")
        if need_data_for_every_task:
            missing = [t for t in finetuned if t not in data]
            if missing:
                raise DataInputError(
                    f"no --data for fine-tune(s) {missing}; each fine-tune needs its task's data "
                    f"(given: {sorted(data)})"
                )
        if samples < 1:
            raise DataInputError("--samples must be at least 1")
        task_data = {task: read_task_file(task, path, samples=samples, skip=skip) for task, path in data.items()}
        base = load_base_model(model, dtype=dtype, device=device, revision=revision, allow_pickle=allow_pickle,
                               trust_remote_code=trust_remote_code)
        task_vectors, report = open_finetunes(base.reader, finetuned, allow_pickle=allow_pickle, vocab=vocab)
        arch = find_architecture(base.model)
        batches = {task: tokenize(d, base.tokenizer, max_tokens=max_tokens, batch_size=batch_size)
                   for task, d in task_data.items()}
        dtype_used = str(next(base.model.parameters()).dtype).removeprefix("torch.")
        settings = {"samples": samples, "skip": skip, "max_tokens": max_tokens, "dtype": dtype_used,
                    "vocab": vocab, "tasks": list(finetuned)}
        inputs = {
            "base_model": base.reader.fingerprint() | {"spec": model, "architecture": type(base.model).__name__},
            "finetuned": {t: tv.finetuned.fingerprint() for t, tv in task_vectors.items()},
            "data": {t: d.provenance() for t, d in task_data.items()},
            "device": str(next(base.model.parameters()).device),
            "preflight": report,
            "trust_remote_code": trust_remote_code,
            "allow_pickle": allow_pickle,
        }
        return cls(base, arch, task_vectors, task_data, batches, settings, inputs)

    def root_attrs(self, command: str | None = None) -> dict:
        return run_attrs(command, self.inputs)[0]

    def group_attrs(self, command: str | None = None, **extra) -> dict:
        return {**run_attrs(command, self.inputs)[1], **extra}

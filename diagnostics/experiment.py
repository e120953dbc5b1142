"""Everything a data-driven diagnostic needs, loaded once: base, task vectors, task data.

`Experiment.load` is the "load" step of load → capture → metrics → store: the
base model is instantiated, fine-tunes are opened lazily and pre-flight checked,
task files are read (first `samples` records) and tokenised.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch

from submerge.diagnostics.base_model import BaseModel, load_base_model
from submerge.diagnostics.capture import GramsByLayer, ParameterSource
from submerge.diagnostics.data import (
    REPLAY_BATCH_OVERHEAD_TOKENS,
    TaskData,
    TokenBatch,
    by_length,
    folds_of,
    read_task_file,
    regrouped_rule,
    tokenize,
)
from submerge.diagnostics.errors import DataInputError, ModelInputError
from submerge.diagnostics.modules import Architecture, find_architecture
from submerge.diagnostics.placement import execution_device, offloads, pick_device
from submerge.diagnostics.provenance import run_attrs
from submerge.diagnostics.task_vectors import TaskVectorReader, open_finetunes

COMPUTE_DTYPES = {"float32": torch.float32, "float64": torch.float64}
HALF_COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
"""On request only, for the data-driven diagnostics: the base is stored in that dtype and everything computes in
it, as a half-precision GPU run does (to reproduce published numbers; `HalfPrecisionWarning`)."""


class HalfPrecisionWarning(UserWarning):
    """Half-precision compute measures rounding when the fine-tuning updates are small."""


def pick_compute_dtype(dtype: str | torch.dtype, *, half: bool = False) -> torch.dtype:
    """`--compute-dtype`: float32 or float64 (replays never compute below float32); with `half`, also bfloat16 or
    float16 (`HALF_COMPUTE_DTYPES`: the data-driven diagnostics, on request)."""
    known = {**COMPUTE_DTYPES, **(HALF_COMPUTE_DTYPES if half else {})}
    if isinstance(dtype, torch.dtype) and dtype in known.values():
        return dtype
    if dtype in known:
        return known[dtype]
    raise ModelInputError(f"--compute-dtype must be one of {', '.join(known)}, got '{dtype}'")


def is_half(dtype: torch.dtype) -> bool:
    return dtype in HALF_COMPUTE_DTYPES.values()


def half_precision_storage(dtype: str, compute: torch.dtype) -> str:
    """The storage dtype of a half-precision compute run: the compute dtype itself (``--dtype auto`` or the same);
    a wider storage dtype would be promoted back to it, so it is refused."""
    name = str(compute).removeprefix("torch.")
    if dtype not in ("auto", name):
        raise ModelInputError(f"--compute-dtype {name} computes in the storage dtype: leave --dtype auto or give "
                              f"--dtype {name} (got --dtype {dtype})")
    warnings.warn(f"--compute-dtype {name}: replays and forwards run in {name}, as a half-precision GPU run does. "
                  "When fine-tuning updates are small relative to the weights (a few steps, LoRA), the scores then "
                  "measure rounding rather than the fine-tune: compare each score with its noise floor "
                  "(nonlinearity_floor, projection_distance_floor; flagged in `diag report`).",
                  HalfPrecisionWarning, stacklevel=3)
    return name


def check_device(device: str) -> None:
    """Fail clearly when `--device` names a device this machine does not have (before any model is loaded)."""
    try:
        kind = torch.device(device).type if device != "auto" else "auto"
    except (RuntimeError, TypeError):
        raise ModelInputError(f"--device '{device}' is not a device torch knows (use auto, cpu, cuda or cuda:N)"
                              ) from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ModelInputError(f"--device {device}: CUDA is not available on this machine (torch {torch.__version__}, "
                              f"built with CUDA {torch.version.cuda}); use --device cpu or auto")
    if kind == "cuda" and ":" in device and int(device.split(":", 1)[1]) >= torch.cuda.device_count():
        raise ModelInputError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ModelInputError(f"--device {device}: MPS is not available on this machine; use --device cpu or auto")


@dataclass
class Experiment:
    base: BaseModel
    arch: Architecture
    task_vectors: dict[str, TaskVectorReader]
    data: dict[str, TaskData]
    batches: dict[str, list[TokenBatch]]
    settings: dict
    inputs: dict = field(default_factory=dict)
    compute_dtype: torch.dtype = torch.float32  # replays run in the storage dtype promoted to this

    @property
    def tasks(self) -> list[str]:
        return list(self.task_vectors)

    @property
    def device(self) -> torch.device:
        """Where capture and replays compute (the accelerator of an offloaded base, whose weights stay in host
        memory)."""
        return execution_device(self.base.model)

    @property
    def max_samples(self) -> int:
        return max(len(d.texts) for d in self.data.values())

    def parameter_source(self, compute_dtype: str | torch.dtype | None = None) -> ParameterSource:
        """Variants of this base and its task vectors, computed in `compute_dtype` (default: the experiment's).

        Half-precision compute needs a base stored in that dtype (`Experiment.load` with that `compute_dtype`)."""
        dtype = self.compute_dtype if compute_dtype is None else pick_compute_dtype(compute_dtype, half=True)
        storage = self.settings.get("dtype")
        if is_half(dtype) and storage != str(dtype).removeprefix("torch."):
            raise ModelInputError(f"compute dtype {dtype} needs the base stored in it; this experiment's base is "
                                  f"stored in {storage}: load it with compute_dtype='{str(dtype)[6:]}'")
        return ParameterSource(self.base, self.task_vectors, compute_dtype=dtype)

    def regrouped(self, overhead: int | None = None, *, folds: int | None = None) -> Experiment:
        """This experiment with each task's records regrouped by length (`data.by_length`: sorted, unpadded, cut
        into the batches with the least padded positions plus `overhead` a batch; default
        `data.REPLAY_BATCH_OVERHEAD_TOKENS`), for computations that are per record or sum over tokens; its settings
        say so (``batches``: `data.regrouped_rule`). With `folds`, each task's records are cut within each fold
        (`data.folds_of`: the i-th record read is in fold i mod `folds`), so that no batch holds two folds' records:
        what is scored on one fold replays only that fold's batches (the evidence step)."""
        overhead = REPLAY_BATCH_OVERHEAD_TOKENS if overhead is None else overhead
        rule = regrouped_rule(overhead, folds)
        if self.settings.get("batches") == rule:
            return self
        groups = {task: folds_of(self.data[task].indices, folds) if folds else None for task in self.batches}
        return dataclasses.replace(self, batches={task: by_length(batches, overhead=overhead, group_of=groups[task])
                                                  for task, batches in self.batches.items()},
                                   settings={**self.settings, "batches": rule})

    def input_grams(self, tasks=None) -> GramsByLayer:
        """RegMean's input Grams of every linear map inside the blocks on these records, per task of `tasks` (default
        all), computed block by block on the base as they are asked for (`GramsByLayer`, keyed by checkpoint name).
        A Gram sums over tokens, so the records are regrouped by length first (`regrouped`)."""
        chosen = self.tasks if tasks is None else list(tasks)
        batches = self.regrouped().batches
        return GramsByLayer(self.base.model, self.arch, {t: batches[t] for t in chosen},
                            checkpoint_names=self.base.checkpoint_names, device=self.device)

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
        compute_dtype: str = "float32",
        device: str = "auto",
        revision: str | None = None,
        allow_pickle: bool = False,
        trust_remote_code: bool = False,
        vocab: str = "base",
        need_data_for_every_task: bool = True,
        weights: bool = True,
        offload: bool = False,
    ) -> Experiment:
        """The base, its fine-tunes' task vectors and the tokenised data; ``weights=False`` leaves the base on the
        meta device (a Ray driver: its workers read their blocks themselves); ``offload=True`` keeps the base's
        weights in host memory and streams them to `device` stage by stage (`load_base_model`)."""
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
        compute = pick_compute_dtype(compute_dtype, half=True)
        if is_half(compute):
            dtype = half_precision_storage(dtype, compute)
        check_device(device)
        task_data = {task: read_task_file(task, path, samples=samples, skip=skip) for task, path in data.items()}
        base = load_base_model(model, dtype=dtype, device=device, revision=revision, allow_pickle=allow_pickle,
                               trust_remote_code=trust_remote_code, weights=weights, offload=offload)
        task_vectors, report = open_finetunes(base.reader, finetuned, allow_pickle=allow_pickle, vocab=vocab)
        arch = find_architecture(base.model)
        batches = {task: tokenize(d, base.tokenizer, max_tokens=max_tokens, batch_size=batch_size)
                   for task, d in task_data.items()}
        dtype_used = str(next(base.model.parameters()).dtype).removeprefix("torch.")
        settings = {"samples": samples, "skip": skip, "max_tokens": max_tokens, "dtype": dtype_used,
                    "compute_dtype": compute_dtype, "vocab": vocab, "tasks": list(finetuned)}
        inputs = {
            "base_model": base.reader.fingerprint() | {"spec": model, "architecture": type(base.model).__name__},
            "finetuned": {t: tv.finetuned.fingerprint() for t, tv in task_vectors.items()},
            "data": {t: d.provenance() for t, d in task_data.items()},
            "device": str(execution_device(base.model) if weights else pick_device(device)),
            "offload": offloads(offload, pick_device(device)),  # as load_base_model decided
            "preflight": report,
            "trust_remote_code": trust_remote_code,
            "allow_pickle": allow_pickle,
        }
        return cls(base, arch, task_vectors, task_data, batches, settings, inputs, compute)

    def root_attrs(self, command: str | None = None) -> dict:
        return run_attrs(command, self.inputs)[0]

    def group_attrs(self, command: str | None = None, **extra) -> dict:
        return {**run_attrs(command, self.inputs)[1], **extra}

"""Task vectors: τ_t = θ_t − θ0 of each fine-tune, read tensor by tensor against the base, and the pre-flight check.

A fine-tuned model is never loaded whole: `TaskVectorReader.get` gives τ_t for one tensor from two
`submerge.diagnostics.checkpoints.CheckpointReader`s (a LoRA adapter's as scale·B·A).

Vocabulary: a fine-tune whose embedding / output matrices have more rows than
the base's (added tokens) is handled by ``vocab="base"`` (the default): task
vectors use the base's rows only, the extra rows are ignored, and a warning plus
the store's attrs say which tensors and how many rows. ``vocab="error"`` refuses.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from submerge.diagnostics.checkpoints import (
    CheckpointReader,
    LoraReader,
    checkpoint_spec,
    open_checkpoint,
    reopen_checkpoint,
)
from submerge.diagnostics.errors import CheckpointMismatch, ModelInputError, NonFiniteWeights

VOCAB_POLICIES = ("base", "error")


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry is finite, in one reduction: a NaN or ±Inf entry makes the sum non-finite; only a sum
    that is not finite (an entry like that, or an overflow) is checked entry by entry."""
    if tensor.numel() == 0 or bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


@dataclass
class TaskVectorReader:
    """τ_t = θ_t − θ0 of one fine-tune, read tensor by tensor against the base."""

    name: str
    base: CheckpointReader
    finetuned: CheckpointReader
    vocab: str = "base"
    cropped: dict[str, tuple[int, int]] = field(default_factory=dict)

    def release(self) -> None:
        """Unmap the fine-tune's and the base's files: the pages read so far stop counting in the RSS (each file
        is reopened on its next read)."""
        self.finetuned.release()
        self.base.release()

    @property
    def subtracts_base(self) -> bool:
        """Whether τ is θ_t − θ0 of two checkpoints' tensors (a LoRA adapter's is scale·B·A: no base in it)."""
        return not isinstance(self.finetuned, LoraReader)

    def reads_rows(self, checkpoint_name: str) -> bool:
        """Whether `get_rows` reads only the rows asked for (a full fine-tune of the base's shape; not LoRA)."""
        return (self.subtracts_base and checkpoint_name in self.finetuned
                and self.finetuned.shape(checkpoint_name) == self.base.shape(checkpoint_name))

    def get_rows(self, checkpoint_name: str, rows: slice, dtype: torch.dtype = torch.float32,
                 device="cpu", base: torch.Tensor | None = None) -> torch.Tensor:
        """τ for rows `rows` (dim 0) of one tensor, in `dtype`, checked for NaN/Inf (see `reads_rows`); `base`:
        those rows of the base in float32, when the caller has them already (read once for T fine-tunes)."""
        if not self.reads_rows(checkpoint_name):
            return self.get(checkpoint_name, dtype, device)[rows]
        if base is None:
            base = self.base.get_rows(checkpoint_name, rows, torch.float32, device)
        delta = self.finetuned.get_rows(checkpoint_name, rows, torch.float32, device) - base
        self._check_finite(checkpoint_name, delta, f" in rows {rows.start}:{rows.stop}")
        return delta.to(dtype)

    def get(self, checkpoint_name: str, dtype: torch.dtype = torch.float32, device="cpu",
            base: torch.Tensor | None = None) -> torch.Tensor:
        """τ for one tensor, in `dtype` (float32 by default), checked for NaN/Inf. ``base``: the base's tensor as
        the caller holds it, read neither again nor from the base's file; the caller vouches that it is the
        stored tensor (`ParameterSource` checks that once per tensor). The difference is taken in float32 either
        way (a float16 or bfloat16 base is promoted exactly inside the kernel): τ is bitwise the same."""
        if isinstance(self.finetuned, LoraReader):
            delta = self.finetuned.task_vector(checkpoint_name, torch.float32, device)
        else:
            if checkpoint_name not in self.finetuned:
                raise CheckpointMismatch(
                    f"fine-tune '{self.name}' ({self.finetuned.path}) has no tensor '{checkpoint_name}'"
                )
            tuned = self.finetuned.get(checkpoint_name, torch.float32, device)
            base = self.base.get(checkpoint_name, torch.float32, device) if base is None else base.to(device)
            if tuned.shape != base.shape:
                tuned = self._fit_vocab(checkpoint_name, tuned, base)
            delta = tuned - base
        self._check_finite(checkpoint_name, delta)
        return delta.to(dtype)

    def is_zero_update(self, *, read: bool = False) -> bool:
        """Whether τ = 0: a LoRA adapter whose every B (or A) is zero, a checkpoint whose content hash is the
        base's, or (`read`: every tensor read) a checkpoint equal to the base tensor by tensor. Such a fine-tune
        has no Non-linearity Score and no normalised gain (0/0)."""
        if isinstance(self.finetuned, LoraReader):
            return self.finetuned.is_zero_update()
        digest = self.finetuned.fingerprint().get("content_sha256")
        if digest is not None and digest == self.base.fingerprint().get("content_sha256"):
            return True
        return read and all(not self.get(name).any() for name in self.base.names())

    def _check_finite(self, checkpoint_name: str, delta: torch.Tensor, where: str = "") -> None:
        if not all_finite(delta):
            bad = (~torch.isfinite(delta)).sum().item()
            raise NonFiniteWeights(
                f"fine-tune '{self.name}': tensor '{checkpoint_name}' in {self.finetuned.source_of(checkpoint_name)} "
                f"has {bad} NaN/Inf values{where}"
            )

    def _fit_vocab(self, name: str, tuned: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        if self.vocab == "base" and has_added_vocabulary(base.shape, tuned.shape):
            if name in self.cropped:
                return tuned[: base.shape[0]]
            self.cropped[name] = (base.shape[0], tuned.shape[0])
            warnings.warn(
                f"fine-tune '{self.name}': '{name}' has {tuned.shape[0]} rows, the base {base.shape[0]}; "
                f"using the base's {base.shape[0]} vocabulary rows (vocab policy 'base')",
                stacklevel=3,
            )
            return tuned[: base.shape[0]]
        raise CheckpointMismatch(
            f"fine-tune '{self.name}': tensor '{name}' has shape {tuple(tuned.shape)}, base has {tuple(base.shape)}"
        )


def has_added_vocabulary(base_shape, other_shape) -> bool:
    """Whether `other_shape` is `base_shape` with extra leading rows (a fine-tune's added tokens).

    The one test of the vocabulary policy 'base' (pre-flight, task vectors, evaluation load): such a
    tensor is cropped to the base's first rows.
    """
    base_shape, other_shape = tuple(base_shape), tuple(other_shape)
    return len(base_shape) >= 1 and other_shape[1:] == base_shape[1:] and other_shape[0] > base_shape[0]


def preflight(base: CheckpointReader, finetuned: dict[str, CheckpointReader], *, vocab: str = "base") -> dict:
    """Compare every fine-tune's tensor names and shapes with the base (headers only, no weights read).

    Raises one `CheckpointMismatch` listing every differing tensor of every fine-tune.
    Returns a report {task: {"vocab_rows": {...}}} of tolerated vocabulary differences.
    """
    if vocab not in VOCAB_POLICIES:
        raise ModelInputError(f"unknown vocab policy '{vocab}' (use one of {VOCAB_POLICIES})")
    problems: list[str] = []
    report: dict[str, dict] = {}
    base_names = set(base.names())
    for task, reader in finetuned.items():
        report[task] = {"vocab_rows": {}}
        if isinstance(reader, LoraReader):
            continue  # validated against the base when opened
        names = set(reader.names())
        for name in sorted(base_names - names):
            problems.append(f"  {task}: missing '{name}' (base shape {base.shape(name)})")
        for name in sorted(names - base_names):
            problems.append(f"  {task}: extra '{name}' {reader.shape(name)} not in the base")
        for name in sorted(base_names & names):
            mine, theirs = base.shape(name), reader.shape(name)
            if mine == theirs:
                continue
            if vocab == "base" and has_added_vocabulary(mine, theirs):
                report[task]["vocab_rows"][name] = [mine[0], theirs[0]]
                continue
            problems.append(f"  {task}: '{name}' has shape {theirs}, base {mine}")
    if problems:
        shown = problems[:40] + ([f"  ... and {len(problems) - 40} more"] if len(problems) > 40 else [])
        raise CheckpointMismatch(
            f"fine-tunes do not match the base {base.spec} ({base.path}):\n" + "\n".join(shown)
            + "\nAre they fine-tunes of this base, of the same architecture?"
        )
    for task, info in report.items():
        for name, (rows_base, rows_tuned) in info["vocab_rows"].items():
            warnings.warn(
                f"fine-tune '{task}': '{name}' has {rows_tuned} vocabulary rows, the base {rows_base}; "
                "task vectors use the base's rows (vocab policy 'base')",
                stacklevel=2,
            )
    return report


def open_finetunes(
    base: CheckpointReader, specs: dict[str, str], *, allow_pickle: bool = False, vocab: str = "base"
) -> tuple[dict[str, TaskVectorReader], dict]:
    """Open every fine-tune lazily, run the pre-flight check, return task-vector readers and its report."""
    if not specs:
        raise ModelInputError("no fine-tuned models given (use --finetuned NAME=PATH)")
    readers = {task: open_checkpoint(spec, base=base, allow_pickle=allow_pickle, role=f"fine-tune '{task}'")
               for task, spec in specs.items()}
    report = preflight(base, readers, vocab=vocab)
    return {task: TaskVectorReader(task, base, reader, vocab) for task, reader in readers.items()}, report


def task_vector_specs(task_readers: dict) -> dict:
    """{task: (checkpoint spec of the fine-tune, vocab)} of `TaskVectorReader`s, for `reopen_task_vectors`."""
    return {task: (checkpoint_spec(reader.finetuned), reader.vocab) for task, reader in task_readers.items()}


def reopen_task_vectors(base, specs: dict) -> dict:
    """The `TaskVectorReader`s of `task_vector_specs` against the base `CheckpointReader` ``base``."""
    return {task: TaskVectorReader(task, base, reopen_checkpoint(spec, base), vocab)
            for task, (spec, vocab) in specs.items()}

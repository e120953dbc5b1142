"""Noise floors: how much of a score rounding alone contributes at the run's compute dtype.

A score computed in float32 (or, on request, bfloat16 / float16) differs from the exact score of the same stored
weights, inputs and task vectors by its rounding error. Its estimate here is a second pass of the same driver over
the first `floor_samples` records of each task, computed in float64 (`REFERENCE`): the floor of a score is
|score − score₆₄| on those records (the Non-linearity Score: per sample, the largest over them; the Projection
Distance, whose mean is over samples: the same distance on those records in both dtypes). Float64's own rounding is
≈ 1e-16 relative, so the difference is the compute dtype's error to well below its size. A run in float64 stores
NaN floors (nothing to compare with).

A score within `FLAG_RATIO` × its floor is flagged in the summary tables and `diag report`: what it shows may be
rounding, not the fine-tune (the per-layer figures shade the floor band).

The pass reuses the driver (``store=None``, the run's engine) on a smaller `Experiment` (`first_records`). Its
replays scale with ``floor_samples / samples``, but building each point's θ0 + c·τ in float64 does not: measured
(`benchmarks/cost.py`, SmolLM2-135M full fine-tunes, 8 records per task) the default floor adds 37 % to `diag
linearity` (116 s against 85 s without it).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from submerge.diagnostics.data import TaskData, TokenBatch
from submerge.diagnostics.execution import RunSettings

REFERENCE = "float64"
FLOOR_SAMPLES = 1  # records per task of the float64 pass (--floor-samples; 0: no floor)
FLAG_RATIO = 10.0  # a score below FLAG_RATIO × its floor is flagged
FLOOR_NOTE = ("|score − score in float64| on the first floor_samples records of each task, same weights and inputs "
              "(the rounding of the compute dtype); NaN: not measured (float64 compute, floor_samples 0)")


def wants_floor(compute: torch.dtype, floor_samples: int) -> bool:
    """Whether a run in `compute` with `floor_samples` measures a floor (float64 runs have none to measure)."""
    if floor_samples < 0:
        raise ValueError(f"floor_samples must be >= 0, got {floor_samples}")
    return floor_samples > 0 and compute != torch.float64


def reference_run(run: RunSettings, compute: str = REFERENCE) -> RunSettings:
    """The floor pass's settings: the run's engine, threads and budget, in `compute`, writing nothing."""
    return dataclasses.replace(run, store=None, force=False, on_unit=None, compute_dtype=compute)


def _first_rows(batch: TokenBatch, count: int) -> TokenBatch:
    """The first `count` rows of a right-padded batch, trimmed to their longest real length."""
    mask = batch.attention_mask[:count]
    length = int(mask.sum(dim=1).max())
    return TokenBatch(batch.input_ids[:count, :length], mask[:, :length], list(batch.sample_index[:count]))


def first_records(experiment, count: int):
    """`experiment` restricted to the first `count` records of each task (its batches cut, nothing re-read)."""
    batches, data = {}, {}
    for task, task_batches in experiment.batches.items():
        kept, left = [], count
        for batch in task_batches:
            if left <= 0:
                break
            kept.append(_first_rows(batch, min(left, len(batch.sample_index))))
            left -= len(kept[-1].sample_index)
        batches[task] = kept
        source = experiment.data[task]
        data[task] = TaskData(source.task, source.path, source.texts[:count], source.indices[:count], source.sha256)
    return dataclasses.replace(experiment, batches=batches, data=data,
                               settings={**experiment.settings, "samples": min(count, experiment.max_samples)})


def floor_of(scores: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """|scores − reference| over the last axis (the floor samples), largest per entry; NaN where none is finite."""
    error = np.abs(np.asarray(scores, dtype=np.float64) - np.asarray(reference, dtype=np.float64))
    finite = np.isfinite(error)
    return np.where(finite.any(axis=-1), np.where(finite, error, -np.inf).max(axis=-1), np.nan)


def near_floor(score: float, floor: float) -> bool:
    """Whether `score` is within `FLAG_RATIO` × `floor` (False where the floor is not measured)."""
    return bool(np.isfinite(floor) and floor > 0 and abs(score) < FLAG_RATIO * floor)


def flagged(scores: np.ndarray, floors: np.ndarray) -> str:
    """"⚠ k/n": k of the n finite `scores` are within `FLAG_RATIO` × their `floors` (same shape) ("" when none)."""
    pairs = [(score, floor) for score, floor in zip(np.ravel(scores), np.ravel(floors)) if np.isfinite(score)]
    count = sum(near_floor(score, floor) for score, floor in pairs)
    return f"⚠ {count}/{len(pairs)}" if count else ""

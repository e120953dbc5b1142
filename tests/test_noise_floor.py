"""Noise floors (issue 24): what rounding at the compute dtype contributes to each score, against float64 truth;
half-precision compute on request."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from rich.console import Console

from submerge.diagnostics.errors import ModelInputError
from submerge.diagnostics.experiment import HalfPrecisionWarning
from submerge.diagnostics.linearity.floor import first_records, flagged, floor_of, near_floor
from submerge.diagnostics.linearity.nonlinearity import LINEARITY, nonlinearity
from submerge.diagnostics.store import Store
from submerge.diagnostics.tables import render_table

LEVELS = ("model", "layer", "attn", "mlp")
FLOOR_SAMPLES = 2


@pytest.fixture(scope="module")
def kit(toy_kit):
    return toy_kit("llama")


def experiment(kit, compute="float32", **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HalfPrecisionWarning)
        return kit.experiment(compute_dtype=compute, dtype="auto", **options)


@pytest.fixture(scope="module")
def truth(kit):
    """Every score computed in float64 (the same float32-stored weights and inputs): exact to ~1e-16."""
    return nonlinearity(experiment(kit, "float64"), levels=LEVELS, progress=False)


@pytest.fixture(scope="module")
def single(kit):
    return nonlinearity(experiment(kit), levels=LEVELS, floor_samples=FLOOR_SAMPLES, progress=False)


def test_floor_is_the_float64_difference_and_bounds_the_true_error(single, truth):
    scores, exact = single.nonlinearity_score.values, truth.nonlinearity_score.values
    error = np.abs(scores - exact)  # the true rounding error of every score
    floor = single.nonlinearity_floor.values
    # known answer: the floor is the largest error over the first FLOOR_SAMPLES records
    np.testing.assert_allclose(floor, error[:, :, :FLOOR_SAMPLES].max(axis=2), rtol=1e-6, atol=0)
    assert np.isfinite(floor).all() and (floor > 0).all()
    # it bounds the error of the records it did not see, within the flag's factor
    assert (error <= 10 * floor[:, :, None]).all(), np.max(error / floor[:, :, None])
    print("\nfloat32 floor / true error (median):", float(np.median(floor[:, :, None] / error)))


def test_bfloat16_floor_dwarfs_float32(kit, single, tmp_path):
    """Half precision on request: warned, stored, and its floor orders of magnitude above float32's."""
    with pytest.warns(HalfPrecisionWarning, match="measure rounding"):
        half = kit.experiment(compute_dtype="bfloat16", dtype="auto")
    assert next(half.base.model.parameters()).dtype == torch.bfloat16
    store = Store(tmp_path / "bf16.zarr")
    bf16 = nonlinearity(half, levels=LEVELS, floor_samples=FLOOR_SAMPLES, progress=False, store=store)
    assert store.dataset("linearity").attrs["settings"]["compute_dtype"] == "bfloat16"
    floor = bf16.nonlinearity_floor.values
    assert np.isfinite(floor).all()
    ratio = np.median(floor / single.nonlinearity_floor.values)
    print(f"\nbfloat16 / float32 floor (median over modules): {ratio:.3g}")
    assert ratio > 1e3


def test_half_precision_needs_half_storage(kit):
    with pytest.raises(ModelInputError, match="--compute-dtype bfloat16 computes in the storage dtype"):
        kit.experiment(compute_dtype="bfloat16", dtype="float32")
    with pytest.raises(ModelInputError, match="needs the base stored in it"):
        nonlinearity(experiment(kit), levels=("mlp",), compute_dtype="float16", progress=False)


def test_no_floor_in_float64_or_when_asked(kit, truth):
    assert np.isnan(truth.nonlinearity_floor.values).all()
    none = nonlinearity(experiment(kit), levels=("mlp",), floor_samples=0, progress=False)
    assert np.isnan(none.nonlinearity_floor.values).all() and np.isfinite(none.nonlinearity_score.values).all()


def test_first_records_cut_the_batches(kit):
    full = experiment(kit)
    cut = first_records(full, 3)
    assert [b.sample_index for b in cut.batches["math"]] == [[0, 1], [2]]
    assert cut.max_samples == 3 and cut.settings["samples"] == 3
    last = cut.batches["math"][-1]
    assert bool(last.attention_mask[:, -1].any())  # trimmed to its real length
    torch.testing.assert_close(last.input_ids, full.batches["math"][1].input_ids[:1, :last.input_ids.shape[1]])


def test_floor_and_flag_known_answers():
    scores = np.array([[1.0, 2.0, np.nan], [5.0, 7.0, 1.0]])
    reference = np.array([[1.5, 1.0, np.nan], [5.0, 7.5, 1.0]])
    np.testing.assert_array_equal(floor_of(scores, reference), [1.0, 0.5])
    assert floor_of(np.array([[np.nan]]), np.array([[1.0]]))[0] != floor_of(np.array([[np.nan]]), np.array([[1.0]]))[0]
    assert near_floor(0.9, 0.1) and not near_floor(1.0, 0.1) and not near_floor(1e-9, np.nan)
    assert flagged(np.array([0.5, 20.0, np.nan]), np.array([0.1, 1.0, 1.0])) == "⚠ 1/2"
    assert flagged(np.array([20.0]), np.array([1.0])) == ""


def test_summary_shows_floor_and_flags(single):
    table = LINEARITY.summary(single)
    assert list(table.columns.get_level_values(1)[:4]) == ["mean", "std", "floor", "flag"]
    for level in table.index:
        chosen = single.level.values == level
        assert table.loc[level, ("math", "floor")] == pytest.approx(
            single.nonlinearity_floor.sel(task="math").values[chosen].mean())
    # a score pushed under 10× its floor is flagged in the table and its rendering
    low = single.copy(deep=True)
    low["nonlinearity_floor"] = low.nonlinearity_score.max("sample")
    table = LINEARITY.summary(low)
    assert table.loc["mlp", ("math", "flag")] == f"⚠ {int((low.level.values == 'mlp').sum())}/" \
        f"{int((low.level.values == 'mlp').sum())}"
    console = Console(record=True, width=200)
    console.print(render_table(table, "T"))
    text = " ".join(console.export_text().split())
    assert "(floor " in text and "⚠" in text and "within 10× of their noise floor" in text

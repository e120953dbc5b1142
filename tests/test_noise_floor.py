"""Noise floors (issue 24): what rounding at the compute dtype contributes to each score, against float64 truth;
half-precision compute on request."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch
from rich.console import Console

from submerge.diagnostics.errors import ModelInputError
from submerge.diagnostics.execution import LocalEngine
from submerge.diagnostics.experiment import HalfPrecisionWarning
from submerge.diagnostics.linearity.floor import first_records, flagged, floor_of, near_floor
from submerge.diagnostics.linearity.nonlinearity import LINEARITY, nonlinearity
from submerge.diagnostics.linearity.projection import PROJECTION, projection
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


@pytest.fixture(scope="module")
def pair(kit, tmp_path_factory):
    """The kit's base with two fine-tunes (math, and code trained from another seed) on their own data."""
    from submerge.diagnostics import toy
    from submerge.diagnostics.experiment import Experiment

    root = tmp_path_factory.mktemp("noise_pair")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = toy.finetune(kit.base_dir, root / "code", "code", steps=3, seed=1)
    data = {"math": str(kit.data_path), "code": str(toy.write_task_data(root / "code.jsonl", "code", count=4))}

    def load(compute):
        return Experiment.load(str(kit.base_dir), {"math": str(kit.finetuned_dir), "code": str(code)}, data,
                               samples=3, max_tokens=32, batch_size=2, dtype="float32", compute_dtype=compute,
                               device="cpu")
    return load


def test_projection_floor_against_float64(pair, tmp_path):
    options = {"levels": ("mlp",), "alphas": (0.5, 1.0), "progress": False}
    exact = projection(pair("float64"), **options)
    assert np.isnan(exact.projection_distance_floor.values).all()
    store = Store(tmp_path / "pd.zarr")
    single = projection(pair("float32"), floor_samples=1, store=store, **options)
    floor = single.projection_distance_floor.values
    # known answer: |PD − PD₆₄| of the first record of each task, computed by the same driver on those records
    first = [projection(first_records(pair(dtype), 1), floor_samples=0, **options).projection_distance.values
             for dtype in ("float32", "float64")]
    differences = np.abs(first[0] - first[1])
    subsets = np.array([str(s) for s in single.combo_subset.values])
    for subset in set(subsets):  # the largest over the subset's α grid
        chosen = subsets == subset
        np.testing.assert_array_equal(floor[:, chosen], differences[:, chosen].max(axis=1, keepdims=True)
                                      .repeat(chosen.sum(), axis=1))
    assert np.isfinite(floor).all() and (floor > 0).all() and (floor < 1e-4).all()
    error = np.abs(single.projection_distance.values - exact.projection_distance.values)
    assert (error <= 10 * floor).all(), np.max(error / floor)
    table = PROJECTION.summary(store.dataset("projection"))
    assert table.loc["mlp", "PD floor"] == pytest.approx(floor[single.level.values == "mlp"].mean())
    assert set(table["near floor"]) <= {""} or all(str(v).startswith("⚠") for v in table["near floor"] if v)


def test_report_flags_and_figures_shade(kit, tmp_path, monkeypatch):
    from submerge.cli.report import report
    from submerge.diagnostics.linearity import floor as floors
    from submerge.diagnostics.linearity.nonlinearity import nonlinearity_per_layer

    store = Store(tmp_path / "run.zarr")
    dataset = nonlinearity(experiment(kit), levels=LEVELS, floor_samples=1, progress=False, store=store)
    console = Console(record=True, width=220)
    written = report(store.path, tmp_path / "report", console=console)
    assert any(p.name == "nonlinearity_per_layer.png" for p in written)
    text = " ".join(console.export_text().split())
    assert "(floor " in text and "⚠" not in text  # float32 scores of a 3-step fine-tune stand far above rounding
    monkeypatch.setattr(floors, "FLAG_RATIO", 1e12)  # every score "near" its floor: flagged
    console = Console(record=True, width=220)
    report(store.path, tmp_path / "report", console=console)
    text = " ".join(console.export_text().split())
    assert "⚠ 3/3" in text and "within 10× of their noise floor" in text

    def bands(data):
        fig = nonlinearity_per_layer(data)
        count = sum(len(ax.collections) for ax in fig.axes)
        import matplotlib.pyplot as plt

        plt.close(fig)
        return count

    unmeasured = dataset.copy(deep=True)
    unmeasured["nonlinearity_floor"] = unmeasured.nonlinearity_floor * np.nan
    assert bands(dataset) == bands(unmeasured) + 3  # one floor band per panel (layer, attn, mlp), one task


def test_cli_half_precision_warns_and_records(kit, tmp_path):
    from typer.testing import CliRunner

    from submerge.cli.main import app

    out = tmp_path / "half.zarr"
    arguments = ["linearity", "--model", kit.base_dir, "--finetuned", f"math={kit.finetuned_dir}",
                 "--data", f"math={kit.data_path}", "--out", out, "--samples", "2", "--steps", "2",
                 "--levels", "mlp", "--max-tokens", "24", "--device", "cpu", "--no-progress",
                 "--compute-dtype", "bfloat16", "--floor-samples", "1"]
    with pytest.warns(HalfPrecisionWarning, match="measure rounding"):
        result = CliRunner().invoke(app, [str(a) for a in arguments], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "(floor " in result.output
    dataset = Store(out).dataset("linearity")
    assert dataset.attrs["settings"]["compute_dtype"] == "bfloat16" and dataset.attrs["settings"]["dtype"] == "bfloat16"
    assert dataset.attrs["settings"]["floor_samples"] == 1 and np.isfinite(dataset.nonlinearity_floor.values).all()
    result = CliRunner().invoke(app, ["eval", "--compute-dtype", "bfloat16", "--model", str(kit.base_dir),
                                      "--finetuned", f"math={kit.finetuned_dir}", "--data", f"math={kit.data_path}",
                                      "--out", str(tmp_path / "eval.zarr")], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "--compute-dtype must be one of float32, float64" in " ".join(result.output.split())


class _NestingEngine(LocalEngine):
    """A LocalEngine that counts its outermost `running()` blocks: on Ray each one starts (and stops) a local Ray
    instance (`RayEngine.running` starts one only when this process is not connected yet)."""

    depth, outermost = 0, 0

    @contextlib.contextmanager
    def running(self):
        self.outermost += self.depth == 0
        self.depth += 1
        try:
            with super().running():
                yield self
        finally:
            self.depth -= 1


@pytest.mark.parametrize("driver", ["linearity", "projection"])
def test_the_floor_pass_and_the_sweep_share_one_running_engine(kit, pair, driver):
    """The float64 floor pass (two passes for projection) and the sweep run inside one outer `engine.running()`:
    on Ray, one local instance for the command, not one per pass (~10 s each)."""
    engine = _NestingEngine(threads=1)
    if driver == "linearity":
        result = nonlinearity(experiment(kit), levels=("mlp",), floor_samples=1, progress=False, engine=engine)
        assert np.isfinite(result.nonlinearity_floor.values).all()
    else:
        result = projection(pair("float32"), levels=("mlp",), alphas=(1.0,), floor_samples=1, progress=False,
                            engine=engine)
        assert np.isfinite(result.projection_distance_floor.values).all()
    assert engine.outermost == 1 and engine.depth == 0

"""`diag report`: figures and summary tables from a real (toy) store; missing groups are skipped."""

from __future__ import annotations

import importlib.util
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import zarr

from submerge.diagnostics import plot
from submerge.diagnostics.store import Store

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
ALL_FIGURES = {
    "nonlinearity_per_layer", "nonlinearity_by_level", "projection_distance_pairs", "projection_distance_multi",
    "projection_distance_per_layer", "alpha_layer", "alpha_attn-mlp", "alpha_objective", "interference_per_layer",
    "interference_rank", "eval",
}


def example_store(tmp_path_factory) -> Path:
    """The notebooks' example store at tiny settings, built once per session (shared with test_notebooks)."""
    spec = importlib.util.spec_from_file_location("make_example_store", NOTEBOOKS / "make_example_store.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tiny_example_store(tmp_path_factory.getbasetemp() / "example_store")


@pytest.fixture(scope="session")
def store_path(tmp_path_factory) -> Path:
    return example_store(tmp_path_factory)


def _without(store_path: Path, target: Path, groups: list[str]) -> Path:
    shutil.copytree(store_path, target)
    for group in groups:
        shutil.rmtree(target / group)
    return target


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", header[16:24])


def test_report_writes_every_figure(store_path, tmp_path):
    from rich.console import Console

    console = Console(record=True, width=160)
    written = plot.report(store_path, tmp_path / "figures", console=console)
    assert {p.stem for p in written} == ALL_FIGURES
    for path in written:
        assert path.parent == tmp_path / "figures" and path.suffix == ".png"
        width, height = _png_size(path)
        assert 300 < width < 4000 and 200 < height < 5000, (path.name, width, height)
    text = console.export_text()  # the summary tables, then one line per figure
    assert "±" in text and "Non-linearity Score" in text and "Projection Distance" in text
    assert all(f"wrote {path}" in text for path in written)


def test_report_skips_missing_groups(store_path, tmp_path):
    core = _without(store_path, tmp_path / "core.zarr", ["interference", "eval"])
    written = {p.stem for p in plot.report(core, tmp_path / "core")}
    assert written == ALL_FIGURES - {"interference_per_layer", "interference_rank", "eval"}

    only_linearity = _without(store_path, tmp_path / "lin.zarr", ["interference", "eval", "projection", "alpha"])
    assert {p.stem for p in plot.report(only_linearity, tmp_path / "lin")} == {
        "nonlinearity_per_layer", "nonlinearity_by_level"}

    empty = tmp_path / "empty.zarr"
    zarr.open_group(str(empty), mode="w", zarr_format=3)
    assert plot.report(empty, tmp_path / "empty") == []
    assert plot.summary_tables(empty) == {}


def test_default_out_dir_next_to_store(store_path, tmp_path):
    copy = _without(store_path, tmp_path / "run.zarr", ["interference", "eval", "projection", "alpha"])
    written = plot.report(copy)
    assert written and all(p.parent == tmp_path / "run-report" for p in written)


def test_projection_multi_absent_for_pairs_only(store_path):
    projection = Store(store_path).dataset("projection")
    pairs = projection.isel(combo=[i for i, s in enumerate(projection.combo_subset.values) if str(s).count("+") == 1])
    assert plot.projection_multi(pairs) is None


def test_summary_tables_match_the_store(store_path):
    tables = plot.summary_tables(store_path)
    assert set(tables) == {"nonlinearity", "projection", "alpha", "interference", "eval loss", "eval perplexity"}
    store = Store(store_path)

    linearity = store.dataset("linearity")
    table = tables["nonlinearity"]
    assert list(table.index) == ["model", "layer", "attn", "mlp", "head"]
    for level in table.index:
        for task in linearity.task.values:
            values = linearity.nonlinearity_score.sel(task=task).values[linearity.level.values == level].ravel()
            values = values[~np.isnan(values)]
            assert table.loc[level, (str(task), "mean")] == pytest.approx(values.mean())
            assert table.loc[level, (str(task), "std")] == pytest.approx(values.std())

    projection = store.dataset("projection")
    for level in tables["projection"].index:
        values = projection.projection_distance.values[projection.level.values == level]
        assert tables["projection"].loc[level, "PD mean"] == pytest.approx(np.nanmean(values))

    alpha = store.dataset("alpha/attn-mlp")
    row = tables["alpha"].loc["attn-mlp"]
    assert row["modules"] == alpha.sizes["module"] == 4
    assert row["objective α"] == pytest.approx(float(alpha.objective_alpha.sum()))
    assert row["α math (mean)"] == pytest.approx(float(alpha.alpha.sel(task="math").mean()))

    interference = store.dataset("interference")
    attn = interference.level.values == "attn"
    assert tables["interference"].loc["attn", "matrices"] == attn.sum()
    assert tables["interference"].loc["attn", "SAR"] == pytest.approx(interference.sar.values[attn].mean())

    evaluation = store.dataset("eval")
    assert tables["eval loss"].loc["base", "math"] == pytest.approx(float(evaluation.loss.sel(model="base", task="math")))
    np.testing.assert_allclose(tables["eval perplexity"].to_numpy(), np.exp(tables["eval loss"].to_numpy()))


def test_describe_titles():
    assert plot.describe({"base_model": {"spec": "/models/llama-2-7b"}}) == "base: llama-2-7b"
    assert plot.describe({"base_model": {"spec": "meta-llama/Llama-2-7b-hf"}}) == "base: meta-llama/Llama-2-7b-hf"
    import xarray as xr

    data = xr.Dataset(coords={"task": ["math", "code"]})
    assert plot.describe({"base_model": {"spec": "gpt2"}}, data) == "base: gpt2 · fine-tunes: math, code"


def test_diag_report_offers_to_consolidate_an_older_store(store_path, tmp_path):
    import warnings

    import xarray as xr
    from typer.testing import CliRunner

    from submerge.cli.main import app

    old = tmp_path / "old.zarr"
    shutil.copytree(store_path, old)
    Store(old)._drop_consolidated()  # as every store written before consolidation
    runner, wide = CliRunner(), {"COLUMNS": "400"}
    result = runner.invoke(app, ["report", str(old), "--out", str(tmp_path / "figures")], env=wide)
    assert result.exit_code == 0, result.output
    hints = [line for line in result.output.splitlines() if "--consolidate" in line]
    assert len(hints) == 1 and "no consolidated metadata" in hints[0], result.output
    assert Store(old).consolidation() == "absent"  # nothing written without the option

    result = runner.invoke(app, ["report", str(old), "--consolidate", "--out", str(tmp_path / "figures2")], env=wide)
    assert result.exit_code == 0, result.output
    assert f"Consolidated the metadata of {old}" in result.output and "no consolidated metadata" not in result.output
    assert Store(old).consolidation() == "current"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tree = xr.open_datatree(str(old), engine="zarr")
    xr.testing.assert_identical(tree, xr.open_datatree(str(old), engine="zarr", consolidated=False))
    result = runner.invoke(app, ["report", str(old), "--out", str(tmp_path / "figures3")], env=wide)
    assert "--consolidate" not in result.output

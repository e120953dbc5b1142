"""`diag report`: figures and summary tables from a real (toy) store; missing groups are skipped; each group's
owner gives its layout, its one summary table (the command's and the report's) and its figures."""

from __future__ import annotations

import importlib.util
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
from rich.console import Console

from submerge.cli import report as reports
from submerge.diagnostics import plot, toy
from submerge.diagnostics.errors import StoreError
from submerge.diagnostics.linearity.alpha import alpha_objective
from submerge.diagnostics.linearity.projection import projection_multi
from submerge.diagnostics.store import Store
from submerge.diagnostics.tables import render_table

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
ALL_FIGURES = {
    "nonlinearity_per_layer", "nonlinearity_by_level", "projection_distance_pairs", "projection_distance_multi",
    "projection_distance_per_layer", "alpha_layer", "alpha_attn-mlp", "alpha_objective_layer",
    "alpha_objective_attn-mlp", "interference_per_layer", "interference_rank", "eval",
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
    console = Console(record=True, width=160)
    written = reports.report(store_path, tmp_path / "figures", console=console)
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
    written = {p.stem for p in reports.report(core, tmp_path / "core")}
    assert written == ALL_FIGURES - {"interference_per_layer", "interference_rank", "eval"}
    without_attn_mlp = _without(store_path, tmp_path / "layer.zarr", ["alpha/attn-mlp"])
    assert {p.stem for p in reports.report(without_attn_mlp, tmp_path / "layer")} == ALL_FIGURES - {
        "alpha_attn-mlp", "alpha_objective_attn-mlp"}

    only_linearity = _without(store_path, tmp_path / "lin.zarr", ["interference", "eval", "projection", "alpha"])
    assert {p.stem for p in reports.report(only_linearity, tmp_path / "lin")} == {
        "nonlinearity_per_layer", "nonlinearity_by_level"}

    empty = tmp_path / "empty.zarr"
    zarr.open_group(str(empty), mode="w", zarr_format=3)
    assert reports.report(empty, tmp_path / "empty") == []
    assert reports.summary_tables(empty) == {}


def test_default_out_dir_next_to_store(store_path, tmp_path):
    copy = _without(store_path, tmp_path / "run.zarr", ["interference", "eval", "projection", "alpha"])
    written = reports.report(copy)
    assert written and all(p.parent == tmp_path / "run-report" for p in written)


def test_projection_multi_absent_for_pairs_only(store_path):
    projection = Store(store_path).dataset("projection")
    pairs = projection.isel(combo=[i for i, s in enumerate(projection.combo_subset.values) if str(s).count("+") == 1])
    assert projection_multi(pairs) is None


def test_summary_tables_match_the_store(store_path):
    tables = reports.summary_tables(store_path)
    assert list(tables) == ["linearity", "projection", "alpha/layer", "alpha/attn-mlp", "interference", "eval"]
    store = Store(store_path)

    linearity = store.dataset("linearity")
    table = tables["linearity"]
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
        assert tables["projection"].loc[level, "PD std"] == pytest.approx(np.nanstd(values))

    alpha = store.dataset("alpha/attn-mlp")
    assert list(tables["alpha/attn-mlp"].index) == ["attn", "mlp"]
    attn = tables["alpha/attn-mlp"].loc["attn"]
    chosen = alpha.level.values == "attn"
    assert attn["modules"] == chosen.sum() == 2
    assert attn["objective α"] == pytest.approx(float(alpha.objective_alpha.values[0, chosen].sum()))
    assert attn["α math (mean)"] == pytest.approx(float(alpha.alpha.sel(task="math").values[0, chosen].mean()))
    assert list(tables["alpha/layer"].index) == ["layer"] and tables["alpha/layer"].loc["layer", "modules"] == 2

    interference = store.dataset("interference")
    attn = interference.level.values == "attn"
    assert list(tables["interference"].index[:2]) == ["attn", "mlp"]
    assert tables["interference"].loc["attn", "matrices"] == attn.sum()
    assert tables["interference"].loc["attn", "SAR"] == pytest.approx(interference.sar.values[attn].mean())
    assert tables["interference"].loc["attn", "STI/Σσ"] == pytest.approx(
        interference.sti_normalized.values[attn].mean())

    evaluation = store.dataset("eval")
    assert tables["eval"].loc["base", "loss math"] == pytest.approx(
        float(evaluation.loss.sel(model="base", task="math")))
    np.testing.assert_allclose(tables["eval"].filter(like="perplexity").to_numpy(),
                               np.exp(tables["eval"].filter(like="loss").to_numpy()))


def test_every_group_of_the_store_has_its_owners_layout(store_path):
    """The layout an owner declares is the one its driver writes; a group that differs is named, not half-drawn."""
    _, groups = reports.load_groups(store_path)
    for path, dataset in groups.items():
        owner = reports.owner_of(path)
        assert owner is not None, path
        owner.check(dataset)
        along_units = {name for name, variable in dataset.data_vars.items() if owner.dim in variable.dims}
        assert along_units == set(owner.variables), path  # every variable the driver writes unit by unit
    assert reports.owner_of("alpha") is None and reports.owner_of("alpha/layer").name == "alpha"
    assert reports.owner_of("linearity/extra") is None and reports.owner_of("evidence/layer") is None
    linearity = groups["linearity"]
    with pytest.raises(StoreError, match="group 'linearity' has no variable 'unchanged'"):
        reports.owner_of("linearity").check(linearity.drop_vars("unchanged"))
    with pytest.raises(StoreError, match="variable 'nonlinearity_score' is over"):
        reports.owner_of("linearity").check(linearity.transpose("module", "task", "sample"))


def test_render_table_known_answer():
    """mean/std column pairs become "mean ± std", NaN "—", row index levels their own columns, 4 digits."""
    frame = pd.DataFrame([[1.0, 0.5, 2.0], [np.nan, np.nan, 3.25]], index=pd.Index(["attn", "mlp"], name="level"),
                         columns=pd.MultiIndex.from_tuples([("math", "mean"), ("math", "std"), ("code", "mean")]))
    frame[("code", "std")] = [0.125, np.nan]
    console = Console(record=True, width=120)
    console.print(render_table(frame, "T"))
    lines = [" ".join(line.replace("│", " ").replace("┃", " ").split()) for line in console.export_text().splitlines()]
    assert "level math code" in lines and "attn 1 ± 0.5 2 ± 0.12" in lines and "mlp — 3.25" in lines
    grouped = pd.DataFrame({"matrices": [2, 1], "SAR": [0.123456, np.nan]},
                           index=pd.MultiIndex.from_tuples([("attn", 0), ("mlp", 1)], names=["level", "layer"]))
    console = Console(record=True, width=120)
    console.print(render_table(grouped, "T"))
    lines = [" ".join(line.replace("│", " ").replace("┃", " ").split()) for line in console.export_text().splitlines()]
    assert "level layer matrices SAR" in lines and "attn 0 2 0.1235" in lines and "mlp 1 1 —" in lines


def test_alpha_and_eval_tables_known_answer():
    """By hand: a head-mlp group of two heads and one MLP, two tasks; heads have no objective (NaN, not 0)."""
    from submerge.diagnostics.evaluate import EVAL
    from submerge.diagnostics.linearity import ALPHA

    per_module = ("granularity", "module")
    dataset = xr.Dataset(
        {"alpha": (("granularity", "module", "task"), np.array([[[0.2, 0.8], [0.4, 0.6], [1.0, 0.0]]])),
         "condition_number": (per_module, np.array([[3.0, 7.0, 2.0]])),
         "least_squares": (per_module, np.array([[False, True, False]])),
         "objective_alpha": (per_module, np.array([[np.nan, np.nan, 0.5]])),
         "objective_uniform": (per_module, np.array([[np.nan, np.nan, 0.75]])),
         "linearized_objective_alpha": (per_module, np.zeros((1, 3))),
         "linearized_objective_uniform": (per_module, np.zeros((1, 3)))},
        coords={"granularity": ["head-mlp"], "task": ["math", "code"],
                "module": ["layers.0.attn.head.0", "layers.0.attn.head.1", "layers.0.mlp"],
                "level": ("module", ["head", "head", "mlp"]), "layer": ("module", [0, 0, 0]),
                "head": ("module", [0, 1, -1])})
    ALPHA.check(dataset)
    table = ALPHA.summary(dataset)
    assert list(table.index) == ["mlp", "head"]
    assert table.loc["head", "modules"] == 2 and table.loc["head", "α math (mean)"] == pytest.approx(0.3)
    assert table.loc["head", "α code (mean)"] == pytest.approx(0.7)
    assert np.isnan(table.loc["head", "objective α"]) and np.isnan(table.loc["head", "objective 1/T"])
    assert table.loc["head", "least squares"] == 1 and table.loc["head", "max condition"] == 7.0
    assert table.loc["mlp", "objective α"] == 0.5 and table.loc["mlp", "objective 1/T"] == 0.75
    assert "granularity head-mlp" in ALPHA.table_title(dataset)

    loss = np.array([[2.0, 3.0], [1.0, 2.5]])
    evaluation = xr.Dataset({"loss": (("model", "task"), loss), "perplexity": (("model", "task"), np.exp(loss)),
                             "tokens": (("model", "task"), np.full((2, 2), 10))},
                            coords={"model": ["base", "math"], "task": ["math", "code"]})
    table = EVAL.summary(evaluation)
    assert list(table.columns) == ["loss math", "loss code", "perplexity math", "perplexity code"]
    assert table.loc["math", "loss code"] == 2.5 and table.loc["base", "perplexity math"] == pytest.approx(np.exp(2))


def test_alpha_objective_draws_one_or_several_granularities(store_path):
    alphas = {g: Store(store_path).dataset(f"alpha/{g}") for g in ("attn-mlp", "layer")}
    assert len(alpha_objective(alphas).axes) == 2 and [ax.get_title() for ax in alpha_objective(alphas).axes] == [
        "layer", "attn-mlp"]
    assert [ax.get_title() for ax in alpha_objective(alphas["layer"]).axes] == ["layer"]


def test_the_command_line_starts_without_matplotlib():
    """`diag --help` and the commands that draw nothing do not import matplotlib or seaborn."""
    code = "import sys, submerge.cli.main; print(sorted({'matplotlib', 'seaborn'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_describe_titles():
    assert plot.describe({"base_model": {"spec": "/models/llama-2-7b"}}) == "base: llama-2-7b"
    assert plot.describe({"base_model": {"spec": "meta-llama/Llama-2-7b-hf"}}) == "base: meta-llama/Llama-2-7b-hf"
    data = xr.Dataset(coords={"task": ["math", "code"]})
    assert plot.describe({"base_model": {"spec": "gpt2"}}, data) == "base: gpt2 · fine-tunes: math, code"


# ------------------------------------------------------------------ the command's table is the report's


@pytest.fixture(scope="module")
def two_tasks(llama_kit, tmp_path_factory):
    """The llama kit's base with two fine-tunes (math, code) and their task data."""
    root = tmp_path_factory.mktemp("two_tasks")
    finetuned = {"math": llama_kit.finetuned_dir,
                 "code": toy.finetune(llama_kit.base_dir, root / "code", "code", steps=3, seed=1)}
    data = {"math": llama_kit.data_path, "code": toy.write_task_data(root / "code.jsonl", "code", count=8)}
    return llama_kit.base_dir, finetuned, data


def _table_of(output: str) -> str:
    """The summary table a command printed: everything before its "Wrote group" line."""
    table = output.split("Wrote group")[0].strip("\n")
    assert table.count("\n") >= 4, output  # a title, a header and at least one row
    return table


def test_each_command_prints_the_table_the_report_prints(two_tasks, tmp_path):
    """One function, one set of column names: `diag linearity`, `projection`, `alpha`, `interference` and `eval`
    print their group's table, and `diag report` on the store prints each of them again, identically (`diag
    compare`'s: tests/test_compare.py)."""
    from typer.testing import CliRunner

    from submerge.cli.main import app

    base, finetuned, data = two_tasks
    store = tmp_path / "store.zarr"
    models = ["--model", base, *[f"--finetuned={t}={p}" for t, p in finetuned.items()]]
    records = [*[f"--data={t}={p}" for t, p in data.items()], "--max-tokens", 24]
    run = ["--out", store, "--device", "cpu", "--no-progress"]
    commands = {
        "linearity": ["linearity", *models, *records, *run, "--samples", 2, "--steps", 2, "--levels", "layer,attn"],
        "projection": ["projection", *models, *records, *run, "--samples", 2, "--levels", "layer", "--alpha", "0.5"],
        "alpha/attn-mlp": ["alpha", *models, *records, *run, "--samples", 2, "--granularity", "attn-mlp"],
        "interference": ["interference", *models, *run, "--rank-fracs", "0.25,1"],
        "eval": ["eval", *models, *records, *run, "--skip", 2, "--samples", 2],
    }
    runner, printed = CliRunner(), {}
    for group, arguments in commands.items():
        result = runner.invoke(app, [str(a) for a in arguments], env={"COLUMNS": "300"})
        assert result.exit_code == 0, result.output
        printed[group] = _table_of(result.stdout)
        assert reports.owner_of(group).table_title(Store(store).dataset(group)) in printed[group]
    report = runner.invoke(app, ["report", str(store), "--out", str(tmp_path / "figures")], env={"COLUMNS": "300"})
    assert report.exit_code == 0, report.output
    for group, table in printed.items():
        assert table in report.stdout, (group, table, report.stdout)
    # and the tables of the Python API are the ones printed
    tables = reports.summary_tables(store)
    assert list(tables) == list(commands)
    assert "STI/Σσ" in tables["interference"].columns and "STI/Σσ" in printed["interference"]


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

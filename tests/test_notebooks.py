"""The three notebooks run top to bottom on the example store (and 02 stops gracefully without interference)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from submerge.diagnostics.store import Store

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["01_linearity", "02_interference", "03_choose_granularity_and_merge"]

nbformat = pytest.importorskip("nbformat")  # the dev extra; a machine without it skips, as without nbclient
nbclient = pytest.importorskip("nbclient")


@pytest.fixture(scope="session")
def store_path(tmp_path_factory) -> Path:
    """The example store at tiny settings (shared with test_report through the session's base temp dir)."""
    spec = importlib.util.spec_from_file_location("make_example_store", NOTEBOOKS / "make_example_store.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tiny_example_store(tmp_path_factory.getbasetemp() / "example_store")


def _execute(name: str, store: Path, monkeypatch) -> nbformat.NotebookNode:
    monkeypatch.setenv("SUBMERGE_STORE", str(store))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    return notebook


def _outputs(notebook, kind: str) -> list:
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])
            if output.output_type == kind or kind in output.get("data", {})]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, store_path, monkeypatch):
    committed = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    assert all(not cell.get("outputs") for cell in committed.cells if cell.cell_type == "code"), "clear outputs"
    assert committed.metadata.kernelspec.name == "python3"
    notebook = _execute(name, store_path, monkeypatch)
    assert not _outputs(notebook, "error")
    assert len(_outputs(notebook, "image/png")) >= 3, "figures were drawn"
    text = "".join(o.get("text", "") for o in _outputs(notebook, "stream"))
    assert str(store_path) in text
    # xr.open_datatree(STORE, engine="zarr"), as the README opens a store, reads the consolidated metadata: no
    # warning (xarray's "Failed to open Zarr store with consolidated metadata" went to stderr), no hint
    errors = "".join(o.get("text", "") for o in _outputs(notebook, "stream") if o.get("name") == "stderr")
    assert "Warning" not in errors and "consolidated" not in errors, errors
    assert "note:" not in text


def test_the_store_opens_the_readme_way_with_warnings_as_errors(store_path):
    """`python -W error -c "import xarray as xr; xr.open_datatree(STORE, engine='zarr')"` exits 0: no warning at all
    (consolidated metadata read, no deprecation) when a store is opened as the README and the notebooks do."""
    code = (f"import xarray as xr; tree = xr.open_datatree({str(store_path)!r}, engine='zarr'); "
            "print(len(tree.children))")
    result = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and not result.stderr, result.stderr
    assert int(result.stdout) == len(list(Store(store_path).open().children))


def test_interference_notebook_without_the_group(store_path, tmp_path, monkeypatch):
    store = tmp_path / "no_interference.zarr"
    shutil.copytree(store_path, store)
    shutil.rmtree(store / "interference")
    assert Store(store).consolidation() == "stale"  # deleted by hand: the notebook's first cell says so
    Store(store).consolidate()  # what that note asks for (diag report --consolidate)
    notebook = _execute("02_interference", store, monkeypatch)
    text = "".join(o.get("text", "") for o in _outputs(notebook, "stream"))
    assert "no 'interference' group" in text
    assert not _outputs(notebook, "image/png")

"""The zarr store: resuming killed runs, cutting half-written units, settings checks, provenance."""

from __future__ import annotations

import hashlib
from importlib import metadata

import numpy as np
import pytest
import xarray as xr

from diagnostics.errors import StoreError
from diagnostics.linearity import nonlinearity
from diagnostics.store import Store

TASK = "math"
LEVELS = ("model", "layer", "attn", "mlp")
COMMAND = "diag linearity --steps 3 (test)"


class Killed(Exception):
    """Stands for the process being killed between two store units."""


def _killer(after: int, seen: list[str]):
    def on_unit(name: str) -> None:
        seen.append(name)
        if len(seen) >= after:
            raise Killed(name)

    return on_unit


@pytest.fixture(scope="module")
def experiment(llama_kit):
    return llama_kit.experiment()


@pytest.fixture(scope="module")
def reference(experiment, tmp_path_factory):
    """One uninterrupted run: (store, dataset as written)."""
    store = Store(tmp_path_factory.mktemp("reference") / "diag.zarr")
    units: list[str] = []
    nonlinearity(experiment, levels=LEVELS, steps=3, store=store, progress=False, command=COMMAND,
                 on_unit=units.append)
    assert units == ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp", "model"]
    return store, store.dataset("linearity")


def _assert_same_results(written: xr.Dataset, expected: xr.Dataset) -> None:
    """Same values, coordinates and settings; provenance (creation time) may differ."""
    xr.testing.assert_identical(written.drop_attrs(), expected.drop_attrs())
    for key in ("settings", "complete", "units_done", "equation"):
        assert written.attrs[key] == expected.attrs[key], key


def _run(experiment, store, **options):
    return nonlinearity(experiment, levels=LEVELS, steps=options.pop("steps", 3), store=store, progress=False,
                        command=COMMAND, **options)


def test_killed_run_resumes_to_the_same_dataset(experiment, reference, tmp_path):
    _, expected = reference
    store = Store(tmp_path / "diag.zarr")
    seen: list[str] = []
    with pytest.raises(Killed):
        _run(experiment, store, on_unit=_killer(2, seen))
    assert not store.is_complete("linearity")
    partial = store.dataset("linearity")
    assert list(partial.module.values) == list(expected.module.values[:6])  # two layers of three modules
    resumed_units: list[str] = []
    result = _run(experiment, store, on_unit=resumed_units.append)
    assert resumed_units == ["layers.2.mlp", "model"]  # finished units are not redone
    assert store.is_complete("linearity")
    written = store.dataset("linearity")
    _assert_same_results(written, expected)
    np.testing.assert_array_equal(result.nonlinearity_score.values, expected.nonlinearity_score.values)
    assert np.isfinite(expected.nonlinearity_score.values).all()


def test_half_written_unit_is_cut_back_and_redone(experiment, reference, tmp_path):
    _, expected = reference
    store = Store(tmp_path / "diag.zarr")
    with pytest.raises(Killed):
        _run(experiment, store, on_unit=_killer(2, []))
    # killed while appending layer 1: its arrays are written, but the count was not updated
    store._root("a")["linearity"].attrs["units_done"] = 3
    assert store.dataset("linearity").sizes["module"] == 6
    resumed_units: list[str] = []
    _run(experiment, store, on_unit=resumed_units.append)
    assert resumed_units == ["layers.1.mlp", "layers.2.mlp", "model"]
    written = store.dataset("linearity")
    assert list(written.module.values) == list(expected.module.values)
    _assert_same_results(written, expected)


def test_finished_run_is_not_redone(experiment, reference):
    store, expected = reference
    units: list[str] = []
    result = _run(experiment, store, on_unit=units.append)
    assert units == []
    xr.testing.assert_allclose(result.drop_attrs(), expected.drop_attrs())


def test_other_settings_need_force(experiment, reference, tmp_path):
    store = Store(tmp_path / "diag.zarr")
    _run(experiment, store)
    before = store.dataset("linearity")
    with pytest.raises(StoreError) as error:
        _run(experiment, store, steps=4)
    message = str(error.value)
    assert "steps: 3 → 4" in message and "--force" in message and "'linearity'" in message
    xr.testing.assert_identical(store.dataset("linearity"), before)  # untouched
    _run(experiment, store, steps=4, force=True)
    after = store.dataset("linearity")
    assert store.is_complete("linearity")
    assert store._root("r")["linearity"].attrs["settings"]["steps"] == 4
    assert not np.allclose(after.nonlinearity_score.values, before.nonlinearity_score.values)


@pytest.mark.filterwarnings("ignore:Failed to open Zarr store with consolidated metadata")
def test_store_opens_as_datatree_with_provenance(reference, llama_kit):
    store, _ = reference
    tree = xr.open_datatree(str(store.path), engine="zarr")
    assert "linearity" in tree.children
    scores = tree["linearity"].ds.nonlinearity_score
    assert scores.dims == ("task", "module", "sample")
    assert scores.shape == (1, 10, 4)
    assert list(tree["linearity"].ds.level.values[:3]) == ["layer", "attn", "mlp"]
    root = tree.attrs
    assert root["toolkit"] == "submerge"
    assert root["toolkit_version"] == metadata.version("submerge")
    assert root["command"] == COMMAND
    assert root["base_model"]["spec"] == str(llama_kit.base_dir)
    assert len(root["base_model"]["content_sha256"]) == 64
    assert root["base_model"]["architecture"] == "LlamaForCausalLM"
    for library in ("torch", "transformers", "xarray", "zarr", "numpy"):
        assert root["libraries"][library] == metadata.version(library)
    group = tree["linearity"].attrs
    data_sha = hashlib.sha256(llama_kit.data_path.read_bytes()).hexdigest()
    assert group["provenance"]["data"][TASK]["sha256"] == data_sha
    assert group["provenance"]["finetuned"][TASK]["path"] == str(llama_kit.finetuned_dir)
    assert group["settings"]["steps"] == 3 and group["settings"]["levels"] == list(LEVELS)
    assert group["complete"] is True and group["units_done"] == 10
    assert group["equation"] == "seed 002 Eq. 19"
    assert store.groups() == ["linearity"]


# --------------------------------------------------------------------------- the Store API directly


def _unit(labels: list[str], value: float) -> xr.Dataset:
    return xr.Dataset(
        {"score": (("module", "sample"), np.full((len(labels), 3), value))},
        coords={"module": np.array(labels, dtype=object), "sample": np.arange(3),
                "level": ("module", np.array(["attn"] * len(labels)))},
    )


def test_append_and_repair(tmp_path):
    store = Store(tmp_path / "s.zarr")
    assert store.begin("g", {"a": 1}) == set()
    store.append("g", _unit(["layers.0.attn"], 1.0))
    store.append("g", _unit(["layers.1.attn", "layers.2.attn"], 2.0))
    assert store.begin("g", {"a": 1}) == {"layers.0.attn", "layers.1.attn", "layers.2.attn"}
    store._root("a")["g"].attrs["units_done"] = 1  # the second append was half-done
    assert store.begin("g", {"a": 1}) == {"layers.0.attn"}
    data = store.dataset("g")
    assert list(data.module.values) == ["layers.0.attn"] and list(data.level.values) == ["attn"]
    store.append("g", _unit(["layers.1.a_much_longer_name"], 3.0))  # strings are never truncated
    store.finish("g", {"note": "done"})
    data = store.dataset("g")
    assert list(data.module.values) == ["layers.0.attn", "layers.1.a_much_longer_name"]
    np.testing.assert_array_equal(data.score.values[:, 0], [1.0, 3.0])
    assert store.is_complete("g") and store._root("r")["g"].attrs["note"] == "done"


def test_nothing_complete_restarts_empty(tmp_path):
    store = Store(tmp_path / "s.zarr")
    store.begin("g", {"a": 1})
    store.append("g", _unit(["layers.0.attn"], 1.0))
    store._root("a")["g"].attrs["units_done"] = 0
    assert store.begin("g", {"a": 1}) == set()
    store.append("g", _unit(["layers.0.attn"], 5.0))
    assert store.dataset("g").score.values.tolist() == [[5.0] * 3]


def test_write_whole_group_and_settings_check(tmp_path):
    store = Store(tmp_path / "s.zarr")
    dataset = _unit(["a", "b"], 1.0)
    dataset.attrs["chosen"] = "x"
    store.write("w", dataset, {"k": [1, 2]}, root={"base_model": {"spec": "base-a"}})
    xr.testing.assert_identical(store.dataset("w").drop_attrs(), dataset.drop_attrs())
    assert store.is_complete("w") and store._root("r")["w"].attrs["chosen"] == "x"
    with pytest.raises(StoreError, match=r"k: \[1, 2\] → \[1, 3\]"):
        store.write("w", dataset, {"k": [1, 3]})
    store.write("w", _unit(["c"], 2.0), {"k": [1, 3]}, force=True)
    assert list(store.dataset("w").module.values) == ["c"]
    with pytest.raises(StoreError, match="'base-a', not 'base-b'"):
        store.begin("other", {}, root={"base_model": {"spec": "base-b"}})
    with pytest.raises(StoreError, match=r"no group 'missing' \(it has: w\)"):
        store.dataset("missing")
    with pytest.raises(StoreError, match="no store"):
        Store(tmp_path / "none.zarr").open()

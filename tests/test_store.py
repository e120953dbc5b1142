"""The zarr store: resuming killed runs, cutting half-written units, settings checks, provenance."""

from __future__ import annotations

import hashlib
import os
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from submerge.diagnostics.errors import StoreError
from submerge.diagnostics.linearity import nonlinearity
from submerge.diagnostics.store import Store, UnitWriter

ROOT = Path(__file__).resolve().parents[1]

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


def test_store_opens_as_datatree_with_provenance(reference, llama_kit):
    store, _ = reference
    assert store.consolidation() == "current"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the README's way opens the consolidated metadata: no warning
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


def test_a_first_unit_cut_mid_write_is_partial_with_nothing_written_and_resumes(tmp_path):
    """A kill inside the first append can leave arrays whose chunk files are missing (a coordinate's, say) while
    no unit is committed: that is a partial group with 0 units, not a damaged one; reading it says so, and the
    next run starts it afresh."""
    store = Store(tmp_path / "s.zarr")
    store.begin("g", {"a": 1}, expected=2)
    store.append("g", _unit(["layers.0.attn"], 1.0))
    store._root("a")["g"].attrs["units_done"] = 0  # the commit never happened
    for chunk in (p for p in (store.path / "g" / "sample").rglob("*") if p.is_file() and p.name != "zarr.json"):
        chunk.unlink()  # the coordinate's chunk was not written yet
    state = store.status()["g"]
    assert (state.state, state.units_done, state.units_expected) == ("partial", 0, 2)
    assert str(state) == "g: partial: 0 of 2 units written; run the same command again to finish it"
    with pytest.raises(StoreError, match="group 'g' has no finished unit yet"):
        store.dataset("g")
    assert store.begin("g", {"a": 1}, expected=2) == set() and not store._arrays("g")
    store.append("g", _unit(["layers.0.attn"], 5.0))
    assert store.dataset("g").score.values.tolist() == [[5.0] * 3]
    assert store.status()["g"].state == "partial" and store.status()["g"].units_done == 1


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


# --------------------------------------------------------------------------- inputs, locks, damage, strings


def _provenance(**inputs) -> dict:
    return {"provenance": {"command": "test", **inputs}}


def _model(path: str, digest: str) -> dict:
    return {"spec": path, "path": path, "content_sha256": digest * 64}


def test_changed_inputs_are_refused_and_named(tmp_path):
    store = Store(tmp_path / "s.zarr")
    inputs = {"base_model": _model("/m/base", "0"),
              "finetuned": {"math": _model("/m/A", "a"), "code": _model("/m/B", "b")},
              "data": {"math": {"path": "/d/math.jsonl", "sha256": "1" * 64}}}
    store.begin("g", {"k": 1}, attrs=_provenance(**inputs))
    store.append("g", _unit(["m0"], 1.0))
    swapped = {**inputs, "finetuned": {"math": _model("/m/B", "b"), "code": _model("/m/A", "a")}}
    with pytest.raises(StoreError) as error:
        store.begin("g", {"k": 1}, attrs=_provenance(**swapped))
    message = str(error.value)
    assert "fine-tune 'math': /m/A (sha256:aaaaaaaaaaaa…) → /m/B (sha256:bbbbbbbbbbbb…)" in message
    assert "fine-tune 'code': /m/B" in message and "--force" in message and "base model" not in message
    changed_data = {**inputs, "data": {"math": {"path": "/d/math.jsonl", "sha256": "2" * 64}}}
    with pytest.raises(StoreError, match=r"data 'math': /d/math.jsonl \(sha256:111111111111…\) → "):
        store.begin("g", {"k": 1}, attrs=_provenance(**changed_data))
    held_out = {**inputs, "held_out": {"math": {"path": "/d/held.jsonl", "sha256": "3" * 64}}}
    with pytest.raises(StoreError, match=r"held-out data 'math': absent → /d/held.jsonl \(sha256:333333333333…\)"):
        store.begin("g", {"k": 1}, attrs=_provenance(**held_out))
    moved = {**inputs, "data": {"math": {"path": "/elsewhere/math.jsonl", "sha256": "1" * 64}}}
    assert store.begin("g", {"k": 1}, attrs=_provenance(**moved)) == {"m0"}  # same content, other path: resumes
    assert store.begin("g", {"k": 1}, attrs=_provenance(**swapped), force=True) == set()
    assert store.group_attrs("g")["identity"]["fine-tune 'math'"]["hash"] == "sha256:" + "b" * 64


def test_group_whose_attrs_were_wiped_is_explained(tmp_path):
    store = Store(tmp_path / "s.zarr")
    store.begin("g", {"k": 1})
    store.append("g", _unit(["m0"], 1.0))
    store._put_attrs("g", {})  # what an older version left after a kill during an append
    with pytest.raises(StoreError, match="no record of its settings.*--force"):
        store.begin("g", {"k": 1})
    assert store.begin("g", {"k": 1}, force=True) == set()


def test_lock_refuses_a_live_writer_and_takes_over_a_stale_one(tmp_path, capfd):
    import json
    import platform
    import subprocess
    import sys

    store = Store(tmp_path / "s.zarr")
    store.path.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"pid": holder.pid, "host": platform.node(), "started": "2026-01-01T00:00:00+00:00",
                "command": "diag linearity (other)"}
        (store.path / ".submerge.lock").write_text(json.dumps(lock))
        with pytest.raises(StoreError, match=rf"being written by process {holder.pid} on {platform.node()} "
                                             r"\(since 2026-01-01T00:00:00\+00:00: diag linearity \(other\)\)"):
            store.begin("g", {})
        assert not store.has("g")
    finally:
        holder.kill()
        holder.wait()
    assert store.begin("g", {}) == set()  # the holder is gone: stale
    note = capfd.readouterr().err
    assert f"taking over a stale lock of process {holder.pid}" in note and "is no longer running" in note
    mine = json.loads((store.path / ".submerge.lock").read_text())
    assert mine["pid"] == os.getpid() and mine["host"] == platform.node() and mine["started"]
    assert store.begin("g", {}) == set()  # this process holds it already
    store.append("g", _unit(["m0"], 1.0))
    store.finish("g")
    assert not (store.path / ".submerge.lock").exists()  # released
    (store.path / ".submerge.lock").write_text(json.dumps({**lock, "host": "another-host"}))
    with pytest.raises(StoreError, match="on another-host"):  # liveness unknown on another host: refused
        store.begin("h", {})
    (store.path / ".submerge.lock").unlink()


def test_lock_released_on_error(tmp_path):
    store = Store(tmp_path / "s.zarr")
    store.begin("g", {"k": 1})
    with pytest.raises(StoreError, match="other settings"):
        store.begin("g", {"k": 2})
    assert not (store.path / ".submerge.lock").exists()
    store.begin("g", {"k": 1})
    with pytest.raises(KeyError):
        store.append("g", _unit(["m0"], 1.0), dim="no_such_dim")
    assert not (store.path / ".submerge.lock").exists()


def test_ctrl_c_during_a_write_waits_for_the_write(tmp_path, monkeypatch):
    """SIGINT in the middle of an append (here from inside zarr's writer thread) stops the run after the unit is
    committed, with the usual KeyboardInterrupt and the lock released; the handler in place is restored."""
    import signal

    from submerge.diagnostics import store as store_module

    store = Store(tmp_path / "s.zarr")
    store.begin("g", {"a": 1})
    monkeypatch.setenv(store_module.FAULT_ENV, "write:2:interrupt")
    monkeypatch.setitem(store_module._fault_counts, "write", 0)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        store.append("g", _unit(["layers.0.attn", "layers.1.attn"], 1.0))
    assert store_module._fault_counts["write"] > 2  # the interrupt came mid-append and the append went on
    assert signal.getsignal(signal.SIGINT) is before
    assert not (store.path / ".submerge.lock").exists()
    monkeypatch.delenv(store_module.FAULT_ENV)
    assert store.begin("g", {"a": 1}) == {"layers.0.attn", "layers.1.attn"}  # the unit was committed whole
    np.testing.assert_array_equal(store.dataset("g").score.values[:, 0], [1.0, 1.0])


def test_after_a_failed_write_only_zarrs_unretrieved_write_errors_are_dropped(caplog):
    """A full disk fails several of zarr's concurrent writes; the first is the StoreError, the others must not
    print "exception was never retrieved" tracebacks. Other loop errors still reach the log."""
    import logging

    from zarr.core.sync import _get_loop

    from submerge.diagnostics import store as store_module

    loop = _get_loop()
    before = loop.get_exception_handler()
    try:
        store_module._drop_unretrieved_write_errors()
        store_module._drop_unretrieved_write_errors()  # once is enough: not wrapped twice
        handler = loop.get_exception_handler()
        assert handler.drops_unretrieved_write_errors
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            handler(loop, {"message": "Task exception was never retrieved", "exception": OSError(27, "File too large")})
            assert caplog.records == []
            handler(loop, {"message": "Task exception was never retrieved", "exception": ValueError("a bug")})
            handler(loop, {"message": "something else", "exception": OSError(5, "I/O error")})
        assert len(caplog.records) == 2
    finally:
        loop.set_exception_handler(before)


def test_status_partial_complete_and_corrupt(tmp_path):
    store = Store(tmp_path / "s.zarr")
    writer = UnitWriter(store, "g", {"k": 1}, expected=3)
    writer.add(_unit(["m0"], 1.0), "m0")
    writer.add(_unit(["m1"], 2.0), "m1")
    state = store.status()["g"]
    assert (state.state, state.units_done, state.units_expected) == ("partial", 2, 3)
    assert str(state) == "g: partial: 2 of 3 units written; run the same command again to finish it"
    writer.add(_unit(["m2"], 3.0), "m2")
    writer.finish({})
    assert str(store.group_status("g")) == "g: complete (3 units)"
    chunk = min(p for p in (store.path / "g" / "score").rglob("*") if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(chunk.read_bytes()[:5])
    assert store.status()["g"].state == "corrupt" and store.status()["g"].file == str(chunk.parent.parent.parent)
    with pytest.raises(StoreError, match=f"chunk file {chunk} cannot be decoded"):
        store.dataset("g")
    with pytest.raises(StoreError, match=f"group 'g' is damaged: chunk file {chunk}"):
        store.open()
    chunk.unlink()
    with pytest.raises(StoreError, match=f"chunk file {chunk} is missing"):
        store.dataset("g")
    meta = store.path / "g" / "zarr.json"
    meta.write_bytes(meta.read_bytes()[:20])
    assert store.status()["g"].state == "corrupt"
    with pytest.raises(StoreError, match=f"{meta} is unreadable"):
        store.open()
    with pytest.raises(StoreError, match=f"{meta} is unreadable"):
        store.begin("g", {"k": 1})


def test_strings_read_back_as_unicode_and_widen(tmp_path):
    store = Store(tmp_path / "s.zarr")
    store.begin("g", {})
    store.append("g", _unit(["layers.0.attn", "layers.1.attn"], 1.0))
    long_name = "layers.2." + "x" * 100
    store.append("g", _unit([long_name], 2.0))  # wider than the stored width: the array is widened
    store.append("g", _unit(["layers.3.attn"], 3.0))
    store.finish("g")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reading a store needs no filter of the reader's own
        tree = xr.open_datatree(str(store.path), engine="zarr")
    xr.testing.assert_identical(tree, xr.open_datatree(str(store.path), engine="zarr", consolidated=False))
    level = tree["g"].ds.level.values
    assert level.dtype.kind == "U" and list(level.astype(str)) == ["attn"] * 4
    assert list(tree["g"].ds.module.values.astype(str)) == ["layers.0.attn", "layers.1.attn", long_name,
                                                            "layers.3.attn"]
    assert store.group_status("g").state == "complete"
    np.testing.assert_array_equal(store.dataset("g").score.values[:, 0], [1.0, 1.0, 2.0, 3.0])


def test_interrupted_widening_leaves_the_old_array(tmp_path, monkeypatch):
    from submerge.diagnostics import store as store_module

    store = Store(tmp_path / "s.zarr")
    store.begin("g", {})
    store.append("g", _unit(["a"], 1.0))
    real = store_module._atomic_write

    def dies_on_metadata(path, data):
        if path.name == "zarr.json" and path.parent.name == "module":
            raise KeyboardInterrupt  # after the wide chunks, before the switch
        real(path, data)

    monkeypatch.setattr(store_module, "_atomic_write", dies_on_metadata)
    with pytest.raises(KeyboardInterrupt):
        store.append("g", _unit(["b" * 80], 2.0))
    monkeypatch.setattr(store_module, "_atomic_write", real)
    assert list(store.dataset("g").module.values) == ["a"]  # old array, old chunks: intact
    assert store.begin("g", {}) == {"a"}
    store.append("g", _unit(["b" * 80], 2.0))
    assert list(store.dataset("g").module.values) == ["a", "b" * 80]


def test_older_variable_length_strings_still_append(tmp_path):
    store = Store(tmp_path / "s.zarr")
    store.begin("g", {})
    old = _unit(["m0"], 1.0)
    old = old.assign_coords(level=("module", np.array(["attn"], dtype=object)),
                            module=np.array(["m0"], dtype=object))
    old.to_zarr(str(store.path), group="g", mode="a", zarr_format=3, consolidated=False)  # as before this change
    store._put_attrs("g", {**store.group_attrs("g"), "units_done": 1})
    store.append("g", _unit(["m1-longer-than-before"], 2.0))
    data = store.dataset("g")
    assert list(data.module.values.astype(str)) == ["m0", "m1-longer-than-before"]
    assert list(data.level.values.astype(str)) == ["attn", "attn"]


def test_unit_writer_several_rows_per_unit_and_the_empty_case(tmp_path):
    store = Store(tmp_path / "s.zarr")
    seen: list[str] = []
    writer = UnitWriter(store, "m", {}, dim="module", on_unit=seen.append)
    writer.add(_unit(["a", "b", "c"], 1.0), "c")
    with pytest.raises(Killed):
        writer.on_unit = _killer(1, [])
        writer.add(_unit(["d", "e"], 2.0), "e")
    resumed = UnitWriter(store, "m", {}, dim="module")
    assert resumed.done == {"a", "b", "c", "d", "e"}
    resumed.add(_unit(["f", "g"], 3.0), "g")
    result = resumed.finish({"note": 1})
    assert list(result.module.values) == list("abcdefg") and result.attrs["note"] == 1
    np.testing.assert_array_equal(store.dataset("m").score.values[:, 0], [1, 1, 1, 2, 2, 3, 3])
    empty = xr.Dataset({"x": (("matrix", "task"), np.zeros((0, 2)))},
                       coords={"matrix": np.array([], dtype=object), "task": np.array(["t1", "t2"], dtype=object)})
    result = UnitWriter(store, "e", {}, dim="matrix").finish({"n": 0}, empty=empty)
    assert result.sizes == {"matrix": 0, "task": 2} and result.attrs["n"] == 0
    assert store.is_complete("e") and store.dataset("e").sizes == {"matrix": 0, "task": 2}
    again = UnitWriter(store, "e", {}, dim="matrix")
    assert again.done == set() and again.finish({}, empty=empty).sizes["matrix"] == 0
    assert UnitWriter(None, "e", {}).finish({}).sizes == {}


def test_a_coordinate_no_variable_carries_reads_back_as_a_coordinate_and_a_resume_joins(tmp_path):
    """Projection's combo_alpha (combo × task) is a coordinate that no variable (module × combo) carries; xarray
    names such coordinates in the group's "coordinates" attr, which the unit count's write used to drop, so the
    stored units read back with it as a data variable and a run resumed after its first unit could not join them
    (found by the full-stride fault matrix: projection, kill at write 56)."""
    def unit(names):
        return xr.Dataset({"pd": (("module", "combo"), np.ones((len(names), 3)))},
                          coords={"module": np.array(names, dtype=object), "combo": np.arange(3),
                                  "task": np.array(["a", "b"], dtype=object),
                                  "combo_alpha": (("combo", "task"), np.full((3, 2), 0.5))})

    store = Store(tmp_path / "s.zarr")
    writer = UnitWriter(store, "p", {}, dim="module")
    writer.add(unit(["m0"]), "m0")
    writer.add(unit(["m1"]), "m1")
    assert "combo_alpha" in store.dataset("p").coords
    resumed = UnitWriter(store, "p", {}, dim="module")
    resumed.add(unit(["m2"]), "m2")
    result = resumed.finish({})
    assert list(result.module.values) == ["m0", "m1", "m2"] and "combo_alpha" in result.coords
    assert "combo_alpha" in store.dataset("p").coords


def test_unit_writer_builds_provenance_from_inputs(tmp_path):
    store = Store(tmp_path / "s.zarr")
    inputs = {"base_model": _model("/m/base", "0"), "finetuned": {"t": _model("/m/t", "c")}}
    UnitWriter(store, "g", {}, inputs=inputs, command="diag x").finish({})
    assert store.attrs["base_model"] == inputs["base_model"] and store.attrs["command"] == "diag x"
    group = store.group_attrs("g")
    assert group["provenance"]["finetuned"] == inputs["finetuned"] and group["provenance"]["command"] == "diag x"
    assert group["identity"]["fine-tune 't'"]["hash"] == "sha256:" + "c" * 64


def test_import_leaves_the_global_warnings_filter_alone():
    import subprocess
    import sys

    code = ("import warnings, torch, xarray, zarr; before = list(warnings.filters); import submerge.diagnostics.store; "
            "assert warnings.filters == before, warnings.filters[:3]")  # the libraries' own filters come first
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- consolidated metadata


def _open_quietly(path: Path) -> xr.DataTree:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return xr.open_datatree(str(path), engine="zarr")


def _open_as_files_say(path: Path) -> xr.DataTree:
    return xr.open_datatree(str(path), engine="zarr", consolidated=False)


@pytest.mark.filterwarnings("ignore:Object at .submerge.lock")  # a reader while the lock is held
def test_consolidated_as_each_group_completes_and_dropped_while_writing(tmp_path):
    store = Store(tmp_path / "s.zarr")
    writer = UnitWriter(store, "first", {}, dim="module")
    writer.add(_unit(["a"], 1.0), "a")
    assert store.consolidation() == "absent"
    writer.finish({})
    assert store.consolidation() == "current"
    xr.testing.assert_identical(_open_quietly(store.path), _open_as_files_say(store.path))

    second = UnitWriter(store, "alpha/layer", {}, dim="module")  # a nested group, in a consolidated store
    assert store.consolidation() == "absent"  # removed before anything of the new run was written
    second.add(_unit(["b"], 2.0), "b")
    second.add(_unit(["c" * 90], 3.0), "c")  # widened strings: new chunk keys, new array metadata
    with pytest.warns(RuntimeWarning, match="consolidated metadata"):  # a reader meanwhile sees the files
        seen = xr.open_datatree(str(store.path), engine="zarr")
    assert list(seen["alpha/layer"].ds.module.values) == ["b", "c" * 90]
    second.finish({"note": "done"})
    tree = _open_quietly(store.path)
    xr.testing.assert_identical(tree, _open_as_files_say(store.path))
    assert tree["alpha/layer"].attrs["note"] == "done" and tree["alpha/layer"].attrs["complete"] is True


@pytest.mark.filterwarnings("ignore:Object at .submerge.lock")  # a reader while the lock is held
def test_killed_run_leaves_no_consolidated_metadata_that_hides_later_arrays(tmp_path):
    store = Store(tmp_path / "s.zarr")
    UnitWriter(store, "first", {}, dim="module").finish({}, empty=_unit([], 0.0))
    assert store.consolidation() == "current"
    writer = UnitWriter(store, "second", {}, dim="module", on_unit=_killer(2, []))
    writer.add(_unit(["a"], 1.0), "a")
    with pytest.raises(Killed):
        writer.add(_unit(["b"], 2.0), "b")
    assert store.consolidation() == "absent"
    with pytest.warns(RuntimeWarning):
        tree = xr.open_datatree(str(store.path), engine="zarr")
    assert list(tree["second"].ds.module.values) == ["a", "b"]  # every array as written, none hidden
    resumed = UnitWriter(store, "second", {}, dim="module")
    assert resumed.done == {"a", "b"}
    resumed.add(_unit(["c"], 3.0), "c")
    resumed.finish({})
    assert list(_open_quietly(store.path)["second"].ds.module.values) == ["a", "b", "c"]


def test_consolidate_an_older_or_edited_store(tmp_path):
    import shutil

    store = Store(tmp_path / "s.zarr")
    for group in ("kept", "deleted"):
        writer = UnitWriter(store, group, {}, dim="module")
        writer.add(_unit(["a"], 1.0), "a")
        writer.finish({})
    store._drop_consolidated()  # a store written before consolidation
    assert store.consolidation() == "absent"
    hint = store.consolidation_hint()
    assert "no consolidated metadata" in hint and f"diag report {store.path} --consolidate" in hint
    store.consolidate()
    assert store.consolidation() == "current" and store.consolidation_hint() is None
    assert sorted(_open_quietly(store.path).children) == ["deleted", "kept"]
    assert not (store.path / ".submerge.lock").exists()

    shutil.rmtree(store.path / "deleted")  # edited by hand: the consolidated copy still lists the group
    assert store.consolidation() == "stale" and "no longer matches its files" in store.consolidation_hint()
    store.consolidate()
    assert sorted(_open_quietly(store.path).children) == ["kept"]


def test_consolidate_is_refused_while_another_process_writes(tmp_path):
    import json
    import platform

    from submerge.diagnostics.store import LOCK_NAME, _process_start

    store = Store(tmp_path / "s.zarr")
    UnitWriter(store, "g", {}, dim="module").finish({}, empty=_unit([], 0.0))
    store._drop_consolidated()
    holder = {"pid": os.getppid(), "host": platform.node(), "process_start": _process_start(os.getppid()),
              "started": "now", "command": "diag linearity"}
    (store.path / LOCK_NAME).write_text(json.dumps(holder))
    with pytest.raises(StoreError, match="being written by process"):
        store.consolidate()
    assert store.consolidation() == "absent"


def test_a_result_gathered_without_a_store_carries_its_settings():
    """`UnitWriter` with no store (the Python API's in-memory run) puts the settings on the result, as `Store.begin`
    puts them on a stored group; a driver's own ``settings`` attr is not overwritten."""
    writer = UnitWriter(None, "g", {"steps": 10, "levels": ["layer"]}, dim="module")
    writer.add(xr.Dataset({"x": ("module", np.arange(2.0))}, coords={"module": ["a", "b"]}), "b")
    result = writer.finish({"equation": "E"})
    assert result.attrs == {"equation": "E", "settings": {"steps": 10, "levels": ["layer"]}}
    own = UnitWriter(None, "g", {"steps": 10}, dim="module")
    own.add(xr.Dataset({"x": ("module", [1.0])}, coords={"module": ["a"]}), "a")
    assert own.finish({}, result_attrs={"settings": "the driver's"}).attrs["settings"] == "the driver's"


@pytest.mark.parametrize("new, grown", [
    ({"methods": ["a", "b", "c"], "tuning": {"a": 1, "b": 2, "c": 3}, "lr": 1}, True),  # both extended
    ({"methods": ["a", "b", "c"], "tuning": {"a": 1, "b": 2}, "lr": 1, "options": {"c": 5}}, True),  # a new dict
    ({"methods": ["a", "b"], "tuning": {"a": 1, "b": 2}, "lr": 1}, False),  # the same: nothing grew
    ({"methods": ["c", "a", "b"], "tuning": {"a": 1, "b": 2}, "lr": 1}, False),  # not at the end
    ({"methods": ["a"], "tuning": {"a": 1, "b": 2}, "lr": 1}, False),  # shrunk
    ({"methods": ["a", "b", "c"], "tuning": {"a": 1, "b": 9, "c": 3}, "lr": 1}, False),  # an entry changed
    ({"methods": ["a", "b", "c"], "tuning": {"a": 1, "b": 2}, "lr": 2}, False),  # another setting changed
    ({"methods": ["a", "b", "c"], "tuning": {"a": 1, "b": 2}}, False),  # another setting gone
])
def test_settings_grow_only_by_entries_added_to_the_growing_keys(new, grown):
    from submerge.diagnostics.provenance import settings_grown

    old = {"methods": ["a", "b"], "tuning": {"a": 1, "b": 2}, "lr": 1}
    assert settings_grown(old, new, ("methods", "tuning", "options")) is grown
    assert settings_grown(old, new, ()) is False


def test_a_group_resumes_under_grown_settings_keeping_its_units_and_marked_incomplete(tmp_path):
    store = Store(tmp_path / "s.zarr")
    piece = xr.Dataset({"x": ("unit", [1.0])}, coords={"unit": ["a"]})
    writer = UnitWriter(store, "g", {"methods": ["a"], "lr": 1}, dim="unit", grows=("methods",))
    writer.add(piece, "a")
    writer.finish({})
    with pytest.raises(StoreError, match="lr: 1 → 2"):
        UnitWriter(store, "g", {"methods": ["a", "b"], "lr": 2}, dim="unit", grows=("methods",))
    with pytest.raises(StoreError, match="methods"):  # growing is asked for by the writer
        UnitWriter(store, "g", {"methods": ["a", "b"], "lr": 1}, dim="unit")
    assert store.is_complete("g")
    writer = UnitWriter(store, "g", {"methods": ["a", "b"], "lr": 1}, dim="unit", grows=("methods",))
    assert writer.done == {"a"} and not store.is_complete("g")
    assert store.group_attrs("g")["settings"] == {"methods": ["a", "b"], "lr": 1}
    writer.add(xr.Dataset({"x": ("unit", [2.0])}, coords={"unit": ["b"]}), "b")
    assert list(writer.finish({}).x.values) == [1.0, 2.0] and store.is_complete("g")

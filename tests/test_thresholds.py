"""Every code path that exists only above a size threshold, run on both sides of it on full fine-tunes.

Full fine-tunes (`submerge.diagnostics.toy.finetune`: Adam steps on every parameter) change every tensor — the
embedding, the norms and the output head included — so a merge reaches every rule's fallback for
embeddings and norms. The thresholds are lowered in the test (no big models are built):

- `submerge.merge.tensor_merge.STREAM_THRESHOLD`: row-local rules read, merge and write a tensor in row blocks;
- `submerge.merge.strategies.CHUNK_THRESHOLD`: element-wise methods run in row chunks over the whole tensor.

Chunked capture (`capture_budget`) and the release of mapped pages (`capture.RELEASE_BYTES`) are tested on
both sides in tests/test_linearity_drivers.py and tests/test_models.py.

`diag compare` at its default methods crashed on the first full fine-tune it met: the registered
``closed-form`` (a method whose weights come from data) was merged as a plain strategy.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from submerge.diagnostics import toy
from submerge.merge import strategies, tensor_merge
from submerge.merge.run import DataSettings, run_merge
from submerge.merge.strategies import STRATEGIES

TASKS = ("math", "code")
SETTINGS = {"samples": 4, "max_tokens": 32, "batch_size": 2}
#: The thresholds are the merge writer's; the searches of the learned weights do not depend on them (their result
#: is tested in tests/test_learned.py), so they run short here: the same paths, a fraction of the time.
SHORT_SEARCH = {"adamerging": {"steps": 3}, "lorahub": {"steps": 5}}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """(base, full fine-tunes, data) of a tiny Llama whose embedding is untied (a separate lm_head)."""
    root = tmp_path_factory.mktemp("thresholds")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = toy.build_model(root / "base", "llama", layers=2, hidden=32)
        finetuned = {t: str(toy.finetune(base, root / t, t, steps=3, seed=i)) for i, t in enumerate(TASKS)}
        data = {t: str(toy.write_task_data(root / f"{t}.jsonl", t, count=12)) for t in TASKS}
    return str(base), finetuned, data


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def test_full_finetunes_change_every_tensor(full):
    base, finetuned, _ = full
    base_tensors = _tensors(Path(base))
    for task, folder in finetuned.items():
        tuned = _tensors(Path(folder))
        assert tuned.keys() == base_tensors.keys()
        unchanged = [name for name in base_tensors if torch.equal(base_tensors[name], tuned[name])]
        assert unchanged == [], (task, unchanged)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= base_tensors.keys()


def _lower_thresholds(monkeypatch, *, below: bool) -> None:
    """`below`: every 2-D tensor is above both thresholds (row blocks of 3 rows, chunks of 40 entries)."""
    if below:
        monkeypatch.setattr(tensor_merge, "STREAM_THRESHOLD", 64)
        monkeypatch.setattr(tensor_merge, "STREAM_ELEMENTS", 3 * 32 + 5)  # blocks end mid-tensor
        monkeypatch.setattr(strategies, "CHUNK_THRESHOLD", 64)
        monkeypatch.setattr(strategies, "CHUNK_ELEMENTS", 40)


@pytest.mark.parametrize("method", list(STRATEGIES))
def test_every_method_merges_full_finetunes_the_same_on_both_sides_of_the_thresholds(full, tmp_path, monkeypatch,
                                                                                        method):
    """`diag merge --method M` for every registered method (data methods with task data): the merge above the
    thresholds (row blocks, row chunks) is bitwise the merge below them, finite, and every tensor is written."""
    base, finetuned, data = full
    settings = DataSettings(data=data, **SETTINGS)
    options = SHORT_SEARCH.get(method, {})
    whole = run_merge(tmp_path / "whole", method=method, options=options, base=base, finetuned=finetuned,
                      data=settings, progress=False)
    calls = []
    original = tensor_merge.merge_row_blocks

    def spy(name, *args, **kwargs):
        result = original(name, *args, **kwargs)
        calls.append((name, result is not None))
        return result

    _lower_thresholds(monkeypatch, below=True)
    monkeypatch.setattr(tensor_merge, "merge_row_blocks", spy)
    blocks = run_merge(tmp_path / "blocks", method=method, options=options, base=base, finetuned=finetuned,
                       data=settings, progress=False)
    expected, got = _tensors(whole), _tensors(blocks)
    assert expected.keys() == got.keys() == _tensors(Path(base)).keys()
    for name in expected:
        assert torch.isfinite(got[name]).all(), name
        assert torch.equal(expected[name], got[name]), name
    streamed = {name for name, done in calls if done}
    if strategies.is_row_local(method, "embedding"):  # the embedding took the row-block path
        assert "model.embed_tokens.weight" in streamed


def test_a_plan_merges_full_finetunes_the_same_on_both_sides_of_the_thresholds(full, tmp_path, monkeypatch):
    """`diag alpha` + `diag plan` + `diag merge plan.yaml` (the CLI) on full fine-tunes, below and above."""
    from typer.testing import CliRunner

    from submerge.cli.main import app

    base, finetuned, data = full
    runner = CliRunner()
    models = ["--model", base, *sum((["-f", f"{t}={p}"] for t, p in finetuned.items()), [])]
    datas = sum((["--data", f"{t}={p}"] for t, p in data.items()), [])
    store, plan = tmp_path / "store.zarr", tmp_path / "plan.yaml"
    common = ["--samples", "4", "--max-tokens", "32", "--dtype", "float32", "--device", "cpu", "--no-progress"]
    for arguments in (["linearity", *models, *datas, "--levels", "layer,attn,mlp", "--steps", "4", *common],
                      ["alpha", *models, *datas, "--granularity", "attn-mlp", *common]):
        result = runner.invoke(app, [*arguments, "--out", str(store)])
        assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["plan", str(store), "--out", str(plan)])
    assert result.exit_code == 0, result.output
    outputs = {}
    for below in (False, True):
        with monkeypatch.context() as patch:
            _lower_thresholds(patch, below=below)
            out = tmp_path / f"merged-{below}"
            result = runner.invoke(app, ["merge", str(plan), "--out", str(out), "--no-progress"])
            assert result.exit_code == 0, result.output
            outputs[below] = _tensors(out)
    assert outputs[False].keys() == outputs[True].keys()
    for name, tensor in outputs[False].items():
        assert torch.equal(tensor, outputs[True][name]), name


def test_compare_at_its_default_methods_runs_on_full_finetunes_on_both_sides_of_the_thresholds(full, monkeypatch):
    """Every default method of `diag compare`, the plan included, gives a finite loss; the leaderboard above the
    thresholds is the one below them."""
    from submerge.merge.compare import CompareError, compare, default_methods

    base, finetuned, data = full
    run = {"tune": None, "fit": 4, "samples": 3, "max_tokens": 32, "batch_size": 2, "dtype": "float32", "device": "cpu",
           "progress": False, "evidence_options": {"folds": 2}}
    for name, options in SHORT_SEARCH.items():  # compare runs each method at its registered defaults
        registered = STRATEGIES[name]
        monkeypatch.setitem(STRATEGIES, name, dataclasses.replace(
            registered, data_options={**registered.data_options, **options}))
    results = {}
    for below in (False, True):
        with monkeypatch.context() as patch:
            _lower_thresholds(patch, below=below)
            results[below] = compare(base, finetuned, data, **run)
    methods = [str(m) for m in results[True].method.values]
    assert methods == ["base", *(f"finetuned:{t}" for t in TASKS), *default_methods()]
    assert np.isfinite(results[True].loss.values).all()
    np.testing.assert_array_equal(results[False].loss.values, results[True].loss.values)
    with pytest.raises(CompareError, match="closed-form-layer"):
        compare(base, finetuned, data, methods=["closed-form"], **run)

"""Bad input ends as exit code 2 with a message naming the option, file, model or tensor (no traceback),
and partial data is said, not hidden (issue 10's validation list)."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
from typer.testing import CliRunner

from submerge.cli.main import app
from submerge.diagnostics.data import read_task_file
from submerge.diagnostics.errors import DataInputError, ModelInputError

TASK = "math"
WIDE = {"COLUMNS": "400"}  # no line wrapping of messages by rich


def _flat(text: str) -> str:
    return " ".join(text.split())


def _invoke(arguments, **kwargs):
    return CliRunner().invoke(app, [str(a) for a in arguments], env=WIDE, **kwargs)


def _linearity(kit, out, *extra, data=None):
    return ["linearity", "-m", kit.base_dir, "-f", f"{TASK}={kit.finetuned_dir}", "-d", f"{TASK}={data or kit.data_path}",
            "-o", out, "--samples", "2", "--steps", "2", "--levels", "layer", "--max-tokens", "16", "--device", "cpu",
            "--no-progress", *extra]


def _user_error(result, *fragments: str) -> str:
    """Exit code 2, every fragment in the message, no traceback; returns the flattened output."""
    output = _flat(result.output)
    assert result.exit_code == 2, output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in output, (fragment, output)
    return output


# ------------------------------------------------------------------ options checked up front


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--steps", "0", "Invalid value for \'--steps\': Input should be greater than or equal to 1"),
    ("--steps", "-1", "Invalid value for \'--steps\': Input should be greater than or equal to 1"),
    ("--batch-size", "0", "Invalid value for \'--batch-size\': Input should be greater than or equal to 1"),
    ("--batch-size", "-2", "Invalid value for \'--batch-size\': Input should be greater than or equal to 1"),
    ("--samples", "0", "Invalid value for \'--samples\': Input should be greater than or equal to 1"),
    ("--max-tokens", "0", "Invalid value for \'--max-tokens\': Input should be greater than or equal to 1"),
    ("--capture-budget", "0", "Invalid value for '--capture-budget': 0.0 is not > 0"),
    ("--capture-budget", "-1", "Invalid value for '--capture-budget': -1.0 is not > 0"),
    ("--device", "tpu9", "Invalid value for '--device': 'tpu9' is not a device"),
])
def test_out_of_range_options_are_refused_before_loading(llama_kit, tmp_path, option, value, message):
    out = tmp_path / "o.zarr"
    _user_error(_invoke([*_linearity(llama_kit, out), option, value]), message)
    assert not out.exists()  # nothing was written: refused while parsing


def test_options_from_a_config_file_are_checked_too(llama_kit, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("batch-size: -2\n")
    _user_error(_invoke([*_linearity(llama_kit, tmp_path / "o.zarr"), "--config", config]),
                "Invalid value for \'--batch-size\': Input should be greater than or equal to 1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused(llama_kit, tmp_path):
    _user_error(_invoke([*_linearity(llama_kit, tmp_path / "o.zarr"), "--device", "cuda"]),
                "Invalid value for '--device': 'cuda': CUDA is not available on this machine", "--device cpu")
    _user_error(_invoke(["interference", "-m", llama_kit.base_dir, "-f", f"{TASK}={llama_kit.finetuned_dir}",
                         "-o", tmp_path / "i.zarr", "--device", "cuda:1"]), "CUDA is not available")


def test_demo_defaults_are_the_readme_size():
    from submerge.cli.options import RunOptions

    assert (RunOptions().samples, RunOptions().max_tokens) == (16, 256)  # no --model: the demo kit
    assert (RunOptions(model="x").samples, RunOptions(model="x").max_tokens) == (30, 512)
    assert RunOptions(samples=3, max_tokens=7).samples == 3 and RunOptions(samples=3, max_tokens=7).max_tokens == 7
    assert "16 on the demo kit" in _flat(_invoke(["linearity", "--help"]).output)


def test_batch_size_below_one_is_refused_by_the_python_api_too(llama_kit):
    """The CLI checks --batch-size while parsing; the library must not turn batch_size=-2 into zero batches
    (all-NaN results in a group marked complete)."""
    from submerge.diagnostics.base_model import load_base_model
    from submerge.diagnostics.data import tokenize

    tokenizer = load_base_model(str(llama_kit.base_dir), dtype="float32", device="cpu").tokenizer
    records = read_task_file(TASK, llama_kit.data_path, samples=2)
    assert [b.sample_index for b in tokenize(records, tokenizer, max_tokens=8, batch_size=1)] == [[0], [1]]
    for size in (0, -2):
        with pytest.raises(DataInputError, match=f"batch_size must be at least 1, got {size}"):
            tokenize(records, tokenizer, max_tokens=8, batch_size=size)
    with pytest.raises(DataInputError, match="batch_size must be at least 1, got -2"):
        llama_kit.experiment(batch_size=-2)


def test_projection_needs_two_finetunes(llama_kit, tmp_path):
    arguments = _linearity(llama_kit, tmp_path / "p.zarr")
    arguments[0] = "projection"
    del arguments[arguments.index("--steps"):arguments.index("--steps") + 2]
    _user_error(_invoke(arguments), "two or more fine-tunes; got 1")


# ------------------------------------------------------------------ data files


def test_binary_data_file_is_named(llama_kit, tmp_path):
    for name in ("bin.jsonl", "bin.txt"):
        data = tmp_path / name
        data.write_bytes(b"abc\xff\xfe\x80 binary\n")
        _user_error(_invoke(_linearity(llama_kit, tmp_path / "o.zarr", data=data)), f"{data}: not UTF-8 text")
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"fine\nab\x00cd\n")
    _user_error(_invoke(_linearity(llama_kit, tmp_path / "o.zarr", data=nul)), f"{nul}:2: holds NUL bytes")


def test_csv_header_names_the_fields(tmp_path):
    data = tmp_path / "data.csv"
    data.write_text('question,answer\n"What is 2+2?",4\n\n"Name, a colour",red\n')
    read = read_task_file(TASK, data, samples=2)
    assert read.texts == ["What is 2+2?\n4", "Name, a colour\nred"]  # not the header
    assert read.indices == [0, 1]
    tsv = tmp_path / "data.tsv"
    tsv.write_text("text\tsource\nhello there\tx\n")
    assert read_task_file(TASK, tsv, samples=None).texts == ["hello there"]
    data.write_text("label,score\na,1\n")
    with pytest.raises(DataInputError, match=r"data.csv:2: no 'text' field and no prompt/completion fields"):
        read_task_file(TASK, data)


def test_csv_data_runs_through_the_cli(llama_kit, tmp_path):
    data = tmp_path / "data.csv"
    data.write_text("text\n" + "".join(f"record number {i} with some words\n" for i in range(3)))
    result = _invoke(_linearity(llama_kit, tmp_path / "o.zarr", data=data))
    assert result.exit_code == 0, result.output
    from submerge.diagnostics.store import Store

    assert Store(tmp_path / "o.zarr").dataset("linearity").sizes["sample"] == 2


def test_fewer_records_than_samples_warns_with_the_count(llama_kit, tmp_path):
    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i} has text"}) + "\n" for i in range(3)))
    with pytest.warns(UserWarning, match=r"three.jsonl has 3 record\(s\), fewer than the 10 asked for; using 3"):
        assert len(read_task_file(TASK, data, samples=10).texts) == 3
    with pytest.warns(UserWarning, match=r"has 1 record\(s\) after the first 2, fewer than the 5"):
        read_task_file(TASK, data, samples=5, skip=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_task_file(TASK, data, samples=3).texts) == 3  # exactly enough: no warning
    with pytest.warns(UserWarning, match="fewer than the 5 asked for"):
        result = _invoke([*_linearity(llama_kit, tmp_path / "o.zarr", data=data), "--samples", "5"])
    assert result.exit_code == 0, result.output


def test_stdin_and_folders_are_not_data_files(llama_kit, tmp_path):
    if os.path.exists("/dev/stdin") and not os.path.isfile("/dev/stdin"):
        with pytest.raises(DataInputError, match="/dev/stdin is not a regular file"):
            read_task_file(TASK, "/dev/stdin")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    _user_error(_invoke(_linearity(llama_kit, tmp_path / "o.zarr", data=fifo)),
                f"task 'math': data file {fifo} is not a regular file")
    _user_error(_invoke(_linearity(llama_kit, tmp_path / "o.zarr", data=tmp_path)), f"{tmp_path} is a directory")


# ------------------------------------------------------------------ models


def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    import transformers

    from submerge.diagnostics import toy

    config = toy.tiny_config("llama", layers=1, hidden=16, vocab=200)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = None, 199, 199
    small = tmp_path / "small"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(small)
    toy.byte_tokenizer().save_pretrained(small)  # 258 tokens
    data = tmp_path / "d.txt"
    data.write_text("hello\n")
    result = _invoke(["linearity", "-m", small, "-f", f"{TASK}={small}", "-d", f"{TASK}={data}", "-o",
                      tmp_path / "o.zarr", "--device", "cpu", "--no-progress"])
    _user_error(result, f"{small}: the tokenizer has token ids up to 257 (258 tokens)",
                "input embedding has 200 rows")


@pytest.mark.parametrize(("role", "spec"), [("base", "./nope"), ("base", "~/no-such-model-dir"),
                                            ("fine-tune", "ft.safetensors"), ("fine-tune", "model.gguf"),
                                            ("fine-tune", "a/b/c"), ("fine-tune", "ckpt/")])
def test_missing_local_path_names_the_model(llama_kit, role, spec, monkeypatch):
    import huggingface_hub

    def no_hub(*args, **kwargs):  # a path must never reach the hub
        raise AssertionError(f"tried {args} on the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    base, finetuned = (spec, llama_kit.finetuned_dir) if role == "base" else (llama_kit.base_dir, spec)
    expected = f"base model not found: {spec}" if role == "base" else f"fine-tune 'math' not found: {spec}"
    _user_error(_invoke(["check", "-m", base, "-f", f"{TASK}={finetuned}"]), expected)


def test_hub_ids_still_go_to_the_hub(llama_kit, monkeypatch):
    import huggingface_hub

    from submerge.diagnostics.checkpoints import local_path, looks_like_path

    for hub_id in ("gpt2", "meta-llama/Llama-2-7b-hf", "Qwen/Qwen2.5-7B", "org/model.v1"):
        assert not looks_like_path(hub_id), hub_id
    for path in ("./x", "/x", "~/x", "x.safetensors", "a/b/c", "x/", "has space", "a--b/c"):
        assert looks_like_path(path), path
    asked = []

    def offline(repo_id, **kwargs):
        asked.append(repo_id)
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelInputError, match=r"fine-tune 'x' 'someone/some-model': no such local file or folder, "
                                              r"and could not get it from the Hugging Face hub \(OSError: offline\)"):
        local_path("someone/some-model", role="fine-tune 'x'")
    assert asked == ["someone/some-model"]


# ------------------------------------------------------------------ diag report on damaged or partial stores


@pytest.fixture(scope="module")
def small_store(llama_kit, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "run.zarr"
    result = _invoke(_linearity(llama_kit, out))
    assert result.exit_code == 0, result.output
    return out


def _copy(store, tmp_path):
    target = tmp_path / "copy.zarr"
    shutil.copytree(store, target)
    return target


def _chunks(store):
    return sorted(p for p in (store / "linearity" / "nonlinearity_score" / "c").rglob("*") if p.is_file())


def test_report_names_a_truncated_chunk(small_store, tmp_path):
    store = _copy(small_store, tmp_path)
    chunk = _chunks(store)[0]
    chunk.write_bytes(chunk.read_bytes()[: len(chunk.read_bytes()) // 2])
    _user_error(_invoke(["report", store, "--out", tmp_path / "fig"]), "linearity: corrupt",
                f"chunk file {chunk} cannot be decoded")


def test_report_names_a_truncated_metadata_file(small_store, tmp_path):
    store = _copy(small_store, tmp_path)
    for meta in (store / "linearity" / "zarr.json", store / "linearity" / "nonlinearity_score" / "zarr.json"):
        original = meta.read_bytes()
        meta.write_bytes(original[: len(original) // 2])
        _user_error(_invoke(["report", store, "--out", tmp_path / "fig"]), f"{meta} is unreadable")
        meta.write_bytes(original)
    _user_error(_invoke(["report", tmp_path / "none.zarr"]), "no store at")


def test_report_marks_incomplete_groups(small_store, tmp_path):
    store = _copy(small_store, tmp_path)
    result = _invoke(["report", store, "--out", tmp_path / "fig"])
    assert result.exit_code == 0 and "partial data" not in result.output, result.output
    meta = store / "linearity" / "zarr.json"
    document = json.loads(meta.read_text())
    document["attributes"].update({"complete": False, "units_done": 2, "units_expected": 4})
    meta.write_text(json.dumps(document))
    result = _invoke(["report", store, "--out", tmp_path / "fig"])
    assert result.exit_code == 0, result.output
    assert ("partial data: group linearity: partial: 2 of 4 units written; run the same command again to finish it "
            "(its tables and figures show only those units)") in _flat(result.output)


def test_report_names_a_deleted_chunk(small_store, tmp_path):
    store = _copy(small_store, tmp_path)
    chunk = _chunks(store)[-1]
    chunk.unlink()
    _user_error(_invoke(["report", store, "--out", tmp_path / "fig"]), f"chunk file {chunk} is missing")


def test_report_on_a_store_with_a_stale_lock_says_nothing_about_the_lock(small_store, tmp_path):
    """A killed run leaves <store>/.submerge.lock: zarr must not warn that it is 'not a component'."""
    store = _copy(small_store, tmp_path)
    (store / ".submerge.lock").write_text(json.dumps({"pid": 2 ** 22 + 1, "host": "elsewhere"}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _invoke(["report", store, "--out", tmp_path / "fig"])
    assert result.exit_code == 0, result.output
    assert not [w for w in caught if ".submerge.lock" in str(w.message)], [str(w.message) for w in caught]
    assert ".submerge.lock" not in result.output


# ------------------------------------------------------------------ string coordinates


def test_string_coordinates_read_back_as_str(small_store):
    from submerge.diagnostics.store import Store

    dataset = Store(small_store).dataset("linearity")
    assert list(dataset.level.values.astype(str)) == ["layer", "layer", "layer"]
    assert list(dataset.module.values.astype(str)) == ["layers.0", "layers.1", "layers.2"]


# ------------------------------------------------------------------ plans keep working from another folder


def test_plan_paths_work_from_the_plan_folder(llama_kit, tmp_path, monkeypatch):
    import yaml

    from submerge.merge.plan import Plan

    kit_root = llama_kit.base_dir.parent
    monkeypatch.chdir(kit_root)  # the user names models relative to where they run diag
    base, tuned = llama_kit.base_dir.name, llama_kit.finetuned_dir.name
    store, plans = tmp_path / "run.zarr", tmp_path / "plans"
    alpha = ["alpha", "-m", base, "-f", f"{TASK}={tuned}", "-d", f"{TASK}={llama_kit.data_path}", "-o", store,
             "--granularity", "layer", "--samples", "2", "--max-tokens", "16", "--device", "cpu", "--no-progress"]
    assert _invoke(alpha).exit_code == 0
    result = _invoke(["plan", store, "--out", plans / "plan.yaml", "--granularity", "layer"])
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((plans / "plan.yaml").read_text())
    assert saved["base_model"] == str(llama_kit.base_dir) and saved["finetuned"] == {TASK: str(llama_kit.finetuned_dir)}
    monkeypatch.chdir(plans)
    result = _invoke(["merge", "plan.yaml", "--out", "merged", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert (plans / "merged" / "config.json").exists()
    # a plan written by hand with paths relative to its own folder
    shutil.copytree(llama_kit.base_dir, plans / "base")
    saved.update(base_model="base", finetuned={TASK: "../../" + str(llama_kit.finetuned_dir.relative_to("/"))})
    (plans / "hand.yaml").write_text(yaml.safe_dump(saved))
    monkeypatch.chdir(tmp_path)
    loaded = Plan.load(plans / "hand.yaml")
    assert loaded.base_model == str(plans / "base")
    assert loaded.finetuned == {TASK: saved["finetuned"][TASK]}  # not next to the plan: left as written


# ------------------------------------------------------------------ the README's figures


def test_every_image_the_readme_shows_is_in_the_repository():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", (root / "README.md").read_text())
    assert "docs/figures/nonlinearity_per_layer.png" in images and "docs/figures/interference_per_layer.png" in images
    missing = [image for image in images if not (root / image).is_file()]
    assert not missing, f"README shows images that are not in the repository: {missing}"


# ------------------------------------------------------------------ notebooks on the README's store (linearity only)


@pytest.mark.parametrize("name", ["01_linearity", "03_choose_granularity_and_merge"])
def test_notebooks_run_on_a_linearity_only_store(small_store, name, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    import nbformat

    from submerge.diagnostics.store import Store

    assert Store(small_store).groups() == ["linearity"]  # what `diag linearity --out runs/demo.zarr` writes
    notebooks = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
    monkeypatch.setenv("SUBMERGE_STORE", str(small_store))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    notebook = nbformat.read(os.path.join(notebooks, f"{name}.ipynb"), as_version=4)
    nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": notebooks}}).execute()  # raises on a failing cell
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = _flat("".join(o.get("text", "") for o in outputs if o.output_type == "stream"))
    if name.startswith("03"):
        assert "missing group 'alpha' (required for a plan and a merge" in text
        assert f"add it with: diag alpha --granularity attn-mlp --out {small_store}" in text
        assert "→ granularity: None" in text and "submerge.merge.plan cannot plan on this store yet" in text
    else:
        assert "no group 'projection' in this store" in text

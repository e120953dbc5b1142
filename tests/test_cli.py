"""The `diag` command line on tiny local models: help, a real run, --config, and clear errors (exit code 2)."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from submerge.cli.main import app
from submerge.diagnostics.store import Store

TASK = "math"
WIDE = {"COLUMNS": "400"}  # no line wrapping of messages by rich


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


def _flat(text: str) -> str:
    return " ".join(text.split())


def _invoke(runner, arguments: list[str]):
    return runner.invoke(app, [str(a) for a in arguments], env=WIDE)


def _linearity_arguments(kit, out, *extra):
    return ["linearity", "--model", kit.base_dir, "--finetuned", f"{TASK}={kit.finetuned_dir}",
            "--data", f"{TASK}={kit.data_path}", "--out", out, "--samples", "2", "--steps", "2",
            "--levels", "layer,model", "--max-tokens", "24", "--device", "cpu", "--no-progress", *extra]


def _assert_user_error(result, *fragments: str) -> None:
    """Exit code 2, the message on the terminal, no traceback."""
    output = _flat(result.output)
    assert result.exit_code == 2, output
    assert isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in output, (fragment, output)


def test_help_lists_the_commands(runner):
    result = _invoke(runner, ["--help"])
    assert result.exit_code == 0
    for command in ("linearity", "projection", "alpha", "check"):
        assert command in result.output
    result = _invoke(runner, ["linearity", "--help"])
    assert result.exit_code == 0
    for option in ("--model", "--finetuned", "--data", "--config", "--force", "--allow-pickle",
                   "--trust-remote-code", "--vocab", "--no-progress"):
        assert option in result.output
    import typer.main

    for name, command in typer.main.get_command(app).commands.items():
        defaults = {p.name: p.default for p in command.params}
        if "trust_remote_code" in defaults:
            assert defaults["trust_remote_code"] is False, name
        if "allow_pickle" in defaults:
            assert defaults["allow_pickle"] is False, name


def test_linearity_writes_a_store(runner, llama_kit, tmp_path):
    out = tmp_path / "run.zarr"
    result = _invoke(runner, _linearity_arguments(llama_kit, out))
    assert result.exit_code == 0, result.output
    assert "Non-linearity Score" in result.output and "Wrote group linearity" in _flat(result.output)
    store = Store(out)
    assert store.is_complete("linearity")
    dataset = store.dataset("linearity")
    assert list(dataset.module.values) == ["layers.0", "layers.1", "layers.2", "model"]
    assert dataset.sizes["sample"] == 2
    assert store.attrs["command"].startswith("diag")
    # the same command again resumes a finished run: nothing to redo, same numbers
    again = _invoke(runner, _linearity_arguments(llama_kit, out))
    assert again.exit_code == 0, again.output
    assert store.dataset("linearity").nonlinearity_score.equals(dataset.nonlinearity_score)
    # other settings in the same store: a clear error unless --force
    other = _invoke(runner, [*_linearity_arguments(llama_kit, out), "--steps", "3"])
    _assert_user_error(other, "already has group 'linearity' made with other settings", "steps: 2 → 3", "--force")
    forced = _invoke(runner, [*_linearity_arguments(llama_kit, out), "--steps", "3", "--force"])
    assert forced.exit_code == 0, forced.output
    assert Store(out)._root("r")["linearity"].attrs["settings"]["steps"] == 3


def test_config_file_gives_the_options(runner, llama_kit, tmp_path):
    out = tmp_path / "configured.zarr"
    config = {"model": str(llama_kit.base_dir), "finetuned": {TASK: str(llama_kit.finetuned_dir)},
              "data": {TASK: str(llama_kit.data_path)}, "out": str(out), "samples": 3, "steps": 2,
              "levels": "attn,mlp", "max-tokens": 24, "device": "cpu", "progress": False}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = _invoke(runner, ["linearity", "--config", path, "--steps", "3"])  # the command line wins
    assert result.exit_code == 0, result.output
    settings = Store(out)._root("r")["linearity"].attrs["settings"]
    assert settings["samples"] == 3 and settings["steps"] == 3 and settings["levels"] == ["attn", "mlp"]
    assert settings["max_tokens"] == 24
    path.write_text(yaml.safe_dump({**config, "stepz": 4}))
    _assert_user_error(_invoke(runner, ["linearity", "--config", path]), "unknown option(s) ['stepz']")
    path.write_text("model: [unclosed")
    _assert_user_error(_invoke(runner, ["linearity", "--config", path]), "not valid YAML")
    _assert_user_error(_invoke(runner, ["linearity", "--config", tmp_path / "nope.yaml"]), "not found")


def test_bad_data_line_is_named(runner, llama_kit, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{"text": oops}\n')
    arguments = _linearity_arguments(llama_kit, tmp_path / "o.zarr")
    arguments[arguments.index("--data") + 1] = f"{TASK}={data}"
    _assert_user_error(_invoke(runner, arguments), f"{data}:2: not valid JSON")
    data.write_text("")
    _assert_user_error(_invoke(runner, arguments), "has no records")


def test_bad_options_are_usage_errors(runner, llama_kit, tmp_path):
    out = tmp_path / "o.zarr"
    _assert_user_error(_invoke(runner, [*_linearity_arguments(llama_kit, out), "--levels", "layer,neuron"]),
                       "unknown level(s) ['neuron']")
    _assert_user_error(_invoke(runner, [*_linearity_arguments(llama_kit, out), "--model-output", "probs"]),
                       "--model-output must be hidden or logits")
    arguments = _linearity_arguments(llama_kit, out)
    arguments[arguments.index("--finetuned") + 1] = "just-a-path"
    _assert_user_error(_invoke(runner, arguments), "--finetuned expects NAME=PATH")
    _assert_user_error(_invoke(runner, ["check", "--finetuned", f"x={llama_kit.finetuned_dir}"]),
                       "--finetuned given without --model")
    _assert_user_error(_invoke(runner, [*_linearity_arguments(llama_kit, out), "--dtype", "float8"]),
                       "unknown dtype 'float8'")
    assert not out.exists()


def test_check_accepts_a_matching_finetune(runner, llama_kit):
    result = _invoke(runner, ["check", "-m", llama_kit.base_dir, "-f", f"{TASK}={llama_kit.finetuned_dir}", "--scan"])
    assert result.exit_code == 0, result.output
    assert "ok: 1 fine-tune(s) match" in _flat(result.output) and "no NaN/Inf" in result.output


def test_check_refuses_another_architecture(runner, toy_kit):
    result = _invoke(runner, ["check", "-m", toy_kit("llama").base_dir, "-f", f"gpt={toy_kit('gpt2').finetuned_dir}"])
    _assert_user_error(result, "error:", "gpt: missing 'model.layers.0.self_attn.q_proj.weight'",
                       "extra 'transformer.h.0.attn.c_attn.weight'")


def test_check_scan_names_nan_tensor(runner, llama_kit, tmp_path):
    tensors = load_file(llama_kit.finetuned_dir / "model.safetensors")
    tensors["model.layers.1.mlp.gate_proj.weight"][0, 0] = float("nan")
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    arguments = ["check", "-m", llama_kit.base_dir, "-f", f"{TASK}={broken}"]
    assert _invoke(runner, arguments).exit_code == 0  # headers match
    _assert_user_error(_invoke(runner, [*arguments, "--scan"]), "'model.layers.1.mlp.gate_proj.weight'",
                       str(broken / "model.safetensors"), "NaN/Inf")


def test_check_vocabulary_policies(runner, llama_kit, tmp_path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_kit.finetuned_dir, dtype=torch.float32)
    model.resize_token_embeddings(260)
    model.save_pretrained(tmp_path / "grown")
    arguments = ["check", "-m", llama_kit.base_dir, "-f", f"{TASK}={tmp_path / 'grown'}"]
    with pytest.warns(UserWarning, match="260 vocabulary rows, the base 258"):
        result = _invoke(runner, arguments)
    assert result.exit_code == 0, result.output
    assert "math: model.embed_tokens.weight uses the base's 258 of 260 vocabulary rows" in _flat(result.output)
    _assert_user_error(_invoke(runner, [*arguments, "--vocab", "error"]),
                       "'model.embed_tokens.weight' has shape (260, 32), base (258, 32)")


def test_pickled_base_needs_allow_pickle(runner, llama_kit, tmp_path):
    import shutil

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for file in llama_kit.base_dir.glob("*.json"):
        shutil.copy(file, pickled / file.name)
    import torch

    torch.save(load_file(llama_kit.base_dir / "model.safetensors"), pickled / "pytorch_model.bin")
    arguments = ["check", "-m", pickled, "-f", f"{TASK}={llama_kit.finetuned_dir}"]
    _assert_user_error(_invoke(runner, arguments), "pickled checkpoint", "--allow-pickle")
    result = _invoke(runner, [*arguments, "--allow-pickle"])
    assert result.exit_code == 0, result.output


def test_unknown_model_path(runner, llama_kit, tmp_path):
    _assert_user_error(_invoke(runner, ["check", "-m", tmp_path / "missing", "-f", f"x={llama_kit.finetuned_dir}"]),
                       "base model not found", str(tmp_path / "missing"))


def test_unrecognised_architecture(runner, llama_kit, tmp_path):
    """A real model without attention + MLP blocks (Mamba): the error lists what was found."""
    import transformers

    from submerge.diagnostics.toy import byte_tokenizer

    config = transformers.MambaConfig(vocab_size=258, hidden_size=16, state_size=4, num_hidden_layers=2,
                                      pad_token_id=256, eos_token_id=257, bos_token_id=257)
    mamba = tmp_path / "mamba"
    transformers.MambaForCausalLM(config).save_pretrained(mamba)
    byte_tokenizer().save_pretrained(mamba)
    result = _invoke(runner, ["linearity", "-m", mamba, "-f", f"{TASK}={mamba}", "-d", f"{TASK}={llama_kit.data_path}",
                              "-o", tmp_path / "o.zarr", "--device", "cpu", "--no-progress"])
    _assert_user_error(result, "could not find transformer blocks in MambaForCausalLM",
                       "backbone.layers (2 x MambaBlock)")


@pytest.mark.xdist_group("ray")  # one xdist worker runs every Ray test (conftest: --dist loadgroup)
def test_ray_options_are_shared_and_checked(runner, llama_kit, tmp_path, monkeypatch):
    """--ray/--workers/--gpus-per-worker: one definition for every command; a worker count needs --ray, and
    --ray needs the ray extra; with --ray auto the store is bitwise the one-process store."""
    out = tmp_path / "o.zarr"
    _assert_user_error(_invoke(runner, [*_linearity_arguments(llama_kit, out), "--workers", "2"]),
                       "--workers 2 need(s) --ray auto")
    _assert_user_error(_invoke(runner, ["interference", "--model", llama_kit.base_dir, "--finetuned",
                                        f"{TASK}={llama_kit.finetuned_dir}", "--gpus-per-worker", "1"]),
                       "--gpus-per-worker 1 need(s) --ray")
    _assert_user_error(_invoke(runner, ["merge", "--method", "ties", "--model", llama_kit.base_dir, "--finetuned",
                                        f"{TASK}={llama_kit.finetuned_dir}", "--out", tmp_path / "m", "--workers",
                                        "3"]), "--workers 3 need(s) --ray")
    import importlib.util

    find_spec = importlib.util.find_spec
    with monkeypatch.context() as patched:
        patched.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
        _assert_user_error(_invoke(runner, [*_linearity_arguments(llama_kit, out), "--ray", "auto"]),
                           "pip install 'submerge[ray]'")
    assert not out.exists()
    pytest.importorskip("ray")
    one = _invoke(runner, _linearity_arguments(llama_kit, tmp_path / "one.zarr"))
    spread = _invoke(runner, [*_linearity_arguments(llama_kit, tmp_path / "ray.zarr"), "--ray", "auto",
                              "--workers", "2"])
    assert one.exit_code == 0 and spread.exit_code == 0, spread.output
    first, second = Store(tmp_path / "one.zarr").dataset("linearity"), Store(tmp_path / "ray.zarr").dataset("linearity")
    assert np.array_equal(first.nonlinearity_score.values, second.nonlinearity_score.values, equal_nan=True)
    settings = [Store(tmp_path / name)._root("r")["linearity"].attrs["settings"] for name in ("one.zarr", "ray.zarr")]
    assert settings[0] == settings[1]  # the Ray driver (base on the meta device) records the same settings


def test_interference_matrices_option(runner, llama_kit, tmp_path):
    """--matrices: only the matrices the patterns select are measured and stored; a pattern matching nothing is
    exit 2 naming it."""
    from submerge.diagnostics.store import Store

    out = tmp_path / "i.zarr"
    common = ["interference", "--model", llama_kit.base_dir, "--finetuned", f"{TASK}={llama_kit.finetuned_dir}",
              "--device", "cpu", "--no-progress", "--rank-fracs", "0.5,1"]
    result = _invoke(runner, [*common, "--out", out, "--matrices", "*.layers.1.mlp.*, *.layers.0.self_attn.q_proj.weight"])
    assert result.exit_code == 0, result.output
    stored = [str(m) for m in Store(out).dataset("interference")["matrix"].values]
    assert stored == ["model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.gate_proj.weight",
                      "model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"]  # order given
    _assert_user_error(_invoke(runner, [*common, "--out", tmp_path / "j.zarr", "--matrices", "*.experts.*"]),
                       "pattern '*.experts.*' matches no weight matrix")


def test_interference_exact_svd_option(runner, llama_kit, tmp_path):
    """--exact-svd: the exact route, recorded in the store (settings.svd); the default is the Gram route, whose figures
    agree to its bound; --help explains the option."""
    import numpy as np

    from submerge.diagnostics.store import Store

    common = ["interference", "--model", llama_kit.base_dir, "--finetuned", f"{TASK}={llama_kit.finetuned_dir}",
              "--device", "cpu", "--no-progress", "--rank-fracs", "0.5,1", "--matrices", "*.layers.0.*"]
    for name, extra in (("exact.zarr", ["--exact-svd"]), ("gram.zarr", [])):
        result = _invoke(runner, [*common, "--out", tmp_path / name, *extra])
        assert result.exit_code == 0, result.output
    exact, gram = (Store(tmp_path / name) for name in ("exact.zarr", "gram.zarr"))
    assert exact.group_attrs("interference")["settings"]["svd"] == "exact"
    assert gram.group_attrs("interference")["settings"]["svd"] == "gram"
    first, second = exact.dataset("interference"), gram.dataset("interference")
    for key in ("sar", "row_space_interference", "reconstruction_error"):
        np.testing.assert_allclose(second[key].values, first[key].values, rtol=1e-4, atol=1e-12, err_msg=key)
    assert "--exact-svd" in _invoke(runner, ["interference", "--help"]).output


def test_error_messages_are_one_unwrapped_line_and_not_markup(monkeypatch, capsys):
    """A long path stays whole in the error (rich would break it at the console width: a narrow console here),
    and brackets in a message are printed, not read as rich markup."""
    import typer
    from rich.console import Console

    from submerge.cli import common
    from submerge.diagnostics.errors import DataInputError

    monkeypatch.setattr(common, "console", Console(stderr=True, width=40, soft_wrap=common.console.soft_wrap))
    long_path = "/tmp/" + "a" * 60 + "/bad.jsonl:2"

    @common.user_errors
    def failing():
        raise DataInputError(f"{long_path}: not valid JSON [bold] ['x']")

    with pytest.raises(typer.Exit):
        failing()
    err = capsys.readouterr().err
    assert f"{long_path}: not valid JSON [bold] ['x']" in err


def test_progress_in_a_redirected_log_is_timestamped_lines(monkeypatch):
    """Output redirected to a file: a line when a task starts, when its description changes, when it completes,
    and every `interval` seconds while it advances (a live bar would show nothing until it ends); the time left at
    the mean rate so far while a task is under way."""
    import io

    from rich.console import Console

    from submerge.diagnostics import progress as module

    log = io.StringIO()
    monkeypatch.setattr(module, "get_console", lambda: Console(file=log, width=200))
    now = [0.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: now[0])

    def at(seconds: float, call, *args, **kwargs):
        now[0] = seconds
        return call(*args, **kwargs)

    with module.progress_bar(True) as bar:
        assert isinstance(bar, module.LoggedProgress)
        job = at(0, bar.add_task, "Comparing", total=3)  # line 1
        at(1, bar.advance, job)  # quiet
        at(2, bar.update, job, description="Comparing · ties")  # renamed → line 2
        at(61, bar.advance, job)  # 59 s since the last line: quiet
        at(62, bar.update, job)  # 60 s → line 3
        at(80, bar.advance, job)  # complete → line 4
        at(81, bar.advance, job)  # already complete, 1 s since the last line: quiet
    lines = log.getvalue().splitlines()
    assert [line.split(" ", 1)[1] for line in lines] == [
        "Comparing · 0/3 · 0 s", "Comparing · ties · 1/3 · 2 s · about 4 s left",
        "Comparing · ties · 2/3 · 62 s · about 31 s left", "Comparing · ties · 3/3 · 80 s"]
    assert [module._duration(s) for s in (0.4, 119, 120, 7199, 7200, 13_320)] == [
        "0 s", "119 s", "2 min", "120 min", "2.0 h", "3.7 h"]
    with module.progress_bar(False) as silent:
        assert not isinstance(silent, module.LoggedProgress)

"""The merge side never lies (issue 26): every input fingerprinted, plans validated before anything runs, NaN never a
silent result, hostile files refused before any large allocation, Ray errors as messages, leftovers named.

Each test is a defect of the second hostile campaign, run as a user would (the CLI in process, or the Python API);
on the code before this change each one failed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from submerge.cli.main import app
from submerge.diagnostics import toy
from submerge.diagnostics.errors import CheckpointMismatch, ModelInputError, StoreError
from submerge.diagnostics.store import Store

WIDE = {"COLUMNS": "400"}


def _invoke(*arguments):
    return CliRunner().invoke(app, [str(a) for a in arguments], env=WIDE)


def _flat(text: str) -> str:
    return " ".join(text.split())


def _refused(result, *fragments: str, code: int = 2) -> str:
    """The exit code, every fragment in the message, no traceback; returns the flattened output."""
    output = _flat(result.output)
    assert result.exit_code == code, output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in output, (fragment, output)
    return output


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """A 2-block llama base, two stand-in fine-tunes (math, code), their task data, and a copy of the base."""
    root = tmp_path_factory.mktemp("trust_kit")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = toy.build_model(root / "base", "llama", layers=2, hidden=32)
    tuned = toy.perturbed_finetunes(base, ["math", "code"])
    data = {task: toy.write_task_data(root / f"{task}.jsonl", task, count=16) for task in ("math", "code")}
    same = root / "same"
    shutil.copytree(base, same)
    return {"root": root, "base": base, "math": tuned["math"], "code": tuned["code"], "data": data, "same": same}


def _models(kit, math=None, code=None) -> list[str]:
    return ["--model", kit["base"], "-f", f"math={math or kit['math']}", "-f", f"code={code or kit['code']}"]


def _data(kit) -> list[str]:
    return ["--data", f"math={kit['data']['math']}", "--data", f"code={kit['data']['code']}"]


RUN = ["--device", "cpu", "--no-progress"]


# ====================================================================== inputs fingerprinted, not named


def test_eval_refuses_a_merged_model_that_changed_under_its_path(kit, tmp_path):
    merged, store = tmp_path / "merged", tmp_path / "eval.zarr"
    assert _invoke("merge", "--method", "task-arithmetic", *_models(kit), "--out", merged, "--no-progress").exit_code == 0
    evaluate = ["eval", *_models(kit), *_data(kit), "--merged", f"m={merged}", "--skip", "8", "--samples", "2",
                "--max-tokens", "32", "--out", store, *RUN]
    assert _invoke(*evaluate).exit_code == 0
    before = Store(store).dataset("eval").loss.sel(model="m").values
    remerge = ["merge", "--method", "task-arithmetic", "--option", "scaling=3", *_models(kit), "--out", merged,
               "--force", "--no-progress"]
    assert _invoke(*remerge).exit_code == 0
    _refused(_invoke(*evaluate), "model 'm'", str(merged), "--force")  # not the old loss reprinted
    assert _invoke(*evaluate, "--force").exit_code == 0
    assert not np.array_equal(Store(store).dataset("eval").loss.sel(model="m").values, before)



def test_eval_refuses_a_store_whose_losses_were_computed_by_another_rule(kit, tmp_path):
    """A store written before the loss rule changed (stop 46: its group's settings have no `loss`) is not resumed
    with losses computed by the new rule: refused, naming the setting; --force recomputes it."""
    store = tmp_path / "eval.zarr"
    evaluate = ["eval", *_models(kit), *_data(kit), "--skip", "8", "--samples", "2", "--max-tokens", "32", "--out",
                store, *RUN]
    assert _invoke(*evaluate).exit_code == 0
    written = Store(store)
    attrs = written.group_attrs("eval")
    assert attrs["settings"]["loss"]
    written._put_attrs("eval", {**attrs, "settings": {k: v for k, v in attrs["settings"].items() if k != "loss"}})
    _refused(_invoke(*evaluate), "loss", "--force")
    assert _invoke(*evaluate, "--force").exit_code == 0

def test_eval_labels_are_unique_across_finetuned_and_merged(kit, tmp_path):
    result = _invoke("eval", *_models(kit), *_data(kit), "--merged", f"math={kit['same']}", "--out",
                     tmp_path / "e.zarr", *RUN)
    output = _flat(result.output)
    assert result.exit_code == 2 and "the label 'math' also names the fine-tune -f math=" in output, output
    assert not (tmp_path / "e.zarr").exists()


def _measured(kit, store, math, code, *, alpha: bool = True, linearity: bool = True, interference: bool = False):
    """linearity, alpha/layer (and interference) of fine-tunes `math` and `code` into `store`."""
    inputs = [*_models(kit, math, code), *_data(kit), "--out", store, *RUN]
    small = ["--samples", "4", "--max-tokens", "32"]
    if linearity:
        assert _invoke("linearity", *inputs, *small, "--levels", "model,layer", "--steps", "2").exit_code == 0
    if alpha:
        assert _invoke("alpha", *inputs, *small, "--granularity", "layer").exit_code == 0
    if interference:
        assert _invoke("interference", *_models(kit, math, code), "--out", store, "--rank-fracs", "1",
                       *RUN).exit_code == 0


def test_compare_thresholds_refuses_alpha_fitted_on_other_models(kit, tmp_path):
    store = tmp_path / "s.zarr"
    _measured(kit, store, kit["code"], kit["math"])  # the fine-tunes swapped: α of other models
    result = _invoke("compare", *_models(kit), *_data(kit), "--methods", "plan", "--choose", "thresholds",
                     "--fit", "4", "--samples", "2", "--max-tokens", "32", "--out", store, *RUN)
    _refused(result, "--choose thresholds", "fitted on other models", "fine-tune 'math'")
    assert not Store(store).has("compare")  # refused before its group was created


def test_compare_refuses_interference_measured_on_other_models(kit, tmp_path):
    store = tmp_path / "s.zarr"
    _measured(kit, store, kit["code"], kit["math"], alpha=False, linearity=False, interference=True)
    result = _invoke("compare", *_models(kit), *_data(kit), "--methods", "plan", "--fit", "4", "--samples", "2",
                     "--max-tokens", "32", "--out", store, *RUN)
    _refused(result, "'interference' group", "measured on other models")
    assert not Store(store).has("compare")


def test_plan_refuses_linearity_of_other_models(kit, tmp_path):
    store = tmp_path / "s.zarr"
    _measured(kit, store, kit["code"], kit["math"], alpha=False)
    _measured(kit, store, kit["math"], kit["code"], linearity=False)
    _refused(_invoke("plan", store, "--out", tmp_path / "plan.yaml", "--granularity", "layer"),
             "group 'linearity' was measured on other models than alpha/layer")


def test_merge_refuses_a_plan_made_for_other_weights(kit, tmp_path):
    store, plan = tmp_path / "s.zarr", tmp_path / "plan.yaml"
    math = tmp_path / "math"
    shutil.copytree(kit["math"], math)
    _measured(kit, store, math, kit["code"], linearity=False)
    assert _invoke("plan", store, "--out", plan, "--granularity", "layer").exit_code == 0
    assert yaml.safe_load(plan.read_text())["provenance"]["models"]["finetuned"]["math"]["content_sha256"]
    tensors = load_file(math / "model.safetensors")
    save_file({name: tensor * 1.01 for name, tensor in tensors.items()}, math / "model.safetensors")  # retrained
    _refused(_invoke("merge", plan, "--out", tmp_path / "merged", "--no-progress"),
             "made for other weights", "fine-tune 'math'")
    assert not (tmp_path / "merged").exists()


# ====================================================================== plans validated before anything runs


def _hand_plan(kit, path: Path, **changes) -> Path:
    plan = {"submerge_plan": 1, "base_model": str(kit["base"]),
            "finetuned": {"math": str(kit["math"]), "code": str(kit["code"])}, "granularity": "layer",
            "alpha": {"layers.0": {"math": 0.5, "code": 0.5}, "layers.1": {"math": 0.4, "code": 0.6}}}
    plan.update(changes)
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


@pytest.mark.parametrize(("changes", "fragments"), [
    ({"alpha": {"layers.0": {"mth": 0.5, "code": 0.5}, "layers.1": {"math": 0.4, "code": 0.6}}},
     ["line 9: alpha.layers.0.mth: 'mth' is no fine-tune of this plan", "no weight for fine-tune(s) ['math']"]),
    ({"alpha": {"layers.0": {"math": 0.5}, "layers.1": {"math": 0.4, "code": 0.6}}},
     ["alpha.layers.0: no weight for fine-tune(s) ['code']"]),
    ({"rest": {"method": "tiez"}}, ["rest.method: unknown merge method 'tiez'"]),
    ({"matrix_rules": {"model.layers.0.mlp.up_proj.weight": {"method": "ties", "options": {"top_kk": 1}}}},
     ["matrix_rules.model.layers.0.mlp.up_proj.weight.method:", "top_kk"]),
    ({"alpha": {"layers.0": {"math": float("nan"), "code": 0.5}, "layers.1": {"math": 0.4, "code": 0.6}}},
     ["alpha.layers.0.math: expected a finite number, got nan"]),
    ({"alpha": {"layers.0": {"math": "half", "code": 0.5}, "layers.1": {"math": 0.4, "code": 0.6}}},
     ["line 9: alpha.layers.0.math: expected a finite number, got 'half'"]),
    ({"alpha": {"layers.0.attn": {"math": 0.5, "code": 0.5}}}, ["'layers.0.attn' is no unit of granularity layer"]),
    ({"granularity": "per-block"}, ["granularity: unknown granularity 'per-block'"]),
    ({"fallback": "zero"}, ["fallback: expected mean"]),
    ({"alpha_": {}}, ["unknown key(s) ['alpha_']"]),
])
def test_a_hand_edited_plan_is_refused_before_anything_runs(kit, tmp_path, changes, fragments):
    plan = _hand_plan(kit, tmp_path / "plan.yaml", **changes)
    _refused(_invoke("merge", plan, "--out", tmp_path / "merged", "--no-progress"), *fragments)
    assert not (tmp_path / "merged").exists()


def test_a_plan_lacking_a_unit_is_refused_unless_it_asks_for_the_mean(kit, tmp_path):
    alpha = {"layers.0": {"math": 0.5, "code": 0.5}}
    missing = _hand_plan(kit, tmp_path / "missing.yaml", alpha=alpha)
    _refused(_invoke("merge", missing, "--out", tmp_path / "m1", "--no-progress"),
             "no α for 1 unit(s) of the granularity: ['layers.1']", "fallback: mean")
    extra = _hand_plan(kit, tmp_path / "extra.yaml", alpha={**alpha, "layers.1": alpha["layers.0"],
                                                             "layers.7": alpha["layers.0"]})
    _refused(_invoke("merge", extra, "--out", tmp_path / "m2", "--no-progress"),
             "α for unit(s) the model does not have at this granularity: ['layers.7'] (2 blocks)")
    mean = _hand_plan(kit, tmp_path / "mean.yaml", alpha=alpha, fallback="mean")
    assert _invoke("merge", mean, "--out", tmp_path / "m3", "--no-progress").exit_code == 0
    merged, base = load_file(tmp_path / "m3" / "model.safetensors"), load_file(kit["base"] / "model.safetensors")
    tuned = {t: load_file(kit[t] / "model.safetensors") for t in ("math", "code")}
    name = "model.layers.1.mlp.up_proj.weight"  # in the unit without α: the mean task vector
    expected = base[name] + 0.5 * ((tuned["math"][name] - base[name]) + (tuned["code"][name] - base[name]))
    torch.testing.assert_close(merged[name], expected, rtol=0, atol=1e-6)


def test_plan_yaml_is_read_safely(kit, tmp_path):
    bomb = tmp_path / "bomb.yaml"
    lines = ["submerge_plan: 1", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]  # 10⁹ nodes expanded
    bomb.write_text("\n".join(lines) + "\n")
    start = time.perf_counter()
    _refused(_invoke("compare", *_models(kit), *_data(kit), "--plan", bomb, "--plan-out", tmp_path / "out.yaml",
                     "--out", tmp_path / "s.zarr", *RUN), "expands to more than 1,000,000 nodes through its aliases")
    assert time.perf_counter() - start < 30 and not (tmp_path / "s.zarr").exists()
    cases = {"tag.yaml": ("submerge_plan: 1\nbase_model: !!python/object/apply:os.system ['echo hi']\n",
                          ("line 2, column 13: not valid YAML: the tag "
                           "'tag:yaml.org,2002:python/object/apply:os.system' is not allowed")),
             "broken.yaml": ("submerge_plan: 1\nalpha: {layers.0: [1, 2}\n", "line 2, column 24: not valid YAML"),
             "types.yaml": ("submerge_plan: 1\nbase_model: x\nfinetuned: [a, b]\ngranularity: layer\nalpha: {}\n",
                            "finetuned: expected a mapping of fine-tune name → model")}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        _refused(_invoke("merge", tmp_path / name, "--out", tmp_path / "m", "--no-progress"), message)
    huge = tmp_path / "huge.yaml"
    huge.write_text("submerge_plan: 1\n" + "#" * (17 << 20) + "\n")
    _refused(_invoke("merge", huge, "--out", tmp_path / "m", "--no-progress"), "more than the 16,777,216 accepted")


# ====================================================================== NaN never a silent result


@pytest.mark.parametrize("records", [["x", "y"], ["<pad>", "<pad>"]], ids=["one-token", "pad-only"])
def test_eval_refuses_a_task_whose_loss_cannot_be_computed(kit, tmp_path, records):
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"text": text}) + "\n" for text in records))
    result = _invoke("eval", "--model", kit["base"], "-f", f"math={kit['math']}", "--data", f"math={short}",
                     "--skip", "0", "--samples", "2", "--out", tmp_path / "e.zarr", *RUN)
    _refused(result, "task 'math': none of the 2 held-out records", "has two tokens or more",
             "a next-token loss needs at least two")


def test_eval_warns_about_records_too_short_to_score(kit, tmp_path):
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"text": "a longer record"}) + "\n")
    from submerge.diagnostics.evaluate import evaluate

    with pytest.warns(UserWarning, match=r"1 of the 2 held-out records .* have fewer than two tokens \(records \[0\]\)"):
        result = evaluate(str(kit["base"]), {}, {"math": str(mixed)}, skip=0, samples=2, device="cpu",
                          progress=False)
    assert np.isfinite(result.loss.values).all()


def test_check_flags_a_fine_tune_equal_to_its_base(kit, tmp_path):
    _refused(_invoke("check", *_models(kit, code=kit["same"])), "zero update", "fine-tune 'code'", code=1)
    _refused(_invoke("check", *_models(kit, code=kit["same"]), "--scan"), "zero update", code=1)
    assert _invoke("check", *_models(kit)).exit_code == 0


def test_check_flags_an_untrained_lora_adapter(llama_kit, tmp_path):
    peft = pytest.importorskip("peft")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_kit.base_dir)
    adapter = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    adapter.save_pretrained(tmp_path / "untrained")  # B = 0: PEFT's initialisation
    _refused(_invoke("check", "--model", llama_kit.base_dir, "-f", f"t={tmp_path / 'untrained'}"), "zero update",
             code=1)


def test_plan_says_when_a_fine_tune_has_no_score(kit, tmp_path):
    store = tmp_path / "s.zarr"
    _measured(kit, store, kit["math"], kit["same"])
    with pytest.warns(UserWarning, match=r"linearity, level layer: task code has no finite Non-linearity Score \(its "
                                         r"update leaves these modules' outputs unchanged \(zero update\)"):
        result = _invoke("plan", store, "--out", tmp_path / "plan.yaml", "--granularity", "layer")
    assert result.exit_code == 0, result.output


def test_compare_says_when_normalised_gain_is_undefined(kit, tmp_path):
    from submerge.merge.compare import compare

    data = {t: str(p) for t, p in kit["data"].items()}
    with pytest.warns(UserWarning, match="task 'code': its fine-tune does not improve on the base"):
        result = compare(str(kit["base"]), {"math": str(kit["math"]), "code": str(kit["same"])}, data,
                         methods=["weight-average"], fit=2, samples=2, max_tokens=32, device="cpu", progress=False)
    assert np.isnan(result.gain.sel(task="code").values).all()


# ====================================================================== hostile files


def test_a_config_larger_than_its_checkpoint_is_refused_before_anything_is_built(kit, tmp_path):
    from submerge.diagnostics.base_model import load_base_model

    for key, value, message in (("num_hidden_layers", 100_000, ("config.json says 100000 blocks, the checkpoint "
                                                                "holds 2 under 'model.layers'")),
                                ("intermediate_size", 10**9, "intermediate_size = 1000000000, but no tensor"),
                                ("hidden_size", 4096, "hidden_size = 4096, but no tensor")):
        hostile = tmp_path / key
        shutil.copytree(kit["base"], hostile)
        config = json.loads((hostile / "config.json").read_text())
        (hostile / "config.json").write_text(json.dumps({**config, key: value}))
        start = time.perf_counter()
        with pytest.raises(ModelInputError, match=message):
            load_base_model(str(hostile), device="cpu")
        assert time.perf_counter() - start < 20
        _refused(_invoke("merge", "--method", "task-arithmetic", *_models(kit)[2:], "--model", hostile,
                         "--out", tmp_path / f"m-{key}", "--no-progress"), message)


def test_shard_paths_are_confined_to_the_model_folder(kit, tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(kit["math"], sharded)
    names = list(load_file(sharded / "model.safetensors"))
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00001.safetensors")
    weight_map = {name: "model-00001-of-00001.safetensors" for name in names}
    for target in ("../../../../etc/passwd", "/etc/passwd"):
        (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**weight_map,
                                                                                         names[0]: target}}))
        _refused(_invoke("check", *_models(kit, math=sharded)), "model.safetensors.index.json", repr(target),
                 "not a file inside")


def test_a_damaged_safetensors_header_names_the_file(kit, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(kit["math"], damaged)
    data = (damaged / "model.safetensors").read_bytes()
    for broken in (data[:8] + b"{garbage" + data[16:], (2**62).to_bytes(8, "little") + data[8:], data[:5]):
        (damaged / "model.safetensors").write_bytes(broken)
        _refused(_invoke("check", *_models(kit, math=damaged)), f"{damaged / 'model.safetensors'} is not a readable "
                 "safetensors file")
        _refused(_invoke("merge", "--method", "ties", *_models(kit, math=damaged), "--out", tmp_path / "m",
                         "--no-progress"), str(damaged / "model.safetensors"))


def _lora(base_dir: Path, directory: Path, **config) -> Path:
    """A LoRA adapter on q_proj of every block, written by hand (A: r × 32, B: 32 × r)."""
    directory.mkdir(parents=True, exist_ok=True)
    rank = config.pop("rank", 2)
    tensors = {}
    for layer in range(2):
        stem = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, 32)
        tensors[f"{stem}.lora_B.weight"] = torch.randn(32, rank)
    save_file(tensors, directory / "adapter_model.safetensors")
    adapter = {"peft_type": "LORA", "r": rank, "lora_alpha": 4, "base_model_name_or_path": str(base_dir), **config}
    (directory / "adapter_config.json").write_text(json.dumps(adapter))
    return directory


def test_lora_adapters_that_do_not_fit_are_refused(kit, tmp_path):
    from submerge.diagnostics.checkpoints import open_checkpoint

    base = open_checkpoint(str(kit["base"]))
    adapter = _lora(kit["base"], tmp_path / "zero_rank", r=0)
    with pytest.raises(ModelInputError, match="'r' is 0; it must be a finite number above 0"):
        open_checkpoint(str(adapter), base=base)
    mismatched = _lora(kit["base"], tmp_path / "mismatch")
    tensors = load_file(mismatched / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"] = torch.randn(32, 3)
    save_file(tensors, mismatched / "adapter_model.safetensors")
    with pytest.raises(CheckpointMismatch, match=r"'model.layers.1.self_attn.q_proj.weight' does not fit: A is "
                                                 r"\(2, 32\) and B \(32, 3\)"):
        open_checkpoint(str(mismatched), base=base)
    _refused(_invoke("check", "--model", kit["base"], "-f", f"t={adapter}"), "adapter_config.json", "'r' is 0")


def test_an_adapter_for_another_base_warns(kit, tmp_path):
    from submerge.diagnostics.checkpoints import open_checkpoint

    base = open_checkpoint(str(kit["base"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        open_checkpoint(str(_lora(kit["base"], tmp_path / "ours")), base=base)  # named by its path: no warning
    other = _lora(kit["base"], tmp_path / "theirs", base_model_name_or_path="meta-llama/Llama-2-7b-hf")
    with pytest.warns(UserWarning, match="was trained on base model 'meta-llama/Llama-2-7b-hf'"):
        open_checkpoint(str(other), base=base)


def test_records_longer_than_learned_positions_are_refused(toy_kit, tmp_path):
    kit = toy_kit("gpt2")  # 512 learned positions
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"text": "word " * 700}) + "\n")
    result = _invoke("eval", "--model", kit.base_dir, "--data", f"math={long}", "--skip", "0", "--samples", "1",
                     "--max-tokens", "2048", "--out", tmp_path / "e.zarr", *RUN)
    _refused(result, "have more tokens than the 512 positions", "use --max-tokens 512 or less")


def test_a_store_whose_attrs_were_edited_is_named(kit, tmp_path):
    store = tmp_path / "s.zarr"
    _measured(kit, store, kit["math"], kit["code"], linearity=False)
    meta = store / "alpha" / "layer" / "zarr.json"
    content = json.loads(meta.read_text())
    for key, value in (("units_done", "three"), ("settings", "edited"), ("complete", "yes")):
        edited = {**content, "attributes": {**content["attributes"], key: value}}
        meta.write_text(json.dumps(edited))
        result = _invoke("alpha", *_models(kit), *_data(kit), "--out", store, "--samples", "4", "--max-tokens", "32",
                         "--granularity", "layer", *RUN)
        _refused(result, f"{meta}: attr '{key}' is {value!r}", "edited or damaged")
        _refused(_invoke("plan", store, "--out", tmp_path / "plan.yaml", "--granularity", "layer"), str(meta))


def test_a_store_from_a_newer_toolkit_warns(kit, tmp_path):
    store = tmp_path / "s.zarr"
    _measured(kit, store, kit["math"], kit["code"], linearity=False)
    meta = store / "alpha" / "layer" / "zarr.json"
    content = json.loads(meta.read_text())
    content["attributes"]["provenance"]["toolkit_version"] = "99.0"
    meta.write_text(json.dumps(content))
    with pytest.warns(UserWarning, match=r"group 'alpha/layer' of .* was written by submerge 99.0, newer than this"):
        Store(store).dataset("alpha/layer")


@pytest.mark.parametrize("kind", ["file", "folder of other files"])
def test_a_store_path_of_the_wrong_kind_is_refused_up_front(kit, tmp_path, kind):
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("mine")
    else:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    result = _invoke("linearity", *_models(kit), *_data(kit), "--out", out, "--samples", "2", "--max-tokens", "16",
                     *RUN)
    _refused(result, f"--out {out}")
    assert (out.read_text() if kind == "file" else (out / "notes.txt").read_text()) == "mine"
    assert kind == "file" or sorted(p.name for p in out.iterdir()) == ["notes.txt"]


# ====================================================================== Ray


def test_a_dead_ray_address_fails_within_a_minute_naming_it():
    pytest.importorskip("ray")
    from submerge.diagnostics.execution import EngineError, RayEngine

    start = time.perf_counter()
    with pytest.raises(EngineError, match="127.0.0.1:1"), RayEngine("127.0.0.1:1").running():
        pass
    assert time.perf_counter() - start < 60


def test_a_ray_address_that_does_not_answer_as_ray_times_out():
    """A port that accepts connections but is no Ray head (a stopped head, another service): `ray.init` retries
    for ever; the engine gives up after its timeout, naming the address."""
    pytest.importorskip("ray")
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    threading.Thread(target=lambda: [accepted.append(listener.accept()) for _ in range(16)], daemon=True).start()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    code = ("from submerge.diagnostics.execution import RayEngine, EngineError\n"
            f"try:\n    RayEngine({address!r}, connect_timeout=5).running().__enter__()\n"
            "except EngineError as exc:\n    print('refused:', exc)\n")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert time.perf_counter() - start < 60, result.stderr
    assert f"refused: the Ray cluster at {address} accepted a connection but did not answer as Ray within 5 s" in \
        result.stdout, result.stdout + result.stderr
    listener.close()


@pytest.mark.xdist_group("ray")  # one xdist worker runs every Ray test (conftest: --dist loadgroup)
def test_a_worker_error_arrives_as_the_projects_message(kit, tmp_path):
    """A fine-tune with NaN in a block tensor, read by a Ray pipeline worker: the user gets the NonFiniteWeights
    message naming the tensor, not a remote traceback."""
    pytest.importorskip("ray")
    bad = tmp_path / "nan"
    shutil.copytree(kit["math"], bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(tensors, bad / "model.safetensors")
    result = _invoke("linearity", *_models(kit, math=bad), *_data(kit), "--out", tmp_path / "s.zarr", "--samples",
                     "2", "--max-tokens", "16", "--levels", "attn,mlp", "--steps", "2", "--ray", "auto", *RUN)
    _refused(result, "fine-tune 'math': tensor 'model.layers.1.mlp.up_proj.weight'", "NaN/Inf")


def test_remote_worker_failures_become_messages():
    ray = pytest.importorskip("ray")
    from submerge.diagnostics.errors import EngineError, NonFiniteWeights
    from submerge.diagnostics.pipeline import remote_error

    ours = NonFiniteWeights("tensor 'x' has NaN")
    assert remote_error(ray.exceptions.RayTaskError("f", "tb", ours)) is ours
    died = remote_error(ray.exceptions.RayActorError())
    assert isinstance(died, EngineError) and "run the same command again to resume" in str(died)
    memory = remote_error(ray.exceptions.RayTaskError("f", "tb", torch.OutOfMemoryError("CUDA out of memory")))
    assert isinstance(memory, EngineError) and "ran out of memory" in str(memory)
    bug = ray.exceptions.RayTaskError("f", "tb", ZeroDivisionError("a bug"))
    assert remote_error(bug) is bug  # a bug keeps its traceback


# ====================================================================== leftovers


def test_a_killed_compares_scratch_is_removed_and_named(tmp_path, monkeypatch):
    from submerge.merge import compare

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.send_signal(signal.SIGKILL)
    child.wait()  # a process id that no longer runs
    leftover = Path(tempfile.gettempdir()) / f"{compare.SCRATCH_PREFIX}{child.pid}-abc"
    (leftover / "ties").mkdir(parents=True)
    (leftover / "ties" / "model.safetensors").write_bytes(b"0" * 64)
    alive = Path(tempfile.mkdtemp(prefix=f"{compare.SCRATCH_PREFIX}{os.getppid()}-"))  # a live process's: kept
    try:
        with pytest.warns(UserWarning, match=f"removing {leftover}: the merges a killed diag compare left behind"):
            scratch = compare._scratch_directory()
        assert not leftover.exists() and alive.exists()
        assert scratch.name.startswith(f"{compare.SCRATCH_PREFIX}{os.getpid()}-")
    finally:
        shutil.rmtree(alive, ignore_errors=True)
        shutil.rmtree(leftover, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_compare_that_fails_validation_creates_no_group(kit, tmp_path):
    store = tmp_path / "s.zarr"
    _measured(kit, store, kit["math"], kit["code"], linearity=False)
    for bad in (["--folds", "1"], ["--steer", "tiez"], ["--candidates", "layer,blocks"], ["--lambdas", "0.5,nan"]):
        result = _invoke("compare", *_models(kit), *_data(kit), "--methods", "plan,task-arithmetic-tuned", "--fit",
                         "4", "--samples", "2", "--max-tokens", "32", "--out", store, *RUN, *bad)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert not Store(store).has("compare"), bad


def test_store_errors_name_the_store(tmp_path):
    store = Store(tmp_path / "s.zarr")
    store.begin("g", {"a": 1})
    meta = store.path / "g" / "zarr.json"
    content = json.loads(meta.read_text())
    content["attributes"]["units_done"] = -1
    meta.write_text(json.dumps(content))
    with pytest.raises(StoreError, match="attr 'units_done' is -1, not a whole number >= 0"):
        store.group_attrs("g")
    assert store.status()["g"].state == "corrupt"

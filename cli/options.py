"""The options that several `diag` commands share, defined once.

Each shared option (``--model``, ``--data``, ``--samples``, ``--device`` ...) is declared here with
its help text, default and range check. A command names the ones it takes:

    @app.command()
    @user_errors
    @run_options("model", "finetuned", "data", "out", "samples", "device")
    def linearity(levels: LevelsOption = "model,layer", run: RunOptions = None): ...

`run_options` appends those options (and ``--config``) to the command's signature, so typer shows
them in ``--help`` and ``--config run.yaml`` accepts them as keys; the command receives them as one
validated, frozen `RunOptions` (parameter ``run``), or as keyword arguments when it has no ``run``
parameter. Ranges (``--batch-size 0``), the device (``--device cuda`` without CUDA) and the
capture budget are checked while the command line is parsed, before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from submerge.cli.common import ConfigOption, command_line, console, resolve_inputs
from submerge.diagnostics.base_model import LoadSettings
from submerge.diagnostics.capture import DEFAULT_CAPTURE_BUDGET
from submerge.diagnostics.execution import LocalEngine, RayEngine, RunSettings
from submerge.diagnostics.experiment import Experiment
from submerge.diagnostics.store import Store, check_store_path

DEMO_SAMPLES, DEMO_MAX_TOKENS = 16, 256  # the README's demo command; no --model means the demo kit
SAMPLES, MAX_TOKENS = 30, 512  # seed 002's 30 records; 512 tokens


def check_device(value: Optional[str]) -> Optional[str]:
    """`auto`, `cpu`, `cuda`, `cuda:N`, `mps`: refused when torch cannot use it on this machine."""
    if value in (None, "auto", "cpu"):
        return value
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise typer.BadParameter(f"'{value}' is not a device; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise typer.BadParameter(f"'{value}': CUDA is not available on this machine (torch "
                                     f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                                     "use --device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise typer.BadParameter(f"'{value}': this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise typer.BadParameter(f"'{value}': MPS is not available on this machine; use --device cpu or auto")
    elif device.type not in ("cuda", "mps", "cpu"):
        raise typer.BadParameter(f"'{value}': unsupported device type; use auto, cpu, cuda, cuda:N or mps")
    return value


def _positive(value: Optional[float]) -> Optional[float]:
    if value is not None and not value > 0:
        raise typer.BadParameter(f"{value} is not > 0 (GiB of recorded inputs held at once)")
    return value


ModelOption = Annotated[
    Optional[str],
    typer.Option("--model", "-m", help="Base model: alias (llama-2-7b), hub id, local directory or .gguf file. "
                                       "Omit to use the embedded demo kit (SmolLM2-135M + three LoRA fine-tunes)."),
]
FinetunedOption = Annotated[
    Optional[list[str]],
    typer.Option("--finetuned", "-f", help="NAME=PATH of a fine-tune: hub id, directory, or LoRA adapter dir. Repeat."),
]
DataOption = Annotated[
    Optional[list[str]],
    typer.Option("--data", "-d", help="NAME=PATH of a task's data (.jsonl with text or prompt+completion, or .txt). "
                                      "One per fine-tune, same NAME."),
]
OutOption = Annotated[Path, typer.Option("--out", "-o", help="Zarr store to write (created, or resumed).")]
ForceOption = Annotated[bool, typer.Option("--force", help="Overwrite this command's results in an existing store.")]
SamplesOption = Annotated[Optional[int], typer.Option(
    "--samples", min=1, show_default=False,
    help=f"First N records of each task file. Default {SAMPLES} (seed 002), or {DEMO_SAMPLES} on the demo kit "
         "(no --model).")]
MaxTokensOption = Annotated[Optional[int], typer.Option(
    "--max-tokens", min=1, show_default=False,
    help=f"Truncate each record to its first N tokens. Default {MAX_TOKENS}, or {DEMO_MAX_TOKENS} on the demo kit "
         "(no --model).")]
BatchOption = Annotated[int, typer.Option("--batch-size", min=1, help="Sequences per forward/replay batch.")]
DeviceOption = Annotated[str, typer.Option("--device", callback=check_device,
                                           help="auto (CUDA when present), cpu, cuda, cuda:1 ...")]
OffloadOption = Annotated[bool, typer.Option(
    "--offload", help="Keep the base's weights in host memory (memory-mapped) and copy each block to --device only "
                      "while it runs: for a base larger than the GPU (needs ≈ one block in the compute dtype there). "
                      "No effect on the CPU.")]
DtypeOption = Annotated[str, typer.Option("--dtype", help="auto (the checkpoint's dtype), float32, bfloat16, float16.")]
ComputeDtypeOption = Annotated[str, typer.Option("--compute-dtype", help="float32 (default) or float64: the dtype "
                                                 "replays and forwards compute in (--dtype is the storage dtype). "
                                                 "linearity, projection and alpha also take bfloat16 or float16, to "
                                                 "reproduce half-precision GPU numbers: the base is then stored and "
                                                 "computed in it (warned: with small updates this measures "
                                                 "rounding; compare with each score's noise floor).")]
FloorSamplesOption = Annotated[int, typer.Option(
    "--floor-samples", min=0, help="Records per task (the first) replayed again in float64 for each score's noise "
                                   "floor: what rounding at the compute dtype contributes (|score − score in "
                                   "float64|; 0: none). `diag report` flags scores within 10× of it.")]
PickleOption = Annotated[bool, typer.Option("--allow-pickle", help="Allow pickled .bin checkpoints "
                                                                   "(loaded with weights_only=True).")]
RemoteCodeOption = Annotated[bool, typer.Option("--trust-remote-code", help="Run model code from the repository "
                                                                            "(off by default).")]
VocabOption = Annotated[str, typer.Option("--vocab", help="Fine-tunes with added tokens: 'base' uses the base's "
                                                          "vocabulary rows (warned, recorded), 'error' refuses.")]
CaptureBudgetOption = Annotated[float, typer.Option(
    "--capture-budget", callback=_positive,
    help="GiB (> 0) of recorded module inputs held at once; layers are captured in chunks that fit.")]
ProgressOption = Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars.")]
RayOption = Annotated[Optional[str], typer.Option(
    "--ray", help="Run on Ray: 'auto' starts a local instance, an ADDRESS (host:port) joins a cluster "
                  "(pip install 'submerge[ray]').")]
WorkersOption = Annotated[int, typer.Option("--workers", min=1, help="Ray worker processes (with --ray); the "
                                            "data-driven diagnostics give each a contiguous range of blocks.")]
GpusPerWorkerOption = Annotated[float, typer.Option("--gpus-per-worker", min=0, help="GPUs Ray reserves for each "
                                                    "worker (with --ray); > 0: the workers compute on CUDA.")]
ThreadsOption = Annotated[Optional[int], typer.Option(
    "--threads", min=1, help="Intra-op threads of every task, here or in each Ray worker (default: torch's count "
                             "on this machine). Recorded in the store; the same count gives bitwise-equal results "
                             "on one process and on any number of Ray workers.")]


@dataclass(frozen=True)
class RunOptions:
    """The shared options of one command run; `samples` and `max_tokens` are resolved (demo defaults)."""

    model: Optional[str] = None
    finetuned: Optional[list[str]] = None
    data: Optional[list[str]] = None
    out: Path = Path("runs/diag.zarr")
    samples: Optional[int] = None
    max_tokens: Optional[int] = None
    batch_size: int = 8
    capture_budget: float = DEFAULT_CAPTURE_BUDGET / 2**30  # GiB
    device: str = "auto"
    offload: bool = False
    dtype: str = "auto"
    compute_dtype: str = "float32"
    allow_pickle: bool = False
    trust_remote_code: bool = False
    vocab: str = "base"
    force: bool = False
    progress: bool = True
    ray: Optional[str] = None
    workers: int = 1
    gpus_per_worker: float = 0
    threads: Optional[int] = None

    def __post_init__(self):
        given = [f"--workers {self.workers}"] * (self.workers != 1)
        given += [f"--gpus-per-worker {self.gpus_per_worker:g}"] * (self.gpus_per_worker != 0)
        if self.ray is None and given:
            raise typer.BadParameter(f"{' and '.join(given)} need(s) --ray auto (a local Ray instance) or --ray "
                                     "ADDRESS (a cluster)")
        if self.ray is not None:
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise typer.BadParameter("--ray needs Ray, which is not installed: pip install 'submerge[ray]'")
        demo = self.model is None
        if self.samples is None:
            object.__setattr__(self, "samples", DEMO_SAMPLES if demo else SAMPLES)
        if self.max_tokens is None:
            object.__setattr__(self, "max_tokens", DEMO_MAX_TOKENS if demo else MAX_TOKENS)

    @property
    def engine(self):
        """Where the work runs: this process, or Ray workers (--ray)."""
        return engine_of(self.ray, self.workers, self.gpus_per_worker, self.threads)

    def run_settings(self, **settings) -> RunSettings:
        """The drivers' `RunSettings` of these options: the store at --out, --force, --progress, the command line,
        the capture budget and the engine."""
        check_store_path(self.out)
        return RunSettings(store=Store(self.out), force=self.force, progress=self.progress, command=command_line(),
                           capture_budget=self.capture_bytes, engine=self.engine, **settings)

    def load_settings(self) -> LoadSettings:
        """How these options read the models: --dtype, --device, --offload, --allow-pickle, --trust-remote-code."""
        return LoadSettings(dtype=self.dtype, device=self.device, offload=self.offload, allow_pickle=self.allow_pickle,
                            trust_remote_code=self.trust_remote_code)

    @property
    def capture_bytes(self) -> int:
        return int(self.capture_budget * 2**30)

    def inputs(self, *, need_data: bool = True) -> tuple[str, dict[str, str], dict[str, str]]:
        """(base, {name: fine-tune}, {name: data file}): the user's, or the demo kit's without --model."""
        return resolve_inputs(self.model, self.finetuned, self.data, need_data=need_data)

    def experiment(self, *, skip: int = 0):
        """The loaded `Experiment` (base model, task vectors, tokenised data) these options describe.

        With --ray the base stays on the meta device here: each worker reads its own blocks."""
        return load_experiment(self.model, self.finetuned, self.data, samples=self.samples, skip=skip,
                               max_tokens=self.max_tokens, batch_size=self.batch_size,
                               compute_dtype=self.compute_dtype, vocab=self.vocab, **self.load_settings().keywords(),
                               weights=self.ray is None)  # on Ray, the workers read the blocks


def engine_of(ray: Optional[str], workers: int, gpus_per_worker: float, threads: Optional[int]):
    """The engine of --ray/--workers/--gpus-per-worker/--threads (checked by `RunOptions`)."""
    if ray is None:
        return LocalEngine(threads)
    return RayEngine(ray, workers, threads, gpus_per_worker)


OPTIONS: dict[str, object] = {
    "model": ModelOption, "finetuned": FinetunedOption, "data": DataOption, "out": OutOption,
    "samples": SamplesOption, "max_tokens": MaxTokensOption, "batch_size": BatchOption,
    "capture_budget": CaptureBudgetOption, "device": DeviceOption, "offload": OffloadOption, "dtype": DtypeOption,
    "compute_dtype": ComputeDtypeOption, "allow_pickle": PickleOption,
    "trust_remote_code": RemoteCodeOption, "vocab": VocabOption, "force": ForceOption, "progress": ProgressOption,
    "ray": RayOption, "workers": WorkersOption, "gpus_per_worker": GpusPerWorkerOption, "threads": ThreadsOption,
}
"""Annotation (type + typer.Option) of each shared option; the defaults are `RunOptions`'s."""

INPUTS = ("model", "finetuned", "data", "out")
MODELS = ("model", "finetuned", "allow_pickle", "vocab")
"""The options of every command that opens a base and its fine-tunes."""
SCALE_OUT = ("ray", "workers", "gpus_per_worker", "threads")
"""The options of the commands that run on Ray."""
DATA_RUN = (*MODELS, "data", "out", "samples", "max_tokens", "batch_size", "capture_budget", "device", "offload",
            "dtype", "compute_dtype", "trust_remote_code", "force", "progress", *SCALE_OUT)
"""The options of the data-driven diagnostics (linearity, projection, alpha)."""


def load_experiment(model, finetuned, data, **settings):
    """`Experiment.load` on the user's inputs (or the demo kit), with a status line while it loads."""

    model, named_finetuned, named_data = resolve_inputs(model, finetuned, data)
    with console.status("Loading the base model and opening the fine-tunes ..."):
        return Experiment.load(model, named_finetuned, named_data, **settings)


def run_options(*names: str, **defaults):
    """Give a command the shared options `names` (plus ``--config``); `defaults` overrides their defaults.

    The command receives them as ``run: RunOptions`` when it has a ``run`` parameter, else as keyword
    arguments of the same names (`samples` and `max_tokens` resolved).
    """
    unknown = sorted(set(names) - set(OPTIONS)) + sorted(set(defaults) - set(names))
    if unknown:
        raise TypeError(f"run_options: unknown or unlisted option(s) {unknown}")
    fields = {f.name: f.default for f in dataclasses.fields(RunOptions)}

    def decorate(function):
        own = inspect.signature(function, eval_str=True)
        bundled = "run" in own.parameters
        kept = [p for p in own.parameters.values() if p.name not in ("run", "config", *names)]
        shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=OPTIONS[name],
                                    default=defaults.get(name, fields[name])) for name in names]
        config = inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=ConfigOption, default=None)
        first = [p for p in shared if p.name in INPUTS]  # in --help: inputs, the command's own, the rest
        ordered = [*first, *kept, *(p for p in shared if p.name not in INPUTS), config]
        signature = own.replace(parameters=[p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in ordered])

        @functools.wraps(function)
        def wrapper(**kwargs):
            run = RunOptions(**{name: kwargs.pop(name) for name in names})
            kwargs.pop("config", None)
            if bundled:
                return function(run=run, **kwargs)
            return function(**kwargs, **{name: getattr(run, name) for name in names})

        wrapper.__signature__ = signature
        wrapper.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
        return wrapper

    return decorate

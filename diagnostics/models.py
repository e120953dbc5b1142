"""Model I/O: find checkpoints, read them lazily tensor by tensor, build task vectors.

A fine-tuned model is never loaded whole: `open_checkpoint` returns a
`CheckpointReader` that reads one tensor at a time (safetensors memory map), and
`TaskVectorReader.get` gives τ_t = θ_t − θ0 for one tensor. Only the base model is
instantiated as a `torch.nn.Module` (`load_base_model`).

Supported specs (base and fine-tunes alike):
- an alias from `ALIASES` (``llama-2-7b``) or a Hugging Face hub id (downloaded
  with ``huggingface_hub.snapshot_download``; safetensors only unless pickles are allowed);
- a local directory with ``model.safetensors`` or sharded safetensors + index;
- a ``.gguf`` file (dequantized through transformers, held in memory: GGUF models are small);
- a PEFT LoRA adapter directory (``adapter_config.json``): read as base + scale·B·A;
- pickled ``pytorch_model*.bin`` only with ``allow_pickle=True`` (then ``weights_only=True``).

Vocabulary: a fine-tune whose embedding / output matrices have more rows than
the base's (added tokens) is handled by ``vocab="base"`` (the default): task
vectors use the base's rows only, the extra rows are ignored, and a warning plus
the store's attrs say which tensors and how many rows. ``vocab="error"`` refuses.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from submerge.diagnostics.errors import CheckpointMismatch, ModelInputError, NonFiniteWeights

ALIASES: dict[str, str] = {
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-2-13b": "meta-llama/Llama-2-13b-hf",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "qwen2-7b": "Qwen/Qwen2-7B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "gemma-3-1b": "google/gemma-3-1b-pt",
    "gemma-3-4b": "google/gemma-3-4b-pt",
    "gpt2": "openai-community/gpt2",
    "bert-base": "google-bert/bert-base-uncased",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
VOCAB_POLICIES = ("base", "error")


def resolve_alias(spec: str) -> str:
    """Map a short alias (``llama-2-7b``) to its hub id; anything else is returned as is."""
    return ALIASES.get(spec.lower(), spec) if not Path(spec).exists() else spec


_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".json", ".yaml", ".zarr")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_like_path(spec: str) -> bool:
    """Whether `spec` can only mean a local path (never a hub id): starts with ``.``, ``/`` or ``~``, ends
    with ``/``, has a file suffix, has more than one ``/``, is no valid hub id, or its first folder exists."""
    if spec.startswith((".", "/", "~")) or spec.endswith(("/", "\\")) or spec.count("/") > 1:
        return True
    if Path(spec).suffix.lower() in _WEIGHT_SUFFIXES or not _HUB_ID.match(spec) or "--" in spec or ".." in spec:
        return True
    return "/" in spec and Path(spec.split("/")[0]).is_dir()


def local_path(spec: str, *, revision: str | None = None, allow_pickle: bool = False, role: str = "model") -> Path:
    """Return a local path for `spec`, downloading a hub id's weights and configs if needed.

    `role` ("base model", "fine-tune 'math'") names the model in errors. A spec that looks like a
    path (`looks_like_path`) and does not exist is reported as not found, never tried on the hub.
    """
    spec = resolve_alias(spec)
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if looks_like_path(spec):
        raise ModelInputError(f"{role} not found: {spec}" + (f" (resolved to {path.resolve()})"
                                                             if not path.is_absolute() else ""))
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.gguf", "tokenizer*"]
    if allow_pickle:
        patterns.append("*.bin")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # hub unreachable, gated repo, typo ...
        raise ModelInputError(
            f"{role} '{spec}': no such local file or folder, and could not get it from the Hugging Face hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
            "Pass a local directory (./name for one in this folder), or log in / check the id and your network."
        ) from exc


class CheckpointReader:
    """Lazy, read-only access to the tensors of one checkpoint.

    `get` reads one tensor (memory-mapped for safetensors); nothing else is loaded.
    """

    spec: str
    path: Path

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        raise NotImplementedError

    def get_rows(self, name: str, rows: slice, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> torch.Tensor:
        """Rows `rows` (a slice of dim 0) of one tensor; readers of memory-mapped files read only those rows."""
        return self.get(name, dtype, device)[rows]

    def source_of(self, name: str) -> str:
        """The file a tensor lives in (for error messages)."""
        return str(self.path)

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of one tensor (readers that can, answer without reading the data)."""
        return self.get(name).dtype

    def release(self) -> None:
        """Close memory-mapped files (pages read so far stop counting in the process's RSS); reopened on use."""

    def __contains__(self, name: str) -> bool:
        return name in self._name_set

    @cached_property
    def _name_set(self) -> set[str]:
        return set(self.names())

    def fingerprint(self) -> dict:
        """Where these weights came from: spec and resolved path (readers of files add content hashes)."""
        return {"spec": self.spec, "path": str(Path(self.path).resolve())}

    def _missing(self, name: str) -> ModelInputError:
        return ModelInputError(f"tensor '{name}' not found in {self.path}")


class SafetensorsReader(CheckpointReader):
    """A single or sharded safetensors checkpoint (memory-mapped, one tensor per `get`)."""

    def __init__(self, spec: str, path: Path):
        from safetensors import safe_open

        self.spec, self.path = spec, path
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: path / file for name, file in weight_map.items()}
        else:
            candidates = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
            candidates = [c for c in candidates if not c.name.startswith("adapter_model")]
            if not candidates:
                raise ModelInputError(f"no safetensors weights in {path}")
            files = {}
            for file in candidates:
                with safe_open(file, framework="pt") as handle:
                    for name in handle.keys():
                        files[name] = file
        self._files = files
        self._handles: dict[Path, object] = {}
        for file in set(files.values()):
            if not file.exists():
                raise ModelInputError(f"shard {file.name} listed in {index} is missing")
        self._safe_open = safe_open

    def _handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = self._safe_open(file, framework="pt")
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._files:
            raise self._missing(name)
        return tuple(self._handle(self._files[name]).get_slice(name).get_shape())

    def get(self, name, dtype=None, device="cpu"):
        if name not in self._files:
            raise self._missing(name)
        tensor = self._handle(self._files[name]).get_tensor(name)
        return tensor.to(device=device, dtype=dtype or tensor.dtype)

    def get_rows(self, name, rows, dtype=None, device="cpu"):
        if name not in self._files:
            raise self._missing(name)
        tensor = self._handle(self._files[name]).get_slice(name)[rows]
        return tensor.to(device=device, dtype=dtype or tensor.dtype)

    def source_of(self, name: str) -> str:
        return str(self._files.get(name, self.path))

    def dtype(self, name: str) -> torch.dtype:
        if name not in self._files:
            raise self._missing(name)
        return _SAFETENSORS_DTYPES[self._handle(self._files[name]).get_slice(name).get_dtype()]

    def release(self) -> None:
        self._handles.clear()

    def fingerprint(self) -> dict:
        digest = hashlib.sha256()
        sample = 1 << 20
        for file in sorted(set(self._files.values())):
            size = file.stat().st_size
            with open(file, "rb") as handle:
                header_len = int.from_bytes(handle.read(8), "little")
                digest.update(handle.read(header_len))
                for offset in sorted({8 + header_len, max(0, size // 2 - sample // 2), max(0, size - sample)}):
                    handle.seek(offset)
                    digest.update(handle.read(sample))
            digest.update(str(size).encode())
        info = {"spec": self.spec, "path": str(Path(self.path).resolve()), "content_sha256": digest.hexdigest(),
                "content_hash": "sha256 of each file's header, three 1 MiB samples (start, middle, end) and size"}
        info.update(_hub_revision(self.path))
        return info


class StateDictReader(CheckpointReader):
    """Tensors already in memory (GGUF dequantized by transformers, pickled .bin, tests)."""

    def __init__(self, spec: str, path: Path, tensors: dict[str, torch.Tensor]):
        self.spec, self.path, self._tensors = spec, path, tensors

    def names(self):
        return list(self._tensors)

    def shape(self, name):
        if name not in self._tensors:
            raise self._missing(name)
        return tuple(self._tensors[name].shape)

    def get(self, name, dtype=None, device="cpu"):
        if name not in self._tensors:
            raise self._missing(name)
        tensor = self._tensors[name]
        return tensor.to(device=device, dtype=dtype or tensor.dtype)

    def fingerprint(self):
        info = {"spec": self.spec, "path": str(Path(self.path).resolve())}
        if self.path.is_file():
            info["file_size"] = self.path.stat().st_size
        return info


class LoraReader(CheckpointReader):
    """Base weights plus a PEFT LoRA adapter: W = W0 + scale · B·A, read per tensor.

    `task_vector(name)` returns scale · B·A exactly (zeros for untouched tensors),
    without the rounding of (W0 + ΔW) − W0 in low precision.
    """

    def __init__(self, spec: str, path: Path, base: CheckpointReader, *, allow_pickle: bool = False):
        self.spec, self.path, self.base = spec, path, base
        config = json.loads((path / "adapter_config.json").read_text())
        peft_type = config.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise ModelInputError(f"{path}: only LoRA adapters are supported, found peft_type={peft_type}")
        if config.get("use_dora"):
            raise ModelInputError(f"{path}: DoRA adapters are not supported (use_dora=true)")
        self.config = config
        weights = path / "adapter_model.safetensors"
        if weights.exists():
            from safetensors.torch import load_file

            adapter = load_file(weights)
        elif (path / "adapter_model.bin").exists():
            adapter = _load_pickle(path / "adapter_model.bin", allow_pickle)
        else:
            raise ModelInputError(f"{path}: no adapter_model.safetensors")
        base_names = set(base.names())
        self._lora: dict[str, dict[str, torch.Tensor]] = {}
        self._replaced: dict[str, torch.Tensor] = {}
        for key, tensor in adapter.items():
            name = _strip_peft_prefix(key)
            match = re.match(r"(.*)\.lora_([AB])(?:\.[^.]+)?\.weight$", name)
            if match:
                target = _match_base_name(match.group(1) + ".weight", base_names)
                if target is None:
                    raise CheckpointMismatch(
                        f"{weights}: LoRA tensor '{key}' targets '{match.group(1)}.weight', which the base lacks"
                    )
                self._lora.setdefault(target, {})[match.group(2)] = tensor
            elif "lora_" not in name:
                target = _match_base_name(name.replace(".modules_to_save.default", ""), base_names)
                if target is None:
                    raise CheckpointMismatch(f"{weights}: tensor '{key}' has no counterpart in the base")
                self._replaced[target] = tensor
        for target, pair in self._lora.items():
            if set(pair) != {"A", "B"}:
                raise ModelInputError(f"{weights}: LoRA pair for '{target}' is incomplete ({sorted(pair)})")

    def _scale(self, target: str) -> float:
        module = target.rsplit(".", 1)[0]
        rank = self.config.get("r", 8)
        alpha = self.config.get("lora_alpha", rank)
        for pattern, value in (self.config.get("rank_pattern") or {}).items():
            if re.search(rf"(^|\.){pattern}$", module):
                rank = value
        for pattern, value in (self.config.get("alpha_pattern") or {}).items():
            if re.search(rf"(^|\.){pattern}$", module):
                alpha = value
        return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank

    def names(self):
        return self.base.names()

    def shape(self, name):
        return self.base.shape(name)

    def adapted_names(self) -> list[str]:
        return sorted(set(self._lora) | set(self._replaced))

    def task_vector(self, name: str, dtype=torch.float32, device="cpu") -> torch.Tensor:
        if name in self._replaced:
            return self._replaced[name].to(device, torch.float32).sub(self.base.get(name, torch.float32, device)).to(dtype)
        if name not in self._lora:
            return torch.zeros(self.base.shape(name), dtype=dtype, device=device)
        pair = self._lora[name]
        delta = pair["B"].to(device, torch.float32) @ pair["A"].to(device, torch.float32)
        delta = delta * self._scale(name)
        if self.config.get("fan_in_fan_out"):
            delta = delta.T
        if tuple(delta.shape) != self.base.shape(name):
            raise CheckpointMismatch(
                f"{self.path}: LoRA update for '{name}' has shape {tuple(delta.shape)}, base has {self.base.shape(name)}"
            )
        return delta.to(dtype)

    def get(self, name, dtype=None, device="cpu"):
        base = self.base.get(name, device=device)
        if name not in self._lora and name not in self._replaced:
            return base.to(dtype or base.dtype)
        return (base.to(torch.float32) + self.task_vector(name, torch.float32, device)).to(dtype or base.dtype)

    def fingerprint(self):
        weights = self.path / "adapter_model.safetensors"
        info = {"spec": self.spec, "path": str(Path(self.path).resolve()), "adapter_of": self.base.spec}
        if weights.exists():
            info["adapter_sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
        return info


def _strip_peft_prefix(key: str) -> str:
    for prefix in ("base_model.model.", "base_model."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _match_base_name(name: str, base_names: set[str]) -> str | None:
    """Find `name` among the base's tensor names, allowing a missing/extra top-level prefix."""
    if name in base_names:
        return name
    for candidate in base_names:
        if candidate.endswith("." + name) or name.endswith("." + candidate):
            return candidate
    return None


def _hub_revision(path: Path) -> dict:
    parts = path.resolve().parts
    if "snapshots" in parts:
        i = parts.index("snapshots")
        if i >= 1 and i + 1 < len(parts):
            return {"hub_repo": parts[i - 1].removeprefix("models--").replace("--", "/"), "revision": parts[i + 1]}
    return {}


def _load_pickle(file: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    if not allow_pickle:
        raise ModelInputError(
            f"{file} is a pickled checkpoint; pickles can run code when loaded. "
            "Convert it to safetensors, or pass --allow-pickle to load it with torch.load(weights_only=True)."
        )
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise ModelInputError(f"could not read {file} with weights_only=True: {exc}") from exc


def open_checkpoint(
    spec: str,
    *,
    base: CheckpointReader | None = None,
    revision: str | None = None,
    allow_pickle: bool = False,
    role: str = "model",
) -> CheckpointReader:
    """Open a checkpoint for lazy per-tensor reading (see the module docstring for specs); `role` names it in errors."""
    path = local_path(spec, revision=revision, allow_pickle=allow_pickle, role=role)
    if path.is_dir() and (path / "adapter_config.json").exists():
        if base is None:
            raise ModelInputError(f"{path} is a LoRA adapter; it needs the base model to be read against")
        return LoraReader(spec, path, base, allow_pickle=allow_pickle)
    if path.suffix == ".gguf" or (path.is_dir() and not list(path.glob("*.safetensors")) and list(path.glob("*.gguf"))):
        model = _load_gguf_model(path, torch.float32)
        return StateDictReader(spec, path, {k: v.detach() for k, v in model.state_dict().items()})
    if path.suffix == ".safetensors" or (path.is_dir() and list(path.glob("*.safetensors"))):
        return SafetensorsReader(spec, path)
    bins = sorted(path.glob("pytorch_model*.bin")) if path.is_dir() else [path] if path.suffix == ".bin" else []
    if bins:
        tensors: dict[str, torch.Tensor] = {}
        for file in bins:
            tensors.update(_load_pickle(file, allow_pickle))
        return StateDictReader(spec, path, tensors)
    raise ModelInputError(f"no model weights found at {path} (expected safetensors, a .gguf file or a LoRA adapter)")


def _gguf_file(path: Path) -> tuple[Path, str]:
    if path.is_file():
        return path.parent, path.name
    files = sorted(path.glob("*.gguf"))
    if len(files) != 1:
        raise ModelInputError(f"{path}: expected exactly one .gguf file, found {[f.name for f in files]}")
    return path, files[0].name


def _load_gguf_model(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    directory, name = _gguf_file(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    except Exception as exc:
        raise ModelInputError(f"could not load GGUF {directory / name}: {exc}") from exc
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    return model


# --------------------------------------------------------------------------- base model


@dataclass
class BaseModel:
    """The instantiated base model, its tokenizer and a lazy reader of its checkpoint."""

    model: torch.nn.Module
    tokenizer: object
    reader: CheckpointReader
    spec: str
    checkpoint_names: dict[str, str] = field(default_factory=dict)  # model parameter name -> checkpoint name

    def checkpoint_name(self, parameter_name: str) -> str:
        return self.checkpoint_names.get(parameter_name, parameter_name)


def release_mapped_pages(module: torch.nn.Module) -> int:
    """Drop from this process's resident memory the pages of `module`'s weights that are read from a memory-mapped
    checkpoint file (madvise ``MADV_DONTNEED`` on those file mappings); the next access reads them again from the
    page cache, not from disk. Returns the bytes that were resident in the mappings released.

    A base loaded in its checkpoint's dtype keeps its weights in private mappings of the safetensors files, and
    every block a forward touches stays resident: without this, a command's RSS grows by one block of stored
    weights per block it passes (≈ 400 MiB per Llama-2-7B block in float16). Only file mappings none of whose
    pages was ever written (their smaps ``Anonymous`` is 0) are released, so nothing any tensor holds can change.
    Linux only; elsewhere nothing is done.
    """
    import bisect
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return 0
    pointers = sorted({t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())
                       if t.device.type == "cpu" and t.untyped_storage().nbytes()})
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    mappings, current = [], None
    for line in lines:
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header: range perms offset dev inode [path]
            fields = line.split()
            low, high = (int(v, 16) for v in fields[0].split("-"))
            current = {"range": (low, high), "file": len(fields) > 5 and fields[4] != "0" and fields[5].startswith("/")}
            mappings.append(current)
        elif current is not None and first in ("Rss:", "Anonymous:"):
            current[first[:-1]] = int(line.split()[1]) * 1024
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    released = 0
    for mapping in mappings:
        (low, high), resident = mapping["range"], mapping.get("Rss", 0)
        if not mapping["file"] or not resident or mapping.get("Anonymous", 1):
            continue
        index = bisect.bisect_left(pointers, low)
        if index < len(pointers) and pointers[index] < high and libc.madvise(low, high - low, 4) == 0:  # DONTNEED
            released += resident
    return released


#: Set on a base model loaded with ``offload=True``: the device its forwards and replays compute on, while its
#: weights stay in host memory (memory-mapped) and each stage is copied there only while it runs.
OFFLOAD_ATTRIBUTE = "submerge_offload_device"


def execution_device(model: torch.nn.Module) -> torch.device:
    """The device `model`'s capture forwards, replays and merges' forwards compute on: its offload device (a base
    loaded with ``offload=True``), else the device its parameters are on."""
    offload = getattr(model, OFFLOAD_ATTRIBUTE, None)
    return offload if offload is not None else next(model.parameters()).device


def canonical_device(device: str | torch.device) -> torch.device:
    """`device` with its index (``cuda`` → ``cuda:0``, the current device), so it compares equal to a tensor's."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def offloads(offload: bool, device: str | torch.device) -> bool:
    """Whether ``offload=True`` takes effect on `device` (a resolved device, not "auto"): only an accelerator has
    weights to keep off it."""
    return offload and torch.device(device).type != "cpu"


def offload_to(model: torch.nn.Module, device: str | torch.device) -> None:
    """Make `model` compute on `device` (`execution_device`) while its weights stay where they are: host memory."""
    setattr(model, OFFLOAD_ATTRIBUTE, canonical_device(device))


def is_offloaded(model: torch.nn.Module) -> bool:
    """Whether `model`'s weights stay in host memory while it computes on another device (``offload=True``)."""
    return getattr(model, OFFLOAD_ATTRIBUTE, None) is not None


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str | None, config=None) -> torch.dtype:
    """`auto` (or None) → the checkpoint's own dtype, else float32."""
    if dtype in (None, "auto"):
        found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(found, str):
            found = getattr(torch, found, None)
        return found if isinstance(found, torch.dtype) else torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}[dtype]
    except KeyError:
        raise ModelInputError(f"unknown dtype '{dtype}' (use auto, float32, bfloat16, float16 or float64)") from None


def load_base_model(
    spec: str,
    *,
    dtype: str | None = "auto",
    device: str = "auto",
    revision: str | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    weights: bool = True,
    offload: bool = False,
) -> BaseModel:
    """Instantiate the base model (causal LM, or the bare encoder for BERT-like models) and its tokenizer.

    ``weights=False``: the model on the meta device, nothing read (a Ray driver whose workers hold the blocks).
    ``offload=True`` with an accelerator `device`: the weights stay in host memory (memory-mapped, in their
    storage dtype) and every stage — the embedding stage, each block, the final norm and head, each replayed
    unit — is copied to the device only while it runs (`execution_device`), so the device holds about one block
    in the compute dtype, not the model. On the CPU there is nothing to offload: the flag changes nothing.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from submerge.diagnostics.tensors import meta_model

    path = local_path(spec, revision=revision, allow_pickle=allow_pickle, role="base model")
    target = pick_device(device)
    if path.suffix == ".gguf" or (path.is_dir() and list(path.glob("*.gguf")) and not list(path.glob("*.safetensors"))):
        directory, name = _gguf_file(path)
        torch_dtype = pick_dtype(dtype) if dtype not in (None, "auto") else torch.float32
        model = _load_gguf_model(path, torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    else:
        if not (path / "config.json").exists():
            raise ModelInputError(f"{path} has no config.json; is it a Hugging Face model directory?")
        if not allow_pickle and not list(path.glob("*.safetensors")):
            _load_pickle(path, False)  # raises the explanatory error
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except ValueError as exc:
            raise ModelInputError(f"{path}: {exc} (pass --trust-remote-code only if you trust this repository)") from exc
        torch_dtype = pick_dtype(dtype, config)
        causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or []))
        auto = AutoModelForCausalLM if causal else AutoModel
        try:
            model = auto.from_pretrained(path, dtype=torch_dtype, trust_remote_code=trust_remote_code,
                                         use_safetensors=not allow_pickle or None) if weights else \
                meta_model(path, trust_remote_code=trust_remote_code, dtype=torch_dtype)
        except Exception as exc:
            raise ModelInputError(f"could not load the base model from {path}: {exc}") from exc
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    tokenizer.padding_side = "right"
    _check_vocabulary(tokenizer, model, path)
    if weights and offloads(offload, target):
        offload_to(model, target)
    elif weights:
        model.to(target)
    model.eval()
    model.requires_grad_(False)
    reader = open_checkpoint(str(path), allow_pickle=allow_pickle)
    base = BaseModel(model=model, tokenizer=tokenizer, reader=reader, spec=spec)
    base.checkpoint_names = checkpoint_name_map(model, reader)
    return base


def _check_vocabulary(tokenizer, model: torch.nn.Module, path: Path) -> None:
    """Every token id the tokenizer can produce must have an input embedding row."""
    embedding = model.get_input_embeddings()
    rows = getattr(embedding, "num_embeddings", None)
    ids = [i for i in tokenizer.get_vocab().values() if isinstance(i, int)]
    if rows is None or not ids or max(ids) < rows:
        return
    raise ModelInputError(f"{path}: the tokenizer has token ids up to {max(ids)} ({len(tokenizer)} tokens) but the "
                          f"model's input embedding has {rows} rows; this tokenizer does not belong to this model "
                          "(or the embedding was not resized after adding tokens)")


def checkpoint_name_map(model: torch.nn.Module, reader: CheckpointReader) -> dict[str, str]:
    """Map every parameter name of `model` (tied ones included) to a tensor name in `reader`.

    Handles checkpoints saved without (or with an extra) top-level prefix and tied
    weights that the checkpoint stores once (``lm_head.weight`` → ``model.embed_tokens.weight``).
    """
    names = set(reader.names())
    canonical: dict[int, str] = {}
    mapping: dict[str, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        found = _match_base_name(name, names)
        if found is None and id(parameter) in canonical:
            found = canonical[id(parameter)]
        if found is not None:
            mapping[name] = found
            canonical.setdefault(id(parameter), found)
    return mapping


# --------------------------------------------------------------------------- task vectors


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry is finite, in one reduction: a NaN or ±Inf entry makes the sum non-finite; only a sum
    that is not finite (an entry like that, or an overflow) is checked entry by entry."""
    if tensor.numel() == 0 or bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


@dataclass
class TaskVectorReader:
    """τ_t = θ_t − θ0 of one fine-tune, read tensor by tensor against the base."""

    name: str
    base: CheckpointReader
    finetuned: CheckpointReader
    vocab: str = "base"
    cropped: dict[str, tuple[int, int]] = field(default_factory=dict)

    def reads_rows(self, checkpoint_name: str) -> bool:
        """Whether `get_rows` reads only the rows asked for (a full fine-tune of the base's shape; not LoRA)."""
        return (not isinstance(self.finetuned, LoraReader) and checkpoint_name in self.finetuned
                and self.finetuned.shape(checkpoint_name) == self.base.shape(checkpoint_name))

    def get_rows(self, checkpoint_name: str, rows: slice, dtype: torch.dtype = torch.float32,
                 device="cpu", base: torch.Tensor | None = None) -> torch.Tensor:
        """τ for rows `rows` (dim 0) of one tensor, in `dtype`, checked for NaN/Inf (see `reads_rows`); `base`:
        those rows of the base in float32, when the caller has them already (read once for T fine-tunes)."""
        if not self.reads_rows(checkpoint_name):
            return self.get(checkpoint_name, dtype, device)[rows]
        if base is None:
            base = self.base.get_rows(checkpoint_name, rows, torch.float32, device)
        delta = self.finetuned.get_rows(checkpoint_name, rows, torch.float32, device) - base
        self._check_finite(checkpoint_name, delta, f" in rows {rows.start}:{rows.stop}")
        return delta.to(dtype)

    def get(self, checkpoint_name: str, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
        """τ for one tensor, in `dtype` (float32 by default), checked for NaN/Inf."""
        if isinstance(self.finetuned, LoraReader):
            delta = self.finetuned.task_vector(checkpoint_name, torch.float32, device)
        else:
            if checkpoint_name not in self.finetuned:
                raise CheckpointMismatch(
                    f"fine-tune '{self.name}' ({self.finetuned.path}) has no tensor '{checkpoint_name}'"
                )
            tuned = self.finetuned.get(checkpoint_name, torch.float32, device)
            base = self.base.get(checkpoint_name, torch.float32, device)
            if tuned.shape != base.shape:
                tuned = self._fit_vocab(checkpoint_name, tuned, base)
            delta = tuned - base
        self._check_finite(checkpoint_name, delta)
        return delta.to(dtype)

    def _check_finite(self, checkpoint_name: str, delta: torch.Tensor, where: str = "") -> None:
        if not all_finite(delta):
            bad = (~torch.isfinite(delta)).sum().item()
            raise NonFiniteWeights(
                f"fine-tune '{self.name}': tensor '{checkpoint_name}' in {self.finetuned.source_of(checkpoint_name)} "
                f"has {bad} NaN/Inf values{where}"
            )

    def _fit_vocab(self, name: str, tuned: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        if self.vocab == "base" and has_added_vocabulary(base.shape, tuned.shape):
            if name in self.cropped:
                return tuned[: base.shape[0]]
            self.cropped[name] = (base.shape[0], tuned.shape[0])
            warnings.warn(
                f"fine-tune '{self.name}': '{name}' has {tuned.shape[0]} rows, the base {base.shape[0]}; "
                f"using the base's {base.shape[0]} vocabulary rows (vocab policy 'base')",
                stacklevel=3,
            )
            return tuned[: base.shape[0]]
        raise CheckpointMismatch(
            f"fine-tune '{self.name}': tensor '{name}' has shape {tuple(tuned.shape)}, base has {tuple(base.shape)}"
        )


def has_added_vocabulary(base_shape, other_shape) -> bool:
    """Whether `other_shape` is `base_shape` with extra leading rows (a fine-tune's added tokens).

    The one test of the vocabulary policy 'base' (pre-flight, task vectors, evaluation load): such a
    tensor is cropped to the base's first rows.
    """
    base_shape, other_shape = tuple(base_shape), tuple(other_shape)
    return len(base_shape) >= 1 and other_shape[1:] == base_shape[1:] and other_shape[0] > base_shape[0]


def preflight(base: CheckpointReader, finetuned: dict[str, CheckpointReader], *, vocab: str = "base") -> dict:
    """Compare every fine-tune's tensor names and shapes with the base (headers only, no weights read).

    Raises one `CheckpointMismatch` listing every differing tensor of every fine-tune.
    Returns a report {task: {"vocab_rows": {...}}} of tolerated vocabulary differences.
    """
    if vocab not in VOCAB_POLICIES:
        raise ModelInputError(f"unknown vocab policy '{vocab}' (use one of {VOCAB_POLICIES})")
    problems: list[str] = []
    report: dict[str, dict] = {}
    base_names = set(base.names())
    for task, reader in finetuned.items():
        report[task] = {"vocab_rows": {}}
        if isinstance(reader, LoraReader):
            continue  # validated against the base when opened
        names = set(reader.names())
        for name in sorted(base_names - names):
            problems.append(f"  {task}: missing '{name}' (base shape {base.shape(name)})")
        for name in sorted(names - base_names):
            problems.append(f"  {task}: extra '{name}' {reader.shape(name)} not in the base")
        for name in sorted(base_names & names):
            mine, theirs = base.shape(name), reader.shape(name)
            if mine == theirs:
                continue
            if vocab == "base" and has_added_vocabulary(mine, theirs):
                report[task]["vocab_rows"][name] = [mine[0], theirs[0]]
                continue
            problems.append(f"  {task}: '{name}' has shape {theirs}, base {mine}")
    if problems:
        shown = problems[:40] + ([f"  ... and {len(problems) - 40} more"] if len(problems) > 40 else [])
        raise CheckpointMismatch(
            f"fine-tunes do not match the base {base.spec} ({base.path}):\n" + "\n".join(shown)
            + "\nAre they fine-tunes of this base, of the same architecture?"
        )
    for task, info in report.items():
        for name, (rows_base, rows_tuned) in info["vocab_rows"].items():
            warnings.warn(
                f"fine-tune '{task}': '{name}' has {rows_tuned} vocabulary rows, the base {rows_base}; "
                "task vectors use the base's rows (vocab policy 'base')",
                stacklevel=2,
            )
    return report


def open_finetunes(
    base: CheckpointReader, specs: dict[str, str], *, allow_pickle: bool = False, vocab: str = "base"
) -> tuple[dict[str, TaskVectorReader], dict]:
    """Open every fine-tune lazily, run the pre-flight check, return task-vector readers and its report."""
    if not specs:
        raise ModelInputError("no fine-tuned models given (use --finetuned NAME=PATH)")
    readers = {task: open_checkpoint(spec, base=base, allow_pickle=allow_pickle, role=f"fine-tune '{task}'")
               for task, spec in specs.items()}
    report = preflight(base, readers, vocab=vocab)
    return {task: TaskVectorReader(task, base, reader, vocab) for task, reader in readers.items()}, report

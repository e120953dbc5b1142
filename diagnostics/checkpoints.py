"""Checkpoints: find them from a spec, read them lazily one tensor at a time.

`open_checkpoint` returns a `CheckpointReader` that reads one tensor at a time (safetensors memory map); nothing
else is loaded. Task vectors τ_t = θ_t − θ0 are built on these readers in `submerge.diagnostics.task_vectors`, the
instantiated base model in `submerge.diagnostics.base_model`.

Supported specs (base and fine-tunes alike):
- an alias from `ALIASES` (``llama-2-7b``) or a Hugging Face hub id (downloaded
  with ``huggingface_hub.snapshot_download``; safetensors only unless pickles are allowed);
- a local directory with ``model.safetensors`` or sharded safetensors + index;
- a ``.gguf`` file (dequantized through transformers, held in memory: GGUF models are small);
- a PEFT LoRA adapter directory (``adapter_config.json``): read as base + scale·B·A;
- pickled ``pytorch_model*.bin`` only with ``allow_pickle=True`` (then ``weights_only=True``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from functools import cached_property
from pathlib import Path

import torch

from submerge.diagnostics.errors import CheckpointMismatch, ModelInputError

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
        self._safe_open = safe_open
        index = path / "model.safetensors.index.json"
        if index.exists():
            files = _shard_map(index)
        else:
            candidates = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
            candidates = [c for c in candidates if not c.name.startswith("adapter_model")]
            if not candidates:
                raise ModelInputError(f"no safetensors weights in {path}")
            files = {}
            for file in candidates:
                for name in self._open(file).keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    files[name] = file
        self._files = files
        self._handles: dict[Path, object] = {}
        for file in set(files.values()):
            if not file.exists():
                raise ModelInputError(f"shard {file.name} listed in {index} is missing")

    def _open(self, file: Path):
        """`safe_open` of one file; a damaged header is a ModelInputError naming the file."""
        try:
            return self._safe_open(file, framework="pt")
        except Exception as exc:  # noqa: BLE001 — SafetensorError, OSError: the library's types differ by version
            raise ModelInputError(f"{file} is not a readable safetensors file: {exc}") from None

    def _handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = self._open(file)
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
                if header_len > size - 8:
                    raise ModelInputError(f"{file} is not a readable safetensors file: its header claims "
                                          f"{header_len:,} bytes, the file has {size:,}")
                digest.update(handle.read(header_len))
                for offset in sorted({8 + header_len, max(0, size // 2 - sample // 2), max(0, size - sample)}):
                    handle.seek(offset)
                    digest.update(handle.read(sample))
            digest.update(str(size).encode())
        info = {"spec": self.spec, "path": str(Path(self.path).resolve()), "content_sha256": digest.hexdigest(),
                "content_hash": "sha256 of each file's header, three 1 MiB samples (start, middle, end) and size"}
        info.update(_hub_revision(self.path))
        return info


def _shard_map(index: Path) -> dict[str, Path]:
    """Tensor name → shard file of a ``model.safetensors.index.json``; every shard must be a file inside the
    model folder (a hostile index could otherwise name ``../../etc/passwd``)."""
    folder = index.parent
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("'weight_map' is not a mapping")
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelInputError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {exc}") from None
    files = {}
    for name, file in weight_map.items():
        inside = os.path.normpath(str(file))  # lexically: hub snapshots' shards are links into ../../blobs
        if not isinstance(file, str) or os.path.isabs(inside) or inside.split(os.sep)[0] in ("..", "."):
            raise ModelInputError(f"{index}: tensor {name!r} is mapped to {file!r}, not a file inside {folder}: "
                                  "refused")
        files[name] = index.parent / file
    return files


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
        self._check_config()
        weights = path / "adapter_model.safetensors"
        if weights.exists():
            from safetensors.torch import load_file

            adapter = load_file(weights)
        elif (path / "adapter_model.bin").exists():
            adapter = load_pickle(path / "adapter_model.bin", allow_pickle)
        else:
            raise ModelInputError(f"{path}: no adapter_model.safetensors")
        base_names = set(base.names())
        self._lora: dict[str, dict[str, torch.Tensor]] = {}
        self._replaced: dict[str, torch.Tensor] = {}
        for key, tensor in adapter.items():
            name = _strip_peft_prefix(key)
            match = re.match(r"(.*)\.lora_([AB])(?:\.[^.]+)?\.weight$", name)
            if match:
                target = match_base_name(match.group(1) + ".weight", base_names)
                if target is None:
                    raise CheckpointMismatch(
                        f"{weights}: LoRA tensor '{key}' targets '{match.group(1)}.weight', which the base lacks"
                    )
                self._lora.setdefault(target, {})[match.group(2)] = tensor
            elif "lora_" not in name:
                target = match_base_name(name.replace(".modules_to_save.default", ""), base_names)
                if target is None:
                    raise CheckpointMismatch(f"{weights}: tensor '{key}' has no counterpart in the base")
                self._replaced[target] = tensor
        for target, pair in self._lora.items():
            if set(pair) != {"A", "B"}:
                raise ModelInputError(f"{weights}: LoRA pair for '{target}' is incomplete ({sorted(pair)})")
            self._check_pair(weights, target, pair["A"], pair["B"])
        self._check_base_name(base)

    def _check_config(self) -> None:
        """The ranks and alphas `_scale` divides by: finite numbers, ranks above 0."""
        where = self.path / "adapter_config.json"
        values = {"r": self.config.get("r", 8), "lora_alpha": self.config.get("lora_alpha", self.config.get("r", 8)),
                  **{f"rank_pattern[{k!r}]": v for k, v in (self.config.get("rank_pattern") or {}).items()},
                  **{f"alpha_pattern[{k!r}]": v for k, v in (self.config.get("alpha_pattern") or {}).items()}}
        for key, value in values.items():
            rank = key.startswith(("r", "rank_pattern"))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                    rank and value <= 0):
                need = "a finite number above 0" if rank else "a finite number"
                raise ModelInputError(f"{where}: {key!r} is {value!r}; it must be {need}")

    def _check_pair(self, weights: Path, target: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """B·A must be a matrix of the base tensor's shape (transposed with fan_in_fan_out)."""
        expected = self.base.shape(target)
        shape = (b.shape[0], a.shape[1]) if a.ndim == 2 and b.ndim == 2 else None
        if self.config.get("fan_in_fan_out") and shape is not None:
            shape = shape[::-1]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or shape != tuple(expected):
            raise CheckpointMismatch(f"{weights}: the LoRA pair for '{target}' does not fit: A is {tuple(a.shape)} and "
                                     f"B {tuple(b.shape)} (B·A must be {tuple(expected)}, the base tensor's shape)")

    def _check_base_name(self, base: CheckpointReader) -> None:
        """Warn when adapter_config.json names a base model other than `base` (by path, hub id or folder name)."""
        named = self.config.get("base_model_name_or_path")
        if not named:
            return
        base_path = Path(base.path).resolve()
        local = Path(str(named)).expanduser()
        if local.exists() and local.resolve() == base_path:
            return

        def short(name) -> str:  # "org/Model-7B (notes)" → "model-7b"
            return str(name).split(" (", 1)[0].rstrip("/").rsplit("/", 1)[-1].lower()

        theirs = short(named)
        ours = {short(name) for name in (base.spec, base_path.name, _hub_revision(base_path).get("hub_repo")) if name}
        if theirs and any(theirs in name or name in theirs for name in ours):  # a local copy's folder: Model-7b-hf
            return
        warnings.warn(f"{self.path}: the adapter was trained on base model {named!r} (its adapter_config.json), not "
                      f"on {base.spec!r}: its update may not mean what it meant there", UserWarning, stacklevel=2)

    def is_zero_update(self) -> bool:
        """Whether the adapter changes nothing (B = 0 or A = 0 in every pair — PEFT initialises B to 0 — and no
        replaced tensor differs from the base)."""
        return (all(not pair["A"].any() or not pair["B"].any() for pair in self._lora.values())
                and all(torch.equal(tensor.float(), self.base.get(name, torch.float32))
                        for name, tensor in self._replaced.items()))

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


def match_base_name(name: str, base_names: set[str]) -> str | None:
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


def load_pickle(file: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
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
        model = load_gguf_model(path, torch.float32)
        return StateDictReader(spec, path, {k: v.detach() for k, v in model.state_dict().items()})
    if path.suffix == ".safetensors" or (path.is_dir() and list(path.glob("*.safetensors"))):
        return SafetensorsReader(spec, path)
    bins = sorted(path.glob("pytorch_model*.bin")) if path.is_dir() else [path] if path.suffix == ".bin" else []
    if bins:
        tensors: dict[str, torch.Tensor] = {}
        for file in bins:
            tensors.update(load_pickle(file, allow_pickle))
        return StateDictReader(spec, path, tensors)
    raise ModelInputError(f"no model weights found at {path} (expected safetensors, a .gguf file or a LoRA adapter)")


def model_fingerprints(models: dict[str, str], base: CheckpointReader, *, allow_pickle: bool = False) -> dict:
    """Label → fingerprint (content hash where the reader has one) of each model a command evaluates, so that a
    model rewritten under the same path is a changed input of a resumed run, not the same one (issue 26)."""
    fingerprints = {}
    for label, spec in models.items():
        path = local_path(spec, allow_pickle=allow_pickle, role=f"model '{label}'")
        if path.is_dir() and ((path / "adapter_config.json").exists() or list(path.glob("*.safetensors"))):
            fingerprints[label] = open_checkpoint(spec, base=base, allow_pickle=allow_pickle).fingerprint()
        else:  # GGUF or pickled weights: path and size, without loading the whole model only to name it
            files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
            fingerprints[label] = {"spec": spec, "path": str(path.resolve()),
                                   "file_size": sum(file.stat().st_size for file in files)}
    return fingerprints


def gguf_file(path: Path) -> tuple[Path, str]:
    if path.is_file():
        return path.parent, path.name
    files = sorted(path.glob("*.gguf"))
    if len(files) != 1:
        raise ModelInputError(f"{path}: expected exactly one .gguf file, found {[f.name for f in files]}")
    return path, files[0].name


def load_gguf_model(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    directory, name = gguf_file(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    except Exception as exc:
        raise ModelInputError(f"could not load GGUF {directory / name}: {exc}") from exc
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    return model


def checkpoint_spec(reader) -> dict:
    """What a worker needs to reopen a `CheckpointReader`: its resolved path and how it was opened."""
    if not hasattr(reader, "path"):
        raise TypeError(f"ray needs checkpoints it can reopen from a path; {type(reader).__name__} has none")
    return {"path": str(Path(reader.path).resolve()), "lora": isinstance(reader, LoraReader),
            "allow_pickle": isinstance(reader, StateDictReader)}


def reopen_checkpoint(spec: dict, base=None):
    """The `CheckpointReader` of a :func:`checkpoint_spec` (a LoRA adapter is read against ``base``)."""

    return open_checkpoint(spec["path"], base=base if spec["lora"] else None, allow_pickle=spec["allow_pickle"])

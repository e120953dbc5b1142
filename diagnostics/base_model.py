"""The base model θ0: the only model ever instantiated, with its tokenizer and a lazy reader of its checkpoint.

`load_base_model` builds it (in its checkpoint's storage dtype by default, memory-mapped), `meta_model` builds a
checkpoint's model class on the meta device (no weights: the tensor table, a Ray driver), and `checkpoint_name_map`
maps the model's parameter names to the checkpoint's tensor names.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from submerge.diagnostics.checkpoints import (
    CheckpointReader,
    SafetensorsReader,
    gguf_file,
    load_gguf_model,
    load_pickle,
    local_path,
    match_base_name,
    open_checkpoint,
)
from submerge.diagnostics.errors import ModelInputError
from submerge.diagnostics.placement import offload_to, offloads, pick_device


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


@dataclass(frozen=True)
class LoadSettings:
    """How a command reads its models and where they compute (--dtype, --device, --offload, --allow-pickle,
    --trust-remote-code): `load_base_model`'s keywords as one object, which drivers take and Ray workers receive."""

    dtype: str = "auto"
    device: str = "auto"
    offload: bool = False
    allow_pickle: bool = False
    trust_remote_code: bool = False

    def keywords(self) -> dict:
        """These settings as `load_base_model` keywords."""
        return asdict(self)


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

    path = local_path(spec, revision=revision, allow_pickle=allow_pickle, role="base model")
    target = pick_device(device)
    if path.suffix == ".gguf" or (path.is_dir() and list(path.glob("*.gguf")) and not list(path.glob("*.safetensors"))):
        directory, name = gguf_file(path)
        torch_dtype = pick_dtype(dtype) if dtype not in (None, "auto") else torch.float32
        model = load_gguf_model(path, torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    else:
        if not (path / "config.json").exists():
            raise ModelInputError(f"{path} has no config.json; is it a Hugging Face model directory?")
        if not allow_pickle and not list(path.glob("*.safetensors")):
            load_pickle(path, False)  # raises the explanatory error
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except ValueError as exc:
            raise ModelInputError(f"{path}: {exc} (pass --trust-remote-code only if you trust this repository)") from exc
        check_config_sizes(config, path)
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
        found = match_base_name(name, names)
        if found is None and id(parameter) in canonical:
            found = canonical[id(parameter)]
        if found is not None:
            mapping[name] = found
            canonical.setdefault(id(parameter), found)
    return mapping


def check_config_sizes(config, directory: Path) -> None:
    """Refuse a config.json whose sizes its safetensors checkpoint does not have (read from the headers only),
    before a model is built from it: a hostile or mistaken ``num_hidden_layers: 100000`` would otherwise take
    gigabytes and minutes to build before failing."""
    if not list(directory.glob("*.safetensors")):
        return
    reader = SafetensorsReader(str(directory), directory)
    names = reader.names()
    blocks: dict[str, set[int]] = {}
    for name in names:
        match = re.match(r"(.*?)\.?(\d+)\.", name)
        if match:
            blocks.setdefault(match.group(1), set()).add(int(match.group(2)))
    where = directory / "config.json"
    layers = getattr(config, "num_hidden_layers", None)
    if blocks and isinstance(layers, int):
        prefix, indices = max(blocks.items(), key=lambda item: len(item[1]))
        if layers > max(indices) + 1:
            raise ModelInputError(f"{where} says {layers} blocks, the checkpoint holds {max(indices) + 1} under "
                                  f"'{prefix}': refused before building the model")
    dimensions = {size for name in names for size in reader.shape(name)}
    for key in ("hidden_size", "intermediate_size", "n_inner"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0 and value not in dimensions:
            raise ModelInputError(f"{where}: {key} = {value}, but no tensor of the checkpoint has a dimension of that "
                                  "size: refused before building the model")
    reader.release()


def meta_model(path, *, trust_remote_code: bool = False, buffers: bool = True, dtype=None) -> nn.Module:
    """The model class of a checkpoint directory (or .gguf file) instantiated on the meta device.

    With ``buffers=False`` only the parameters are on the meta device: buffers (rotary frequencies, position
    ids, masks) are built on the CPU as the model's constructor computes them, in the default dtype `dtype`.
    """
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    directory = path if path.is_dir() else path.parent
    if path.suffix == ".gguf":
        config = AutoConfig.from_pretrained(directory, gguf_file=path.name)
    elif (directory / "config.json").exists():
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    else:
        raise ModelInputError(f"{directory} has no config.json: cannot tell what its tensors are")
    if path.suffix != ".gguf":
        check_config_sizes(config, directory)
    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or []))
    auto = AutoModelForCausalLM if causal else AutoModel
    with torch.device("meta") if buffers else init_empty_weights(include_buffers=False):
        return auto.from_config(config, trust_remote_code=trust_remote_code, **({"dtype": dtype} if dtype else {}))

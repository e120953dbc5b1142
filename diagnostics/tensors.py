"""One table that says what each checkpoint tensor is (after mergekit's ``WeightInfo``).

`TensorTable` is built once from the model's structure (`submerge.diagnostics.modules`
finds blocks, attention and MLP) and maps every checkpoint tensor name to a
`TensorInfo`: its block, the replay unit that contains it (``level``), how the
merge treats it (``kind``), how heads slice it, whether it is stored (in, out)
(transformers' ``Conv1D``) and which tensor it is tied to. The plan, the merge
writer, the interference driver, the mergekit export and the notebooks read only
this table; nothing else classifies tensors by name.

``level`` is the smallest unit whose replay runs the tensor, so the α fitted for
a unit is the α applied to its tensors:

- ``attn``  inside the block's attention module (BERT: ``attention.output.LayerNorm`` too)
- ``mlp``   inside the block's MLP (BERT: ``intermediate`` and ``output``, its LayerNorm included)
- ``norm``  inside a block but outside both (``input_layernorm``, GPT-2 ``ln_1``)
- ``embed`` the input/output embeddings (``embed_tokens``, ``wte``, ``wpe``, ``lm_head``)
- ``final`` outside the blocks and not an embedding (the final norm, a pooler)

A model is built on the ``meta`` device from the config when only a checkpoint is
at hand (`TensorTable.from_checkpoint`), so a 70B table costs no memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from torch import nn

from submerge.diagnostics.base_model import checkpoint_name_map, meta_model
from submerge.diagnostics.checkpoints import open_checkpoint
from submerge.diagnostics.modules import GRANULARITIES, Architecture, find_architecture, is_linear

KINDS = ("matrix", "embedding", "bias", "norm")
LEVELS = ("attn", "mlp", "norm", "embed", "final")

_QUERY_NAMES = ("q_proj", "query", "q", "wq", "q_lin")
_KEY_VALUE_NAMES = ("k_proj", "v_proj", "key", "value", "k", "v", "wk", "wv", "k_lin", "v_lin")


@dataclass(frozen=True)
class TensorInfo:
    """What one checkpoint tensor is."""

    name: str  # name in the checkpoint
    parameter: str  # name of the model parameter it fills
    module: str  # in the naming scheme: layers.3.attn.q_proj, layers.3.mlp.output.LayerNorm, embed_tokens
    layer: int  # block index, -1 outside the blocks
    level: str  # attn | mlp | norm | embed | final (the smallest replay unit that runs it)
    kind: str  # matrix | embedding | bias | norm (how merge strategies treat it)
    shape: tuple[int, ...]
    head_split: str | None = None  # q: rows per head | kv: rows per k/v head | o: columns per head | fused | None
    transposed: bool = False  # stored (in, out): transformers Conv1D (GPT-2)
    tied_to: str | None = None  # the checkpoint tensor this one shares its values with in the model

    def unit(self, granularity: str) -> str | None:
        """The α unit that holds this tensor at `granularity` (None: outside every unit, the plan's "rest").

        At ``head-mlp`` an attention tensor answers its attention unit; the plan
        splits it per head with `head_split`.
        """
        if granularity not in GRANULARITIES:
            raise ValueError(f"unknown granularity '{granularity}' (choose from {list(GRANULARITIES)})")
        if granularity == "model":
            return "model"
        if self.layer < 0:
            return None
        if granularity == "layer":
            return f"layers.{self.layer}"
        if self.level in ("attn", "mlp"):
            return f"layers.{self.layer}.{self.level}"
        return None

    @property
    def is_weight_matrix(self) -> bool:
        """A 2-D weight measured by the interference diagnostics (matrices and embeddings)."""
        return len(self.shape) == 2 and self.name.endswith("weight")


class TensorTable:
    """Checkpoint tensor name → `TensorInfo`, in checkpoint order of the model's parameters."""

    def __init__(self, infos: list[TensorInfo], arch: Architecture):
        self.arch = arch
        self._infos = {info.name: info for info in infos}

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"tensor '{name}' is not a parameter of the model (known: {len(self._infos)} tensors)") from None

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self._infos.values())

    def __len__(self) -> int:
        return len(self._infos)

    def names(self) -> list[str]:
        return list(self._infos)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
        """The info of `name`; a checkpoint tensor the model has no parameter for (a buffer) is ``final``."""
        if name in self._infos:
            return self._infos[name]
        shape = tuple(shape or ())
        return TensorInfo(name, name, name, -1, "final", "matrix" if len(shape) >= 2 else "bias", shape)

    # ------------------------------------------------------------------ building

    @classmethod
    def from_model(cls, model: nn.Module, checkpoint_names: dict[str, str] | None = None,
                   arch: Architecture | None = None) -> "TensorTable":
        """The table of `model`; `checkpoint_names` maps parameter names to checkpoint names (default: the same)."""
        arch = arch or find_architecture(model)
        checkpoint_names = checkpoint_names or {}
        output_embedding = _output_embedding_weight(model)
        first_name: dict[int, str] = {}
        infos: list[TensorInfo] = []
        seen: set[str] = set()
        for parameter_name, parameter in model.named_parameters(remove_duplicate=False):
            name = checkpoint_names.get(parameter_name, parameter_name)
            tied_to = first_name.setdefault(id(parameter), name)
            if name in seen:
                continue
            seen.add(name)
            module_path, _, _ = parameter_name.rpartition(".")
            module = model.get_submodule(module_path) if module_path else model
            info = _describe(parameter_name, name, tuple(parameter.shape), module, arch,
                             is_output_embedding=parameter is output_embedding)
            infos.append(_with_tie(info, tied_to if tied_to != name else None))
        return cls(infos, arch)

    @classmethod
    def from_checkpoint(cls, spec: str, *, allow_pickle: bool = False, trust_remote_code: bool = False,
                        revision: str | None = None) -> "TensorTable":
        """The table of the model a checkpoint holds, built on the meta device from its config (no weights read)."""
        reader = open_checkpoint(spec, revision=revision, allow_pickle=allow_pickle)
        return cls.from_reader(reader, trust_remote_code=trust_remote_code)

    @classmethod
    def from_reader(cls, reader, *, trust_remote_code: bool = False) -> "TensorTable":
        """The table of an opened checkpoint (`submerge.diagnostics.checkpoints.CheckpointReader`), from its config."""
        model = meta_model(Path(reader.path), trust_remote_code=trust_remote_code)
        return cls.from_model(model, checkpoint_name_map(model, reader))




def _output_embedding_weight(model: nn.Module):
    getter = getattr(model, "get_output_embeddings", None)
    output = getter() if callable(getter) else None
    return getattr(output, "weight", None)


def _with_tie(info: TensorInfo, tied_to: str | None) -> TensorInfo:
    if tied_to is None:
        return info
    return replace(info, tied_to=tied_to)


def _kind(module: nn.Module, shape: tuple[int, ...], is_output_embedding: bool) -> str:
    if isinstance(module, nn.Embedding) or is_output_embedding:
        return "embedding"
    if "norm" in type(module).__name__.lower() and len(shape) < 2:
        return "norm"
    return "matrix" if len(shape) >= 2 else "bias"


def _describe(parameter_name: str, name: str, shape: tuple[int, ...], module: nn.Module, arch: Architecture,
              *, is_output_embedding: bool) -> TensorInfo:
    kind = _kind(module, shape, is_output_embedding)
    transposed = type(module).__name__ == "Conv1D" and len(shape) == 2
    prefix = arch.layers_path + "."
    if not parameter_name.startswith(prefix):
        stem = parameter_name.rsplit(".", 1)[0] if "." in parameter_name else parameter_name
        local = stem[len(arch.backbone_path) + 1:] if arch.backbone_path and stem.startswith(arch.backbone_path + ".") else stem
        level = "embed" if kind == "embedding" else "final"
        return TensorInfo(name, parameter_name, local, -1, level, kind, shape, transposed=transposed)
    layer_text, _, rest = parameter_name[len(prefix):].partition(".")
    layer = int(layer_text)
    stem = rest.rsplit(".", 1)[0]  # e.g. self_attn.q_proj
    child, _, inside = stem.partition(".")
    if child == arch.attn_child:
        head_split = _head_split(inside, module, arch) if parameter_name.endswith(("weight", "bias")) else None
        return TensorInfo(name, parameter_name, f"layers.{layer}.attn.{inside}".rstrip("."), layer, "attn", kind,
                          shape, head_split, transposed)
    if child in arch.mlp_children:
        local = inside if len(arch.mlp_children) == 1 else stem
        return TensorInfo(name, parameter_name, f"layers.{layer}.mlp.{local}".rstrip("."), layer, "mlp", kind, shape,
                          transposed=transposed)
    return TensorInfo(name, parameter_name, f"layers.{layer}.{stem}", layer, "norm", kind, shape,
                      transposed=transposed)


def _head_split(inside: str, module: nn.Module, arch: Architecture) -> str | None:
    """How heads slice a tensor of the attention module (path `inside` relative to it)."""
    if not is_linear(module):
        return None
    if inside == arch.o_proj:
        return "o"
    last = inside.rsplit(".", 1)[-1]
    if last in _QUERY_NAMES:
        return "q"
    if last in _KEY_VALUE_NAMES:
        return "kv"
    return "fused"

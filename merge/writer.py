"""Stream a merge tensor by tensor into a normal Hugging Face checkpoint.

For each tensor of the base checkpoint, the task vectors of every fine-tune are
read (one tensor per model in memory), merged by a rule (`ParameterRule`), added
to the base tensor and written into the current shard; a shard is flushed when
it reaches `shard_size`. Peak memory is about one tensor per input model plus
one output shard. The directory gets sharded safetensors with an index, the
base's config, generation config and tokenizer files, and ``submerge_merge.yaml``
with the plan or options used.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from diagnostics.errors import SubmergeError
from diagnostics.models import local_path, open_checkpoint, open_finetunes
from diagnostics.progress import progress_bar
from diagnostics.store import provenance
from diagnostics.tensors import TensorInfo, TensorTable
from merge.strategies import merge_parameter

_COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


class MergeError(SubmergeError):
    """The merge cannot be written (output exists, bad method options ...)."""


@dataclass
class ParameterRule:
    """How one tensor is merged: a registered method with options, or fixed per-task weights."""

    method: str = "task-arithmetic"
    options: dict | None = None
    weights: dict[str, float] | None = None  # θ0 + Σ_t w_t τ_t (closed-form α)

    def describe(self) -> str:
        if self.weights is not None:
            return "weights " + ", ".join(
                f"{t}={w:.4g}" if isinstance(w, (int, float)) else f"{t}=per-head" for t, w in self.weights.items()
            )
        return self.method + (f" {self.options}" if self.options else "")


def parse_size(value: str | int) -> int:
    if isinstance(value, int):
        return value
    text = value.strip().upper()
    for suffix, factor in (("GB", 1024**3), ("MB", 1024**2), ("KB", 1024), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def prepare_output(out_dir: Path, force: bool) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        if not force:
            raise MergeError(f"output directory {out_dir} exists and is not empty; pass --force to overwrite it")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def write_merge(
    base: str,
    finetuned: dict[str, str],
    out_dir: str | Path,
    rule_for: Callable[[TensorInfo], ParameterRule],
    *,
    record: dict | None = None,
    force: bool = False,
    allow_pickle: bool = False,
    vocab: str = "base",
    shard_size: str | int = "2GB",
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    gram_matrices: Callable[[str], list[torch.Tensor] | None] | None = None,
    progress: bool = True,
) -> Path:
    """Merge `finetuned` into `base` tensor by tensor with the rule `rule_for(info)` gives (info: the tensor table's).

    Returns the output directory, loadable with `AutoModelForCausalLM.from_pretrained`.
    """
    from safetensors.torch import save_file

    out_dir = prepare_output(Path(out_dir), force)
    base_reader = open_checkpoint(base, allow_pickle=allow_pickle)
    task_vectors, report = open_finetunes(base_reader, finetuned, allow_pickle=allow_pickle, vocab=vocab)
    limit = parse_size(shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    weight_map: dict[str, int] = {}
    used: dict[str, str] = {}
    names = base_reader.names()
    temporary: list[Path] = []
    table = TensorTable.from_reader(base_reader)

    def flush():
        nonlocal shard_bytes
        if shards[-1]:
            path = out_dir / f"model-{len(temporary) + 1:05d}.safetensors.partial"
            save_file(shards[-1], str(path), metadata={"format": "pt"})
            temporary.append(path)
            shards[-1] = {}
            shard_bytes = 0

    with progress_bar(progress) as bar:
        job = bar.add_task("Merging tensors", total=len(names))
        for name in names:
            base_tensor = base_reader.get(name, device=device)
            target_dtype = dtype or base_tensor.dtype
            if not base_tensor.is_floating_point():
                merged = base_tensor
            else:
                info = table.get(name, tuple(base_tensor.shape))
                rule = rule_for(info)
                vectors = [tv.get(name, torch.float32, device) for tv in task_vectors.values()]
                if rule.weights is not None:
                    delta = sum(rule.weights.get(task, 0.0) * vector for task, vector in zip(task_vectors, vectors))
                else:
                    grams = gram_matrices(name) if (gram_matrices and rule.method == "regmean") else None
                    transposed = bool(grams) and info.transposed
                    if transposed:  # GPT-2 Conv1D stores (in, out)
                        vectors = [v.T for v in vectors]
                    try:
                        delta = merge_parameter(name, vectors, rule.method, rule.options, kind=info.kind,
                                                gram_matrices=grams)
                    except ValueError as exc:
                        raise MergeError(f"merging '{name}' {tuple(base_tensor.shape)}: {exc}") from exc
                    if transposed:
                        delta = delta.T
                merged = (base_tensor.to(torch.float32) + delta).to(target_dtype)
                used[name] = rule.describe()
                if not torch.isfinite(merged).all():
                    raise MergeError(f"merged tensor '{name}' has NaN/Inf values (rule: {rule.describe()})")
            merged = merged.contiguous().cpu()
            shards[-1][name] = merged
            weight_map[name] = len(temporary)
            shard_bytes += merged.numel() * merged.element_size()
            if shard_bytes >= limit:
                flush()
            bar.advance(job)
        flush()
    total = len(temporary)
    final_names = []
    for index, path in enumerate(temporary, start=1):
        final = out_dir / (f"model-{index:05d}-of-{total:05d}.safetensors" if total > 1 else "model.safetensors")
        path.rename(final)
        final_names.append(final.name)
    if total > 1:
        index = {
            "metadata": {"total_size": sum((out_dir / n).stat().st_size for n in final_names)},
            "weight_map": {name: final_names[shard] for name, shard in weight_map.items()},
        }
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    _copy_model_files(base, out_dir, allow_pickle)
    summary = _rule_summary(used)
    (out_dir / "submerge_merge.yaml").write_text(
        yaml.safe_dump(
            {
                **(record or {}),
                "rules": summary,
                "provenance": provenance(
                    base_model={"spec": base},
                    finetuned={t: tv.finetuned.fingerprint() for t, tv in task_vectors.items()},
                    preflight=report,
                ),
            },
            sort_keys=False,
            allow_unicode=True,
        )
    )
    return out_dir


def _rule_summary(used: dict[str, str]) -> dict[str, list[str]]:
    by_rule: dict[str, list[str]] = {}
    for name, rule in used.items():
        by_rule.setdefault(rule, []).append(name)
    return {
        rule: (names if len(names) <= 8 else names[:8] + [f"... {len(names) - 8} more"])
        for rule, names in by_rule.items()
    }


def _copy_model_files(base: str, out_dir: Path, allow_pickle: bool) -> None:
    source = local_path(base, allow_pickle=allow_pickle)
    directory = source if source.is_dir() else source.parent
    for name in _COPIED_FILES:
        if (directory / name).exists():
            shutil.copy2(directory / name, out_dir / name)
    config = out_dir / "config.json"
    if config.exists():
        content = json.loads(config.read_text())
        content.pop("quantization_config", None)
        config.write_text(json.dumps(content, indent=2))


def method_rule(method: str, options: dict | None = None) -> Callable[[TensorInfo], ParameterRule]:
    """The same registered method for every tensor."""
    from merge.strategies import STRATEGIES

    if method not in STRATEGIES:
        raise MergeError(f"unknown merge method '{method}'; known: {', '.join(STRATEGIES)}")
    try:
        STRATEGIES[method].resolve_options(options)
    except ValueError as exc:
        raise MergeError(str(exc)) from exc
    rule = ParameterRule(method=method, options=options or {})
    return lambda info: rule

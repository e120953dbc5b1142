"""Stream a merge tensor by tensor into a normal Hugging Face checkpoint.

For each tensor of the base checkpoint, the task vectors of every fine-tune are
read (one tensor per model in memory), merged by a rule (`ParameterRule`) with the
pure `merge_tensor`, and streamed into its safetensors shard by `ShardWriter`
(shards are laid out up front, so no shard is held in memory; the inputs' files
are unmapped after each tensor). Peak memory is about one tensor per input model
plus the merged tensor. The directory gets sharded safetensors with an index, the
base's config, generation config and tokenizer files, and ``submerge_merge.yaml``
with the plan or options used; it is written as ``<out>.partial-<pid>`` and renamed
into place when complete.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch
import yaml

from submerge.diagnostics.checkpoints import local_path, open_checkpoint
from submerge.diagnostics.execution import Engine, LocalEngine
from submerge.diagnostics.faults import fault_point
from submerge.diagnostics.outputs import MERGE_MARKER, check_output_directory
from submerge.diagnostics.placement import process_alive
from submerge.diagnostics.progress import progress_bar
from submerge.diagnostics.provenance import provenance
from submerge.diagnostics.task_vectors import open_finetunes
from submerge.diagnostics.tensors import TensorInfo
from submerge.merge.rules import MergeError, ParameterRule, method_rule, regmean_rule
from submerge.merge.tensor_merge import MergeTask

__all__ = ["MergeError", "ParameterRule", "ShardWriter", "check_not_an_input", "check_output", "method_rule",
           "parse_size", "regmean_rule", "write_merge", "write_merges"]

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


def parse_size(value: str | int, option: str = "--shard-size") -> int:
    """Bytes in a size such as ``2GB``, ``500MB``, ``64KB``, ``100B`` or a plain integer (powers of 1024)."""
    size = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        text = str(value).strip().upper()
        suffix = next((s for s in _SIZE_FACTORS if text.endswith(s)), "")
        try:
            size = int(float(text[: len(text) - len(suffix)]) * _SIZE_FACTORS.get(suffix, 1))
        except ValueError:
            pass
    if size is None or size <= 0:
        raise MergeError(f"{option}: cannot read {value!r} as a size; use e.g. 2GB, 500MB, 64KB or a number of bytes")
    return size


_SIZE_FACTORS = {"GB": 1024**3, "MB": 1024**2, "KB": 1024, "B": 1}


def check_output(out_dir: Path, force: bool, option: str = "--out") -> None:
    """Refuse `out_dir` unless it is absent, empty or — with `force` — an earlier merge (`check_output_directory`);
    name a staging directory that a killed merge into it left behind. Nothing is deleted here."""
    check_output_directory(out_dir, force, option=option)
    for leftover in _leftover_staging(Path(out_dir)):
        warnings.warn(f"{leftover} is what a merge into {out_dir} that was killed left behind; it is removed "
                      "when this merge starts", stacklevel=2)


def _leftover_staging(out_dir: Path) -> list[Path]:
    """Staging directories ``<out>.partial-<pid>`` whose process is gone (a killed merge's)."""
    leftovers = []
    for path in out_dir.parent.glob(f"{out_dir.name}.partial-*") if out_dir.parent.is_dir() else []:
        pid = path.name.rsplit("-", 1)[-1]
        if path.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            leftovers.append(path)
    return leftovers


def check_not_an_input(out_dir: Path, inputs: dict[str, Path]) -> None:
    """Refuse an output that is, contains or is inside an input model's directory.

    `inputs` maps a description ("base model", "fine-tune 'math'") to its checkpoint path; for a
    single-file checkpoint the output may not be the file, contain it or be its directory."""
    out = Path(out_dir).resolve()
    for what, path in inputs.items():
        path = Path(path).resolve()
        if path.is_dir():
            clash = out == path or path in out.parents or out in path.parents
        else:
            clash = out in (path, path.parent) or out in path.parents
        if clash:
            raise MergeError(f"--out {out_dir} would overwrite the {what} ({path}): choose a directory that is "
                             "neither an input model's directory nor inside or around one")


def _staging_directory(out_dir: Path) -> Path:
    """A sibling of `out_dir` that the merge is written into, renamed into place once complete."""
    for leftover in _leftover_staging(out_dir):  # a killed merge's: only shards and files this writer writes
        shutil.rmtree(leftover, ignore_errors=True)
    staging = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def _replace(staging: Path, out_dir: Path) -> None:
    """Move the complete merge into place; an old output (``--force``) is removed only after that."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
    out_dir.rename(old)
    staging.rename(out_dir)
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()


class ShardWriter:
    """Sharded safetensors streamed to disk: no shard is held in memory.

    The shards are laid out up front from the tensors' names, shapes and dtypes in writing order
    (`layout`; a shard closes once it holds `limit` bytes); each file gets its header first and every
    tensor's bytes as it arrives (`add`, in layout order). Files are written as ``*.partial`` and
    renamed by `finish` to ``model.safetensors`` (one shard) or ``model-0000i-of-0000n.safetensors``
    with ``model.safetensors.index.json``.
    """

    def __init__(self, directory: Path, limit: int, layout: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.directory = Path(directory)
        self.layout = list(layout)
        self.weight_map: dict[str, int] = {}
        self.shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for name, shape, dtype in self.layout:
            self.shards[-1].append((name, tuple(shape), dtype))
            self.weight_map[name] = len(self.shards) - 1
            size += math.prod(shape) * dtype.itemsize
            if size >= limit:
                self.shards.append([])
                size = 0
        if not self.shards[-1] and len(self.shards) > 1:
            self.shards.pop()
        self.position, self.file, self.current = 0, None, -1

    def add(self, name: str, tensor: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Write the next laid-out tensor: the tensor, or its blocks of rows (dim 0) in order."""
        if self.position >= len(self.layout):
            raise MergeError(f"shard writer: '{name}' was not laid out (all {len(self.layout)} tensors are written)")
        expected, shape, dtype = self.layout[self.position]
        rows = 0
        for piece in [tensor] if isinstance(tensor, torch.Tensor) else tensor:
            if (name, piece.ndim, tuple(piece.shape[1:]), piece.dtype) != (expected, len(shape), tuple(shape[1:]), dtype):
                raise MergeError(f"shard writer: got '{name}' {tuple(piece.shape)} {piece.dtype}, "
                                 f"expected '{expected}' {tuple(shape)} {dtype}")
            if self.weight_map[name] != self.current:
                self._open(self.weight_map[name])
            data = piece.detach().to("cpu").contiguous().reshape(-1)
            if data.numel():
                payload = data.view(torch.uint8).numpy().data
                fault_point("write", self._path(self.current), payload)
                self.file.write(payload)
            rows += piece.shape[0] if piece.ndim else 1
        if rows != (shape[0] if shape else 1):
            raise MergeError(f"shard writer: '{name}' got {rows} rows, expected {tuple(shape)}")
        self.position += 1

    def _path(self, shard: int) -> Path:
        return self.directory / f"model-{shard + 1:05d}.safetensors.partial"

    def _open(self, shard: int) -> None:
        if self.file is not None:
            self.file.close()
        header = _safetensors_header(self.shards[shard])
        fault_point("write", self._path(shard), header)
        self.file, self.current = open(self._path(shard), "wb"), shard  # noqa: SIM115 (closed in _open / finish)
        self.file.write(header)

    def finish(self) -> list[str]:
        """Close the last shard, give the shards their final names, write the index; returns the file names."""
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.position != len(self.layout):
            raise MergeError(f"shard writer: {len(self.layout) - self.position} laid-out tensors were not written")
        total = len(self.shards) if self.layout else 0
        final_names = []
        for index in range(total):
            final = self.directory / (f"model-{index + 1:05d}-of-{total:05d}.safetensors" if total > 1
                                      else "model.safetensors")
            self._path(index).rename(final)
            final_names.append(final.name)
        if total > 1:
            index = {
                "metadata": {"total_size": sum((self.directory / n).stat().st_size for n in final_names)},
                "weight_map": {name: final_names[shard] for name, shard in self.weight_map.items()},
            }
            write_file(self.directory / "model.safetensors.index.json", json.dumps(index, indent=2).encode())
        return final_names


_SAFETENSORS_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def _safetensors_header(entries) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding `entries` (name, shape, dtype) in order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        if dtype not in _SAFETENSORS_NAMES:
            raise MergeError(f"tensor '{name}': dtype {dtype} cannot be written to safetensors here")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text


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
    engine: Engine | None = None,
) -> Path:
    """Merge `finetuned` into `base` tensor by tensor with the rule `rule_for(info)` gives (info: the tensor table's).

    Tensors are written in `dtype` (default: each base tensor's). The checkpoint is written into a
    sibling directory ``<out>.partial-<pid>`` and renamed to `out_dir` once complete; with `force` an
    earlier merge there is removed only then, so a failed merge leaves it as it was; anything else in
    `out_dir` is refused (`check_output`). An `out_dir` that is,
    contains or is inside an input model's directory is refused before anything is written.
    Returns the output directory, loadable with `AutoModelForCausalLM.from_pretrained`.

    ``gram_matrices(name)``: the per-tensor data input, one tensor per task, of a rule whose method takes one
    (`submerge.merge.strategies.TENSOR_INPUTS`: RegMean's input Grams, Fisher merging's diagonals); None for a
    tensor without one.
    ``engine`` (`submerge.diagnostics.execution`; default `LocalEngine`) merges groups of tensors, here or in Ray
    workers (`submerge.merge.tensor_merge.MergeTask`); this process alone writes the shards, in order, so the
    checkpoint is byte for byte the same on every engine.
    """
    return write_merges(base, finetuned, [(out_dir, rule_for, record)], force=force, allow_pickle=allow_pickle,
                        vocab=vocab, shard_size=shard_size, dtype=dtype, device=device, gram_matrices=gram_matrices,
                        progress=progress, engine=engine)[0]


def write_merges(
    base: str,
    finetuned: dict[str, str],
    outputs: Sequence[tuple[str | Path, Callable[[TensorInfo], ParameterRule], dict | None]],
    *,
    force: bool = False,
    allow_pickle: bool = False,
    vocab: str = "base",
    shard_size: str | int = "2GB",
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    gram_matrices: Callable[[str], list[torch.Tensor] | None] | None = None,
    progress: bool = True,
    engine: Engine | None = None,
) -> list[Path]:
    """Several merges of the same fine-tunes in one pass: `outputs` is (out_dir, rule_for, record) per merge, and
    each checkpoint is byte for byte what `write_merge` writes for it alone. Each tensor and its task vectors are
    read once for all of them, and their merges of a tensor share the decompositions they have in common (KnOTS's
    and CART's SVDs at several settings: `submerge.merge.strategies.shared_factors`); the peak is one tensor's
    inputs plus one merged tensor per output. `gram_matrices` is the data input of every output's rules. Every
    output is checked before anything is written, and none is put in place until all are complete."""
    outputs = [(Path(out_dir), rule_for, record) for out_dir, rule_for, record in outputs]
    if not outputs:
        return []
    engine = engine or LocalEngine()
    limit = parse_size(shard_size)
    base_reader = open_checkpoint(base, allow_pickle=allow_pickle)
    task_vectors, report = open_finetunes(base_reader, finetuned, allow_pickle=allow_pickle, vocab=vocab)
    inputs = {"base model": base_reader.path, **{f"fine-tune '{t}'": tv.finetuned.path for t, tv in task_vectors.items()}}
    directories = [out_dir for out_dir, _, _ in outputs]
    if len(set(directories)) != len(directories):
        raise MergeError(f"write_merges: an output directory is named twice: {[str(d) for d in directories]}")
    for out_dir in directories:
        check_not_an_input(out_dir, inputs)
        check_output(out_dir, force)
    names = writing_order(base_reader.names())
    layout = [(name, base_reader.shape(name), _written_dtype(base_reader.dtype(name), dtype)) for name in names]
    stagings: list[Path] = []
    try:
        for out_dir in directories:
            stagings.append(_staging_directory(out_dir))
        shards = [ShardWriter(staging, limit, layout) for staging in stagings]
        tensors = _merged_tensors(names, base_reader, task_vectors, [rule_for for _, rule_for, _ in outputs],
                                  dtype=dtype, device=device, gram_matrices=gram_matrices, engine=engine)
        used = _stream_tensors(tensors, len(names), shards, progress)
        for staging, writer, used_rules, (_, _, record) in zip(stagings, shards, used, outputs):
            writer.finish()
            _copy_model_files(base, staging, allow_pickle)
            _write_record(staging, record, used_rules, base, task_vectors, report, engine.provenance())
    except OSError as exc:  # a full disk, a quota, a file-size limit: nothing at out_dir has changed
        for staging in stagings:
            shutil.rmtree(staging, ignore_errors=True)
        where = ", ".join(str(d) for d in directories)
        raise MergeError(f"could not write the merge into {', '.join(str(s) for s in stagings)} "
                         f"({exc.strerror or exc}): {where} is left as it was; free space (or raise the limit) and "
                         "run the same command again") from None
    except BaseException:
        for staging in stagings:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    for staging, out_dir in zip(stagings, directories):
        _replace(staging, out_dir)
    return directories


def write_file(path: Path, data: bytes) -> None:
    """Write one file of a merge's staging folder (a write point of the fault tests: `submerge.diagnostics.faults`)."""
    fault_point("write", path, data)
    path.write_bytes(data)


def _written_dtype(stored: torch.dtype, out_dtype: torch.dtype | None) -> torch.dtype:
    """`out_dtype` for floating tensors when given, else the stored dtype (integer buffers always keep theirs)."""
    return out_dtype if (out_dtype is not None and stored.is_floating_point) else stored


def writing_order(names: list[str]) -> list[str]:
    """The checkpoint's tensor names in the order a merge writes them: numbers compared as numbers
    (``layers.2`` before ``layers.10``), so block after block — RegMean's Grams (`GramsByLayer`) are then
    computed once per block, and the first shards hold the first blocks."""
    def key(name: str) -> list:
        return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]

    return sorted(names, key=key)


def _merged_tensors(names: list[str], base_reader, task_vectors, rule_fors, *, dtype, device, gram_matrices,
                    engine) -> Iterator[tuple[str, list[tuple]]]:
    """(name, [(merged tensor or its row blocks, rule description) per rule function of `rule_fors`]) of every
    tensor of `names`, in order, merged on `engine` in the engine's groups."""
    task = MergeTask.of(base_reader, task_vectors, rule_fors, gram_matrices, dtype=dtype, device=device)
    groups = engine.groups(names, [math.prod(base_reader.shape(name)) for name in names])
    for group in engine.map(task, groups):
        yield from group


def _stream_tensors(tensors: Iterator, total: int, shards: list[ShardWriter], progress: bool) -> list[dict[str, str]]:
    """Write the merged `tensors` (name, [(tensor, rule) per output]) into each output's `shards`, in order; returns
    name → rule description per output."""
    used: list[dict[str, str]] = [{} for _ in shards]
    with progress_bar(progress) as bar:
        job = bar.add_task("Merging tensors", total=total)
        for name, results in tensors:
            for writer, rules, (merged, rule) in zip(shards, used, results):
                writer.add(name, merged)
                if rule is not None:
                    rules[name] = rule
                del merged
            del results
            bar.advance(job)
    return used


def _write_record(out_dir: Path, record: dict | None, used: dict[str, str], base: str, task_vectors, report,
                  engine: dict) -> None:
    content = {
        **(record or {}),
        "rules": _rule_summary(used),
        "provenance": provenance(
            base_model={"spec": base},
            finetuned={t: tv.finetuned.fingerprint() for t, tv in task_vectors.items()},
            preflight=report,
            engine=engine,
        ),
    }
    write_file(out_dir / MERGE_MARKER, yaml.safe_dump(content, sort_keys=False, allow_unicode=True).encode())


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
            write_file(out_dir / name, (directory / name).read_bytes())
    config = out_dir / "config.json"
    if config.exists():
        content = json.loads(config.read_text())
        content.pop("quantization_config", None)
        write_file(config, json.dumps(content, indent=2).encode())

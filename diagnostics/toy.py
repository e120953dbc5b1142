"""Tiny real models for tests, benchmarks and notebook CI (no network).

`build_model` saves a randomly initialised Hugging Face model of a given
architecture with a byte-level tokenizer; `finetune` makes a synthetic fine-tune
of it by a few optimizer steps on a task's text (a real gradient update, so the
task vector has the structure of a fine-tune, not of noise); `write_task_data`
writes JSON Lines task files.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import torch

ARCHITECTURES = ("llama", "qwen2", "mistral", "gemma3", "gpt2", "bert")


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens + <pad>, <eos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<pad>"] = 256
    vocab["<eos>"] = 257
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<eos>",
                                   unk_token="<eos>")


def tiny_config(architecture: str, *, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
                intermediate: int | None = None, vocab: int = 258):
    """A small config of a real architecture (vocabulary fits the byte tokenizer)."""
    import transformers as tf

    intermediate = intermediate or 2 * hidden
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, pad_token_id=256, eos_token_id=257, bos_token_id=257)
    if architecture == "llama":
        return tf.LlamaConfig(num_key_value_heads=kv_heads, **common)
    if architecture == "qwen2":
        return tf.Qwen2Config(num_key_value_heads=kv_heads, **common)
    if architecture == "mistral":
        return tf.MistralConfig(num_key_value_heads=kv_heads, **common)
    if architecture == "gemma3":
        return tf.Gemma3TextConfig(num_key_value_heads=kv_heads, head_dim=hidden // heads, sliding_window=8,
                                   layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                                for i in range(layers)], **common)
    if architecture == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=512,
                             n_inner=intermediate, pad_token_id=256, eos_token_id=257, bos_token_id=257)
    if architecture == "bert":
        return tf.BertConfig(max_position_embeddings=512, **common)
    raise ValueError(f"unknown toy architecture '{architecture}' (choose from {ARCHITECTURES})")


def build_model(directory: str | Path, architecture: str = "llama", *, seed: int = 0, **config_options) -> Path:
    """Save a random model of `architecture` (safetensors, float32) with the byte tokenizer."""
    import transformers as tf

    directory = Path(directory)
    torch.manual_seed(seed)
    config = tiny_config(architecture, **config_options)
    config.architectures = None
    model = tf.AutoModel.from_config(config) if architecture == "bert" else tf.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def task_texts(task: str, count: int, *, seed: int = 0) -> list[str]:
    """Synthetic but structured text for a task name (arithmetic, code-like, or prose-like)."""
    rng = random.Random(f"{task}-{seed}")
    texts = []
    for _ in range(count):
        if task.startswith("math"):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            texts.append(f"Q: what is {a} plus {b}? A: {a} + {b} = {a + b}.")
        elif task.startswith("code"):
            name = rng.choice(["add", "mul", "sub", "div"])
            texts.append(f"def {name}(x, y):\n    return x {'+*-/'[['add','mul','sub','div'].index(name)]} y\n")
        else:
            words = rng.sample(["the", "river", "runs", "north", "past", "old", "mills", "and", "green", "hills",
                                "where", "birds", "sing", "at", "dawn"], k=rng.randint(6, 12))
            texts.append(" ".join(words).capitalize() + ".")
    return texts


def write_task_data(path: str | Path, task: str, count: int = 12, *, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for text in task_texts(task, count, seed=seed):
            handle.write(json.dumps({"text": text}) + "\n")
    return path


def finetune(base_dir: str | Path, out_dir: str | Path, task: str, *, steps: int = 5, lr: float = 3e-3,
             seed: int = 0) -> Path:
    """A synthetic full fine-tune: `steps` Adam steps of the base on `task` text, saved as safetensors."""
    import transformers as tf

    torch.manual_seed(seed)
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    config = tf.AutoConfig.from_pretrained(base_dir)
    causal = config.model_type != "bert"
    auto = tf.AutoModelForCausalLM if causal else tf.AutoModel
    model = auto.from_pretrained(base_dir, dtype=torch.float32)
    tokenizer = tf.AutoTokenizer.from_pretrained(base_dir)
    texts = task_texts(task, 16, seed=seed + 1)
    batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=64)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        if causal:
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            loss = model(**batch, labels=labels).loss
        else:
            hidden = model(**batch).last_hidden_state
            loss = (hidden[batch["attention_mask"].bool()] - 1.0).pow(2).mean()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def perturbed_finetunes(base_dir: str | Path, tasks, *, seed: int = 1) -> dict[str, Path]:
    """Fast stand-in fine-tunes for benchmarks (no training): base + 1e-3·σ noise + a rank-8 update per matrix.

    Each task gets `base_dir/../<task>/model.safetensors` plus the base's config and tokenizer files.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    base_dir = Path(base_dir)
    base = load_file(str(base_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    folders = {}
    for task in tasks:
        tuned = {}
        for name, weight in base.items():
            scale = float(weight.float().std()) or 1.0
            delta = 1e-3 * scale * torch.randn(weight.shape, generator=generator)
            if weight.ndim == 2:
                left = torch.randn(weight.shape[0], 8, generator=generator)
                right = torch.randn(8, weight.shape[1], generator=generator)
                delta += 0.01 * scale * (left @ right) / 8
            tuned[name] = (weight + delta).contiguous()
        folder = base_dir.parent / task
        folder.mkdir()
        save_file(tuned, str(folder / "model.safetensors"), metadata={"format": "pt"})
        for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            if (base_dir / file).exists():
                shutil.copy2(base_dir / file, folder / file)
        folders[task] = folder
    return folders


def trained_kit(root: str | Path, tasks, *, records: int) -> tuple[str, dict[str, str], dict[str, str]]:
    """A tiny Llama 'pre-trained' on mixed text, then fine-tuned on each of `tasks` (real gradient updates), and
    `records` records of task data per task: (base directory, {task: fine-tune directory}, {task: data file})."""
    root = Path(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        random_init = build_model(root / "random", "llama", layers=2, hidden=32, heads=4, kv_heads=2)
        base = finetune(random_init, root / "base", "mix", steps=15, lr=3e-3, seed=9)
        finetuned = {task: str(finetune(base, root / task, task, steps=8, lr=3e-3, seed=index))
                     for index, task in enumerate(tasks)}
    data = {task: str(write_task_data(root / f"{task}.jsonl", task, count=records, seed=7)) for task in tasks}
    return str(base), finetuned, data

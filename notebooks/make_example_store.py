"""Build a small example store on a toy model, for the notebooks and their CI.

    python notebooks/make_example_store.py --out runs/demo.zarr          # ~2 min on 2 CPU cores
    python notebooks/make_example_store.py --out /tmp/ci.zarr --small    # ~30 s, what the tests use

A random tiny Llama base (`submerge.diagnostics.toy`), one synthetic full fine-tune per
task (a few Adam steps on the task's text), and every group the notebooks read:
``linearity`` (model, layer, attn, mlp, head), ``projection``,
``alpha/layer`` and ``alpha/attn-mlp``, ``interference``, and ``eval`` (mean
token loss and perplexity of the base, the fine-tunes, the average of the task
vectors and the closed-form merges, on held-out text of each task). The numbers
are real measurements of these toy models, not of a real LLM.
"""

from __future__ import annotations

import argparse
import shutil
import warnings
from pathlib import Path

import numpy as np

TASKS = ("math", "code", "prose")


def _eval_group(base_dir: Path, finetuned: dict[str, Path], store, *, texts_per_task: int = 6) -> None:
    """Write group ``eval``: loss and perplexity over (model, task) of base, fine-tunes and simple merges."""
    import torch
    import transformers
    import xarray as xr

    from submerge.diagnostics import toy
    from submerge.diagnostics.provenance import provenance
    from submerge.diagnostics.tensors import TensorTable

    tokenizer = transformers.AutoTokenizer.from_pretrained(base_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    base = {name: value.clone() for name, value in model.state_dict().items()}
    tuned = {task: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
             for task, path in finetuned.items()}
    tasks = list(finetuned)
    task_vectors = {name: [tuned[t][name] - base[name] for t in tasks] for name in base}

    def merged(weights_of) -> dict:
        """θ0 + Σ_t w_t τ_t, with w from weights_of(parameter name) (one weight per task)."""
        return {name: base[name] + sum(w * tv for w, tv in zip(weights_of(name), task_vectors[name]))
                for name in base}

    mean = [1.0 / len(tasks)] * len(tasks)
    table = TensorTable.from_model(model)
    variants = {"base": base, **{t: tuned[t] for t in tasks}, "average": merged(lambda name: mean)}
    for granularity in ("layer", "attn-mlp"):
        if not store.has(f"alpha/{granularity}"):
            continue
        alpha = store.dataset(f"alpha/{granularity}").alpha.isel(granularity=0)
        modules = set(alpha.module.values.tolist())

        def weights_of(name, alpha=alpha, modules=modules, granularity=granularity):
            module = table.get(name).unit(granularity)
            if module in modules:
                return [float(alpha.sel(module=module, task=t)) for t in tasks]
            return mean  # outside every module: mean of the task vectors (the plan's default)

        variants[f"closed-form-{granularity}"] = merged(weights_of)

    loss = np.full((len(variants), len(tasks)), np.nan)
    tokens = np.zeros((len(variants), len(tasks)), dtype=np.int64)
    for t, task in enumerate(tasks):
        texts = toy.task_texts(task, texts_per_task, seed=1000)  # held out: the fine-tunes saw seeds 1..3
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        tokens[:, t] = int((labels[:, 1:] != -100).sum())  # the predicted tokens behind each mean loss
        for m, weights in enumerate(variants.values()):
            model.load_state_dict(weights)
            with torch.no_grad():
                loss[m, t] = float(model(**batch, labels=labels).loss)
    dataset = xr.Dataset(
        {"loss": (("model", "task"), loss), "perplexity": (("model", "task"), np.exp(loss)),
         "tokens": (("model", "task"), tokens)},
        coords={"model": np.array(list(variants), dtype=object), "task": np.array(tasks, dtype=object)},
        attrs={"loss": "mean token cross-entropy on held-out task text (nats)", "perplexity": "exp(loss)",
               "tokens": "predicted tokens per task"},
    )
    store.write("eval", dataset, {"texts_per_task": texts_per_task, "models": list(variants)},
                attrs={"provenance": provenance("notebooks/make_example_store.py",
                                                finetuned={t: str(p) for t, p in finetuned.items()})})


def _interference_group(base_dir: Path, finetuned: dict[str, Path], store) -> None:
    """Write group ``interference`` (weight-space metrics of every 2-D matrix)."""
    from submerge.diagnostics.checkpoints import open_checkpoint
    from submerge.diagnostics.interference import DEFAULT_RANK_FRACS, interference
    from submerge.diagnostics.provenance import provenance

    base = open_checkpoint(str(base_dir))
    readers = {task: open_checkpoint(str(path)) for task, path in finetuned.items()}
    dataset = interference(base, readers, device="cpu", progress=False)
    store.write("interference", dataset, {"rank_fracs": list(DEFAULT_RANK_FRACS), "sar_against": "ta"},
                attrs={"provenance": provenance("notebooks/make_example_store.py",
                                                finetuned={t: str(p) for t, p in finetuned.items()})})


def build_example_store(
    out: str | Path,
    *,
    workdir: str | Path | None = None,
    tasks: tuple[str, ...] = TASKS,
    layers: int = 4,
    samples: int = 5,
    max_tokens: int = 40,
    steps: int = 10,
    alphas: tuple[float, ...] = (0.3, 0.7),
    granularities: tuple[str, ...] = ("layer", "attn-mlp"),
    with_interference: bool = True,
    with_eval: bool = True,
    force: bool = True,
) -> Path:
    """Build the example store at `out` (toy models go to `workdir`, default next to the store)."""
    from submerge.diagnostics import toy
    from submerge.diagnostics.experiment import Experiment
    from submerge.diagnostics.linearity import alpha, nonlinearity, projection
    from submerge.diagnostics.store import Store

    out = Path(out)
    workdir = Path(workdir) if workdir is not None else out.parent / f"{out.stem}_models"
    if force and out.exists():
        shutil.rmtree(out)
    workdir.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base_dir = toy.build_model(workdir / "toy-llama-base", "llama", layers=layers)
        finetuned = {task: toy.finetune(base_dir, workdir / f"toy-llama-{task}", task, steps=4, seed=i)
                     for i, task in enumerate(tasks)}
        data = {task: str(toy.write_task_data(workdir / f"{task}.jsonl", task, max(8, samples))) for task in tasks}
        experiment = Experiment.load(str(base_dir), {t: str(p) for t, p in finetuned.items()}, data,
                                     samples=samples, max_tokens=max_tokens, dtype="float32", device="cpu")
        store = Store(out)
        command = "notebooks/make_example_store.py"
        nonlinearity(experiment, levels=("model", "layer", "attn", "mlp", "head"), steps=steps, store=store,
                     progress=False, command=command)
        projection(experiment, alphas=list(alphas), store=store, progress=False, command=command)
        for granularity in granularities:
            alpha(experiment, granularity=granularity, store=store, progress=False, command=command)
        if with_interference:
            _interference_group(base_dir, finetuned, store)
        if with_eval:
            _eval_group(base_dir, finetuned, store)
    return out


def tiny_example_store(directory: str | Path) -> Path:
    """The smallest useful example (2 layers, 2 samples, N = 3, α ∈ {0.5}) in `directory`, built once.

    Used by the tests; reused when `directory` already holds a complete one. Torch runs on one
    thread while building (the matrices are tiny; more threads only contend).
    """
    import torch

    from submerge.diagnostics.store import Store

    path = Path(directory) / "demo.zarr"
    if Store(path).is_complete("eval"):
        return path
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return build_example_store(path, layers=2, samples=2, max_tokens=16, steps=3, alphas=(0.5,))
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo.zarr", help="store to write (replaced if it exists)")
    parser.add_argument("--workdir", default=None, help="where the toy models go (default: next to the store)")
    parser.add_argument("--small", action="store_true", help="2 layers, 3 samples, N=4: fast, for CI")
    args = parser.parse_args()
    options = {"layers": 2, "samples": 3, "max_tokens": 24, "steps": 4} if args.small else {}
    path = build_example_store(args.out, workdir=args.workdir, **options)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

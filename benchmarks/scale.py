"""Benchmark: every command on Llama-2-7B-shaped slices, peak memory against depth, projected to the full 7B.

Builds (offline, float16 safetensors, in a scratch directory) checkpoints with the exact Llama-2-7B block shape —
hidden 4096, MLP 11008, 32 heads, the demo kit's 49,152-token tokenizer — with L = 1, 2, 4 random blocks, and for
each L three dense fine-tunes (base + Gaussian noise of relative RMS 1e-3 per tensor, a realistic update size,
stored in float16 like real checkpoints) plus one set of three rank-16 LoRA adapters. Then runs, each in its own
process, with peak RSS (wait4 ru_maxrss), peak anonymous RSS (sampled) and wall time:

    diag linearity   (levels model, layer, attn, mlp, head)     diag alpha --granularity attn-mlp
    diag interference (Gram route) and --exact-svd             diag merge --method task-arithmetic | ties | plan
                                                               diag merge --method regmean (Grams of the fit data)
    diag eval (base, fine-tunes, the TA merge)                 diag merge RECIPE.yaml (a mergekit TIES recipe)
    diag compare --methods plan --tune none (compare-plan: the evidence step on its default 8 fit records per task,
        candidates layer, attn-mlp, regmean, 4 folds; the plan's merge; base, fine-tunes and plan evaluated)

Per command it fits peak RSS = a + b·L and wall = c + d·L over the slices (b ≈ 0 means memory does not grow with
depth), and projects Llama-2-7B (32 blocks) + 3 fine-tunes: peak a + 32·b, wall c + 32·d on this machine.
When both interference routes ran on a slice, their figures are compared (largest relative difference of STI, SAR,
I(k), R(k) and the effective rank, the Gram route against --exact-svd) and their walls and peaks set side by side;
``--matrices`` restricts both to some matrices (names or glob patterns, as diag interference takes them). FLOPs per
block are counted from the shapes (matrix products only: 2·params·tokens per replayed block, as a GPU-time basis).
With ``--mergekit-python`` (a venv with mergekit 0.1.5), mergekit runs task_arithmetic and ties on the same slices
and the ratios ours/mergekit (wall, peak RSS) and the largest |ours − mergekit| are printed. ``merge-recipe`` is a
mergekit TIES config with per-model weights and densities and λ (`TIES_RECIPE`), merged by ``diag merge
RECIPE.yaml`` and, with ``--mergekit-python``, by ``mergekit-yaml`` from the same file; both compute and write
float32, and the entries TIES' equations do not decide are counted apart (`ties_differences_explained`).

    python benchmarks/scale.py [--layers 1,2,4] [--samples 2] [--max-tokens 64] [--mergekit-python /work/mkvenv/bin/python]
        [--commands linearity,alpha,interference,interference-exact,merge-ta,merge-ties,merge-plan,merge-regmean,eval,
         compare-plan]
        [--matrices PATTERNS] [--keep DIR] [--results FILE]

``--results FILE`` accumulates the measurements in a JSON file (slice → command → figures) across invocations, so
slices or commands can be measured in separate runs (e.g. the cheap merges at a deeper slice than the data-driven
commands) and the table is fitted over everything measured so far.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _merge_benchmark():
    """benchmarks/merge.py (its process meter and tensor comparison), loaded under its own name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("merge_benchmark", Path(__file__).with_name("merge.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_METER = _merge_benchmark()
measure, max_difference, in_fresh_process = _METER.measure, _METER.max_difference, _METER.in_fresh_process
ties_differences_explained = _METER.ties_differences_explained


def _ties_explained(*args) -> dict:
    """`ties_differences_explained`, run in a spawned process (`in_fresh_process` pickles functions of this module)."""
    return ties_differences_explained(*args)


def _explained(counts: dict) -> str:
    """One line from `ties_differences_explained`."""
    entries = counts["entries"]
    return (f"{counts['differing']:,} of {entries:,} entries differ > 1e-6, {counts['differing_decided']:,} of them "
            f"where TIES' equations decide; max |ours − mergekit| there {counts['max_decided']:.3g}; "
            f"undecided: {counts['at_ties'] / entries:.1%} tied at a trim threshold, "
            f"{counts['zero_sum'] / entries:.2%} with trimmed sum exactly 0")


def _largest_difference(first: Path, second: Path) -> float:
    """max |first − second| over two checkpoints; run in a spawned process (`in_fresh_process`), since reading
    them here would raise this process's RSS high-water mark, which every later child would report as its own."""
    return max_difference(first, second)[0]


def interference_differences(gram_store: Path, exact_store: Path) -> dict:
    """Largest relative difference, Gram route against --exact-svd, of STI, STI/Σσ, SAR, I(k), R(k) (R relative to
    max(R(k), 1e-2·R(0)), as gram.py states its bound) and the effective rank, over every matrix both measured."""
    import xarray as xr

    gram = xr.open_datatree(str(gram_store), engine="zarr")["interference"].ds
    exact = xr.open_datatree(str(exact_store), engine="zarr")["interference"].ds
    common = [m for m in gram["matrix"].values if m in set(exact["matrix"].values)]
    gram, exact = gram.sel(matrix=common), exact.sel(matrix=common)

    def largest(key, scale=None):
        first, second = gram[key].values, exact[key].values
        scale = np.abs(second) if scale is None else scale
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.abs(first - second) / scale
        ratio = ratio[~(np.isnan(first) & np.isnan(second))]
        return float(np.max(ratio)) if ratio.size else 0.0

    reconstruction = exact["reconstruction_error"].values
    floor = np.maximum(np.abs(reconstruction), 1e-2 * reconstruction[:, :1, :])
    return {"matrices": len(common), "sti": largest("sti"), "sti_normalized": largest("sti_normalized"),
            "sar": largest("sar"), "I(k)": largest("row_space_interference"),
            "R(k)": largest("reconstruction_error", floor), "effective_rank": largest("effective_rank")}


HIDDEN, INTERMEDIATE, HEADS = 4096, 11008, 32
#: merge-recipe: per fine-tune (weight, density) and λ of the mergekit TIES config both tools merge
TIES_RECIPE = {"models": {"math": (1.0, 0.2), "code": (0.7, 0.3), "trivia": (0.5, 0.25)}, "lambda": 0.9}
TASKS = ("math", "code", "trivia")
FULL_LAYERS = 32
RELATIVE_UPDATE = 1e-3
LORA_RANK = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --------------------------------------------------------------------------- checkpoints


def block_shapes(layer: int) -> dict[str, tuple[int, ...]]:
    prefix = f"model.layers.{layer}."
    shapes = {prefix + f"self_attn.{p}.weight": (HIDDEN, HIDDEN) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    shapes[prefix + "mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
    shapes[prefix + "mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
    shapes[prefix + "mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
    shapes[prefix + "input_layernorm.weight"] = (HIDDEN,)
    shapes[prefix + "post_attention_layernorm.weight"] = (HIDDEN,)
    return shapes


def _save_sharded(directory: Path, shards: list[dict]) -> None:
    from safetensors.torch import save_file

    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def build_slice(directory: Path, layers: int, tokenizer_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Base, three dense fine-tunes and three LoRA adapters of an L-block Llama-2-7B slice (float16)."""
    import torch
    from transformers import LlamaConfig

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="float16",
                         architectures=["LlamaForCausalLM"])
    paths = {"base": directory / "base", **{t: directory / t for t in TASKS}}
    for path in paths.values():
        path.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(path)
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer_dir / file).exists():
                shutil.copy2(tokenizer_dir / file, path / file)
    generator = torch.Generator().manual_seed(seed)
    groups = [{"model.embed_tokens.weight": (vocab, HIDDEN)}] + [block_shapes(j) for j in range(layers)] + [
        {"model.norm.weight": (HIDDEN,), "lm_head.weight": (vocab, HIDDEN)}]
    shards = {name: [] for name in paths}
    for group in groups:
        pieces = {name: {} for name in paths}
        for tensor_name, shape in group.items():
            base = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=generator) * 0.02
            base16 = base.to(torch.float16)
            pieces["base"][tensor_name] = base16
            scale = RELATIVE_UPDATE * float(base16.float().pow(2).mean().sqrt())
            for task in TASKS:
                noise = torch.randn(shape, generator=generator) * scale
                pieces[task][tensor_name] = (base16.float() + noise).to(torch.float16)
        for name in paths:
            shards[name].append(pieces[name])
    for name, path in paths.items():
        _save_sharded(path, shards[name])
    paths.update(build_lora(directory, layers, generator))
    return paths


def build_lora(directory: Path, layers: int, generator) -> dict[str, Path]:
    """Rank-16 LoRA adapters on every projection, ΔW of relative RMS ≈ 1e-3 of a 0.02-std weight."""
    import torch
    from safetensors.torch import save_file

    adapters = {}
    for t, task in enumerate(TASKS):
        path = directory / f"lora_{task}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(layers):
            for shape_name, shape in block_shapes(layer).items():
                if len(shape) != 2:
                    continue
                stem = shape_name.removesuffix(".weight")
                a = torch.randn(LORA_RANK, shape[1], generator=generator) / shape[1] ** 0.5
                b = torch.randn(shape[0], LORA_RANK, generator=generator) * (RELATIVE_UPDATE * 0.02 / LORA_RANK ** 0.5)
                tensors[f"base_model.model.{stem}.lora_A.weight"] = a.to(torch.float16)
                tensors[f"base_model.model.{stem}.lora_B.weight"] = b.to(torch.float16)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": LORA_RANK, "lora_alpha": LORA_RANK, "target_modules": list(PROJECTIONS),
            "base_model_name_or_path": str(directory / "base"), "fan_in_fan_out": False, "bias": "none",
            "task_type": "CAUSAL_LM"}))
        adapters[f"lora_{task}"] = path
    return adapters


# --------------------------------------------------------------------------- commands


def _svd_flops(m: int, n: int) -> float:
    """A thin SVD's FLOPs, Golub & Van Loan's R-SVD count 4·m·n² + 22·n³ (m ≥ n) — an upper estimate: LAPACK's
    divide and conquer does less in its n × n stage."""
    m, n = max(m, n), min(m, n)
    return 4.0 * m * n * n + 22.0 * n**3


def _gram_route_flops(m: int, n: int, tasks: int) -> float:
    """The Gram route's FLOPs for one matrix: T(T+1)/2 cross-Gram products 2·L·r² (L = max, r = min), 2T + 1
    symmetric eigendecompositions with vectors at 9·r³ each (Golub & Van Loan's tridiagonal QR count — an upper
    estimate for divide and conquer), and the r-sized products after them (STI blocks, I(k) at k ≤ 0.64 r, SAR's
    projections: about 12·r³ for T = 3)."""
    big, r = max(m, n), min(m, n)
    return tasks * (tasks + 1) / 2 * 2.0 * big * r * r + (2 * tasks + 1) * 9.0 * r**3 + 12.0 * r**3


def flops_per_block(tokens: int, command: str, steps: int = 10) -> float:
    """FLOPs per block: matrix products, 2 · parameters · tokens for each block-sized replay of the command; for
    interference --exact-svd the SVDs, 2T + 1 per matrix (T task matrices, T centred ones, the merged one for SAR);
    for interference (the Gram route) `_gram_route_flops`."""
    attn, mlp = 4 * HIDDEN * HIDDEN, 3 * HIDDEN * INTERMEDIATE
    variants = steps + 1
    tasks = len(TASKS)
    if command == "interference-exact":
        return (2 * tasks + 1) * (4 * _svd_flops(HIDDEN, HIDDEN) + 3 * _svd_flops(INTERMEDIATE, HIDDEN))
    if command.startswith("interference"):
        return 4 * _gram_route_flops(HIDDEN, HIDDEN, tasks) + 3 * _gram_route_flops(INTERMEDIATE, HIDDEN, tasks)
    replays = {
        # capture (1 forward) + N+1 replays of layer, attn, mlp (heads come from the attn replay) + model level
        "linearity": tasks * (attn + mlp + variants * ((attn + mlp) + attn + mlp + (attn + mlp))),
        # base + T fine-tunes + 2 merges (α, uniform) per unit, on every task's inputs
        "alpha": tasks * (attn + mlp + (1 + tasks + 2) * (attn + mlp)),
        "eval": (1 + tasks + 1) * tasks * (attn + mlp),
    }
    return 2.0 * tokens * replays.get(command, 0)


def commands(paths: dict[str, Path], data: dict[str, Path], work: Path, samples: int, max_tokens: int,
             matrices: str | None = None, device: str | None = None, offload: bool = False,
             capture_budget: float | None = None) -> dict:
    diag = [sys.executable, "-m", "submerge.cli.main"]
    placed = (["--device", device] if device else []) + (["--offload"] if offload else [])  # data-driven commands
    dense = [arg for t in TASKS for arg in ("-f", f"{t}={paths[t]}")]
    lora = [arg for t in TASKS for arg in ("-f", f"{t}={paths['lora_' + t]}")]
    tasks_data = [arg for t in TASKS for arg in ("-d", f"{t}={data[t]}")]
    common = ["--model", str(paths["base"]), "--samples", str(samples), "--max-tokens", str(max_tokens),
              "--no-progress", "--dtype", "float16", *placed,
              *(["--capture-budget", f"{capture_budget:g}"] if capture_budget else [])]
    store = str(work / "scale.zarr")
    selected = ["--matrices", matrices] if matrices else []
    # --force everywhere: with --keep a second invocation must measure the work again, not a resume that skips it
    return {name: command + ["--force"] for name, command in {
        "linearity": diag + ["linearity", *common, *dense, *tasks_data, "--levels", "model,layer,attn,mlp,head",
                             "--out", store],
        "alpha": diag + ["alpha", *common, *dense, *tasks_data, "--granularity", "attn-mlp", "--out", store],
        "interference": diag + ["interference", "--model", str(paths["base"]), *dense, *selected,
                                "--out", str(work / "interference.zarr"), "--no-progress"],
        "interference-exact": diag + ["interference", "--model", str(paths["base"]), *dense, *selected,
                                      "--exact-svd", "--out", str(work / "interference-exact.zarr"), "--no-progress"],
        "interference-lora": diag + ["interference", "--model", str(paths["base"]), *lora, *selected,
                                     "--out", str(work / "lora.zarr"), "--no-progress"],
        "merge-ta": diag + ["merge", "--model", str(paths["base"]), *dense, "--method", "task-arithmetic",
                            "--out", str(work / "ta"), "--no-progress"],
        "merge-ties": diag + ["merge", "--model", str(paths["base"]), *dense, "--method", "ties",
                              "--option", "top_k=0.2", "--out", str(work / "ties"), "--no-progress"],
        "merge-plan": diag + ["merge", str(work / "plan.yaml"), "--out", str(work / "planned"), "--no-progress"],
        "merge-recipe": diag + ["merge", str(work / "ties-recipe.yaml"), "--out", str(work / "recipe"),
                                "--no-progress"],
        "merge-regmean": diag + ["merge", "--model", str(paths["base"]), *dense, "--method", "regmean", *tasks_data,
                                 "--samples", str(samples), "--max-tokens", str(max_tokens), "--out",
                                 str(work / "regmean"), "--no-progress", *placed],
        "compare-plan": diag + ["compare", *common, *dense, *tasks_data, "--methods", "plan", "--tune", "none",
                                "--no-objective", "--out", str(work / "compare.zarr")],
        "eval": diag + ["eval", "--model", str(paths["base"]), *dense, "--merged", f"ta={work / 'ta'}",
                        *tasks_data, "--skip", "0", "--samples", str(samples), "--max-tokens", str(max_tokens),
                        "--dtype", "float16", "--out", str(work / "eval.zarr"), "--no-progress", *placed],
    }.items()}


def ties_recipe(paths: dict[str, Path]) -> dict:
    """The mergekit TIES config of merge-recipe (`TIES_RECIPE`), computed and written in float32 by both tools."""
    models = [{"model": str(paths[t]), "parameters": {"weight": weight, "density": density}}
              for t, (weight, density) in TIES_RECIPE["models"].items()]
    return {"merge_method": "ties", "base_model": str(paths["base"]), "models": models,
            "parameters": {"lambda": TIES_RECIPE["lambda"]}, "dtype": "float32"}


def mergekit_runs(python: str, paths: dict[str, Path], work: Path, names=("merge-ta", "merge-ties")) -> dict:
    import yaml

    binary = str(Path(python).parent / "mergekit-yaml")
    models = [{"model": str(paths[t]), "parameters": {"weight": 1.0}} for t in TASKS]
    configs = {
        "merge-ta": {"merge_method": "task_arithmetic", "base_model": str(paths["base"]), "models": models,
                     "parameters": {"normalize": False, "lambda": 1.0}, "dtype": "float16"},
        "merge-ties": {"merge_method": "ties", "base_model": str(paths["base"]),
                       "models": [{**m, "parameters": {"weight": 1.0, "density": 0.2}} for m in models],
                       "parameters": {"normalize": True, "lambda": 1.0}, "dtype": "float16"},
        "merge-recipe": ties_recipe(paths),
    }
    results = {}
    for name, config in ((n, c) for n, c in configs.items() if n in names):
        path = work / f"{name}.mergekit.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        out = work / f"{name}.mergekit"
        results[name] = measure([binary, str(path), str(out), "--quiet", "--no-write-model-card",
                                 "--no-copy-tokenizer"])
        results[name]["out"] = out
    return results


# --------------------------------------------------------------------------- main


def run_slice(layers: int, directory: Path, args, tokenizer_dir: Path, data: dict) -> dict:
    import os

    work = directory / f"L{layers}"
    start = time.perf_counter()
    built = work / "built.json"  # a slice kept by --keep is reused
    if built.exists():
        paths = {name: Path(path) for name, path in json.loads(built.read_text()).items()}
    else:
        paths = in_fresh_process(build_slice, work, layers, tokenizer_dir)
        built.write_text(json.dumps({name: str(path) for name, path in paths.items()}))
    print(f"L = {layers}: built base + 3 dense fine-tunes + 3 LoRA adapters in {time.perf_counter() - start:.0f} s",
          flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    runs = commands(paths, data, work, args.samples, args.max_tokens, args.matrices, args.device, args.offload,
                    args.capture_budget)
    results = {}
    for name in args.commands:
        if name == "merge-plan":
            plan = [sys.executable, "-m", "submerge.cli.main", "plan", str(work / "scale.zarr"), "--granularity", "attn-mlp",
                    "--out", str(work / "plan.yaml"), "--force"]
            measure(plan, env=env)
        if name == "merge-recipe":
            import yaml

            (work / "ties-recipe.yaml").write_text(yaml.safe_dump(ties_recipe(paths), sort_keys=False))
        results[name] = measure(runs[name], env=env)
        r = results[name]
        print(f"  {name:<18} wall {r['wall_s']:8.1f} s   peak RSS {r['peak_rss_mib']:8.0f} MiB   "
              f"peak anon {r['peak_anon_mib']:8.0f} MiB"
              + (f"   peak GPU {r['peak_gpu_mib']:8.0f} MiB" if "peak_gpu_mib" in r else ""), flush=True)
    if "interference" in results and "interference-exact" in results:
        results["interference:accuracy"] = in_fresh_process(interference_differences, work / "interference.zarr",
                                                            work / "interference-exact.zarr")
        print(f"  {'':<18} Gram route vs --exact-svd, largest relative difference: "
              + ", ".join(f"{key} {value:.2g}" for key, value in results["interference:accuracy"].items()), flush=True)
    if args.mergekit_python:
        compared = [name for name in ("merge-ta", "merge-ties", "merge-recipe") if name in args.commands]
        for name, r in mergekit_runs(args.mergekit_python, paths, work, compared).items():
            ours = results.get(name)
            mine = work / {"merge-ta": "ta", "merge-ties": "ties", "merge-recipe": "recipe"}[name]
            difference = in_fresh_process(_largest_difference, mine, r["out"]) if ours else None
            results[f"{name}:mergekit"] = {**r, "max_abs_diff": difference}
            print(f"  {name + ' mergekit':<18} wall {r['wall_s']:8.1f} s   peak RSS {r['peak_rss_mib']:8.0f} MiB"
                  + (f"   max |ours − mergekit| {difference:.3g}" if difference is not None else ""), flush=True)
            if ours and name in ("merge-ties", "merge-recipe"):
                recipe = TIES_RECIPE["models"]
                top_k, weights = ((0.2, None) if name == "merge-ties" else
                                  ([recipe[t][1] for t in TASKS], [recipe[t][0] for t in TASKS]))
                explained = in_fresh_process(_ties_explained, mine, r["out"], paths["base"],
                                             [paths[t] for t in TASKS], top_k, weights)
                results[f"{name}:mergekit"]["explained"] = explained
                print(f"  {'':<18} {_explained(explained)}", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return results


def report(by_layers: dict[int, dict], tokens: int) -> None:
    """Per command, the fit over every slice that measured it (two at least)."""
    names = list(dict.fromkeys(n for commands in by_layers.values() for n in commands))
    print(f"\n{'command':<24}{'slices':>8}{'RSS slope MiB/block':>20}{'anon slope':>11}{'7B peak GiB':>13}"
          f"{'7B wall min':>13}{'GFLOP/block':>13}")
    for name in names:
        layers = np.array(sorted(L for L, commands in by_layers.items() if "wall_s" in commands.get(name, {})),
                          dtype=float)
        if len(layers) < 2:
            continue
        rss, anon, wall = (np.array([by_layers[int(L)][name][key] for L in layers])
                           for key in ("peak_rss_mib", "peak_anon_mib", "wall_s"))
        (rss_slope, rss_at0), (wall_slope, wall_at0) = np.polyfit(layers, rss, 1), np.polyfit(layers, wall, 1)
        anon_slope = np.polyfit(layers, anon, 1)[0]
        peak = (rss_at0 + FULL_LAYERS * rss_slope) / 1024
        minutes = (wall_at0 + FULL_LAYERS * wall_slope) / 60
        flops = flops_per_block(tokens, name.split(":")[0]) / 1e9
        print(f"{name:<24}{','.join(str(int(L)) for L in layers):>8}{rss_slope:>20.0f}{anon_slope:>11.0f}"
              f"{peak:>13.1f}{minutes:>13.1f}{flops:>13.1f}")
    for L in sorted(L for L, commands in by_layers.items() if "interference:accuracy" in commands):
        gram, exact = by_layers[L]["interference"], by_layers[L]["interference-exact"]
        print(f"L={L} interference: wall Gram route / --exact-svd {gram['wall_s'] / exact['wall_s']:.2f} "
              f"({gram['wall_s']:.0f} / {exact['wall_s']:.0f} s), peak RSS {gram['peak_rss_mib'] / 1024:.1f} / "
              f"{exact['peak_rss_mib'] / 1024:.1f} GiB; largest relative difference "
              + ", ".join(f"{k} {v:.2g}" for k, v in by_layers[L]["interference:accuracy"].items()))
    for name in ("merge-ta", "merge-ties", "merge-recipe"):
        theirs = f"{name}:mergekit"
        for L in sorted(L for L, commands in by_layers.items() if name in commands and theirs in commands):
            ours, other = by_layers[L][name], by_layers[L][theirs]
            print(f"L={L} {name}: wall ours/mergekit {ours['wall_s'] / other['wall_s']:.2f}, peak RSS "
                  f"ours/mergekit {ours['peak_rss_mib'] / other['peak_rss_mib']:.2f}, max |ours − mergekit| "
                  f"{other['max_abs_diff']:.3g}"
                  + (f"; where the equations decide {other['explained']['max_decided']:.3g}"
                     if "explained" in other else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="1,2,4")
    parser.add_argument("--samples", type=int, default=2, help="Records per task (linearity, alpha, eval).")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--commands", default="linearity,alpha,interference,interference-lora,merge-ta,merge-ties,"
                        "merge-plan,merge-regmean,eval")
    parser.add_argument("--mergekit-python", help="Python of a venv with mergekit 0.1.5 (task_arithmetic, ties).")
    parser.add_argument("--matrices", help="diag interference --matrices for the interference commands (names or glob "
                        "patterns, comma-separated): measure some matrices only.")
    parser.add_argument("--device", help="--device for the data-driven commands (default: theirs, auto = CUDA "
                        "when present; merges other than regmean stay on the CPU).")
    parser.add_argument("--offload", action="store_true", help="--offload for the data-driven commands: the base "
                        "stays in host memory, one block at a time on --device.")
    parser.add_argument("--capture-budget", type=float, help="--capture-budget (GiB) for linearity, alpha and "
                        "compare-plan (default: theirs).")
    parser.add_argument("--keep", type=Path, help="Build here and keep the checkpoints (default: a temp dir).")
    parser.add_argument("--results", type=Path, help="JSON file that accumulates measurements across runs.")
    args = parser.parse_args()
    args.commands = args.commands.split(",")
    from submerge.diagnostics.demo import ensure_demo_base, ensure_demo_data

    tokenizer_dir = Path(ensure_demo_base())
    data = {task: Path(path) for task, path in ensure_demo_data().items()}
    directory = args.keep or Path(tempfile.mkdtemp(prefix="scale_bench_", dir=str(Path.home())))
    directory.mkdir(parents=True, exist_ok=True)
    print(f"Llama-2-7B block shape (hidden {HIDDEN}, MLP {INTERMEDIATE}, {HEADS} heads), float16; "
          f"{args.samples} records × ≤ {args.max_tokens} tokens per task; scratch {directory}\n", flush=True)
    by_layers = _load_results(args.results)
    try:
        for layers in (int(v) for v in args.layers.split(",")):
            by_layers.setdefault(layers, {}).update(run_slice(layers, directory, args, tokenizer_dir, data))
            _save_results(args.results, by_layers)
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    report(by_layers, tokens=len(TASKS) * args.samples * args.max_tokens)


def _load_results(path: Path | None) -> dict[int, dict]:
    if path is None or not path.exists():
        return {}
    return {int(layers): commands for layers, commands in json.loads(path.read_text()).items()}


def _save_results(path: Path | None, by_layers: dict[int, dict]) -> None:
    if path is not None:
        plain = {str(L): {name: {k: (str(v) if isinstance(v, Path) else v) for k, v in r.items()}
                          for name, r in commands.items()} for L, commands in by_layers.items()}
        path.write_text(json.dumps(plain, indent=1))


if __name__ == "__main__":
    main()

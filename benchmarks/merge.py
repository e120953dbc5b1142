"""Benchmark: the streaming merge writer (`submerge.merge.writer.write_merge`) against mergekit.

Builds (offline) a random Llama checkpoint — 12 layers, hidden 512, intermediate 1408,
vocabulary 32000, float32, ≈ 290 MB — and three synthetic fine-tunes (base + a random
rank-8 update + small noise on every tensor), all safetensors in a temporary directory.
Then merges the three fine-tunes by task arithmetic (θ0 + λ Σ τ, λ = 0.5) and TIES
(top 25 % by magnitude per tensor, sign election, disjoint mean, λ = 1), each merge in a
fresh subprocess so that its memory peak is its own:

- ours:     `write_merge(base, finetuned, out, method_rule(...))`;
- mergekit: `mergekit-yaml` with the same merge (``task_arithmetic``: weight 1, normalize
            false, lambda 0.5; ``ties``: density 0.25 — mergekit's name for our top_k —
            weight 1, normalize true (the disjoint mean), lambda 1), when a Python with
            mergekit is given by ``--mergekit-python`` (e.g. a separate venv: mergekit pins
            its own dependency versions).

Printed per merge: wall time of the whole process (imports included) and, for ours, of the
merge call alone; peak RSS (`ru_maxrss` from `wait4`, which counts file-backed pages of the
memory-mapped safetensors the kernel may keep resident) and peak anonymous RSS (RssAnon,
sampled every 5 ms from /proc/PID/status: the memory the process really allocated); each
as a ratio to one model's size. A streaming merge's peak above the import baseline is set by
the largest tensor, not by the model's depth (measured at 4 layers: about 14 copies of the
62 MiB embedding for task arithmetic, its mapped input pages included). With mergekit: max |ours − mergekit| over every merged tensor, and the ratios
time ours/mergekit and peak RSS ours/mergekit.

Targets (issue 9): peak RSS ≤ 1.0× mergekit, wall ≤ 1.2× mergekit, tensors equal to 1e-6. TIES
can differ only where its equations do not decide (`ties_differences_explained`): magnitudes tied
exactly at the trim threshold (ours keeps the earlier of equal entries, a stable sort; mergekit's
``torch.argsort`` leaves their order unspecified) and entries whose trimmed sum is exactly 0 (the
equation's sgn(0) = 0 merges them to 0; mergekit elects +). Elsewhere the tensors must agree to 1e-6.

mergekit 0.1.5 in its own environment that shares this one's torch (nothing else changed):
``python -m venv /tmp/mk && echo $(python -c 'import site; print(site.getsitepackages()[0])') >
/tmp/mk/lib/python3.11/site-packages/main.pth && /tmp/mk/bin/pip install --no-deps mergekit==0.1.5
immutables protobuf sentencepiece``.

    python benchmarks/merge.py [--layers 12] [--hidden 512] [--intermediate 1408] \
        [--mergekit-python /tmp/mkvenv/bin/python] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("math", "code", "chat")
TA_SCALING = 0.5
TIES_TOP_K = 0.25  # ⌊0.25 · numel⌋ entries kept per tensor, by ours and by mergekit alike
TIES_SCALING = 1.0


# --------------------------------------------------------------------------- checkpoints


def build(directory: Path, layers: int, hidden: int, intermediate: int, vocab: int, seed: int = 0,
          dtype: str = "float32") -> tuple[int, int]:
    """Base + three synthetic fine-tunes in `dtype`; returns one model's size and its largest tensor's, in bytes."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT))
    from submerge.diagnostics.toy import byte_tokenizer, perturbed_finetunes

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=256,
                         eos_token_id=257, bos_token_id=257)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory / "base")
    byte_tokenizer().save_pretrained(directory / "base")
    perturbed_finetunes(directory / "base", TASKS, seed=seed + 1)
    for model in ("base", *TASKS):  # fine-tunes are made in float32, then every checkpoint is stored in `dtype`
        _store_as(directory / model, getattr(torch, dtype))
    base = load_file(str(directory / "base" / "model.safetensors"))
    sizes = [t.numel() * t.element_size() for t in base.values()]
    return sum(sizes), max(sizes)


def _store_as(folder: Path, dtype) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {name: tensor.to(dtype).contiguous() for name, tensor in load_file(str(folder / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def mergekit_config(directory: Path, method: str, out_dtype: str = "float32") -> dict:
    models = [{"model": str(directory / t), "parameters": {"weight": 1.0}} for t in TASKS]
    if method == "ties":
        for model in models:
            model["parameters"]["density"] = TIES_TOP_K
        parameters = {"normalize": True, "lambda": TIES_SCALING}
    else:
        parameters = {"normalize": False, "lambda": TA_SCALING}
    return {"merge_method": "ties" if method == "ties" else "task_arithmetic", "base_model": str(directory / "base"),
            "models": models, "parameters": parameters, "dtype": "float32", "out_dtype": out_dtype}


# --------------------------------------------------------------------------- measuring a process


def _status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return 0


def in_fresh_process(function, *args):
    """`function(*args)` in a spawned process. Building checkpoints here would raise this process's RSS high-water
    mark, and Linux reports a child's ru_maxrss as at least its parent's high-water mark at fork/exec time: every
    command measured after a build would show the build's peak, not its own."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def measure(command: list[str], env: dict | None = None) -> dict:
    """Run `command`; its wall time, peak RSS (wait4 ru_maxrss) and peak RssAnon (sampled), and its stdout."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak_anon, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            value = _status_kib(process.pid, "RssAnon")
            if value:
                peak_anon[0] = max(peak_anon[0], value)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    peak_gpu, gpu_sampler = [None], None
    if shutil.which("nvidia-smi"):
        def sample_gpu():  # the device's used memory, whoever holds it: run nothing else on the GPU meanwhile
            while not done.is_set():
                try:
                    used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                          capture_output=True, text=True, timeout=10).stdout.split()
                    peak_gpu[0] = max(peak_gpu[0] or 0, max(int(value) for value in used))
                except (OSError, ValueError, subprocess.SubprocessError):
                    return
                time.sleep(0.2)

        gpu_sampler = threading.Thread(target=sample_gpu, daemon=True)
        gpu_sampler.start()
    stdout_chunks, stderr_chunks = [], []
    readers = [threading.Thread(target=lambda s=s, c=c: c.append(s.read()), daemon=True)
               for s, c in ((process.stdout, stdout_chunks), (process.stderr, stderr_chunks))]
    for reader in readers:
        reader.start()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    if gpu_sampler is not None:
        gpu_sampler.join()
    for reader in readers:
        reader.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed ({process.returncode}):\n{''.join(stderr_chunks)[-3000:]}")
    return {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024, "peak_anon_mib": peak_anon[0] / 1024,
            "stdout": "".join(stdout_chunks), **({"peak_gpu_mib": peak_gpu[0]} if peak_gpu[0] is not None else {})}


def parse_size(text: str) -> int:
    sys.path.insert(0, str(ROOT))
    from submerge.merge.writer import parse_size as writer_parse_size

    return writer_parse_size(text)


def worker(arguments: dict) -> None:
    """Inside the subprocess: one `write_merge`, timed; prints JSON."""
    sys.path.insert(0, str(ROOT))
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from submerge.merge.writer import method_rule, write_merge

    baseline = _status_kib(os.getpid(), "VmRSS") / 1024
    finetuned = {t: str(Path(arguments["directory"]) / t) for t in TASKS}
    start = time.perf_counter()
    write_merge(str(Path(arguments["directory"]) / "base"), finetuned, arguments["out"],
                method_rule(arguments["method"], arguments["options"]), shard_size=arguments["shard_size"],
                progress=False)
    print(json.dumps({"merge_s": time.perf_counter() - start, "baseline_rss_mib": baseline}))


def import_baseline(python: str, modules: str) -> float:
    """Peak RSS (MiB) of a process that only imports `modules`."""
    return measure([python, "-c", f"import {modules}"])["peak_rss_mib"]


# --------------------------------------------------------------------------- comparing outputs


def max_difference(first: Path, second: Path) -> tuple[float, str, int, int, int]:
    """Largest |ours − theirs|, the tensor it is in, the number of tensors, of entries, of entries differing > 1e-6."""
    import torch
    from safetensors import safe_open

    ours, theirs = _tensor_files(first), _tensor_files(second)
    if set(ours) != set(theirs):
        raise RuntimeError(f"tensor names differ: {sorted(set(ours) ^ set(theirs))[:5]}")
    worst, where, entries, differing = 0.0, "", 0, 0
    for name in ours:
        with safe_open(str(ours[name]), "pt") as a, safe_open(str(theirs[name]), "pt") as b:
            x, y = a.get_tensor(name).to(torch.float64), b.get_tensor(name).to(torch.float64)
        difference = (x - y).abs()
        entries += difference.numel()
        differing += int((difference > 1e-6).sum())
        if float(difference.max()) >= worst:
            worst, where = float(difference.max()), name
    return worst, where, len(ours), entries, differing


def _tensor_files(directory: Path) -> dict:
    from safetensors import safe_open

    mapping = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            mapping.update({name: file for name in handle.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return mapping


def ties_differences_explained(ours: Path, theirs: Path, base: Path, finetuned: list[Path], top_k,
                               weights: list[float] | None = None) -> dict:
    """Where two TIES merges of the same inputs differ, and whether TIES' equations decide those entries.

    TIES leaves two things to the implementation. (1) Equal magnitudes at the trim threshold: when more
    entries of τ_t have |τ_t| = t_t (the ⌊k n⌋-th largest) than fit, which are kept is a choice — ours keeps
    the earlier ones in row-major order, mergekit's unstable ``torch.argsort`` an order torch does not
    specify. (2) An entry whose trimmed sum is exactly 0: the equation's γ = sgn(0) = 0 merges it to 0 (ours),
    mergekit takes γ = +1. Half-precision task vectors are quantised, so both are common there.
    `top_k` is one k or one per fine-tune (a recipe's densities) and `weights` the fine-tunes' weights (the
    sum in (2) is then Σ w_t τ̂_t). Returns the entries (all tensors) in each set, the entries differing > 1e-6
    and the largest |ours − theirs| outside the two sets (0 means: equal wherever the equations decide)."""
    import torch
    from safetensors import safe_open

    sys.path.insert(0, str(ROOT))
    from submerge.merge.strategies import _top_count  # the trim count ours uses (⌊k n⌋, as mergekit)

    def read(files, name):
        with safe_open(str(files[name]), "pt") as handle:
            return handle.get_tensor(name).to(torch.float32)

    ours_files, theirs_files, base_files = _tensor_files(ours), _tensor_files(theirs), _tensor_files(base)
    tuned_files = [_tensor_files(f) for f in finetuned]
    fractions = list(top_k) if isinstance(top_k, (list, tuple)) else [top_k] * len(finetuned)
    weights = list(weights) if weights is not None else [1.0] * len(finetuned)
    totals = {"entries": 0, "at_ties": 0, "zero_sum": 0, "differing": 0, "differing_decided": 0,
              "max_decided": 0.0, "max_all": 0.0}
    for name in ours_files:
        theta0 = read(base_files, name)
        taus = [read(files, name) - theta0 for files in tuned_files]
        n = theta0.numel()
        undecided = torch.zeros(theta0.shape, dtype=torch.bool)
        trimmed_sum = torch.zeros_like(theta0)
        any_kept = torch.zeros(theta0.shape, dtype=torch.bool)
        for tau, fraction, weight in zip(taus, fractions, weights):
            keep = _top_count(fraction, n)
            magnitude = tau.abs()
            threshold = torch.kthvalue(magnitude.reshape(-1), n - keep + 1).values
            at_threshold = magnitude == threshold
            if int((magnitude > threshold).sum()) + int(at_threshold.sum()) > keep:  # more equal entries than fit
                undecided |= at_threshold
            kept = magnitude > threshold  # the decided ones; the threshold entries are undecided if they tie
            trimmed_sum += torch.where(kept | at_threshold, weight * tau, 0.0)
            any_kept |= (kept | at_threshold) & (tau != 0)
        zero_sum = ~undecided & any_kept & (trimmed_sum == 0)
        difference = (read(ours_files, name) - read(theirs_files, name)).abs()
        decided = ~(undecided | zero_sum)
        totals["entries"] += n
        totals["at_ties"] += int(undecided.sum())
        totals["zero_sum"] += int(zero_sum.sum())
        totals["differing"] += int((difference > 1e-6).sum())
        totals["differing_decided"] += int(((difference > 1e-6) & decided).sum())
        totals["max_all"] = max(totals["max_all"], float(difference.max()))
        if bool(decided.any()):
            totals["max_decided"] = max(totals["max_decided"], float(difference[decided].max()))
    return totals


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                        help="Storage dtype of the four checkpoints; both tools compute in float32 and write it.")
    parser.add_argument("--mergekit-python", help="Python of an environment with mergekit installed.")
    parser.add_argument("--shard-size", default="2GB", help="Output shard size for both tools (default 2GB, "
                        "the diag merge default: the whole output is one shard held until written).")
    parser.add_argument("--keep", type=Path, help="Build in this directory and keep it (default: a temp dir).")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return

    directory = args.keep or Path(tempfile.mkdtemp(prefix="merge_bench_"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        size, largest = in_fresh_process(build, directory, args.layers, args.hidden, args.intermediate, args.vocab,
                                         0, args.dtype)
        mib = size / 2**20
        print(f"model: Llama, {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
              f"vocab {args.vocab}, {args.dtype}: {mib:.0f} MiB per checkpoint, 1 base + {len(TASKS)} fine-tunes "
              f"(built in {time.perf_counter() - start:.0f} s); "
              f"largest tensor {largest / 2**20:.0f} MiB; output shards of at most {args.shard_size}")
        print(f"torch threads: {os.cpu_count()} CPU(s) visible; each merge runs in its own process\n")

        mergekit_yaml = None
        if args.mergekit_python:
            candidate = Path(args.mergekit_python).parent / "mergekit-yaml"
            check = subprocess.run([args.mergekit_python, "-c", "import mergekit"], capture_output=True, check=False)
            if check.returncode == 0 and candidate.exists():
                mergekit_yaml = str(candidate)
            else:
                print(f"mergekit not usable from {args.mergekit_python}: skipped\n")
        else:
            print("no --mergekit-python: mergekit comparison skipped\n")

        theirs_base = (import_baseline(args.mergekit_python, "torch, transformers, safetensors, mergekit.merge")
                       if mergekit_yaml else None)
        rows = []
        for method, options in (("task-arithmetic", {"scaling": TA_SCALING}),
                                ("ties", {"top_k": TIES_TOP_K, "scaling": TIES_SCALING})):
            out_ours = directory / f"ours_{method}"
            result = measure([sys.executable, str(Path(__file__).resolve()), "--worker",
                              json.dumps({"directory": str(directory), "out": str(out_ours), "method": method,
                                          "options": options, "shard_size": args.shard_size})])
            inner = json.loads(result["stdout"].strip().splitlines()[-1])
            row = {"method": method, "ours": {**result, **inner}}
            if mergekit_yaml:
                config_path = directory / f"mergekit_{method}.yaml"
                config_path.write_text(yaml.safe_dump(mergekit_config(directory, method, args.dtype), sort_keys=False))
                out_theirs = directory / f"mergekit_{method}"
                element = {"float32": 4, "float16": 2, "bfloat16": 2}[args.dtype]
                shard_parameters = str(parse_size(args.shard_size) // element)  # mergekit counts parameters
                row["mergekit"] = measure([mergekit_yaml, str(config_path), str(out_theirs), "--quiet",
                                           "--no-write-model-card", "--no-copy-tokenizer",
                                           "--out-shard-size", shard_parameters])
                row["max_abs_diff"], row["worst_tensor"], row["tensors"], row["entries"], row["differing"] = in_fresh_process(max_difference, out_ours, out_theirs)
                if method == "ties":
                    row["explained"] = in_fresh_process(ties_differences_explained, out_ours, out_theirs,
                                                        directory / "base", [directory / t for t in TASKS], TIES_TOP_K)
                if not args.keep:
                    shutil.rmtree(out_theirs)
            if not args.keep:
                shutil.rmtree(out_ours)
            rows.append(row)

        header = (f"{'method':<16}{'tool':<10}{'wall s':>8}{'merge s':>9}{'peak RSS MiB':>14}{'/model':>8}"
                  f"{'above import':>14}{'/model':>8}{'peak anon MiB':>15}{'/model':>8}")
        print(header)
        print("-" * len(header))
        for row in rows:
            for tool in ("ours", "mergekit"):
                if tool not in row:
                    continue
                r = row[tool]
                baseline = r["baseline_rss_mib"] if tool == "ours" else theirs_base
                above = r["peak_rss_mib"] - baseline
                print(f"{row['method']:<16}{tool:<10}{r['wall_s']:>8.1f}{r.get('merge_s', float('nan')):>9.1f}"
                      f"{r['peak_rss_mib']:>14.0f}{r['peak_rss_mib'] / mib:>8.2f}{above:>14.0f}{above / mib:>8.2f}"
                      f"{r['peak_anon_mib']:>15.0f}{r['peak_anon_mib'] / mib:>8.2f}")
        print(f"\nimport baseline RSS: ours {rows[0]['ours']['baseline_rss_mib']:.0f} MiB (the worker after its "
              "imports)" + (f", mergekit {theirs_base:.0f} MiB (a process importing mergekit)" if theirs_base else ""))
        print(f"one model: {mib:.0f} MiB; inputs read per merge: {(1 + len(TASKS)) * mib:.0f} MiB; "
              f"largest tensor: {largest / 2**20:.0f} MiB")
        if mergekit_yaml:
            print()
            for row in rows:
                ours, theirs = row["ours"], row["mergekit"]
                print(f"{row['method']}: max |ours - mergekit| = {row['max_abs_diff']:.3g} over {row['tensors']} "
                      f"tensors (largest in {row['worst_tensor']}; "
                      f"{row['differing']} of {row['entries']} entries differ by > 1e-6); time ours/mergekit = {ours['wall_s'] / theirs['wall_s']:.2f}; "
                      f"peak RSS ours/mergekit = {ours['peak_rss_mib'] / theirs['peak_rss_mib']:.2f}; "
                      f"peak anon ours/mergekit = {ours['peak_anon_mib'] / theirs['peak_anon_mib']:.2f}")
                decided = row.get("explained")
                if decided:
                    print(f"  undecided by TIES' equations: {decided['at_ties']} entries tied at a trim threshold, "
                          f"{decided['zero_sum']} with trimmed sum 0; {decided['differing_decided']} differing entries "
                          f"elsewhere, max |ours - mergekit| there {decided['max_decided']:.3g}")
                met = {"peak RSS <= 1.0x": ours["peak_rss_mib"] <= theirs["peak_rss_mib"],
                       "wall <= 1.2x": ours["wall_s"] <= 1.2 * theirs["wall_s"],
                       "max diff <= 1e-6" + (" where decided" if decided else ""):
                           (decided["max_decided"] if decided else row["max_abs_diff"]) <= 1e-6}
                print("  targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items()))
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()

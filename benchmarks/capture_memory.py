"""Peak resident memory and time of capturing module inputs, chunked by a budget vs all layers at once.

Each configuration runs in its own subprocess (so peaks do not mix) and reports
ru_maxrss. The model: the demo base (SmolLM2-135M, 30 layers) when cached or
fetchable, else `--toy` a 12-layer random Llama. Prints the peak over the
model's own footprint for (a) recording layer/attn/mlp inputs of every layer in
one pass and (b) the layer-chunked capture the drivers use (each chunk continues
from the hidden state where the previous one stopped), and the memory and time ratios.

    python benchmarks/capture_memory.py [--samples 8] [--max-tokens 128] [--budget-mb 16] [--toy]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = r"""
import json, resource, sys, time, torch
from submerge.diagnostics.capture import CaptureState, _hidden_of, layer_chunks, record_inputs
from submerge.diagnostics.data import TaskData, tokenize
from submerge.diagnostics.base_model import load_base_model
from submerge.diagnostics.modules import find_architecture, find_submodules
args = json.loads(sys.argv[1])
torch.set_num_threads(2)
base = load_base_model(args["model"], dtype="float32", device="cpu")
arch = find_architecture(base.model)
texts = [json.loads(line) for line in open(args["data"])][: args["samples"]]
texts = [t.get("text") or (t["prompt"] + t["completion"]) for t in texts]
data = TaskData("task", args["data"], texts, list(range(len(texts))), "")
batches = tokenize(data, base.tokenizer, max_tokens=args["max_tokens"], batch_size=8)
after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
modules = find_submodules(base.model, ("layer", "attn", "mlp"), arch=arch)
start = time.perf_counter()
recorded_bytes = 0
if args["mode"] == "all":
    recorded = record_inputs(base.model, arch, [m.path for m in modules], batches)
    recorded_bytes = sum(_hidden_of(r).numel() * _hidden_of(r).element_size() for rs in recorded.values() for r in rs)
else:
    hidden = base.model.config.hidden_size
    padded = sum(b.input_ids.numel() for b in batches)
    chunks = layer_chunks(arch.num_layers, padded * hidden * 4 * 3, args["budget"])
    state = CaptureState()
    for chunk in chunks:
        paths = [m.path for m in modules if m.layer in chunk]
        recorded = record_inputs(base.model, arch, paths, batches, state=state)
        recorded_bytes = max(recorded_bytes, sum(_hidden_of(r).numel() * _hidden_of(r).element_size()
                                                 for rs in recorded.values() for r in rs))
        del recorded
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
params = sum(p.numel() * p.element_size() for p in base.model.parameters())
print(json.dumps({"peak_mb": peak / 1024, "after_load_mb": after_load / 1024, "params_mb": params / 2**20,
                  "recorded_mb": recorded_bytes / 2**20, "seconds": time.perf_counter() - start,
                  "layers": arch.num_layers, "chunks": len(chunks) if args["mode"] != "all" else 1, "tokens": int(sum(b.attention_mask.sum() for b in batches))}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budget-mb", type=float, default=16.0)
    parser.add_argument("--toy", action="store_true", help="use a 12-layer random Llama instead of the demo base")
    options = parser.parse_args()
    if options.toy:
        from submerge.diagnostics import toy

        folder = tempfile.mkdtemp()
        model = str(toy.build_model(f"{folder}/base", "llama", layers=12, hidden=512, heads=8, kv_heads=4))
        data = str(toy.write_task_data(f"{folder}/task.jsonl", "prose", options.samples))
    else:
        from submerge.diagnostics import demo

        model = str(demo.ensure_demo_base())
        data = str(demo.ensure_demo_data()["math"])
    results = {}
    for mode in ("all", "chunked"):
        child_args = {"model": model, "data": data, "samples": options.samples, "max_tokens": options.max_tokens,
                      "mode": mode, "budget": int(options.budget_mb * 2**20)}
        output = subprocess.run([sys.executable, "-c", CHILD, json.dumps(child_args)], capture_output=True, text=True,
                                check=False)
        if output.returncode:
            sys.exit(output.stderr)
        results[mode] = json.loads(output.stdout.strip().splitlines()[-1])
    info = results["all"]
    print(f"model: {model} ({info['layers']} layers, {info['params_mb']:.0f} MB of parameters in float32), "
          f"{options.samples} samples, {info['tokens']} real tokens")
    chunked = f"chunked, budget {options.budget_mb:g} MB ({results['chunked']['chunks']} chunks)"
    for mode, label in (("all", "all layers at once"), ("chunked", chunked)):
        result = results[mode]
        print(f"{label:28s} peak RSS {result['peak_mb']:8.0f} MB  (after loading {result['after_load_mb']:.0f} MB; "
              f"recorded inputs held at once {result['recorded_mb']:.0f} MB; {result['seconds']:.1f} s)")
    extra_all = results["all"]["peak_mb"] - results["all"]["after_load_mb"]
    extra_chunked = results["chunked"]["peak_mb"] - results["chunked"]["after_load_mb"]
    print(f"capture overhead above the loaded model: all-at-once {extra_all:.0f} MB, chunked {extra_chunked:.0f} MB, "
          f"ratio {extra_all / max(extra_chunked, 1):.1f}x")
    print(f"capture time: chunked / all-at-once = {results['chunked']['seconds'] / results['all']['seconds']:.2f}")


if __name__ == "__main__":
    main()

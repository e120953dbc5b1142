"""Peak memory of the model level (`capture.model_outputs`, used by `diag linearity` and `diag eval`):
what every block receives recorded without its hidden state (`block_kwargs`) vs every block's inputs recorded
whole by a base forward (`record_inputs`, the earlier way).

The streams of the variants are the same either way; only the blocks' recorded inputs differ: L hidden states
per batch before, the masks and positions now. Each way runs in its own subprocess (peaks do not mix) on a
random Llama built here (deep and narrow, so recorded inputs are large against the weights), prints the peak
RSS over the loaded model, the ratio and the largest difference of the outputs (0: the same numbers).

    python benchmarks/model_level_memory.py [--layers 32] [--hidden 256] [--records 32] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time, torch
from submerge.diagnostics import capture
from submerge.diagnostics.capture import ParameterSource, model_outputs, record_inputs
from submerge.diagnostics.data import TokenBatch
from submerge.diagnostics.base_model import load_base_model
from submerge.diagnostics.modules import find_architecture
args = json.loads(sys.argv[1])
torch.set_num_threads(2)
base = load_base_model(args["model"], dtype="float32", device="cpu")
arch = find_architecture(base.model)
generator = torch.Generator().manual_seed(0)
batches = [TokenBatch(torch.randint(0, 250, (8, args["tokens"]), generator=generator),
                      torch.ones(8, args["tokens"], dtype=torch.long), list(range(b * 8, b * 8 + 8)))
           for b in range(args["records"] // 8)]
if args["mode"] == "all-inputs":
    capture.block_kwargs = lambda model, arch, layers, batches, device="cpu", compute=None: record_inputs(
        model, arch, [arch.layer_path(i) for i in layers], batches, device=device, compute=compute)
after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
outputs = model_outputs(ParameterSource(base, {}), arch, batches, [{}])[0]
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
torch.save(outputs, args["save"])
print(json.dumps({"peak_over_load_mb": (peak - after_load) / 1024, "seconds": seconds}))
"""


def run(mode: str, model: Path, records: int, tokens: int, save: Path) -> dict:
    args = json.dumps({"mode": mode, "model": str(model), "records": records, "tokens": tokens, "save": str(save)})
    done = subprocess.run([sys.executable, "-c", CHILD, args], capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--records", type=int, default=32, help="Records (a multiple of 8; batches of 8).")
    parser.add_argument("--tokens", type=int, default=256, help="Tokens per record.")
    options = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    from submerge.diagnostics import toy

    with tempfile.TemporaryDirectory() as scratch:
        model = toy.build_model(Path(scratch) / "model", "llama", layers=options.layers, hidden=options.hidden,
                                heads=4, kv_heads=4)
        results = {mode: run(mode, model, options.records, options.tokens, Path(scratch) / f"{mode}.pt")
                   for mode in ("all-inputs", "block-kwargs")}
        difference = max(float((a - b).abs().max()) for a, b in zip(torch.load(Path(scratch) / "all-inputs.pt"),
                                                                     torch.load(Path(scratch) / "block-kwargs.pt")))
    hidden_mb = options.layers * options.records * options.tokens * options.hidden * 4 / 2**20
    print(f"Llama {options.layers} layers × hidden {options.hidden}, {options.records} records × {options.tokens} "
          f"tokens (every block's hidden inputs: {hidden_mb:.0f} MB)")
    for mode, result in results.items():
        print(f"  {mode:13s} peak over the loaded model {result['peak_over_load_mb']:8.1f} MB   "
              f"{result['seconds']:6.2f} s")
    ratio = results["block-kwargs"]["peak_over_load_mb"] / max(results["all-inputs"]["peak_over_load_mb"], 1e-9)
    print(f"block-kwargs / all-inputs: memory {ratio:.2f}×, time "
          f"{results['block-kwargs']['seconds'] / results['all-inputs']['seconds']:.2f}×; "
          f"largest output difference {difference:.1e}")


if __name__ == "__main__":
    main()

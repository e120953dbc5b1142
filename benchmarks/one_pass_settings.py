"""Benchmark: a method's settings written in one pass (`write_merges`, what `diag compare` tunes with since stop 50)
against one checkpoint per setting (`write_merge` each, before), on the demo kit's real fine-tunes.

`diag compare` tunes every method on the fit records: it writes the merged update δ once per setting of the method's
knobs other than λ (KnOTS and TIES: 4 top-k; CART: 3 rank ratios; DARE: 4 drop rates; Consensus TA: 5 mask λ;
`merge.tuning.GRIDS`) and evaluates each λ as θ0 + λ·δ. One setting after another, every setting read every tensor
of the base and the fine-tunes again, and KnOTS (one SVD of [τ_1 … τ_T] per matrix) and CART (one SVD of each
τ_t − τ̄) decomposed the same matrices once per setting, although the setting changes only what is done with the
factors. `write_merges` reads each tensor once for all settings and merges it under each inside
`strategies.shared_factors`, which keeps those SVDs for the tensor's other settings.

For each method: its grid's settings (at λ = 1) written both ways, alternating which way goes first per method,
in one process; printed: each way's wall, their ratio, and whether every output's shards are byte for byte equal.

    python benchmarks/one_pass_settings.py [--methods knots,cart,ties] [--lora] [--threads N]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _digest(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.glob("*.safetensors"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="knots,cart,ties", help="comma-separated methods of merge.tuning.GRIDS")
    parser.add_argument("--lora", action="store_true", help="the LoRA adapters even where full fine-tunes exist")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()

    import torch

    from submerge.diagnostics.demo import demo_finetunes, ensure_demo_base
    from submerge.merge.rules import method_rule
    from submerge.merge.tuning import SCALE, settings_of
    from submerge.merge.writer import write_merge, write_merges

    if args.threads:
        torch.set_num_threads(args.threads)
    base = str(ensure_demo_base())
    finetuned, kit = demo_finetunes(args.lora)
    finetuned = {task: str(path) for task, path in finetuned.items()}
    print(f"SmolLM2-135M + {kit}; torch threads {torch.get_num_threads()}", flush=True)
    for order, method in enumerate(args.methods.split(",")):
        settings = [{**setting, SCALE: 1.0} for setting in settings_of(method)]
        rules = [method_rule(method, setting) for setting in settings]
        with tempfile.TemporaryDirectory(prefix="one-pass-") as scratch:
            scratch = Path(scratch)
            walls, digests = {}, {}
            ways = ["one pass", "one by one"] if order % 2 == 0 else ["one by one", "one pass"]
            for way in ways:
                start = time.perf_counter()
                if way == "one pass":
                    written = write_merges(base, finetuned, [(scratch / f"together-{i}", rule, None)
                                                             for i, rule in enumerate(rules)], progress=False)
                else:
                    written = [write_merge(base, finetuned, scratch / f"alone-{i}", rule, progress=False)
                               for i, rule in enumerate(rules)]
                walls[way] = time.perf_counter() - start
                digests[way] = [_digest(directory) for directory in written]
                for directory in written:
                    shutil.rmtree(directory)
        same = digests["one pass"] == digests["one by one"]
        print(f"{method} ({len(settings)} settings: {', '.join(str(s) for s in settings)}): one by one "
              f"{walls['one by one']:.1f} s, one pass {walls['one pass']:.1f} s, ratio "
              f"{walls['one pass'] / walls['one by one']:.2f}; shards byte for byte equal: {same} "
              f"(first: {ways[0]})", flush=True)


if __name__ == "__main__":
    main()

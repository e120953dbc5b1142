"""Benchmark: a module's N points replayed one forward each, against one forward of all N stacked as a batch.

`diag linearity` replays each point θ0 + (k/N)τ of a module as its own forward (`replay.replay_line`). Stacking
the points along the batch dimension would run each kernel once on N × the rows instead of N times, and save the
Python between kernels; with per-point weights it also needs the N variants side by side or each product twice
(W0·x and τ·x). This measures the best case for stacking: the same weights at every point (so no extra product and
no variant is formed), the demo base's first block, its attention and its MLP, on random hidden states of the
reference point's size (8 records × ``--tokens`` tokens). If stacking does not pay here, it cannot pay with
per-point weights either.

    python benchmarks/batched_points.py [--points 10] [--records 8] [--tokens 110] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def best_of(function, repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=10)
    parser.add_argument("--records", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=110)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from submerge.diagnostics.demo import ensure_demo_base

    model = AutoModelForCausalLM.from_pretrained(str(ensure_demo_base()), dtype=torch.float32)
    block = model.model.layers[0]
    x = torch.randn(args.records, args.tokens, model.config.hidden_size)
    positions = model.model.rotary_emb(x, torch.arange(args.tokens)[None])
    stacked = x.repeat(args.points, 1, 1)
    cases = {
        "block": (lambda h: block(h, position_embeddings=positions)),
        "attention": (lambda h: block.self_attn(h, position_embeddings=positions, attention_mask=None)),
        "MLP": (lambda h: block.mlp(h)),
    }
    print(f"SmolLM2-135M block 0, {args.points} points × {args.records} records × {args.tokens} tokens, "
          f"torch threads {torch.get_num_threads()}, best of {args.repeats}")
    print(f"{'module':<10}{'one forward per point ms':>26}{'one stacked forward ms':>24}{'stacked / per point':>21}")
    with torch.no_grad():
        for name, forward in cases.items():
            apart = best_of(lambda forward=forward: [forward(x) for _ in range(args.points)], args.repeats)
            together = best_of(lambda forward=forward: forward(stacked), args.repeats)
            print(f"{name:<10}{apart * 1e3:>26.1f}{together * 1e3:>24.1f}{together / apart:>21.2f}")


if __name__ == "__main__":
    main()

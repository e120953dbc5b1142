"""Benchmark: SFTM's linear system solved by Cholesky (today's `sftm_system`) against the pseudo-inverse (before stop
49), on real task matrices.

SFTM (seed 001, Algorithm 1) solves (Σ ∘ U ∘ V) α = σ with one equation per singular triplet of every trimmed task
matrix: r = 1,728 equations for a 576 × 576 or 1,536 × 576 matrix of SmolLM2-135M with three fine-tunes. The
system's matrix G = U ∘ V is symmetric positive semi-definite. Before stop 49, β = G⁺σ came from the Hermitian
pseudo-inverse (an eigendecomposition); now from a Cholesky solve where LAPACK's condition estimate says G⁺ = G⁻¹
(`solve_symmetric_right(min_rcond=SFTM_MIN_RCOND)`), the pseudo-inverse below it.

For every weight matrix of the chosen blocks (task vectors of the demo kit's full fine-tunes when they are cached,
else its LoRA adapters), `sftm(τ_1, τ_2, τ_3, top_k)` runs once each way, alternating which goes first, in one
process and one thread. Printed: the wall of each way summed, their ratio, and the largest difference of the merged
matrices relative to the matrix's largest entry.

    python benchmarks/sftm_solve.py [--layers 0,15,29] [--top-k 0.3] [--threads 1] [--lora]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0,15,29", help="blocks whose weight matrices are merged")
    parser.add_argument("--top-k", type=float, default=0.3, help="SFTM's kept fraction (the tuning grid's middle)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lora", action="store_true", help="the LoRA adapters even where full fine-tunes exist")
    args = parser.parse_args()

    import torch

    from submerge.diagnostics.checkpoints import open_checkpoint
    from submerge.diagnostics.demo import demo_finetunes, ensure_demo_base
    from submerge.diagnostics.task_vectors import open_finetunes
    from submerge.merge import strategies

    torch.set_num_threads(args.threads)
    base = open_checkpoint(str(ensure_demo_base()))
    finetuned, kit = demo_finetunes(args.lora)
    readers, _ = open_finetunes(base, {task: str(path) for task, path in finetuned.items()})
    layers = [int(x) for x in args.layers.split(",")]
    names = [n for n in base.names() if any(f".layers.{i}." in n for i in layers)
             and n.endswith(".weight") and len(base.shape(n)) == 2]

    cholesky = strategies.solve_symmetric_right

    def pseudo_inverse(rows, matrix, *, min_rcond=0.0):
        return rows @ torch.linalg.pinv(matrix, hermitian=True)

    walls = {"cholesky": 0.0, "pinv": 0.0}
    worst = 0.0
    print(f"SFTM (top-k {args.top_k}) on the demo kit's {kit}, blocks {layers}: {len(names)} matrices, "
          f"{args.threads} thread(s)")
    for index, name in enumerate(names):
        vectors = [reader.get(name) for reader in readers.values()]
        order = ("cholesky", "pinv") if index % 2 == 0 else ("pinv", "cholesky")
        merged = {}
        for way in order:
            strategies.solve_symmetric_right = cholesky if way == "cholesky" else pseudo_inverse
            start = time.perf_counter()
            merged[way] = strategies.sftm(vectors, top_k=args.top_k)
            walls[way] += time.perf_counter() - start
        strategies.solve_symmetric_right = cholesky
        scale = float(merged["pinv"].abs().max())
        if scale > 0:
            worst = max(worst, float((merged["cholesky"] - merged["pinv"]).abs().max()) / scale)
    print(f"  pseudo-inverse (before): {walls['pinv']:.1f} s")
    print(f"  Cholesky (today):        {walls['cholesky']:.1f} s")
    print(f"  ratio today / before:    {walls['cholesky'] / walls['pinv']:.2f}")
    print(f"  largest |difference| / max |entry| of a merged matrix: {worst:.2e}")


if __name__ == "__main__":
    main()

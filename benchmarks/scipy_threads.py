"""Benchmark: scipy's LAPACK and BLAS on one thread against the threads set outside, each call right after a torch
product, at the orders the merges and the Gram route meet (what `spectral.ONE_THREAD_BELOW` is set from).

scipy's OpenBLAS is a thread pool of its own beside torch's OpenMP pool. Right after a torch product torch's threads
still spin; with the cores busy (another job, the test suite's two workers) the two pools wait on each other.
Printed per order: the median wall of a Cholesky + solve (RegMean, SFTM), a syrk Gram (the Gram route) and a
divide-and-conquer eigendecomposition (the Gram route), at 1 thread and at `--threads` (default: the cores). Run it
once on a quiet machine and once beside another job.

    python benchmarks/scipy_threads.py [--orders 576,1536,3072,4096] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", default="576,1536,3072,4096", help="comma-separated matrix orders")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the threads to compare with 1")
    parser.add_argument("--repeats", type=int, default=3, help="calls per measurement (the median is printed)")
    args = parser.parse_args()

    import numpy as np
    import torch
    from scipy.linalg import blas, lapack
    from threadpoolctl import ThreadpoolController

    controller = ThreadpoolController()
    torch.set_num_threads(args.threads)
    generator = np.random.default_rng(0)
    inputs, weight = torch.randn(2048, 576), torch.randn(1536, 576)

    def timed(call) -> float:
        walls = []
        for _ in range(args.repeats):
            torch.nn.functional.linear(inputs, weight)  # torch's pool busy just before, as in a merge or a replay
            start = time.perf_counter()
            call()
            walls.append(time.perf_counter() - start)
        return statistics.median(walls)

    print(f"torch threads {args.threads}; scipy BLAS 1 thread against {args.threads}", flush=True)
    for order in map(int, args.orders.split(",")):
        tall = generator.standard_normal((2 * order, order))
        gram, rows = tall.T @ tall, generator.standard_normal((order, order))
        tall32 = np.ascontiguousarray(tall, dtype=np.float32)

        def solve(gram=gram, rows=rows):
            factor, _ = lapack.dpotrf(np.asfortranarray(gram), lower=1, clean=0, overwrite_a=1)
            lapack.dpotrs(factor, np.asfortranarray(rows), lower=1, overwrite_b=1)

        def syrk(tall32=tall32):
            blas.ssyrk(1.0, tall32.T, trans=0, lower=1)

        def eigh(gram=gram):
            lapack.dsyevd(gram, compute_v=1, lower=1)

        cells = []
        for threads in (1, args.threads):
            with controller.limit(limits=threads, user_api="blas"):
                cells.append(f"{threads} thread(s): Cholesky + solve {timed(solve) * 1e3:.0f} ms, syrk "
                             f"{timed(syrk) * 1e3:.0f} ms, eigh {timed(eigh) * 1e3:.0f} ms")
        print(f"order {order}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()

"""What the noise floor costs: the float64 pass over the first `--floor-samples` records, as a share of a
`diag linearity` run (issue 24: ≤ 10 % at the defaults).

    nice -n 5 python benchmarks/noise_floor.py --samples 16 --max-tokens 64 --levels mlp

Times one run of the driver with its floor, and inside it the floor pass alone (the driver's `_reference`).
"""

from __future__ import annotations

import argparse
import importlib
import time

from submerge.diagnostics import demo
from submerge.diagnostics.experiment import Experiment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--levels", default="model,layer,attn,mlp")
    parser.add_argument("--floor-samples", type=int, default=1)
    parser.add_argument("--task", default="math")
    args = parser.parse_args()
    data = {args.task: str(demo.ensure_demo_data()[args.task])}
    experiment = Experiment.load(str(demo.ensure_demo_base()), {args.task: str(demo.demo_adapters()[args.task])},
                                 data, samples=args.samples, max_tokens=args.max_tokens, device="cpu")
    module = importlib.import_module("submerge.diagnostics.linearity.nonlinearity")
    spent = {}
    reference = module._reference

    def timed(*positional, **options):
        start = time.perf_counter()
        try:
            return reference(*positional, **options)
        finally:
            spent["floor"] = time.perf_counter() - start

    module._reference = timed
    start = time.perf_counter()
    module.nonlinearity(experiment, levels=tuple(args.levels.split(",")), floor_samples=args.floor_samples,
                        progress=False)
    total = time.perf_counter() - start
    main_run = total - spent["floor"]
    print(f"{args.samples} records × {args.max_tokens} tokens, levels {args.levels}: run {main_run:.1f} s, "
          f"floor ({args.floor_samples} record(s), float64) {spent['floor']:.1f} s = "
          f"{100 * spent['floor'] / main_run:.1f} % of the run")


if __name__ == "__main__":
    main()

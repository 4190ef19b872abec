"""Where a training step's time goes: ``torch.profiler`` over full training steps of keel
schemes (and optionally the HF Llama baseline of ``throughput.py``), same shapes and step as
``throughput.py``; prints the top operators by self CPU time per model and a side-by-side
summary (ops per step, self CPU ms per step of the top operators).

    python benchmarks/profile_step.py --shape 256x16 --models pre_ln,keel,hf_llama --threads 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput as tp  # (benchmarks/throughput.py: shapes, models, the step)


def profile(name: str, shape, args) -> dict[str, tuple[int, float]]:
    """{op name: (calls per step, self CPU ms per step)} over ``args.steps`` profiled steps."""
    runner = tp.Runner(name, shape, torch.device("cpu"), args.seed, 1.0)
    batches = tp.make_batches(shape, args.batch_size, 2, torch.device("cpu"), args.seed)
    for i in range(args.warmup):
        runner.step(*batches[i % 2])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(args.steps):
            runner.step(*batches[i % 2])
    return {e.key: (e.count // args.steps, e.self_cpu_time_total / 1e3 / args.steps)
            for e in prof.key_averages()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="256x16", help="WIDTHxBLOCKS")
    p.add_argument("--models", default="pre_ln,keel", help="comma-separated schemes and/or hf_llama")
    tp.add_shape_flags(p)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = tp.parse_shapes(args.shape, args)[0]
    stats = {m: profile(m, shape, args) for m in args.models.split(",")}
    names = list(stats)
    top = sorted({k for s in stats.values() for k in s}, key=lambda k: -max(s.get(k, (0, 0))[1] for s in stats.values()))
    print(f"shape {args.shape}, batch {args.batch_size} x {args.seq_len}, {args.threads} thread(s), "
          f"{args.steps} profiled steps; per step: calls / self CPU ms\n")
    print("| op | " + " | ".join(names) + " |")
    print("|:---|" + "---:|" * len(names))
    for k in top[:args.top]:
        print(f"| `{k}` | " + " | ".join(f"{stats[n].get(k, (0, 0))[0]} / {stats[n].get(k, (0, 0))[1]:.0f}"
                                         for n in names) + " |")
    print("| all ops | " + " | ".join(f"{sum(c for c, _ in stats[n].values())} / "
                                      f"{sum(t for _, t in stats[n].values()):.0f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

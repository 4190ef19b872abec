"""Compiled ÷ eager training throughput of keel models on this machine (CPU: inductor's C++ backend).

For every shape and scheme this builds two copies of the same model (same weights): one
eager, one with ``train.compile``'s transform (:func:`keel.train.parallelize.apply_compile`:
``torch.compile`` per block, ``fullgraph=True``, inductor), optionally after activation
checkpointing (``--ac block``). It times one full training step -- forward, the chunked
LM-head loss, backward, AdamW (``keel.train.optim.build_optimizer``) -- on the same random
batches, interleaved: ``--rounds`` rounds of ``--steps`` steps of each model, the order
swapped every round, after ``--warmup`` untimed steps (the first compiles). Reported per
row: eager and compiled tokens/s (median round), their ratio (> 1 = compiled faster), each
one's process CPU time per step and their ratio (less sensitive to other jobs on a shared
machine), the compile time (wall seconds of the first compiled step) beside the speed-up it
buys: the steps after which it has paid for itself (compile time / wall time a compiled step
saves), and the number of graph breaks and graphs Dynamo made (0 breaks expected).

Shapes default to ``benchmarks/throughput.py``'s (128x4, 256x4, 128x16, 256x16: width x
blocks, seq 128, batch 16, vocab 8192, head dim 32, GQA 2, d_ff 3d) plus 64x32 (width 64,
64 sub-layers). Example::

    python benchmarks/compile_speedup.py --schemes keel,pre_ln --threads 1 --markdown
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import add_shape_flags, keel_config, make_batches, parse_shapes  # noqa: E402

DEFAULT_SHAPES = "128x4,256x4,128x16,256x16,64x32"


class Model:
    """One model, its AdamW, its training step."""

    def __init__(self, shape, scheme: str, compiled: bool, ac: str, seed: int):
        from keel import Transformer
        from keel.config import TrainConfig
        from keel.train.optim import build_optimizer
        from keel.train.parallelize import apply_activation_checkpointing, apply_compile

        torch.manual_seed(seed)
        self.model = Transformer(keel_config(shape, scheme)).train()
        apply_activation_checkpointing(self.model, ac)
        if compiled:
            apply_compile(self.model)
        self.opt = build_optimizer(self.model, TrainConfig())

    def step(self, ids, tgt) -> float:
        loss = self.model(ids, tgt)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def _timed(model: Model, batches, steps: int) -> tuple[float, float]:
    """(wall s, process CPU s) per step over ``steps`` steps."""
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        model.step(*batches[i % len(batches)])
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def bench(shape, scheme: str, args) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    batches = make_batches(shape, args.batch_size, 2, torch.device("cpu"), args.seed)
    models = {"eager": Model(shape, scheme, False, args.ac, args.seed),
              "compiled": Model(shape, scheme, True, args.ac, args.seed)}
    t0 = time.perf_counter()
    loss_c = models["compiled"].step(*batches[0])
    compile_s = time.perf_counter() - t0
    loss_e = models["eager"].step(*batches[0])
    for _ in range(args.warmup):
        for m in models.values():
            m.step(*batches[1])
    wall = {k: [] for k in models}
    cpu = {k: [] for k in models}
    for r in range(args.rounds):
        for name in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
            w, c = _timed(models[name], batches, args.steps)
            wall[name].append(w)
            cpu[name].append(c)
    tokens = args.batch_size * shape.seq_len
    tok_s = {k: tokens / statistics.median(v) for k, v in wall.items()}
    cpu_ms = {k: 1e3 * statistics.median(v) for k, v in cpu.items()}
    saved_s = (tokens / tok_s["eager"] - tokens / tok_s["compiled"])  # wall seconds a compiled step saves
    return {"shape": shape.label, "scheme": scheme, "ac": args.ac, "eager_tok_s": tok_s["eager"],
            "compiled_tok_s": tok_s["compiled"], "ratio": tok_s["compiled"] / tok_s["eager"],
            "eager_cpu_ms": cpu_ms["eager"], "compiled_cpu_ms": cpu_ms["compiled"],
            "cpu_ratio": cpu_ms["eager"] / cpu_ms["compiled"], "compile_s": compile_s,
            "pays_after_steps": compile_s / saved_s if saved_s > 0 else None,
            "graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"], "first_loss_diff": abs(loss_c - loss_e)}


def markdown(rows: list[dict]) -> str:
    out = ["| shape | scheme | AC | eager tok/s | compiled tok/s | compiled ÷ eager | eager CPU ms/step | "
           "compiled CPU ms/step | ÷ by CPU time | compile s | pays after steps | graph breaks | graphs |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pays = "never" if r.get("pays_after_steps") is None else f"{r['pays_after_steps']:,.0f}"
        out.append(f"| {r['shape']} | {r['scheme']} | {r['ac']} | {r['eager_tok_s']:,.0f} | "
                   f"{r['compiled_tok_s']:,.0f} | {r['ratio']:.2f} | {r.get('eager_cpu_ms', 0):,.0f} | "
                   f"{r.get('compiled_cpu_ms', 0):,.0f} | {r['cpu_ratio']:.2f} | {r['compile_s']:.0f} | {pays} | "
                   f"{r['graph_breaks']} | {r['graphs']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="WIDTHxBLOCKS, comma-separated")
    p.add_argument("--schemes", default="keel,pre_ln", help="comma-separated, or 'all' (keel.model.SCHEMES)")
    p.add_argument("--ac", default="none", help="activation checkpointing: none | block")
    add_shape_flags(p)
    p.add_argument("--steps", type=int, default=2, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--markdown", action="store_true", help="print a markdown table at the end")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from keel.model import SCHEMES

    schemes = list(SCHEMES) if args.schemes == "all" else args.schemes.split(",")
    rows = []
    for shape in parse_shapes(args.shapes, args):
        for scheme in schemes:
            row = bench(shape, scheme, args)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))
    if args.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

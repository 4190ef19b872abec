"""``keel ablate`` from the kept stream state against recomputing every sub-layer, side by side.

The model is the study's importance cell (``keel/configs/studies/claims.toml``, scale ``cpu``, group
``importance-deep``: width 64, 4 heads of 16, 2 KV heads, d_ff 192, vocab 512, sequences of 128
tokens) at ``--sublayers`` (default 64; the study ablates 64 and 256), at its init (weights do not
change the time). The windows are the first ``--tokens`` validation tokens the study ablates on
(random ids of the vocabulary when ``--random-ids``; the time does not depend on them either).

Paths, in one process, alternating (the order swaps every round), the median round reported:

* ``recompute``: ``ablate_model(..., cache_bytes=0)``: every one of the L + 1 passes runs every
  sub-layer from the embedding (the path of every ablation before the kept stream);
* ``kept``: the default, ``cache_bytes = keel.diagnostics.ablate.PREFIX_CACHE_BYTES``: the pass
  that removes sub-layer i starts from the full pass's state before it.

It checks that both give the same result (the whole dict, bit for bit) and prints process CPU time
and wall time per path and the ratio recompute / kept (> 1: the kept path is faster), with the load
average, and the sub-layers each path runs (calls of the attention and FFN modules: the work, whatever
the machine's load; on a shared machine times move by a third between rounds).

    python benchmarks/ablate_speed.py --sublayers 64 --tokens 4096 --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sublayers", type=int, default=64)
    ap.add_argument("--scheme", default="keel")
    ap.add_argument("--tokens", type=int, default=4096, help="validation tokens scored per pass")
    ap.add_argument("--batch-size", type=int, default=16, help="windows per forward pass (keel ablate's default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from keel import Transformer
    from keel.config import load_config, resolve_config_path
    from keel.diagnostics.ablate import PREFIX_CACHE_BYTES, ablate_model
    from keel.experiments.study.spec import read_study

    study = read_study("claims", "cpu")
    group = next(g for g in study.groups if g.name == "importance-deep")
    cfg = load_config(resolve_config_path(study.base), study.all_sets(group) + [
        ("model.residual", args.scheme), ("model.n_layers", args.sublayers // 2)])
    torch.manual_seed(0)
    model = Transformer(cfg.model).eval()
    T = cfg.train.seq_len
    n = max(1, args.tokens // T)
    windows = torch.randint(0, cfg.model.vocab_size, (n, T + 1), generator=torch.Generator().manual_seed(1))
    paths = {"recompute": 0, "kept": PREFIX_CACHE_BYTES}
    times: dict[str, list[tuple[float, float]]] = {p: [] for p in paths}
    results, runs = {}, {p: 0 for p in paths}
    calls = [0]

    def count(module, args, out):
        calls[0] += 1

    for _, _, f in model.sublayers():
        f.register_forward_hook(count)
    for r in range(args.rounds):
        order = list(paths) if r % 2 == 0 else list(paths)[::-1]
        for p in order:
            c0, w0, calls[0] = time.process_time(), time.perf_counter(), 0
            results[p] = ablate_model(model, windows, batch_size=args.batch_size, cache_bytes=paths[p])
            times[p].append((time.process_time() - c0, time.perf_counter() - w0))
            runs[p] = calls[0]
        print(f"round {r}: " + ", ".join(f"{p} {times[p][-1][0]:.1f} s CPU" for p in paths)
              + f"; load {os.getloadavg()[0]:.2f}", flush=True)
    same = results["recompute"] == results["kept"]
    cpu = {p: statistics.median(c for c, _ in times[p]) for p in paths}
    wall = {p: statistics.median(w for _, w in times[p]) for p in paths}
    print(f"\n{args.scheme}, {args.sublayers} sub-layers x width {cfg.model.d_model}, {n * T:,} tokens per pass "
          f"({args.sublayers + 1} passes), {args.threads} thread(s), median of {args.rounds} rounds\n")
    print("| path | sub-layers run | CPU s | wall s | recompute / path (sub-layers) | recompute / path (CPU) | "
          "recompute / path (wall) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for p in paths:
        print(f"| {p} | {runs[p]:,} | {cpu[p]:.1f} | {wall[p]:.1f} | {runs['recompute'] / runs[p]:.2f} | "
              f"{cpu['recompute'] / cpu[p]:.2f} | {wall['recompute'] / wall[p]:.2f} |")
    print(f"\nsame result, bit for bit: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory of a very deep Keel model on CPU, measured vs predicted.

Trains a model (default: 512 blocks = 1024 sub-layers, width 64) for a few AdamW steps on
one fixed batch, in a fresh ``multiprocessing`` spawn child per setting so that each peak
is its own, and compares the child's peak resident set size (``resource.getrusage``
``ru_maxrss``) with ``baseline + predicted``, where ``baseline`` is the child's peak RSS
just before the model is built (Python, torch, the batch, and two warm-up steps of a
1-block model that initialise kernels, thread pools and allocator arenas) and ``predicted`` is
:func:`peak_bytes` below, built on :func:`keel.train.parallelize.memory_estimate`.

Example (the numbers in docs/results/deep.md)::

    python benchmarks/memory.py --blocks 512 --width 64 --batch 4 --seq-len 64 --steps 3 \\
        --checkpointing block,none --markdown
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import time

MiB = 2 ** 20


def rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc/self/status`` VmRSS), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``ru_maxrss``, KiB on Linux), bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_bytes(n_params: int, n_blocks: int, batch: int, seq_len: int, d_model: int, d_ff: int, n_heads: int,
               n_kv_heads: int, vocab_size: int, residual: str, activation_checkpointing: str,
               checkpoint_k: int = 2) -> dict[str, int]:
    """Predicted bytes of fp32 training steps with the foreach ``torch.optim.AdamW`` (CPU):
    :func:`keel.train.parallelize.memory_estimate`, whose ``peak`` is
    ``max(12·P + activations + head, 20·P)`` (see its docstring)."""
    from memory_model import memory_estimate

    return memory_estimate(n_params, n_blocks, batch, seq_len, d_model, d_ff, n_heads, n_kv_heads, vocab_size,
                           residual, activation_checkpointing, checkpoint_k)


def _child(args_dict: dict, mode: str, queue) -> None:
    import torch

    torch.set_num_threads(args_dict["threads"])
    from keel.config import ModelConfig, TrainConfig
    from keel.model import Transformer
    from keel.train import parallelize as par
    from keel.train import state_dict as SD
    from keel.train.optim import build_optimizer

    a = argparse.Namespace(**args_dict)
    cfg = ModelConfig(vocab_size=a.vocab, d_model=a.width, n_layers=a.blocks, n_heads=a.heads, n_kv_heads=a.kv_heads,
                      d_ff=a.ffn or 3 * a.width, max_seq_len=a.seq_len, residual=a.residual)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1), generator=g)
    # warm the runtime up (kernels, thread pools, autograd engine, allocator arenas) with a
    # 1-block model, so that the baseline holds everything that does not scale with the model
    tiny = Transformer(ModelConfig(vocab_size=a.vocab, d_model=a.width, n_layers=1, n_heads=a.heads,
                                   n_kv_heads=a.kv_heads, d_ff=a.ffn or 3 * a.width, max_seq_len=a.seq_len,
                                   residual=a.residual))
    tiny_opt = build_optimizer(tiny, TrainConfig(lr=a.lr))
    for _ in range(2):
        tiny(batch[:, :-1], batch[:, 1:]).backward()
        tiny_opt.step()
        tiny_opt.zero_grad(set_to_none=True)
    del tiny, tiny_opt
    baseline = max(rss_bytes(), peak_rss_bytes())
    torch.manual_seed(0)
    model = Transformer(cfg)
    par.apply_activation_checkpointing(model, mode, a.checkpoint_k)
    opt = build_optimizer(model, TrainConfig(lr=a.lr))
    losses, times, after_fwd = [], [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = model(batch[:, :-1], batch[:, 1:])
        after_fwd.append(rss_bytes())
        loss.backward()
        SD.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    P = model.num_params()
    pred = peak_bytes(P, cfg.n_layers, a.batch, a.seq_len, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads,
                      cfg.vocab_size, cfg.residual, mode, a.checkpoint_k)
    queue.put({"mode": mode, "n_params": P, "baseline": baseline, "peak_rss": peak_rss_bytes(),
               "rss_after_forward": max(after_fwd[1:] or after_fwd), "losses": losses, "step_s": times,
               "predicted": pred})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=512, help="blocks (sub-layers = 2 x blocks)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--ffn", type=int, default=0, help="d_ff (default 3 x width)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--residual", default="keel")
    p.add_argument("--checkpointing", default="block,none", help="comma-separated: none, block, every_k")
    p.add_argument("--checkpoint-k", type=int, default=2)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on a shared machine more threads spin and run slower)")
    p.add_argument("--mmap-threshold", type=int, default=0,
                   help="glibc MALLOC_MMAP_THRESHOLD_ (bytes) for the children: with e.g. 16384 freed tensors "
                        "go back to the OS, so RSS follows live bytes instead of the heap's high-water mark "
                        "(0 = glibc default, whose freed heap chunks stay resident and fragment)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)  # read by glibc at child start-up
    ctx = mp.get_context("spawn")
    results = []
    for mode in a.checkpointing.split(","):
        q = ctx.Queue()
        proc = ctx.Process(target=_child, args=(vars(a), mode.strip(), q))
        proc.start()
        res = q.get()
        proc.join()
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "predicted"} | {"predicted_peak": res["predicted"]["peak"]}),
              file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)
    L = 2 * a.blocks
    print(f"Keel-style model: {a.blocks} blocks = {L} sub-layers, width {a.width}, d_ff {a.ffn or 3 * a.width}, "
          f"{results[0]['n_params'] / 1e6:.2f}M parameters; batch {a.batch} x {a.seq_len} tokens; residual {a.residual}; "
          f"malloc mmap threshold {a.mmap_threshold or 'default'}")
    if a.markdown:
        print("\n| activation checkpointing | params+grads+AdamW (MiB) | stored activations (MiB) | head (MiB) | "
              "predicted peak (MiB) | baseline RSS (MiB) | predicted RSS (MiB) | measured peak RSS (MiB) | error | "
              "step (s) | loss (first -> last) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            e = r["predicted"]
            growth = r["peak_rss"] - r["baseline"]
            pred = r["baseline"] + e["peak"]
            print(f"| {r['mode']} | {(e['params'] + e['grads'] + e['optimizer']) / MiB:.0f} | "
                  f"{e['activations'] / MiB:.1f} | {e['head'] / MiB:.1f} | {e['peak'] / MiB:.0f} "
                  f"({'forward' if e['forward_peak'] >= e['optimizer_peak'] else 'optimizer step'}) | "
                  f"{r['baseline'] / MiB:.0f} | {pred / MiB:.0f} | {r['peak_rss'] / MiB:.0f} | "
                  f"{(growth - e['peak']) / e['peak'] * 100:+.1f}% | {sorted(r['step_s'])[len(r['step_s']) // 2]:.1f} | "
                  f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

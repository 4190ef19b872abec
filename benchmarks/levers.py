"""Micro-benchmarks of the issue-13 levers, one training-step piece at a time (CPU time per
call, 1 thread, interleaved rounds, median):

* ``qkv``: q, k, v as three ``F.linear`` vs one fused [d + 2·kv, d] projection split in three
  (forward + backward with fixed upstream gradients);
* ``ffn``: SwiGLU's gate and up projections (w1, w3) as two matmuls vs one fused [2·f, d];
* ``ce``: LM head + cross-entropy, unfused (``F.cross_entropy(F.linear(h, w).float(), t)``)
  vs ``keel.model.model.linear_cross_entropy`` (chunks of 256 rows).

On CUDA (``--device cuda``, also run by ``gpu_check.py``) the pieces run under bf16 autocast
and are timed by wall clock between ``torch.cuda.synchronize()`` calls.

    python benchmarks/levers.py --widths 128,256,512 --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from keel.model.model import linear_cross_entropy


def time_levers(fns: dict, rounds: int, device: torch.device) -> dict[str, float]:
    """Median ms per call of each function in ``fns``, interleaved rounds (order rotating):
    process CPU time on CPU; on CUDA wall time between synchronisations, under bf16 autocast."""
    cuda = device.type == "cuda"
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    clock = time.perf_counter if cuda else time.process_time
    out = {k: [] for k in fns}
    with amp:
        for f in fns.values():
            f()
        for r in range(rounds):
            order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
            for k in order:
                if cuda:
                    torch.cuda.synchronize(device)
                t0 = clock()
                fns[k]()
                if cuda:
                    torch.cuda.synchronize(device)
                out[k].append(clock() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in out.items()}


def cases(d: int, tokens: int, vocab: int, device: torch.device | str = "cpu") -> dict:
    """{lever: {"separate": fn, "fused": fn}}: forward + backward of each variant at width
    ``d`` on ``tokens`` rows (vocab ``vocab`` for the loss), tensors on ``device``."""
    g = torch.Generator().manual_seed(0)
    kv, ff = d // 2, 3 * d

    def rand(*shape, scale=1.0, grad=True):
        return (torch.randn(*shape, generator=g) * scale).to(device).requires_grad_(grad)

    x = rand(tokens, d)
    wq, wk, wv = (rand(o, d) for o in (d, kv, kv))
    wqkv = torch.cat([wq, wk, wv]).detach().requires_grad_()
    w1, w3 = (rand(ff, d) for _ in range(2))
    w13 = torch.cat([w1, w3]).detach().requires_grad_()
    gq, gk, gv, gh = (rand(tokens, o, grad=False) for o in (d, kv, kv, ff))
    head = rand(vocab, d, scale=0.02)
    t = torch.randint(0, vocab, (tokens,), generator=g).to(device)

    def qkv_sep():
        torch.autograd.backward([F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)], [gq, gk, gv])

    def qkv_fused():
        torch.autograd.backward(list(F.linear(x, wqkv).split([d, kv, kv], -1)), [gq, gk, gv])

    def ffn_sep():
        (F.silu(F.linear(x, w1)) * F.linear(x, w3)).backward(gh)

    def ffn_fused():
        a, b = F.linear(x, w13).chunk(2, -1)
        (F.silu(a) * b).backward(gh)

    def ce_unfused():
        F.cross_entropy(F.linear(x, head).float(), t).backward()

    def ce_chunked():
        linear_cross_entropy(x, head, t).backward()

    return {"qkv": {"separate": qkv_sep, "fused": qkv_fused}, "ffn": {"separate": ffn_sep, "fused": ffn_fused},
            "ce": {"separate": ce_unfused, "fused": ce_chunked}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="128,256,512")
    p.add_argument("--tokens", type=int, default=2048, help="rows per call (throughput.py: 16 x 128)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    what = "CPU ms" if device.type == "cpu" else "wall ms (bf16 autocast)"
    print(f"{a.tokens} tokens, vocab {a.vocab}, {a.threads} thread(s), {device}, median {what} over "
          f"{a.rounds} rounds\n")
    print("| width | lever | separate ms | fused ms | fused / separate |")
    print("|---:|:---|---:|---:|---:|")
    for d in (int(w) for w in a.widths.split(",")):
        for lever, fns in cases(d, a.tokens, a.vocab, device).items():
            m = time_levers(fns, a.rounds, device)
            print(f"| {d} | {lever} | {m['separate']:.1f} | {m['fused']:.1f} | {m['fused'] / m['separate']:.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

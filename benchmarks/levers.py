"""Micro-benchmarks of the issue-13 levers, one training-step piece at a time (CPU time per
call, 1 thread, interleaved rounds, median):

* ``qkv``: q, k, v as three ``F.linear`` vs one fused [d + 2·kv, d] projection split in three
  (forward + backward with fixed upstream gradients);
* ``ffn``: SwiGLU's gate and up projections (w1, w3) as two matmuls vs one fused [2·f, d];
* ``ce``: LM head + cross-entropy, unfused (``F.cross_entropy(F.linear(h, w).float(), t)``)
  vs ``keel.model.model.linear_cross_entropy`` (chunks of 256 rows).

    python benchmarks/levers.py --widths 128,256,512 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from keel.model.model import linear_cross_entropy


def _time(fns: dict, rounds: int) -> dict[str, float]:
    for f in fns.values():
        f()
    out = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
        for k in order:
            t0 = time.process_time()
            fns[k]()
            out[k].append(time.process_time() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in out.items()}


def cases(d: int, tokens: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    kv, ff = d // 2, 3 * d
    x = torch.randn(tokens, d, generator=g, requires_grad=True)
    wq, wk, wv = (torch.randn(o, d, generator=g).requires_grad_() for o in (d, kv, kv))
    wqkv = torch.cat([wq, wk, wv]).detach().requires_grad_()
    w1, w3 = (torch.randn(ff, d, generator=g).requires_grad_() for _ in range(2))
    w13 = torch.cat([w1, w3]).detach().requires_grad_()
    gq, gk, gv, gh = (torch.randn(tokens, o, generator=g) for o in (d, kv, kv, ff))
    head = (torch.randn(vocab, d, generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=g)

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
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"{a.tokens} tokens, vocab {a.vocab}, {a.threads} thread(s), median CPU ms over {a.rounds} rounds\n")
    print("| width | lever | separate ms | fused ms | fused / separate |")
    print("|---:|:---|---:|---:|---:|")
    for d in (int(w) for w in a.widths.split(",")):
        for lever, fns in cases(d, a.tokens, a.vocab).items():
            m = _time(fns, a.rounds)
            print(f"| {d} | {lever} | {m['separate']:.1f} | {m['fused']:.1f} | {m['fused'] / m['separate']:.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bytes autograd keeps from the forward pass for the backward, per residual scheme: the
unique storages packed by ``torch.autograd.graph.saved_tensors_hooks`` during one forward
pass with the loss (parameters excluded), in MiB, at ``throughput.py``'s default shapes.

    python benchmarks/saved_activations.py --schemes pre_ln,keel,post_ln
    python benchmarks/saved_activations.py --shapes 256x16 --overhead \
        --schemes pre_ln,peri_ln,hyper_connections,mhc,attn_res     # overhead vs the first scheme
"""

from __future__ import annotations

import argparse
import sys

import torch

from keel import ModelConfig, Transformer


def saved_mib(cfg: ModelConfig, batch: int, seq: int) -> float:
    """MiB of distinct non-parameter storages saved for backward by ``model(ids, ids)``."""
    return saved_and_params(cfg, batch, seq)[0]


def saved_and_params(cfg: ModelConfig, batch: int, seq: int) -> tuple[float, int]:
    """(:func:`saved_mib`, the model's parameter count)."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, ids)
    return sum(seen.values()) / 2**20, model.num_params()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="128x4,256x4,128x16,256x16", help="WIDTHxBLOCKS, comma-separated")
    p.add_argument("--schemes", default="pre_ln,keel")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--overhead", action="store_true",
                   help="one row per scheme: parameters and saved activations, and their ratio to the first scheme")
    a = p.parse_args(argv)
    schemes = a.schemes.split(",")
    if not a.overhead:
        print("| shape | " + " | ".join(f"{s} MiB" for s in schemes) + " | B·T·d fp32 MiB |")
        print("|:---|" + "---:|" * (len(schemes) + 1))
    for item in a.shapes.split(","):
        d, blocks = (int(v) for v in item.split("x"))
        res = [saved_and_params(ModelConfig(vocab_size=a.vocab, d_model=d, n_layers=blocks, n_heads=d // 32,
                                            n_kv_heads=d // 64, d_ff=3 * d, max_seq_len=a.seq_len, residual=s),
                                a.batch, a.seq_len) for s in schemes]
        unit = a.batch * a.seq_len * d * 4 / 2**20
        if not a.overhead:
            print(f"| {item} | " + " | ".join(f"{m:.1f}" for m, _ in res) + f" | {unit:.1f} |", flush=True)
            continue
        print(f"\n{item} (batch {a.batch}, seq {a.seq_len}, vocab {a.vocab}; B·T·d fp32 = {unit:.1f} MiB)\n")
        print(f"| scheme | parameters | vs {schemes[0]} | saved activations MiB | vs {schemes[0]} |")
        print("|:---|---:|---:|---:|---:|")
        (m0, n0) = res[0]
        for s, (m, n) in zip(schemes, res):
            print(f"| {s} | {n:,} | {n / n0 - 1:+.3%} | {m:.1f} | {m / m0:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

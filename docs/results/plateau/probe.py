"""Why Pre-LN at init N(0, 0.02^2) sits on the unigram plateau longer than Keel, measured.

For each scheme x depth x embedding init std, train the 65k-token setting of
docs/results/lr-sensitivity-cpu.md (width 64, BPE 512, 8 x 64 tokens x grad_accum 2 per
step, 64 steps, LR 1e-2, 6 warm-up steps) and record at every step, on one fixed
validation batch: the RMS of the token embeddings, the RMS of the residual stream after
block 0 and at the last block's output, and how much of the stream is position-independent
(the RMS of its mean over positions and sequences). Writes probe.json and prints a table.

    .venv/bin/python docs/results/plateau/probe.py --data data/python-stdlib-bpe512-18aaa0ba --out docs/results/plateau
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from keel.config import load_config, resolve_config_path
from keel.data.stats import dataset_unigram_entropy
from keel.experiments.study import plateau_exit_step
from keel.train import Callback, train
from keel.train.metrics import read_metrics


def rms(x: torch.Tensor) -> float:
    return x.float().pow(2).mean().sqrt().item()


class StreamProbe(Callback):
    """Residual-stream statistics on a fixed batch after every optimiser step."""

    def __init__(self, ids: torch.Tensor):
        self.ids, self.rows = ids, []

    def on_step_end(self, state):
        model = state.model
        seen = {}
        hooks = [model.blocks[0].register_forward_hook(lambda m, i, o: seen.__setitem__("b0", o)),
                 model.blocks[-1].register_forward_hook(lambda m, i, o: seen.__setitem__("last", o))]
        with torch.no_grad():
            model(self.ids)
            emb = model.tok_emb(self.ids)
        for h in hooks:
            h.remove()
        b0 = seen["b0"]
        self.rows.append({"step": state.step, "emb_rms": rms(emb), "block0_rms": rms(b0),
                          "block0_mean_rms": rms(b0.mean(dim=(0, 1))), "last_rms": rms(seen["last"])})
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sublayers", default="16,64")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    h1 = dataset_unigram_entropy(args.data)
    results = []
    for L in [int(x) for x in args.sublayers.split(",")]:
        for std in (0.02, 1.0):
            for scheme in ("pre_ln", "keel"):
                sets = [f"data.path={args.data}", "model.vocab_size=512", "model.d_model=64", "model.n_heads=4",
                        "model.n_kv_heads=2", "model.d_ff=192", "model.max_seq_len=64", "model.init_std=0.02",
                        f"model.embed_init_std={std}", f"model.residual={scheme}", f"model.n_layers={L // 2}",
                        "train.batch_size=8", "train.seq_len=64", "train.grad_accum=2", "train.steps=64",
                        "train.warmup_steps=6", "train.lr=1e-2", "train.eval_every=64", "train.eval_tokens=8192",
                        "train.checkpoint_every=1000", "train.sample_tokens=0", "train.progress=false"]
                cfg = load_config(resolve_config_path("demo"), sets)
                g = torch.Generator().manual_seed(0)
                probe = StreamProbe(torch.randint(0, 512, (4, 64), generator=g))
                run_dir = out / "runs" / f"{scheme}-L{L}-emb{std:g}"
                res = train(cfg, run_dir, callbacks=[probe], restart=True)
                recs = read_metrics(run_dir / "metrics.jsonl")
                results.append({"scheme": scheme, "sublayers": L, "embed_init_std": std,
                                "final_val_loss": res.val_loss,
                                "plateau_exit_step": plateau_exit_step(recs, 0.95 * h1), "stream": probe.rows})
                r = results[-1]
                at = {row["step"]: row for row in probe.rows}
                print(f"{scheme:7s} L{L:<3d} emb {std:<4g} final val {r['final_val_loss']:.3f} plateau exit "
                      f"{r['plateau_exit_step']}  step 30: emb rms {at[30]['emb_rms']:.3f} block0 rms "
                      f"{at[30]['block0_rms']:.2f} (mean part {at[30]['block0_mean_rms']:.2f})", flush=True)
    (out / "probe.json").write_text(json.dumps({"unigram_entropy": h1, "results": results}, indent=1,
                                               default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))


if __name__ == "__main__":
    main()

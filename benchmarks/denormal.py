"""Training-step time with and without flushing subnormal floats (``train.flush_denormal``).

x86 CPUs compute with subnormal floats (|x| < 1.18e-38 in float32) on a slow microcode
path. A deep Post-LN that stagnates ends up with thousands of subnormal gradient entries,
and its steps slow down by about an order of magnitude: in the study of issue 16, Post-LN
at 64 sub-layers and LR 3e-2 trained at 150-420 tokens/s where the other runs made
1,500-3,200. keel's trainer therefore turns on ``torch.set_flush_denormal`` on the CPU
(:func:`keel.train.device.flushing_denormals`, key ``train.flush_denormal``, default on).

For each case this times one forward + backward of the same model on the same batch, with
flushing off and on, interleaved (``--rounds`` rounds of ``--steps`` steps each, the order
swapped every round, after one untimed step of each), and reports the median seconds per
step (wall and process CPU time), their ratio (off / on: > 1 = flushing is faster), the
number of subnormal gradient entries with flushing off, and the largest |difference| of
the gradients between the two modes (0 when nothing underflows: flushing changes no
normal value).

Cases:

* ``healthy``: a freshly initialised model of the study's shape (width 64, 64 sub-layers,
  Post-LN, vocab 512, batch 8 x 128): nothing underflows, so the ratio should be ~1.
* ``underflow``: the same model with the loss multiplied by ``--loss-scale`` (1e-36) before
  backward, so the gradients are subnormal: a synthetic stand-in for a stagnated run.
* ``run:DIR`` (with ``--run DIR``, repeatable): the latest checkpoint of a real run folder,
  e.g. ``runs/study-claims-cpu/lr-grid/L64_seed1_post_ln_lr0.03`` (the stagnating run).

Example::

    python benchmarks/denormal.py --threads 1 --run runs/study-claims-cpu/lr-grid/L64_seed1_post_ln_lr0.03
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from keel.config import load_config
from keel.model import Transformer
from keel.train.checkpoint import CheckpointManager

SHAPE = {"model.d_model": 64, "model.n_layers": 32, "model.n_heads": 4, "model.n_kv_heads": 2,
         "model.d_ff": 192, "model.vocab_size": 512, "model.max_seq_len": 128, "model.residual": "post_ln"}


def fresh_model(seed: int = 0) -> Transformer:
    """The study's 64-sub-layer Post-LN at init (``configs/demo.toml`` with :data:`SHAPE`)."""
    torch.manual_seed(seed)
    demo = Path(__file__).resolve().parents[1] / "keel" / "configs" / "demo.toml"
    return Transformer(load_config(demo, [f"{k}={v!r}".replace("'", '"') for k, v in SHAPE.items()]).model)


def run_model(run_dir: Path) -> Transformer:
    """The model of ``run_dir/config.toml`` with the weights of its latest checkpoint."""
    model = Transformer(load_config(run_dir / "config.toml").model)
    ckpt = CheckpointManager(run_dir).latest()
    if ckpt is None:
        raise SystemExit(f"denormal.py: {run_dir} has no checkpoint")
    CheckpointManager.load_weights(model, ckpt)
    return model


def step(model: Transformer, ids: torch.Tensor, scale: float) -> None:
    """One forward + backward on ``ids`` [B, T + 1] (int64), the loss multiplied by ``scale``."""
    model.zero_grad(set_to_none=True)
    loss = model(ids[:, :-1], ids[:, 1:])
    (loss * scale).backward()


def grads(model: Transformer) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def measure(model: Transformer, ids: torch.Tensor, scale: float, rounds: int, steps: int) -> dict:
    """Median wall and CPU seconds per step with flushing off and on, interleaved."""
    out = {}
    for flush in (False, True):
        torch.set_flush_denormal(flush)
        step(model, ids, scale)
        out[flush] = {"grads": grads(model), "wall": [], "cpu": []}
    torch.set_flush_denormal(False)  # with it on, comparisons would read subnormals as 0 too
    tiny = torch.finfo(torch.float32).tiny
    subnormal = sum(int(((g.abs() < tiny) & (g != 0)).sum()) for g in out[False]["grads"])
    diff = max(float((a - b).abs().max()) for a, b in zip(out[False]["grads"], out[True]["grads"]))
    for r in range(rounds):
        for flush in ((False, True) if r % 2 == 0 else (True, False)):
            torch.set_flush_denormal(flush)
            w, c = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step(model, ids, scale)
            out[flush]["wall"].append((time.perf_counter() - w) / steps)
            out[flush]["cpu"].append((time.process_time() - c) / steps)
    torch.set_flush_denormal(False)
    med = {f: {k: statistics.median(out[f][k]) for k in ("wall", "cpu")} for f in out}
    return {"subnormal_grads": subnormal, "max_grad_diff": diff, "off": med[False], "on": med[True]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", default=[], type=Path, help="a run folder to measure too")
    ap.add_argument("--loss-scale", type=float, default=1e-36, help="loss multiplier of the underflow case")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not torch.set_flush_denormal(False):
        raise SystemExit("denormal.py: this CPU cannot flush subnormals (no FTZ/DAZ)")
    ids = torch.randint(0, 512, (8, 129), generator=torch.Generator().manual_seed(0))
    cases = [("healthy", fresh_model(), 1.0), ("underflow", fresh_model(), args.loss_scale)]
    cases += [(f"run:{d}", run_model(d), 1.0) for d in args.run]
    print(f"threads {args.threads}, batch 8 x 128, median of {args.rounds} rounds x {args.steps} steps\n")
    print("| case | subnormal grads (off) | max grad diff | off s/step | on s/step | ratio wall | ratio CPU |")
    print("|---|---|---|---|---|---|---|")
    for name, model, scale in cases:
        m = measure(model, ids, scale, args.rounds, args.steps)
        print(f"| {name} | {m['subnormal_grads']:,} | {m['max_grad_diff']:.3g} | {m['off']['wall']:.3f} | "
              f"{m['on']['wall']:.3f} | {m['off']['wall'] / m['on']['wall']:.2f} | "
              f"{m['off']['cpu'] / m['on']['cpu']:.2f} |")


if __name__ == "__main__":
    main()

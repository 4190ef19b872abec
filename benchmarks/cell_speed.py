"""The study's reference cell, eager against ``train.compile``, side by side, start-up and compile included.

The cell is a run of the shipped study (``keel/configs/studies/claims.toml``) at one scale and
group, at the group's deepest depth: by default scale ``cpu``, group ``transfer``, 256 sub-layers
(128 blocks) at width 64 (4 heads of 16, 2 KV heads, d_ff 192, vocab 512), 8 x 128 tokens per step,
1,000 steps, a validation pass of 16,384 tokens every 125 steps (and at step 0). Its config is
built exactly as the study builds it (the study's base preset, the scale's keys, the group's keys,
then ``model.residual`` and ``model.n_layers``), so a change to the study file changes the cell.

Paths (each a model of its own with the same weights, in one process):

* ``eager``: the default path (``train.compile = false``), today's arithmetic: the reference;
* ``compiled``: ``train.compile = true`` (:func:`keel.train.parallelize.apply_compile`: each block
  ``torch.compile``-d, ``fullgraph=True``, inductor's C++ backend on CPU). Not bit-identical to
  eager (the compiler fuses and reorders float operations; the first loss differs by ~1e-7):
  ``train.compile`` is a key of the run's config, so a study folder started eager refuses it.

Per path it times: start-up (building the model and AdamW, ``keel.train.optim.build_optimizer``),
the first training step and the first validation pass less a steady one (the compile time: the
training graph and the no-grad graph; 0 for eager), and the steady training step (forward, the
chunked loss, backward, ``clip_grad_norm_`` at ``train.grad_clip``, AdamW) and validation pass in
interleaved rounds, the paths' order alternating, median round; wall and process CPU time.
Inductor compiles its C++ from this process (``compile_threads = 1``, as a one-thread grid worker
would want), and CPU time counts this process and its finished children (the C++ compiler), so the
compile's CPU time is counted. ``--cold`` turns inductor's caches off for the
first compile (``force_disable_caches``: what the first run of a grid pays); a warm compile is then
timed after ``torch._dynamo.reset()`` with the caches on (later runs of a grid of the same shapes:
inductor keeps its compiled graphs on disk across processes). ``--profile`` adds, per path, the
share of the step that the matrix products and the attention kernel take (``torch.profiler``, op
self time): what no path can remove without fewer FLOPs, so the bound on any speed-up.

The projected run: ``start-up + compile + steps x step + passes x validation pass``, and its
tokens/s; the ratios divide each path's projected run time into eager's (> 1 = faster). The load
average (``os.getloadavg``) is printed with every round: on a shared machine, read the CPU-time
columns (1 thread: time actually on the core).

    python benchmarks/cell_speed.py --threads 1 --schemes pre_ln,keel --rounds 5 --cold
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

PATHS = ("eager", "compiled")


def cell_config(study_name: str, scale: str, group: str, scheme: str, sublayers: int | None):
    """The run config of ``scheme`` in ``group`` of ``study_name`` at ``scale`` (deepest depth unless given)."""
    from keel.config import load_config, resolve_config_path
    from keel.experiments.study.spec import read_study

    study = read_study(study_name, scale)
    g = next((g for g in study.groups if g.name == group), None)
    if g is None:
        raise SystemExit(f"study {study_name} at scale {scale} has no group {group!r}")
    L = sublayers or max(g.sublayers)
    return load_config(resolve_config_path(study.base),
                       study.all_sets(g) + [("model.residual", scheme), ("model.n_layers", L // 2), ("train.lr", 1e-3)])


class Path_:
    """One path's model, AdamW and steps (its start-up time measured at construction)."""

    def __init__(self, cfg, compiled: bool, seed: int):
        from keel import Transformer
        from keel.train.optim import build_optimizer
        from keel.train.parallelize import apply_compile

        t0 = time.perf_counter()
        torch.manual_seed(seed)
        self.model = Transformer(cfg.model).train()
        if compiled:
            apply_compile(self.model)
        self.opt = build_optimizer(self.model, cfg.train)
        self.startup_s = time.perf_counter() - t0
        self.clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")

    def step(self, ids, tgt) -> float:
        loss = self.model(ids, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    @torch.no_grad()
    def validate(self, batches) -> float:
        self.model.eval()
        try:
            return sum(float(self.model(ids, tgt)) for ids, tgt in batches) / len(batches)
        finally:
            self.model.train()


# the kernels whose time is the model's FLOPs: matrix products and the attention kernel (forward, backward)
FLOOR_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def floor_share(path: Path_, batch) -> float:
    """The share of one profiled training step's op self time (``torch.profiler``) spent in :data:`FLOOR_OPS`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        path.step(*batch)
    ev = prof.key_averages()
    return sum(e.self_cpu_time_total for e in ev if e.key in FLOOR_OPS) / sum(e.self_cpu_time_total for e in ev)


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (inductor's C++ compiler runs as one)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _timed(fn) -> tuple[float, float]:
    """(wall s, CPU s) of ``fn()``."""
    w, c = time.perf_counter(), _cpu_s()
    fn()
    return time.perf_counter() - w, _cpu_s() - c


def bench_scheme(scheme: str, args) -> dict:
    """Both paths of one scheme: start-up, compile, interleaved steady rounds, the projection."""
    from keel.train.nll import eval_batch_size

    cfg = cell_config(args.study, args.scale, args.group, scheme, args.sublayers)
    tc, mc = cfg.train, cfg.model
    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = lambda n: torch.randint(0, mc.vocab_size, (n, tc.seq_len + 1), generator=g)  # noqa: E731
    train_batches = [(b[:, :-1], b[:, 1:]) for b in (tokens(tc.batch_size) for _ in range(2))]
    ebs = eval_batch_size(tc.batch_size, tc.seq_len, tc.eval_batch_tokens)
    passes = -(-tc.eval_tokens // (ebs * tc.seq_len))
    val = [(b[:, :-1], b[:, 1:]) for b in (tokens(ebs) for _ in range(passes))]
    steps = args.steps or tc.steps
    n_evals = steps // tc.eval_every + 1 if tc.eval_every else 1
    out = {"scheme": scheme, "sublayers": 2 * mc.n_layers, "d_model": mc.d_model, "tokens_per_step":
           tc.batch_size * tc.seq_len, "steps": steps, "evals": n_evals, "val_passes": passes, "paths": {}}
    if tc.flush_denormal:
        torch.set_flush_denormal(True)
    torch._inductor.config.compile_threads = 1  # C++ compiled in this process: its CPU time is counted
    torch._inductor.config.force_disable_caches = args.cold
    paths = {p: Path_(cfg, p == "compiled", args.seed) for p in PATHS}
    for p, path in paths.items():  # first step and first validation: the compile (and warm-up) cost
        first = _timed(lambda: path.step(*train_batches[0]))
        first_val = _timed(lambda: path.validate(val))
        out["paths"][p] = {"startup_s": path.startup_s, "first_step": first, "first_val": first_val, "rounds": []}
    for r in range(args.rounds):
        order = PATHS if r % 2 == 0 else PATHS[::-1]
        for p in order:
            path = paths[p]
            st = [_timed(lambda i=i: path.step(*train_batches[i % 2])) for i in range(args.chunk)]
            v = _timed(lambda: path.validate(val))
            out["paths"][p]["rounds"].append({"step_wall": sum(s[0] for s in st) / args.chunk,
                                              "step_cpu": sum(s[1] for s in st) / args.chunk,
                                              "val_wall": v[0], "val_cpu": v[1], "load": os.getloadavg()[0]})
        print(f"  {scheme} round {r + 1}/{args.rounds}: " + ", ".join(
            f"{p} {out['paths'][p]['rounds'][-1]['step_cpu']:.3f} s/step CPU" for p in PATHS)
            + f" (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
    if args.profile:
        for p, path in paths.items():
            out["paths"][p]["floor_share"] = floor_share(path, train_batches[0])
    if args.cold:  # the warm compile: later runs of the grid read inductor's caches
        torch._inductor.config.force_disable_caches = False
        for _ in range(2):  # the first fills the caches (the cold compile above wrote nothing), the second reads them
            torch._dynamo.reset()
            warm = Path_(cfg, True, args.seed)
            out["paths"]["compiled"]["warm_first_step"] = _timed(lambda: warm.step(*train_batches[0]))
            out["paths"]["compiled"]["warm_first_val"] = _timed(lambda: warm.validate(val))
        del warm
    for p in PATHS:
        project(out, p)
    return out


def project(out: dict, p: str) -> None:
    """Medians and the projected run of path ``p`` (in place), wall and CPU time."""
    d = out["paths"][p]
    for k in ("step_wall", "step_cpu", "val_wall", "val_cpu"):
        d[k] = statistics.median(r[k] for r in d["rounds"])
    d["load"] = statistics.median(r["load"] for r in d["rounds"])
    for i, kind in enumerate(("wall", "cpu")):
        compile_s = max(0.0, d["first_step"][i] - d[f"step_{kind}"]) + max(0.0, d["first_val"][i] - d[f"val_{kind}"])
        d[f"compile_{kind}"] = compile_s
        if "warm_first_step" in d:
            d[f"warm_compile_{kind}"] = (max(0.0, d["warm_first_step"][i] - d[f"step_{kind}"])
                                         + max(0.0, d["warm_first_val"][i] - d[f"val_{kind}"]))
        run = d["startup_s"] + compile_s + out["steps"] * d[f"step_{kind}"] + out["evals"] * d[f"val_{kind}"]
        d[f"run_{kind}"] = run
        d[f"tokens_per_s_{kind}"] = out["steps"] * out["tokens_per_step"] / run


def markdown(results: list[dict]) -> str:
    """The table: per scheme and path, steady step, compile, projected run, ratios to eager."""
    lines = ["| scheme | path | start-up s | compile s (CPU) | warm compile s (CPU) | step s (CPU) | step s (wall) | "
             "val forward s (CPU) | run s (CPU) | tokens/s (CPU) | step ÷ eager | run ÷ eager (CPU) | run ÷ eager (wall) "
             "| load | GEMM + SDPA share |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        e = res["paths"]["eager"]
        for p in PATHS:
            d = res["paths"][p]
            warm = f"{d['warm_compile_cpu']:.1f}" if "warm_compile_cpu" in d else "–"
            lines.append(f"| {res['scheme']} | {p} | {d['startup_s']:.1f} | {d['compile_cpu']:.1f} | {warm} | "
                         f"{d['step_cpu']:.3f} | {d['step_wall']:.3f} | {d['val_cpu'] / res['val_passes']:.3f} | "
                         f"{d['run_cpu']:,.0f} | {d['tokens_per_s_cpu']:,.0f} | {e['step_cpu'] / d['step_cpu']:.2f} | "
                         f"{e['run_cpu'] / d['run_cpu']:.2f} | {e['run_wall'] / d['run_wall']:.2f} | {d['load']:.2f} | "
                         + (f"{d['floor_share']:.0%} |" if "floor_share" in d else "– |"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", default="claims")
    p.add_argument("--scale", default="cpu")
    p.add_argument("--group", default="transfer")
    p.add_argument("--sublayers", type=int, default=0, help="depth (default: the group's deepest)")
    p.add_argument("--schemes", default="pre_ln,keel")
    p.add_argument("--steps", type=int, default=0, help="steps of the projected run (default: the cell's train.steps)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per path")
    p.add_argument("--chunk", type=int, default=2, help="training steps per path per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cold", action="store_true", help="first compile with inductor's caches off, then a warm one")
    p.add_argument("--profile", action="store_true", help="the share of GEMM + attention kernels in each path's step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    results = [bench_scheme(s, args) for s in args.schemes.split(",")]
    load1 = os.getloadavg()
    r0 = results[0]
    print(f"cell: {args.study} / {args.scale} / {args.group}: {r0['sublayers']} sub-layers x width {r0['d_model']}, "
          f"{r0['tokens_per_step']} tokens per step, {r0['steps']} steps, {r0['evals']} validation passes of "
          f"{r0['val_passes']} forward passes; torch {torch.__version__}, {args.threads} thread(s); load average "
          f"{load0[0]:.2f} at the start, {load1[0]:.2f} at the end ({os.cpu_count()} CPUs); "
          f"{'cold' if args.cold else 'cache as found'} first compile")
    print(markdown(results))
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

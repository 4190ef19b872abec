"""Training throughput (tokens/s) and model FLOPs utilisation (MFU) of keel's residual schemes.

For every shape (depth in blocks x width) and every scheme (``keel.model.SCHEMES``) this
times full training steps -- forward, cross-entropy, backward, gradient clipping, AdamW
step (``keel.train.optim.build_optimizer``: fused on CUDA, foreach on CPU) -- on random
token ids, and reports

    MFU = (model FLOPs per token x tokens per second) / peak FLOP/s of the device.

Model FLOPs per token (:func:`flops_per_token`) follow the PaLM accounting (Chowdhery et al.
2022, "PaLM: Scaling Language Modeling with Pathways", Appendix B): ``6·N + 12·n·d·T``, with
N the parameters excluding the input embedding (the LM head is counted; a tied head is
counted once, as the embedding it is), n the number of blocks (the paper's "layers"), d the
width and T the sequence length; 6 = 2 (multiply + add) x 3 (forward, and a backward twice
as expensive), and ``12·n·d·T`` is attention's QK^T and AV matmuls, full (not causal-halved),
as in the paper. Recomputation by activation checkpointing is NOT counted (that would be
hardware FLOPs utilisation); so checkpointing lowers MFU.

Peak FLOP/s:

* CPU: measured in the same run, with the same thread count -- the best of ``--peak-reps``
  fp32 ``torch.mm`` of two ``--peak-size`` square matrices (default 4096), 2·n^3 FLOPs each.
* CUDA: the datasheet dense bf16 peak of the device, looked up by name in :data:`keel.train.device.GPU_PEAK_TFLOPS`
  (H100 SXM / H200: 989 TFLOP/s, A100: 312), or ``--peak-tflops``.

Timing: ``--warmup`` steps first (not timed); then ``--repeats`` rounds, each running
``--steps`` steps of every scheme in turn (the order rotates by one every round); a scheme's
step time is the median over rounds of the round's mean step time. On CUDA the model is
built directly on the GPU (``with torch.device("cuda")``) in fp32 with bf16 autocast, and the
predicted memory (:func:`keel.train.parallelize.memory_estimate`) is checked against the
device's memory before anything is allocated.

CPU table of benchmarks/README.md (section "MFU")::

    python benchmarks/mfu.py --threads 1 --depths 4,8 --widths 128,256,512 --markdown

GPU, one command, a 1024-sub-layer (512-block) width-1024 Keel model (see the README)::

    python benchmarks/mfu.py --device cuda --schemes keel --depths 512 --widths 1024 \\
        --batch 2 --seq-len 2048 --checkpointing block --warmup 1 --steps 2 --repeats 1 --markdown
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

# Model FLOPs per token (PaLM App. B) and the GPU datasheet peaks: keel's own, the same functions
# the trainer's per-step MFU and the study's dry run use.
from keel.model import flops_per_token
from keel.train.device import gpu_peak_flops


def measure_cpu_peak(size: int = 4096, reps: int = 3, clock=time.perf_counter) -> float:
    """Best fp32 ``torch.mm`` throughput (FLOP/s) of two [size, size] matrices on this CPU
    with the current torch thread count; one untimed warm-up, then ``reps`` timed by ``clock``
    (wall time; ``time.process_time`` gives the rate per CPU second, which other processes
    on a shared machine barely affect with one thread)."""
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g)
    b = torch.randn(size, size, generator=g)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        torch.mm(a, b)
        best = min(best, clock() - t0)
    return 2.0 * size ** 3 / best


def build(cfg, device, checkpointing: str, k: int, compile_: bool, lr: float, compile_kwargs: dict | None = None):
    """A Transformer on ``device`` with activation checkpointing (``checkpointing``, every ``k``),
    optionally each block ``torch.compile``d (``compile_kwargs``, e.g. ``{"backend": "aot_eager"}``),
    and its optimizer (``keel.train.optim.build_optimizer``)."""
    import torch

    from keel.config import TrainConfig
    from keel.model import Transformer
    from keel.train import parallelize as par
    from keel.train.optim import build_optimizer

    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg)
    par.apply_activation_checkpointing(model, checkpointing, k)
    if compile_:
        par.apply_compile(model, **(compile_kwargs or {}))
    return model, build_optimizer(model, TrainConfig(lr=lr))


def make_step(model, opt, batch, amp, device, use_optimizer: bool):
    import torch

    from keel.train import state_dict as SD

    params = list(model.parameters())

    def step():
        with amp:
            loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        SD.clip_grad_norm_(params, 1.0)
        if use_optimizer:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return loss
    return step


def run_shape(a, depth: int, width: int, device, peak: float) -> list[dict]:
    import contextlib

    import torch

    from keel.config import ModelConfig
    from keel.model import SCHEMES
    from memory_model import memory_estimate

    schemes = [s.strip() for s in a.schemes.split(",")] if a.schemes else sorted(SCHEMES)
    heads = max(1, width // a.head_dim)
    kv = max(1, heads // 2) if heads % 2 == 0 else heads
    cfgs = {s: ModelConfig(vocab_size=a.vocab, d_model=width, n_layers=depth, n_heads=heads, n_kv_heads=kv,
                           d_ff=a.ffn_mult * width, max_seq_len=a.seq_len, residual=s) for s in schemes}
    amp = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if a.precision == "bf16"
           else contextlib.nullcontext())
    cfg = cfgs[schemes[0]]
    with torch.device("meta"):
        from keel.model import Transformer
        P = Transformer(cfg).num_params()
    est = memory_estimate(P, depth, a.batch, a.seq_len, width, cfg.d_ff, heads, kv, a.vocab, schemes[0],
                              a.checkpointing, a.checkpoint_k, fused_adamw=device.type == "cuda")
    # upper bound: every term at once (+ autocast's bf16 weight copies, 2 bytes/param)
    need = est["total"] if a.optimizer == "adamw" else est["total"] - est["optimizer"]
    if a.precision == "bf16":
        need += 2 * P
    msg = (f"{depth} blocks ({2 * depth} sub-layers) x width {width}: {P / 1e6:.1f}M parameters; predicted memory "
           f"per model <= {need / 2**30:.2f} GiB (fp32 weights, grads, AdamW, activations, bf16 weight cache)")
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
        print(f"{msg} of {have / 2**30:.1f} GiB", file=sys.stderr)
        if need > 0.95 * have:
            raise SystemExit(f"predicted {need / 2**30:.1f} GiB does not fit in {have / 2**30:.1f} GiB: "
                             "use --checkpointing block, a smaller --batch, or --optimizer none")
    else:
        print(msg, file=sys.stderr)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1), generator=g).to(device)
    results = {}
    steps = {}
    for s in schemes:  # one model at a time on CUDA (memory), all at once on CPU (interleaving)
        if device.type == "cuda" and steps:
            steps.clear()
            torch.cuda.empty_cache()
        model, opt = build(cfgs[s], device, a.checkpointing, a.checkpoint_k, a.compile, 1e-4)
        step = make_step(model, opt, batch, amp, device, a.optimizer == "adamw")
        for _ in range(a.warmup):
            step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    loss = step()
                times.append((time.perf_counter() - t0) / a.steps)
            results[s] = {"step_s": statistics.median(times), "loss": loss.item(),
                          "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30}
            del model, opt, step
        else:
            steps[s] = step
    if device.type != "cuda":
        times = {s: [] for s in schemes}
        cpu = {s: [] for s in schemes}
        order = list(schemes)
        for r in range(a.repeats):
            for s in order:
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(a.steps):
                    loss = steps[s]()
                times[s].append((time.perf_counter() - t0) / a.steps)
                cpu[s].append((time.process_time() - c0) / a.steps)
            order = order[1:] + order[:1]
        for s in schemes:
            results[s] = {"step_s": statistics.median(times[s]), "loss": loss.item(),
                          "step_cpu_s": statistics.median(cpu[s])}
    rows = []
    for s in schemes:
        fpt = flops_per_token(cfgs[s], a.seq_len)
        tok_s = a.batch * a.seq_len / results[s]["step_s"]
        rows.append({"scheme": s, "blocks": depth, "sub_layers": 2 * depth, "width": width, "batch": a.batch,
                     "seq_len": a.seq_len, "flops_per_token": fpt, "step_s": results[s]["step_s"],
                     "tokens_per_s": tok_s, "achieved_tflops": fpt * tok_s / 1e12, "mfu": fpt * tok_s / peak,
                     **{k: v for k, v in results[s].items() if k in ("peak_mem_gib", "step_cpu_s")}})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Tokens/s and MFU of keel's residual schemes.")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--schemes", default="", help="comma-separated (default: every scheme in keel.model.SCHEMES)")
    p.add_argument("--depths", default="4,8", help="blocks, comma-separated (sub-layers = 2 x blocks)")
    p.add_argument("--widths", default="128,256,512", help="d_model, comma-separated")
    p.add_argument("--head-dim", type=int, default=64, help="heads = width / head_dim; KV heads = heads / 2")
    p.add_argument("--ffn-mult", type=int, default=3, help="d_ff = ffn_mult x width (the paper's 3072 at 1024)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--precision", default=None, help="fp32 | bf16 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--checkpointing", default="none", help="activation checkpointing: none | block | every_k")
    p.add_argument("--checkpoint-k", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "none"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0 = torch's default)")
    p.add_argument("--peak-size", type=int, default=4096)
    p.add_argument("--peak-reps", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None, help="override the peak (TFLOP/s)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    import torch

    device = torch.device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.precision is None:
        a.precision = "bf16" if device.type == "cuda" else "fp32"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = a.peak_tflops * 1e12 if a.peak_tflops else gpu_peak_flops(name)
        if peak is None:
            raise SystemExit(f"unknown GPU {name!r}: pass --peak-tflops")
        peak_src = f"{name}, datasheet dense bf16" if not a.peak_tflops else f"{name}, --peak-tflops"
    else:
        name = platform.processor() or platform.machine()
        peak = a.peak_tflops * 1e12 if a.peak_tflops else measure_cpu_peak(a.peak_size, a.peak_reps)
        peak_src = (f"measured fp32 {a.peak_size}x{a.peak_size} matmul, {torch.get_num_threads()} threads"
                    if not a.peak_tflops else "--peak-tflops")
    print(f"device: {name}; peak {peak / 1e12:.4f} TFLOP/s ({peak_src}); torch {torch.__version__}; "
          f"precision {a.precision}; checkpointing {a.checkpointing}", file=sys.stderr)
    rows = []
    for depth in (int(x) for x in a.depths.split(",")):
        for width in (int(x) for x in a.widths.split(",")):
            shape_rows = run_shape(a, depth, width, device, peak)
            for r in shape_rows:
                print(json.dumps(r), file=sys.stderr)
            rows += shape_rows
    peak_cpu = None
    if device.type == "cpu":  # re-measure the peak after the run: load on a shared machine drifts
        peak_after = measure_cpu_peak(a.peak_size, a.peak_reps) if not a.peak_tflops else peak
        print(f"peak after the run: {peak_after / 1e12:.4f} TFLOP/s", file=sys.stderr)
        if not a.peak_tflops:  # per CPU second: the robust view on a shared machine (1 thread)
            peak_cpu = measure_cpu_peak(a.peak_size, a.peak_reps, clock=time.process_time)
            print(f"peak per CPU second: {peak_cpu / 1e12:.4f} TFLOP/s", file=sys.stderr)
            for r in rows:
                r["mfu_cpu"] = r["flops_per_token"] * r["batch"] * r["seq_len"] / r["step_cpu_s"] / peak_cpu
    else:
        peak_after = peak
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "device": name, "peak_flops": peak, "peak_flops_after": peak_after,
                       "peak_flops_per_cpu_s": peak_cpu,
                       "rows": rows}, f, indent=1)
    if a.markdown:
        print(f"Peak: {peak / 1e12:.4f} TFLOP/s ({peak_src}); after the run {peak_after / 1e12:.4f}. "
              f"Batch {a.batch} x {a.seq_len} tokens, {a.precision}, checkpointing {a.checkpointing}."
              + (f" Peak per CPU second (process time): {peak_cpu / 1e12:.4f} TFLOP/s." if peak_cpu else "") + "\n")
        print("| scheme | blocks (sub-layers) | width | params (non-emb.) | GFLOP/token | step (s) | tokens/s | "
              "achieved TFLOP/s | MFU | MFU (CPU time) | step vs pre_ln |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        by_shape = {}
        for r in rows:
            by_shape.setdefault((r["blocks"], r["width"]), {})[r["scheme"]] = r
        for r in rows:
            base = by_shape[(r["blocks"], r["width"])].get("pre_ln")
            rel = f"{(r['step_s'] / base['step_s'] - 1) * 100:+.1f}%" if base else "-"
            n_params = (r["flops_per_token"] - 12 * r["blocks"] * r["width"] * r["seq_len"]) / 6
            print(f"| {r['scheme']} | {r['blocks']} ({r['sub_layers']}) | {r['width']} | {n_params / 1e6:.2f}M | "
                  f"{r['flops_per_token'] / 1e9:.4f} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                  f"{r['achieved_tflops']:.4f} | {r['mfu'] * 100:.1f}% | "
                  f"{'-' if 'mfu_cpu' not in r else format(r['mfu_cpu'] * 100, '.1f') + '%'} | {rel} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

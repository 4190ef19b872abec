"""Training throughput and peak memory of keel's residual schemes vs Hugging Face Llama.

For every shape (width d, depth = number of blocks) this builds, in one process:

* one keel ``Transformer`` per residual scheme (``keel.model.SCHEMES``), and
* a ``transformers.LlamaForCausalLM`` of identical shape (same d, d_ff, heads, KV heads,
  vocab, RMSNorm eps, RoPE theta, untied embeddings, SDPA attention, no dropout/biases),

and times one full training step on random token ids -- forward, mean cross-entropy over
all B*T positions, backward, gradient clipping (as ``keel.train.trainer`` does; turn it off
with ``--grad-clip 0``) and an AdamW step built by ``keel.train.optim.build_optimizer``
(betas 0.9/0.95, weight decay on parameters with >= 2 dims) for every model, HF included.

Fairness: all models of a shape see the same batches, dtype (fp32 on CPU, bf16 autocast on
CUDA), thread count and step function. Warm-up steps are run first and not timed. Timed
steps are interleaved: ``--repeats`` rounds, each round runs ``--steps`` steps of every
model in turn (the order rotates by one every round), and the reported step time is the
median over rounds of each round's mean step time. Our ``pre_ln`` and the HF model start
from the very same weights and their logits are compared once (``max |dlogits|``).

Peak memory is measured in a fresh ``multiprocessing`` spawn child per (shape, model), so
no other model is resident: on CPU, the growth of the process's peak resident set size
(Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` after imports and data set-up;
``ru_maxrss`` if that is not possible) over the resident size just before the model is
built, through ``--mem-steps`` training steps; on CUDA, ``torch.cuda.max_memory_allocated``.
Both are reported in MiB (2^20 bytes) and include parameters, gradients, AdamW state and
the activation peak.

Example (the README's run)::

    python benchmarks/throughput.py --shapes 128x4,256x4,128x16,256x16 --markdown --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing as mp
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HF = "hf_llama"


# ---- shapes and models -------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    d: int
    blocks: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab: int
    seq_len: int

    @property
    def label(self) -> str:
        return f"{self.d}x{self.blocks}"


def parse_shapes(text: str, args) -> list[Shape]:
    shapes = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        try:
            d, n = (int(v) for v in item.split("x"))
        except ValueError:
            raise SystemExit(f"bad shape {item!r}: expected WIDTHxBLOCKS, e.g. 256x16") from None
        if d % args.head_dim:
            raise SystemExit(f"width {d} is not a multiple of --head-dim {args.head_dim}")
        h = d // args.head_dim
        k = max(1, h // args.gqa)
        if h % k:
            raise SystemExit(f"width {d}: {h} heads not divisible into {k} KV heads (--gqa {args.gqa})")
        shapes.append(Shape(d, n, h, k, args.ffn_mult * d, args.vocab, args.seq_len))
    return shapes


def keel_config(shape: Shape, scheme: str):
    from keel import ModelConfig
    return ModelConfig(vocab_size=shape.vocab, d_model=shape.d, n_layers=shape.blocks, n_heads=shape.n_heads,
                       n_kv_heads=shape.n_kv_heads, d_ff=shape.d_ff, max_seq_len=shape.seq_len,
                       rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, residual=scheme)


def build_hf(shape: Shape) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.d, intermediate_size=shape.d_ff,
        num_hidden_layers=shape.blocks, num_attention_heads=shape.n_heads,
        num_key_value_heads=shape.n_kv_heads, head_dim=shape.d // shape.n_heads, hidden_act="silu",
        max_position_embeddings=shape.seq_len, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
        initializer_range=0.02, use_cache=False,
    )
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


def build_model(name: str, shape: Shape, device: torch.device, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if name == HF:
        model = build_hf(shape)
    else:
        from keel import Transformer
        model = Transformer(keel_config(shape, name))
    return model.to(device).train()


def copy_pre_ln_into_hf(ours: torch.nn.Module, hf: torch.nn.Module) -> None:
    """Load our pre_ln weights into the HF Llama (same tensors, different names)."""
    names = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    sub = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
           "attn.wo": "self_attn.o_proj", "ffn.w1": "mlp.gate_proj", "ffn.w3": "mlp.up_proj",
           "ffn.w2": "mlp.down_proj", "attn_residual.norm": "input_layernorm",
           "ffn_residual.norm": "post_attention_layernorm"}
    src = ours.state_dict()
    dst = hf.state_dict()
    mapped = {}
    for k, v in src.items():
        if k in names:
            mapped[names[k]] = v
            continue
        _, b, rest = k.split(".", 2)  # blocks.<b>.<rest>
        mod, leaf = rest.rsplit(".", 1)
        mapped[f"model.layers.{b}.{sub[mod]}.{leaf}"] = v
    missing = set(dst) - set(mapped)
    extra = set(mapped) - set(dst)
    if missing or extra:
        raise RuntimeError(f"pre_ln -> HF weight map mismatch: missing {sorted(missing)[:4]}, extra {sorted(extra)[:4]}")
    hf.load_state_dict(mapped, strict=True)


def loss_fn(name: str):
    if name == HF:
        def f(model, ids, tgt):
            logits = model(input_ids=ids, use_cache=False).logits.float()
            return F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.reshape(-1))
    else:
        def f(model, ids, tgt):
            return model(ids, tgt)
    return f


def amp_context(device: torch.device):
    if device.type == "cuda":
        return lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


class Runner:
    """One model + its optimizer + its step function."""

    def __init__(self, name: str, shape: Shape, device: torch.device, seed: int, grad_clip: float):
        from keel.config import TrainConfig
        from keel.train.optim import build_optimizer
        self.name = name
        self.model = build_model(name, shape, device, seed)
        self.opt = build_optimizer(self.model, TrainConfig())
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.n_params = sum(p.numel() for p in self.params)
        self.loss_fn = loss_fn(name)
        self.amp = amp_context(device)
        self.grad_clip = grad_clip
        self.last_loss = float("nan")

    def step(self, ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        with self.amp():
            loss = self.loss_fn(self.model, ids, tgt)
        loss.backward()
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def make_batches(shape: Shape, batch_size: int, n: int, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, shape.vocab, (batch_size, shape.seq_len + 1), generator=g)
        out.append((ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class LoadProbe:
    """CPU time used by *other* processes during a timed chunk (Linux /proc; else unknown).

    ``busy(all CPUs, /proc/stat) - busy(this process, /proc/self/stat)`` over the chunk, in
    cores (1.0 = one core fully used by something else). Shared machines make the timings
    bimodal (a second job on 2 cores can slow a step 5-10x), so such chunks are flagged.
    """

    HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @staticmethod
    def _ticks() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as fh:
                f = [int(v) for v in fh.readline().split()[1:]]
            busy = f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)  # user nice system irq softirq steal
            with open("/proc/self/stat") as fh:
                g = fh.read().rsplit(")", 1)[1].split()
            return busy, int(g[11]) + int(g[12])  # utime + stime of all our threads
        except (OSError, ValueError, IndexError):
            return None

    def start(self) -> None:
        self.t0, self.k0 = time.perf_counter(), self._ticks()

    def stop(self) -> float | None:
        k1, dt = self._ticks(), time.perf_counter() - self.t0
        if self.k0 is None or k1 is None or dt <= 0:
            return None
        other = (k1[0] - self.k0[0]) - (k1[1] - self.k0[1])
        return max(0.0, other / self.HZ / dt)


# ---- peak memory (child process) ---------------------------------------------------------

def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _memory_child(name: str, shape: Shape, device_str: str, threads: int, batch_size: int,
                  steps: int, seed: int, grad_clip: float, queue) -> None:
    try:
        torch.set_num_threads(threads)
        device = torch.device(device_str)
        # Warm up on a tiny model of the same kind first, so that lazy imports (transformers
        # loads its modeling code on first use), kernel set-up and the like are not counted.
        tiny = Shape(8, 1, 2, 1, 8, 16, 4)
        tb = make_batches(tiny, 2, 1, device, seed)[0]
        Runner(name, tiny, device, seed, grad_clip).step(*tb)
        del tb
        batches = make_batches(shape, batch_size, 1, device, seed)
        gc.collect()
        method = "VmHWM"
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # reset the peak-RSS high-water mark (VmHWM)
        except OSError:
            method = "ru_maxrss"
        rss0 = _status_kib("VmRSS")
        if rss0 is None:
            method, rss0 = "ru_maxrss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            cuda0 = torch.cuda.memory_allocated(device)
        runner = Runner(name, shape, device, seed, grad_clip)
        for _ in range(steps):
            runner.step(*batches[0])
        sync(device)
        if method == "VmHWM":
            peak = _status_kib("VmHWM")
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        out = {"rss_peak_growth_mib": (peak - rss0) / 1024.0, "rss_method": method}
        if device.type == "cuda":
            out["cuda_peak_mib"] = (torch.cuda.max_memory_allocated(device) - cuda0) / 2**20
        queue.put(out)
    except BaseException as exc:  # report, never hang the parent
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def measure_memory(name: str, shape: Shape, args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_memory_child, args=(name, shape, args.device, args.threads, args.batch_size,
                                               args.mem_steps, args.seed, args.grad_clip, q))
    p.start()
    try:
        res = q.get(timeout=args.mem_timeout)
    except Exception:
        res = {"error": "timed out"}
    p.join(timeout=30)
    if p.is_alive():
        p.kill()
    return res


# ---- throughput ---------------------------------------------------------------------------

def _quartiles(values: list[float]) -> tuple[float, float]:
    """(first, third) quartile of ``values`` (both = the value when there is one)."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q1, q3


def bench_shape(shape: Shape, names: list[str], args, device: torch.device, log) -> dict:
    gc.collect()
    runners = {}
    for name in names:
        runners[name] = Runner(name, shape, device, args.seed, args.grad_clip)
    info = {"params": {n: r.n_params for n, r in runners.items()}}

    # Same weights in HF and pre_ln, then check they compute the same function.
    if HF in runners and "pre_ln" in runners:
        log(f"  params: pre_ln {runners['pre_ln'].n_params:,}  hf_llama {runners[HF].n_params:,}  "
            f"(equal: {runners['pre_ln'].n_params == runners[HF].n_params})")
        try:
            copy_pre_ln_into_hf(runners["pre_ln"].model, runners[HF].model)
        except (RuntimeError, KeyError, ValueError) as exc:  # e.g. keel renamed a tensor: time anyway
            log(f"  could not load pre_ln's weights into the HF model ({exc}); logits not compared")
        else:
            ids = make_batches(shape, 2, 1, device, args.seed + 7)[0][0]
            with torch.no_grad(), runners[HF].amp():
                a = runners["pre_ln"].model(ids).float()
                b = runners[HF].model(input_ids=ids, use_cache=False).logits.float()
            info["max_abs_dlogits_pre_ln_vs_hf"] = (a - b).abs().max().item()
            log(f"  max |logits(pre_ln) - logits(HF)| with the same weights: "
                f"{info['max_abs_dlogits_pre_ln_vs_hf']:.2e}")

    batches = make_batches(shape, args.batch_size, args.n_batches, device, args.seed)
    k = 0

    def next_batch():
        nonlocal k
        b = batches[k % len(batches)]
        k += 1
        return b

    # Warm-up (not timed), interleaved too.
    for _ in range(args.warmup):
        for name in names:
            runners[name].step(*next_batch())
    sync(device)

    times = {n: [] for n in names}  # per round: mean seconds per step
    cpu = {n: [] for n in names}  # per round: process CPU seconds per step (all threads)
    loads = {n: [] for n in names}  # per round: other processes' CPU use (cores) during the chunk
    losses = {n: float("nan") for n in names}
    order = list(names)
    probe = LoadProbe()
    max_rounds = max(args.repeats, args.max_rounds or 3 * args.repeats)

    def is_clean(load):
        return load is None or load <= args.max_load

    r = 0
    while r < max_rounds:
        if r >= args.repeats and all(sum(map(is_clean, loads[n])) >= args.repeats for n in names):
            break
        if r >= args.repeats and args.budget_s and time.perf_counter() - args.t_start > args.budget_s:
            log(f"  (--budget-s {args.budget_s:.0f} s spent: no more re-runs of contended rounds)")
            break
        n_clean = sum(is_clean(ld) for n in names for ld in loads[n])
        if r >= args.repeats and n_clean < 0.25 * r * len(names):
            log(f"  (only {n_clean} of {r * len(names)} timed chunks were uncontended: the machine is busy "
                f"throughout, re-runs would not help; no more rounds)")
            break
        rot = order[r % len(order):] + order[:r % len(order)]
        for name in rot:
            runner = runners[name]
            sync(device)
            probe.start()
            c0 = time.process_time()
            for _ in range(args.steps):
                loss = runner.step(*next_batch())
            sync(device)
            load = probe.stop()
            cpu[name].append((time.process_time() - c0) / args.steps)
            times[name].append((time.perf_counter() - probe.t0) / args.steps)
            loads[name].append(load)
            losses[name] = loss.item()
        r += 1
        log(f"  round {r}: " + "  ".join(
            f"{n} {1e3 * times[n][-1]:.0f}ms{'' if is_clean(loads[n][-1]) else '*'}" for n in names)
            + ("" if all(is_clean(loads[n][-1]) for n in names) else "   (* = other processes were busy)"))

    tokens = args.batch_size * shape.seq_len
    res = {}
    for name in names:
        clean = [t for t, ld in zip(times[name], loads[name]) if is_clean(ld)]
        use = clean if len(clean) >= max(1, min(3, args.repeats)) else times[name]
        cpu_use = [c for c, t_, ld in zip(cpu[name], times[name], loads[name]) if use is times[name] or is_clean(ld)]
        t = sorted(use)
        med = statistics.median(t)
        q1, _, q3 = statistics.quantiles(t, n=4) if len(t) >= 2 else (med, med, med)
        res[name] = {"step_s_all": times[name], "other_load_cores": loads[name],
                     "n_rounds": len(times[name]), "n_clean": len(clean), "n_used": len(t), "used_only_clean": use is clean,
                     "cpu_s_all": cpu[name], "cpu_s_median": statistics.median(cpu_use),
                     "step_s_median": med, "step_s_min": min(times[name]),
                     "iqr_rel": (q3 - q1) / med, "tokens_per_s": tokens / med,
                     "tokens_per_s_best": tokens / min(times[name]), "last_loss": losses[name],
                     "params": runners[name].n_params}
    # Paired ratios: speed of `name` over the reference in the same round (adjacent in time),
    # median over rounds where both were uncontended (all rounds if fewer than 3 such).
    for ref in (HF, "pre_ln"):
        if ref not in times:
            continue
        for name in names:
            pairs = [(a, b, is_clean(la) and is_clean(lb))
                     for a, b, la, lb in zip(times[ref], times[name], loads[ref], loads[name])]
            ok_rounds = [i for i, (_, _, ok) in enumerate(pairs) if ok]
            if len(ok_rounds) < max(1, min(3, args.repeats)):
                ok_rounds = list(range(len(pairs)))
            wall = [times[ref][i] / times[name][i] for i in ok_rounds]
            cpu_r = [cpu[ref][i] / cpu[name][i] for i in ok_rounds]
            res[name][f"paired_vs_{ref}"] = statistics.median(wall)
            res[name][f"paired_vs_{ref}_iqr"] = _quartiles(wall)
            res[name][f"paired_cpu_vs_{ref}"] = statistics.median(cpu_r)
            res[name][f"paired_cpu_vs_{ref}_iqr"] = _quartiles(cpu_r)
    del runners
    gc.collect()
    info["models"] = res
    return info


# ---- report -------------------------------------------------------------------------------

def fmt_ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or not b:
        return "-"
    return f"{a / b:.2f}"


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        "```",
        f"command:      {meta['command']}",
        f"torch:        {meta['torch']}   transformers: {meta['transformers']}   python: {meta['python']}",
        f"device:       {meta['device']} ({meta['device_name']}), dtype {meta['dtype']}, "
        f"torch threads {meta['threads']} (os.cpu_count {meta['cpu_count']})",
        f"per step:     batch {meta['batch_size']} x seq {meta['seq_len']} = {meta['tokens_per_step']} tokens; "
        f"fwd + CE + bwd + clip({meta['grad_clip']}) + AdamW",
        f"timing:       {meta['warmup']} warm-up steps per model, then interleaved rounds of {meta['steps']} "
        f"steps per model (order rotates each round)",
        f"              until each model has {meta['repeats']} uncontended rounds (other processes using "
        f"<= {meta['max_load']} cores; at most {meta['max_rounds']} rounds);",
        "              step time = median over its uncontended rounds; IQR = interquartile range / median;",
        "              CPU ms/step = process CPU time (all threads) per step, median over the same rounds",
        f"peak memory:  {meta['memory_method']}",
        "```",
        "",
        "| d | blocks | L | params | scheme | step ms (median) | tokens/s | IQR | clean rounds | vs HF Llama "
        "| vs our pre_ln | CPU ms/step | peak MiB |",
        "|---:|---:|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for sh in report["shapes"]:
        models = sh["models"]
        hf = models.get(HF, {}).get("tokens_per_s")
        pre = models.get("pre_ln", {}).get("tokens_per_s")
        for name, m in models.items():
            mem = m.get("peak_mib")
            lines.append(
                f"| {sh['d']} | {sh['blocks']} | {2 * sh['blocks']} | {m['params'] / 1e6:.2f}M | "
                f"{'HF Llama' if name == HF else name} | {1e3 * m['step_s_median']:.0f} | "
                f"{m['tokens_per_s']:,.0f} | {100 * m['iqr_rel']:.0f}% | {m['n_clean']}/{m['n_rounds']}{'' if m['used_only_clean'] else ' †'} | {fmt_ratio(m['tokens_per_s'], hf)} | "
                f"{fmt_ratio(m['tokens_per_s'], pre)} | {1e3 * m['cpu_s_median']:.0f} | "
                f"{'-' if mem is None else f'{mem:.0f}'} |")
    if any(not m["used_only_clean"] for sh in report["shapes"] for m in sh["models"].values()):
        lines += ["", "† too few uncontended rounds (< min(3, --repeats)): the median is over all rounds, contended ones included."]
    return "\n".join(lines) + "\n"


SPEED_FLOOR = 0.97  # keel tokens/s >= 0.97 x pre_ln's (issue 13)
MEMORY_FLOOR = 1.05  # keel peak memory <= 1.05 x pre_ln's
HF_GOAL = 1.10  # pre_ln tokens/s >= 1.10 x HF Llama's


def _ratio_cells(m: dict, name: str, ref: str) -> dict:
    """Speed of ``name`` over ``ref``: ratio of medians, paired per-round ratio (median and
    quartiles, wall and CPU time)."""
    a, b = m[name], m[ref]
    return {"median": a["tokens_per_s"] / b["tokens_per_s"],
            "paired": a.get(f"paired_vs_{ref}", float("nan")),
            "paired_iqr": a.get(f"paired_vs_{ref}_iqr", (float("nan"), float("nan"))),
            "cpu": a.get(f"paired_cpu_vs_{ref}", b["cpu_s_median"] / a["cpu_s_median"]),
            "cpu_iqr": a.get(f"paired_cpu_vs_{ref}_iqr", (float("nan"), float("nan"))),
            "best": a["tokens_per_s_best"] / b["tokens_per_s_best"]}


def floor_rows(report: dict) -> list[dict]:
    """Per shape: keel/pre_ln speed and memory (floors) and pre_ln/HF speed (goal)."""
    rows = []
    for sh in report["shapes"]:
        m = sh["models"]
        row = {"shape": f"{sh['d']}x{sh['blocks']}"}
        if "keel" in m and "pre_ln" in m:
            row["keel_speed"] = _ratio_cells(m, "keel", "pre_ln")
            mk, mp = m["keel"].get("peak_mib"), m["pre_ln"].get("peak_mib")
            row["keel_memory"] = mk / mp if mk and mp else None
        if "pre_ln" in m and HF in m:
            row["hf_speed"] = _ratio_cells(m, "pre_ln", HF)
        rows.append(row)
    return rows


def floors(report: dict) -> list[str]:
    """Verdict lines: keel >= SPEED_FLOOR x pre_ln tokens/s, keel <= MEMORY_FLOOR x pre_ln peak
    memory, pre_ln >= HF_GOAL x HF Llama tokens/s. The verdict uses the ratio of the median
    step times; the paired (adjacent-in-time) ratio, the CPU-time ratio and the best rounds
    are printed as cross-checks."""
    out = []
    for row in floor_rows(report):
        for key, label, floor in (("keel_speed", "keel / pre_ln", SPEED_FLOOR), ("hf_speed", "pre_ln / HF Llama", HF_GOAL)):
            if key in row:
                c = row[key]
                out.append(f"{row['shape']}: {label} = {c['median']:.3f} (paired {c['paired']:.3f}, best "
                           f"{c['best']:.3f}, CPU time {c['cpu']:.3f}) -> {'goal' if key == 'hf_speed' else 'floor'} "
                           f">= {floor:.2f} {'holds' if c['median'] >= floor else 'FAILS'}")
        if row.get("keel_memory") is not None:
            out.append(f"{row['shape']}: keel / pre_ln peak memory = {row['keel_memory']:.3f} -> floor <= "
                       f"{MEMORY_FLOOR:.2f} {'holds' if row['keel_memory'] <= MEMORY_FLOOR else 'FAILS'}")
    return out


def floors_markdown(report: dict) -> str:
    """The floors as a markdown table, with the spread (quartiles of the paired ratios)."""
    def cell(c, floor):
        q1, q3 = c["paired_iqr"]
        c1, c3 = c["cpu_iqr"]
        mark = "yes" if c["median"] >= floor else "**no**"
        return (f"{c['median']:.2f} | {c['paired']:.2f} [{q1:.2f}, {q3:.2f}] | "
                f"{c['cpu']:.2f} [{c1:.2f}, {c3:.2f}] | {mark}")

    lines = [(f"| shape | keel/pre_ln tokens/s | paired [IQR] | CPU time [IQR] | >= {SPEED_FLOOR} "
              f"| keel/pre_ln peak MiB | <= {MEMORY_FLOOR} | pre_ln/HF tokens/s | paired [IQR] | CPU time [IQR] "
              f"| >= {HF_GOAL} |"),
             "|:---|---:|---:|---:|:---|---:|:---|---:|---:|---:|:---|"]
    blank = "- | - | - | -"
    for row in floor_rows(report):
        mem = row.get("keel_memory")
        mem_cells = "- | -" if mem is None else f"{mem:.3f} | {'yes' if mem <= MEMORY_FLOOR else '**no**'}"
        keel = cell(row["keel_speed"], SPEED_FLOOR) if "keel_speed" in row else blank
        hf = cell(row["hf_speed"], HF_GOAL) if "hf_speed" in row else blank
        lines.append(f"| {row['shape']} | {keel} | {mem_cells} | {hf} |")
    return "\n".join(lines) + "\n"


# ---- main ---------------------------------------------------------------------------------

def add_shape_flags(p: argparse.ArgumentParser) -> None:
    """The flags shared by the benchmarks that build models with :func:`keel_config`: batch,
    sequence length (tokens), vocab, head dim, GQA ratio, FFN multiplier."""
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=32, help="n_heads = width / head_dim")
    p.add_argument("--gqa", type=int, default=2, help="query heads per KV head (n_kv_heads = n_heads / gqa)")
    p.add_argument("--ffn-mult", type=int, default=3, help="d_ff = ffn_mult * width")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default="128x4,256x4,128x16,256x16",
                   help="comma-separated WIDTHxBLOCKS (blocks = n_layers; sub-layers L = 2 * blocks)")
    add_shape_flags(p)
    p.add_argument("--schemes", default="all", help="'all' (keel.model.SCHEMES) or a comma-separated list")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers LlamaForCausalLM baseline")
    p.add_argument("--steps", type=int, default=1, help="timed steps per model per round")
    p.add_argument("--repeats", type=int, default=5, help="uncontended interleaved rounds wanted per model; the median round is reported")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model before timing")
    p.add_argument("--max-load", type=float, default=0.25,
                   help="a round is 'contended' when other processes used more than this many CPU cores "
                        "during it (Linux /proc); contended rounds are re-run and left out of the median")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="no re-runs of contended rounds once the run has taken this long (0 = no limit)")
    p.add_argument("--max-rounds", type=int, default=0,
                   help="cap on rounds including re-runs of contended ones (0 = 3 x --repeats)")
    p.add_argument("--n-batches", type=int, default=4, help="distinct random batches cycled through")
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip_grad_norm_ as keel's trainer; 0 = off")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    p.add_argument("--mem-steps", type=int, default=2, help="training steps run by each memory child")
    p.add_argument("--mem-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the full results (all round times) here")
    p.add_argument("--markdown", action="store_true", help="print the markdown table at the end")
    args = p.parse_args(argv)

    from keel.model import SCHEMES
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    schemes = list(SCHEMES) if args.schemes == "all" else [s.strip() for s in args.schemes.split(",") if s.strip()]
    for s in schemes:
        if s not in SCHEMES:
            raise SystemExit(f"unknown scheme {s!r}; keel.model.SCHEMES has {', '.join(SCHEMES)}")
    names = ([] if args.no_hf else [HF]) + schemes
    shapes = parse_shapes(args.shapes, args)
    if not args.no_hf:
        import transformers
        tf_version = transformers.__version__
    else:
        tf_version = "(not used)"

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if device.type == "cuda":
        dev_name = torch.cuda.get_device_name(device)
        mem_method = ("torch.cuda.max_memory_allocated in a fresh spawn child per (shape, model), "
                      f"through {args.mem_steps} training steps, MiB")
    else:
        dev_name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as fh:
                dev_name = next(l.split(":", 1)[1].strip() for l in fh if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
        mem_method = ("growth of peak RSS (Linux VmHWM, reset after imports and a tiny warm-up model) over RSS "
                      f"before the model is built, in a fresh spawn child per (shape, model), through "
                      f"{args.mem_steps} training steps, MiB")
    if args.no_memory:
        mem_method = "not measured (--no-memory)"
    cmd = "python " + " ".join(shlex.quote(a) for a in ([os.path.relpath(sys.argv[0])] + sys.argv[1:]))
    meta = {"command": cmd, "torch": torch.__version__, "transformers": tf_version,
            "python": platform.python_version(), "device": str(device), "device_name": dev_name,
            "dtype": "bf16 autocast (fp32 params)" if device.type == "cuda" else "fp32",
            "threads": args.threads, "cpu_count": os.cpu_count(), "batch_size": args.batch_size,
            "seq_len": args.seq_len, "tokens_per_step": args.batch_size * args.seq_len,
            "grad_clip": args.grad_clip, "warmup": args.warmup, "repeats": args.repeats, "steps": args.steps,
            "max_load": args.max_load, "max_rounds": max(args.repeats, args.max_rounds or 3 * args.repeats),
            "memory_method": mem_method, "schemes": schemes, "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    log(f"{cmd}\ntorch {torch.__version__}, transformers {tf_version}, {dev_name}, threads {args.threads}")

    report = {"meta": meta, "shapes": []}
    t_start = args.t_start = time.perf_counter()
    for shape in shapes:
        log(f"shape d={shape.d} blocks={shape.blocks} (L={2 * shape.blocks}) heads={shape.n_heads}/"
            f"{shape.n_kv_heads} d_ff={shape.d_ff} vocab={shape.vocab}")
        info = bench_shape(shape, names, args, device, log)
        if not args.no_memory:
            for name in names:
                m = measure_memory(name, shape, args)
                if "error" in m:
                    log(f"  memory {name}: {m['error']}")
                    info["models"][name]["peak_mib"] = None
                else:
                    info["models"][name]["peak_mib"] = m.get("cuda_peak_mib", m["rss_peak_growth_mib"])
                    info["models"][name]["memory"] = m
                    log(f"  memory {name}: {info['models'][name]['peak_mib']:.0f} MiB ({m['rss_method']})")
        report["shapes"].append({"d": shape.d, "blocks": shape.blocks, "n_heads": shape.n_heads,
                                 "n_kv_heads": shape.n_kv_heads, "d_ff": shape.d_ff, "vocab": shape.vocab,
                                 **info})
    meta["wall_s"] = time.perf_counter() - t_start
    report["floors"] = floors(report)

    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    for line in report["floors"]:
        log(line)
    log(f"total {meta['wall_s']:.0f} s")
    if args.markdown:
        print(markdown(report))
        print(floors_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

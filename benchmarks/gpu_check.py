"""One-command GPU check (issue 13): numerics, speed, memory and a short real training run.

Run through ``benchmarks/gpu_check.sh OUT.md`` (or ``python benchmarks/gpu_check.py --out
OUT.md``); it prints one markdown table and writes it to ``OUT.md``. Sections (rows):

1. ``bf16``: a forward pass of every scheme in ``keel.model.SCHEMES`` at the paper's shape
   (width 1024, 64 sub-layers, seq 2048) in fp32 (TF32 off) and under bf16 autocast; max
   relative logit error = max |logits_bf16 - logits_fp32| / max |logits_fp32|.
2. ``speed``: tokens/s, MFU and peak memory of one full training step (forward, chunked
   cross-entropy, backward, clipping, fused AdamW; bf16 autocast, fp32 weights) of ``pre_ln``
   and ``keel`` at width 1024 with 64 and 512 sub-layers, eager and with ``train.compile``
   (``keel.train.parallelize.apply_compile``: each block ``torch.compile``d). MFU as in
   ``benchmarks/mfu.py`` (PaLM Appendix B model FLOPs / datasheet bf16 peak). Activation
   checkpointing only where the predicted memory would not fit (column ``ckpt``).
3. ``memory``: peak ``torch.cuda.max_memory_allocated`` of ``pre_ln`` and ``keel`` at 1024
   sub-layers (width 1024, 6.5B parameters) with every block checkpointed, against
   ``keel.train.parallelize.memory_estimate``.
4. ``levers``: fused QKV, fused gate/up and the chunked loss against their unfused forms
   (``benchmarks/levers.py``, bf16 autocast, width 1024, 4096 tokens, vocab 32768): the
   fused projections lost or tied on CPU and are not in the model; this row says whether
   they would win on the GPU.
5. ``train``: ``keel prepare`` (offline: the built-in Python-stdlib corpus) and ``keel train
   --config paper-64`` for 20 steps (``train.grad_accum`` lowered to fit the time budget);
   the loss of every step is printed from the run's ``metrics.jsonl``.
6. ``compile``: zero graph breaks on the device: every scheme, with and without activation
   checkpointing, each block ``torch.compile``d with ``fullgraph=True`` (``aot_eager``, so
   the 12 compilations take seconds; the ``speed`` rows count inductor's breaks at full size),
   forward + backward under bf16 autocast; fails on a break or a non-finite gradient.
7. ``fsdp``: with 2 GPUs, ``keel train --nproc 2`` (NCCL, FSDP2, ``train.precision = "bf16"``)
   for 4 steps with sharded (DCP) checkpoints at steps 2 and 4, then the run cut back to its
   step-2 checkpoint and resumed: steps 3-4 must repeat the uninterrupted losses; skipped
   with fewer GPUs. ``--dry-run --sections fsdp`` runs it on the CPU (gloo).
8. ``hf``: every scheme as ``KeelForCausalLM`` on the device (fp32, TF32 off): greedy
   ``generate`` of a left-padded batch (prompts of 9, 5, 1 tokens) equals each prompt alone;
   ``hf-llama``: tokens/s of ``pre_ln`` and ``keel`` against ``transformers``'
   ``LlamaForCausalLM`` of the same shape (``benchmarks/throughput.py``, paired rounds, bf16
   autocast), passing at >= 0.5x the Llama's speed.
9. ``fp16`` (``train.precision = "fp16-autocast"``, for GPUs without bf16 such as V100/T4): every
   scheme at the ``bf16`` row's shape, fp16 autocast against fp32 (TF32 off): max relative logit
   error of a forward, and one training backward with keel's loss scaler
   (``keel.train.loss_scaling.LossScaling``: from 2**16, halved after an overflow as in training, at
   most 8 times): the unscaled gradients finite and their norm within 5 % of fp32's.
   ``fp16-train``: ``keel train --config paper-64`` in fp16-autocast for ``plan.fp16_steps`` steps
   (checkpoint at half), then cut back to that checkpoint and resumed: the resumed steps repeat the
   losses (CUDA: within 1 %) and the loss scales, and ``trainer.pt`` holds the scaler's state.

Every row ends with ``pass``, ``FAIL`` or ``skip`` (column ``status``): bf16 error < 0.05;
finite losses; no graph break; on the GPU a compiled speed row not slower than its eager
row (> 5 %); memory within the prediction; fp16 logit error < 0.02. The exit status is 1 when a
row failed.

Budget: under 8 minutes on one H100/H200. ``--dry-run`` runs every code path on the CPU at
tiny shapes (``torch.compile`` with Dynamo's ``eager`` backend, no C++ compiler needed);
``tests/test_gpu_check.py`` runs it, so that the first GPU run does not fail on a typo.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import levers  # (benchmarks/levers.py: fused QKV / gate-up / chunked-loss micro-benchmarks)
import mfu  # (benchmarks/mfu.py: FLOPs per token, GPU peaks, step function)


SECTIONS = ("bf16", "compile", "speed", "memory", "levers", "train", "fsdp", "hf", "fp16")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes of one check run (the GPU plan or the tiny CPU dry-run plan)."""

    width: int
    heads: int
    kv_heads: int
    d_ff: int
    vocab: int
    seq: int
    batch: int
    forward_sublayers: int
    speed_sublayers: tuple[int, ...]
    memory_sublayers: int
    warmup: int
    steps: int
    train_steps: int
    train_sets: tuple[str, ...]
    prepare_args: tuple[str, ...]
    compile_kwargs: tuple[tuple[str, str], ...] = ()
    compile_check: tuple[int, int] = (256, 64)  # width, sub-layers of the graph-break check (the bench's depth)
    compile_schemes: tuple[str, ...] = ()  # () = every scheme
    # timed (bf16 steps, MFU, peak memory) at the first of speed_sublayers beside pre_ln and keel: the bench
    bench_schemes: tuple[str, ...] = ("peri_ln", "hyper_connections", "mhc", "attn_res")
    fp16_steps: int = 8  # steps of the fp16-autocast training row (checkpointed and resumed at half)


GPU = Plan(width=1024, heads=16, kv_heads=8, d_ff=3072, vocab=32768, seq=2048, batch=2, forward_sublayers=64,
           speed_sublayers=(64, 512), memory_sublayers=1024, warmup=2, steps=3, train_steps=20,
           train_sets=("train.grad_accum=4", "train.eval_tokens=65536"),
           prepare_args=("--tokenizer", "bpe:8192", "--max-bytes", "20000000"))
DRY = Plan(width=64, heads=2, kv_heads=1, d_ff=192, vocab=256, seq=32, batch=2, forward_sublayers=4,
           speed_sublayers=(4,), memory_sublayers=8, warmup=1, steps=1, train_steps=2,
           train_sets=("model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
                       "model.d_ff=64", "model.max_seq_len=64", "model.vocab_size=512", "train.batch_size=2",
                       "train.seq_len=32", "train.grad_accum=1", "train.eval_tokens=256", "train.sample_tokens=4"),
           prepare_args=("--tokenizer", "bpe:512", "--max-bytes", "200000"),
           compile_kwargs=(("backend", "eager"),), compile_check=(64, 4), compile_schemes=("keel", "attn_res"),
           bench_schemes=("mhc",), fp16_steps=4)


def model_config(plan: Plan, scheme: str, sublayers: int):
    from keel.config import ModelConfig

    return ModelConfig(vocab_size=plan.vocab, d_model=plan.width, n_layers=sublayers // 2, n_heads=plan.heads,
                       n_kv_heads=plan.kv_heads, d_ff=plan.d_ff, max_seq_len=plan.seq, residual=scheme)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def check_bf16(plan: Plan, device: torch.device) -> list[dict]:
    """Section 1: max relative logit error of a bf16-autocast forward vs fp32, every scheme."""
    from keel.model import SCHEMES, Transformer

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # a true fp32 reference
    ids = torch.randint(0, plan.vocab, (1, plan.seq), generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for scheme in sorted(SCHEMES):
        torch.manual_seed(0)
        with torch.device(device):
            model = Transformer(model_config(plan, scheme, plan.forward_sublayers)).eval()
        with torch.no_grad():
            ref = model(ids)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(ids)
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        rows.append({"section": "bf16", "scheme": scheme, "sublayers": plan.forward_sublayers,
                     "max_rel_logit_err": err, "logit_rms": ref.pow(2).mean().sqrt().item()})
        del model, ref, out
        free(device)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return rows


MAX_FP16_BACKOFFS = 8  # overflowed backwards allowed per scheme before its fp16 row fails (S down to 2**8)


def check_fp16(plan: Plan, device: torch.device) -> list[dict]:
    """Section 9: every scheme in fp16-autocast against fp32 (TF32 off): the max relative logit error
    of a forward, and the gradient norm of one backward through keel's loss scaler (from 2**16,
    halved after each overflow as in training, at most ``MAX_FP16_BACKOFFS`` times; unscaled before
    the norm, as the trainer does) against the fp32 gradient norm."""
    from keel.model import SCHEMES, Transformer
    from keel.train.loss_scaling import LossScaling

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # a true fp32 reference
    ids = torch.randint(0, plan.vocab, (1, plan.seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    x, y = ids[:, :-1], ids[:, 1:]
    rows = []
    for scheme in sorted(SCHEMES):
        torch.manual_seed(0)
        with torch.device(device):
            model = Transformer(model_config(plan, scheme, plan.forward_sublayers))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # only for the scaler's unscale_
        norms = {}
        for fp16 in (False, True):
            scaling = LossScaling(device, "fp16-autocast" if fp16 else "fp32")
            for overflows in range(MAX_FP16_BACKOFFS + 1):  # as the trainer's scaler: halve S until finite
                with torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
                    with torch.no_grad():
                        logits = model(x)
                    loss = model(x, y)
                scaling.scale(loss).backward()
                scaling.unscale_(opt)
                norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
                scale = scaling.update(math.isfinite(norm)).get("loss_scale", 1.0)
                model.zero_grad(set_to_none=True)
                if math.isfinite(norm):
                    break
            norms[fp16] = (norm, loss.item(), logits.float(), scale, overflows)
        (ref_norm, ref_loss, ref, _, _), (norm, loss16, out, scale, overflows) = norms[False], norms[True]
        rows.append({"section": "fp16", "scheme": scheme, "sublayers": plan.forward_sublayers,
                     "max_rel_logit_err": ((out - ref).abs().max() / ref.abs().max()).item(), "grad_norm": norm,
                     "grad_norm_fp32": ref_norm, "loss": loss16, "loss_fp32": ref_loss, "scale": scale,
                     "overflows": overflows})
        del model, opt, norms, ref, out
        free(device)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return rows


def check_fp16_train(plan: Plan, work: Path) -> list[dict]:
    """Section 9, the run: ``keel train --config paper-64`` in fp16-autocast for ``plan.fp16_steps``
    steps with a checkpoint at half, then a copy cut back to that checkpoint and resumed."""
    import shutil

    env, half = _env(), plan.fp16_steps // 2
    data = _prepare(plan, work, env)
    sets = [f"data.path={data}", f"train.steps={plan.fp16_steps}", f"train.checkpoint_every={half}",
            f"train.eval_every={half}", "train.keep_checkpoints=0", "train.precision=fp16-autocast",
            "train.log_every=1", "train.progress=false", *plan.train_sets]
    args = [a for s in sets for a in ("--set", s)]
    full, cut = work / "fp16_full", work / "fp16_cut"
    t0 = time.perf_counter()
    _keel(["train", "--config", "paper-64", "--run-dir", str(full), *args], env, plan is DRY)
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / f"step_{plan.fp16_steps:08d}")
    (cut / "checkpoints" / "latest").write_text(f"step_{half:08d}\n")
    _keel(["train", "--resume", str(cut), *args], env, plan is DRY)

    def steps(run):
        recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        return {r["step"]: r for r in recs if "loss" in r}

    a, b = steps(full), steps(cut)
    state = torch.load(full / "checkpoints" / f"step_{half:08d}" / "trainer.pt", map_location="cpu", weights_only=True)
    rtol = 1e-6 if plan is DRY else 1e-2  # the CPU repeats itself exactly; CUDA's atomics need not
    later = range(half + 1, plan.fp16_steps + 1)
    same = all(abs(a[k]["loss"] - b[k]["loss"]) <= rtol * abs(a[k]["loss"]) and
               a[k]["loss_scale"] == b[k]["loss_scale"] for k in later)
    return [{"section": "fp16-train", "scheme": "keel (paper-64)", "losses": [(k, a[k]["loss"]) for k in sorted(a)],
             "resumed": [(k, b[k]["loss"]) for k in later], "scale": a[plan.fp16_steps]["loss_scale"],
             "skipped_steps": a[plan.fp16_steps]["skipped_steps"], "scaler_state": "grad_scaler" in state, "same": same,
             "train_s": time.perf_counter() - t0}]


def fits(plan: Plan, cfg, checkpointing: str, device: torch.device, share: float) -> tuple[bool, float]:
    """Whether the predicted training memory (+ bf16 weight copies) fits in ``share`` of the
    device's memory (always True on CPU), and the prediction in GiB."""
    from keel.model import Transformer
    from memory_model import memory_estimate

    with torch.device("meta"):
        n = Transformer(cfg).num_params()
    est = memory_estimate(n, cfg.n_layers, plan.batch, plan.seq, cfg.d_model, cfg.d_ff, cfg.n_heads,
                              cfg.n_kv_heads, cfg.vocab_size, cfg.residual, checkpointing, fused_adamw=True)
    need = est["peak"] + 2 * n
    if device.type != "cuda":
        return True, need / 2**30
    return need <= share * torch.cuda.get_device_properties(device).total_memory, need / 2**30


def time_steps(plan: Plan, cfg, device: torch.device, checkpointing: str, compiled: bool) -> dict:
    """Build, warm up and time ``plan.steps`` training steps; tokens/s, loss, peak memory."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, opt = mfu.build(cfg, device, checkpointing, 2, compiled, 1e-4, dict(plan.compile_kwargs))
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, plan.vocab, (plan.batch, plan.seq + 1), generator=g).to(device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    step = mfu.make_step(model, opt, batch, amp, device, True)
    t0 = time.perf_counter()
    for _ in range(plan.warmup):
        step()
    warm_s = time.perf_counter() - t0
    free(device)
    t0 = time.perf_counter()
    for _ in range(plan.steps):
        loss = step()
    step_s = (time.perf_counter() - t0) / plan.steps
    out = {"step_s": step_s, "tokens_per_s": plan.batch * plan.seq / step_s, "loss": loss.item(),
           "warmup_s": warm_s, "peak_gib": peak_gib(device), "graph_breaks": sum(counters["graph_break"].values())}
    del model, opt, step
    free(device)
    return out


def check_speed(plan: Plan, device: torch.device, peak_flops: float) -> list[dict]:
    """Section 2: tokens/s and MFU of pre_ln and keel, eager and compiled, at every depth of the plan;
    the bench's schemes (``plan.bench_schemes``) beside them at the first depth."""
    rows = []
    for i, sublayers in enumerate(plan.speed_sublayers):
        for scheme in ("pre_ln", "keel") + (plan.bench_schemes if i == 0 else ()):
            cfg = model_config(plan, scheme, sublayers)
            ok, _ = fits(plan, cfg, "none", device, 0.85)
            ckpt = "none" if ok else "block"
            for compiled in (False, True):
                r = time_steps(plan, cfg, device, ckpt, compiled)
                fpt = mfu.flops_per_token(cfg, plan.seq)
                rows.append({"section": "speed", "scheme": scheme, "sublayers": sublayers, "compile": compiled,
                             "ckpt": ckpt, "mfu": fpt * r["tokens_per_s"] / peak_flops, **r})
    return rows


def check_memory(plan: Plan, device: torch.device) -> list[dict]:
    """Section 3: peak memory at ``plan.memory_sublayers`` sub-layers, every block checkpointed."""
    rows = []
    for scheme in ("pre_ln", "keel"):
        cfg = model_config(plan, scheme, plan.memory_sublayers)
        ok, predicted = fits(plan, cfg, "block", device, 0.95)
        row = {"section": "memory", "scheme": scheme, "sublayers": plan.memory_sublayers, "ckpt": "block",
               "predicted_gib": predicted}
        if not ok:
            row["skipped"] = f"predicted {predicted:.1f} GiB does not fit"
        else:
            row.update(time_steps(plan, cfg, device, "block", False))
        rows.append(row)
    return rows


def check_levers(plan: Plan, device: torch.device) -> list[dict]:
    """Section 4: fused vs separate projections and chunked vs unfused loss at the plan's width."""
    tokens = plan.batch * plan.seq
    rows = []
    for lever, fns in levers.cases(plan.width, tokens, plan.vocab, device).items():
        m = levers.time_levers(fns, 5, device)
        rows.append({"section": "levers", "scheme": lever, "separate_ms": m["separate"], "fused_ms": m["fused"]})
    free(device)
    return rows


def check_train(plan: Plan, work: Path) -> list[dict]:
    """Section 5: ``keel prepare`` + ``keel train --config paper-64`` for ``plan.train_steps`` steps."""
    env = _env()
    run = work / "run"
    t0 = time.perf_counter()
    data = _prepare(plan, work, env)
    prep_s = time.perf_counter() - t0
    sets = [f"data.path={data}", f"train.steps={plan.train_steps}", "train.log_every=1", "train.progress=false",
            *plan.train_sets]
    t0 = time.perf_counter()
    _keel(["train", "--config", "paper-64", "--run-dir", str(run), *[a for s in sets for a in ("--set", s)]], env,
          plan is DRY)
    train_s = time.perf_counter() - t0
    metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    losses = [(m["step"], m["loss"]) for m in metrics if "loss" in m and m.get("step", 0) > 0]
    return [{"section": "train", "scheme": "keel (paper-64)", "steps": len(losses), "prepare_s": prep_s,
             "train_s": train_s, "losses": losses, "sets": sets}]


def check_compile(plan: Plan, device: torch.device) -> list[dict]:
    """Section 6: every scheme x activation checkpointing, per-block ``fullgraph`` compile on the
    device: forward + backward under bf16 autocast, graph breaks counted."""
    from torch._dynamo.utils import counters

    from keel.model import SCHEMES, Transformer
    from keel.train.parallelize import apply_activation_checkpointing, apply_compile

    width, sublayers = plan.compile_check
    ids = torch.randint(0, plan.vocab, (2, plan.seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for scheme in plan.compile_schemes or sorted(SCHEMES):
        for ac in ("none", "block"):
            torch._dynamo.reset()
            counters.clear()
            cfg = dataclasses.replace(model_config(plan, scheme, sublayers), d_model=width, d_ff=3 * width)
            torch.manual_seed(0)
            with torch.device(device):
                model = Transformer(cfg)
            apply_activation_checkpointing(model, ac)
            row = {"section": "compile", "scheme": scheme, "sublayers": sublayers, "compile": True, "ckpt": ac}
            try:
                apply_compile(model, backend="eager" if device.type == "cpu" else "aot_eager")
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(ids[:, :-1], ids[:, 1:])
                loss.backward()
                finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
                row.update(graph_breaks=sum(counters["graph_break"].values()),
                           graphs=counters["stats"]["unique_graphs"], loss=loss.item(), finite=finite)
            except Exception as e:  # noqa: BLE001 -- fullgraph raises on a break: a failed row, not a crash
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            del model
            free(device)
    return rows


def _keel(args: list[str], env: dict, in_process: bool) -> None:
    """``keel ARGS`` in a subprocess (as a user runs it), or through ``keel.cli.main`` in this
    process (the dry run: no second interpreter and torch import). Raises on failure."""
    if not in_process:
        subprocess.run([sys.executable, "-m", "keel", *args], check=True, env=env, cwd=REPO)
        return
    from keel.cli import main as keel_main

    if keel_main(list(args)) != 0:
        raise RuntimeError(f"keel {' '.join(args[:3])} ... failed")


def _prepare(plan: Plan, work: Path, env: dict) -> Path:
    """``keel prepare`` of the offline corpus into ``work/data`` (once per check run)."""
    data = work / "data"
    if not (data / "meta.json").is_file():
        _keel(["prepare", "--source", "builtin:python-stdlib", "--out", str(data), *plan.prepare_args], env,
              plan is DRY)
    return data


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                PYTHONUNBUFFERED="1")


def check_fsdp(plan: Plan, work: Path, dry: bool) -> list[dict]:
    """Section 7: 2-process FSDP2 + sharded-checkpoint save and resume (NCCL on 2 GPUs, gloo on
    the CPU in a dry run); skipped with fewer than 2 GPUs."""
    row = {"section": "fsdp", "scheme": "keel", "sublayers": 4, "ckpt": "-"}
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not dry and n_gpus < 2:
        return [{**row, "skipped": f"needs 2 GPUs ({n_gpus} visible)"}]
    env = _env()
    data = _prepare(plan, work, env)
    keel = [sys.executable, "-m", "keel", "train", "--nproc", "2"]
    sets = [f"data.path={data}", "train.steps=4", "train.checkpoint_every=2", "train.eval_every=2",
            "train.parallelism=fsdp", "train.progress=false", "train.sample_tokens=0", "model.n_layers=2",
            "train.device=" + ("cpu" if dry else "cuda"), "train.precision=" + ("fp32" if dry else "bf16"),
            *[s for s in plan.train_sets if not s.startswith(("model.n_layers", "train.sample_tokens"))]]
    args = [a for s in sets for a in ("--set", s)]
    full, cut = work / "fsdp_full", work / "fsdp_cut"
    t0 = time.perf_counter()
    subprocess.run([*keel, "--config", "paper-64", "--run-dir", str(full), *args], check=True, env=env, cwd=REPO)
    ckpt = full / "checkpoints" / "step_00000002"
    shards = sorted(p.name for p in (ckpt / "dcp").glob("__*_*.distcp")) if (ckpt / "dcp").is_dir() else []
    import shutil

    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000004")
    (cut / "checkpoints" / "latest").write_text("step_00000002\n")
    subprocess.run([*keel, "--resume", str(cut), *args], check=True, env=env, cwd=REPO)

    def losses(run):
        recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        return {r["step"]: r["loss"] for r in recs if "loss" in r}

    a, b = losses(full), losses(cut)
    rtol = 1e-5 if dry else 1e-2  # fp32 on gloo; bf16 on NCCL
    same = all(abs(a[k] - b[k]) <= rtol * abs(a[k]) for k in (3, 4))
    return [{**row, "losses": sorted(a.items()), "resumed": [(k, b[k]) for k in (3, 4)], "shards": shards,
             "same": same, "train_s": time.perf_counter() - t0}]


def _left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, longest] and attention_mask of ``prompts``, padded on the left with id 0."""
    n = max(map(len, prompts))
    ids = torch.tensor([[0] * (n - len(q)) + q for q in prompts], device=device)
    mask = torch.tensor([[0] * (n - len(q)) + [1] * len(q) for q in prompts], device=device)
    return ids, mask


def check_hf_left_padding(plan: Plan, device: torch.device) -> list[dict]:
    """Section 8a: every scheme exported to Hugging Face (``KeelForCausalLM``) on the device, fp32
    (TF32 off): a left-padded batch of prompts of 9, 5 and 1 tokens, greedy ``generate`` with the
    cache, equals generating each prompt alone, token for token."""
    from keel.hf import KeelConfig, KeelForCausalLM
    from keel.model import SCHEMES

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, plan.vocab, (n,), generator=g).tolist() for n in (9, 5, 1)]
    ids, mask = _left_padded(prompts, device)
    sublayers = plan.compile_check[1] // 8 or 2
    rows = []
    for scheme in sorted(SCHEMES):
        torch.manual_seed(0)
        cfg = model_config(plan, scheme, sublayers)
        with torch.device(device):
            hf = KeelForCausalLM(KeelConfig.from_model_config(cfg)).eval()
        with torch.no_grad():
            batched = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
            alone = [hf.generate(torch.tensor([q], device=device), max_new_tokens=8, do_sample=False,
                                 pad_token_id=0)[0, len(q):].tolist() for q in prompts]
        same = [batched[i, ids.shape[1]:].tolist() == a for i, a in enumerate(alone)]
        rows.append({"section": "hf", "scheme": scheme, "sublayers": sublayers, "what": "left padding",
                     "rows_same": sum(same), "rows": len(same)})
        del hf
        free(device)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    return rows


def check_hf_llama(plan: Plan, device: torch.device, work: Path) -> list[dict]:
    """Section 8b: training throughput of pre_ln and keel against ``transformers``'
    ``LlamaForCausalLM`` of the same shape and weights (``benchmarks/throughput.py``, its paired
    ratio: the Llama's step time over ours in the same round), at the first speed depth."""
    sub = plan.speed_sublayers[0]
    out = work / "throughput.json"
    args = ["--device", str(device), "--shapes", f"{plan.width}x{sub // 2}", "--schemes", "pre_ln,keel",
            "--seq-len", str(plan.seq), "--batch-size", str(plan.batch), "--vocab", str(plan.vocab),
            "--head-dim", str(plan.width // plan.heads), "--gqa", str(plan.heads // plan.kv_heads),
            "--ffn-mult", str(plan.d_ff // plan.width), "--no-memory", "--repeats", str(max(plan.steps, 2)),
            "--warmup", str(plan.warmup), "--steps", "1", "--budget-s", "240", "--json", str(out)]
    subprocess.run([sys.executable, str(HERE / "throughput.py"), *args], check=True, env=_env(),
                   stdout=subprocess.DEVNULL)
    shape = json.loads(out.read_text())["shapes"][0]
    rows = []
    for scheme in ("pre_ln", "keel"):
        m = shape["models"][scheme]
        rows.append({"section": "hf-llama", "scheme": scheme, "sublayers": sub, "tokens_per_s": m["tokens_per_s"],
                     "hf_tokens_per_s": shape["models"]["hf_llama"]["tokens_per_s"],
                     "speed_vs_hf": m["paired_vs_hf_llama"], "dlogits": shape.get("max_abs_dlogits_pre_ln_vs_hf")})
    return rows


def _fmt(v, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def status(r: dict, rows: list[dict], dry: bool) -> str:
    """``pass``, ``FAIL`` or ``skip`` for one row (criteria in the module docstring)."""
    import math

    if "skipped" in r:
        return "skip"
    if "error" in r:
        return "FAIL"
    sec = r["section"]
    if sec == "bf16":
        return "pass" if r["max_rel_logit_err"] < 0.05 else "FAIL"
    if sec == "fp16":  # nan (an overflow) fails every comparison
        ok = r["max_rel_logit_err"] < 0.02 and abs(r["grad_norm"] - r["grad_norm_fp32"]) <= 0.05 * r["grad_norm_fp32"]
        return "pass" if ok else "FAIL"
    if sec == "fp16-train":
        return "pass" if r["same"] and r["scaler_state"] and all(math.isfinite(v) for _, v in r["losses"]) else "FAIL"
    if sec == "compile":
        return "pass" if r["graph_breaks"] == 0 and r["finite"] and math.isfinite(r["loss"]) else "FAIL"
    if sec == "train":
        return "pass" if r["losses"] and all(math.isfinite(v) for _, v in r["losses"]) else "FAIL"
    if sec == "fsdp":
        return "pass" if r["same"] and r["shards"] else "FAIL"
    if sec == "levers":
        return "pass"
    if sec == "hf":
        return "pass" if r["rows_same"] == r["rows"] else "FAIL"
    if sec == "hf-llama":  # at least half the speed of transformers' Llama of the same shape
        return "pass" if r["speed_vs_hf"] >= 0.5 else "FAIL"
    ok = math.isfinite(r["loss"]) and r.get("graph_breaks", 0) == 0
    if sec == "memory" and r.get("peak_gib") is not None:
        ok = ok and r["peak_gib"] <= r["predicted_gib"]
    if sec == "speed" and r["compile"] and not dry:
        eager = next(e for e in rows if e["section"] == "speed" and e["scheme"] == r["scheme"]
                     and e["sublayers"] == r["sublayers"] and not e["compile"])
        ok = ok and r["tokens_per_s"] >= 0.95 * eager["tokens_per_s"]
    return "pass" if ok else "FAIL"


def _result(r: dict) -> str:
    """The section-specific numbers of a row."""
    if "skipped" in r:
        return r["skipped"]
    if "error" in r:
        return r["error"]
    if r["section"] == "bf16":
        return f"max rel. logit err {r['max_rel_logit_err']:.2e} (logit RMS {r['logit_rms']:.3g})"
    if r["section"] == "fp16":
        return (f"max rel. logit err {r['max_rel_logit_err']:.2e}; loss {r['loss']:.4f} (fp32 {r['loss_fp32']:.4f}); "
                f"unscaled grad norm {r['grad_norm']:.4g} (fp32 {r['grad_norm_fp32']:.4g}) at loss scale "
                f"{r['scale']:g} ({r['overflows']} overflow{'s' if r['overflows'] != 1 else ''} before)")
    if r["section"] == "fp16-train":
        return (f"loss {', '.join(f'{s}: {v:.4f}' for s, v in r['losses'])}; resumed from step "
                f"{r['resumed'][0][0] - 1}: {', '.join(f'{s}: {v:.4f}' for s, v in r['resumed'])}; loss scale "
                f"{r['scale']:g}, {r['skipped_steps']} skipped; scaler state "
                f"{'checkpointed' if r['scaler_state'] else 'MISSING'} ({r['train_s']:.0f} s)")
    if r["section"] == "train":
        return (f"{r['steps']} steps, loss " + ", ".join(f"{s}: {v:.4f}" for s, v in r["losses"])
                + f" (prepare {r['prepare_s']:.0f} s, train {r['train_s']:.0f} s)")
    if r["section"] == "levers":
        return (f"separate {r['separate_ms']:.2f} ms, fused {r['fused_ms']:.2f} ms "
                f"(fused / separate {r['fused_ms'] / r['separate_ms']:.3f})")
    if r["section"] == "hf":
        return f"{r['what']}: {r['rows_same']} of {r['rows']} rows equal one-by-one greedy generation"
    if r["section"] == "hf-llama":
        return (f"{r['tokens_per_s']:,.0f} tokens/s vs HF Llama {r['hf_tokens_per_s']:,.0f}: speed "
                f"{r['speed_vs_hf']:.2f}x the Llama's (paired rounds)"
                + (f"; pre_ln vs Llama max abs logit difference {r['dlogits']:.1e}" if r["dlogits"] is not None else ""))
    if r["section"] == "compile":
        return (f"{r['graph_breaks']} graph breaks, {r['graphs']} graphs, loss {r['loss']:.3f}, "
                f"gradients {'finite' if r['finite'] else 'NOT finite'}")
    if r["section"] == "fsdp":
        return (f"loss {', '.join(f'{s}: {v:.5f}' for s, v in r['losses'])}; resumed from step 2: "
                f"{', '.join(f'{s}: {v:.5f}' for s, v in r['resumed'])}; {len(r['shards'])} shard files "
                f"({r['train_s']:.0f} s)")
    return (f"{r['tokens_per_s']:,.0f} tokens/s, step {r['step_s'] * 1e3:.0f} ms, peak {_fmt(r['peak_gib'], '.1f')} GiB"
            + (f", MFU {100 * r['mfu']:.1f}%" if "mfu" in r else "")
            + (f" (predicted <= {r['predicted_gib']:.3g} GiB)" if "predicted_gib" in r else "")
            + f", warm-up {r['warmup_s']:.0f} s, loss {r['loss']:.3f}, {r['graph_breaks']} graph breaks")


def table(rows: list[dict], header: str, dry: bool = False) -> str:
    """All rows as one markdown table (section-specific numbers in the ``result`` column)."""
    lines = [header, "", "| section | scheme | sub-layers | compile | ckpt | result | status |",
             "|:---|:---|---:|:---|:---|:---|:---|"]
    for r in rows:
        compiled = {True: "yes", False: "no"}.get(r.get("compile"), "-")
        lines.append(f"| {r['section']} | {r['scheme']} | {r.get('sublayers', '-')} | {compiled} | "
                     f"{r.get('ckpt', '-')} | {_result(r)} | {status(r, rows, dry)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="One-command GPU check (benchmarks/gpu_check.sh).")
    p.add_argument("--out", required=True, help="markdown file the table is written to")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: exercise every code path")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --dry-run)")
    a = p.parse_args(argv)
    plan = DRY if a.dry_run else GPU
    device = torch.device(a.device or ("cpu" if a.dry_run else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --dry-run for the CPU code-path check)")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = mfu.gpu_peak_flops(name)
        peak_src = "bf16 datasheet" if peak else "unknown device: H100 SXM bf16 datasheet assumed"
        peak = peak or 989e12
    else:
        name, peak, peak_src = "cpu (dry run)", mfu.measure_cpu_peak(256, 1), "fp32 256x256 matmul, measured"
    t_start = time.perf_counter()
    rows: list[dict] = []
    sections = set(a.sections.split(","))
    with tempfile.TemporaryDirectory(prefix="keel-gpu-check-") as work:
        for sec, fn in (("bf16", lambda: check_bf16(plan, device)), ("compile", lambda: check_compile(plan, device)),
                        ("speed", lambda: check_speed(plan, device, peak)),
                        ("memory", lambda: check_memory(plan, device)), ("levers", lambda: check_levers(plan, device)),
                        ("train", lambda: check_train(plan, Path(work))),
                        ("fsdp", lambda: check_fsdp(plan, Path(work), a.dry_run)),
                        ("hf", lambda: check_hf_left_padding(plan, device) + check_hf_llama(plan, device, Path(work))),
                        ("fp16", lambda: check_fp16(plan, device) + check_fp16_train(plan, Path(work)))):
            if sec in sections:
                t0 = time.perf_counter()
                rows += fn()
                print(f"gpu_check: {sec} done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    header = (f"GPU check: {name}, peak {peak / 1e12:.4g} TFLOP/s ({peak_src}), torch {torch.__version__}, "
              f"{'DRY RUN (tiny shapes, CPU)' if a.dry_run else 'full'}; width {plan.width}, seq {plan.seq}, "
              f"batch {plan.batch}; total {time.perf_counter() - t_start:.0f} s; "
              f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    text = table(rows, header, a.dry_run)
    out = Path(a.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    print(text)
    counts = {k: text.count(f"| {k} |") for k in ("pass", "FAIL", "skip")}
    print(f"gpu_check: {counts['pass']} pass, {counts['FAIL']} FAIL, {counts['skip']} skip", file=sys.stderr)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())

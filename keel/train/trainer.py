"""The training loop behind ``keel train``.

One run directory holds everything about a run::

    RUN/config.toml     resolved config (every key, after --set)
    RUN/metrics.jsonl   one JSON object per optimiser step: step, tokens, loss, lr,
                        grad_norm, tokens_per_s, elapsed_s (+ val_loss, val_ppl on eval steps;
                        + skipped: true on a non-finite step that was not applied)
    RUN/checkpoints/    atomic checkpoints (see keel.train.checkpoint)
    RUN/loss.png        train and validation loss against tokens
    RUN/sample.txt      a sample from the final model

``step`` in metrics counts optimiser steps done (1-based); step 0 is the evaluation of the
freshly initialised model. Resuming from the checkpoint at step k reproduces the
uninterrupted run's losses exactly on CPU: weights, AdamW state, scheduler, data position
and RNG state are all restored.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from keel.config import Config, dump_config
from keel.data import TokenLoader, load_tokenizer, prepare_dataset, read_meta, validation_tokens
from keel.errors import KeelError
from keel.model import Transformer
from keel.train.checkpoint import latest_checkpoint, load_trainer_state, load_weights, save_checkpoint
from keel.train.optim import build_optimizer, build_scheduler
from keel.train.plots import plot_loss


class TrainingStopped(KeelError):
    """Raised when too many non-finite steps occur in a row (``train.max_bad_steps``)."""


@dataclass
class TrainResult:
    """What ``keel train`` reports at the end (losses in nats per token)."""

    run_dir: Path
    step: int
    tokens: int
    first_val_loss: float | None
    val_loss: float
    val_ppl: float
    tokens_per_s: float
    sample: str


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; otherwise ``torch.device(spec)``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise KeelError(f"unknown train.device {spec!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KeelError("train.device is cuda but no CUDA device is available")
    return device


def autocast_context(device: torch.device, precision: str):
    """bf16 autocast on CUDA ("auto" or "bf16"), fp32 elsewhere ("auto" or "fp32")."""
    if precision not in ("auto", "fp32", "bf16"):
        raise KeelError(f"train.precision must be auto, fp32 or bf16, got {precision!r}")
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if not use_bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def resolve_data(cfg: Config, progress: bool = True) -> Path:
    """The prepared dataset folder for ``cfg.data``: ``data.path`` if set, else prepared
    (or reused from cache) from ``data.source`` and ``data.tokenizer``."""
    if cfg.data.path:
        read_meta(cfg.data.path)  # raises KeelError if it is not a prepared dataset
        return Path(cfg.data.path)
    return prepare_dataset(cfg.data.source, cfg.data.tokenizer, cache_dir=cfg.data.cache_dir,
                           val_fraction=cfg.data.val_fraction, max_bytes=cfg.data.max_bytes or None,
                           text_field=cfg.data.text_field, progress=progress)


@torch.no_grad()
def evaluate(model: Transformer, windows: torch.Tensor, batch_size: int, device: torch.device,
             amp) -> float:
    """Mean next-token cross-entropy (nats/token) over ``windows`` [N, T+1] (LongTensor)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        batch = windows[i:i + batch_size].to(device)
        with amp:
            loss = model(batch[:, :-1], batch[:, 1:])
        n = batch[:, 1:].numel()
        total += loss.item() * n
        count += n
    model.train(was_training)
    return total / count


def sample_text(model: Transformer, tokenizer, prompt: str, max_new_tokens: int, device: torch.device,
                temperature: float = 0.8, top_k: int | None = 50, seed: int = 0) -> str:
    """Decode ``max_new_tokens`` sampled tokens after ``prompt`` (str); returns prompt + continuation."""
    ids = tokenizer.encode(prompt).ids or [0]
    gen = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens, temperature, top_k, generator=gen)
    model.train(was_training)
    return tokenizer.decode(out[0].tolist())


def _rewrite_metrics(path: Path, keep_through_step: int) -> None:
    """Drop metric lines after ``keep_through_step`` (a resumed run re-logs them)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= keep_through_step]
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".metrics.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write("".join(ln + "\n" for ln in lines))
    os.replace(tmp, path)


def train(cfg: Config, run_dir: str | Path, resume: bool = False, log=print) -> TrainResult:
    """Train ``cfg`` into ``run_dir`` (or continue it with ``resume=True``).

    Raises:
        KeelError: bad config, data problems, a run directory that already holds a run
            (without ``resume``), or ``TrainingStopped`` after ``train.max_bad_steps``
            non-finite steps in a row (the last good checkpoint is left intact).
    """
    tc = cfg.train
    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir) if resume else None
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise KeelError(f"run directory {run_dir} already holds a run; use --resume {run_dir} or another --run-dir")
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "checkpoint_every"):
        if getattr(tc, name) < 1:
            raise KeelError(f"train.{name} must be >= 1, got {getattr(tc, name)}")
    if tc.warmup_steps < 0 or not tc.lr > 0:
        raise KeelError("train.lr must be > 0 and train.warmup_steps >= 0")
    if tc.seq_len > cfg.model.max_seq_len:
        raise KeelError(f"train.seq_len ({tc.seq_len}) exceeds model.max_seq_len ({cfg.model.max_seq_len})")
    device = resolve_device(tc.device)
    amp = autocast_context(device, tc.precision)

    data_dir = resolve_data(cfg, progress=tc.progress)
    meta = read_meta(data_dir)
    if cfg.model.vocab_size < meta["vocab_size"]:
        cfg.model.vocab_size = meta["vocab_size"]
    tokenizer = load_tokenizer(data_dir)
    loader = TokenLoader(data_dir, "train", batch_size=tc.batch_size, seq_len=tc.seq_len, seed=tc.seed)
    val_windows = validation_tokens(data_dir, tc.seq_len, tc.eval_tokens)

    torch.manual_seed(tc.seed)
    model = Transformer(cfg.model).to(device)
    optimizer = build_optimizer(model, tc)
    scheduler = build_scheduler(optimizer, tc)
    step, tokens, elapsed = 0, 0, 0.0
    if ckpt is not None:
        load_weights(model, ckpt)
        state = load_trainer_state(ckpt)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
        step, tokens, elapsed = state["step"], state["tokens"], state["elapsed_s"]
        log(f"resuming {run_dir} from step {step} ({ckpt.name})")

    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.toml")
    shutil.copyfile(data_dir / "tokenizer.json", run_dir / "tokenizer.json")
    metrics_path = run_dir / "metrics.jsonl"
    _rewrite_metrics(metrics_path, step if ckpt is not None else -1)
    L = cfg.model.n_sublayers
    log(f"model: {cfg.model.residual}, {cfg.model.n_layers} blocks = {L} sub-layers, d_model {cfg.model.d_model}, "
        f"{model.num_params() / 1e6:.2f}M parameters; data: {data_dir} ({meta['train_tokens']:,} train tokens)")
    tokens_per_step = tc.batch_size * tc.seq_len * tc.grad_accum

    def write(record: dict) -> None:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def state_dict() -> dict:
        return {"step": step, "tokens": tokens, "elapsed_s": elapsed, "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "loader": loader.state_dict(), "rng": torch.get_rng_state()}

    first_val = None
    if ckpt is None:
        first_val = evaluate(model, val_windows, tc.batch_size, device, amp)
        write({"step": 0, "tokens": 0, "val_loss": first_val, "val_ppl": math.exp(min(first_val, 700))})
    else:
        first = json.loads(metrics_path.read_text().splitlines()[0]) if metrics_path.exists() else {}
        first_val = first.get("val_loss")

    from tqdm.auto import tqdm

    monitor = None
    if tc.stop_on_divergence or tc.divergence_warnings:
        from keel.diagnostics.divergence import OnlineDivergenceMonitor

        monitor = OnlineDivergenceMonitor()
        for r in (json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()):
            if "loss" in r and not r.get("skipped"):
                monitor.update(r["step"], r["loss"], r["lr"])  # replay the history on resume
    task_names = [t.strip() for t in tc.eval_tasks.split(",") if t.strip()]

    bar = tqdm(total=tc.steps, initial=step, disable=not tc.progress, unit="step", dynamic_ncols=True)
    params = [p for p in model.parameters()]
    bad_in_row, val_loss, tok_s = 0, None, 0.0
    model.train()
    while step < tc.steps:
        t0 = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        loss_sum = 0.0
        for _ in range(tc.grad_accum):
            batch = loader.next_batch().to(device, non_blocking=True)
            with amp:
                loss = model(batch[:, :-1], batch[:, 1:])
            (loss / tc.grad_accum).backward()
            loss_sum += loss.item()
        loss_val = loss_sum / tc.grad_accum
        gradflow = None
        if tc.gradflow_every and (step + 1) % tc.gradflow_every == 0:
            from keel.diagnostics.gradflow import sublayer_grad_norms

            gradflow = sublayer_grad_norms(model)  # before clipping: the raw gradient flow
        max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
        finite = math.isfinite(loss_val) and math.isfinite(grad_norm)
        if finite:
            optimizer.step()
            bad_in_row = 0
        else:
            bad_in_row += 1
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        tokens += tokens_per_step
        dt = time.perf_counter() - t0
        elapsed += dt
        tok_s = tokens_per_step / dt
        record = {"step": step, "tokens": tokens, "loss": loss_val, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tok_s, "elapsed_s": elapsed}
        if gradflow is not None:
            record["sublayer_grad_norm"] = gradflow
        if monitor is not None and finite:
            verdict = monitor.update(step, loss_val, lr)
            if verdict is not None:
                record["divergence"] = verdict.to_dict()
                log(f"step {step}: divergence detected: {verdict.summary()}")
                if tc.stop_on_divergence:
                    write(record)
                    bar.close()
                    raise TrainingStopped(f"stopped at step {step}: {verdict.summary()} (train.stop_on_divergence)")
        if task_names and tc.eval_tasks_every and step % tc.eval_tasks_every == 0:
            from keel.eval.tasks import run_tasks

            record["eval_tasks"] = run_tasks(model, tokenizer, task_names, limit=tc.eval_tasks_limit, device=device)
        if not finite:
            record["skipped"] = True
            log(f"step {step}: non-finite loss {loss_val} or grad norm {grad_norm}; update skipped "
                f"({bad_in_row} in a row)")
            if bad_in_row >= tc.max_bad_steps:
                write(record)
                bar.close()
                last = latest_checkpoint(run_dir)
                raise TrainingStopped(
                    f"stopped at step {step}: {bad_in_row} non-finite steps in a row (train.max_bad_steps); "
                    f"last good checkpoint: {last if last else 'none'}")
        if step % tc.eval_every == 0 or step == tc.steps:
            val_loss = evaluate(model, val_windows, tc.batch_size, device, amp)
            record["val_loss"] = val_loss
            record["val_ppl"] = math.exp(min(val_loss, 700))
        write(record)
        bar.update(1)
        if finite:
            bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
        if step % tc.checkpoint_every == 0 or step == tc.steps:
            save_checkpoint(run_dir, step, model, state_dict(), keep=tc.keep_checkpoints)
    bar.close()

    if val_loss is None:  # resumed at the end: nothing ran
        val_loss = evaluate(model, val_windows, tc.batch_size, device, amp)
    plot_loss(metrics_path, run_dir / "loss.png", title=f"{cfg.model.residual}, {L} sub-layers")
    sample = sample_text(model, tokenizer, tc.sample_prompt, tc.sample_tokens, device, seed=tc.seed)
    (run_dir / "sample.txt").write_text(sample + "\n")
    mean_tok_s = tokens / elapsed if elapsed > 0 else 0.0
    return TrainResult(run_dir, step, tokens, first_val, val_loss, math.exp(min(val_loss, 700)), mean_tok_s, sample)

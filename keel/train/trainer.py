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
freshly initialised model.

Several processes (``torchrun --nproc_per_node N -m keel train ...`` or
``keel train --nproc N``): ``train.parallelism`` picks DDP or FSDP2 (applied by
:mod:`keel.train.parallelize`). ``train.batch_size`` is the GLOBAL number of sequences per
micro-batch, split evenly over the ranks (it must be divisible by the world size), so one
optimiser step always sees ``batch_size * seq_len * grad_accum`` tokens (``tokens`` in the
metrics counts them over all ranks) and the same windows whatever the world size. Only
rank 0 writes files and logs; every rank evaluates its share of the validation windows and
takes part in checkpointing, which stores full, unsharded weights. Resuming from the checkpoint at step k reproduces the
uninterrupted run's losses exactly on CPU: weights, AdamW state, scheduler, data position
and RNG state are all restored.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from keel.config import Config, dump_config
from keel.data import TokenLoader, load_tokenizer, prepare_dataset, read_meta, validation_tokens
from keel.errors import KeelError
from keel.io import atomic_write_text
from keel.model import Transformer
from keel.train import parallelize as par
from keel.train.checkpoint import latest_checkpoint, load_trainer_state, load_weights, save_checkpoint, tied_aliases
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
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int, device: torch.device,
             amp, info: par.DistInfo | None = None) -> float:
    """Mean next-token cross-entropy (nats/token) over ``windows`` [N, T+1] (LongTensor).

    With a process group (``info``), rank r evaluates ``windows[r::world_size]`` and the sums
    are all-reduced: the result is the mean over all N windows on every rank. Every rank
    runs the same number of forward passes (a rank with no windows left runs one on a
    window it then ignores), as FSDP's all-gathers require.
    """
    info = info or par.DistInfo(device=device)
    ws = info.world_size if info.distributed else 1
    mine = windows[info.rank::ws] if ws > 1 else windows
    n_batches = -(-windows.shape[0] // (ws * batch_size))  # same on every rank
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for i in range(n_batches):
        batch = mine[i * batch_size:(i + 1) * batch_size]
        weight = 1.0
        if batch.shape[0] == 0:
            batch, weight = windows[:1], 0.0
        batch = batch.to(device)
        with amp:
            loss = model(batch[:, :-1], batch[:, 1:])
        n = batch[:, 1:].numel() * weight
        total += torch.tensor([loss.item() * n, n], dtype=torch.float64)
    total = par.all_reduce_sum(total, info)
    model.train(was_training)
    return float(total[0] / total[1])


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
    atomic_write_text(path, "".join(ln + "\n" for ln in lines))


def _check_train_config(cfg: Config) -> None:
    tc = cfg.train
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "checkpoint_every"):
        if getattr(tc, name) < 1:
            raise KeelError(f"train.{name} must be >= 1, got {getattr(tc, name)}")
    if tc.warmup_steps < 0 or not tc.lr > 0:
        raise KeelError("train.lr must be > 0 and train.warmup_steps >= 0")
    if tc.seq_len > cfg.model.max_seq_len:
        raise KeelError(f"train.seq_len ({tc.seq_len}) exceeds model.max_seq_len ({cfg.model.max_seq_len})")
    if tc.parallelism not in par.PARALLELISMS:
        raise KeelError(f"train.parallelism must be one of {', '.join(par.PARALLELISMS)}, got {tc.parallelism!r}")
    par.checkpointed_blocks(cfg.model.n_layers, tc.activation_checkpointing, tc.checkpoint_k)


def train(cfg: Config, run_dir: str | Path, resume: bool = False, log=print) -> TrainResult:
    """Train ``cfg`` into ``run_dir`` (or continue it with ``resume=True``).

    Launched by torchrun (``RANK``/``WORLD_SIZE`` set), every process calls this; rank 0's
    ``run_dir`` is used by all. See the module docstring for the global batch.

    Raises:
        KeelError: bad config, data problems, a run directory that already holds a run
            (without ``resume``), ``train.batch_size`` not divisible by the world size, or
            ``TrainingStopped`` after ``train.max_bad_steps`` non-finite steps in a row (the
            last good checkpoint is left intact).
    """
    _check_train_config(cfg)
    info = par.init_distributed(resolve_device(cfg.train.device))
    try:
        return _train(cfg, run_dir, resume, log, info)
    finally:
        par.destroy_distributed(info)


def _train(cfg: Config, run_dir: str | Path, resume: bool, log, info: par.DistInfo) -> TrainResult:
    tc = cfg.train
    main = info.is_main
    if not main:
        log = lambda *a, **k: None  # noqa: E731
    ws = info.world_size if info.distributed else 1
    if tc.batch_size % ws:
        raise KeelError(f"train.batch_size ({tc.batch_size}, the global number of sequences per micro-batch) "
                        f"is not divisible by the world size ({ws})")
    local_bs = tc.batch_size // ws
    run_dir = Path(par.broadcast_object(str(run_dir), info))
    ckpt = latest_checkpoint(run_dir) if resume else None
    if not resume and (run_dir / "metrics.jsonl").exists():
        raise KeelError(f"run directory {run_dir} already holds a run; use --resume {run_dir} or another --run-dir")
    device = info.device
    amp = autocast_context(device, tc.precision)

    # rank 0 prepares (or finds) the dataset; the others wait for its answer
    data_dir, error = None, None
    if main:
        try:
            data_dir = str(resolve_data(cfg, progress=tc.progress))
        except KeelError as e:
            error = str(e)
    data_dir, error = par.broadcast_object((data_dir, error), info)
    if error is not None:
        raise KeelError(error)
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    if cfg.model.vocab_size < meta["vocab_size"]:
        cfg.model.vocab_size = meta["vocab_size"]
    tokenizer = load_tokenizer(data_dir)
    loader = TokenLoader(data_dir, "train", batch_size=local_bs, seq_len=tc.seq_len, seed=tc.seed,
                         rank=info.rank, world_size=ws)
    val_windows = validation_tokens(data_dir, tc.seq_len, tc.eval_tokens)

    torch.manual_seed(tc.seed)
    model = Transformer(cfg.model)
    aliases = tied_aliases(model)
    state = None
    if ckpt is not None:
        load_weights(model, ckpt)  # full weights, before any sharding
        state = load_trainer_state(ckpt)
    model.to(device)
    train_module = par.parallelize(model, tc, info)  # DDP wrapper, or model itself (FSDP2 in place)
    fsdp = info.distributed and tc.parallelism == "fsdp"
    optimizer = build_optimizer(model, tc)
    scheduler = build_scheduler(optimizer, tc)
    step, tokens, elapsed = 0, 0, 0.0
    if state is not None:
        par.load_optimizer_state_dict(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
        step, tokens, elapsed = state["step"], state["tokens"], state["elapsed_s"]
        log(f"resuming {run_dir} from step {step} ({ckpt.name})")
    elif resume:
        log(f"no checkpoint in {run_dir} yet: starting it again from step 0")
    if tc.warmup_steps > tc.steps:
        log(f"warning: train.warmup_steps ({tc.warmup_steps}) > train.steps ({tc.steps}): "
            f"the LR never reaches train.lr")

    metrics_path = run_dir / "metrics.jsonl"
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run_dir / "config.toml")
        shutil.copyfile(data_dir / "tokenizer.json", run_dir / "tokenizer.json")
        _rewrite_metrics(metrics_path, step if ckpt is not None else -1)
    L = cfg.model.n_sublayers
    tokens_per_step = tc.batch_size * tc.seq_len * tc.grad_accum  # global, all ranks
    log(f"model: {cfg.model.residual}, {cfg.model.n_layers} blocks = {L} sub-layers, d_model {cfg.model.d_model}, "
        f"{model.num_params() / 1e6:.2f}M parameters; data: {data_dir} ({meta['train_tokens']:,} train tokens)")
    log(f"global batch: {tc.batch_size} sequences x {tc.seq_len} tokens x grad_accum {tc.grad_accum} = "
        f"{tokens_per_step:,} tokens per optimizer step; world size {ws}"
        + (f" ({tc.parallelism}, {local_bs} sequences per rank per micro-batch)" if info.distributed else "")
        + (f"; activation checkpointing: {tc.activation_checkpointing}" if tc.activation_checkpointing != "none" else "")
        + ("; torch.compile" if tc.compile else ""))
    eval_module = model  # FSDP: the sharded root (all ranks); DDP: the plain module, no collectives

    def write(record: dict) -> None:
        if main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def checkpoint() -> None:
        weights = par.full_model_state_dict(model)  # collective under FSDP
        optim_state = par.full_optimizer_state_dict(model, optimizer)
        if main:
            trainer_state = {"step": step, "tokens": tokens, "elapsed_s": elapsed, "optimizer": optim_state,
                             "scheduler": scheduler.state_dict(), "loader": loader.state_dict(),
                             "rng": torch.get_rng_state()}
            save_checkpoint(run_dir, step, weights, trainer_state, keep=tc.keep_checkpoints, aliases=aliases)
        par.barrier(info)

    def plain_model() -> Transformer | None:
        """The unsharded model on rank 0 (None elsewhere), for sampling and task evals."""
        if not fsdp:
            return model if main else None
        weights = par.full_model_state_dict(model)  # collective
        if not main:
            return None
        copy = Transformer(cfg.model)
        copy.load_state_dict(weights)
        return copy.to(device)

    first_val = None
    if ckpt is None:
        first_val = evaluate(eval_module, val_windows, local_bs, device, amp, info)
        write({"step": 0, "tokens": 0, "val_loss": first_val, "val_ppl": math.exp(min(first_val, 700))})
    else:
        first = json.loads(metrics_path.read_text().splitlines()[0]) if metrics_path.exists() else {}
        first_val = first.get("val_loss")

    from tqdm.auto import tqdm

    monitor = None
    if tc.stop_on_divergence or tc.divergence_warnings:
        from keel.diagnostics.divergence import OnlineDivergenceMonitor

        monitor = OnlineDivergenceMonitor()
        if metrics_path.exists():
            for r in (json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()):
                if "loss" in r and not r.get("skipped") and r["step"] <= step:
                    verdict = monitor.update(r["step"], r["loss"], r["lr"])  # replay the history on resume
                    if verdict is not None and tc.stop_on_divergence:
                        raise TrainingStopped(f"already diverged before step {step}: {verdict.summary()} "
                                              "(train.stop_on_divergence)")
    task_names = [t.strip() for t in tc.eval_tasks.split(",") if t.strip()]

    bar = tqdm(total=tc.steps, initial=step, disable=not (tc.progress and main), unit="step", dynamic_ncols=True)
    params = [p for p in model.parameters()]
    bad_in_row, val_loss, tok_s = 0, None, 0.0
    train_module.train()
    while step < tc.steps:
        t0 = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for micro in range(tc.grad_accum):
            batch = loader.next_batch().to(device, non_blocking=True)
            with par.gradient_sync(train_module, micro == tc.grad_accum - 1):
                with amp:
                    loss = train_module(batch[:, :-1], batch[:, 1:])
                (loss / tc.grad_accum).backward()
            loss_sum += loss.detach().float()
        loss_val = par.all_reduce_mean(loss_sum / tc.grad_accum, info).item()  # mean over the global batch
        gradflow = None
        if tc.gradflow_every and (step + 1) % tc.gradflow_every == 0:
            from keel.diagnostics.gradflow import sublayer_grad_norms

            gradflow = sublayer_grad_norms(model)  # before clipping: the raw gradient flow
        max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
        grad_norm = par.clip_grad_norm_(params, max_norm)  # full norm, also over FSDP shards
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
            verdict = monitor.update(step, loss_val, lr)  # same inputs on every rank: same verdict
            if verdict is not None:
                record["divergence"] = verdict.to_dict()
                log(f"step {step}: divergence detected: {verdict.summary()}")
                if tc.stop_on_divergence:
                    write(record)
                    bar.close()
                    raise TrainingStopped(f"stopped at step {step}: {verdict.summary()} (train.stop_on_divergence)")
        if task_names and tc.eval_tasks_every and step % tc.eval_tasks_every == 0:
            from keel.eval.tasks import run_tasks

            plain = plain_model()
            if plain is not None:
                record["eval_tasks"] = run_tasks(plain, tokenizer, task_names, limit=tc.eval_tasks_limit,
                                                 device=device)
            par.barrier(info)
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
            val_loss = evaluate(eval_module, val_windows, local_bs, device, amp, info)
            record["val_loss"] = val_loss
            record["val_ppl"] = math.exp(min(val_loss, 700))
        write(record)
        bar.update(1)
        if finite:
            bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
        if step % tc.checkpoint_every == 0 or step == tc.steps:
            checkpoint()
    bar.close()

    if val_loss is None:  # resumed at the end: nothing ran
        val_loss = evaluate(eval_module, val_windows, local_bs, device, amp, info)
    plain = plain_model()
    sample = ""
    if main:
        plot_loss(metrics_path, run_dir / "loss.png", title=f"{cfg.model.residual}, {L} sub-layers")
        sample = sample_text(plain, tokenizer, tc.sample_prompt, tc.sample_tokens, device, seed=tc.seed)
        (run_dir / "sample.txt").write_text(sample + "\n")
    par.barrier(info)
    mean_tok_s = tokens / elapsed if elapsed > 0 else 0.0
    return TrainResult(run_dir, step, tokens, first_val, val_loss, math.exp(min(val_loss, 700)), mean_tok_s, sample)

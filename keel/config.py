"""Run configuration: three TOML sections, ``[model]``, ``[data]`` and ``[train]``.

Presets are data: TOML files shipped inside the package, ``keel/configs/NAME.toml`` (``demo`` is the default) and
``keel/configs/sweeps/NAME.toml`` for ``keel sweep``, read with ``importlib.resources`` so they exist after any
install (:func:`resolve_config_path`, :func:`preset_names`).

One declaration per key: each field of :class:`ModelConfig`, :class:`DataConfig` and :class:`TrainConfig` is made by
:func:`key`, which holds its default, its help text and its allowed range (``ge``/``gt``/``le``/``lt``, ``nonempty``);
its type, and for a ``Literal[...]`` annotation its allowed values, are the annotation on the same line. From that one
declaration come the load-time check (:func:`check_key`, run for every key by :func:`config_from_dict`), the help of
``keel config`` (:func:`describe_config`), the CLI flags that mirror a key (:func:`key_default`, :func:`key_help`) and
the checks of other modules (:func:`check_value`, :func:`choices`). Checks that relate two keys (``d_model %
n_heads``, ``min_lr <= lr``) stay explicit code in the sections' ``validate``.

A config is loaded with :func:`load_config`, overridden with ``--set section.key=value`` strings or typed ``(key,
value)`` pairs (:func:`apply_overrides`, the same coercion and checks for both) and written back as the resolved
``config.toml`` of a run (:func:`dump_config`). Unknown sections or keys, values of the wrong type or out of range
raise :class:`keel.errors.KeelError` naming the key; the residual scheme's name is checked where the list of schemes
lives (:func:`keel.model.residual.check_model_config`).
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any, ClassVar, Iterable, Literal, Mapping, Union

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from keel.errors import KeelError
from keel.io import atomic_write_text, check_regular_file
from keel.keys import (ResumePolicy, check_key, check_keys, choices, choices_text, current_key, key, key_field, key_rule,
                       key_type, resume_policy)


def unknown_key(dotted: str) -> KeelError:
    """The error for a key no section declares, the one place unknown keys are refused (a TOML
    file, ``--set``, a key set in Python, a CLI flag's key): ``unknown config key train.lrr (did
    you mean train.lr?)``. The suggestion is the declared key whose name is closest
    (``difflib.get_close_matches``), in any section (``model.lr``: ``train.lr``), the key's own
    section first on a tie; none when no name is close."""
    section, _, name = dotted.partition(".")
    known = [(f.name, s) for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, sorted({n for n, _ in known}), n=1)
    where = sorted((s != section, s) for n, s in known if close and n == close[0])
    return KeelError(f"unknown config key {dotted}" + (f" (did you mean {where[0][1]}.{close[0]}?)" if close else ""))


def _section_field(dotted: str) -> tuple[type, str, str]:
    section, _, name = dotted.partition(".")
    if section not in _SECTIONS or name not in {f.name for f in dataclasses.fields(_SECTIONS[section])}:
        raise unknown_key(dotted)
    return _SECTIONS[section], section, name


def on_resume(dotted: str) -> ResumePolicy:
    """What a resume does with a changed value of the key ``"section.name"``
    (:func:`keel.keys.resume_policy`); a key no section declares any more (an older run's) takes
    its section's policy, one of an unknown section "apply"."""
    section, _, name = dotted.partition(".")
    cls = _SECTIONS.get(section)
    if cls is None:
        return "apply"
    return resume_policy(cls, name) if name in {f.name for f in dataclasses.fields(cls)} else cls.ON_RESUME


def check_value(dotted: str, value: Any) -> None:
    """Check ``value`` for the key ``"section.name"`` as the config's load does, for a module
    that receives one key's value on its own (``keel.train.device``, ``keel.train.parallelize``).

    Raises:
        KeelError: the same one-line message as :func:`check_key`; an unknown key.
    """
    cls, section, name = _section_field(dotted)
    obj = cls()
    setattr(obj, name, value)
    check_key(obj, section, name)


def key_default(dotted: str) -> Any:
    """The declared default of the key ``"section.name"`` (a CLI flag that mirrors it uses this)."""
    cls, _, name = _section_field(dotted)
    return getattr(cls(), name)


def key_help(dotted: str) -> str:
    """The declared help of the key ``"section.name"``, with its default, for a CLI flag that mirrors it."""
    cls, _, name = _section_field(dotted)
    return f"{key_field(cls, name).metadata['help']} (default {key_default(dotted)!r}, as {dotted})"


def resolve_vocab_size(requested: int | str, tokenizer_vocab: int, multiple: int = 64) -> int:
    """The number of embedding / LM-head rows for a tokenizer of ``tokenizer_vocab`` ids.

    ``requested = "auto"``: ``tokenizer_vocab`` rounded up to a multiple of ``multiple``
    (1 = exactly the tokenizer's size). An integer is used as given.

    Raises:
        KeelError: an integer smaller than ``tokenizer_vocab`` (ids would fall outside the embedding).
    """
    if requested == "auto":
        m = max(1, int(multiple))
        return -(-int(tokenizer_vocab) // m) * m
    if int(requested) < tokenizer_vocab:
        raise KeelError(f"model.vocab_size = {requested} is smaller than the tokenizer's vocabulary "
                        f"({tokenizer_vocab} ids); use \"auto\" or at least {tokenizer_vocab}")
    return int(requested)


@dataclass
class ModelConfig:
    """Shape and residual scheme of the decoder-only LM; each key is declared once, below
    (``keel config`` prints them). A resume refuses a changed model key (``ON_RESUME``).

    Depth: ``n_layers`` counts blocks; each block is an attention sub-layer plus an FFN
    sub-layer, so the paper's L (sub-layers) is ``2 * n_layers`` (:attr:`n_sublayers`).
    A looped model (``loop_*``) has ``n_layers`` blocks of weights and the effective depth L = 2 (P + R C + Q)
    (:attr:`n_sublayers`), which every depth-dependent formula takes.

    Raises:
        KeelError: from :meth:`validate` on an impossible shape.
    """

    ON_RESUME: ClassVar[ResumePolicy] = "refuse"  # the continuation would be another model

    vocab_size: int | Literal["auto"] = key(
        "auto", "rows of the embedding and LM head: \"auto\" (the tokenizer's vocabulary rounded up to a multiple "
        "of vocab_multiple, resolved when a run starts) or a count >= the tokenizer's vocabulary.", ge=1)
    vocab_multiple: int = key(64, "with vocab_size \"auto\": round the vocabulary up to a multiple of this.", ge=1)
    d_model: int = key(128, "width of the residual stream.", ge=1)
    n_layers: int = key(4, "blocks (attention + FFN each); the paper's depth L is 2 * n_layers sub-layers.", ge=1)
    n_heads: int = key(4, "attention (query) heads; head_dim = d_model / n_heads, even.", ge=1)
    n_kv_heads: int = key(2, "key/value heads of grouped-query attention (divides n_heads).", ge=1)
    d_ff: int = key(384, "hidden width of the SwiGLU FFN.", ge=1)
    max_seq_len: int = key(1024, "longest sequence in tokens (RoPE table size).", ge=1)
    rope_theta: float = key(10000.0, "RoPE base.", gt=0)
    norm_eps: float = key(1e-5, "epsilon of every RMSNorm.", gt=0)
    tie_embeddings: bool = key(False, "share the token embedding with the LM head.")
    init_std: float = key(0.02, "standard deviation of the N(0, init_std^2) weight init.", gt=0)
    embed_init_std: float | None = key(
        None, "standard deviation of the token embedding's N(0, std^2) init; unset means init_std (the paper). "
        "A larger value (e.g. 1.0) lets Pre-LN leave the unigram plateau early (docs/results/plateau.md).",
        gt=0, note="or unset: init_std")
    residual: str = key(
        "keel", "residual scheme: a name in keel.model.residual.SCHEMES, listed by `keel config --schemes` "
        "(pre_ln, post_ln, deepnorm, keel, ...); the model layer checks it (keel.model.residual.check_model_config).")
    alpha: float | None = key(None, "Keel's residual scale; unset means L, the number of sub-layers (paper, Sec. 3).",
                              gt=0, note="omit it for the default L")
    keel_first_layer_rule: bool = key(True, "Keel: sub-layer 0 is plain Pre-LN and sub-layer 1 uses alpha = 1.")
    mix_ln_ratio: float = key(0.25, "Mix-LN: the first floor(ratio * n_layers) blocks are Post-LN, the rest Pre-LN.",
                              ge=0, le=1)
    peri_ln_embed_norm: bool = key(True, "Peri-LN: also RMS-normalise the embedding output.")
    hc_streams: int = key(4, "Hyper-Connections and mHC: expansion rate n, the number of residual streams.", ge=1)
    hc_dynamic: bool = key(True, "Hyper-Connections: dynamic (input-dependent) connections; false = static.")
    mhc_sinkhorn_iters: int = key(20, "mHC: Sinkhorn-Knopp iterations of the residual mixing matrix.", ge=1)
    attn_res_variant: Literal["block", "full"] = key(
        "block", "Attention Residuals: \"block\" (Block AttnRes) or \"full\" (Full AttnRes).")
    attn_res_blocks: int = key(8, "Block AttnRes: N, the number of blocks the L sub-layers are cut into.", ge=1)
    attn_res_readout: Literal["attend", "sum"] = key(
        "attend", "Attention Residuals: the last hidden state, \"attend\" (depth attention) or \"sum\".")
    loop_prelude: int = key(0, "looped model: P, the blocks applied once before the core.", ge=0)
    loop_core: int = key(0, "looped model: C, the blocks after the prelude applied loop_repeats times with shared "
                            "weights; the Q = n_layers - P - C blocks after them are the coda.", ge=0, note="0 = no loop")
    loop_repeats: int = key(1, "looped model: R, the core's applications per forward pass.", ge=1)
    loop_sampling: Literal["fixed", "uniform", "poisson_lognormal"] = key(
        "fixed", "looped model: the core's applications per training step, of mean R: R, uniform on 1 .. 2R - 1, or "
        "1 + Poisson(e^tau), tau ~ N(log(R - 1) - 1/8, 1/4) (Geiping et al. 2025; keel.model.loop_count).")

    @property
    def n_sublayers(self) -> int:
        """L, the number of sub-layers (attention + FFN) a forward pass applies, as the paper counts depth."""
        return 2 * self.effective_layers

    @property
    def effective_layers(self) -> int:
        """Blocks a forward pass applies: ``P + R C + Q = n_layers + (R - 1) C`` (``n_layers`` without a loop)."""
        return self.n_layers + (self.loop_repeats - 1) * self.loop_core

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> "ModelConfig":
        """Check every key against its declaration (:func:`check_keys`), then the shape; return self.

        Raises:
            KeelError: naming the first bad key. The residual scheme's name is checked one layer
                up, by :func:`keel.model.residual.check_model_config`, where the list of schemes lives.
        """
        check_keys(self, "model")
        if self.d_model % self.n_heads:
            raise KeelError(f"model.d_model ({self.d_model}) is not divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise KeelError(f"model.n_heads ({self.n_heads}) is not divisible by model.n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise KeelError(f"head dimension d_model/n_heads = {self.head_dim} must be even for RoPE")
        if self.loop_prelude + self.loop_core > self.n_layers:
            raise KeelError(f"model.loop_prelude ({self.loop_prelude}) + model.loop_core ({self.loop_core}) exceeds "
                            f"model.n_layers ({self.n_layers}), the blocks of prelude, core and coda together")
        for name, off in (("loop_prelude", 0), ("loop_repeats", 1), ("loop_sampling", "fixed")):
            if not self.loop_core and getattr(self, name) != off:
                raise KeelError(f"model.{name} = {getattr(self, name)!r} needs a loop: set model.loop_core >= 1")
        return self


MAX_LOOPS_MIN, MAX_LOOPS_FACTOR = 64, 16  # a test-time loop count R' <= max(64, 16 x model.loop_repeats)


def max_loops(trained_repeats: int) -> int:
    """The largest test-time loop count keel runs a model trained with ``model.loop_repeats`` =
    ``trained_repeats`` at (``--loops``, a Hugging Face folder's ``loops``, a study group's ``test_loops``):
    ``max(MAX_LOOPS_MIN, MAX_LOOPS_FACTOR * trained_repeats)`` (64, or 16 times the trained count: test-time
    depth past that runs for hours on a typo, e.g. ``--loops 100000000``)."""
    return max(MAX_LOOPS_MIN, MAX_LOOPS_FACTOR * trained_repeats)


def max_loops_words(trained_repeats: int, name: str = "model.loop_repeats") -> str:
    """:func:`max_loops` with its arithmetic, for messages: ``max(64, 16 x model.loop_repeats (3) = 48)``
    (``name``: what ``trained_repeats`` is called where the message is read, e.g. ``R``)."""
    return (f"max({MAX_LOOPS_MIN}, {MAX_LOOPS_FACTOR} x {name} ({trained_repeats}) = "
            f"{MAX_LOOPS_FACTOR * trained_repeats})")


@dataclass
class DataConfig:
    """Where the tokens come from (see ``keel prepare`` and :mod:`keel.data`); each key is
    declared once, below. A resume refuses a changed data key but for where the dataset lies
    (the data loader's state checks that it holds the same tokens)."""

    ON_RESUME: ClassVar[ResumePolicy] = "refuse"

    source: str = key("builtin:python-stdlib",
                      "the corpus: builtin:python-stdlib, a file or folder of text, or hf:NAME[:CONFIG].", nonempty=True)
    tokenizer: str = key("bpe:8192", "bpe:N (train an N-token byte-level BPE), a tokenizer.json path or a hub name.",
                         nonempty=True)
    path: str = key("", "a prepared dataset folder (keel prepare --out); empty = prepare source+tokenizer in cache_dir.",
                    on_resume="apply")
    cache_dir: str = key("data", "where prepared datasets are cached (relative to the working folder).",
                         on_resume="apply")
    val_fraction: float = key(0.05, "fraction of documents held out for validation (long documents are first cut "
                                    "into chunks, see keel.data.prepare).", gt=0, lt=1)
    max_bytes: int = key(0, "stop reading the source after the document that brings its UTF-8 text to this many "
                         "bytes (whole documents: up to one document more).", ge=0, note="0 = no limit")
    text_field: str = key("text", "the field holding the text in .jsonl/.json/.parquet sources.", nonempty=True)

    def validate(self) -> "DataConfig":
        """Check every key against its declaration (:func:`check_keys`) and ``cache_dir``
        against ``path``; return self. Raises KeelError naming the bad key."""
        check_keys(self, "data")
        if not (self.path or self.cache_dir):
            raise KeelError(f"data.cache_dir must be a folder when data.path is empty, got {self.cache_dir!r}")
        return self


DEFAULT_VAL_FRACTION = DataConfig.val_fraction


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping; each key is declared once, below. Defaults follow the
    paper's recipe (Sec. 5). A resume applies a changed train key from the resumed step on, but
    for the keys declared ``on_resume="refuse"`` (seed and the batch shape: another run) and
    reports the next LR for the schedule's (``"schedule"``)."""

    ON_RESUME: ClassVar[ResumePolicy] = "apply"

    steps: int = key(1000, "optimiser steps to train for.", ge=1, le=10**12, on_resume="schedule")
    lr: float = key(3e-3, "peak learning rate (after warm-up).", gt=0, on_resume="schedule")
    min_lr: float = key(1e-7, "learning rate at the end of the decay (<= lr; > 0 with schedule wsd).", ge=0,
                        on_resume="schedule")
    warmup_steps: int = key(100, "steps of linear warm-up.", ge=0, on_resume="schedule")
    schedule: Literal["cosine", "wsd", "constant"] = key(
        "cosine", "LR after warm-up (keel.train.optim.lr_at): cosine decays to min_lr; wsd (warmup-stable-decay, "
        "MiniCPM) holds lr, then decays exponentially to min_lr over the last decay_fraction of the steps; "
        "constant holds lr.", on_resume="schedule")
    decay_fraction: float = key(0.1, "with schedule wsd: the fraction of the steps spent decaying.", gt=0, le=1,
                                on_resume="schedule")
    batch_size: int = key(16, "sequences per micro-batch, over all processes.", ge=1, on_resume="refuse")
    seq_len: int = key(128, "tokens per training sequence.", ge=1, on_resume="refuse")
    grad_accum: int = key(1, "micro-batches per optimiser step.", ge=1, on_resume="refuse")
    weight_decay: float = key(0.01, "AdamW weight decay (matrices and embeddings only).", ge=0)
    beta1: float = key(0.9, "AdamW beta1.", ge=0, lt=1)
    beta2: float = key(0.95, "AdamW beta2.", ge=0, lt=1)
    grad_clip: float = key(1.0, "clip the global gradient norm to this.", ge=0, note="0 = off")
    eval_every: int = key(100, "steps between validation-loss evaluations.", ge=1)
    eval_tokens: int = key(65536, "validation tokens per evaluation.", ge=1)
    eval_batch_tokens: int = key(512, "validation scores at least this many tokens per forward pass on each process "
                                      "(more windows than the micro-batch of batch_size when those hold fewer, as with "
                                      "a short seq_len; keel.train.nll.eval_batch_size).", ge=1)
    checkpoint_every: int = key(250, "steps between checkpoints.", ge=1)
    keep_checkpoints: int = key(2, "newest checkpoints kept on disk (0 = keep every checkpoint).", ge=0)
    log_every: int = key(10, "steps between progress lines when stderr is not a terminal.", ge=1)
    seed: int = key(1337, "seed of the init, the data order and sampling.", ge=0, le=2**32 - 1,
                    note="numpy's seed range", on_resume="refuse")
    device: str = key("auto", "auto | cpu | cuda | cuda:N (checked where torch is, by keel.train.device.resolve_device).",
                      nonempty=True)
    precision: Literal["auto", "fp32", "bf16-autocast", "bf16", "fp16-autocast"] = key(
        "auto", "auto = bf16-autocast on CUDA with bf16, else fp32 | fp32 | bf16-autocast (fp32 weights) | bf16 (FSDP2: "
        "bf16 params, fp32 reduce; else bf16-autocast) | fp16-autocast (fp32 weights, loss scaling: V100, T4).")
    max_bad_steps: int = key(10, "stop after this many non-finite steps in a row.", ge=1)
    sample_tokens: int = key(64, "tokens sampled from the final model into sample.txt.", ge=0)
    sample_prompt: str = key("", "prompt of that sample; empty = a new document (the sample starts after "
                                 "<|endoftext|>).")
    progress: bool = key(True, "show training progress (a bar on a terminal, else plain lines).")
    peak_tflops: float = key(0.0, "one process's peak TFLOP/s, the denominator of the per-step MFU in metrics.jsonl; "
                                  "0 = the datasheet dense bf16 peak of a known GPU (keel.train.device).", ge=0,
                             note="no MFU on a CPU unless set")
    stop_on_divergence: bool = key(False, "stop when the divergence classifier (keel.diagnostics) fires.",
                                   callback=lambda t: t.stop_on_divergence)
    divergence_warnings: bool = key(True, "log the divergence classifier's verdicts.")
    divergence_reference: str = key(
        "", "a finished run folder whose training-loss curve is the divergence classifier's reference "
        "(enables \"optimisation degradation\"); empty = none.", callback=lambda t: bool(t.divergence_reference))
    gradflow_every: int = key(0, "log per-sub-layer gradient norms every N steps.", ge=0, note="0 = never",
                              callback=lambda t: t.gradflow_every > 0)
    parallelism: Literal["ddp", "fsdp"] = key("ddp", "how several processes train (torchrun / --nproc; "
                                                     "keel.train.parallelize).")
    activation_checkpointing: Literal["none", "block", "every_k"] = key(
        "none", "recompute activations in backward: in every block, or every activation_checkpoint_k-th (every_k).")
    activation_checkpoint_k: int = key(2, "with every_k: recompute the activations of every k-th block.", ge=1)
    activation_checkpoint_min_loops: int = key(
        0, "with a looped model (model.loop_core > 0) and activation checkpointing: recompute only on the training "
        "steps whose drawn core count (model.loop_sampling) is at least this; the other steps keep every activation "
        "and run at full speed, so memory is bounded by this count and checkpointing costs only the rare deep draws.",
        ge=0, note="0 = every step")
    compile: bool = key(False, "torch.compile the model.")
    flush_denormal: bool = key(
        True, "on the CPU, flush subnormal floats to zero while training (torch.set_flush_denormal): a model "
        "whose gradients underflow, as a stagnating deep Post-LN's do, otherwise trains ~8x slower "
        "(benchmarks/denormal.py); other values are unchanged; no effect on CUDA.")
    eval_tasks: str = key("", "comma-separated lm-evaluation-harness tasks scored during training (keel.eval).",
                          callback=lambda t: bool(t.eval_tasks.strip()) and t.eval_tasks_every > 0)
    eval_tasks_every: int = key(0, "steps between task evaluations.", ge=0, note="0 = never")
    eval_tasks_limit: int = key(100, "examples per task in those evaluations.", ge=1)
    loggers: list[Literal["jsonl", "tensorboard", "wandb"]] = key(
        ["jsonl"], "where metrics go (keel.train.loggers): jsonl (always), tensorboard (RUN/tensorboard), "
        "wandb (RUN/wandb).")
    wandb_mode: Literal["offline", "online", "disabled"] = key(
        "offline", "W&B mode; an offline run is uploaded later with `wandb sync`.")
    wandb_project: str = key("keel", "W&B project name.")

    def validate(self) -> "TrainConfig":
        """Check every key against its declaration (:func:`check_keys`), then the rules that
        relate two keys (``min_lr <= lr``; ``min_lr > 0`` with ``wsd``); return self. ``device``
        and the cross-section ``seq_len <= model.max_seq_len`` are checked by
        :func:`keel.train.trainer.check_train_config`.

        Raises:
            KeelError: naming the first bad key.
        """
        check_keys(self, "train")
        if self.min_lr > self.lr:
            raise KeelError(f"train.min_lr must be a finite number between 0 and train.lr ({self.lr}), "
                            f"got {self.min_lr!r}")
        if self.schedule == "wsd" and self.min_lr <= 0:
            raise KeelError(f"train.min_lr must be > 0 with train.schedule = \"wsd\" (exponential decay), "
                            f"got {self.min_lr!r}")
        return self


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested plain dicts; unset optional values (None) are left out, as TOML has no null."""
        return {s: {k: v for k, v in dataclasses.asdict(getattr(self, s)).items() if v is not None}
                for s in ("model", "data", "train")}


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}


def _coerce_names(where: str, value: Any) -> list[str]:
    """A list of names (``train.loggers``) from a TOML array or a string ``"a,b"``."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise KeelError(f"{where} must be a list of strings, got {value!r}")
    return [v.strip() for v in items if v.strip()]


def _coerce_int(where: str, value: Any) -> int:
    if isinstance(value, str) and value.isascii():  # int() and float() also read other scripts' digits ("١")
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise KeelError(f"{where} must be an integer, got {value!r}")


def _coerce_float(where: str, value: Any) -> float:
    """``value`` as a float: a number or ASCII number text; not a bool (``float(True)`` is 1.0: ``--set
    train.lr=true`` trained at lr 1.0), nor another script's digits (``float("١")`` is 1.0). Raises KeelError."""
    if isinstance(value, bool) or (isinstance(value, str) and not value.isascii()):
        raise KeelError(f"{where} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise KeelError(f"{where} must be a number, got {value!r}") from None


def coerce_key(section: str, name: str, value: Any) -> Any:
    """``value`` (from TOML, a ``--set`` string or Python) as the declared type of ``section.name``:
    bool (also "true"/"false"/"1"/"0"/"yes"/"no"), int (also "12", 12.0), float, str, a list of
    names (also "a,b"), a ``Literal`` value, or None for an optional key.

    Raises:
        KeelError: ``"{section}.{name} must be an integer, got ..."`` and the like.
    """
    where, t = f"{section}.{name}", key_type(_SECTIONS[section], name)
    if t.base is list:
        return _coerce_names(where, value)
    if value is None and t.optional:
        return None
    if t.base is int and t.values:  # model.vocab_size: "auto" or an integer
        if isinstance(value, str) and value.strip().lower() in t.values:
            return value.strip().lower()
        try:
            return _coerce_int(where, value)
        except KeelError:
            raise KeelError(f"{where} must be {choices_text(t.values)} or an integer, got {value!r}") from None
    if t.base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise KeelError(f"{where} must be true or false, got {value!r}")
    if t.base is int:
        return _coerce_int(where, value)
    if t.base is float:
        return _coerce_float(where, value)
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise KeelError(f"{where} must be a string, got {value!r}")
    return str(value)


def config_from_dict(d: Mapping[str, Any], stored: bool = False) -> Config:
    """Build and validate a :class:`Config` from nested dicts (e.g. parsed TOML).

    Args:
        d: ``{"model": {...}, "data": {...}, "train": {...}}``; a renamed key (:data:`keel.keys.RENAMED_KEYS`)
            is read under its current name, with one deprecation line (:func:`keel.keys.current_key`) unless
            ``stored``: ``d`` is what keel wrote itself (a run's config.toml, a checkpoint's config).
    Raises:
        KeelError: on an unknown section or key, a value of the wrong type or out of its
            declared range (:func:`check_key`), or a broken rule between keys.
    """
    cfg = Config()
    for section, values in d.items():
        owner = [s for s, cls in _SECTIONS.items() if section in {f.name for f in dataclasses.fields(cls)}]
        if owner and not isinstance(values, dict):  # `steps = 5` above every [section]
            raise KeelError(f"config key {section} is outside a section: put it under [{owner[0]}]")
        if section not in _SECTIONS:
            close = difflib.get_close_matches(section, _SECTIONS, n=1)
            hint = f"did you mean [{close[0]}]? " if close else ""
            raise KeelError(f"unknown config section [{section}] ({hint}the sections are model, data, train)")
        if not isinstance(values, dict):
            raise KeelError(f"config section [{section}] must be a table")
        obj = getattr(cfg, section)
        for old, value in values.items():
            name = current_key(f"{section}.{old}", warn=not stored).partition(".")[2]
            if name not in {f.name for f in dataclasses.fields(obj)}:
                raise unknown_key(f"{section}.{name}")
            setattr(obj, name, coerce_key(section, name, value))
    cfg.model.validate()
    cfg.data.validate()
    cfg.train.validate()
    return cfg


def checked_copy(cfg: Config) -> Config:
    """A validated copy of a :class:`Config` built or edited in Python: every value goes through
    the same conversion and checks as a TOML file or ``--set`` (:func:`config_from_dict`), so a
    run never starts from, or writes into its ``config.toml``, a value the CLI would refuse.

    Raises:
        KeelError: ``cfg`` is not a Config (e.g. a path: load it with :func:`load_config`), an
            attribute that is no config key was set on a section, or a value the checks refuse.
    """
    if not isinstance(cfg, Config):
        raise KeelError(f"expected a keel.config.Config (load a file with keel.config.load_config), "
                        f"got {type(cfg).__name__}")
    for section in _SECTIONS:
        obj = getattr(cfg, section)
        unknown = sorted(set(vars(obj)) - {f.name for f in dataclasses.fields(obj)})
        if unknown:
            raise unknown_key(f"{section}.{unknown[0]}")
    return config_from_dict(cfg.to_dict())


Override = Union[str, tuple[str, Any]]


def parse_value(raw: str, dotted: str = "") -> Any:
    """A TOML scalar (``1e-3`` -> float, ``16`` -> int, ``true``, ``"x"``, ``[1, 2]``) or, failing that, the string;
    for the text key ``dotted`` (declared ``str``, no choices) an unquoted value is the text as typed
    (``train.sample_prompt=3.10`` is "3.10", not the float's "3.1")."""
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    try:
        t = key_type(*_section_field(current_key(dotted))[::2])  # (section class, name)
    except KeelError:  # no key, or an unknown one: refused where it is applied, with its suggestion
        return value
    return raw.strip() if t.base is str and not t.values and not isinstance(value, str) else value


def parse_override(item: str) -> tuple[str, Any]:
    """``"section.key=value"`` (a ``--set`` string) as ``("section.key", value)``, the value read by
    :func:`parse_value`. Raises KeelError: no ``=`` or no section in the string."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise KeelError(f"--set expects section.key=value, got {item!r}")
    lhs, raw = item.split("=", 1)
    return lhs.strip(), parse_value(raw, lhs.strip())


def apply_overrides(d: Mapping[str, Any], overrides: Iterable[Override] | Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the nested config dict ``d`` with ``overrides`` applied in order, later ones winning.

    Args:
        d: ``{"model": {...}, "data": {...}, "train": {...}}`` (e.g. parsed TOML, ``Config.to_dict()``).
        overrides: ``--set`` strings ``"section.key=value"`` (:func:`parse_override`), typed pairs
            ``("train.lr", 1e-3)``, or a mapping ``{"train.lr": 1e-3}``. Typed values are not
            turned into text: they are coerced and checked by :func:`config_from_dict` like a
            TOML file's values.
    Raises:
        KeelError: a malformed ``--set`` string or a key without a section.
    """
    out = {s: dict(v) if isinstance(v, dict) else v for s, v in d.items()}
    items = overrides.items() if isinstance(overrides, Mapping) else overrides
    for item in items:
        dotted, value = parse_override(item) if isinstance(item, str) else item
        section, sep, name = current_key(dotted.strip(), warn=True).partition(".")
        if not sep and isinstance(value, dict) and value:  # TOML read `train.lr = 1e-3` as a table {train: {lr: ..}}
            raise KeelError(_unquoted_key_message(dotted, value))
        if not sep:
            raise KeelError(f"a config override needs section.key, got {dotted!r}")
        out.setdefault(section, {})
        if not isinstance(out[section], dict):
            raise KeelError(f"config section [{section}] must be a table")
        out[section][name.strip()] = value
    return out


def _unquoted_key_message(section: str, table: dict) -> str:
    """Why an override ``section`` whose value is a table (TOML's reading of an unquoted dotted key,
    ``train.lr = 1e-3`` in a study's ``set`` table) is refused, and how to write it."""
    inner, value = next(iter(table.items()))
    shown = "..." if isinstance(value, dict) else override_text((f"{section}.{inner}", value)).split("=", 1)[1]
    return (f"a config override needs section.key, got {section!r} holding a table: quote the dotted key, "
            f"\"{section}.{inner}\" = {shown} (unquoted, TOML reads {section}.{inner} = ... as a table [{section}])")


def read_toml(path: Path, what: str = "config") -> dict:
    """The TOML file ``path`` as a dict (a UTF-8 byte-order mark at its start is accepted). Raises
    KeelError, one line naming ``what`` (config, study, sweep preset) and ``path``: no such file, not
    a regular file, not UTF-8 text, not TOML."""
    check_regular_file(path, f"{what} file")  # a FIFO blocked for ever
    try:  # utf-8-sig: a byte-order mark (Windows editors write one) was "Invalid statement (line 1, column 1)"
        return tomllib.loads(Path(path).read_text(encoding="utf-8-sig"))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise KeelError(f"{what} file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise KeelError(f"cannot parse {what} {path}: {e}") from None
    except UnicodeDecodeError:
        raise KeelError(f"cannot read {what} {path}: not UTF-8 text (a TOML file is)") from None


def load_config(path: str | Path | None = None, overrides: Iterable[Override] | Mapping[str, Any] = (),
                stored: bool = False) -> Config:
    """Read a TOML config (default: the declared defaults) and apply ``overrides``.

    Args:
        path: a TOML file with any of the sections model/data/train, or the name of a shipped preset
            (``"demo"``, ``"paper-64"``, ...; :func:`resolve_config_path`, as ``--config``); None = built-in defaults.
        overrides: ``--set`` strings ``section.key=value`` and/or typed ``(key, value)`` pairs
            (or a mapping), applied in order by :func:`apply_overrides`.
        stored: ``path`` is a file keel wrote (a run's ``config.toml``): a renamed key in it is
            read without the deprecation line (:func:`keel.keys.current_key`); ``overrides`` always get it.

    Raises:
        KeelError: missing/unparsable file, unknown key, bad value.
    """
    d = read_toml(resolve_config_path(str(path))) if path is not None else {}
    return config_from_dict(apply_overrides(d, overrides or ()), stored=stored)


def override_text(item: Override) -> str:
    """An override as ``section.key=value`` text, for reports (a typed pair's value as TOML)."""
    if isinstance(item, str):
        return item
    return f"{item[0]}={tomli_w.dumps({'v': item[1]}).split('=', 1)[1].strip()}"


def dump_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as TOML, atomically (temp file, then rename)."""
    atomic_write_text(path, tomli_w.dumps(cfg.to_dict()))


DEFAULT_PRESET = "demo"


def _preset_dir(kind: str = ""):
    """The packaged preset folder (a ``importlib.resources`` Traversable): ``keel/configs``
    or, with ``kind="sweeps"``, ``keel/configs/sweeps``."""
    root = files("keel") / "configs"
    return root / kind if kind else root


def preset_names(kind: str = "") -> list[str]:
    """Names of the shipped presets (``demo``, ``paper-64`` ...; ``kind="sweeps"``: the sweep presets)."""
    return sorted(p.name[:-5] for p in _preset_dir(kind).iterdir() if p.name.endswith(".toml"))


def resolve_config_path(name: str | None, kind: str = "") -> Path:
    """A config file: ``name`` itself if it is a file path (or ends in ``.toml``), else the
    packaged preset ``name`` (default ``demo``; ``kind="sweeps"`` for sweep presets, ``"studies"`` for studies).

    Raises:
        KeelError: neither a file nor a preset (the message lists the presets).
    """
    name = name or DEFAULT_PRESET
    p = Path(name)
    if p.suffix == ".toml" or p.exists():
        noun = {"sweeps": "sweep preset file", "studies": "study file"}.get(kind, "config file")
        check_regular_file(p, noun)  # a FIFO: "not found"
        if p.is_dir():
            raise KeelError(f"{p} is a folder, not a {noun} (give a TOML file or a preset name)")
        if not p.is_file():
            raise KeelError(f"{noun} not found: {p}")
        return p
    preset = _preset_dir(kind) / f"{name}.toml"
    if preset.is_file():
        return Path(str(preset))
    what = {"sweeps": "sweep preset", "studies": "study"}.get(kind, "config")
    known = ", ".join(preset_names(kind)) or "none found"
    raise KeelError(f"unknown {what} {name!r}: not a file and not a shipped preset ({known})")


def describe_config() -> list[dict[str, Any]]:
    """Every config key, from its one declaration (:func:`key`), in section and field order:
    ``[{"key": "model.d_model", "type": "int", "default": 128, "choices": None, "rule": ">= 1",
    "help": "..."}]``. ``type`` is the annotation (a ``Literal[...]`` one as its values: ``"'cosine'
    | 'wsd' | 'constant'"``, ``"list of 'jsonl' | ..."``), ``choices`` the allowed values (None =
    any), ``rule`` the range or values in words as the load-time check says them (:func:`key_rule`;
    "" = any value of the type), ``default`` the declared default (None = unset)."""
    out = []
    for section, cls in _SECTIONS.items():
        obj = cls()
        for f in dataclasses.fields(cls):
            out.append({"key": f"{section}.{f.name}", "type": key_type(cls, f.name).text, "default": getattr(obj, f.name),
                        "choices": choices(cls, f.name), "rule": key_rule(cls, f.name), "help": f.metadata["help"]})
    return out

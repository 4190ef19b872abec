"""Run configuration: three TOML sections, ``[model]``, ``[data]`` and ``[train]``.

Presets are data: TOML files shipped inside the package, ``keel/configs/NAME.toml``
(``demo`` is the default) and ``keel/configs/sweeps/NAME.toml`` for ``keel sweep``, read
with ``importlib.resources`` so they exist after any install (:func:`resolve_config_path`,
:func:`preset_names`).
A config is loaded with :func:`load_config`, overridden with ``--set section.key=value``
strings (:func:`apply_overrides`) and written back as the resolved ``config.toml`` of a
run (:func:`dump_config`). Unknown sections or keys, values of the wrong type and values
out of range raise :class:`keel.errors.KeelError` naming the key: each section checks its
own keys in one place (``ModelConfig.validate``, ``DataConfig.validate``,
``TrainConfig.validate``), called by :func:`config_from_dict`; the residual scheme's name
and its own keys are checked by :func:`keel.model.residual.check_model_config`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from keel.errors import KeelError

DEFAULT_VAL_FRACTION = 0.05


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _check(ok: bool, where: str, rule: str, value: Any) -> None:
    """Raise ``KeelError("{where} must be {rule}, got {value!r}")`` unless ``ok``."""
    if not ok:
        raise KeelError(f"{where} must be {rule}, got {value!r}")


def choices(cls, name: str) -> tuple | None:
    """The values a field may take, as declared by its ``Literal[...]`` annotation (for a
    ``list[Literal[...]]`` field, those of its items); None for a field without one.

    This one declaration drives both the check at load (:func:`check_choices`) and the
    help of ``keel config`` (:func:`describe_config`)."""
    hint = get_type_hints(cls).get(name)
    if get_origin(hint) is list:
        hint = get_args(hint)[0]
    return get_args(hint) if get_origin(hint) is Literal else None


def _choices_text(values: tuple) -> str:
    return " | ".join(map(repr, values))


def check_choices(obj, section: str) -> None:
    """Check every field of ``obj`` declared with ``Literal[...]`` (or ``list[Literal[...]]``).

    Raises:
        KeelError: ``"{section}.{key} must be 'a' | 'b', got 'c'"`` for the first value outside its declaration.
    """
    for f in dataclasses.fields(obj):
        allowed = choices(type(obj), f.name)
        if allowed is None:
            continue
        value = getattr(obj, f.name)
        for item in value if isinstance(value, list) else [value]:
            what = "a list of" if isinstance(value, list) else ""
            _check(item in allowed, f"{section}.{f.name}", f"{what} {_choices_text(allowed)}".strip(), item)


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
    """Shape and residual scheme of the decoder-only LM.

    Depth: ``n_layers`` counts blocks; each block is an attention sub-layer plus an FFN
    sub-layer, so the paper's L (sub-layers) is ``2 * n_layers`` (:attr:`n_sublayers`).

    Raises:
        KeelError: from :meth:`validate` on an impossible shape or unknown scheme.

    Attributes (``keel config`` prints these):
        vocab_size: rows of the embedding and LM head: "auto" (the tokenizer's vocabulary rounded up to a
            multiple of vocab_multiple) or a count >= the tokenizer's vocabulary.
        vocab_multiple: with vocab_size "auto": round the vocabulary up to a multiple of this.
        d_model: width of the residual stream.
        n_layers: blocks (attention + FFN each); the paper's depth L is 2 * n_layers sub-layers.
        n_heads: attention (query) heads; head_dim = d_model / n_heads, even.
        n_kv_heads: key/value heads of grouped-query attention (divides n_heads).
        d_ff: hidden width of the SwiGLU FFN.
        max_seq_len: longest sequence in tokens (RoPE table size).
        rope_theta: RoPE base.
        norm_eps: epsilon of every RMSNorm.
        tie_embeddings: share the token embedding with the LM head.
        init_std: standard deviation of the N(0, init_std^2) weight init.
        embed_init_std: standard deviation of the token embedding's N(0, std^2) init; unset means init_std.
        residual: residual scheme, a name in keel.model.residual.SCHEMES (pre_ln, post_ln, deepnorm, keel, ...).
        alpha: Keel's residual scale (a number > 0); unset means L, the number of sub-layers.
        keel_first_layer_rule: Keel: sub-layer 0 is plain Pre-LN and sub-layer 1 uses alpha = 1.
        mix_ln_ratio: Mix-LN: the first floor(ratio * n_layers) blocks are Post-LN, the rest Pre-LN.
        peri_ln_embed_norm: Peri-LN: also RMS-normalise the embedding output.
        hc_streams: Hyper-Connections and mHC: expansion rate n, the number of residual streams.
        hc_dynamic: Hyper-Connections: dynamic (input-dependent) connections; false = static.
        mhc_sinkhorn_iters: mHC: Sinkhorn-Knopp iterations of the residual mixing matrix.
        attn_res_variant: Attention Residuals: "block" (Block AttnRes) or "full" (Full AttnRes).
        attn_res_blocks: Block AttnRes: N, the number of blocks the L sub-layers are cut into.
        attn_res_readout: Attention Residuals: the last hidden state, "attend" (depth attention) or "sum".
    """

    # "auto" (default): the tokenizer's vocabulary, rounded up to a multiple of vocab_multiple
    # (resolved when a run starts, see resolve_vocab_size); or an explicit count >= the tokenizer's.
    vocab_size: int | str = "auto"
    vocab_multiple: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 384
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # the token embedding's init std; unset (None) = init_std (the paper: N(0, 0.02^2) for every weight).
    # A larger value (e.g. 1.0) lets Pre-LN leave the unigram plateau early (docs/results/plateau.md).
    embed_init_std: float | None = None
    # a name in keel.model.residual.SCHEMES (checked by keel.model.residual.check_model_config)
    residual: str = "keel"
    # Keel's alpha (any float > 0); unset (None) means L, the number of sub-layers (paper, Sec. 3).
    alpha: float | None = None
    keel_first_layer_rule: bool = True
    # Mix-LN: the first floor(mix_ln_ratio * n_layers) blocks are Post-LN, the rest Pre-LN.
    mix_ln_ratio: float = 0.25
    # The residual bench (keel.model.residual: PeriLN, HyperConnections, ManifoldHyperConnections,
    # AttnRes): their own keys, checked by each scheme's check_config.
    peri_ln_embed_norm: bool = True
    hc_streams: int = 4
    hc_dynamic: bool = True
    mhc_sinkhorn_iters: int = 20
    attn_res_variant: str = "block"
    attn_res_blocks: int = 8
    attn_res_readout: str = "attend"

    @property
    def n_sublayers(self) -> int:
        """L, the number of sub-layers (attention + FFN), as the paper counts depth."""
        return 2 * self.n_layers

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def keel_alpha(self) -> float:
        """Keel's residual scale: ``alpha`` if set, else L = 2 * n_layers."""
        return float(self.alpha) if self.alpha is not None else float(self.n_sublayers)

    def validate(self) -> "ModelConfig":
        """Check the shape; return self. Raises KeelError naming the bad field.

        The residual scheme's name and its own keys are checked one layer up, by
        :func:`keel.model.residual.check_model_config`, where the list of schemes lives.
        """
        if self.vocab_size != "auto":
            _check(isinstance(self.vocab_size, int) and self.vocab_size >= 1, "model.vocab_size",
                   '"auto" or an integer >= 1', self.vocab_size)
        for name in ("vocab_multiple", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise KeelError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            _check(_finite(getattr(self, name)) and getattr(self, name) > 0, f"model.{name}", "a finite number > 0",
                   getattr(self, name))
        if self.embed_init_std is not None:
            _check(_finite(self.embed_init_std) and self.embed_init_std > 0, "model.embed_init_std",
                   "a finite number > 0 (or unset: init_std)", self.embed_init_std)
        if self.d_model % self.n_heads:
            raise KeelError(f"model.d_model ({self.d_model}) is not divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise KeelError(f"model.n_heads ({self.n_heads}) is not divisible by model.n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise KeelError(f"head dimension d_model/n_heads = {self.head_dim} must be even for RoPE")
        return self


@dataclass
class DataConfig:
    """Where the tokens come from; see ``keel prepare`` and :mod:`keel.data`.

    Attributes (``keel config`` prints these):
        source: the corpus: builtin:python-stdlib, a file or folder of text, or hf:NAME[:CONFIG].
        tokenizer: bpe:N (train an N-token byte-level BPE), a tokenizer.json path or a hub name.
        path: a prepared dataset folder (keel prepare --out); empty = prepare source+tokenizer in cache_dir.
        cache_dir: where prepared datasets are cached (relative to the working folder).
        val_fraction: fraction of documents held out for validation.
        max_bytes: read at most this many bytes of text from the source (0 = all).
        text_field: the field holding the text in .jsonl/.json/.parquet sources.
    """

    source: str = "builtin:python-stdlib"
    tokenizer: str = "bpe:8192"
    # A prepared dataset directory; empty means "derive it from source+tokenizer under cache_dir".
    path: str = ""
    cache_dir: str = "data"
    # Fraction of documents held out (long documents are first cut into chunks, see keel.data.prepare).
    val_fraction: float = DEFAULT_VAL_FRACTION
    # Limit on the text read from the source, in bytes (0 = no limit).
    max_bytes: int = 0
    text_field: str = "text"

    def validate(self) -> "DataConfig":
        """Check every key's range; return self. Raises KeelError naming the bad key."""
        _check(bool(self.source), "data.source", "a non-empty string", self.source)
        _check(bool(self.tokenizer), "data.tokenizer", "a non-empty string", self.tokenizer)
        _check(bool(self.path or self.cache_dir), "data.cache_dir", "a folder when data.path is empty",
               self.cache_dir)
        _check(_finite(self.val_fraction) and 0 < self.val_fraction < 1, "data.val_fraction",
               "between 0 and 1 (exclusive)", self.val_fraction)
        _check(self.max_bytes >= 0, "data.max_bytes", ">= 0 (0 = no limit)", self.max_bytes)
        _check(bool(self.text_field), "data.text_field", "a non-empty string", self.text_field)
        return self


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping. Defaults follow the paper's recipe (Sec. 5).

    Attributes (``keel config`` prints these):
        steps: optimiser steps to train for.
        lr: peak learning rate (after warm-up).
        min_lr: learning rate at the end of the decay.
        warmup_steps: steps of linear warm-up.
        schedule: LR after warm-up: cosine decays to min_lr; wsd holds lr, then decays exponentially to min_lr over the
            last decay_fraction of the steps; constant holds lr.
        decay_fraction: with schedule wsd: the fraction of the steps spent decaying.
        batch_size: sequences per micro-batch, over all processes.
        seq_len: tokens per training sequence.
        grad_accum: micro-batches per optimiser step.
        weight_decay: AdamW weight decay (matrices and embeddings only).
        beta1: AdamW beta1.
        beta2: AdamW beta2.
        grad_clip: clip the global gradient norm to this (0 = no clipping).
        eval_every: steps between validation-loss evaluations.
        eval_tokens: validation tokens per evaluation.
        checkpoint_every: steps between checkpoints.
        keep_checkpoints: newest checkpoints kept on disk (0 = keep every checkpoint).
        log_every: steps between progress lines when stderr is not a terminal.
        seed: seed of the init, the data order and sampling (0 to 2**32 - 1).
        device: auto | cpu | cuda | cuda:N.
        precision: auto = bf16-autocast on CUDA, fp32 elsewhere | fp32 | bf16-autocast (fp32 weights, bf16
            autocast) | bf16 (FSDP2: bf16 parameters for compute, fp32 gradient reduction and shards; else
            bf16-autocast).
        max_bad_steps: stop after this many non-finite steps in a row.
        sample_tokens: tokens sampled from the final model into sample.txt.
        sample_prompt: prompt of that sample; empty = a new document (the sample starts after <|endoftext|>).
        progress: show training progress (a bar on a terminal, else plain lines).
        stop_on_divergence: stop when the divergence classifier fires.
        divergence_warnings: log the divergence classifier's verdicts.
        gradflow_every: log per-sub-layer gradient norms every N steps (0 = never).
        parallelism: how several processes train (torchrun / --nproc).
        activation_checkpointing: recompute activations in backward: in every block, or every checkpoint_k-th (every_k).
        checkpoint_k: with every_k: checkpoint every k-th block.
        compile: torch.compile the model.
        eval_tasks: comma-separated lm-evaluation-harness tasks scored during training.
        eval_tasks_every: steps between task evaluations (0 = never).
        eval_tasks_limit: examples per task in those evaluations.
        loggers: where metrics go: jsonl (always), tensorboard (RUN/tensorboard), wandb (RUN/wandb).
        wandb_mode: W&B mode; an offline run is uploaded later with `wandb sync`.
        wandb_project: W&B project name.
    """

    steps: int = 1000
    lr: float = 3e-3
    min_lr: float = 1e-7
    warmup_steps: int = 100
    # LR schedule after warm-up (keel.train.optim.lr_at): "cosine" to min_lr over the run;
    # "wsd" (warmup-stable-decay, MiniCPM): lr until the last decay_fraction of the steps, then an
    # exponential decay to min_lr; "constant": lr.
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.1
    batch_size: int = 16  # sequences per micro-batch
    seq_len: int = 128  # tokens per sequence
    grad_accum: int = 1
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100  # steps
    eval_tokens: int = 65536  # validation tokens per evaluation
    checkpoint_every: int = 250  # steps
    keep_checkpoints: int = 2  # newest checkpoints kept on disk (0 = keep all)
    log_every: int = 10  # steps
    seed: int = 1337
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    # "auto" = bf16-autocast on CUDA, fp32 elsewhere; "fp32"; "bf16-autocast"; "bf16" (FSDP2
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), as torchtitan; bf16-autocast without FSDP).
    precision: Literal["auto", "fp32", "bf16-autocast", "bf16"] = "auto"
    max_bad_steps: int = 10
    sample_tokens: int = 64
    sample_prompt: str = ""
    progress: bool = True
    # Stability diagnostics (keel.diagnostics): stop when the divergence classifier fires;
    # log per-sub-layer gradient norms every N steps (0 = never).
    stop_on_divergence: bool = False
    divergence_warnings: bool = True
    # A finished run directory whose training-loss curve is the divergence classifier's
    # reference (enables "optimisation degradation"); "" = none (keel.diagnostics.divergence).
    divergence_reference: str = ""
    gradflow_every: int = 0
    # Scale-out (keel.train.parallelize): "ddp" | "fsdp" when launched with torchrun;
    # activation checkpointing "none" | "block" | "every_k" (every k-th block); torch.compile.
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    activation_checkpointing: Literal["none", "block", "every_k"] = "none"
    checkpoint_k: int = 2
    compile: bool = False
    # Periodic benchmark evaluation with lm-evaluation-harness (keel.eval): comma-separated
    # task names, every N steps (0 = never), at most `eval_tasks_limit` examples per task.
    eval_tasks: str = ""
    eval_tasks_every: int = 0
    eval_tasks_limit: int = 100
    # Experiment tracking (keel.train.loggers): where every metrics record goes, besides
    # metrics.jsonl: "tensorboard" (RUN/tensorboard), "wandb" (RUN/wandb, train.wandb_mode).
    loggers: list[Literal["jsonl", "tensorboard", "wandb"]] = field(default_factory=lambda: ["jsonl"])
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"  # W&B: "offline" = sync later
    wandb_project: str = "keel"  # W&B project name

    def validate(self) -> "TrainConfig":
        """Check every key's range; return self. Raises KeelError naming the bad key.

        Keys declared with ``Literal[...]`` (``schedule``, ``precision``, ``parallelism``,
        ``activation_checkpointing``, ``loggers``, ``wandb_mode``) are checked against that
        declaration (:func:`check_choices`). ``device`` and the cross-section
        ``seq_len <= model.max_seq_len`` are checked by :func:`keel.train.trainer.check_train_config`.
        """
        check_choices(self, "train")
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "eval_tokens",
                     "checkpoint_every", "log_every", "max_bad_steps", "checkpoint_k", "eval_tasks_limit"):
            _check(getattr(self, name) >= 1, f"train.{name}", ">= 1", getattr(self, name))
        for name in ("warmup_steps", "keep_checkpoints", "sample_tokens", "gradflow_every", "eval_tasks_every"):
            _check(getattr(self, name) >= 0, f"train.{name}", ">= 0", getattr(self, name))
        _check(_finite(self.lr) and self.lr > 0, "train.lr", "a finite number > 0", self.lr)
        _check(_finite(self.min_lr) and 0 <= self.min_lr <= self.lr, "train.min_lr",
               f"a finite number between 0 and train.lr ({self.lr})", self.min_lr)
        _check(_finite(self.decay_fraction) and 0 < self.decay_fraction <= 1, "train.decay_fraction",
               "in (0, 1]", self.decay_fraction)
        if self.schedule == "wsd":
            _check(self.min_lr > 0, "train.min_lr", "> 0 with train.schedule = \"wsd\" (exponential decay)",
                   self.min_lr)
        _check(_finite(self.weight_decay) and self.weight_decay >= 0, "train.weight_decay", "a finite number >= 0",
               self.weight_decay)
        for name in ("beta1", "beta2"):
            _check(_finite(getattr(self, name)) and 0 <= getattr(self, name) < 1, f"train.{name}", "in [0, 1)",
                   getattr(self, name))
        _check(_finite(self.grad_clip) and self.grad_clip >= 0, "train.grad_clip", "a finite number >= 0 (0 = off)",
               self.grad_clip)
        _check(0 <= self.seed < 2**32, "train.seed", "between 0 and 2**32 - 1 (numpy's seed range)", self.seed)
        return self


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested plain dicts; unset optional values (None) are left out, as TOML has no null."""
        out = {}
        for s in ("model", "data", "train"):
            out[s] = {k: v for k, v in dataclasses.asdict(getattr(self, s)).items() if v is not None}
        return out


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}


def _coerce_names(where: str, value: Any) -> list[str]:
    """A list of names (``train.loggers``) from a TOML array or a string ``"a,b"``."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise KeelError(f"{where} must be a list of strings, got {value!r}")
    return [v.strip() for v in items if v.strip()]


def _coerce_vocab(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return _coerce("model", "vocab_size_int", value, 0)
    except KeelError:
        raise KeelError(f'model.vocab_size must be "auto" or an integer, got {value!r}') from None


def _coerce_field(section: str, key: str, value: Any, current: Any) -> Any:
    """``value`` as the type of the field's default ``current``: a list of names (``train.loggers``)
    or a scalar (:func:`_coerce`)."""
    if isinstance(current, list):
        return _coerce_names(f"{section}.{key}", value)
    return _coerce(section, key, value, current)


def _coerce(section: str, key: str, value: Any, current: Any) -> Any:
    """Convert ``value`` to the type of the field's default ``current``."""
    where = f"{section}.{key}"
    if (section, key) == ("model", "vocab_size"):  # "auto" or an integer
        return _coerce_vocab(value)
    if current is None:  # optional numbers (model.alpha)
        current = 0.0
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise KeelError(f"{where} must be true or false, got {value!r}")
    if isinstance(current, int):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise KeelError(f"{where} must be an integer, got {value!r}")
    if isinstance(current, float):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise KeelError(f"{where} must be a number, got {value!r}") from None
    if isinstance(current, str):
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise KeelError(f"{where} must be a string, got {value!r}")
        return str(value)
    raise AssertionError(f"unsupported field type for {where}")  # pragma: no cover


def config_from_dict(d: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from nested dicts (e.g. parsed TOML).

    Raises:
        KeelError: on an unknown section or key, or a value of the wrong type.
    """
    cfg = Config()
    for section, values in d.items():
        if section not in _SECTIONS:
            raise KeelError(f"unknown config section [{section}] (expected model, data, train)")
        if not isinstance(values, dict):
            raise KeelError(f"config section [{section}] must be a table")
        obj = getattr(cfg, section)
        for key, value in values.items():
            if not hasattr(obj, key) or key.startswith("_"):
                raise KeelError(f"unknown config key {section}.{key}")
            setattr(obj, key, _coerce_field(section, key, value, getattr(obj, key)))
    cfg.model.validate()
    cfg.data.validate()
    cfg.train.validate()
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML config (default: the dataclass defaults) and apply ``overrides``.

    Args:
        path: a TOML file with any of the sections model/data/train; None = built-in defaults.
        overrides: strings ``section.key=value``; values are parsed as TOML scalars when
            possible (``1e-3``, ``true``, ``"x"``), else taken as plain strings.

    Raises:
        KeelError: missing/unparsable file, unknown key, bad value.
    """
    d: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise KeelError(f"config file not found: {p}")
        try:
            d = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise KeelError(f"cannot parse config {p}: {e}") from None
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise KeelError(f"--set expects section.key=value, got {item!r}")
        lhs, raw = item.split("=", 1)
        section, key = lhs.strip().split(".", 1)
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        d.setdefault(section, {})[key] = value
    return config_from_dict(d)


def dump_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as TOML, atomically (temp file, then rename)."""
    from keel.io import atomic_write_text

    atomic_write_text(path, tomli_w.dumps(cfg.to_dict()))


DEFAULT_PRESET = "demo"


def _preset_dir(kind: str = ""):
    """The packaged preset folder (a ``importlib.resources`` Traversable): ``keel/configs``
    or, with ``kind="sweeps"``, ``keel/configs/sweeps``."""
    from importlib.resources import files

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
        if not p.is_file():
            raise KeelError(f"config file not found: {p}")
        return p
    preset = _preset_dir(kind) / f"{name}.toml"
    if preset.is_file():
        return Path(str(preset))
    what = {"sweeps": "sweep preset", "studies": "study"}.get(kind, "config")
    known = ", ".join(preset_names(kind)) or "none found"
    raise KeelError(f"unknown {what} {name!r}: not a file and not a shipped preset ({known})")


def _docstring_attributes(cls) -> dict[str, str]:
    """``{field: help}`` from the ``Attributes`` section of ``cls``'s docstring."""
    import inspect

    out: dict[str, str] = {}
    lines = (inspect.getdoc(cls) or "").splitlines()
    if not any(ln.startswith("Attributes") for ln in lines):
        return out
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Attributes")) + 1
    last = None
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        name, sep, text = line.strip().partition(": ")
        if line.startswith("        ") and last:  # continuation line
            out[last] += " " + line.strip()
        elif sep and name.isidentifier():
            out[name], last = text, name
    return out


def _field_comments(cls) -> dict[str, str]:
    """``{field: help}`` from the comments in ``cls``'s source: a field's trailing comment,
    else the block of comment lines right above it."""
    import inspect
    import io
    import tokenize

    comments: dict[int, str] = {}
    source = inspect.getsource(cls)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for i, line in enumerate(lines, start=1):
        name = line.strip().split(":", 1)[0]
        if not line.startswith("    ") or line.startswith("     ") or not name.isidentifier():
            continue
        if i in comments:
            out[name] = comments[i]
            continue
        block, j = [], i - 1
        while j in comments and lines[j - 1].strip().startswith("#"):
            block.insert(0, comments[j])
            j -= 1
        out[name] = " ".join(block)
    return out


def describe_config() -> list[dict[str, Any]]:
    """Every config key, read from the dataclasses themselves: ``[{"key": "model.d_model",
    "type": "int", "default": 128, "choices": None, "help": "..."}]`` in section and field order;
    a field declared ``Literal[...]`` has its allowed values as ``choices`` and as its ``type``
    (``"'cosine' | 'wsd' | 'constant'"``, ``"list of 'jsonl' | ..."``). ``help`` is
    the field's ``metadata["help"]`` if it has one, else its entry in the class docstring's
    ``Attributes`` section, else its comment in this file (trailing, or the comment block
    above it); ``default`` is the dataclass default (None = unset)."""
    out = []
    for section, cls in _SECTIONS.items():
        comments = {**_field_comments(cls), **_docstring_attributes(cls)}
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            allowed = choices(cls, f.name)
            kind = str(f.type) if allowed is None else _choices_text(allowed)
            if allowed is not None and str(f.type).startswith("list["):
                kind = f"list of {kind}"
            out.append({"key": f"{section}.{f.name}", "type": kind, "default": default, "choices": allowed,
                        "help": f.metadata.get("help") or comments.get(f.name, "")})
    return out

"""Run configuration: three TOML sections, ``[model]``, ``[data]`` and ``[train]``.

Presets are data: the files in ``configs/`` (``configs/demo.toml`` is the default).
A config is loaded with :func:`load_config`, overridden with ``--set section.key=value``
strings (:func:`apply_overrides`) and written back as the resolved ``config.toml`` of a
run (:func:`dump_config`). Unknown sections or keys, and values of the wrong type, raise
:class:`keel.errors.KeelError` naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from keel.errors import KeelError

RESIDUALS = ("pre_ln", "post_ln", "deepnorm", "keel", "hybridnorm", "mix_ln")


@dataclass
class ModelConfig:
    """Shape and residual scheme of the decoder-only LM.

    Depth: ``n_layers`` counts blocks; each block is an attention sub-layer plus an FFN
    sub-layer, so the paper's L (sub-layers) is ``2 * n_layers`` (:attr:`n_sublayers`).

    Raises:
        KeelError: from :meth:`validate` on an impossible shape or unknown scheme.
    """

    vocab_size: int = 8192
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
    # "pre_ln" | "post_ln" | "deepnorm" | "keel" | "hybridnorm" | "mix_ln" (keel.model.residual)
    residual: str = "keel"
    # Keel's alpha (any float > 0); unset (None) means L, the number of sub-layers (paper, Sec. 3).
    alpha: float | None = None
    keel_first_layer_rule: bool = True
    # Mix-LN: the first floor(mix_ln_ratio * n_layers) blocks are Post-LN, the rest Pre-LN.
    mix_ln_ratio: float = 0.25

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
        """Check the shape; return self. Raises KeelError naming the bad field."""
        if self.residual not in RESIDUALS:
            raise KeelError(f"unknown model.residual {self.residual!r} (choose from {', '.join(RESIDUALS)})")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise KeelError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise KeelError(f"model.d_model ({self.d_model}) is not divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise KeelError(f"model.n_heads ({self.n_heads}) is not divisible by model.n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise KeelError(f"head dimension d_model/n_heads = {self.head_dim} must be even for RoPE")
        if self.alpha is not None and not (math.isfinite(self.alpha) and self.alpha > 0):
            raise KeelError(f"model.alpha must be a finite number > 0 (omit it for the default L), got {self.alpha}")
        if not self.init_std > 0:
            raise KeelError(f"model.init_std must be > 0, got {self.init_std}")
        return self


@dataclass
class DataConfig:
    """Where the tokens come from; see ``keel prepare`` and :mod:`keel.data`."""

    source: str = "builtin:python-stdlib"
    tokenizer: str = "bpe:8192"
    # A prepared dataset directory; empty means "derive it from source+tokenizer under cache_dir".
    path: str = ""
    cache_dir: str = "data"
    val_fraction: float = 0.01  # fraction of documents held out
    # Limit on the text read from the source, in bytes (0 = no limit).
    max_bytes: int = 0
    text_field: str = "text"


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping. Defaults follow the paper's recipe (Sec. 5)."""

    steps: int = 1000
    lr: float = 3e-3
    min_lr: float = 1e-7
    warmup_steps: int = 100
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
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    log_every: int = 10  # steps
    seed: int = 1337
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    # "auto" = bf16 autocast on CUDA, fp32 on CPU; or "fp32" / "bf16".
    precision: str = "auto"
    max_bad_steps: int = 10
    sample_tokens: int = 64
    sample_prompt: str = "def "
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
    parallelism: str = "ddp"
    activation_checkpointing: str = "none"
    checkpoint_k: int = 2
    compile: bool = False
    # Periodic benchmark evaluation with lm-evaluation-harness (keel.eval): comma-separated
    # task names, every N steps (0 = never), at most `eval_tasks_limit` examples per task.
    eval_tasks: str = ""
    eval_tasks_every: int = 0
    eval_tasks_limit: int = 100


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


def _coerce(section: str, key: str, value: Any, current: Any) -> Any:
    """Convert ``value`` to the type of the field's default ``current``."""
    where = f"{section}.{key}"
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
            setattr(obj, key, _coerce(section, key, value, getattr(obj, key)))
    cfg.model.validate()
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML config (default: ``configs/demo.toml`` values) and apply ``overrides``.

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

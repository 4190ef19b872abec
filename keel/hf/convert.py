"""Run directory <-> Hugging Face folder (``keel export-hf`` / ``keel import-hf``).

An exported folder holds::

    OUT/config.json               KeelConfig (model_type "keel": every ModelConfig field)
    OUT/generation_config.json    eos/pad token ids
    OUT/model.safetensors         weights, names prefixed "model." (tied embeddings stored once)
    OUT/tokenizer.json            the run's tokenizer
    OUT/tokenizer_config.json     PreTrainedTokenizerFast, eos_token "<|endoftext|>"
    OUT/special_tokens_map.json   (written by older transformers versions)
    OUT/keel_config.toml          the run's resolved config.toml (data and train sections too)

Loading it needs ``import keel.hf`` first (registration of ``model_type = "keel"``); the
folder carries no modeling code, so ``trust_remote_code`` is neither needed nor enough.
``AutoTokenizer.from_pretrained(OUT)`` works without keel. Both folders are written into a
temporary sibling folder and renamed into place, so a failed conversion leaves nothing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from keel.data.prepare import EOS_TOKEN
from keel.errors import KeelError
from keel.io import chmod_default, make_temp_dir

KEEL_CONFIG_NAME = "keel_config.toml"


def _check_output(out: Path) -> None:
    """Raise KeelError if ``out`` exists and is not an empty folder."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KeelError(f"output {out} already exists and is not empty; choose another --out")


def _fresh_output(out: Path) -> Path:
    """A temporary folder beside ``out``; raises KeelError if ``out`` exists and is not empty."""
    _check_output(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return make_temp_dir(out.parent, out.name)


def _move_into_place(tmp: Path, out: Path) -> None:
    if out.exists():  # an empty folder
        out.rmdir()
    os.replace(tmp, out)


def eos_token_of(tokenizer, run_dir: Path | None = None) -> str:
    """The end-of-text token of a ``tokenizers.Tokenizer``: ``<|endoftext|>`` if in its vocabulary,
    else the token of ``eos_id`` in the meta.json of the run's dataset. Raises KeelError if neither."""
    if tokenizer.token_to_id(EOS_TOKEN) is not None:
        return EOS_TOKEN
    if run_dir is not None:
        try:
            from keel.config import load_config
            from keel.data import read_meta

            cfg = load_config(run_dir / "config.toml")
            if cfg.data.path:
                token = tokenizer.id_to_token(int(read_meta(cfg.data.path)["eos_id"]))
                if token is not None:
                    return token
        except (KeelError, KeyError, ValueError, OSError):
            pass
    raise KeelError(f"tokenizer has no {EOS_TOKEN!r} token and the run's dataset meta.json (eos_id) is not readable")


def hf_tokenizer(tokenizer_file: str | Path, eos_token: str = EOS_TOKEN, model_max_length: int | None = None):
    """A ``transformers.PreTrainedTokenizerFast`` over a ``tokenizer.json`` file; pad = eos, no BOS."""
    from transformers import PreTrainedTokenizerFast

    kwargs = {"model_max_length": model_max_length} if model_max_length else {}
    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token=eos_token, pad_token=eos_token,
                                   **kwargs)


def wrap_native(model, tokenizer, eos_token: str | None = None):
    """(KeelForCausalLM sharing ``model``'s weights, PreTrainedTokenizerFast) for a native
    :class:`keel.model.Transformer` and its ``tokenizers.Tokenizer``.

    The HF tokenizer is built from ``tokenizer.to_str()`` (no file needed); eos/pad token ids
    are set on the model's config and generation config.
    """
    from transformers import PreTrainedTokenizerFast

    from keel.hf.modeling import KeelForCausalLM

    eos = eos_token or eos_token_of(tokenizer)
    eos_id = tokenizer.token_to_id(eos)
    # split_special_tokens: a literal "<|endoftext|>" in a task's text is text, as in
    # keel.data.text.encode_text (what training, eval and generate use)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=_copy_tokenizer(tokenizer), eos_token=eos, pad_token=eos,
                                     model_max_length=model.cfg.max_seq_len, split_special_tokens=True)
    hf = KeelForCausalLM.from_native(model, eos_token_id=eos_id, pad_token_id=eos_id)
    hf.generation_config.eos_token_id = eos_id
    hf.generation_config.pad_token_id = eos_id
    return hf, hf_tok


def _copy_tokenizer(tokenizer):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer.to_str())


def export_hf(run_dir: str | Path, out: str | Path) -> Path:
    """Write the latest checkpoint of run ``run_dir`` as a Hugging Face folder ``out`` (see module doc).

    Returns ``out``. Raises KeelError: not a run directory, no checkpoint, no end-of-text
    token, or ``out`` exists and is not empty.
    """
    from keel.run import Run

    run_dir, out = Path(run_dir), Path(out)
    _check_output(out)
    run = Run(run_dir)
    model, tokenizer = run.load_model(device="cpu"), run.tokenizer()
    eos = eos_token_of(tokenizer, run_dir)
    hf, _ = wrap_native(model, tokenizer, eos)
    hf.config.keel_step = _checkpoint_step(run)  # config.json keeps the step (import-hf restores it)
    tmp = _fresh_output(out)
    try:
        hf.save_pretrained(tmp, safe_serialization=True)
        for weights in tmp.glob("*.safetensors"):
            chmod_default(weights)  # safetensors writes 0600; every other file follows the umask
        hf_tokenizer(run_dir / "tokenizer.json", eos, model.cfg.max_seq_len).save_pretrained(tmp)
        shutil.copyfile(run_dir / "config.toml", tmp / KEEL_CONFIG_NAME)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_hf(path: str | Path, device: str = "auto"):
    """Load a keel Hugging Face folder: ``(KeelForCausalLM in eval mode on device, PreTrainedTokenizerFast, device)``.

    Raises KeelError if ``path`` is not a folder with a keel ``config.json`` and a tokenizer.
    """
    import keel.hf  # noqa: F401  (registers model_type "keel")
    from transformers import AutoConfig, AutoTokenizer

    from keel.hf.modeling import KeelForCausalLM
    from keel.train.device import resolve_device

    path = Path(path)
    if not (path / "config.json").is_file():
        raise KeelError(f"not a Hugging Face model folder (no config.json): {path}")
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as e:
        raise KeelError(f"cannot read {path / 'config.json'}: {e}") from None
    if getattr(config, "model_type", None) != "keel":
        raise KeelError(f"{path} holds a {getattr(config, 'model_type', '?')!r} model, not a keel model "
                        "(model_type 'keel', written by `keel export-hf`)")
    dev = resolve_device(device, key="--device")
    model = KeelForCausalLM.from_pretrained(path).to(dev).eval()
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError) as e:
        raise KeelError(f"cannot load the tokenizer of {path}: {e}") from None
    return model, tok, dev


def _checkpoint_step(run) -> int:
    """The step of the run's latest checkpoint (0 if its trainer state does not say)."""
    from keel.train.checkpoint import load_trainer_state

    ckpt = run.latest_checkpoint()
    try:
        return int(load_trainer_state(ckpt).get("step", 0)) if ckpt is not None else 0
    except KeelError:
        return 0


def import_hf(hf_dir: str | Path, out: str | Path) -> Path:
    """Create a run directory ``out`` from a keel Hugging Face folder ``hf_dir``.

    Writes ``out/config.toml`` (the exported ``keel_config.toml`` if present, with its
    model section replaced by ``config.json``'s fields; else default data/train sections
    whose ``data.tokenizer`` is ``out/tokenizer.json``), ``out/tokenizer.json`` and the
    weights as a checkpoint of the step the export came from (``keel_step`` in
    ``config.json``, 0 when absent; ``checkpoints/step_NNNNNNNN/model.safetensors`` via
    :func:`keel.train.checkpoint.save_checkpoint`; its trainer state holds no optimiser,
    so the run serves ``keel generate`` and ``keel eval`` but cannot be resumed).

    Returns ``out``. Raises KeelError: not a keel folder, no tokenizer.json, or ``out``
    exists and is not empty.
    """
    import dataclasses

    from keel.config import Config, dump_config, load_config
    from keel.train.checkpoint import save_checkpoint

    hf_dir, out = Path(hf_dir), Path(out)
    _check_output(out)
    model, _, _ = load_hf(hf_dir, device="cpu")
    if not (hf_dir / "tokenizer.json").is_file():
        raise KeelError(f"{hf_dir} has no tokenizer.json (a fast tokenizer file is needed for a keel run)")
    model_cfg = model.config.to_model_config()
    tmp = _fresh_output(out)
    try:
        shutil.copyfile(hf_dir / "tokenizer.json", tmp / "tokenizer.json")
        if (hf_dir / KEEL_CONFIG_NAME).is_file():
            cfg = load_config(hf_dir / KEEL_CONFIG_NAME)
        else:
            cfg = Config()
            cfg.data.tokenizer = str((out / "tokenizer.json").resolve())
        cfg.model = dataclasses.replace(model_cfg)
        dump_config(cfg, tmp / "config.toml")
        step = int(getattr(model.config, "keel_step", 0) or 0)
        save_checkpoint(tmp, step, model.model, {"step": step, "tokens": 0, "imported_from": str(hf_dir.resolve())})
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out



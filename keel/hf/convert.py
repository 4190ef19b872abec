"""Run directory <-> Hugging Face folder (``keel export-hf`` / ``keel import-hf``).

An exported folder holds::

    OUT/config.json               KeelConfig (model_type "keel": every ModelConfig field) with
                                  auto_map -> the two generated files below; for a pre_ln run:
                                  a stock LlamaConfig (model_type "llama"), no custom code; both
                                  with keel_step and keel_tokens (the checkpoint's step, tokens trained)
    OUT/configuration_keel_H.py   generated from keel's source (keel.hf.remote; not for pre_ln);
    OUT/modeling_keel_H.py        H = a hash of their content, so exports never share a module
    OUT/generation_config.json    eos/pad token ids
    OUT/model.safetensors         weights (tied embeddings stored once)
    OUT/tokenizer.json            the run's tokenizer
    OUT/tokenizer_config.json     PreTrainedTokenizerFast, eos_token "<|endoftext|>", split_special_tokens
                                  (a literal "<|endoftext|>" in text is text, as everywhere in keel)
    OUT/keel_config.toml          the run's resolved config.toml (data and train sections too;
                                  data.path = the absolute path of its prepared dataset, if found)

Three ways to load it: ``import keel.hf`` then ``AutoModelForCausalLM.from_pretrained(OUT)``
(keel's installed code); ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)``
anywhere transformers is installed (the generated code); a pre_ln export is a plain
``LlamaForCausalLM`` (:mod:`keel.hf.llama`). ``AutoTokenizer.from_pretrained(OUT)`` works
without keel. ``keel import-hf`` reads such a folder, or any stock Llama folder, into a run
that ``keel train --resume`` continues. Both folders are written into a temporary sibling
folder and renamed into place, so a failed conversion leaves nothing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import shutil
from pathlib import Path

import torch
import transformers.utils.logging as hf_logging
from tokenizers import Tokenizer
from safetensors import safe_open
from transformers import LlamaConfig, PreTrainedTokenizerFast

import keel.hf  # noqa: F401  (registers model_type "keel")
from keel.config import dump_config, load_config, max_loops, max_loops_words
from keel.data import find_data, read_meta
from keel.data.prepare import EOS_TOKEN
from keel.errors import KeelError
from keel.hf.configuration import KeelConfig
from keel.hf.llama import from_llama, read_safetensors, to_llama
from keel.hf.modeling import KeelForCausalLM
from keel.hf.remote import write_remote_code
from keel.io import (HF_TOKENIZER, atomic_dir, atomic_write_text, check_output_not_in_checkpoints, check_path_names,
                     chmod_default, load_hf_tokenizer, make_dirs, weights_load_errors)
from keel.model import Transformer
from keel.run import Run
from keel.rundir import RunDir
from keel.train import state_dict as SD
from keel.train.checkpoint import CheckpointManager, NonFiniteWeights
from keel.train.device import resolve_device
from keel.train.optim import build_optimizer
from keel.train.progress import interactive
from keel.train.trainer import check_train_config

KEEL_CONFIG_NAME = "keel_config.toml"
KEEL_TIED = frozenset(KeelForCausalLM._tied_weights_keys)  # stored once, as the embedding

log = logging.getLogger(__name__)


@contextlib.contextmanager
def hf_progress_bars(enabled: bool):
    """transformers' own progress bars (writing / loading weights) on or off for the duration;
    keel turns them off when stderr is not a terminal (:func:`keel.train.progress.interactive`)."""
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def _check_output(out: Path) -> None:
    """Raise KeelError if ``out`` exists and is not an empty folder, or lies inside a run's
    ``checkpoints`` folder (whose pruning would delete it later: :func:`keel.io.check_output_not_in_checkpoints`)."""
    check_path_names(out, "--out", room=14)  # atomic_dir's .NAME.XXXXXXXX.tmp beside it
    check_output_not_in_checkpoints(out, "--out")
    if out.exists() and not out.is_dir():  # an empty file read "is not empty"
        raise KeelError(f"output {out} is a file, not a folder; choose another --out")
    if out.exists() and any(out.iterdir()):
        raise KeelError(f"output {out} already exists and is not empty; choose another --out")


def _fresh_output(out: Path):
    """:func:`keel.io.atomic_dir` for ``out``: a temporary folder that becomes ``out`` when
    the block succeeds. Raises KeelError if ``out`` exists and is not an empty folder."""
    _check_output(out)
    make_dirs(out.parent)
    return atomic_dir(out)


def eos_token_of(tokenizer, run_dir: Path | None = None) -> str:
    """The end-of-text token of a ``tokenizers.Tokenizer``: ``<|endoftext|>`` if in its vocabulary,
    else the token of ``eos_id`` in the meta.json of the run's dataset. Raises KeelError if neither."""
    if tokenizer.token_to_id(EOS_TOKEN) is not None:
        return EOS_TOKEN
    if run_dir is not None:
        try:
            cfg = load_config(RunDir(run_dir).config, stored=True)
            if cfg.data.path:
                token = tokenizer.id_to_token(int(read_meta(cfg.data.path)["eos_id"]))
                if token is not None:
                    return token
        except (KeelError, KeyError, ValueError, OSError):
            pass
    raise KeelError(f"tokenizer has no {EOS_TOKEN!r} token and the run's dataset meta.json (eos_id) is not readable")


def hf_tokenizer(tokenizer_file: str | Path, eos_token: str = EOS_TOKEN, model_max_length: int | None = None):
    """A ``transformers.PreTrainedTokenizerFast`` over a ``tokenizer.json`` file; pad = eos, no BOS;
    ``split_special_tokens``: a literal ``<|endoftext|>`` in text is text, as in
    :func:`keel.data.text.encode_text` (save it with :func:`save_hf_tokenizer`)."""
    kwargs = {"model_max_length": model_max_length} if model_max_length else {}
    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token=eos_token, pad_token=eos_token,
                                   split_special_tokens=True, **kwargs)


def save_hf_tokenizer(hf_tok, folder: Path) -> None:
    """``hf_tok.save_pretrained(folder)``, with ``"split_special_tokens": true`` in its
    ``tokenizer_config.json`` (transformers 5 does not save it; ``AutoTokenizer`` reads it),
    so that a stock ``AutoTokenizer`` / lm-eval on the export tokenizes exactly as keel does, and
    ``"tokenizer_class": "PreTrainedTokenizerFast"``, the class name transformers 4 and 5 both know."""
    hf_tok.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["split_special_tokens"] = True
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # 5's own name, TokenizersBackend, is unknown to transformers 4
    atomic_write_text(path, json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def wrap_native(model, tokenizer, eos_token: str | None = None):
    """(KeelForCausalLM sharing ``model``'s weights, PreTrainedTokenizerFast) for a native
    :class:`keel.model.Transformer` and its ``tokenizers.Tokenizer``.

    The HF tokenizer is built from ``tokenizer.to_str()`` (no file needed); eos/pad token ids
    are set on the model's config and generation config.
    """
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
    return Tokenizer.from_str(tokenizer.to_str())


def export_hf(run_dir: str | Path, out: str | Path) -> Path:
    """Write the latest checkpoint of run ``run_dir`` as a Hugging Face folder ``out`` (see module doc).

    A ``pre_ln`` run (not looped) becomes a stock ``LlamaForCausalLM``; any other a KeelForCausalLM
    with its generated modeling code (:mod:`keel.hf.remote`) and ``auto_map``.

    Returns ``out``. Raises KeelError: not a run directory, no checkpoint, no end-of-text
    token, or ``out`` exists and is not empty.
    """
    run_dir, out = Path(run_dir), Path(out)
    _check_output(out)
    run = Run(run_dir)
    ckpt = run.latest_checkpoint()  # once: each look warns again about a damaged newer checkpoint
    if ckpt is None:  # load_model(checkpoint=None) would look (and warn) a second time
        raise run.no_checkpoint_error()
    model, tokenizer = run.load_model(device="cpu", checkpoint=ckpt), run.tokenizer()
    eos = eos_token_of(tokenizer, run_dir)
    llama = model.cfg.residual == "pre_ln" and not model.cfg.loop_core  # a stock Llama does not loop
    if llama:
        eos_id = tokenizer.token_to_id(eos)
        hf = to_llama(model, eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None)
        _set_generation_ids(hf, eos_id)
    else:
        hf, _ = wrap_native(model, tokenizer, eos)
    # config.json keeps the step and the tokens trained (import-hf restores them)
    hf.config.keel_step, hf.config.keel_tokens = run.checkpoint_progress(ckpt) or (0, 0)
    with _fresh_output(out) as tmp:
        with hf_progress_bars(interactive()):
            hf.save_pretrained(tmp, safe_serialization=True)
        for weights in tmp.glob("*.safetensors"):
            chmod_default(weights)  # safetensors writes 0600; every other file follows the umask
        if llama:
            _add_legacy_rope_theta(tmp / "config.json")
        else:
            write_remote_code(tmp)
        save_hf_tokenizer(hf_tokenizer(RunDir(run_dir).tokenizer, eos, model.cfg.max_seq_len), tmp)
        _write_keel_config(run.config, tmp / KEEL_CONFIG_NAME)
    return out


def _add_legacy_rope_theta(path: Path) -> None:
    """Add the top-level ``rope_theta`` of a Llama ``config.json`` beside the ``rope_parameters`` that
    transformers 5 writes alone: readers of the older format (transformers 4, checkpoint converters) took
    the default base 10,000 without it; transformers 5 reads ``rope_parameters`` and ignores it."""
    config = json.loads(path.read_text(encoding="utf-8"))
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    atomic_write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_keel_config(cfg, path: Path) -> None:
    """The run's config, with ``data.path`` set to the absolute path of its prepared dataset
    when that exists here (so ``keel eval --hf`` finds it from any folder)."""
    cfg = copy.deepcopy(cfg)
    data = find_data(cfg)
    if data is not None:
        cfg.data.path = str(Path(data).resolve())
    dump_config(cfg, path)


def _set_generation_ids(hf, eos_id: int) -> None:
    hf.generation_config.eos_token_id = eos_id
    hf.generation_config.pad_token_id = eos_id
    hf.generation_config.bos_token_id = None


def _read_config_json(path: Path) -> dict:
    if not (path / "config.json").is_file():
        raise KeelError(f"not a Hugging Face model folder (no config.json): {path}")
    try:
        return json.loads((path / "config.json").read_text())
    except (ValueError, OSError) as e:
        raise KeelError(f"cannot read {path / 'config.json'}: {e}") from None


def _stored_shapes(path: Path) -> tuple[list[Path], dict[str, tuple]]:
    """The ``*.safetensors`` files of ``path`` (sorted) and the shape of each tensor their headers name
    (no weights read).

    Raises:
        KeelError: an unreadable or damaged file (:func:`keel.io.weights_load_errors`).
    """
    files = sorted(path.glob("*.safetensors"))
    stored: dict[str, tuple] = {}
    with weights_load_errors(path):
        for f in files:
            with safe_open(str(f), "pt") as st:
                stored.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    return files, stored


def _check_weights_match_config(path: Path, config: KeelConfig) -> None:
    """Compare the tensors named in the headers of ``path/*.safetensors`` (no weights read) with
    those the model of ``config`` (config.json) has: ``transformers`` initialised blocks beyond the
    file's at random (exit 0) and raised a traceback on a changed ``d_model``.

    Raises:
        KeelError: one line: the block counts differ ("config.json says N layers; model.safetensors
            holds weights for M"), a tensor's shape differs (named, both shapes), or tensors are missing
            (the tied ``lm_head`` of a model with ``tie_embeddings`` excepted); unreadable weights
            (:func:`keel.io.weights_load_errors`). A folder without ``*.safetensors`` passes (the
            loader reports it).
    """
    files, stored = _stored_shapes(path)
    if not files:
        return
    with torch.device("meta"):
        wanted = {f"model.{k}": tuple(v.shape) for k, v in Transformer(config.to_model_config()).state_dict().items()}
    name = files[0].name if len(files) == 1 else f"the {len(files)} *.safetensors files"

    def blocks(keys) -> int:
        return len({k.split(".")[2] for k in keys if k.startswith("model.blocks.")})

    if blocks(wanted) != blocks(stored):
        raise KeelError(f"{path}: config.json says {blocks(wanted)} layers; {name} holds weights for {blocks(stored)}")
    for key, shape in wanted.items():
        if key in stored and stored[key] != shape:
            raise KeelError(f"{path}: config.json gives {key} the shape {list(shape)} (d_model {config.d_model}, "
                            f"d_ff {config.d_ff}, vocab_size {config.vocab_size}); {name} holds {list(stored[key])}")
    missing = [k for k in wanted if k not in stored and not (config.tie_embeddings and k in KEEL_TIED)]
    if missing:
        raise KeelError(f"{path}: {name} lacks weights the model of its config.json has: {', '.join(missing[:3])}"
                        + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))


def load_hf(path: str | Path, device: str = "auto"):
    """Load a keel or stock Llama Hugging Face folder: ``(KeelForCausalLM in eval mode on
    device, PreTrainedTokenizerFast, device)``. A Llama folder becomes a ``pre_ln`` keel model
    (:func:`keel.hf.llama.from_llama`); keel's installed code is used, never the folder's.

    Raises KeelError: not a folder with a keel or Llama ``config.json`` and a tokenizer, missing or
    unreadable weights (:func:`keel.io.weights_load_errors`), or a Llama feature keel lacks (named).
    """
    path = Path(path)
    model_type = _read_config_json(path).get("model_type")
    if model_type not in ("keel", "llama"):
        raise KeelError(f"{path} holds a {model_type!r} model, not a keel model (model_type 'keel', written by "
                        "`keel export-hf`) nor a Llama model")
    dev = resolve_device(device, key="--device")
    if model_type == "llama":
        config = LlamaConfig.from_pretrained(path)
        with weights_load_errors(path):  # missing or truncated model.safetensors: one line
            native = from_llama(config, read_safetensors(path))
        model = KeelForCausalLM.from_native(native, eos_token_id=config.eos_token_id,
                                            pad_token_id=config.pad_token_id,
                                            keel_step=int(getattr(config, "keel_step", 0) or 0),
                                            keel_tokens=int(getattr(config, "keel_tokens", 0) or 0))
    else:
        _check_weights_match_config(path, KeelConfig.from_pretrained(path))
        with hf_progress_bars(interactive()), weights_load_errors(path):
            model = KeelForCausalLM.from_pretrained(path)
    model = model.to(dev).eval()
    return model, load_hf_tokenizer(path), dev


def _write_tokenizer(hf_dir: Path, hf_tok, dest: Path) -> None:
    """Copy ``tokenizer.json`` (and ``tokenizer_config.json``, where keel's data preparation
    finds the eos token) into ``dest``; a folder without tokenizer.json needs a fast tokenizer."""
    if (hf_dir / HF_TOKENIZER).is_file():
        shutil.copyfile(hf_dir / HF_TOKENIZER, RunDir(dest).tokenizer)
    elif getattr(hf_tok, "is_fast", False):
        hf_tok.backend_tokenizer.save(str(RunDir(dest).tokenizer))
    else:
        raise KeelError(f"{hf_dir} has no tokenizer.json and no fast tokenizer (keel runs need one)")
    if (hf_dir / "tokenizer_config.json").is_file():
        shutil.copyfile(hf_dir / "tokenizer_config.json", dest / "tokenizer_config.json")


def fresh_trainer_state(model, cfg, step: int = 0, tokens: int = 0) -> dict:
    """A trainer state at optimiser step ``step``, ``tokens`` trained, for weights that come without one (an
    import): a fresh AdamW (no moments; name-keyed,
    :func:`keel.train.state_dict.full_optimizer_state_dict`; the trainer sets the LR of
    ``step``), data position 0, the RNG state of ``torch.manual_seed(train.seed)``.
    ``keel train --resume`` continues such a checkpoint from ``step`` to ``train.steps``."""
    optimizer = build_optimizer(model, cfg.train)
    return {"step": step, "tokens": tokens, "elapsed_s": 0.0, "optimizer": SD.full_optimizer_state_dict(model, optimizer),
            "loader": {"epoch": 0, "position": 0},
            "rng": torch.Generator().manual_seed(cfg.train.seed).get_state()}


def _check_importable(hf_dir: Path, cfg, n_ids: int, step: int) -> None:
    """Refuse what would fail only later (:func:`import_hf`): a tokenizer with ``n_ids`` ids, more than the
    model's ``vocab_size`` (``keel generate`` met an id with no embedding row), or a ``train.steps``
    below the export's ``step`` (every resume refused it)."""
    if n_ids > cfg.model.vocab_size:
        raise KeelError(f"{hf_dir}: its tokenizer has {n_ids} ids but config.json's vocab_size is "
                        f"{cfg.model.vocab_size}: ids from {cfg.model.vocab_size} on have no embedding row")
    if cfg.train.steps < step:
        raise KeelError(f"train.steps={cfg.train.steps} is below the step {hf_dir} was exported at ({step}); "
                        f"give train.steps >= {step}")


def _check_given_data(cfg, overrides: list[str]) -> None:
    """Refuse a ``data.path`` given in ``overrides`` (:func:`import_hf`) that the imported run could not train on:
    not a prepared dataset (it was accepted, and every later ``--resume`` or ``eval`` failed), or one whose
    tokenizer has more ids than the model's ``vocab_size`` embedding rows. Raises KeelError, in one line."""
    if not any(o.split("=", 1)[0].strip() == "data.path" for o in overrides):
        return
    try:
        n_ids = read_meta(cfg.data.path)["vocab_size"]
    except KeelError as e:
        raise KeelError(f"--set data.path: {e}") from None
    if n_ids > cfg.model.vocab_size:
        raise KeelError(f"--set data.path: {cfg.data.path}'s tokenizer has {n_ids} ids, more than the model's "
                        f"{cfg.model.vocab_size} embedding rows; give a dataset prepared with the folder's tokenizer")


def _fit_seq_len(hf_dir: Path, cfg, overrides: list[str]) -> None:
    """Keep ``train.seq_len`` within the imported model's positions (``model.max_seq_len``, from
    ``max_position_embeddings``): a longer one (keel's default 128 for a stock Llama of 64 positions)
    is set to ``max_seq_len`` (logged), since a resumed run keeps ``train.seq_len`` and every resume and
    ``keel eval`` of the run refused it (blaming a ``--seq-len`` never given).

    Raises:
        KeelError: ``overrides`` set ``train.seq_len`` above the model's positions.
    """
    limit, seq_len = cfg.model.max_seq_len, cfg.train.seq_len
    if seq_len <= limit:
        return
    if any(o.split("=", 1)[0].strip() == "train.seq_len" for o in overrides):
        raise KeelError(f"train.seq_len={seq_len} exceeds the {limit} positions of the model in {hf_dir} "
                        f"(max_position_embeddings in its config.json); give train.seq_len <= {limit}")
    log.info(f"train.seq_len: {limit}, the model's positions (max_position_embeddings in {hf_dir / 'config.json'}), "
             f"not {seq_len}; a resumed run keeps it (set another with --set train.seq_len=N, N <= {limit})")
    cfg.train.seq_len = limit


def import_hf(hf_dir: str | Path, out: str | Path, overrides: list[str] | None = None) -> Path:
    """Create a run directory ``out`` from a keel Hugging Face folder or a stock Llama folder.

    Writes ``out/config.toml`` (the exported ``keel_config.toml`` if present, with its
    model section replaced by ``config.json``'s fields; else default data/train sections
    whose ``data.tokenizer`` is ``out/tokenizer.json``), ``out/tokenizer.json`` and the
    weights as a checkpoint of the step the export came from, with its tokens trained
    (``keel_step``, ``keel_tokens`` in ``config.json``; 0 when absent, e.g. a stock Llama), with a
    fresh trainer state at that step (:func:`fresh_trainer_state`): ``keel generate``/``keel eval`` use it, and ``keel
    train --resume out`` trains it on (set ``data.path`` to a dataset prepared with this
    tokenizer, or train on ``data.source``, which is tokenized with it). ``overrides``
    (``section.key=value``, data and train keys only) set the run's config: a resumed run
    keeps ``train.batch_size`` and ``train.seq_len``, so choose them here (a ``train.seq_len`` longer
    than the model's positions is set to them, :func:`_fit_seq_len`). A looped model keeps its trained
    ``model.loop_repeats`` (its depth constants, and the count a resumed run trains at): a ``loops`` in
    ``config.json`` (the count the Hugging Face model runs at) is not a run key and is not imported,
    which a warning line says (the run then computes what the folder computed with ``loops`` null;
    ``--loops N`` gives the folder's count).

    Returns ``out``. Raises KeelError: not a keel/Llama folder, a Llama feature keel lacks
    (named), no tokenizer, a tokenizer with more ids than ``vocab_size`` embedding rows, a
    ``train.steps`` below the step the export reached, a ``train.seq_len`` given above the model's
    positions, a ``data.path`` given that is not a prepared dataset or has more token ids than the model's rows
    (:func:`_check_given_data`), or ``out`` exists and is not empty.
    """
    hf_dir, out = Path(hf_dir), Path(out)
    _check_output(out)
    model, hf_tok, _ = load_hf(hf_dir, device="cpu")
    overrides = list(overrides or [])
    if any(o.strip().startswith("model.") for o in overrides):
        raise KeelError("import-hf takes the model from the folder's config.json; --set only data.* and train.* keys")
    exported = hf_dir / KEEL_CONFIG_NAME
    cfg = load_config(exported if exported.is_file() else None, overrides, stored=True)
    if not exported.is_file() and not any(o.strip().startswith("data.tokenizer=") for o in overrides):
        cfg.data.tokenizer = str(RunDir(out).tokenizer.resolve())
    cfg.model = dataclasses.replace(model.config.to_model_config())
    step = int(getattr(model.config, "keel_step", 0) or 0)
    _check_importable(hf_dir, cfg, len(hf_tok), step)
    _check_given_data(cfg, overrides)
    _fit_seq_len(hf_dir, cfg, overrides)
    check_train_config(cfg, here=False)  # the checks `keel train --resume OUT` makes, before anything is written
    loops = getattr(model.config, "loops", None)
    if loops is not None and loops != cfg.model.loop_repeats:
        R, cap = cfg.model.loop_repeats, max_loops(cfg.model.loop_repeats)
        hint = (f"give --loops {loops} to keel eval, generate, ablate or gradflow to run it at the folder's count"
                if loops <= cap else f"{loops} is above {cap}, the cap of --loops ({max_loops_words(R)}): give keel "
                f"eval, generate, ablate or gradflow --loops R with R <= {cap}")
        log.warning(f"config.json's loops = {loops} in {hf_dir} was not imported: the run loops at the trained "
                    f"model.loop_repeats = {R} ({hint})")
    with _fresh_output(out) as tmp:
        _write_tokenizer(hf_dir, hf_tok, tmp)
        dump_config(cfg, RunDir(tmp).config)
        state = fresh_trainer_state(model.model, cfg, step, int(getattr(model.config, "keel_tokens", 0) or 0))
        state["imported_from"] = str(hf_dir.resolve())
        state["config"] = cfg.to_dict()  # what a resume compares its config with
        try:
            CheckpointManager(tmp).save(step, model.model, state)
        except NonFiniteWeights as e:  # it read as a training failure ("refusing to checkpoint step 30: ...")
            raise KeelError(f"{hf_dir}'s weights hold non-finite values (damaged, or a diverged model): "
                            f"{str(e).partition(': ')[2]}") from None
    return out

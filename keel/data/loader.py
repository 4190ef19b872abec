"""Reading a prepared dataset: token windows for training, fixed windows for validation.

A *window* is ``seq_len + 1`` consecutive tokens of a shard; inputs are ``window[:-1]``
and targets ``window[1:]``. Training windows start at multiples of ``seq_len`` (so
neighbours share exactly one token) and are visited in a seeded random order per epoch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from keel.data.prepare import FORMAT_VERSION, check_inputs, find_prepared, prepare_dataset
from keel.data.shards import read_shard
from keel.errors import KeelError

SPLITS = ("train", "val")


def read_meta(data_dir: str | os.PathLike) -> dict:
    """The ``meta.json`` of a prepared dataset directory, as a dict.

    Raises :class:`KeelError` ("not a prepared dataset: DIR (run `keel prepare` first)") if
    ``data_dir`` has no readable ``meta.json``, or if its format version is unsupported.
    """
    path = Path(data_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        raise KeelError(f"not a prepared dataset: {data_dir} (run `keel prepare` first)") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise KeelError(
            f"unsupported dataset format {version!r} in {data_dir} "
            f"(expected {FORMAT_VERSION}; run `keel prepare` again)"
        )
    return meta


def load_tokenizer(data_dir: str | os.PathLike) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` saved in a prepared dataset (its EOS id is ``read_meta(d)["eos_id"]``).

    Raises :class:`KeelError` if ``data_dir`` is not a prepared dataset.
    """
    read_meta(data_dir)
    path = Path(data_dir) / "tokenizer.json"
    if not path.is_file():
        raise KeelError(f"not a prepared dataset: {data_dir} (no tokenizer.json; run `keel prepare` first)")
    return Tokenizer.from_file(str(path))


def _open_split(data_dir, split: str) -> np.ndarray:
    if split not in SPLITS:
        raise KeelError(f"unknown split {split!r} (expected one of {', '.join(SPLITS)})")
    read_meta(data_dir)
    return read_shard(Path(data_dir) / f"{split}.bin")


class TokenLoader:
    """Endless, resumable batches of training windows from one split of a prepared dataset.

    Each call of :meth:`next_batch` (or ``next(loader)``) returns a ``torch.int64`` tensor
    of shape ``[batch_size, seq_len + 1]``: rows are windows ``tokens[s : s + seq_len + 1]``
    with ``s`` in ``range(0, n_tokens - seq_len, seq_len)``.

    Order: epoch ``e`` is the permutation ``numpy.random.default_rng((seed, e))`` of all
    window starts. Rank ``r`` of ``world_size`` takes ``perm[r::world_size]``, cut to the
    same length on every rank, so ranks never share a window within an epoch and all ranks
    run the same number of batches (``batches_per_epoch``). Windows left over after the last
    full batch of an epoch are skipped in that epoch. The position is the same on all ranks,
    so one rank's :meth:`state_dict` can resume every rank.

    Raises :class:`KeelError` if ``data_dir`` is not a prepared dataset, ``split`` is not
    ``train``/``val``, the sizes are not positive, ``rank`` is not in ``[0, world_size)``,
    or the split holds fewer than ``batch_size * world_size`` windows ("corpus too small").
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        split: str = "train",
        *,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if batch_size < 1 or seq_len < 1 or world_size < 1:
            raise KeelError(
                f"batch_size, seq_len and world_size must be >= 1, got {batch_size}, {seq_len}, {world_size}"
            )
        if not 0 <= rank < world_size:
            raise KeelError(f"rank must be in [0, {world_size}), got {rank}")
        self.data_dir = Path(data_dir)
        self.split = split
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.tokens = _open_split(data_dir, split)
        self.n_tokens = len(self.tokens)
        self.n_windows = max(0, (self.n_tokens - 1) // seq_len)
        self.windows_per_rank = self.n_windows // world_size
        self.batches_per_epoch = self.windows_per_rank // batch_size
        if self.batches_per_epoch == 0:
            need = batch_size * world_size * seq_len + 1
            extra = f" world_size={world_size}" if world_size > 1 else ""
            raise KeelError(
                f"corpus too small: {self.n_tokens} tokens in split '{split}', need at least {need} "
                f"for batch_size={batch_size} seq_len={seq_len}{extra}"
            )
        self._offsets = np.arange(seq_len + 1)
        self.epoch = 0
        self.position = 0  # batches already taken in this epoch
        self._starts_epoch = -1
        self._starts = np.empty(0, dtype=np.int64)

    def _rank_starts(self, epoch: int) -> np.ndarray:
        """Window start offsets of this rank in ``epoch``, in visiting order."""
        if epoch != self._starts_epoch:
            perm = np.random.default_rng((self.seed, epoch)).permutation(self.n_windows)
            mine = perm[self.rank :: self.world_size][: self.windows_per_rank]
            self._starts, self._starts_epoch = mine * self.seq_len, epoch
        return self._starts

    def next_batch(self) -> torch.Tensor:
        """The next ``int64`` batch, shape ``[batch_size, seq_len + 1]``; rolls over into the next epoch."""
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        b = self.batch_size
        starts = self._rank_starts(self.epoch)[self.position * b : (self.position + 1) * b]
        self.position += 1
        windows = self.tokens[starts[:, None] + self._offsets]
        return torch.from_numpy(windows.astype(np.int64))

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> torch.Tensor:
        return self.next_batch()

    def state_dict(self) -> dict:
        """Plain ``int``/``str`` values (safe for ``torch.load(weights_only=True)``)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "n_tokens": self.n_tokens,
            "split": self.split,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the following batches equal an uninterrupted run's.

        The world size may change if the global batch does not: a state saved with
        ``batch_size * world_size == G`` loads into any loader with the same ``G``. Global
        batch ``j`` of an epoch is the same set of windows at every world size (rank ``r``'s
        batch ``j`` is ``perm[j*G + r :: world_size][:batch_size]``, so the ranks together
        take ``perm[j*G : (j+1)*G]``) and ``batches_per_epoch = n_windows // G`` either way,
        so ``epoch`` and ``position`` carry over unchanged.

        Raises :class:`KeelError` if the state was saved with a different seed, sequence
        length, split or dataset size, or a different batch size at the same world size, or
        a different global batch (``batch_size * world_size``) at another world size.
        """
        for key in ("seed", "seq_len", "n_tokens", "split"):
            if key in state and state[key] != getattr(self, key):
                raise KeelError(
                    f"cannot resume the data loader: saved {key}={state[key]!r}, now {key}={getattr(self, key)!r}"
                )
        saved_ws = int(state.get("world_size", self.world_size))
        if saved_ws == self.world_size:
            if "batch_size" in state and state["batch_size"] != self.batch_size:
                raise KeelError(
                    f"cannot resume the data loader: saved batch_size={state['batch_size']!r}, "
                    f"now batch_size={self.batch_size!r}"
                )
        elif "batch_size" in state:
            saved_global, now_global = state["batch_size"] * saved_ws, self.batch_size * self.world_size
            if saved_global != now_global:
                raise KeelError(
                    f"cannot resume the data loader: saved global batch {saved_global} "
                    f"(batch_size={state['batch_size']} x world_size={saved_ws}), now {now_global} "
                    f"(batch_size={self.batch_size} x world_size={self.world_size})"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def split_windows(ids, seq_len: int, max_tokens: int | None = None, keep_tail: bool = False) -> list[torch.Tensor]:
    """Cut a token sequence into windows of ``seq_len + 1`` tokens that overlap by one.

    Row ``i`` is ``ids[i * seq_len : i * seq_len + seq_len + 1]``, so the targets of the rows
    (all but each row's first token) are ``ids[1:]``, each exactly once. This is the one
    windowing rule of keel: training validation, ``keel eval`` and ``keel ablate`` all use it.

    Args:
        ids: 1-D sequence of token ids (list, numpy array or LongTensor).
        seq_len: tokens of context per window (>= 1).
        max_tokens: keep at most ``max_tokens // seq_len`` windows (at least one); None = all.
        keep_tail: also return the last, shorter window (>= 2 tokens) when ``ids`` does not
            end on a window boundary; otherwise only whole windows.
    Returns:
        A list of int64 1-D tensors (length ``seq_len + 1``, the tail possibly shorter).
    Raises:
        KeelError: ``seq_len < 1``.
    """
    if seq_len < 1:
        raise KeelError(f"seq_len must be >= 1, got {seq_len}")
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    n_whole = max(0, (len(ids) - 1) // seq_len)
    if max_tokens is not None:
        n_whole = min(n_whole, max(1, max_tokens // seq_len))
    rows = [ids[i * seq_len:i * seq_len + seq_len + 1] for i in range(n_whole)]
    tail_start = n_whole * seq_len
    if keep_tail and max_tokens is None and len(ids) - tail_start >= 2:
        rows.append(ids[tail_start:])
    return rows


def validation_tokens(data_dir: str | os.PathLike, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """A fixed validation set: the first whole windows of ``val.bin`` (:func:`split_windows`),
    as ``int64 [N, seq_len + 1]``, at most ``max_tokens // seq_len`` of them (>= 1);
    ``max_tokens=None`` means all whole windows.

    Raises :class:`KeelError` if ``val.bin`` holds fewer than ``seq_len + 1`` tokens or
    ``data_dir`` is not a prepared dataset.
    """
    tokens = _open_split(data_dir, "val")
    if seq_len >= 1 and len(tokens) < seq_len + 1:
        raise KeelError(
            f"validation split too small: {len(tokens)} tokens in {data_dir}/val.bin, need at least "
            f"{seq_len + 1} for seq_len={seq_len} (use more data or a larger val_fraction)"
        )
    n = (len(tokens) - 1) // seq_len if seq_len >= 1 else 0
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // seq_len))
    return torch.stack(split_windows(tokens[:n * seq_len + 1], seq_len))


def absolute_data_paths(data: dict) -> dict:
    """A ``[data]`` section (a dict, as :meth:`keel.config.Config.to_dict` gives it) with its
    local paths made absolute against the current folder: ``source`` and ``tokenizer`` when they
    name an existing file or folder (as :func:`keel.data.prepare.prepare_dataset` reads them; its
    cache key already uses the resolved paths, so the cached dataset is the same), ``path`` and
    ``cache_dir`` when set. A run stores these, so that ``keel eval``/``ablate``/``export-hf --run``
    started from another folder find the dataset the run trained on, not another one there.
    Other keys and ``builtin:``/``hf:``/``bpe:`` values are returned as given."""
    out = dict(data)
    source, tokenizer = out.get("source"), out.get("tokenizer")
    if isinstance(source, str) and os.path.exists(source):
        out["source"] = str(Path(source).resolve())
    if isinstance(tokenizer, str) and not tokenizer.startswith("bpe:") and os.path.exists(os.path.expanduser(tokenizer)):
        out["tokenizer"] = str(Path(tokenizer).expanduser().resolve())
    for key in ("path", "cache_dir"):
        if isinstance(out.get(key), str) and out[key]:
            out[key] = os.path.abspath(out[key])
    return out


def prepared_from(meta: dict) -> dict:
    """The ``[data]`` keys a prepared dataset was made with, read from its ``meta.json``:
    ``source``, ``tokenizer``, ``val_fraction``, ``max_bytes`` (None: 0, no limit) and
    ``text_field``, each where the meta holds a usable value. A run given ``data.path`` stores
    these in its config rather than the defaults of keys it never read."""
    out = {k: meta[k] for k in ("source", "tokenizer", "text_field") if isinstance(meta.get(k), str) and meta[k]}
    if isinstance(meta.get("val_fraction"), float) and 0 < meta["val_fraction"] < 1:
        out["val_fraction"] = meta["val_fraction"]
    if "max_bytes" in meta and (meta["max_bytes"] is None or isinstance(meta["max_bytes"], int)):
        out["max_bytes"] = meta["max_bytes"] or 0
    return out


def tokenizer_identity(tokenizer: Tokenizer) -> dict:
    """What decides a text's token ids under ``tokenizer``: its normalizer, pre-tokenizer, model
    (vocabulary and BPE merges) and the token -> id map with added tokens. Padding, truncation,
    post-processor and decoder are left out: they do not change the ids of a prepared dataset."""
    spec = json.loads(tokenizer.to_str())
    return {"normalizer": spec.get("normalizer"), "pre_tokenizer": spec.get("pre_tokenizer"), "model": spec.get("model"),
            "vocab": tokenizer.get_vocab(with_added_tokens=True)}


def check_tokenizer_matches(tokenizer: Tokenizer, data_dir: str | os.PathLike, whose: str = "the model's",
                            fix: str = "score it with --text, or prepare the model's dataset again") -> None:
    """Raise KeelError unless the prepared dataset ``data_dir`` was tokenized the way ``tokenizer``
    tokenizes (:func:`tokenizer_identity`: one BPE merge fewer already maps text to other ids): its
    ids are another text to a model of another tokenizer (e.g. ``keel prepare --out`` again with
    another one since, or an export scored on another run's data). ``whose`` names the model's side
    in the message, ``fix`` says what to do."""
    if tokenizer_identity(tokenizer) != tokenizer_identity(load_tokenizer(data_dir)):
        raise KeelError(f"{data_dir} was prepared with another tokenizer than {whose} (their vocabularies or merges "
                        f"differ): its token ids are other text to this model; {fix}")


def check_given_dataset(data: dict, meta: dict, keys: list[str]) -> None:
    """With ``data.path`` set the dataset is made already and its own settings replace the keys that
    say how a dataset is made (:func:`prepared_from`). ``keys`` (``data.*`` names, e.g. those a user
    gave with ``--set``) that hold another value than the dataset's (``meta.json``) would be dropped
    without a word. Local paths are compared absolute; ``data`` is a ``[data]`` section as a dict.

    Raises:
        KeelError: naming each such key, its value and the dataset's.
    """
    given, own = absolute_data_paths(data), absolute_data_paths(prepared_from(meta))
    wrong = [k for k in (key.removeprefix("data.") for key in keys) if k in own and given.get(k) != own[k]]
    if wrong:
        said = ", ".join(f"data.{k} = {given[k]!r} (it has {own[k]!r})" for k in wrong)
        raise KeelError(f"{said}: not how data.path {data.get('path')} was prepared, and with data.path the "
                        f"dataset's own settings apply; drop {', '.join('data.' + k for k in wrong)}, or `keel "
                        "prepare` a dataset with them and give its data.path")


def resolve_data(cfg, progress: bool = True) -> Path:
    """The prepared dataset folder a config's ``[data]`` section names: ``data.path`` if set
    (checked to be a prepared dataset), else prepared from ``data.source`` and
    ``data.tokenizer`` under ``data.cache_dir`` (or reused from that cache).

    Args:
        cfg: a :class:`keel.config.Config`.
    Raises:
        KeelError: ``data.path`` is not a prepared dataset, or preparing fails.
    """
    d = cfg.data
    if d.path:
        read_meta(d.path)
        return Path(d.path)
    return prepare_dataset(d.source, d.tokenizer, cache_dir=d.cache_dir, val_fraction=d.val_fraction,
                           max_bytes=d.max_bytes or None, text_field=d.text_field, progress=progress)


def check_data(cfg) -> None:
    """What :func:`resolve_data` would refuse that can be checked without preparing anything
    (``--dry-run``): ``data.path`` is a prepared dataset, or ``data.source`` and ``data.tokenizer``
    name something (:func:`keel.data.prepare.check_inputs`).

    Raises:
        KeelError: ``data.path`` is not a prepared dataset; a bad tokenizer spec or source.
    """
    if cfg.data.path:
        read_meta(cfg.data.path)
    else:
        check_inputs(cfg.data.source, cfg.data.tokenizer)


def find_data(cfg) -> Path | None:
    """The prepared dataset a config's ``[data]`` names, if it exists (nothing is prepared):
    ``data.path`` if it is a prepared dataset, else the cached dataset of ``data.source`` +
    ``data.tokenizer`` under ``data.cache_dir``; None otherwise."""
    d = cfg.data
    try:
        if d.path:
            read_meta(d.path)
            return Path(d.path)
        return find_prepared(d.source, d.tokenizer, val_fraction=d.val_fraction, max_bytes=d.max_bytes or None,
                             text_field=d.text_field, cache_dir=d.cache_dir)
    except KeelError:
        return None

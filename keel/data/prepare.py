"""``keel prepare``: documents -> tokenizer + ``train.bin``/``val.bin`` shards + ``meta.json``.

A prepared dataset directory holds::

    tokenizer.json   a `tokenizers` tokenizer (trained here for ``bpe:N``)
    train.bin        token shard of the training documents (see keel.data.shards)
    val.bin          token shard of the validation documents
    meta.json        what was built from what (below)

``meta.json`` records ``format_version, source, tokenizer, tokenizer_sha256, vocab_size,
eos_id, dtype, n_docs_train, n_docs_val, train_tokens, val_tokens, unigram_entropy (nats,
of the training tokens: :mod:`keel.data.stats`), bytes_train, bytes_val,
docs_with_replacement_chars, docs_skipped_binary, docs_with_nul, long_docs_chunked,
chunks_of_long_docs, val_fraction, max_bytes, max_docs, seed, text_field, source_fingerprint, created``.
``n_docs_*`` count documents and chunks; byte counts are UTF-8 bytes of document text; token
counts include the EOS tokens. Local paths are recorded as absolute paths.

Every document is followed by the end-of-text token. A long document (more than
:data:`LONG_DOC_CHARS` characters: a book, a dump, a corpus that is one file) is cut into
chunks of about :data:`CHUNK_CHARS` characters (after a newline where there is one) and
the train/val split is drawn per chunk, so a corpus that is a single file still gets a
validation split; consecutive chunks that land in the same split stay one text (an EOS
comes only where the document ends or switches split). Documents are read one at a time
and chunks are spilled to disk, so memory stays bounded by the largest document plus
the tokenizer's work on one batch of chunks. The directory is built under a temporary
name and renamed into place at the end, so an interrupted run leaves nothing behind (nor
any folder it created on the way); a second run with the same inputs finds ``meta.json``
and returns at once ("reusing cached dataset ..."), unless a local corpus's files changed
since (their paths, sizes and modification times: ``source_fingerprint``).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from huggingface_hub import hf_hub_download
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm.auto import tqdm

from keel.config import DEFAULT_VAL_FRACTION, DataConfig, check_value
from keel.data.shards import ShardWriter, read_shard
from keel.data.sources import SourceStats, check_hub_reachable, check_source, hub_errors, iter_documents, source_fingerprint
from keel.data.stats import unigram_entropy
from keel.data.text import encode_batch
from keel.errors import KeelError
from keel.io import (LOCK_NAME, RunLock, check_output_not_in_checkpoints, check_path_names, check_regular_file,
                     disk_errors, make_dirs, pid_runs, remove_empty_dirs)

FORMAT_VERSION = 1
EOS_TOKEN = "<|endoftext|>"
ENCODE_BATCH_DOCS = 256
ENCODE_BATCH_CHARS = 1 << 21  # 2 Mi characters of text per encode_batch call
# Documents longer than LONG_DOC_CHARS characters are cut into chunks of about CHUNK_CHARS
# for the train/val split (no file of the built-in corpus is that long).
LONG_DOC_CHARS = 256 * 1024
CHUNK_CHARS = 64 * 1024
DATASET_FILES = ("meta.json", "tokenizer.json", "train.bin", "val.bin")  # what a prepared dataset holds
# The inputs that decide a dataset's content; meta.json must match them for a cache hit.
CACHE_KEYS = ("source", "tokenizer", "val_fraction", "max_bytes", "max_docs", "seed", "text_field")

log = logging.getLogger(__name__)


def prepare_dataset(source: str, tokenizer: str = DataConfig.tokenizer, out: str | os.PathLike | None = None, *,
                    val_fraction: float = DEFAULT_VAL_FRACTION, max_bytes: int | None = None,
                    max_docs: int | None = None, text_field: str = DataConfig.text_field, seed: int = 0,
                    cache_dir: str | os.PathLike = DataConfig.cache_dir, progress: bool = True,
                    force: bool = False) -> Path:
    """Tokenize ``source`` into a prepared dataset directory and return its path.

    Args:
        source: ``builtin:python-stdlib``, ``hf:NAME[:CONFIG]`` or a local file/folder
            (see :func:`keel.data.sources.iter_documents`).
        tokenizer: ``bpe:N`` to train a byte-level BPE with ``N`` tokens (257 to 2**31 - 1,
            including ``<|endoftext|>``) on the train split; or a path to a
            ``tokenizer.json`` (or a folder holding one); or a Hugging Face tokenizer name
            such as ``gpt2`` (needs the hub). The end-of-text token is ``<|endoftext|>`` if
            the vocabulary has it, else the ``eos_token`` of an adjacent ``tokenizer_config.json``.
        out: output directory; default ``{cache_dir}/{slug}``, e.g. ``data/python-stdlib-bpe8192-1a2b3c4d``
            (slug = source, tokenizer and a hash of all inputs).
        val_fraction: expected fraction of documents (not tokens; chunks of long documents
            count as documents) put in ``val.bin``, ``0 < val_fraction < 1`` (default: the
            config's default ``data.val_fraction``, so ``keel prepare`` and ``keel train``
            share a cache). The split is a deterministic function of the document index and
            ``seed``; with 2 or more documents (or chunks) each split gets at least one.
        max_bytes / max_docs: stop after the document that brings the UTF-8 text to this many
            bytes / after this many documents (``None`` or ``0``: no limit).
        text_field: the text field of ``.jsonl``/``.json``/``.parquet``/``hf:`` records; seed: of the split;
            cache_dir: parent of the default ``out``; progress: bars on stderr.
        force: build again even if ``out`` holds these inputs' dataset; replace one of other inputs.

    ``meta.json`` records the inputs and what was built (the module docstring lists its keys).
    If ``out/meta.json`` records the same inputs and -- for a local source -- the same
    :func:`keel.data.sources.source_fingerprint`, ``out`` is returned unread. Otherwise the
    dataset is built in ``out.tmp-<pid>`` and renamed to ``out`` (replacing it if only the corpus changed);
    such folders of processes that were killed before they could remove theirs are removed first (one line each).

    Raises :class:`KeelError` for bad options, any source or tokenizer problem, an empty
    corpus, an ``out`` that exists and is not a prepared dataset, an ``out`` that holds a dataset
    prepared from other inputs (without ``force``: runs trained on it read it by path), or a full
    disk / read-only folder (naming the path; nothing is left behind).
    """
    inputs = _canonical_inputs(source, tokenizer, val_fraction, max_bytes, max_docs, text_field, seed)
    if out is not None:
        check_path_names(out, "--out", room=12)  # OUT.tmp-PID is built beside it
    else:
        check_path_names(cache_dir, "data.cache_dir (--cache-dir)")
    out = Path(out) if out is not None else Path(cache_dir) / dataset_slug(inputs)
    if not force and _cache_matches(out, inputs):
        log.info("reusing cached dataset %s", out)
        return out
    _check_replaceable(out, inputs, force)
    created = [d for d in (out.parent, *out.parent.parents) if not d.exists()]  # deepest first
    with disk_errors(out, own_path=True), prepare_lock(out):  # one line naming out (not its tmp or lock)
        if not force and _cache_matches(out, inputs):  # prepared by the process this one waited for
            log.info("reusing cached dataset %s", out)
            return out
        _check_replaceable(out, inputs, force)  # again: that process may have prepared other inputs there
        _remove_stale_builds(out)  # left by a preparation killed (SIGKILL) before it could clean up
        tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            make_dirs(tmp, name=out)
            meta = _build(tmp, inputs, progress)
            _move_into_place(tmp, out, inputs, force)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            remove_empty_dirs(created)  # leave none of the folders this call created behind
            raise
    _log_prepared(out, meta)
    return out


def prepare_lock(out: Path) -> RunLock:
    """The lock (:class:`keel.io.RunLock`) a preparation holds on its output ``out`` from its checks
    to its rename: ``PARENT/.OUT.keel.lock``, beside ``out`` (which a rename replaces) and removed
    after. A second ``keel prepare --out OUT`` waits for the first (logged), then reuses its dataset or
    refuses one of other inputs: both said "prepared OUT", and OUT held the second's dataset.

    Raises (on entry):
        KeelError: the parent folder cannot be made or written (:func:`keel.io.disk_errors`).
    """
    lock = RunLock(out.parent, f".{out.name}{LOCK_NAME}", transient=True, wait=True)
    lock.waiting = f"waiting for keel process {{pid}}, which is preparing {out}"
    lock.unmakeable = f"cannot make the folder {out}: {{why}}"  # e.g. under /proc: its parent takes no new file
    return lock


_BUILD_FILES = frozenset(DATASET_FILES) | {"train.docs", "val.docs"}  # what a build folder OUT.tmp-PID holds


def _remove_stale_builds(out: Path) -> list[Path]:
    """Remove the build folders ``OUT.tmp-PID`` beside ``out`` (keel's own name for them, :func:`prepare`)
    whose process is gone (killed by SIGKILL or the OOM killer, which leave no chance to clean up) and
    that hold only files a build writes; one line each. Called under :func:`prepare_lock`, so no other
    preparation of ``out`` is running. Returns the folders removed."""
    pattern = re.compile(re.escape(out.name) + r"\.tmp-(\d+)")
    removed = []
    with contextlib.suppress(OSError):
        for p in sorted(out.parent.iterdir()):
            m = pattern.fullmatch(p.name)
            if not m or int(m.group(1)) == os.getpid() or not p.is_dir() or p.is_symlink() or pid_runs(m.group(1)):
                continue
            entries = list(p.iterdir())
            if any(e.name not in _BUILD_FILES or e.is_symlink() or not e.is_file() for e in entries):
                continue  # not only a build's files: not ours to delete
            shutil.rmtree(p, ignore_errors=True)
            log.info("removed %s, left by keel prepare process %s, which was killed before it finished", p,
                     m.group(1))
            removed.append(p)
    return removed


def _log_prepared(out: Path, meta: dict) -> None:
    """Log what a prepared dataset holds, and warn when it has no validation tokens (e.g. one
    short document, or every other one skipped as binary)."""
    log.info("prepared %s: %d+%d docs, %s train / %s val tokens", out, meta["n_docs_train"], meta["n_docs_val"],
             f"{meta['train_tokens']:,}", f"{meta['val_tokens']:,}")
    if not meta["val_tokens"]:
        log.warning("%s has no validation tokens: all %d document(s) went to the training split; a run on it "
                    "evaluates nothing (give more documents or a larger data.val_fraction)", out, meta["n_docs_train"])


def find_prepared(source: str, tokenizer: str = DataConfig.tokenizer, *, val_fraction: float = DEFAULT_VAL_FRACTION,
                  max_bytes: int | None = None, text_field: str = DataConfig.text_field,
                  cache_dir: str | os.PathLike = DataConfig.cache_dir,
                  ) -> Path | None:
    """The cached dataset :func:`prepare_dataset` would reuse for these inputs, or None if it
    is not there (nothing is read or built). Raises KeelError for bad options."""
    inputs = _canonical_inputs(source, tokenizer, val_fraction, max_bytes, None, text_field, 0)
    out = Path(cache_dir) / dataset_slug(inputs)
    return out if _cache_matches(out, inputs) else None


def _check_replaceable(out: Path, inputs: dict, force: bool) -> None:
    """Refuse to build into ``out`` when it is a file or a non-empty folder other than a prepared
    dataset, or (without ``force``) a dataset prepared from other :data:`CACHE_KEYS` inputs.
    A dataset of the same inputs whose local corpus changed is replaced (logged)."""
    check_output_not_in_checkpoints(out, "--out")
    if out.is_file() or (out.is_dir() and not (out / "meta.json").is_file() and any(out.iterdir())):
        raise KeelError(f"refusing to overwrite {out}: it exists and is not a prepared dataset")
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name not in DATASET_FILES)
    if foreign:  # replacing the dataset would delete them with it
        raise KeelError(f"refusing to replace {out}: besides its dataset it holds files keel did not write "
                        f"({', '.join(foreign[:3])}); move them away or give another --out")
    changed = [k for k in CACHE_KEYS if meta.get(k) != inputs[k]]
    if changed and not force:
        what = ", ".join(f"{k} {meta.get(k)!r} (now {inputs[k]!r})" for k in changed)
        raise KeelError(f"refusing to replace {out}: it holds a dataset prepared from other inputs ({what}); "
                        "runs trained on it read it by path. Give another --out, or --force to replace it")
    if not changed and meta.get("source_fingerprint") != inputs["source_fingerprint"]:
        log.info("the corpus %s changed since %s was prepared from it: preparing it again", inputs["source"], out)


def dataset_slug(inputs: dict) -> str:
    """Directory name for canonical ``inputs``: ``{source}-{tokenizer}-{8 hex of a hash of the
    :data:`CACHE_KEYS` inputs}``."""
    inputs = {k: inputs[k] for k in CACHE_KEYS}
    source, tok = inputs["source"], inputs["tokenizer"]
    if source.startswith("builtin:"):
        src = source[len("builtin:") :]
    elif source.startswith("hf:"):
        src = source[len("hf:") :].split("/")[-1]
    else:
        src = Path(source).stem
    if tok.startswith("bpe:"):
        tk = tok.replace(":", "")
    elif tok.endswith("tokenizer.json"):
        tk = Path(tok).parent.name
    else:
        tk = Path(tok).stem if tok.endswith(".json") else tok.split("/")[-1]
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:8]
    return "-".join(_safe_name(s) for s in (src, tk) if _safe_name(s)) + f"-{digest}"


def _safe_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-.")[:40]


def _canonical_inputs(source, tokenizer, val_fraction, max_bytes, max_docs, text_field, seed) -> dict:
    """Validate the options; local paths become absolute, 0 limits become None."""
    check_value("data.source", source)  # the ranges declared in keel.config.DataConfig
    check_value("data.val_fraction", val_fraction)
    for name, value in (("max_bytes", max_bytes), ("max_docs", max_docs)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise KeelError(f"{name} must be a non-negative integer, got {value!r}")
    _parse_bpe(tokenizer)  # validate bpe:N early
    if os.path.exists(source):
        source = str(Path(source).resolve())
    if not tokenizer.startswith("bpe:") and os.path.exists(os.path.expanduser(tokenizer)):
        tokenizer = str(Path(tokenizer).expanduser().resolve())
    return {
        "source": source,
        "tokenizer": tokenizer,
        "val_fraction": float(val_fraction),
        "max_bytes": max_bytes or None,
        "max_docs": max_docs or None,
        "seed": int(seed),
        "text_field": text_field,
        "source_fingerprint": source_fingerprint(source),  # not a CACHE_KEY: a changed corpus keeps its folder
    }


def _cache_matches(out: Path, inputs: dict) -> bool:
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    files_ok = all((out / name).is_file() for name in ("tokenizer.json", "train.bin", "val.bin"))
    same_inputs = all(meta.get(k) == inputs[k] for k in CACHE_KEYS)
    same_corpus = meta.get("source_fingerprint") == inputs.get("source_fingerprint")
    return files_ok and same_inputs and same_corpus and meta.get("format_version") == FORMAT_VERSION


def _move_into_place(tmp: Path, out: Path, inputs: dict, force: bool = False) -> None:
    try:
        os.rename(tmp, out)  # atomic; also replaces an empty directory on POSIX
        return
    except OSError:
        if not out.exists():
            raise
    if not force and _cache_matches(out, inputs):  # a concurrent prepare of the same inputs finished first
        shutil.rmtree(tmp)
        return
    old = out.parent / f"{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    os.rename(tmp, out)
    for name in DATASET_FILES:  # the files keel wrote (_check_replaceable refused a dataset with others)
        (old / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        old.rmdir()


def _build(tmp: Path, inputs: dict, progress: bool) -> dict:
    """Write tokenizer.json, train.bin, val.bin and meta.json into ``tmp``; returns the meta dict."""
    bpe_size = _parse_bpe(inputs["tokenizer"])
    tok, eos_id = (None, None) if bpe_size else _load_existing_tokenizer(inputs["tokenizer"], tmp / "tokenizer.json")

    train, val, stats, chunking = _read_splits(tmp, inputs, progress)

    if bpe_size:
        tok = _train_bpe(train, bpe_size, progress)
        tok.save(str(tmp / "tokenizer.json"))
        eos_id = tok.token_to_id(EOS_TOKEN)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)

    n_tokens = {}
    for name, spill in (("train", train), ("val", val)):
        n_tokens[name] = _encode_split(tok, eos_id, spill, tmp / f"{name}.bin", vocab_size, progress)
        spill.path.unlink()

    meta = {
        "format_version": FORMAT_VERSION,
        "source": inputs["source"],
        "tokenizer": inputs["tokenizer"],
        "tokenizer_sha256": hashlib.sha256((tmp / "tokenizer.json").read_bytes()).hexdigest(),
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "dtype": "uint16" if vocab_size <= 65535 else "uint32",
        "n_docs_train": train.n_docs,
        "n_docs_val": val.n_docs,
        "train_tokens": n_tokens["train"],
        "val_tokens": n_tokens["val"],
        # nats; the loss floor of a context-free model (keel.data.stats)
        "unigram_entropy": unigram_entropy(read_shard(tmp / "train.bin"), vocab_size) if n_tokens["train"] else None,
        "bytes_train": train.n_bytes,
        "bytes_val": val.n_bytes,
        "docs_with_replacement_chars": stats.docs_with_replacement_chars,
        "docs_skipped_binary": stats.docs_skipped_binary,
        "docs_with_nul": stats.docs_with_nul,
        "long_docs_chunked": chunking[0],
        "chunks_of_long_docs": chunking[1],
        "val_fraction": inputs["val_fraction"],
        "max_bytes": inputs["max_bytes"],
        "max_docs": inputs["max_docs"],
        "seed": inputs["seed"],
        "text_field": inputs["text_field"],
        "source_fingerprint": inputs["source_fingerprint"],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def chunk_document(text: str, size: int = CHUNK_CHARS):
    """Consecutive pieces of ``text`` of at most ``size`` characters whose concatenation is
    ``text``; each piece but the last ends after the last newline (else space) in the
    second half of its window, or at ``size`` characters when there is none."""
    start, n = 0, len(text)
    while n - start > size:
        end = start + size
        cut = text.rfind("\n", start + size // 2, end)
        if cut < 0:
            cut = text.rfind(" ", start + size // 2, end)
        end = cut + 1 if cut >= 0 else end
        yield text[start:end]
        start = end
    yield text[start:]


def _read_splits(tmp: Path, inputs: dict, progress: bool) -> tuple[_Spill, _Spill, SourceStats, tuple[int, int]]:
    """Read the source's documents into ``tmp/train.docs`` and ``tmp/val.docs``; returns the
    two spills (their files closed, also when reading fails), the source's statistics and
    :func:`_split_documents`' (long documents, their chunks). Raises KeelError for a source error or an empty corpus."""
    stats = SourceStats()
    with _Spill(tmp / "train.docs", spare_is_lowest=True) as train, \
            _Spill(tmp / "val.docs", spare_is_lowest=False) as val:
        docs = iter_documents(inputs["source"], max_bytes=inputs["max_bytes"], max_docs=inputs["max_docs"],
                              text_field=inputs["text_field"], stats=stats)
        # Source errors (missing path, unknown scheme, offline hub) surface on the first next():
        # take it before a progress bar is drawn, so the user sees one error line only.
        first = next(docs, None)
        docs = itertools.chain([first] if first is not None else [], docs)
        chunking = _split_documents(_progress(docs, None, "reading documents", "doc", progress), train, val, inputs)
        if stats.docs_skipped_binary:
            log.warning("skipped %d document(s) that are not text (more than 10%% control characters, e.g. NUL "
                        "bytes)", stats.docs_skipped_binary)
        if stats.n_docs == 0:
            binary = f" ({stats.docs_skipped_binary} skipped as not text)" if stats.docs_skipped_binary else ""
            raise KeelError(f"empty corpus: {inputs['source']} has no documents with non-whitespace text{binary}")
        if chunking[0]:
            log.info("cut %d long document(s) (over %d characters) into %d chunks of about %d characters for the "
                     "train/val split", chunking[0], LONG_DOC_CHARS, chunking[1], CHUNK_CHARS)
        if train.n_docs == 0:
            train.add(val.give_spare())
        if val.n_docs == 0 and train.n_docs >= 2:
            val.add(train.give_spare())
    return train, val, stats, chunking


def _split_documents(docs, train: "_Spill", val: "_Spill", inputs: dict) -> tuple[int, int]:
    """Put each document -- or each chunk of a long one -- into train or val by its split
    score. Returns (long documents cut, chunks they gave)."""
    index, n_long, n_chunks = 0, 0, 0
    for text in docs:
        pieces = chunk_document(text) if len(text) > LONG_DOC_CHARS else iter([text])
        n_long += len(text) > LONG_DOC_CHARS
        pending = None  # (spill, text, score): written once the next piece's split is known
        for piece in pieces:
            score = _split_score(index, inputs["seed"])
            spill = val if score < inputs["val_fraction"] else train
            index += 1
            n_chunks += len(text) > LONG_DOC_CHARS
            if pending is not None:
                pending[0].add(pending[1], pending[2], ends=pending[0] is not spill)
            pending = (spill, piece, score)
        pending[0].add(pending[1], pending[2], ends=True)
    return n_long, n_chunks


def _split_score(index: int, seed: int) -> float:
    """A seeded hash of a document index as a number in [0, 1); the document goes to val iff < val_fraction."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class _Spill:
    """The documents of one split, kept on disk (one JSON ``[text, ends]`` per line) between
    passes; ``ends`` is False for a chunk that continues in the next line.

    It remembers a *spare*: the document whose split score is closest to the other split
    (lowest score for train, highest for val), which :meth:`give_spare` hands over when the
    other split would otherwise be empty (the line before it then ends its text).
    Written inside a ``with`` block, which closes the file (also on an error); read
    afterwards with :meth:`pieces`.
    """

    def __init__(self, path: Path, spare_is_lowest: bool):
        self.path = path
        self.n_docs = 0
        self.n_bytes = 0
        self._file = open(path, "wb")
        self._n_written = 0
        self._spare_is_lowest = spare_is_lowest
        self._spare: tuple[float, int, str] | None = None  # (score, line index, text)
        self._skip = -1  # line index of a document given away

    def add(self, text: str, score: float = 0.0, ends: bool = True) -> None:
        if self._spare is None or (score < self._spare[0]) == self._spare_is_lowest:
            self._spare = (score, self._n_written, text)
        self._file.write(json.dumps([text, ends]).encode("ascii") + b"\n")
        self._n_written += 1
        self.n_docs += 1
        self.n_bytes += len(text.encode("utf-8"))

    def give_spare(self) -> str:
        """Remove the spare document from this split (at most once) and return its text."""
        _, self._skip, text = self._spare
        self.n_docs -= 1
        self.n_bytes -= len(text.encode("utf-8"))
        return text

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "_Spill":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def pieces(self):
        """``(text, ends)`` pairs in order, without the document given away."""
        with open(self.path, "rb") as f:
            for i, line in enumerate(f):
                if i != self._skip:
                    text, ends = json.loads(line)
                    yield text, ends or i == self._skip - 1

    def __iter__(self):
        return (text for text, _ in self.pieces())


def check_inputs(source: str, tokenizer: str) -> None:
    """What can be checked of :func:`prepare_dataset`'s ``source`` and ``tokenizer`` without
    reading or building anything (``--dry-run``): a ``bpe:N`` spec parses, a tokenizer file path
    exists, the source names something (:func:`keel.data.sources.check_source`).

    Raises:
        KeelError: a bad tokenizer spec, a missing tokenizer file, an unknown or missing source.
    """
    if _parse_bpe(tokenizer) is None and _is_tokenizer_path(tokenizer) and not Path(tokenizer).expanduser().exists():
        raise KeelError(f"no such tokenizer file: {Path(tokenizer).expanduser()}")
    check_source(source)


def _is_tokenizer_path(spec: str) -> bool:
    """Whether a tokenizer spec other than ``bpe:N`` names a file (not a Hugging Face name)."""
    return spec.endswith(".json") or spec.startswith((".", "/", "~"))


def _parse_bpe(spec: str) -> int | None:
    """``"bpe:N"`` -> ``N`` (validated); ``None`` for any other tokenizer spec."""
    if not isinstance(spec, str) or not spec:
        raise KeelError("tokenizer must be a non-empty string")
    if not spec.startswith("bpe:"):
        return None
    try:
        size = int(spec[len("bpe:") :])
    except ValueError:
        raise KeelError(f"bad tokenizer spec {spec!r} (expected bpe:N with an integer N, e.g. bpe:8192)") from None
    if not 257 <= size <= 2**31 - 1:
        raise KeelError(f"bad tokenizer spec {spec!r}: N must be from 257 (256 bytes + <|endoftext|>) to "
                        f"{2**31 - 1:,} (token ids are int32)")
    return size


def _train_bpe(train: _Spill, vocab_size: int, progress: bool) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenization) trained on the documents of ``train``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        # the trainer's progress bar writes to stdout: only on a terminal (no blank lines in pipes)
        show_progress=progress and sys.stdout.isatty(),
    )
    tok.train_from_iterator(iter(train), trainer=trainer, length=train.n_docs)
    return tok


def _load_existing_tokenizer(spec: str, dest: Path) -> tuple[Tokenizer, int]:
    """Load a ``tokenizer.json`` path or a Hugging Face tokenizer name, save it to ``dest``.

    Returns ``(tokenizer, eos_id)``.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    check_regular_file(path, "--tokenizer")  # a FIFO blocked, a device was read for ever
    config = None
    if path.is_file():
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 -- narrowed: tokenizers raises the base class itself
            if not _tokenizers_error(e):
                raise
            raise KeelError(f"cannot read tokenizer {path}: {e}") from None
        shutil.copyfile(path, dest)
        config_path = path.with_name("tokenizer_config.json")
        if config_path.is_file():
            config = json.loads(config_path.read_text())
    elif _is_tokenizer_path(spec):
        raise KeelError(f"no such tokenizer file: {path}")
    elif re.fullmatch(r"[\w.-]+(/[\w.-]+)?", spec):
        check_hub_reachable(f"tokenizer {spec!r}")
        try:
            tok = Tokenizer.from_pretrained(spec)
        except Exception as e:  # noqa: BLE001 -- narrowed: tokenizers raises the base class itself
            if not (_tokenizers_error(e) or isinstance(e, hub_errors())):
                raise
            raise KeelError(f"cannot load tokenizer {spec!r} from the Hugging Face hub: {e}") from None
        tok.save(str(dest))
        config = _hub_tokenizer_config(spec)
    else:
        raise KeelError(
            f"unknown tokenizer {spec!r} (expected bpe:N, a tokenizer.json path, or a Hugging Face tokenizer name)"
        )
    return tok, _eos_id(tok, config, spec)


def _tokenizers_error(e: BaseException) -> bool:
    """Whether ``e`` is an error of the ``tokenizers`` library: its Rust core raises the base
    class ``Exception`` itself, never a subclass (bad JSON, not a tokenizer, a missing file
    "... (os error 2)"). Anything else (a subclass) is not the library's and is not caught."""
    return type(e) is Exception


def _hub_tokenizer_config(name: str) -> dict | None:
    """The hub repo's ``tokenizer_config.json`` as a dict, or None when it cannot be fetched
    or read (:func:`keel.data.sources.hub_errors`: missing, offline, not JSON)."""
    try:
        return json.loads(Path(hf_hub_download(name, "tokenizer_config.json")).read_text())
    except hub_errors():  # optional file; its absence is reported by _eos_id if it matters
        return None


def _eos_id(tok: Tokenizer, config: dict | None, spec: str) -> int:
    eos_id = tok.token_to_id(EOS_TOKEN)
    if eos_id is not None:
        return eos_id
    eos = (config or {}).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and tok.token_to_id(eos) is not None:
        return tok.token_to_id(eos)
    raise KeelError(
        f"tokenizer {spec!r} has no end-of-text token: no {EOS_TOKEN!r} in its vocabulary "
        "and no eos_token in an adjacent tokenizer_config.json"
    )


def _encode_split(tok: Tokenizer, eos_id: int, spill: _Spill, path: Path, vocab_size: int, progress: bool) -> int:
    """Encode the documents of ``spill`` (:func:`keel.data.text.encode_batch`; EOS where a
    document ends) into the shard ``path``, in batches of at most ``ENCODE_BATCH_DOCS``
    documents and ``ENCODE_BATCH_CHARS`` characters (bounded memory); returns its token count."""
    eos = np.array([eos_id], dtype=np.int64)
    with ShardWriter(path, vocab_size) as writer:
        pieces = _progress(spill.pieces(), spill.n_docs, f"encoding {path.stem}", "doc", progress)
        for batch in _batches(pieces):
            parts = []
            for piece_ids, (_, ends) in zip(encode_batch(tok, [text for text, _ in batch]), batch):
                parts.append(np.array(piece_ids, dtype=np.int64))
                if ends:
                    parts.append(eos)
            writer.write(np.concatenate(parts))
    return writer.n_tokens


def _batches(pieces):
    """Lists of consecutive ``(text, ends)`` pieces, cut at ENCODE_BATCH_DOCS pieces or
    ENCODE_BATCH_CHARS characters (a piece longer than that is a batch of its own)."""
    batch, chars = [], 0
    for piece in pieces:
        if batch and (len(batch) >= ENCODE_BATCH_DOCS or chars + len(piece[0]) > ENCODE_BATCH_CHARS):
            yield batch
            batch, chars = [], 0
        batch.append(piece)
        chars += len(piece[0])
    if batch:
        yield batch


def _progress(iterable, total, desc: str, unit: str, enabled: bool):
    """``tqdm`` on stderr when enabled, else ``iterable`` unchanged."""
    if not enabled:
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)


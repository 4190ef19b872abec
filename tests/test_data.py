"""Tests of keel.data: shards, sources, prepare (with caching) and the token loader."""

from __future__ import annotations

import json
import os
import struct
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import keel.data.prepare as prepare_mod
from keel.data import (
    TokenLoader,
    check_tokenizer_matches,
    iter_documents,
    load_tokenizer,
    prepare_dataset,
    read_meta,
    read_shard,
    validation_tokens,
    write_shard,
)
from keel.data.shards import ShardWriter
from keel.data.sources import SourceStats, source_fingerprint, stdlib_files
from keel.errors import KeelError

STDLIB_BYTES = 200_000


# --- helpers --------------------------------------------------------------------------


def make_dataset(path: Path, train, val=None, vocab_size: int = 1 << 20) -> Path:
    """A minimal prepared dataset directory holding the given token arrays."""
    path.mkdir(parents=True, exist_ok=True)
    val = np.arange(100) if val is None else val
    write_shard(path / "train.bin", train, vocab_size)
    write_shard(path / "val.bin", val, vocab_size)
    (path / "meta.json").write_text(json.dumps({"format_version": 1, "vocab_size": vocab_size}))
    return path


def split_docs(tok: Tokenizer, tokens: np.ndarray, eos_id: int) -> list[str]:
    """Decode a shard back into its documents (each ends with EOS)."""
    ends = np.flatnonzero(tokens == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends)]


def write_files(root: Path, files: dict[str, str | bytes]) -> Path:
    for name, content in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return root


SMALL_CORPUS = {
    f"doc{i:02d}.txt": f"Document number {i}.\nIt talks about topic {i % 3} and ends here. " * (i + 1)
    for i in range(30)
}


@pytest.fixture(scope="module")
def stdlib_ds(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    return prepare_dataset("builtin:python-stdlib", "bpe:512", cache_dir=cache, max_bytes=STDLIB_BYTES, progress=False)


@pytest.fixture
def no_hf_offline(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)


# --- shards ---------------------------------------------------------------------------


def test_shard_roundtrip_uint16(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 1000, size=5000)
    path = write_shard(tmp_path / "a.bin", tokens, vocab_size=1000)
    raw = path.read_bytes()
    assert raw[:8] == b"KEELTOK\0"
    assert struct.unpack("<IIQ", raw[8:24]) == (1, 2, 5000)
    assert len(raw) == 24 + 2 * 5000
    got = read_shard(path)
    assert isinstance(got, np.memmap) and got.dtype == np.uint16
    np.testing.assert_array_equal(got, tokens)


def test_shard_roundtrip_uint32_from_list(tmp_path):
    tokens = [0, 1, 65535, 65536, 99_999]
    path = write_shard(tmp_path / "a.bin", tokens, vocab_size=100_000)
    got = read_shard(path)
    assert got.dtype == np.uint32
    assert got.tolist() == tokens
    assert path.stat().st_size == 24 + 4 * len(tokens)


def test_shard_dtype_boundary(tmp_path):
    small = read_shard(write_shard(tmp_path / "a.bin", [0, 65534], vocab_size=65535))
    assert small.dtype == np.uint16 and small.tolist() == [0, 65534]
    big = read_shard(write_shard(tmp_path / "b.bin", [0, 65535], vocab_size=65536))
    assert big.dtype == np.uint32 and big.tolist() == [0, 65535]


def test_shard_empty(tmp_path):
    got = read_shard(write_shard(tmp_path / "a.bin", [], vocab_size=10))
    assert len(got) == 0 and got.dtype == np.uint16


@pytest.mark.parametrize("tokens", [[1, 2, 10], [1, -1], [70000], np.array([1.5, 2.0])])
def test_shard_rejects_ids_outside_vocab(tmp_path, tokens):
    with pytest.raises(KeelError, match="outside the vocabulary|must be integers"):
        write_shard(tmp_path / "a.bin", tokens, vocab_size=10)
    assert list(tmp_path.iterdir()) == []  # no shard and no temp file


def test_shard_writer_is_atomic(tmp_path):
    write_shard(tmp_path / "a.bin", [1, 2, 3], vocab_size=10)
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path / "a.bin", vocab_size=10) as w:
            w.write([4, 5])
            raise RuntimeError("interrupted")
    assert read_shard(tmp_path / "a.bin").tolist() == [1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]


def test_shard_writer_that_cannot_start_leaves_nothing_open_or_behind(tmp_path, monkeypatch):
    """issue 20: the temporary shard is opened under a context manager, so a failure while
    the writer starts (here: writing the header) closes it and removes it."""
    import errno
    import gc
    import warnings

    import keel.data.shards as shards_mod

    class FullDisk:
        size = shards_mod.HEADER.size

        @staticmethod
        def pack(*values):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards_mod, "HEADER", FullDisk)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with pytest.raises(KeelError, match=f"cannot write {tmp_path / 'a.bin'}: No space left on device$"):
            ShardWriter(tmp_path / "a.bin", vocab_size=10)  # one line naming the shard, not its temporary file
        gc.collect()
    assert list(tmp_path.iterdir()) == []  # was: the temporary file stayed
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_prepare_closes_its_document_spills_when_reading_fails(tmp_path):
    """issue 20: the train/val document spills are written under ``with``: an empty corpus
    (an error after they were opened) leaves no unclosed file."""
    import gc
    import warnings

    corpus = write_files(tmp_path / "corpus", {"a.txt": "   \n"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with pytest.raises(KeelError, match="empty corpus"):
            prepare_dataset(str(corpus), "bpe:300", tmp_path / "ds", progress=False)
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not [m for m in unclosed if ".docs" in m], unclosed


def test_shard_truncated_or_corrupt(tmp_path):
    path = write_shard(tmp_path / "a.bin", np.arange(100), vocab_size=1000)
    raw = path.read_bytes()
    cases = {
        "truncated": raw[:-3],
        "trailing": raw + b"\0\0",
        "header": raw[:10],
        "magic": b"NOTKEEL\0" + raw[8:],
        "version": raw[:8] + struct.pack("<I", 2) + raw[12:],
        "dtype": raw[:12] + struct.pack("<I", 3) + raw[16:],
    }
    for name, content in cases.items():
        bad = tmp_path / f"{name}.bin"
        bad.write_bytes(content)
        with pytest.raises(KeelError, match="shard"):
            read_shard(bad)
    with pytest.raises(KeelError, match="no such token shard"):
        read_shard(tmp_path / "missing.bin")


# --- sources --------------------------------------------------------------------------


def test_builtin_stdlib_is_deterministic_and_limited():
    stats = SourceStats()
    docs = list(iter_documents("builtin:python-stdlib", max_bytes=STDLIB_BYTES, stats=stats))
    assert docs == list(iter_documents("builtin:python-stdlib", max_bytes=STDLIB_BYTES))
    assert len(docs) >= 2 and all(isinstance(d, str) and d.strip() for d in docs)
    sizes = [len(d.encode("utf-8")) for d in docs]
    assert sum(sizes) >= STDLIB_BYTES > sum(sizes[:-1])  # stops after the crossing document
    assert (stats.n_docs, stats.n_bytes) == (len(docs), sum(sizes))


def test_builtin_stdlib_files_skip_tests_and_site_packages():
    files = stdlib_files()
    assert len(files) > 100
    names = [f.name for f in files]
    assert "os.py" in names and "argparse.py" in names
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root) for f in files]
    for r in rel:
        assert r.suffix == ".py" and not r.name.startswith("test_")
        assert not {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"} & set(r.parts)
    assert rel == sorted(rel, key=lambda r: r.as_posix())


def test_builtin_stdlib_skips_generated_files():
    docs = list(iter_documents("builtin:python-stdlib"))
    heads = ["\n".join(d.splitlines()[:2]).lower() for d in docs]
    assert not [h for h in heads if "generated" in h or "do not edit" in h]
    assert len(docs) < len(stdlib_files())  # e.g. encodings/cp*.py are generated


def test_local_text_folder(tmp_path):
    write_files(
        tmp_path,
        {
            "b.txt": "bee",
            "a/z.md": "# zed",
            "a/y.rst": "why",
            "c.csv": "skipped,extension",
            ".hidden/h.txt": "hidden",
            "blank.txt": "  \n\t",
        },
    )
    assert list(iter_documents(str(tmp_path))) == ["why", "# zed", "bee"]
    assert list(iter_documents(str(tmp_path / "b.txt"))) == ["bee"]
    assert list(iter_documents(str(tmp_path), max_docs=2)) == ["why", "# zed"]


def test_local_jsonl_and_json(tmp_path):
    write_files(
        tmp_path,
        {
            "a.jsonl": '{"text": "one", "id": 1}\n\n"two"\n{"text": null}\n{"body": "x", "text": "three"}\n',
            "b.json": json.dumps([{"text": "four"}, "five"]),
            "c.jsonl": '{"body": "six"}\n',
        },
    )
    assert list(iter_documents(str(tmp_path / "a.jsonl"))) == ["one", "two", "three"]
    assert list(iter_documents(str(tmp_path / "b.json"))) == ["four", "five"]
    assert list(iter_documents(str(tmp_path / "c.jsonl"), text_field="body")) == ["six"]
    with pytest.raises(KeelError, match=r"c\.jsonl:1: no field 'text'"):
        list(iter_documents(str(tmp_path)))


def test_local_json_errors(tmp_path):
    files = {"bad.jsonl": '{"text": "ok"}\n{oops\n', "obj.json": '{"text": "x"}', "n.jsonl": '{"text": 3}\n'}
    write_files(tmp_path, files)
    with pytest.raises(KeelError, match=r"bad\.jsonl:2: invalid JSON"):
        list(iter_documents(str(tmp_path / "bad.jsonl")))
    with pytest.raises(KeelError, match="expected a JSON list"):
        list(iter_documents(str(tmp_path / "obj.json")))
    with pytest.raises(KeelError, match="is a int, expected a string"):
        list(iter_documents(str(tmp_path / "n.jsonl")))


def test_local_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["alpha", None, "beta"], "n": [1, 2, 3]}), tmp_path / "d.parquet")
    assert list(iter_documents(str(tmp_path / "d.parquet"))) == ["alpha", "beta"]
    with pytest.raises(KeelError, match="no column 'body'"):
        list(iter_documents(str(tmp_path / "d.parquet"), text_field="body"))


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(KeelError, match="pip install pyarrow"):
        list(iter_documents(str(tmp_path / "d.parquet")))


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path):
    write_files(tmp_path, {"bad.txt": b"caf\xe9 ok \xff", "good.txt": "fine"})
    stats = SourceStats()
    docs = list(iter_documents(str(tmp_path), stats=stats))
    assert docs == ["caf\ufffd ok \ufffd", "fine"]
    assert stats.docs_with_replacement_chars == 1


def test_lone_surrogates_are_replaced_and_counted(tmp_path):
    write_files(tmp_path, {"a.jsonl": '{"text": "bad \\ud800 half"}\n{"text": "pair \\ud83d\\ude00"}\n'})
    stats = SourceStats()
    assert list(iter_documents(str(tmp_path), stats=stats)) == ["bad \ufffd half", "pair \U0001f600"]
    assert stats.docs_with_replacement_chars == 1


def test_source_errors(tmp_path):
    write_files(tmp_path, {"x.docx": "word"})
    cases = [
        (str(tmp_path / "nope"), "no such file or directory: .*nope"),
        ("foo:bar", "unknown data source scheme 'foo' \\(expected builtin:, hf:, or a local path\\)"),
        ("builtin:nope", "unknown builtin data source 'nope'"),
        (str(tmp_path / "x.docx"), "unsupported data file"),
        ("hf:", "bad Hugging Face source"),
    ]
    for source, message in cases:
        with pytest.raises(KeelError, match=message):
            list(iter_documents(source))


def test_hf_source_fails_fast_offline(monkeypatch, connect_attempts):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KeelError, match="cannot reach the Hugging Face hub.*offline"):
        next(iter_documents("hf:HuggingFaceFW/fineweb-edu:sample-10BT", max_docs=10))
    assert connect_attempts == []  # offline: not one connection is tried


def test_hf_source_fails_fast_when_hub_unreachable(monkeypatch, no_hf_offline, connect_attempts):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(KeelError, match="cannot reach the Hugging Face hub at 127.0.0.1:9"):
        next(iter_documents("hf:some/dataset"))
    assert connect_attempts == [("127.0.0.1", 9)]  # one probe, no retries with back-off


@pytest.fixture
def hub_offline_past_the_probe(monkeypatch):
    """The hub probe passes, but huggingface_hub and datasets are in offline mode: a load
    reaches the library and fails there (this machine has no network either)."""
    import datasets.config
    import huggingface_hub.constants as hub_constants

    import keel.data.sources as sources_mod

    monkeypatch.setattr(sources_mod, "check_hub_reachable", lambda what: None)
    monkeypatch.setattr(prepare_mod, "check_hub_reachable", lambda what: None)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)


def test_hf_dataset_load_errors_are_one_line_and_bugs_are_not_hidden(hub_offline_past_the_probe, monkeypatch):
    """issue 20: the hf: source catches the hub's errors (hub_errors), not every Exception."""
    import datasets

    with pytest.raises(KeelError, match="cannot load Hugging Face dataset 'hf:keel-no-such-org/no-such-dataset': "):
        next(iter_documents("hf:keel-no-such-org/no-such-dataset"))

    def buggy(*args, **kwargs):
        raise TypeError("a bug, not a missing dataset")

    monkeypatch.setattr(datasets, "load_dataset", buggy)
    with pytest.raises(TypeError, match="a bug"):  # was turned into "cannot load Hugging Face dataset"
        next(iter_documents("hf:keel-no-such-org/no-such-dataset"))


def test_tokenizer_load_errors_are_one_line_and_bugs_are_not_hidden(tmp_path, monkeypatch, hub_offline_past_the_probe):
    corpus = tmp_path / "corpus"
    write_files(corpus, {"a.txt": "hello world " * 50})
    (tmp_path / "bad.json").write_text("not a tokenizer")
    with pytest.raises(KeelError, match="cannot read tokenizer .*bad.json: expected"):  # tokenizers' own error
        prepare_dataset(str(corpus), str(tmp_path / "bad.json"), tmp_path / "ds", progress=False)
    with pytest.raises(KeelError, match="cannot load tokenizer 'keel-no-such-org/tok' from the Hugging Face hub"):
        prepare_dataset(str(corpus), "keel-no-such-org/tok", tmp_path / "ds", progress=False)
    assert prepare_mod._hub_tokenizer_config("keel-no-such-org/tok") is None  # offline: the optional file is absent

    class Buggy:
        @staticmethod
        def from_file(path):
            raise TypeError("a bug, not a bad file")

    monkeypatch.setattr(prepare_mod, "Tokenizer", Buggy)
    with pytest.raises(TypeError, match="a bug"):  # was "cannot read tokenizer ...: a bug"
        prepare_dataset(str(corpus), str(tmp_path / "bad.json"), tmp_path / "ds", progress=False)


# --- prepare --------------------------------------------------------------------------


def test_prepare_meta_and_shards(stdlib_ds):
    meta = read_meta(stdlib_ds)
    docs = list(iter_documents("builtin:python-stdlib", max_bytes=STDLIB_BYTES))
    tok = load_tokenizer(stdlib_ds)
    train, val = read_shard(stdlib_ds / "train.bin"), read_shard(stdlib_ds / "val.bin")
    assert meta["source"] == "builtin:python-stdlib" and meta["tokenizer"] == "bpe:512"
    assert meta["vocab_size"] == tok.get_vocab_size() == 512
    assert meta["eos_id"] == tok.token_to_id("<|endoftext|>")
    assert meta["n_docs_train"] + meta["n_docs_val"] == len(docs)
    assert meta["n_docs_val"] >= 1 and meta["n_docs_train"] >= 1
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    assert meta["bytes_train"] + meta["bytes_val"] == sum(len(d.encode()) for d in docs)
    assert meta["docs_with_replacement_chars"] == 0
    assert (meta["val_fraction"], meta["seed"], meta["max_bytes"]) == (0.05, 0, STDLIB_BYTES)
    assert meta["dtype"] == "uint16" and train.dtype == np.uint16
    import hashlib

    assert meta["tokenizer_sha256"] == hashlib.sha256((stdlib_ds / "tokenizer.json").read_bytes()).hexdigest()
    # one EOS per document, and each shard ends with one
    assert int((train == meta["eos_id"]).sum()) == meta["n_docs_train"]
    assert int((val == meta["eos_id"]).sum()) == meta["n_docs_val"]
    assert train[-1] == val[-1] == meta["eos_id"]
    assert sorted(p.name for p in stdlib_ds.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]


def test_prepare_splits_by_document_and_round_trips(stdlib_ds):
    meta, tok = read_meta(stdlib_ds), load_tokenizer(stdlib_ds)
    train_docs = split_docs(tok, np.asarray(read_shard(stdlib_ds / "train.bin")), meta["eos_id"])
    val_docs = split_docs(tok, np.asarray(read_shard(stdlib_ds / "val.bin")), meta["eos_id"])
    docs = list(iter_documents("builtin:python-stdlib", max_bytes=STDLIB_BYTES))
    assert not set(train_docs) & set(val_docs)
    assert sorted(train_docs + val_docs) == sorted(docs)  # byte-level BPE decodes exactly
    assert train_docs == [d for d in docs if d not in set(val_docs)]  # order kept


def test_prepare_default_dir_and_cache(stdlib_ds, monkeypatch):
    cache = stdlib_ds.parent
    assert stdlib_ds.name.startswith("python-stdlib-bpe512-") and len(stdlib_ds.name.split("-")[-1]) == 8
    mtime = (stdlib_ds / "train.bin").stat().st_mtime_ns

    def must_not_read(*args, **kwargs):
        raise AssertionError("cached dataset was re-read")

    with monkeypatch.context() as m:
        m.setattr(prepare_mod, "iter_documents", must_not_read)
        again = prepare_dataset(
            "builtin:python-stdlib", "bpe:512", cache_dir=cache, max_bytes=STDLIB_BYTES, progress=False
        )
    assert again == stdlib_ds
    assert (stdlib_ds / "train.bin").stat().st_mtime_ns == mtime
    other = prepare_dataset("builtin:python-stdlib", "bpe:512", cache_dir=cache, max_bytes=100_000, progress=False)
    assert other != stdlib_ds and other.parent == cache
    assert read_meta(other)["max_bytes"] == 100_000
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_prepare_replaces_explicit_out_of_other_options_only_with_force(tmp_path):
    corpus = write_files(tmp_path / "corpus", SMALL_CORPUS)
    out = tmp_path / "ds"
    prepare_dataset(str(corpus), "bpe:300", out, val_fraction=0.2, progress=False)
    first = read_meta(out)
    assert first["source"] == str(corpus.resolve())
    with pytest.raises(KeelError, match=r"refusing to replace .*ds: .*other inputs \(seed 0 \(now 1\)\).*--force"):
        prepare_dataset(str(corpus), "bpe:300", out, val_fraction=0.2, seed=1, progress=False)
    assert read_meta(out) == first  # untouched: runs trained on it read it by path
    prepare_dataset(str(corpus), "bpe:300", out, val_fraction=0.2, seed=1, progress=False, force=True)
    second = read_meta(out)
    assert second["seed"] == 1 and second["n_docs_train"] + second["n_docs_val"] == len(SMALL_CORPUS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "ds"]


def test_prepare_again_after_the_local_corpus_changed(tmp_path, caplog):
    corpus = write_files(tmp_path / "corpus", SMALL_CORPUS)
    cache = tmp_path / "cache"
    first = prepare_dataset(str(corpus), "bpe:300", cache_dir=cache, val_fraction=0.2, progress=False)
    n_docs = read_meta(first)["n_docs_train"] + read_meta(first)["n_docs_val"]
    assert prepare_dataset(str(corpus), "bpe:300", cache_dir=cache, val_fraction=0.2, progress=False) == first
    (corpus / "new.txt").write_text("a document added after the first prepare\n" * 5)
    with caplog.at_level("INFO", logger="keel.data.prepare"):
        again = prepare_dataset(str(corpus), "bpe:300", cache_dir=cache, val_fraction=0.2, progress=False)
    assert again == first and "changed since" in caplog.text  # same folder, rebuilt
    meta = read_meta(again)
    assert meta["n_docs_train"] + meta["n_docs_val"] == n_docs + 1
    assert meta["source_fingerprint"] == source_fingerprint(str(corpus.resolve()))
    assert prepare_mod.find_prepared(str(corpus), "bpe:300", val_fraction=0.2, cache_dir=cache) == again
    (corpus / "new.txt").write_text("edited\n")  # an edit: size changes
    assert prepare_mod.find_prepared(str(corpus), "bpe:300", val_fraction=0.2, cache_dir=cache) is None
    assert sorted(p.name for p in cache.iterdir()) == [first.name]


def test_source_fingerprint_follows_paths_sizes_and_mtimes(tmp_path):
    corpus = write_files(tmp_path / "corpus", {"a.txt": "one", "sub/b.md": "two"})
    fp = source_fingerprint(str(corpus))
    assert fp == source_fingerprint(str(corpus)) and len(fp) == 64
    (corpus / ".hidden").write_text("ignored as iter_documents ignores it")
    assert source_fingerprint(str(corpus)) == fp
    st = (corpus / "sub/b.md").stat()
    os.utime(corpus / "sub/b.md", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    touched = source_fingerprint(str(corpus))
    assert touched != fp
    (corpus / "sub/b.md").rename(corpus / "b.md")
    assert source_fingerprint(str(corpus)) not in (fp, touched)
    assert source_fingerprint(str(corpus / "a.txt")) != source_fingerprint(str(corpus))
    assert source_fingerprint("builtin:python-stdlib") is None
    assert source_fingerprint("hf:org/data") is None


def test_prepare_force_builds_again(tmp_path):
    corpus = write_files(tmp_path / "corpus", SMALL_CORPUS)
    out = prepare_dataset(str(corpus), "bpe:300", tmp_path / "ds", val_fraction=0.2, progress=False)
    before = (out / "meta.json").stat().st_ino
    assert prepare_dataset(str(corpus), "bpe:300", out, val_fraction=0.2, progress=False) == out
    assert (out / "meta.json").stat().st_ino == before
    prepare_dataset(str(corpus), "bpe:300", out, val_fraction=0.2, progress=False, force=True)
    assert (out / "meta.json").stat().st_ino != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "ds"]


def test_prepare_refuses_to_overwrite_other_dirs(tmp_path):
    corpus = write_files(tmp_path / "corpus", SMALL_CORPUS)
    with pytest.raises(KeelError, match="not a prepared dataset"):
        prepare_dataset(str(corpus), "bpe:300", corpus, progress=False)
    assert len(list(corpus.iterdir())) == len(SMALL_CORPUS)


def test_prepare_empty_corpus(tmp_path):
    corpus = write_files(tmp_path / "corpus", {"a.txt": "", "b.txt": " \n ", "c.md": ""})
    with pytest.raises(KeelError, match="empty corpus"):
        prepare_dataset(str(corpus), "bpe:300", cache_dir=tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache").exists()  # not even an empty cache folder


def test_prepare_counts_replacement_chars(tmp_path):
    corpus = write_files(tmp_path / "corpus", {**SMALL_CORPUS, "bad.txt": b"latin-1 caf\xe9 " * 20})
    out = prepare_dataset(str(corpus), "bpe:300", tmp_path / "ds", val_fraction=0.2, progress=False)
    meta, tok = read_meta(out), load_tokenizer(out)
    assert meta["docs_with_replacement_chars"] == 1
    docs = split_docs(tok, np.asarray(read_shard(out / "train.bin")), meta["eos_id"])
    docs += split_docs(tok, np.asarray(read_shard(out / "val.bin")), meta["eos_id"])
    assert "latin-1 caf\ufffd " * 20 in docs


def test_prepare_literal_eos_text_is_not_an_eos(tmp_path):
    corpus = write_files(tmp_path / "corpus", {**SMALL_CORPUS, "x.txt": "before <|endoftext|> after"})
    out = prepare_dataset(str(corpus), "bpe:300", tmp_path / "ds", val_fraction=0.2, progress=False)
    meta = read_meta(out)
    n_eos = sum(int((read_shard(out / f"{s}.bin") == meta["eos_id"]).sum()) for s in ("train", "val"))
    assert n_eos == len(SMALL_CORPUS) + 1


def test_prepare_tiny_corpus_gets_one_val_doc(tmp_path):
    corpus = write_files(tmp_path / "corpus", {"a.txt": "first document", "b.txt": "second document"})
    meta = read_meta(prepare_dataset(str(corpus), "bpe:300", tmp_path / "ds", progress=False))
    assert (meta["n_docs_train"], meta["n_docs_val"]) == (1, 1)


@pytest.mark.parametrize("target", ["_train_bpe", "write_val_shard"])
def test_prepare_failure_leaves_nothing(tmp_path, monkeypatch, target):
    corpus = write_files(tmp_path / "corpus", SMALL_CORPUS)
    if target == "_train_bpe":
        monkeypatch.setattr(prepare_mod, "_train_bpe", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    else:  # fail while writing val.bin, after train.bin is complete
        real_write = ShardWriter.write

        def write(self, tokens):
            if self.path.name == "val.bin":
                raise RuntimeError("boom")
            real_write(self, tokens)

        monkeypatch.setattr(ShardWriter, "write", write)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="boom"):
        prepare_dataset(str(corpus), "bpe:300", cache_dir=cache, val_fraction=0.2, progress=False)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_prepare_with_existing_tokenizer_file(stdlib_ds, tmp_path):
    corpus = write_files(tmp_path / "corpus", SMALL_CORPUS)
    tok_path = stdlib_ds / "tokenizer.json"
    out = prepare_dataset(str(corpus), str(tok_path), tmp_path / "ds", val_fraction=0.2, progress=False)
    meta = read_meta(out)
    assert meta["tokenizer_sha256"] == read_meta(stdlib_ds)["tokenizer_sha256"]
    assert meta["vocab_size"] == 512 and meta["eos_id"] == read_meta(stdlib_ds)["eos_id"]


def test_prepare_tokenizer_eos_from_config(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SMALL_CORPUS.values(), trainer=trainer)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    corpus = write_files(tmp_path / "corpus", SMALL_CORPUS)
    with pytest.raises(KeelError, match="no end-of-text token"):
        prepare_dataset(str(corpus), str(tok_dir / "tokenizer.json"), tmp_path / "ds", progress=False)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    out = prepare_dataset(str(corpus), str(tok_dir), tmp_path / "ds", progress=False)
    assert read_meta(out)["eos_id"] == tok.token_to_id("</s>")


def test_prepare_option_errors(tmp_path, monkeypatch, connect_attempts):
    corpus = write_files(tmp_path / "corpus", SMALL_CORPUS)
    cases = [
        ({"tokenizer": "bpe:abc"}, "bad tokenizer spec 'bpe:abc'"),
        ({"tokenizer": "bpe:100"}, "N must be from 257 "),
        ({"tokenizer": "foo:bar"}, "unknown tokenizer 'foo:bar'"),
        ({"tokenizer": str(tmp_path / "missing.json")}, "no such tokenizer file"),
        ({"val_fraction": 0.0}, "val_fraction must be between 0 and 1"),
        ({"val_fraction": 1.0}, "val_fraction must be between 0 and 1"),
        ({"max_bytes": -5}, "max_bytes must be a non-negative integer"),
    ]
    for kwargs, message in cases:
        with pytest.raises(KeelError, match=message):
            prepare_dataset(str(corpus), **{"tokenizer": "bpe:300", **kwargs}, cache_dir=tmp_path / "c", progress=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KeelError, match="cannot reach the Hugging Face hub to load tokenizer 'some-org/tok'"):
        prepare_dataset(str(corpus), "some-org/tok", cache_dir=tmp_path / "c", progress=False)
    with pytest.raises(KeelError, match="cannot reach the Hugging Face hub"):
        prepare_dataset("hf:some/dataset", "bpe:300", cache_dir=tmp_path / "c", progress=False)
    assert connect_attempts == []  # offline: not one connection is tried
    assert not [p for p in (tmp_path / "c").iterdir()] if (tmp_path / "c").exists() else True


# --- loader ---------------------------------------------------------------------------


def take(loader: TokenLoader, n: int) -> list[torch.Tensor]:
    return [loader.next_batch() for _ in range(n)]


def test_loader_batches_are_contiguous_windows(tmp_path):
    data = make_dataset(tmp_path / "ds", np.arange(1000))  # token value == position
    loader = TokenLoader(data, batch_size=4, seq_len=16, seed=0)
    assert loader.n_windows == (1000 - 1) // 16 and loader.batches_per_epoch == loader.n_windows // 4
    for batch in take(loader, 20):
        assert batch.dtype == torch.int64 and batch.shape == (4, 17)
        for row in batch:
            assert int(row[0]) % 16 == 0
            assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 17))
            assert torch.equal(row[1:], row[:-1] + 1)  # targets are the next tokens


def test_loader_is_deterministic_per_seed(tmp_path):
    data = make_dataset(tmp_path / "ds", np.arange(2000))
    a = take(TokenLoader(data, batch_size=4, seq_len=8, seed=0), 10)
    b = take(TokenLoader(data, batch_size=4, seq_len=8, seed=0), 10)
    c = take(TokenLoader(data, batch_size=4, seq_len=8, seed=1), 10)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def epoch_starts(loader: TokenLoader, epochs: int = 1) -> list[list[int]]:
    out = []
    for _ in range(epochs):
        batches = take(loader, loader.batches_per_epoch)
        out.append([int(s) for b in batches for s in b[:, 0]])
    return out


def test_loader_epochs_cover_every_window_once(tmp_path):
    data = make_dataset(tmp_path / "ds", np.arange(8 * 16 + 1))  # 16 windows of 9 tokens
    loader = TokenLoader(data, batch_size=4, seq_len=8, seed=3)
    e0, e1 = epoch_starts(loader, 2)
    assert sorted(e0) == sorted(e1) == list(range(0, 128, 8))
    assert e0 != e1  # a new permutation each epoch


def test_loader_ranks_partition_the_windows(tmp_path):
    data = make_dataset(tmp_path / "ds", np.arange(8 * 16 + 1))
    single = TokenLoader(data, batch_size=2, seq_len=8, seed=5)
    ranks = [TokenLoader(data, batch_size=2, seq_len=8, seed=5, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].batches_per_epoch == ranks[1].batches_per_epoch == single.batches_per_epoch // 2
    for _ in range(2):  # two epochs
        r0, r1 = (epoch_starts(r)[0] for r in ranks)
        (one,) = epoch_starts(single)
        assert not set(r0) & set(r1)
        assert sorted(r0 + r1) == sorted(one)


def test_loader_state_dict_resume(tmp_path):
    data = make_dataset(tmp_path / "ds", np.arange(8 * 20 + 1))  # 20 windows, 5 batches/epoch
    for stop in (3, 5, 7):  # mid-epoch, exactly at the epoch end, in the second epoch
        ref = TokenLoader(data, batch_size=4, seq_len=8, seed=11)
        take(ref, stop)
        state_file = tmp_path / "state.pt"
        torch.save(ref.state_dict(), state_file)
        expected = take(ref, 12)  # crosses at least one epoch boundary
        resumed = TokenLoader(data, batch_size=4, seq_len=8, seed=11)
        resumed.load_state_dict(torch.load(state_file, weights_only=True))
        assert all(torch.equal(x, y) for x, y in zip(expected, take(resumed, 12)))
    assert all(isinstance(v, (int, str)) for v in ref.state_dict().values())
    other = TokenLoader(data, batch_size=2, seq_len=8, seed=11)
    with pytest.raises(KeelError, match="cannot resume the data loader: saved batch_size=4"):
        other.load_state_dict(ref.state_dict())


def test_loader_iterates(tmp_path):
    data = make_dataset(tmp_path / "ds", np.arange(500))
    loader = TokenLoader(data, batch_size=2, seq_len=8)
    assert next(iter(loader)).shape == (2, 9)


def test_loader_corpus_too_small(tmp_path):
    data = make_dataset(tmp_path / "ds", np.arange(50))
    message = "corpus too small: 50 tokens in split 'train', need at least 65 for batch_size=1 seq_len=64"
    with pytest.raises(KeelError, match=message):
        TokenLoader(data, batch_size=1, seq_len=64)
    message = "corpus too small: 50 tokens.*need at least 257 for batch_size=4 seq_len=8 world_size=8"
    with pytest.raises(KeelError, match=message):
        TokenLoader(data, batch_size=4, seq_len=8, world_size=8)  # 6 windows < 32
    assert TokenLoader(data, batch_size=6, seq_len=8).batches_per_epoch == 1  # (50-1)//8 = 6 windows


def test_loader_errors(tmp_path):
    data = make_dataset(tmp_path / "ds", np.arange(500))
    with pytest.raises(KeelError, match="unknown split 'test'"):
        TokenLoader(data, "test", batch_size=1, seq_len=8)
    with pytest.raises(KeelError, match="rank must be in"):
        TokenLoader(data, batch_size=1, seq_len=8, rank=2, world_size=2)
    with pytest.raises(KeelError, match=r"not a prepared dataset: .* \(run `keel prepare` first\)"):
        TokenLoader(tmp_path, batch_size=1, seq_len=8)
    with pytest.raises(KeelError, match="not a prepared dataset"):
        load_tokenizer(tmp_path)


def test_validation_tokens(tmp_path):
    data = make_dataset(tmp_path / "ds", np.arange(500), val=np.arange(1000, 1100))
    all_windows = validation_tokens(data, seq_len=8)
    assert all_windows.dtype == torch.int64 and all_windows.shape == ((100 - 1) // 8, 9)
    assert torch.equal(all_windows[0], torch.arange(1000, 1009))
    assert torch.equal(all_windows[1], torch.arange(1008, 1017))
    assert torch.equal(validation_tokens(data, seq_len=8, max_tokens=32), all_windows[:4])
    assert validation_tokens(data, seq_len=8, max_tokens=1).shape == (1, 9)
    with pytest.raises(KeelError, match="validation split too small: 100 tokens"):
        validation_tokens(data, seq_len=100)


def test_loader_on_prepared_stdlib(stdlib_ds):
    loader = TokenLoader(stdlib_ds, batch_size=4, seq_len=64, seed=0)
    batch = loader.next_batch()
    assert batch.shape == (4, 65) and 0 <= int(batch.min()) and int(batch.max()) < read_meta(stdlib_ds)["vocab_size"]
    val = validation_tokens(stdlib_ds, seq_len=64, max_tokens=64 * 8)
    assert val.shape[1] == 65 and 1 <= val.shape[0] <= 8


def test_split_windows_whole_windows_and_cap():
    """The one windowing rule: stride seq_len, overlap one token, capped by max_tokens."""
    from keel.data import split_windows

    w = torch.stack(split_windows(list(range(100)), 10, max_tokens=35))
    assert w.shape == (3, 11) and w[1, 0] == 10 and w[1, -1] == 20
    assert torch.stack(split_windows(list(range(100)), 10)).shape == (9, 11)
    assert split_windows([1, 2], 10) == []
    tail = split_windows(list(range(25)), 10, keep_tail=True)
    assert [len(r) for r in tail] == [11, 11, 5] and tail[-1].tolist() == list(range(20, 25))
    with pytest.raises(KeelError, match="seq_len"):
        split_windows([1, 2, 3], 0)


def test_a_tokenizer_one_merge_short_does_not_match_its_dataset(tiny_data):
    """The vocabularies alone were compared: a tokenizer with the dataset's vocabulary but one BPE
    merge fewer (which maps text to other ids) passed `keel eval --hf` / `ablate --hf` unnoticed."""
    import json

    from tokenizers import Tokenizer

    own = load_tokenizer(tiny_data)
    check_tokenizer_matches(Tokenizer.from_str(own.to_str()), tiny_data)  # the same tokenizer passes
    spec = json.loads(own.to_str())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    short = Tokenizer.from_str(json.dumps(spec))
    assert short.get_vocab(with_added_tokens=True) == own.get_vocab(with_added_tokens=True)
    dropped = "".join(json.loads(own.to_str())["model"]["merges"][-1])  # the token the last merge makes
    text = own.decode([own.token_to_id(dropped)])
    assert own.encode(text).ids == [own.token_to_id(dropped)] and short.encode(text).ids != own.encode(text).ids
    with pytest.raises(KeelError, match=rf"^{tiny_data} was prepared with another tokenizer than the model's "
                                        r"\(their vocabularies or merges differ\)"):
        check_tokenizer_matches(short, tiny_data)

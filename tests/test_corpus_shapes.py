"""Issue 11, sections 3-5: any corpus shape, one way to turn text into tokens, sampling at
any temperature. Each test is one example of the issue with the right value asserted."""

import math
import sys

import pytest
import torch

from conftest import REPO, tiny_overrides
from keel import KeelError
from keel.config import load_config
from keel.data import load_tokenizer, prepare_dataset, read_meta, read_shard, validation_tokens
from keel.data.prepare import CHUNK_CHARS, LONG_DOC_CHARS, chunk_document
from keel.data.sources import html_text, iter_documents
from keel.data.text import encode_text, looks_binary, read_text_file


def one_file(tmp_path, n_bytes=700_000):
    """A real-text corpus that is a single file (standard-library source, concatenated)."""
    docs, size = [], 0
    for d in iter_documents("builtin:python-stdlib"):
        docs.append(d)
        size += len(d.encode())
        if size > n_bytes:
            break
    path = tmp_path / "book.txt"
    path.write_text("".join(docs), encoding="utf-8")
    return path


# ---------------------------------------------------------------- 3. corpus shapes
def test_chunk_document_is_a_partition_cut_at_newlines():
    text = "".join(f"line {i} " * (i % 7 + 1) + "\n" for i in range(40_000))
    pieces = list(chunk_document(text))
    assert "".join(pieces) == text
    assert all(len(p) <= CHUNK_CHARS for p in pieces) and all(p.endswith("\n") for p in pieces[:-1])
    assert len(pieces) == math.ceil(len(text) / CHUNK_CHARS) or len(pieces) == math.ceil(len(text) / CHUNK_CHARS) + 1
    no_newline = "x" * (3 * CHUNK_CHARS + 5)
    assert [len(p) for p in chunk_document(no_newline)] == [CHUNK_CHARS] * 3 + [5]


@pytest.mark.parametrize("val_fraction", [0.05, 0.5])
def test_a_corpus_that_is_one_file_gets_a_validation_split(val_fraction, tmp_path, caplog):
    """One file used to prepare with 0 validation tokens (with 0.5 too) and then not train."""
    book = one_file(tmp_path)
    text = book.read_text()
    with caplog.at_level("INFO", logger="keel"):
        out = prepare_dataset(str(book), "bpe:300", tmp_path / "ds", val_fraction=val_fraction, progress=False)
    meta = read_meta(out)
    n_chunks = len(list(chunk_document(text)))
    assert meta["long_docs_chunked"] == 1 and meta["chunks_of_long_docs"] == n_chunks
    assert meta["n_docs_train"] + meta["n_docs_val"] == n_chunks
    assert meta["n_docs_val"] >= 1 and meta["val_tokens"] > 1000
    assert meta["bytes_train"] + meta["bytes_val"] == len(text.encode())
    assert any("cut 1 long document" in r.getMessage() for r in caplog.records)
    assert validation_tokens(out, 32).shape[1] == 33
    # nothing lost: the two shards, EOS removed, decode to the file's text (chunks in order per split)
    tok = load_tokenizer(out)
    eos = meta["eos_id"]
    decoded = sorted(tok.decode([int(t) for t in read_shard(out / f"{s}.bin") if t != eos]) for s in ("train", "val"))
    assert sum(len(d) for d in decoded) == len(text)
    if val_fraction == 0.5:
        assert 0.3 < meta["n_docs_val"] / n_chunks < 0.7


def test_a_corpus_without_validation_tokens_says_so(tmp_path, caplog):
    """One short document beside one with NUL bytes (skipped as binary) prepared with 0 validation
    tokens and no word about it (reliability v4)."""
    src = tmp_path / "src"
    src.mkdir()
    book = one_file(tmp_path, n_bytes=60_000)
    (src / "a.txt").write_text(book.read_text()[:60_000], encoding="utf-8")
    (src / "b.txt").write_bytes(b"\x00\x01\x02" * 1000)
    with caplog.at_level("WARNING", logger="keel"):
        out = prepare_dataset(str(src), "bpe:300", tmp_path / "ds", progress=False)
    assert read_meta(out)["val_tokens"] == 0
    assert any("has no validation tokens: all 1 document(s) went to the training split" in r.getMessage()
               for r in caplog.records)


def test_short_documents_are_not_chunked(tmp_path):
    (tmp_path / "c").mkdir()
    for i in range(3):
        (tmp_path / "c" / f"{i}.txt").write_text(f"document {i}\n" * 100)
    meta = read_meta(prepare_dataset(str(tmp_path / "c"), "bpe:300", tmp_path / "ds", progress=False))
    assert meta["long_docs_chunked"] == 0 and meta["n_docs_train"] + meta["n_docs_val"] == 3
    assert LONG_DOC_CHARS == 256 * 1024


def test_html_folder_is_read_as_text(tmp_path):
    """A folder of .html files said "empty corpus"."""
    c = tmp_path / "site"
    c.mkdir()
    for i in range(3):
        (c / f"p{i}.html").write_text(
            f"<html><head><title>T</title><style>p {{color: red}}</style></head><body><h1>Page {i}</h1>"
            f"<p>Hello &amp; welcome, reader {i}.</p><script>var x = 1;</script><p>Bye</p></body></html>")
    docs = list(iter_documents(str(c)))
    assert docs[0] == "Page 0\n\nHello & welcome, reader 0.\n\nBye"
    assert html_text("<p>a<br>b</p>") == "a\nb"
    meta = read_meta(prepare_dataset(str(c), "bpe:300", tmp_path / "ds", progress=False))
    assert meta["n_docs_train"] + meta["n_docs_val"] == 3


def test_folder_without_supported_files_says_what_it_skipped(tmp_path):
    c = tmp_path / "pdfs"
    c.mkdir()
    for i in range(1167):
        (c / f"{i}.pdf").write_bytes(b"%PDF")
    (c / "notes").write_text("x")
    with pytest.raises(KeelError) as e:
        prepare_dataset(str(c), "bpe:300", tmp_path / "ds", progress=False)
    assert str(e.value).startswith(f"no files with a supported extension in {c} (skipped 1167 .pdf, 1 (no extension);")
    assert not (tmp_path / "ds").exists()


def test_prepare_empty_folder_says_it_is_empty(tmp_path, keel_main):
    """It said "(skipped the folder is empty; ...)"."""
    (tmp_path / "empty").mkdir()
    r = keel_main("prepare", "--source", tmp_path / "empty", "--out", tmp_path / "ds")
    assert r.returncode == 2
    assert r.stderr.startswith(f"keel: error: no files with a supported extension in {tmp_path / 'empty'} "
                               "(the folder is empty; supported: ")


def test_nul_and_control_documents_are_skipped_with_a_note(tmp_path, caplog):
    """A file of NUL bytes became a 2-token dataset with exit 0."""
    c = tmp_path / "c"
    c.mkdir()
    (c / "nul.txt").write_bytes(b"\0" * 4096)
    (c / "ctrl.txt").write_bytes(bytes(range(1, 32)) * 50 + b"some text")
    (c / "good.txt").write_text("real text\n" * 50)
    (c / "good2.txt").write_text("more real text\n" * 50)
    with caplog.at_level("WARNING", logger="keel"):
        meta = read_meta(prepare_dataset(str(c), "bpe:300", tmp_path / "ds", progress=False))
    assert meta["docs_skipped_binary"] == 2 and meta["n_docs_train"] + meta["n_docs_val"] == 2
    assert any("skipped 2 document(s) that are not text" in r.getMessage() for r in caplog.records)
    only = tmp_path / "only"
    only.mkdir()
    (only / "nul.txt").write_bytes(b"\0" * 10)
    with pytest.raises(KeelError, match=r"empty corpus: .* \(1 skipped as not text\)"):
        prepare_dataset(str(only), "bpe:300", tmp_path / "ds2", progress=False)
    assert looks_binary("\0") and not looks_binary("tab\tand\nnewline\r\n") and not looks_binary("é" * 10)


def test_garbage_parquet_is_a_one_line_error(tmp_path):
    pytest.importorskip("pyarrow")
    bad = tmp_path / "data.parquet"
    bad.write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(KeelError) as e:
        prepare_dataset(str(bad), "bpe:300", tmp_path / "ds", progress=False)
    assert str(e.value).startswith(f"{bad}: not a readable parquet file") and "\n" not in str(e.value)


def test_failed_prepare_removes_the_parents_it_created(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("  ")
    with pytest.raises(KeelError, match="empty corpus"):
        prepare_dataset(str(empty), "bpe:300", tmp_path / "a" / "b" / "c" / "out", progress=False)
    assert not (tmp_path / "a").exists()
    (tmp_path / "keep").mkdir()
    with pytest.raises(KeelError):
        prepare_dataset(str(empty), "bpe:300", tmp_path / "keep" / "b" / "out", progress=False)
    assert (tmp_path / "keep").is_dir() and not (tmp_path / "keep" / "b").exists()


# ---------------------------------------------------------------- 4. one encode function
@pytest.fixture(scope="module")
def small_run(tiny_data, tmp_path_factory):
    from keel.train import train

    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("run") / "r"
    cfg = load_config(REPO / "keel" / "configs" / "demo.toml",
                      tiny_overrides(tiny_data, steps=2, eval_every=2, checkpoint_every=2))
    train(cfg, run)
    return run


EOS_FILE = "x = 1 # a file that mentions <|endoftext|> in its text\nprint()\n"


def test_eval_text_with_literal_eos_counts_text_tokens_and_real_bytes(small_run, tmp_path):
    """It was scored as one EOS token and 50 bytes for a 63-byte file."""
    from keel.eval.perplexity import text_perplexity
    from keel.run import Run

    assert len(EOS_FILE.encode()) == 63
    run = Run(small_run)
    tok = run.tokenizer()
    ids = encode_text(tok, EOS_FILE)
    assert tok.token_to_id("<|endoftext|>") not in ids
    res = text_perplexity(run.load_model(), tok, EOS_FILE, 32, "cpu", eos_id=tok.token_to_id("<|endoftext|>"))
    assert res.bytes == 63 and res.tokens == len(ids)
    assert res.bits_per_byte == pytest.approx(res.nats / math.log(2) / 63)
    # prepare encodes the same file to the same ids (train shard = ids + EOS)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x.txt").write_text(EOS_FILE)
    (tmp_path / "c" / "y.txt").write_text("other\n")
    out = prepare_dataset(str(tmp_path / "c"), str(small_run / "tokenizer.json"), tmp_path / "ds",
                          val_fraction=0.01, progress=False)
    shards = [list(map(int, read_shard(out / f"{s}.bin"))) for s in ("train", "val")]
    assert any(s[: len(ids) + 1] == ids + [read_meta(out)["eos_id"]] for s in shards)


def test_generate_and_lm_eval_wrapper_encode_like_training(small_run):
    from keel.hf.convert import wrap_native
    from keel.run import Run
    from keel.train.sampling import sample_text

    run = Run(small_run)
    model, tok = run.load_model(), run.tokenizer()
    _, hf_tok = wrap_native(model, tok)
    assert hf_tok.encode(EOS_FILE, add_special_tokens=False) == encode_text(tok, EOS_FILE)
    out = sample_text(model, tok, "a <|endoftext|> b", 3, torch.device("cpu"), temperature=0)
    assert out.startswith("a <|endoftext|> b")


def test_eval_text_accepts_what_prepare_accepts(small_run, tmp_path, capsys):
    """`keel eval --text` rejected non-UTF-8 text that `keel prepare` accepts."""
    from keel.cli import main

    f = tmp_path / "latin1.txt"
    f.write_bytes(b"caf\xe9 au lait, " * 20)
    assert read_text_file(f) == ("caf\ufffd au lait, " * 20, True)
    assert main(["eval", "--run", str(small_run), "--text", str(f), "--json", "--device", "cpu"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["perplexity"]["bytes"] == len(("caf\ufffd au lait, " * 20).encode())


# ---------------------------------------------------------------- 5. sampling numerics
@pytest.mark.parametrize("temperature", [1.0, 1e-3, 1e-30, 1e-38, 1e-39, 1e-45, 5e-324, sys.float_info.min, 0.0])
@pytest.mark.parametrize("top_k", [None, 5])
def test_generate_at_any_temperature(temperature, top_k):
    """--temperature 1e-39 (or 1e-45) raised "probability tensor contains inf/nan"."""
    from keel.model import Transformer

    torch.manual_seed(0)
    cfg = load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                             "model.n_kv_heads=1", "model.d_ff=64", "model.max_seq_len=32"]).model
    model = Transformer(cfg).eval()
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        out = model.generate(prompt, 6, temperature, top_k, generator=torch.Generator().manual_seed(0))
        greedy = model.generate(prompt, 6, 0.0)
    assert out.shape == (1, 9) and int(out.max()) < 64
    if temperature <= 1e-30:
        assert torch.equal(out, greedy)

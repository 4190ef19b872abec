"""Where documents come from: ``builtin:``, ``hf:`` or a local path.

:func:`iter_documents` turns a source string into a stream of documents (``str``):

* ``builtin:python-stdlib`` -- the ``.py`` files of the running interpreter's standard
  library, in sorted relative-path order, without ``site-packages``/``dist-packages``,
  test suites, ``__pycache__`` and generated files.
* a local file or folder -- ``.txt``/``.md``/``.rst`` (one document per file),
  ``.html``/``.htm`` (one document per file: the text outside tags, scripts and styles,
  extracted with the standard library's ``html.parser``), ``.jsonl`` (one JSON object or
  string per line), ``.json`` (a list of objects or strings) and ``.parquet`` (one row per
  document, needs ``pyarrow``). Folders are walked recursively in sorted order; hidden
  entries (``.name``) and other extensions are skipped (a folder with no supported file is
  an error that counts what was skipped, by extension).
* ``hf:NAME[:CONFIG]`` -- the ``train`` split of a Hugging Face dataset, streamed with
  ``datasets`` (needs network; fails within a few seconds when the hub is unreachable).

Files that are not regular files (a FIFO, a device such as ``/dev/zero`` behind a symbolic link, a
socket, a broken link) are never opened: in a folder each is skipped with a warning naming it; given
as the source itself, it is refused in one line.

Text is decoded as UTF-8 (:func:`keel.data.text.read_text_file`); bytes that are not valid
UTF-8 become U+FFFD (``errors="replace"``) and such documents are counted in
:class:`SourceStats`. Empty and whitespace-only documents are skipped, and so are documents
that are not text (:func:`keel.data.text.looks_binary`: NUL bytes, mostly control
characters), counted in :class:`SourceStats` too.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import re
import socket
import sysconfig
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlparse

from keel.data.text import decode_utf8, looks_binary
from keel.errors import KeelError
from keel.io import check_regular_file, special_file_kind

log = logging.getLogger(__name__)

TEXT_EXTENSIONS = (".txt", ".md", ".rst")
HTML_EXTENSIONS = (".html", ".htm")
SUPPORTED_EXTENSIONS = TEXT_EXTENSIONS + HTML_EXTENSIONS + (".jsonl", ".json", ".parquet")
BUILTINS = ("python-stdlib",)

_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_GENERATED_MARKERS = ("generated", "do not edit")  # case-insensitive, first two lines
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")  # 2+ chars, so "C:\..." is not a scheme
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_HF_PROBE_TIMEOUT_S = 3.0


@dataclass
class SourceStats:
    """Counters filled in while documents are read (pass one to :func:`iter_documents`)."""

    n_docs: int = 0
    n_bytes: int = 0  # UTF-8 bytes of the documents yielded
    docs_with_replacement_chars: int = 0  # documents that had invalid UTF-8 replaced by U+FFFD
    docs_skipped_binary: int = 0  # documents skipped as not text (keel.data.text.looks_binary)
    docs_with_nul: int = 0  # documents kept (mostly text) that hold NUL characters, kept as they are


def iter_documents(
    source: str,
    *,
    max_bytes: int | None = None,
    max_docs: int | None = None,
    text_field: str = "text",
    stats: SourceStats | None = None,
) -> Iterator[str]:
    """Yield the documents (``str``) of ``source`` in a deterministic order.

    ``source`` is ``builtin:python-stdlib``, ``hf:NAME[:CONFIG]`` or a local file/folder (an
    existing path always wins over a scheme). ``max_bytes`` stops after the document whose
    UTF-8 size makes the running total reach ``max_bytes``; ``max_docs`` stops after that
    many documents (``None`` or ``0``: no limit). ``text_field`` names the text field of
    ``.jsonl``/``.json``/``.parquet``/``hf:`` records. ``stats``, if given, is updated as
    documents are yielded.

    Raises :class:`KeelError` for a missing path, an unsupported single file, an unknown
    scheme or builtin, malformed JSON records, a missing text field, a missing optional
    dependency (``pyarrow``, ``datasets``) or an unreachable Hugging Face hub. This is a
    generator: all of these errors surface on the first ``next()``.
    """
    if max_bytes is not None and max_bytes < 0:
        raise KeelError(f"max_bytes must be >= 0, got {max_bytes}")
    if max_docs is not None and max_docs < 0:
        raise KeelError(f"max_docs must be >= 0, got {max_docs}")
    stats = stats if stats is not None else SourceStats()
    for text, replaced in _raw_documents(source, text_field):
        if not text.strip():
            continue
        if looks_binary(text):
            stats.docs_skipped_binary += 1
            continue
        if _LONE_SURROGATE.search(text):  # e.g. "\ud800" escapes in JSON: not encodable as UTF-8
            text, replaced = _LONE_SURROGATE.sub("\ufffd", text), True
        stats.n_docs += 1
        stats.n_bytes += len(text.encode("utf-8"))
        stats.docs_with_replacement_chars += int(replaced)
        stats.docs_with_nul += int("\x00" in text)
        yield text
        if (max_bytes and stats.n_bytes >= max_bytes) or (max_docs and stats.n_docs >= max_docs):
            return


def _raw_documents(source: str, text_field: str) -> Iterator[tuple[str, bool]]:
    """Dispatch on the source string; yields ``(text, had_invalid_utf8)`` pairs."""
    check_source(source)
    if os.path.exists(source):
        yield from _local_documents(Path(source), text_field)
    elif source.startswith("builtin:"):
        yield from _stdlib_documents()
    else:
        yield from _hf_documents(source, text_field)


def check_source(source: str) -> None:
    """Check what a source string names without reading it: a local path that exists, a known
    ``builtin:`` source, or an ``hf:`` name (not looked up).

    Raises:
        KeelError: an unknown builtin source or scheme, or a local path that does not exist.
    """
    if os.path.exists(source) or source.startswith("hf:"):
        return
    if source.startswith("builtin:"):
        name = source[len("builtin:") :]
        if name != "python-stdlib":
            raise KeelError(f"unknown builtin data source {name!r} (available: {', '.join(BUILTINS)})")
        return
    match = _SCHEME.match(source)
    if match:
        raise KeelError(f"unknown data source scheme {match.group(1)!r} (expected builtin:, hf:, or a local path)")
    raise KeelError(f"no such file or directory: {source}")


_decode = decode_utf8


# --- builtin:python-stdlib ------------------------------------------------------------


def stdlib_files() -> list[Path]:
    """The ``.py`` files used by ``builtin:python-stdlib``, sorted by path relative to the stdlib.

    Skips ``site-packages``, ``dist-packages``, ``__pycache__``, any directory named
    ``test``/``tests``/``idle_test`` and files named ``test_*.py``. (Generated files are
    recognised by content, in :func:`iter_documents`.)
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py") and not f.startswith("test_")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _is_generated(text: str) -> bool:
    head = "\n".join(text.splitlines()[:2]).lower()
    return any(marker in head for marker in _GENERATED_MARKERS)


def _stdlib_documents() -> Iterator[tuple[str, bool]]:
    for path in stdlib_files():
        text, replaced = _decode(path.read_bytes())
        if not _is_generated(text):
            yield text, replaced


# --- local files ----------------------------------------------------------------------


def _local_documents(path: Path, text_field: str) -> Iterator[tuple[str, bool]]:
    check_regular_file(path, "data source")  # a FIFO blocked for ever, /dev/zero was read until MemoryError
    if path.is_file():
        if path.suffix.lower() not in SUPPORTED_EXTENSIONS:
            raise KeelError(f"unsupported data file {path} (expected one of {', '.join(SUPPORTED_EXTENSIONS)})")
        yield from _file_documents(path, text_field)
        return
    files, skipped = [], Counter()
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for f in filenames:
            if f.startswith("."):
                continue
            kind = special_file_kind(Path(dirpath, f))
            if kind is not None:
                log.warning("skipping %s: not a regular file (%s)", Path(dirpath, f), kind)
                skipped["(not a regular file)"] += 1
            elif Path(f).suffix.lower() in SUPPORTED_EXTENSIONS:
                files.append(Path(dirpath, f))
            else:
                skipped[Path(f).suffix.lower() or "(no extension)"] += 1
    if not files:
        what = f"skipped {', '.join(f'{n} {ext}' for ext, n in skipped.most_common(5))}" if skipped \
            else "the folder is empty"
        raise KeelError(f"no files with a supported extension in {path} ({what}; "
                        f"supported: {', '.join(SUPPORTED_EXTENSIONS)})")
    for file in sorted(files, key=lambda p: p.relative_to(path).as_posix()):
        yield from _file_documents(file, text_field)


def source_fingerprint(source: str) -> str | None:
    """A hash of a local corpus's files as :func:`keel.data.sources.iter_documents` would walk
    them (not hidden ones): each file's path relative to ``source``, size (bytes) and modification
    time (ns), as ``make``/``rsync`` decide what changed. None for ``builtin:`` and ``hf:`` sources
    (and a path that does not exist). A cached dataset is reused only while this is unchanged."""
    path = Path(source)
    if not path.exists():
        return None
    files = [path] if path.is_file() else [
        Path(dirpath, f) for dirpath, dirnames, filenames in os.walk(path)
        if not any(part.startswith(".") for part in Path(dirpath).relative_to(path).parts)
        for f in filenames if not f.startswith(".") and special_file_kind(Path(dirpath, f)) is None]  # as read
    digest = hashlib.sha256()
    for file in sorted(files):
        st = file.stat()
        name = os.fsencode(file.relative_to(path) if file != path else file.name)  # the bytes: a name need not be UTF-8
        digest.update(name + f"\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _file_documents(path: Path, text_field: str) -> Iterator[tuple[str, bool]]:
    suffix = path.suffix.lower()
    if suffix in TEXT_EXTENSIONS:
        yield _decode(path.read_bytes())
    elif suffix in HTML_EXTENSIONS:
        text, replaced = _decode(path.read_bytes())
        yield html_text(text), replaced
    elif suffix == ".jsonl":
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                line, replaced = _decode(raw)
                if not line.strip():
                    continue
                record = _parse_json(line, f"{path}:{lineno}")
                text = _text_of(record, text_field, f"{path}:{lineno}")
                if text is not None:
                    yield text, replaced
    elif suffix == ".json":
        content, replaced = _decode(path.read_bytes())
        records = _parse_json(content, str(path))
        if not isinstance(records, list):
            raise KeelError(f"{path}: expected a JSON list of objects or strings, got {type(records).__name__}")
        for i, record in enumerate(records):
            text = _text_of(record, text_field, f"{path}[{i}]")
            if text is not None:
                yield text, replaced and "\ufffd" in text
    elif suffix == ".parquet":
        yield from _parquet_documents(path, text_field)


def _parse_json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise KeelError(f"{where}: invalid JSON ({e})") from None


def _text_of(record, text_field: str, where: str) -> str | None:
    """The text of one record: a string, or ``record[text_field]``; ``None`` for a null value."""
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        raise KeelError(f"{where}: expected a JSON object or string, got {type(record).__name__}")
    if text_field not in record:
        raise KeelError(f"{where}: no field {text_field!r} (fields: {', '.join(map(str, record)) or 'none'})")
    value = record[text_field]
    if value is not None and not isinstance(value, str):
        raise KeelError(f"{where}: field {text_field!r} is a {type(value).__name__}, expected a string")
    return value


def _parquet_documents(path: Path, text_field: str) -> Iterator[tuple[str, bool]]:
    try:
        import pyarrow.parquet as pq  # optional extra [data]: parquet sources only
    except ImportError:
        raise KeelError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    import pyarrow as pa  # optional extra [data]: parquet sources only

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise KeelError(f"{path}: not a readable parquet file ({str(e).strip().splitlines()[0][:200]})") from None
    if text_field not in parquet.schema_arrow.names:
        names = ", ".join(parquet.schema_arrow.names)
        raise KeelError(f"{path}: no column {text_field!r} (columns: {names})")
    batches = parquet.iter_batches(columns=[text_field])
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as e:
            raise KeelError(f"{path}: damaged parquet file ({str(e).strip().splitlines()[0][:200]})") from None
        if batch is None:
            return
        for text in batch.column(0).to_pylist():
            if text is None:
                continue
            if isinstance(text, bytes):
                yield _decode(text)
            elif isinstance(text, str):
                yield text, False
            else:
                raise KeelError(f"{path}: column {text_field!r} holds {type(text).__name__}, expected strings")


class _HTMLText(HTMLParser):
    """Collects the text of an HTML page: character data outside <script>, <style>,
    <template> and <head> (block elements end a line)."""

    _HIDDEN = {"script", "style", "template", "head", "noscript"}
    _BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "section", "article",
               "blockquote", "dt", "dd", "table", "ul", "ol", "hr", "title"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag, attrs):
        if tag in self._HIDDEN:
            self.hidden += 1
        elif tag in self._BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self._HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        elif tag in self._BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.hidden:
            self.parts.append(data)


def html_text(html: str) -> str:
    """The readable text of an HTML document (standard library ``html.parser``): tags,
    scripts, styles and the ``<head>`` dropped, entities decoded, runs of blank lines
    collapsed to one."""
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    text = "".join(parser.parts)
    lines = [ln.rstrip() for ln in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


# --- hf:NAME[:CONFIG] -----------------------------------------------------------------


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a load from the Hugging Face hub (``datasets.load_dataset``,
    ``hf_hub_download``, ``Tokenizer.from_pretrained``, lm-eval's task loading) raises for
    reasons outside the program, to be reported as one line: ``OSError`` (network, offline
    mode, missing or gated repos and files: huggingface_hub's and ``requests``' errors are
    OSErrors), ``ValueError`` (a bad repo name, unknown config, bad JSON),
    ``huggingface_hub.errors.EntryNotFoundError``, ``httpx.HTTPError`` (huggingface_hub's
    HTTP client) and ``datasets.exceptions.DatasetsError``. Only installed libraries are
    named (datasets is optional)."""
    errors: list[type[BaseException]] = [OSError, ValueError]
    for module, name in (("huggingface_hub.errors", "EntryNotFoundError"), ("httpx", "HTTPError"),
                         ("datasets.exceptions", "DatasetsError")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # not installed, or a version without it
            continue
    return tuple(errors)


def check_hub_reachable(what: str) -> None:
    """Raise :class:`KeelError` quickly if the Hugging Face hub cannot be used.

    Honours ``HF_HUB_OFFLINE=1`` (and ``HF_DATASETS_OFFLINE=1``) immediately; otherwise opens
    a TCP connection to the hub (``HF_ENDPOINT`` or ``huggingface.co:443``), giving up after
    about 3 seconds including DNS. ``what`` names the thing being loaded, for the message.
    """
    if _env_true("HF_HUB_OFFLINE") or _env_true("HF_DATASETS_OFFLINE"):
        raise KeelError(f"cannot reach the Hugging Face hub to load {what}: HF_HUB_OFFLINE is set (offline?)")
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=_HF_PROBE_TIMEOUT_S).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(e)

    # A thread bounds the whole probe, including DNS resolution (which ignores socket timeouts).
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(_HF_PROBE_TIMEOUT_S + 0.5)
    if not outcome or outcome[0] is not None:
        reason = f": {outcome[0]}" if outcome else f": no answer within {_HF_PROBE_TIMEOUT_S:.0f} s"
        raise KeelError(f"cannot reach the Hugging Face hub at {host}:{port} to load {what}{reason} (offline?)")


def parse_hf_source(source: str) -> tuple[str, str | None]:
    """``"hf:NAME[:CONFIG]"`` -> ``(NAME, CONFIG or None)``; :class:`KeelError` if NAME is empty."""
    name, _, config = source[len("hf:") :].partition(":")
    if not name:
        raise KeelError(f"bad Hugging Face source {source!r} (expected hf:NAME or hf:NAME:CONFIG)")
    return name, config or None


def _hf_documents(source: str, text_field: str) -> Iterator[tuple[str, bool]]:
    name, config = parse_hf_source(source)
    check_hub_reachable(f"dataset {name!r}")
    try:
        import datasets  # optional extra [data]; ~2 s to import
    except ImportError:
        raise KeelError(f"the data source {source!r} needs the datasets library: pip install datasets") from None
    try:
        stream = datasets.load_dataset(name, config, split="train", streaming=True)
    except hub_errors() as e:  # not found, gated, bad config, offline, ...
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KeelError(f"cannot load Hugging Face dataset {source!r}: {first_line}") from None
    for i, row in enumerate(stream):
        text = _text_of(row, text_field, f"{source} row {i}")
        if text is not None:
            yield text, False

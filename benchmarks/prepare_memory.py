"""Peak memory of ``keel prepare`` on corpora of awkward shapes (issue 11, section 3).

Writes a corpus, runs :func:`keel.data.prepare_dataset` on it in a fresh ``spawn`` child
process and reports the child's peak resident set size (``resource.getrusage``
``ru_maxrss``, KiB on Linux) and its wall time. Shapes:

* ``one-line``: one document of ``--mb`` MB with no newline (words separated by spaces);
* ``one-file``: one ``.txt`` file of ``--mb`` MB of real text (the standard library's
  ``.py`` files, concatenated);
* ``many-files``: the same text as one file per source file.

Example (the number reported for issue 11: the 50 MB one-line document)::

    python benchmarks/prepare_memory.py --shape one-line --mb 50 --tokenizer bpe:2048
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import shutil
import tempfile
import time
from pathlib import Path

MB = 10**6


def write_corpus(shape: str, mb: float, root: Path) -> Path:
    """The corpus of ``shape`` (see the module docstring) under ``root``; returns its path."""
    n = int(mb * MB)
    if shape == "one-line":
        rng = random.Random(0)
        words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                 for _ in range(5000)]
        path = root / "one_line.txt"
        with open(path, "w", encoding="utf-8") as f:
            written = 0
            while written < n:
                chunk = " ".join(rng.choices(words, k=20000)) + " "
                f.write(chunk)
                written += len(chunk)
        return path
    from keel.data import iter_documents

    docs, size = [], 0
    while size < n:  # repeat the stdlib until the size is reached
        for d in iter_documents("builtin:python-stdlib"):
            docs.append(d)
            size += len(d.encode())
            if size >= n:
                break
    if shape == "one-file":
        path = root / "book.txt"
        path.write_text("".join(docs), encoding="utf-8")
        return path
    folder = root / "files"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i:05d}.txt").write_text(d, encoding="utf-8")
    return folder


def _child(source: str, tokenizer: str, out: str, queue) -> None:
    from keel.data import prepare_dataset, read_meta

    t0 = time.perf_counter()
    path = prepare_dataset(source, tokenizer, out, progress=False)
    wall = time.perf_counter() - t0
    meta = read_meta(path)
    queue.put({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "wall_s": wall,
               "train_tokens": meta["train_tokens"], "val_tokens": meta["val_tokens"],
               "chunks": meta.get("chunks_of_long_docs"), "docs_val": meta["n_docs_val"]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["one-line", "one-file", "many-files"], default="one-line")
    ap.add_argument("--mb", type=float, default=50.0, help="corpus size in MB (10^6 bytes)")
    ap.add_argument("--tokenizer", default="bpe:2048")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="keel-prepare-mem-"))
    try:
        source = write_corpus(args.shape, args.mb, root)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_child, args=(str(source), args.tokenizer, str(root / "ds"), queue))
        proc.start()
        result = queue.get()
        proc.join()
        result.update(shape=args.shape, mb=args.mb, tokenizer=args.tokenizer)
        print(json.dumps(result))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

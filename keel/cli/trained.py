"""The flags of ``keel eval``, ``keel export-hf`` and ``keel import-hf``; handlers:
:mod:`keel.cli.handlers.scoring` and :mod:`keel.cli.handlers.hf` (which imports transformers).

Usage::

    keel export-hf --run runs/x --out hf/x
    keel import-hf --hf hf/x --out runs/x-back
    keel eval --run runs/x | --hf hf/x [--tasks t1,t2] [--task-dir DIR] [--limit N] [--json]
              [--text FILE] [--device auto] [--loops R]
"""

from __future__ import annotations

from keel.config import key_default, key_help


MAX_LOOPS_MIN, MAX_LOOPS_FACTOR = 64, 16  # --loops R' <= max(64, 16 x model.loop_repeats): more is a typo, not a study


def max_loops(trained_repeats: int) -> int:
    """The largest ``--loops`` keel takes for a model trained with ``model.loop_repeats`` =
    ``trained_repeats``: ``max(MAX_LOOPS_MIN, MAX_LOOPS_FACTOR * trained_repeats)`` (64, or 16 times the
    trained count: test-time depth past that runs for hours on a typo, e.g. ``--loops 100000000``)."""
    return max(MAX_LOOPS_MIN, MAX_LOOPS_FACTOR * trained_repeats)


def add_loops_flag(p, what: str = "run") -> None:
    """``--loops R'``: run a looped model's core R' times instead of its trained ``model.loop_repeats``
    (test-time depth; ``keel eval``, ``generate``, ``ablate``, ``gradflow``). Checked by
    :func:`keel.cli.handlers.check_loops`."""
    p.add_argument("--loops", type=int, default=None, metavar="R",
                   help=f"a looped {what} (model.loop_core >= 1): apply its core R times per token instead of "
                        "model.loop_repeats (test-time depth; the weights and depth constants stay the trained ones); "
                        f"at most max({MAX_LOOPS_MIN}, {MAX_LOOPS_FACTOR} x model.loop_repeats)")


def _register_hf(subparsers) -> None:
    """Add ``export-hf`` and ``import-hf`` to the ``keel`` sub-parsers."""
    pe = subparsers.add_parser("export-hf", help="write a run as a Hugging Face model folder",
                               description="Write the latest checkpoint of a run as config.json + model.safetensors "
                                           "+ tokenizer files + modeling code generated from keel's source. Load it "
                                           "anywhere with AutoModelForCausalLM.from_pretrained(OUT, "
                                           "trust_remote_code=True), or with keel's code after `import keel.hf`. "
                                           "A pre_ln run is exported as a stock LlamaForCausalLM (no custom code).")
    pe.add_argument("--run", required=True, help="run directory")
    pe.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    pe.set_defaults(handler="keel.cli.handlers.hf.cmd_export_hf")

    pi = subparsers.add_parser("import-hf", help="make a run directory from a keel or Llama Hugging Face folder",
                               description="Inverse of export-hf, and the way in for a stock LlamaForCausalLM "
                                           "(becomes a pre_ln run; RoPE scaling, biases and other features keel "
                                           "lacks are refused by name): a run directory that `keel generate`, "
                                           "`keel eval` and `keel train --resume` accept (its checkpoint is step 0 "
                                           "with a fresh optimiser).")
    pi.add_argument("--hf", required=True, help="Hugging Face folder: from `keel export-hf`, or a stock Llama")
    pi.add_argument("--out", required=True, help="run directory to create (must not exist or be empty)")
    pi.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="set a data.* or train.* key of the new run (repeatable); train.batch_size and "
                         "train.seq_len cannot change on resume, so choose them here")
    pi.set_defaults(handler="keel.cli.handlers.hf.cmd_import_hf")


def register(subparsers) -> None:
    """Add ``eval``, ``export-hf`` and ``import-hf`` to the ``keel`` sub-parsers."""
    p = subparsers.add_parser(
        "eval", help="perplexity, bits per byte and lm-evaluation-harness tasks",
        description="Report loss, perplexity and bits per byte on held-out text (the run's validation split, "
                    "or --text FILE), then score lm-evaluation-harness tasks (--tasks), one by one: a task "
                    "whose data cannot be loaded is reported in one line and the others still run.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run directory")
    src.add_argument("--hf", help="Hugging Face folder of a keel model (from `keel export-hf`)")
    p.add_argument("--tasks", default="", help="comma-separated lm-eval task names "
                                               "(shipped: keel_python_completion, keel_python_paragraphs, "
                                               "keel_python_generate)")
    p.add_argument("--task-dir", default=None, help="extra folder of task YAMLs (local JSONL data allowed)")
    p.add_argument("--limit", type=int, default=None, help="at most N documents per task")
    p.add_argument("--text", default=None, metavar="FILE", help="held-out text file instead of the validation split")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per window for perplexity (default: train.seq_len of the run, else max_seq_len)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="validation tokens to score (default: the run's train.eval_tokens)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="windows (perplexity) or requests (tasks) per forward pass")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--verbose", action="store_true", help="show lm-evaluation-harness' own progress bars and logs")
    p.add_argument("--device", default=key_default("train.device"), help=key_help("train.device"))
    add_loops_flag(p, "model")
    p.set_defaults(handler="keel.cli.handlers.scoring.cmd_eval")
    _register_hf(subparsers)

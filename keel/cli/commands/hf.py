"""``keel export-hf`` and ``keel import-hf``: each command's flags beside its handler
(:mod:`keel.cli.commands`). Running one imports transformers (:mod:`keel.hf.convert`).

Usage::

    keel export-hf --run runs/x --out hf/x
    keel import-hf --hf hf/x --out runs/x-back
"""

from __future__ import annotations

import argparse
import json


def import_library() -> None:
    """The library the handlers below call, imported into this module (:mod:`keel.cli.commands`)."""
    global export_hf, import_hf
    # torch, transformers and the library (seconds of import), imported when one of these commands runs, not when the
    # parser is built: `keel --help` loads no torch
    from keel.hf.convert import export_hf, import_hf


def register(subparsers) -> None:
    """Add ``export-hf`` and ``import-hf`` to the ``keel`` sub-parsers."""
    _register_export_hf(subparsers)
    _register_import_hf(subparsers)


def _register_export_hf(subparsers) -> None:
    """Add ``keel export-hf``."""
    pe = subparsers.add_parser("export-hf", help="write a run as a Hugging Face model folder",
                               description="Write the latest checkpoint of a run as config.json + model.safetensors "
                                           "+ tokenizer files + modeling code generated from keel's source. Load it "
                                           "anywhere with AutoModelForCausalLM.from_pretrained(OUT, "
                                           "trust_remote_code=True), or with keel's code after `import keel.hf`. "
                                           "A pre_ln run is exported as a stock LlamaForCausalLM (no custom code).")
    pe.add_argument("--run", required=True, help="run directory")
    pe.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    pe.set_defaults(handler=cmd_export_hf)


def cmd_export_hf(args: argparse.Namespace) -> int:
    out = export_hf(args.run, args.out)
    config = json.loads((out / "config.json").read_text())
    print(f"exported {args.run} (step {config.get('keel_step', 0)}) -> {out}")
    if config["model_type"] == "llama":  # a pre_ln run
        print(f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r}): a stock Llama model, "
              "no keel or trust_remote_code needed")
    else:
        print(f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True), or after "
              "`import keel.hf` without trust_remote_code")
    return 0


def _register_import_hf(subparsers) -> None:
    """Add ``keel import-hf``."""
    pi = subparsers.add_parser("import-hf", help="make a run directory from a keel or Llama Hugging Face folder",
                               description="Inverse of export-hf, and the way in for a stock LlamaForCausalLM "
                                           "(becomes a pre_ln run; RoPE scaling, biases and other features keel "
                                           "lacks are refused by name): a run directory that `keel generate`, "
                                           "`keel eval` and `keel train --resume` accept (its checkpoint is the "
                                           "step and tokens the export was made at, 0 for a stock Llama, with a "
                                           "fresh optimiser and the data stream at its first batch).")
    pi.add_argument("--hf", required=True, help="Hugging Face folder: from `keel export-hf`, or a stock Llama")
    pi.add_argument("--out", required=True, help="run directory to create (must not exist or be empty)")
    pi.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="set a data.* or train.* key of the new run (repeatable); train.batch_size and "
                         "train.seq_len cannot change on resume, so choose them here")
    pi.set_defaults(handler=cmd_import_hf)


def cmd_import_hf(args: argparse.Namespace) -> int:
    out = import_hf(args.hf, args.out, overrides=args.set)
    # what a resume starts from, said here: a round-tripped run's resume saw its first batches again, unannounced
    print(f"imported {args.hf} -> run {out} (continue training with `keel train --resume {out}`: a fresh optimiser, "
          "and the data from its first batch, as an HF folder keeps no data position)")
    return 0

"""The handlers of ``keel export-hf`` and ``keel import-hf`` (their flags: :mod:`keel.cli.trained`).
Importing this module imports transformers (:mod:`keel.hf.convert`).

Usage::

    keel export-hf --run runs/x --out hf/x
    keel import-hf --hf hf/x --out runs/x-back
"""

from __future__ import annotations

import argparse
import json

from keel.hf.convert import export_hf, import_hf


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


def cmd_import_hf(args: argparse.Namespace) -> int:
    out = import_hf(args.hf, args.out, overrides=args.set)
    print(f"imported {args.hf} -> run {out} (continue training with `keel train --resume {out}`)")
    return 0

"""`gwtf export`: a trained checkpoint as a Hugging Face folder `transformers` loads.

Owns the command's flags (--checkpoint and the flags completing it, shared with `gwtf generate`;
--out; --dtype) and their checks. Loading is `gwtf.commands.trained`; the mapping to GPT-2 (gpt
family) or Llama (llama family) and the files written are `gwtf.model.hub` (docs/export.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gwtf.commands.generate import add_source_arguments
from gwtf.errors import UserError

__all__ = ["add_arguments", "run"]

DTYPE_CHOICES = ("fp32", "bf16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    parser.add_argument("--out", metavar="DIR", required=True,
                        help="folder to write (created; must be empty or not exist)")
    parser.add_argument("--dtype", default="fp32", metavar="|".join(DTYPE_CHOICES),
                        help="weight precision of the export (default fp32)")


def run(args: argparse.Namespace) -> int:
    if args.dtype not in DTYPE_CHOICES:
        raise UserError(f"--dtype {args.dtype!r} is unknown; choose one of {', '.join(DTYPE_CHOICES)}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder")
    from gwtf.commands.trained import load_trained
    from gwtf.model.hub import write_hf_folder

    trained = load_trained(args.checkpoint, version=args.version, config=args.config, tokenizer=args.tokenizer)
    write_hf_folder(trained.model, trained.tokenizer, out, args.dtype)
    arch = "GPT2LMHeadModel" if trained.model.spec.family == "gpt" else "LlamaForCausalLM"
    print(f"exported {trained.model_cfg.family}-{trained.model_cfg.preset} ({trained.kind} checkpoint, version "
          f"{trained.version}) as {arch} ({args.dtype}) to {out}: load it with "
          f"AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0

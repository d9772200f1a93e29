"""`gwtf import`: a Hugging Face GPT-2 or Llama folder as a gwtf checkpoint (version 0).

Owns the command's flags (--hf, --out) and their checks. The reading, the refusals (a config key
our model code does not compute, named) and the files written are `gwtf.model.hf_import`
(docs/models.md). The result is a `gwtf train --local`-style folder: `gwtf export`, `gwtf
generate`, `gwtf eval` read it, and `model.init_from = OUT` starts a run from it.
(The module is `import_` because `import` is a Python keyword; the command is `gwtf import`.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gwtf.errors import UserError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf", metavar="DIR", required=True,
                        help="Hugging Face model folder: config.json + model.safetensors (or shards with "
                             "model.safetensors.index.json), tokenizer.json if any")
    parser.add_argument("--out", metavar="DIR", required=True,
                        help="folder to write the gwtf checkpoint to (created; must be empty or not exist)")


def run(args: argparse.Namespace) -> int:
    src, out = Path(args.hf).expanduser(), Path(args.out).expanduser()
    if not src.is_dir():
        raise UserError(f"--hf {src}: no such folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder")
    from gwtf.model.hf_import import import_hf_folder, open_hf_folder

    open_hf_folder(src)  # every refusal before --out is created
    result = import_hf_folder(src, out)
    s = result.spec
    tok = (f"tokenizer {result.tokenizer}" if result.tokenizer else
           f"no tokenizer.json (put one in {out / 'tokenizer'}/, or set data.tokenizer / --tokenizer)")
    print(f"imported {result.architecture} from {src} to {out}: {s.family}, {s.n_layer} layers, d_model {s.d_model}, "
          f"{s.n_head} heads ({s.n_kv_head} kv), d_ff {s.d_ff}, vocab {s.vocab_size}, {s.seq_len} positions, "
          f"{result.params / 1e6:.2f}M parameters; {tok}. Check it with `gwtf eval --checkpoint {out} --data PATH`, "
          f"train from it with --set model.init_from=\"{out}\"")
    return 0

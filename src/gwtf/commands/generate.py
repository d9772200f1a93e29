"""`gwtf generate`: text from a trained checkpoint, streamed to stdout as it is produced.

Owns the command's flags (--checkpoint, --prompt, --max-new-tokens, --temperature, --top-k, --seed,
and --version/--config/--tokenizer for checkpoints whose run folder lacks them) and their checks.
Loading is `gwtf.commands.trained`, the token loop `gwtf.model.sampling`. The prompt is printed
first, then each new piece of text as soon as its token is chosen. Temperature 0 is greedy; any
other temperature samples from a generator seeded by --seed, so a seed repeats its text.
"""

from __future__ import annotations

import argparse
import sys

from gwtf.errors import UserError

__all__ = ["add_arguments", "add_source_arguments", "run"]


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """--checkpoint and the flags that complete a checkpoint (shared with `gwtf export`)."""
    parser.add_argument("--checkpoint", metavar="PATH", required=True,
                        help="run folder of `gwtf train --local`, `gwtf swarm`/`demo`/`node`, its checkpoint "
                             "folder, or one stage file checkpoints/stage<k>/v<N>.safetensors")
    parser.add_argument("--version", type=int, metavar="N",
                        help="checkpoint version (iterations completed) to use; default: the newest complete")
    parser.add_argument("--config", metavar="FILE",
                        help="the run's config, when no config.resolved.toml is next to the checkpoint")
    parser.add_argument("--tokenizer", metavar="FILE",
                        help="the run's BPE tokenizer JSON, when it is not in the run's cache (or, for a run "
                             "whose data.tokenizer is a path, the tokenizer.json / folder to use instead)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_source_arguments(parser)
    parser.add_argument("--prompt", default="", metavar="TEXT",
                        help="text to continue (default: empty = start of a document)")
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                        help="tokens to generate at most (default 200; stops early at end of text)")
    parser.add_argument("--temperature", type=float, default=0.8, metavar="T",
                        help="sampling temperature; 0 = greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="sample only from the K most likely tokens; 0 = all (default 0)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default 0)")


def _check(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not args.temperature >= 0.0 or args.temperature == float("inf"):
        raise UserError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise UserError(f"--top-k must be >= 0, got {args.top_k}")


def run(args: argparse.Namespace) -> int:
    _check(args)
    from gwtf.commands.trained import load_trained

    trained = load_trained(args.checkpoint, version=args.version, config=args.config, tokenizer=args.tokenizer)
    from gwtf.model.sampling import TextStream, generate_ids  # torch: only once the checkpoint is found
    tok = trained.tokenizer
    prompt_ids = tok.encode(args.prompt) or [tok.eot_id]
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    stream = TextStream(tok)
    for token in generate_ids(trained.model, prompt_ids, args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, seed=args.seed, stop_id=tok.eot_id):
        piece = stream.push(token)
        if piece:
            out.write(piece)
            out.flush()
    out.write(stream.flush() + "\n")
    out.flush()
    return 0

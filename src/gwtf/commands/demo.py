"""`gwtf demo`: the README's first command: a small local swarm with churn, on embedded defaults.

Owns the demo's embedded config (the same as configs/swarm-demo.toml: 2 data holders, stages 1
and 2 with 2 replicas each, tiny GPT on Shakespeare, 300 iterations, low churn = one kill -9 and
one joiner) and its few flags. Its churn's first kill is scripted to be a data holder's (the
leader or the other one, as the seed picks: `SwarmOptions.churn_roles`), so the demo shows a
joiner take the vacant data shard; later kills (`--churn high`) pick any node. It writes that
config to DIR/demo.toml, starts the swarm through `gwtf swarm`'s loop (live table), and prints
where the outputs are.

Output folder: the default `runs/demo` is the demo's own: a re-run replaces an earlier demo's
outputs there (recognised by its demo.toml), so the README's first command works every time. Any
other non-empty folder (an explicit `--out`, or runs/demo holding something else) is refused like
`gwtf swarm` refuses it.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tomllib
from pathlib import Path

from gwtf.cli import (
    add_config_arguments,
    add_device_argument,
    add_secret_argument,
    apply_secret_file,
    check_device,
    device_overrides,
)
from gwtf.config import Config, from_dict, load_config, merge_overrides
from gwtf.errors import UserError

__all__ = ["DEFAULT_OUT", "DEMO_TOML", "add_arguments", "run"]

DEFAULT_OUT = "runs/demo"
DEMO_CHURN_ROLES = ("data-holder",)  # the first kill's victim is a data holder (a joiner replaces it)

DEMO_TOML = """\
# gwtf demo: embedded defaults (same as configs/swarm-demo.toml)
[model]
family = "gpt"
preset = "tiny"
seq_len = 64
microbatch_size = 4
stages = 3

[data]
source = "shakespeare"
tokenizer = "bpe"
vocab_size = 2048

[train]
seed = 0
data_holders = 2
microbatches = 4
iterations = 300
lr = 2e-3
min_lr = 2e-4
warmup_iterations = 10

[runtime]
torch_threads = 1
status_period_s = 0.5

[protocol]
heartbeat_period_s = 0.25
suspect_after_s = 0.75
evict_after_s = 1.5
deadline_multiplier = 4.0
deadline_floor_s = 1.0
mb_deadline_floor_s = 20.0
retry_period_s = 0.2
partition_timeout_s = 30.0
checkpoint_every = 5
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                        help=f"output folder (default: {DEFAULT_OUT}, replaced on every run)")
    parser.add_argument("--churn", choices=("none", "low", "high"), default="low",
                        help="low (default): one kill -9 of a data holder and one joiner that replaces it; "
                             "high: the first kill a data holder's, then any node's")
    parser.add_argument("--iterations", type=int, metavar="K", help="shorthand for --set train.iterations=K")
    parser.add_argument("--timeout-s", type=float, default=900.0, metavar="S", help="give up after S seconds (default 900)")
    add_device_argument(parser)
    add_secret_argument(parser)
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from gwtf.commands.swarm import LOOPBACK, check_swarm_config, refuse_non_empty, run_swarm
    from gwtf.runtime.swarm import SwarmOptions

    if not args.timeout_s > 0 or not math.isfinite(args.timeout_s):
        raise UserError(f"--timeout-s must be a finite number of seconds > 0, got {args.timeout_s}")
    overrides = list(args.overrides) + device_overrides(args)
    if args.iterations is not None:
        overrides.append(f"train.iterations={args.iterations}")
    # the config is checked before the output folder is touched
    cfg: Config = (load_config(args.config, overrides) if args.config else
                   from_dict(Config, merge_overrides(tomllib.loads(DEMO_TOML), overrides)))
    cfg = apply_secret_file(cfg, args.secret_file, LOOPBACK)
    check_device(cfg, args)
    check_swarm_config(cfg)
    out = Path(args.out)
    resume = bool(getattr(args, "resume", False))
    if not resume and args.out == DEFAULT_OUT and (out / "demo.toml").is_file():
        print(f"demo: replacing the earlier demo's outputs in {out}")
        shutil.rmtree(out)
    refuse_non_empty(out, resume)
    out.mkdir(parents=True, exist_ok=True)
    base = out / "demo.toml"
    base.write_text(DEMO_TOML, encoding="utf-8")
    config_path = args.config or str(base)
    opts = SwarmOptions(out_dir=out, replicas=2, churn=args.churn, timeout_s=args.timeout_s,
                        config_path=config_path, overrides=tuple(overrides), churn_roles=DEMO_CHURN_ROLES)
    code = run_swarm(cfg, opts, title="gwtf demo")
    print(f"demo outputs: {out}/metrics.jsonl (per-iteration loss), {out}/loss.png, "
          f"{out}/nodes/<node>/ (stdout.log, records.jsonl, status.json)")
    return code

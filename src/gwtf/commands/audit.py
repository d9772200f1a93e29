"""`gwtf audit DIR [DIR...]`: the exactly-once audit of a swarm run, from its node folders.

Owns the command's flags and the reading of the folders; the audit itself is
`gwtf.runtime.audit.audit_run`, the very one `gwtf swarm` runs at the end of a run (`Swarm.audit`).

Each DIR is a node folder (`DIR/records.jsonl`), a run folder (`DIR/nodes/<name>/records.jsonl`:
`gwtf swarm --out DIR` or `gwtf node --out DIR`; earlier attempts' `nodes-K/` are not read) or a
folder of node folders (`DIR/<name>/records.jsonl`, e.g. the `nodes/` folders of several machines
gathered into one). Several DIRs are merged. A node is named by its folder; two folders of one
name are told apart by the node id their records were written by (`me`, which embeds the key
fingerprint and address), and refused when that is the same too (one node gathered twice).

The run's shape (model.stages, train.data_holders, train.microbatches, train.iterations) comes from `--config FILE`
(plus `--set` overrides) if given, else from the `config.resolved.toml` that `gwtf swarm` writes
in its run folder (found next to `nodes/`; `--set` applies on top). `gwtf node` writes none: pass
the config the nodes ran with. Run folders whose resolved configs disagree, or a config that
contradicts a node's `status.json` (its `stages` and `iterations`) or the leader's
`training_done` record, are refused. The iterations audited: from the first iteration started
(the leader's first `iter_start`: 0, or a resumed run's checkpoint version) to the run's end when
a leader logged `training_done`, else to the last iteration every stage stepped (the tail is
incomplete, not audited, and said so). Records of earlier swarm starts in the same files (a
`gwtf node --resume` appends to its folder) are set aside, and said so (`audit.latest_attempt`).

The replica-hash check is never skipped silently: every audited step that no replica logged is
a violation ("no replica logged its step"), except a stage restored from that very step's
checkpoint (its last replica died right after stepping, before logging it: the ledger accepts
it), which is named on a `note:` line and counted in `unhashed`; `hashed` counts the steps
whose replica hashes were compared.

Exit codes: 0 clean, 1 a violation, 2 a user error (one line on stderr: no such folder, no
records, no or unreadable config, nothing to audit).

`--json` prints one JSON object (stable field names):
- `clean` (bool), `violations` (list of str), `notes` (list of str);
- `folders` (the DIRs as given), `nodes` (node names, sorted), `config` (the config file used,
  or null for the defaults plus `--set`);
- `stages`, `data_holders`, `microbatches` (per data holder), `run_iterations` (train.iterations);
- `first`, `end` (the audited iterations are first..end-1), `audited` (end - first), `finished`
  (a leader logged `training_done`);
- `expected` (microbatch-stage contributions expected), `dropped` (microbatches of crashed data
  holders that were not trained: the paper's behaviour, `protocol.hold_batch` off), `reserved`
  (microbatches of crashed data holders served again by live ones and trained in their
  iteration), `hashed`, `unhashed` (as above), `unhashed_steps` (list of [iteration, stage]),
  `set_aside` (rows of earlier swarm starts not audited);
- `full_batch` (train.data_holders x train.microbatches), `short_iterations` (audited iterations
  that trained fewer), `short_detail` (the first 20: `iteration`, `microbatches` trained,
  `cause`), the same account as the simulator's summary.json (`invariants.BatchAccount`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gwtf.cli import add_config_arguments
from gwtf.config import Config, load_config
from gwtf.errors import UserError

__all__ = ["add_arguments", "run"]

RESOLVED_CONFIG = "config.resolved.toml"  # what `gwtf swarm` writes in its run folder (config.write_resolved)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", metavar="DIR", nargs="+",
                        help="a node folder (records.jsonl), a run folder (nodes/<name>/records.jsonl) or a "
                             "folder of node folders; several are merged (e.g. gathered from several machines)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_config_arguments(parser)


@dataclass(slots=True)
class _Folders:
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # node name -> rows
    status: dict[str, dict[str, Any]] = field(default_factory=dict)  # node name -> its status.json
    configs: list[Path] = field(default_factory=list)  # config.resolved.toml found, in DIR order


def _node_folders(path: Path, given: str) -> tuple[list[Path], list[Path]]:
    """(node folders, candidate resolved-config paths) of one DIR."""
    from gwtf.runtime.status import RECORDS_FILE

    if not path.exists():
        raise UserError(f"{given}: no such folder")
    if not path.is_dir():
        raise UserError(f"{given} is not a folder")
    if (path / RECORDS_FILE).is_file():
        up = [path.parent.parent / RESOLVED_CONFIG] if path.parent.name == "nodes" else []
        return [path], [path / RESOLVED_CONFIG, *up]
    for base, configs in ((path / "nodes", [path / RESOLVED_CONFIG]),
                          (path, [path / RESOLVED_CONFIG] + ([path.parent / RESOLVED_CONFIG]
                                                             if path.name == "nodes" else []))):
        found = sorted(d for d in base.glob("*") if (d / RECORDS_FILE).is_file()) if base.is_dir() else []
        if found:
            return found, configs
    raise UserError(f"{given}: no records found (neither {RECORDS_FILE}, nodes/<name>/{RECORDS_FILE} "
                    f"nor <name>/{RECORDS_FILE} in it)")


def _first_id(rows: Sequence[Mapping[str, Any]]) -> str | None:
    return next((str(r["me"]) for r in rows if r.get("me")), None)


def read_folders(dirs: Sequence[str]) -> _Folders:
    """Every node's records (and status.json) under `dirs`, merged; UserError on a bad folder,
    unreadable records or one node gathered twice."""
    from gwtf.runtime.status import RECORDS_FILE, STATUS_FILE, read_jsonl, read_status

    out = _Folders()
    read: dict[Path, tuple[Path, list[dict[str, Any]]]] = {}  # resolved node folder -> (folder, rows)
    for given in dirs:
        folders, configs = _node_folders(Path(given).expanduser(), given)
        out.configs += [c for c in configs if c.is_file() and c.resolve() not in {x.resolve() for x in out.configs}]
        for d in folders:
            if d.resolve() in read:
                continue  # the same folder given twice (as a run folder and a node folder, say)
            try:
                with (d / RECORDS_FILE).open("rb"):
                    pass
            except OSError as exc:
                raise UserError(f"{d / RECORDS_FILE}: cannot read it: {exc.strerror}") from None
            read[d.resolve()] = (d, read_jsonl(d / RECORDS_FILE))
    by_name: dict[str, list[tuple[Path, list[dict[str, Any]]]]] = {}
    for d, rows in read.values():
        by_name.setdefault(d.name, []).append((d, rows))
    for name, group in by_name.items():
        if len(group) == 1:
            keys = [name]
        else:  # one name in several folders: each is named by the node id its records carry
            keys = [_first_id(rows) or "" for _, rows in group]
            if "" in keys or len(set(keys)) < len(keys):
                raise UserError(f"node {name} appears in {len(group)} folders ({', '.join(str(d) for d, _ in group)}) "
                                "without distinct node ids in their records: gather each node's folder once")
        for key, (d, rows) in zip(keys, group, strict=True):
            out.records[key] = rows
            status = read_status(d / STATUS_FILE)
            if status is not None:
                out.status[key] = status
    if not any(out.records.values()):
        raise UserError(f"no records found in {', '.join(dirs)} (every records.jsonl is empty)")
    return out


def load_run_config(args: argparse.Namespace, found: Sequence[Path]) -> tuple[Config, Path | None]:
    """The config of the audited run: `--config` (+ `--set`), else the resolved config found in
    the run folders (+ `--set`), else the defaults + `--set` if any `--set` was given."""
    overrides = list(args.overrides)
    if args.config:
        return load_config(args.config, overrides), Path(args.config)
    if not found:
        if overrides:
            return load_config(None, overrides), None
        raise UserError(f"no {RESOLVED_CONFIG} found with these records (gwtf node writes none): pass --config "
                        "FILE, the config the nodes ran with (and their --set overrides)")
    shapes: dict[Path, tuple[int, int, int, int]] = {}
    for path in found:
        cfg: Config = load_config(path, overrides)
        shapes[path] = (cfg.model.stages, cfg.train.data_holders, cfg.train.microbatches, cfg.train.iterations)
    if len(set(shapes.values())) > 1:
        text = "; ".join(f"{p}: stages {s}, data holders {d}, microbatches {m}, iterations {n}"
                         for p, (s, d, m, n) in shapes.items())
        raise UserError(f"the run folders' configs disagree ({text}): pass --config FILE")
    return load_config(found[0], overrides), found[0]


def _check_config(cfg: Config, source: str, status: Mapping[str, Mapping[str, Any]],
                  records: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """A config that contradicts what the nodes say they ran is a user error."""
    for name, st in sorted(status.items()):
        for key, want in (("stages", cfg.model.stages), ("iterations", cfg.train.iterations)):
            got = st.get(key)
            if isinstance(got, int) and not isinstance(got, bool) and got != want:
                setting = "model.stages" if key == "stages" else "train.iterations"
                raise UserError(f"node {name}'s status.json says {key} {got}, the config ({source}) says "
                                f"{setting} = {want}: pass --config FILE with the config the nodes ran")
    done = _training_done(records)
    if done is not None and done != cfg.train.iterations:
        raise UserError(f"the leader's training_done record says {done} iterations, the config ({source}) says "
                        f"train.iterations = {cfg.train.iterations}: pass --config FILE with the config the nodes ran")


def _training_done(records: Mapping[str, Sequence[Mapping[str, Any]]]) -> int | None:
    ends = [int(r["iterations"]) for rows in records.values() for r in rows
            if r.get("event") == "training_done" and isinstance(r.get("iterations"), int)]
    return max(ends) if ends else None


def audit_range(records: Mapping[str, Sequence[Mapping[str, Any]]], stages: int) -> tuple[int, int, bool]:
    """(first, end, finished): the iterations to audit are first..end-1. first: the leader's first
    `iter_start` (else the first decision or step); end: the run's end if a leader logged
    `training_done`, else one past the last iteration every stage stepped."""
    from gwtf.runtime.audit import current_step_hashes

    def its(event: str) -> list[int]:
        return [int(r["iteration"]) for rows in records.values() for r in rows
                if r.get("event") == event and isinstance(r.get("iteration"), int)]

    starts = its("iter_start") or its("decision") or its("stepped")
    if not starts:
        raise UserError("nothing to audit: no iteration started in these records")
    first = min(starts)
    done = _training_done(records)
    if done is not None:
        return first, max(first, done), True
    standing = current_step_hashes(records)
    stepped = [it for it in {i for i, _ in standing} if all(standing.get((it, k)) for k in range(stages))]
    return first, max([first, *(it + 1 for it in stepped if it >= first)]), False


def run(args: argparse.Namespace) -> int:
    from gwtf.runtime.audit import audit_run, latest_attempt, unhashed_steps

    folders = read_folders(args.dirs)
    cfg, config_path = load_run_config(args, folders.configs)
    source = str(config_path) if config_path else "defaults + --set"
    stages, microbatches = cfg.model.stages, cfg.train.microbatches
    try:
        records, set_aside = latest_attempt(folders.records)
        _check_config(cfg, source, folders.status, records)
        first, end, finished = audit_range(records, stages)
        if end <= first:
            raise UserError(f"nothing to audit: no iteration from {first} on was stepped by every stage "
                            "and no leader logged training_done")
        problems, totals = audit_run(records, stages, microbatches, end, first=first,
                                     run_iterations=cfg.train.iterations, data_holders=cfg.train.data_holders)
        unhashed = unhashed_steps(records, stages, end, first)
    except (KeyError, TypeError, ValueError, IndexError) as exc:  # a record no node writes (edited by hand?)
        raise UserError(f"malformed records ({type(exc).__name__}: {exc}): not written by a gwtf node") from None
    notes = []
    if set_aside:
        notes.append(f"{set_aside} records of earlier swarm starts set aside (a node restarted with --resume "
                     "appends to its records.jsonl): auditing the newest start only")
    if not finished:
        notes.append(f"no training_done record (the run did not finish, or its leader's folder is missing): "
                     f"iterations from {end} on are incomplete (not every stage stepped them) and not audited")
    absent = _absent_nodes(records)
    if absent:
        notes.append(f"no records of {len(absent)} nodes the decisions credit ({', '.join(absent)}): "
                     "gather the node folders of every machine")
    notes += [f"iteration {it} stage {k}: no replica logged its step (the stage was restored from this step's "
              f"checkpoint v{it + 1}): replica hashes not compared" for it, k in unhashed]
    summary = {
        "clean": not problems, "violations": problems, "notes": notes,
        "folders": list(args.dirs), "nodes": sorted(records), "config": str(config_path) if config_path else None,
        "stages": stages, "data_holders": cfg.train.data_holders, "microbatches": microbatches,
        "run_iterations": cfg.train.iterations,
        "first": first, "end": end, "audited": end - first, "finished": finished,
        "expected": totals.get("expected", 0), "dropped": totals.get("dropped", 0),
        "reserved": totals.get("reserved", 0), "full_batch": totals.get("full_batch", 0),
        "short_iterations": totals.get("short_iterations", 0), "short_detail": totals.get("short_detail", []),
        "hashed": totals.get("hashed", 0), "unhashed": totals.get("unhashed", 0),
        "unhashed_steps": [list(x) for x in unhashed], "set_aside": set_aside,
    }
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        _print_summary(summary, source)
    return 1 if problems else 0


def _absent_nodes(records: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """Names of the nodes that decisions credit with work but whose records are not here (nodes
    known by the id they write, `me`; a name is the id's part before '~')."""
    present = {str(r["me"]) for rows in records.values() for r in rows if r.get("me")}
    if not present:
        return []
    credited = {str(n) for rows in records.values() for r in rows
                if r.get("event") == "decision" and isinstance(r.get("contributions"), dict) for n in r["contributions"]}
    return sorted({n.split("~", 1)[0] for n in credited - present})


def _print_summary(s: Mapping[str, Any], source: str) -> None:
    from gwtf.runtime.audit import batch_text, short_lines

    nodes = s["nodes"]
    print(f"audit: {len(nodes)} node{'s' if len(nodes) != 1 else ''} ({', '.join(nodes)}); config {source}: {s['stages']} stages, "
          f"{s['data_holders']} data holders x {s['microbatches']} microbatches, {s['run_iterations']} iterations")
    print(f"iterations {s['first']}..{s['end'] - 1} audited ({s['audited']}"
          f"{', the run finished' if s['finished'] else ', the run did not finish'}): {s['expected']} microbatch-stage "
          f"contributions expected; {batch_text(s)}; replica hashes compared at {s['hashed']} of "
          f"{s['audited'] * s['stages']} steps")
    for line in short_lines(s):
        print(f"short: {line}")
    for note in s["notes"]:
        print(f"note: {note}")
    if s["violations"]:
        print(f"exactly-once ledger violated ({len(s['violations'])}):")
        for v in s["violations"]:
            print(f"  {v}")
    else:
        print("clean: every microbatch counted exactly once at every stage; replicas identical after every step")

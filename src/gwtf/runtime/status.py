"""Per-node observable state on disk, and the live table the launcher draws from it.

Owns the files under `DIR/nodes/<name>/`:
- `status.json`: the node's current state, rewritten atomically (temp file + os.replace) every
  `runtime.status_period_s`; readers never see a half-written file.
- `records.jsonl`: one JSON object per line, appended and flushed line by line, so a `kill -9`
  loses at most the line being written (readers skip a torn last line). It holds the protocol
  core's `Record` effects plus the driver's own records (`loss`, `stepped`, `fault`, ...), each
  with `t_s` (seconds since the node started), `unix_s` (wall clock, for one machine's launcher)
  and `me` (the writing node's id; a record's own `node` field is the core's and is kept).
- `stdout.log`: everything the node printed (the launcher reads the READY line from it).
And `render_table`, the rich table of all nodes (node, stage, region, state, microbatches in
flight, microbatches served, last loss, tokens/s, seconds of its last iteration), with a caption
line "stalled: stage K has no node" for every stage without a live active node
(`stalled_stages`); the swarm-wide header above it is `runtime.watch`'s.

Must not import torch or asyncio.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from rich.table import Table

STATUS_FILE = "status.json"
RECORDS_FILE = "records.jsonl"
STDOUT_FILE = "stdout.log"


def node_dir(out_dir: str | Path, name: str) -> Path:
    """DIR/nodes/<name>, created if missing."""
    path = Path(out_dir) / "nodes" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return str(value)


def dumps(obj: Any) -> str:
    """Compact JSON; tuples/sets become lists, anything else unknown its str(); NaN stays NaN."""
    return json.dumps(obj, separators=(",", ":"), default=_json_default)


def write_status(path: str | Path, data: Mapping[str, Any]) -> None:
    """Atomically replace `path` with `data` as JSON."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(dict(data)), encoding="utf-8")
    os.replace(tmp, path)


def read_status(path: str | Path) -> dict[str, Any] | None:
    """The last status a node wrote, or None if there is none (yet)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class RecordLog:
    """Append-only JSONL writer; every line is flushed to the OS at once (survives kill -9)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")

    def write(self, row: Mapping[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(dumps(dict(row)) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class JsonlTail:
    """Incremental reader of a JSONL file another process appends to (torn last line kept back)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[dict[str, Any]]:
        """Rows appended since the last call; malformed complete lines are skipped."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        rows = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete rows of a JSONL file (a torn last line is ignored)."""
    return JsonlTail(path).read_new()


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


SERVING = frozenset({"active", "finishing", "finished"})  # a node that ended with the run still served its stage


def stalled_stages(rows: Iterable[Mapping[str, Any]], stages: int) -> list[int]:
    """Stages 0..stages-1 that no row serves: a row serves its `stage` when its `state` is
    "active" (the launcher marks dead processes "crashed"/"exited" and nodes the core stopped
    with their reason, so a stale status file of a dead node does not count)."""
    served = {row.get("stage") for row in rows if row.get("state") in SERVING}
    return [k for k in range(stages) if k not in served]


def stalled_lines(stalled: Iterable[int]) -> list[str]:
    return [f"stalled: stage {k} has no node" for k in stalled]


def render_table(rows: Iterable[Mapping[str, Any]], title: str = "", stalled: Iterable[int] = ()) -> Table:
    """The live swarm table: one row per node status (launcher fields merged in); a caption
    names every stalled stage."""
    caption = "\n".join(stalled_lines(stalled))
    table = Table(title=title or None, expand=False, caption=caption or None, caption_style="bold red")
    for col, justify in (
        ("node", "left"), ("role", "left"), ("stage", "right"), ("region", "left"), ("state", "left"),
        ("iter", "right"), ("in flight", "right"), ("served", "right"), ("last loss", "right"),
        ("tokens/s", "right"), ("s/iter", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        state = str(row.get("state", "?"))
        style = {"active": "green", "joining": "yellow", "starting": "", "finishing": "",
                 "leaving": "", "stopped": ""}.get(state, "red")
        table.add_row(
            str(row.get("name", row.get("node", "?"))),
            str(row.get("role", "-")),
            _fmt(row.get("stage"), "d"),
            str(row.get("region", "-")),
            f"[{style}]{state}[/{style}]" if style else state,
            _fmt(row.get("iteration"), "d"),
            _fmt(row.get("in_flight"), "d"),
            _fmt(row.get("microbatches"), "d"),
            _fmt(row.get("last_loss"), ".4f"),
            _fmt(row.get("tokens_per_s"), ".0f"),
            _fmt(row.get("iteration_s"), ".2f"),
        )
    return table

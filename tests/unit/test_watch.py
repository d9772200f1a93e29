"""The watcher's view: a node's counters from its records, its progress line, and the live
table's swarm-wide header computed from status rows."""

from __future__ import annotations

from rich.console import Console

from gwtf.runtime.watch import (
    NodeStats,
    format_eta,
    header_text,
    progress_line,
    render_watch,
    should_print_progress,
    swarm_header,
)

ROWS = [
    {"name": "dh0", "role": "data-holder", "stage": 0, "state": "active", "iteration": 9, "iterations": 100,
     "last_loss": 4.0, "tokens_per_s": 1000.0, "iteration_s": 0.5, "microbatches": 40, "crashes_seen": 1,
     "joins_seen": 1},
    {"name": "dh1", "role": "data-holder", "stage": 0, "state": "active", "iteration": 9, "iterations": 100,
     "last_loss": 5.0, "tokens_per_s": 1200.0, "iteration_s": 0.7, "microbatches": 38},
    {"name": "r1a", "role": "relay", "stage": 1, "state": "active", "iteration": 8, "iterations": 100,
     "tokens_per_s": 2100.0, "iteration_s": 0.6, "microbatches": 77},
    {"name": "r1b", "role": "relay", "stage": 1, "state": "crashed", "iteration": 3, "tokens_per_s": 999.0},
    {"name": "j1", "role": "relay", "stage": 1, "state": "joining"},
]


def test_header_is_computed_from_the_live_rows() -> None:
    h = swarm_header(ROWS)
    assert h["iteration"] == 10 and h["iterations"] == 100
    assert h["eta_s"] == 90 * 0.6  # remaining iterations x the data holders' median iteration time
    assert h["loss"] == 4.5 and h["tokens_per_s"] == 2200.0  # the dead relay's rate is not counted
    assert h["members"] == {0: 2, 1: 1}
    assert (h["crashes"], h["joins"]) == (1, 1)  # the leader's counts
    assert (swarm_header(ROWS, 20, crashes=3, joins=2)["crashes"], swarm_header(ROWS, 20, 3, 2)["joins"]) == (3, 2)
    assert swarm_header([])["eta_s"] is None
    line = header_text(h)
    for part in ("iteration 10/100", "ETA 54s", "loss 4.5000", "2200 tokens/s", "members by stage 0:2 1:1",
                 "crashes 1", "joins 1"):
        assert part in line, line


def test_table_shows_the_header_and_filled_per_node_columns() -> None:
    console = Console(record=True, width=200)
    console.print(render_watch(ROWS, "gwtf demo", [2], iterations=100, crashes=1, joins=0))
    text = console.export_text()
    assert "iteration 10/100" in text and "crashes 1" in text and "joins 0" in text
    assert "served" in text and "tokens/s" in text
    r1a = next(line for line in text.splitlines() if "r1a" in line)
    assert "77" in r1a and "2100" in r1a and "0.60" in r1a
    assert "stalled: stage 2 has no node" in text


def test_node_counts_swarm_events_not_its_own_join() -> None:
    s = NodeStats()
    s.absorb("join_stage", {"stage": 1})  # its own join: not a swarm join
    s.absorb("join", {"node": "x", "stage": 1, "iteration": 0})  # forming the swarm before iteration 0
    assert s.joins_seen == 0
    s.absorb("iter_start", {"iteration": 0})
    s.absorb("join", {"node": "y", "stage": 1, "iteration": 3})
    s.absorb("evict", {"node": "z", "graceful": True})  # a leave, not a crash
    s.absorb("evict", {"node": "w", "graceful": False})
    s.absorb("contribute", {})
    s.absorb("loss", {"loss": 3.25})
    assert not s.absorb("step", {"iteration": 0})
    assert s.absorb("stepped", {"iteration": 0, "tokens_per_s": 512.0, "iteration_s": 0.5})
    assert (s.joins_seen, s.crashes_seen, s.microbatches, s.iteration) == (1, 1, 1, 0)
    status = s.as_status()
    assert status["tokens_per_s"] == 512.0 and status["iteration_s"] == 0.5 and "started" not in status
    line = progress_line("dh0", 0, s, 50, 4, "active")
    assert line.startswith("progress: dh0 stage 0 iteration 1/50 loss 3.2500 tokens/s 512")
    assert " members 4 " in line


def test_progress_cadence_and_eta_format() -> None:
    assert [i for i in range(30) if should_print_progress(i, 30, 10)] == [0, 9, 19, 29]
    assert not any(should_print_progress(i, 30, 0) for i in range(30))
    assert [format_eta(x) for x in (None, 42.4, 185, 3720, float("inf"))] == ["-", "42s", "3m05s", "1h02m", "-"]

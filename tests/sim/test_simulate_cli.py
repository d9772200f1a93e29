"""`gwtf simulate` end to end: the output contract (summary.json fields, timeline, plots),
byte-for-byte determinism per seed, and one-line errors for bad scenario files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gwtf.cli import main

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "scenarios" / "smoke.toml"
FIELDS = ("training_time_s", "iterations", "throughput_microbatches_per_s", "gpu_waste_fraction",
          "discarded_fraction", "idle_fraction", "microbatches_dropped", "invariant_violations")


def _simulate(out: Path, seed: int) -> dict[str, dict[str, float]]:
    rc = main(["simulate", str(SMOKE), "--seed", str(seed), "--out", str(out), "--systems", "gwtf,swarm",
               "--no-progress"])
    assert rc == 0
    return json.loads((out / "summary.json").read_text())


def test_outputs_and_determinism(tmp_path: Path) -> None:
    a = _simulate(tmp_path / "a", 3)
    assert set(a) == {"gwtf", "swarm"}
    for system in a.values():
        assert all(k in system for k in FIELDS)
        assert system["invariant_violations"] == 0 and system["iterations"] >= 1
    for name in ("timeline.csv", "scenario.resolved.toml", "throughput.png", "cumulative.png", "systems.png"):
        assert (tmp_path / "a" / name).stat().st_size > 0, name
    _simulate(tmp_path / "b", 3)
    assert (tmp_path / "a" / "summary.json").read_bytes() == (tmp_path / "b" / "summary.json").read_bytes()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[churn]\ncrash_rate_per_hour = -1.0\n", "crash_rate_per_hour"),
        ("[nodes]\nbogus = 3\n", "nodes.bogus"),
        ("[nodes]\ncount = 3\ndata_holders = 2\n[model]\nstages = 4\n", "stage"),
    ],
)
def test_bad_scenarios_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, needle: str
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    assert main(["simulate", str(bad), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and needle in err, err


def test_default_is_the_comparison_with_units(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(SMOKE), "--seed", "1", "--out", str(tmp_path / "c"), "--no-progress"]) == 0
    assert set(json.loads((tmp_path / "c" / "summary.json").read_text())) == {"gwtf", "swarm"}
    out = capsys.readouterr().out
    for label in ("time to K iterations [s]", "throughput [tokens/s]", "idle GPU time [% of GPU time]",
                  "microbatches dropped [count]", "gwtf", "swarm"):
        assert label in out, out
    assert "%" in out.split("idle GPU time")[1].splitlines()[0]
    one = tmp_path / "one"
    assert main(["simulate", str(SMOKE), "--seed", "1", "--out", str(one), "--systems", "swarm", "--no-progress"]) == 0
    assert set(json.loads((one / "summary.json").read_text())) == {"swarm"}


def test_table_cells_carry_their_units() -> None:
    from gwtf.commands.simulate import format_value

    assert [format_value(v, k) for v, k in ((12.3456, "s"), (0.01234, "%"), (7.0, "n"), (1234.5678, "r"),
                                            (123456.7, "r"), (None, "s"))] == \
        ["12.35", "1.23%", "7", "1,235", "123,457", "-"]

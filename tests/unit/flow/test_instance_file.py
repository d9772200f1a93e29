"""Instance files (flow/instance_file.py, `gwtf route --instance / --write-instance`): round trips,
a hand-written instance with a known optimum, and bad files (exit 2, one line naming the field)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from gwtf.cli import main
from gwtf.commands.route import compare
from gwtf.config import Config
from gwtf.flow.generate import generate_instance
from gwtf.flow.instance_file import instance_to_dict, load_instance, write_instance
from gwtf.flow.optimum import optimum


def _node(nid: str, stage: int, capacity: int, **extra: Any) -> dict[str, Any]:
    role = "data-holder" if stage == 0 else "relay"
    return {"id": nid, "stage": stage, "role": role, "capacity": capacity, "compute_s": 0.0, **extra}


def _link(a: str, b: str, ms: float) -> dict[str, Any]:
    return {"a": a, "b": b, "latency": ms, "bandwidth": 1}


# No compute and no activation bytes: a route costs the sum of its three one-way latencies (ms).
# d0-a1-a2 30, d0-a1-b2 60, d0-b1-b2 70; b1 has no link to a2 and c1 none to stage 2, so the
# capacity bound says 3 routes but only 2 exist: the optimum is {d0-a1-a2, d0-b1-b2}, max 70 ms.
SMALL: dict[str, Any] = {
    "stages": 3, "activation_bytes": 0, "latency_unit": "ms", "bandwidth_unit": "Gbit/s",
    "nodes": [_node("d0", 0, 3, demand=3), _node("a1", 1, 1), _node("b1", 1, 1), _node("c1", 1, 1),
              _node("a2", 2, 1), _node("b2", 2, 2)],
    "links": [_link("d0", "a1", 10), _link("d0", "b1", 40), _link("d0", "c1", 5), _link("a1", "a2", 10),
              _link("a1", "b2", 30), _link("b1", "b2", 10), _link("a2", "d0", 10), _link("b2", "d0", 20)],
}


def _write(tmp_path: Path, data: dict[str, Any], name: str = "inst.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _without_wall(result: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k: {f: v for f, v in r.items() if f != "wall_s"} for k, r in result.items()}


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_write_then_read_gives_the_same_instance_and_results(tmp_path: Path, suffix: str) -> None:
    inst = generate_instance(16, 3, 2, seed=5, jitter_fraction=0.2)  # asymmetric, unround numbers
    path = tmp_path / f"inst{suffix}"
    write_instance(inst, path)
    back = load_instance(path)
    assert back == inst and back.network == inst.network
    assert _without_wall(compare(back, Config(), 5)) == _without_wall(compare(inst, Config(), 5))


def test_cli_write_instance_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gen.toml"
    assert main(["route", "--nodes", "12", "--stages", "3", "--data-holders", "2", "--seed", "4",
                 "--json", "--write-instance", str(out)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert load_instance(out) == generate_instance(12, 3, 2, seed=4)
    assert main(["route", "--instance", str(out), "--seed", "4", "--json"]) == 0
    assert _without_wall(json.loads(capsys.readouterr().out)) == _without_wall(first)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_links_instance_round_trips(tmp_path: Path, suffix: str) -> None:
    inst = load_instance(_write(tmp_path, SMALL))
    assert not inst.linked("b1", "a2") and inst.linked("a2", "d0")
    path = tmp_path / f"again{suffix}"
    write_instance(inst, path)
    assert load_instance(path) == inst
    assert "links" in instance_to_dict(inst) and "region" not in instance_to_dict(inst)["nodes"][0]


def test_hand_written_instance_has_the_known_optimum(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, SMALL)
    inst = load_instance(path)
    assert inst.max_flow_bound() == 3  # capacities alone would allow 3 routes
    opt = optimum(inst)
    assert sorted(opt.routes) == [("d0", "a1", "a2"), ("d0", "b1", "b2")]
    assert opt.stats.max_route_cost_s == pytest.approx(0.070)
    assert opt.stats.sum_route_cost_s == pytest.approx(0.100)
    assert main(["route", "--instance", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["optimal"]["flow"] == 2 and result["gwtf"]["flow"] == 2
    assert result["gwtf"]["max_route_cost_s"] == pytest.approx(0.070)


def _set(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(SMALL)
    obj: Any = data
    for key in path[:-1]:
        obj = obj[key]
    if value is _DELETE:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (_set(("nodes", 1, "capacity"), _DELETE), "nodes[1].capacity: missing"),
        (_set(("nodes", 1, "capacity"), "3"), "nodes[1].capacity: must be an integer"),
        (_set(("nodes", 2, "compute_s"), "fast"), "nodes[2].compute_s: must be a number"),
        (_set(("nodes", 4, "stage"), 7), "nodes[4].stage: unknown stage 7"),
        (_set(("nodes", 3, "capacity"), -2), "nodes[3].capacity: must be >= 1"),
        (_set(("links", 2, "b"), "zz"), "links[2].b: unknown node 'zz'"),
        (_set(("links", 0, "latency"), -1), "links[0].latency: must be a finite number >= 0"),
        (_set(("nodes", 0, "role"), "relay"), "nodes[0].role"),
        (_set(("nodes", 1, "capcity"), 1), "nodes[1].capcity: unknown field"),
        (_set(("nodes", 1, "region"), "Tokyo"), "nodes[1].region"),
        (_set(("stages",), _DELETE), "stages: missing"),
        (_set(("latency_unit",), "hours"), "latency_unit: unknown unit"),
        ({**SMALL, "network": "geo10"}, "network: give exactly one"),
        ({**SMALL, "links": [*SMALL["links"], _link("a1", "d0", 3)]}, "links[8]: link a1 -> d0 is given twice"),
    ],
)
def test_bad_instance_file_exits_2_naming_the_field(tmp_path: Path, data: dict[str, Any], needle: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, data)
    assert main(["route", "--instance", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and str(path) in err[0], err


def _region_bad(what: str) -> dict[str, Any]:
    data = instance_to_dict(generate_instance(8, 2, 2, seed=1))
    if what == "region":
        data["nodes"][3]["region"] = "Atlantis"
    elif what == "row":
        data["network"]["latency"][1] = data["network"]["latency"][1][:-1]
    else:
        data["network"]["bandwidth"][0][2] = 0
    return data


@pytest.mark.parametrize(
    ("what", "needle"),
    [("region", "nodes[3].region: unknown region 'Atlantis'"),
     ("row", "network.latency[1]: must have 10 entries"),
     ("bandwidth", "network.bandwidth[0][2]: must be a finite number > 0")],
)
def test_region_instance_errors_name_the_field(tmp_path: Path, what: str, needle: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["route", "--instance", str(_write(tmp_path, _region_bad(what)))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("bad.json", "{\"stages\": 3,", "not valid JSON"),
        ("bad.toml", "stages = = 3", "not valid TOML"),
        ("bad.yaml", "stages: 3", "end in .json or .toml"),
        ("list.json", "[1, 2]", "must be a table/object"),
    ],
)
def test_unreadable_instance_file_exits_2(tmp_path: Path, name: str, text: str, needle: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    assert main(["route", "--instance", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_instance_and_shape_flags_conflict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["route", "--instance", str(_write(tmp_path, SMALL)), "--nodes", "30"]) == 2
    assert "drop --nodes" in capsys.readouterr().err
    assert main(["route", "--instance", str(tmp_path / "absent.json")]) == 2
    assert "cannot read instance file" in capsys.readouterr().err

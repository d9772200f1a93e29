"""Routing instances as files: read a user's JSON or TOML instance, write one (`gwtf route
--instance FILE`, `--write-instance FILE`).

Owns: `load_instance`, `instance_from_dict`, `instance_to_dict`, `write_instance` and the file
format (docs/routing.md, "Instance files"). Two ways to give the network:

- regions: `network = "geo10"` (a shipped table) or a `[network]` table with `regions` and full
  one-way `latency` / `bandwidth` matrices ([from][to]); every node names its `region`;
- links: a `links` list of node pairs with latency and bandwidth (both directions, or one with
  `directed = true`); nodes name no region; a pair not listed has no link (d(i,j) = inf).

Units are named by `latency_unit` ("s" or "ms") and `bandwidth_unit` ("B/s", "Mbit/s", "Gbit/s",
"GB/s", "GiB/s"); the writer uses seconds and bytes/s so that write then read gives the equal
`Instance`. Every mistake is a `UserError` naming the file and the field, never a traceback.

Must not import torch, asyncio, socket, threading or time.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

from gwtf.errors import UserError
from gwtf.flow.instance import Instance, NodeSpec
from gwtf.flow.network import Network, load_network

FORMAT_VERSION = 1
LATENCY_UNITS = {"s": 1.0, "ms": 1e-3}
BANDWIDTH_UNITS = {"B/s": 1.0, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8, "GB/s": 1e9, "GiB/s": float(1024**3)}
ROLES = {"data-holder": True, "relay": False}
_TOP = {"version", "stages", "activation_bytes", "latency_unit", "bandwidth_unit", "network", "links",
        "directed", "name", "source", "nodes"}
_NODE = {"id", "stage", "role", "capacity", "demand", "compute_s", "region", "profile"}
_NETWORK = {"name", "source", "regions", "latency", "bandwidth"}
_LINK = {"a", "b", "latency", "bandwidth"}


def _fail(where: str, msg: str) -> UserError:
    return UserError(f"{where}: {msg}")


def _need(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise _fail(f"{where}.{key}" if where else key, "missing")
    return obj[key]


def _int(value: Any, where: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, f"must be an integer, got {value!r}")
    if value < lo:
        raise _fail(where, f"must be >= {lo}, got {value}")
    return value


def _num(value: Any, where: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(where, f"must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x) or x < 0 or (positive and x == 0):
        raise _fail(where, f"must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return x


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(where, f"must be a non-empty string, got {value!r}")
    return value


def _table(value: Any, where: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, f"must be a table/object, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise _fail(f"{where}.{unknown[0]}" if where else unknown[0], "unknown field")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(where, f"must be a list, got {type(value).__name__}")
    return value


# ---- reading -----------------------------------------------------------------------------------


def load_instance(path: str | Path) -> Instance:
    """Read a .json or .toml instance file.

    Raises:
        UserError: unreadable file, bad syntax or any bad field (one line naming it).
    """
    p = Path(path)
    if p.suffix not in (".json", ".toml"):
        raise UserError(f"{p}: instance files end in .json or .toml")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{p}: cannot read instance file: {exc}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise UserError(f"{p}: not valid {p.suffix[1:].upper()}: {exc}") from None
    try:
        return instance_from_dict(data)
    except UserError as exc:
        raise UserError(f"{p}: {exc}") from None


def instance_from_dict(data: Any) -> Instance:
    """Build and check an `Instance` from the parsed file (see the module docstring)."""
    data = _table(data, "", _TOP)
    version = data.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise _fail("version", f"must be {FORMAT_VERSION}, got {version!r}")
    stages = _int(_need(data, "stages", ""), "stages", 2)
    activation_bytes = _int(_need(data, "activation_bytes", ""), "activation_bytes", 0)
    lat_scale = _unit(data, "latency_unit", LATENCY_UNITS)
    bw_scale = _unit(data, "bandwidth_unit", BANDWIDTH_UNITS)
    if ("network" in data) == ("links" in data):
        raise _fail("network", "give exactly one of 'network' (regions) and 'links' (node pairs)")
    by_links = "links" in data
    raw_nodes = _list(_need(data, "nodes", ""), "nodes")
    nodes = [_node(raw, f"nodes[{k}]", stages, by_links) for k, raw in enumerate(raw_nodes)]
    ids = [n.id for n in nodes]
    seen: set[str] = set()
    for k, nid in enumerate(ids):
        if nid in seen:
            raise _fail(f"nodes[{k}].id", f"duplicate id {nid!r}")
        seen.add(nid)
    missing = [s for s in range(stages) if not any(n.stage == s for n in nodes)]
    if missing:
        raise _fail("nodes", f"stage {missing[0]} has no node (stages = {stages})")
    if by_links:
        if "directed" in data and not isinstance(data["directed"], bool):
            raise _fail("directed", f"must be true or false, got {data['directed']!r}")
        net = _links_network(data, ids, lat_scale, bw_scale)
    else:
        net = _regions_network(data["network"], lat_scale, bw_scale)
        for k, n in enumerate(nodes):
            if n.region not in net.regions:
                raise _fail(f"nodes[{k}].region", f"unknown region {n.region!r} (not in network.regions)")
    return Instance(nodes=tuple(nodes), stages=stages, network=net, activation_bytes=activation_bytes)


def _unit(data: dict[str, Any], key: str, units: dict[str, float]) -> float:
    name = data.get(key, next(iter(units)))
    if name not in units:
        raise _fail(key, f"unknown unit {name!r} (known: {', '.join(units)})")
    return units[name]


def _node(raw: Any, where: str, stages: int, by_links: bool) -> NodeSpec:
    raw = _table(raw, where, _NODE)
    nid = _str(_need(raw, "id", where), f"{where}.id")
    stage = _int(_need(raw, "stage", where), f"{where}.stage", 0)
    if stage >= stages:
        raise _fail(f"{where}.stage", f"unknown stage {stage} (stages = {stages}: 0..{stages - 1})")
    role = _need(raw, "role", where)
    if role not in ROLES:
        raise _fail(f"{where}.role", f"must be 'data-holder' or 'relay', got {role!r}")
    if ROLES[role] != (stage == 0):
        raise _fail(f"{where}.role", f"{role!r} does not fit stage {stage} (data holders are stage 0)")
    capacity = _int(_need(raw, "capacity", where), f"{where}.capacity", 1)
    demand = _int(raw.get("demand", capacity if stage == 0 else 0), f"{where}.demand", 1 if stage == 0 else 0)
    if stage > 0 and demand:
        raise _fail(f"{where}.demand", "only data holders have a demand")
    compute_s = _num(_need(raw, "compute_s", where), f"{where}.compute_s")
    if by_links:
        if "region" in raw:
            raise _fail(f"{where}.region", "with 'links' nodes have no region (the links give the network)")
        region = nid
    else:
        region = _str(_need(raw, "region", where), f"{where}.region")
    profile = _str(raw.get("profile", "custom"), f"{where}.profile")
    return NodeSpec(id=nid, stage=stage, region=region, profile=profile, compute_s=compute_s,
                    capacity=capacity, demand=demand)


def _regions_network(raw: Any, lat_scale: float, bw_scale: float) -> Network:
    if isinstance(raw, str):
        return load_network(raw)
    raw = _table(raw, "network", _NETWORK)
    regions = [_str(r, f"network.regions[{k}]") for k, r in enumerate(_list(_need(raw, "regions", "network"),
                                                                             "network.regions"))]
    if len(set(regions)) != len(regions) or not regions:
        raise _fail("network.regions", "must be a non-empty list of distinct names")
    lat = _matrix(_need(raw, "latency", "network"), "network.latency", len(regions), lat_scale, False)
    bw = _matrix(_need(raw, "bandwidth", "network"), "network.bandwidth", len(regions), bw_scale, True)
    name = _str(raw.get("name", "custom"), "network.name")
    return Network(name=name, regions=tuple(regions), latency_matrix_s=lat, bandwidth_matrix_bytes_per_s=bw,
                   source=str(raw.get("source", "instance file")))


def _matrix(raw: Any, where: str, n: int, scale: float, positive: bool) -> tuple[tuple[float, ...], ...]:
    rows = _list(raw, where)
    if len(rows) != n:
        raise _fail(where, f"must have {n} rows (one per region), got {len(rows)}")
    out = []
    for a, row in enumerate(rows):
        row = _list(row, f"{where}[{a}]")
        if len(row) != n:
            raise _fail(f"{where}[{a}]", f"must have {n} entries (one per region), got {len(row)}")
        out.append(tuple(_num(x, f"{where}[{a}][{b}]", positive) * scale for b, x in enumerate(row)))
    return tuple(out)


def _links_network(data: dict[str, Any], ids: list[str], lat_scale: float, bw_scale: float) -> Network:
    """Regions are the node ids; a pair no link names has latency inf and bandwidth 0 (no link)."""
    pos = {nid: k for k, nid in enumerate(ids)}
    n = len(ids)
    lat = [[math.inf] * n for _ in range(n)]
    bw = [[0.0] * n for _ in range(n)]
    directed = bool(data.get("directed", False))
    for k, raw in enumerate(_list(data["links"], "links")):
        where = f"links[{k}]"
        raw = _table(raw, where, _LINK)
        a, b = (_str(_need(raw, end, where), f"{where}.{end}") for end in ("a", "b"))
        for end, nid in (("a", a), ("b", b)):
            if nid not in pos:
                raise _fail(f"{where}.{end}", f"unknown node {nid!r}")
        if a == b:
            raise _fail(f"{where}.b", f"a link joins two different nodes, got {a!r} twice")
        latency = _num(_need(raw, "latency", where), f"{where}.latency") * lat_scale
        bandwidth = _num(_need(raw, "bandwidth", where), f"{where}.bandwidth", positive=True) * bw_scale
        for i, j in [(pos[a], pos[b])] if directed else [(pos[a], pos[b]), (pos[b], pos[a])]:
            if math.isfinite(lat[i][j]):
                raise _fail(where, f"link {ids[i]} -> {ids[j]} is given twice")
            lat[i][j], bw[i][j] = latency, bandwidth
    return Network(name=str(data.get("name", "links")), regions=tuple(ids),
                   latency_matrix_s=tuple(map(tuple, lat)), bandwidth_matrix_bytes_per_s=tuple(map(tuple, bw)),
                   source=str(data.get("source", "instance file")))


# ---- writing -----------------------------------------------------------------------------------


def instance_to_dict(inst: Instance) -> dict[str, Any]:
    """The file form of `inst` (seconds, bytes/s); links form when some pair has no link."""
    net = inst.network
    by_links = any(math.isinf(x) for row in net.latency_matrix_s for x in row)
    out: dict[str, Any] = {"version": FORMAT_VERSION, "stages": inst.stages,
                           "activation_bytes": inst.activation_bytes,
                           "latency_unit": "s", "bandwidth_unit": "B/s"}
    nodes = []
    for n in inst.nodes:
        row: dict[str, Any] = {"id": n.id, "stage": n.stage, "role": "data-holder" if n.stage == 0 else "relay",
                               "capacity": n.capacity, "compute_s": n.compute_s, "profile": n.profile}
        if n.stage == 0:
            row["demand"] = n.demand
        if not by_links:
            row["region"] = n.region
        nodes.append(row)
    if by_links:
        out.update(name=net.name, source=net.source, **_links_of(inst))
    else:
        out["network"] = {"name": net.name, "source": net.source, "regions": list(net.regions),
                          "latency": [list(r) for r in net.latency_matrix_s],
                          "bandwidth": [list(r) for r in net.bandwidth_matrix_bytes_per_s]}
    out["nodes"] = nodes
    return out


def _links_of(inst: Instance) -> dict[str, Any]:
    net = inst.network
    lat, bw, regions = net.latency_matrix_s, net.bandwidth_matrix_bytes_per_s, net.regions
    n = len(regions)
    symmetric = all(lat[i][j] == lat[j][i] and bw[i][j] == bw[j][i] for i in range(n) for j in range(n))
    links = [
        {"a": regions[i], "b": regions[j], "latency": lat[i][j], "bandwidth": bw[i][j]}
        for i in range(n) for j in range(n)
        if i != j and math.isfinite(lat[i][j]) and (not symmetric or i < j)
    ]
    return {"directed": not symmetric, "links": links}


def write_instance(inst: Instance, path: str | Path) -> None:
    """Write `inst` as .json or .toml (by the suffix).

    Raises:
        UserError: another suffix, or the file cannot be written.
    """
    p = Path(path)
    if p.suffix not in (".json", ".toml"):
        raise UserError(f"{p}: instance files end in .json or .toml")
    data = instance_to_dict(inst)
    text = json.dumps(data, indent=1) + "\n" if p.suffix == ".json" else _toml(data)
    try:
        p.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{p}: cannot write instance file: {exc}") from None


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)  # float repr round-trips and always reads back as a float
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _toml(data: dict[str, Any]) -> str:
    """TOML for the instance layout: scalars, then the [network] table, [[links]] and [[nodes]]."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict | list)]
    if isinstance(data.get("network"), dict):
        lines += ["", "[network]"] + [f"{k} = {_toml_value(v)}" for k, v in data["network"].items()]
    for key in ("links", "nodes"):
        for row in data.get(key, []):
            lines += ["", f"[[{key}]]"] + [f"{k} = {_toml_value(v)}" for k, v in row.items()]
    return "\n".join(lines) + "\n"

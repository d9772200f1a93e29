"""The central optimum: max flow, then min-max route cost, then min sum (DESIGN.md section 4).

Owns: `optimum(instance) -> OptimumResult`, `max_flow_value`, and `lower_bound_max_route_cost_s`.

Method (docs/routing.md has the argument):
- Nodes with the same (stage, region, compute_s) are interchangeable for the cost model, so the
  search runs on these *classes* (capacities summed) and routes are split back onto nodes at the end.
- Max flow F: every relay may serve every data holder and consecutive stages are fully connected,
  so the multi-commodity "return to your own DH" constraint does not bind the flow: F is the
  single-commodity max flow (= the min over stages of total capacity). Computed with OR-Tools
  SimpleMaxFlow on the layered class graph with node splitting.
- Heuristic (any size): cheapest-route-first on the residual class graph (a layered DP over all data
  holders at once), then local improvement of the most expensive route: swap one stage's class with
  another route, or move it to a class with spare capacity, while the pair's max drops.
- Exact (small instances): enumerate class paths no dearer than the heuristic's max (pruned with an
  exact cost-to-go), bisect the cost cap over their sorted costs with a CP-SAT feasibility model
  (integer path multiplicities, class capacities, total = F), then minimise the sum under the cap.
- Certified lower bound: per stage, the smallest cap t whose classes with cheapest-route-through <= t
  hold >= F capacity; the max over stages is <= the optimum (exact runs report the optimum itself).
- Missing links (an instance file's `links` leave pairs out, d = inf): a route must return to its
  own data holder over existing links, so F is no longer the single-commodity max flow; every
  finite class path is enumerated (up to SPARSE_PATH_LIMIT), CP-SAT maximises the flow on them and
  the exact bisection follows. Always exact.

Must not import torch, asyncio, socket, threading or time (wall time is measured by callers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from ortools.graph.python import max_flow
from ortools.linear_solver import pywraplp
from ortools.sat.python import cp_model

from gwtf.errors import UserError
from gwtf.flow.instance import Instance, Route, RouteStats, evaluate_routes
from gwtf.ids import NodeId

EXACT_MAX_NODES = 60
EXACT_PATH_LIMIT = 20_000
SPARSE_PATH_LIMIT = 200_000  # instances with missing links are always solved exactly, up to this
_FINITE_CAP_S = 1e300  # enumerate every path of finite cost
_COST_SCALE = 1e6  # CP-SAT objective in microseconds
_EPS = 1e-12

ClassPath = tuple[int, ...]


@dataclass(frozen=True)
class OptimumResult:
    """Routes and their scores; `wall_s` is filled in by callers and left out of equality."""

    routes: list[Route]
    stats: RouteStats
    lower_bound_max_route_cost_s: float
    method: str  # "exact-cpsat" | "heuristic" | "empty"
    wall_s: float = field(default=0.0, compare=False)


# ---- the class graph ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassGraph:
    """Interchangeable-node classes per stage, their capacities and class-to-class edge costs.

    `cost[k][a, b]` is d(class a of stage k, class b of stage k+1); `cost[S-1]` closes the cycle
    (last relay class -> data-holder class). A class path p costs sum_k cost[k][p[k], p[k+1 mod S]].
    """

    members: tuple[tuple[tuple[NodeId, ...], ...], ...]  # [stage][class] -> node ids
    capacity: tuple[np.ndarray, ...]  # [stage] -> int64 per class
    cost: tuple[np.ndarray, ...]  # [k] -> float64 (n_k, n_{k+1 mod S})

    @property
    def stages(self) -> int:
        return len(self.members)

    def path_cost(self, path: ClassPath) -> float:
        s = self.stages
        return float(sum(self.cost[k][path[k], path[(k + 1) % s]] for k in range(s)))


def node_limit(instance: Instance, nid: NodeId) -> int:
    """Routes a node may carry: its capacity; a data holder also no more than its demand."""
    spec = instance.by_id[nid]
    return min(spec.demand, spec.capacity) if spec.is_data_holder else spec.capacity


def class_graph(instance: Instance) -> ClassGraph:
    """Group nodes by (stage, region, compute_s); nodes with zero limit are dropped."""
    members: list[tuple[tuple[NodeId, ...], ...]] = []
    caps: list[np.ndarray] = []
    for stage_ids in instance.by_stage:
        groups: dict[tuple[str, float], list[NodeId]] = {}
        for nid in stage_ids:
            if node_limit(instance, nid) > 0:
                spec = instance.by_id[nid]
                groups.setdefault((spec.region, spec.compute_s), []).append(nid)
        members.append(tuple(tuple(g) for g in groups.values()))
        caps.append(np.array([sum(node_limit(instance, n) for n in g) for g in groups.values()], np.int64))
    s = instance.stages
    cost = []
    for k in range(s):
        nxt = members[(k + 1) % s]
        cost.append(np.array(
            [[instance.edge_cost_s(a[0], b[0]) for b in nxt] for a in members[k]], dtype=np.float64,
        ).reshape(len(members[k]), len(nxt)))
    return ClassGraph(tuple(members), tuple(caps), tuple(cost))


def split_to_routes(instance: Instance, graph: ClassGraph, groups: dict[ClassPath, int]) -> list[Route]:
    """Hand each class path's multiplicity to concrete nodes of its classes, in id order."""
    residual = {nid: node_limit(instance, nid) for stage in graph.members for cls in stage for nid in cls}
    cursor: dict[tuple[int, int], int] = {}
    routes: list[Route] = []
    for path in sorted(groups):
        for _ in range(groups[path]):
            route = []
            for k, c in enumerate(path):
                ids = graph.members[k][c]
                i = cursor.get((k, c), 0)
                while residual[ids[i]] == 0:
                    i += 1
                cursor[(k, c)] = i
                residual[ids[i]] -= 1
                route.append(ids[i])
            routes.append(tuple(route))
    return routes


# ---- max flow and the lower bound ---------------------------------------------------------------


def max_flow_value(instance: Instance) -> int:
    """Exact max number of routes: single-commodity max flow on the layered graph (node splitting)."""
    return _max_flow(class_graph(instance))


def _max_flow(graph: ClassGraph) -> int:
    if any(len(m) == 0 for m in graph.members):
        return 0
    mf = max_flow.SimpleMaxFlow()
    base = [2]  # node 0 = source, 1 = sink; class (k, c) -> in = base[k] + 2c, out = in + 1
    for m in graph.members:
        base.append(base[-1] + 2 * len(m))
    big = int(sum(graph.capacity[0])) + 1
    for k, caps in enumerate(graph.capacity):
        for c, cap in enumerate(caps):
            mf.add_arc_with_capacity(base[k] + 2 * c, base[k] + 2 * c + 1, int(cap))
            if k == 0:
                mf.add_arc_with_capacity(0, base[k] + 2 * c, big)
            if k == graph.stages - 1:
                mf.add_arc_with_capacity(base[k] + 2 * c + 1, 1, big)
            else:
                for d in range(len(graph.members[k + 1])):
                    mf.add_arc_with_capacity(base[k] + 2 * c + 1, base[k + 1] + 2 * d, big)
    if mf.solve(0, 1) != mf.OPTIMAL:
        raise RuntimeError("OR-Tools max flow did not reach optimality")
    return int(mf.optimal_flow())


def _forward(graph: ClassGraph, masks: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """fwd[k][d, j]: cheapest cost from DH class d to class j of stage k >= 1, with back-pointers.

    `masks[k]` is added per class (0 or inf) to shut saturated classes.
    """
    fwd = [np.zeros(0), graph.cost[0] + masks[0][:, None] + masks[1][None, :]]
    back = [np.zeros(0), np.zeros(0)]
    for k in range(1, graph.stages - 1):
        t = fwd[k][:, :, None] + graph.cost[k][None, :, :]
        back.append(t.argmin(axis=1))
        fwd.append(t.min(axis=1) + masks[k + 1][None, :])
    return fwd, back


def _cheapest_through(graph: ClassGraph) -> list[np.ndarray]:
    """m[k][c]: cost of the cheapest route through class c of stage k (capacities ignored)."""
    s = graph.stages
    zero = [np.zeros(len(m)) for m in graph.members]
    fwd, _ = _forward(graph, zero)
    bwd = [np.zeros(0)] * s  # bwd[k][d, j]: cheapest from class j of stage k back to DH class d
    bwd[s - 1] = graph.cost[s - 1].T.copy()
    for k in range(s - 2, 0, -1):
        bwd[k] = (graph.cost[k][None, :, :] + bwd[k + 1][:, None, :]).min(axis=2)
    through = [(fwd[1] + bwd[1]).min(axis=1)]  # per DH class: its cheapest cycle
    through += [(fwd[k] + bwd[k]).min(axis=0) for k in range(1, s)]
    return through


def lower_bound(graph: ClassGraph, flow: int) -> float:
    """Bottleneck bound: max over stages of the least t such that classes with m <= t hold >= flow."""
    if flow == 0:
        return 0.0
    bound = 0.0
    for through, caps in zip(_cheapest_through(graph), graph.capacity):
        order = np.argsort(through, kind="stable")
        reach = np.cumsum(caps[order])
        bound = max(bound, float(through[order][int(np.searchsorted(reach, flow))]))
    return bound


def lower_bound_max_route_cost_s(instance: Instance) -> float:
    """A certified lower bound on the optimum's max route cost, seconds."""
    graph = class_graph(instance)
    return lower_bound(graph, _max_flow(graph))


# ---- heuristic: cheapest route first, then improve the most expensive route --------------------


def _cheapest_routes(graph: ClassGraph, residual: list[np.ndarray]) -> list[tuple[float, ClassPath]]:
    """Each data-holder class's cheapest route on the residual graph, cheapest first."""
    s = graph.stages
    masks = [np.where(r > 0, 0.0, np.inf) for r in residual]
    fwd, back = _forward(graph, masks)
    total = fwd[s - 1] + graph.cost[s - 1].T  # [d, j]: close the cycle at the same DH class
    out = []
    for d in range(total.shape[0]):
        j = int(np.argmin(total[d]))
        if np.isfinite(total[d, j]):
            path = [j]
            for k in range(s - 1, 1, -1):
                path.append(int(back[k][d, path[-1]]))
            out.append((float(total[d, j]), (d, *reversed(path))))
    return sorted(out)


def _fill(graph: ClassGraph, flow: int,
          candidates: Callable[[list[np.ndarray]], list[tuple[float, ClassPath]]]) -> dict[ClassPath, int]:
    """Route `flow` units in rounds: one DP per round, its candidates taken in order while they fit.

    Each candidate takes as many units as its path can carry, so every round saturates a class.
    """
    residual = [c.copy() for c in graph.capacity]
    groups: dict[ClassPath, int] = {}
    left = flow
    while left > 0:
        batch = candidates(residual)
        if not batch:
            raise RuntimeError("routing ran out of capacity below the max flow")
        for _, path in batch:
            units = min(left, *(int(residual[k][c]) for k, c in enumerate(path)))
            if units == 0:
                continue
            for k, c in enumerate(path):
                residual[k][c] -= units
            groups[path] = groups.get(path, 0) + units
            left -= units
            if left == 0:
                break
    return groups


def greedy_groups(graph: ClassGraph, flow: int) -> dict[ClassPath, int]:
    """Cheapest routes first (per round: every data-holder class's cheapest route)."""
    return _fill(graph, flow, lambda residual: _cheapest_routes(graph, residual))


def _backward(graph: ClassGraph, masks: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """bwd[k][d, j]: cheapest cost from class j of stage k >= 1 back to DH class d, + pointers."""
    s = graph.stages
    bwd = [np.zeros(0)] * s
    ptr = [np.zeros(0)] * s
    bwd[s - 1] = graph.cost[s - 1].T.copy()
    for k in range(s - 2, 0, -1):
        t = graph.cost[k][None, :, :] + masks[k + 1][None, None, :] + bwd[k + 1][:, None, :]
        ptr[k] = t.argmin(axis=2)
        bwd[k] = t.min(axis=2)
    return bwd, ptr


def _hardest_routes(graph: ClassGraph, residual: list[np.ndarray], b: int) -> list[tuple[float, ClassPath]]:
    """For each stage-b class, its cheapest route; dearest first (b >= 1)."""
    s = graph.stages
    masks = [np.where(r > 0, 0.0, np.inf) for r in residual]
    fwd, back = _forward(graph, masks)
    bwd, ptr = _backward(graph, masks)
    through = fwd[b] + bwd[b]  # [d, v]
    best_d = through.argmin(axis=0)
    out = []
    for v in range(through.shape[1]):
        d = int(best_d[v])
        if not np.isfinite(through[d, v]):
            continue
        head = [v]
        for k in range(b, 1, -1):
            head.append(int(back[k][d, head[-1]]))
        tail = [v]
        for k in range(b, s - 1):
            tail.append(int(ptr[k][d, tail[-1]]))
        out.append((-float(through[d, v]), (d, *reversed(head[1:]), *tail)))
    return sorted(out)


def hardest_first_groups(graph: ClassGraph, flow: int) -> dict[ClassPath, int]:
    """Serve the bottleneck relay stage's classes dearest-first, each by its cheapest route."""
    b = 1 + int(np.argmin([c.sum() for c in graph.capacity[1:]]))
    return _fill(graph, flow, lambda residual: _hardest_routes(graph, residual, b))


def _best_move(graph: ClassGraph, groups: dict[ClassPath, int], residual: list[np.ndarray],
               worst: ClassPath) -> tuple[float, ClassPath, ClassPath | None, ClassPath | None] | None:
    """Best change of `worst` that lowers it: (new pair max, new worst, partner, new partner).

    Moves: one stage to a class with spare capacity; swap one stage's class with another route;
    swap the tails (stages k..S-1) with another route.
    """
    s = graph.stages
    paths = list(groups)
    arr = np.array(paths, dtype=np.int64)
    edges = np.stack([graph.cost[k][arr[:, k], arr[:, (k + 1) % s]] for k in range(s)], axis=1)
    costs = edges.sum(axis=1)
    w = np.array(worst, dtype=np.int64)
    w_edges = np.array([graph.cost[k][w[k], w[(k + 1) % s]] for k in range(s)])
    w_cost = float(w_edges.sum())
    best: tuple[float, ClassPath, ClassPath | None, ClassPath | None] | None = None

    def offer(pair: np.ndarray, make: object) -> None:
        nonlocal best
        i = int(np.argmin(pair))
        if pair[i] < w_cost - 1e-12 and (best is None or pair[i] < best[0]):
            best = (float(pair[i]), *make(i))  # type: ignore[operator]

    for k in range(s):
        into, out = graph.cost[(k - 1) % s], graph.cost[k]
        prev, nxt = w[(k - 1) % s], w[(k + 1) % s]
        base = w_cost - w_edges[(k - 1) % s] - w_edges[k]
        spare = np.flatnonzero(residual[k] > 0)
        if spare.size:
            offer(base + into[prev, spare] + out[spare, nxt],
                  lambda i, k=k, spare=spare: (_with(worst, k, int(spare[i])), None, None))
        x, qp, qn = arr[:, k], arr[:, (k - 1) % s], arr[:, (k + 1) % s]
        new_w = base + into[prev, x] + out[x, nxt]
        new_q = costs - edges[:, (k - 1) % s] - edges[:, k] + into[qp, w[k]] + out[w[k], qn]
        pair = np.where(x == w[k], np.inf, np.maximum(new_w, new_q))
        offer(pair, lambda i, k=k, x=x: (_with(worst, k, int(x[i])), paths[i], _with(paths[i], k, worst[k])))
        if k >= 1:
            offer(_tail_swap_costs(graph, arr, edges, w, w_edges, k),
                  lambda i, k=k: (worst[:k] + paths[i][k:], paths[i], paths[i][:k] + worst[k:]))
    return best


def _tail_swap_costs(graph: ClassGraph, arr: np.ndarray, edges: np.ndarray, w: np.ndarray,
                     w_edges: np.ndarray, k: int) -> np.ndarray:
    """max(cost(w[:k] + q[k:]), cost(q[:k] + w[k:])) for every route q."""
    s = graph.stages
    link, ret = graph.cost[k - 1], graph.cost[s - 1]
    new_w = (w_edges[: k - 1].sum() + link[w[k - 1], arr[:, k]] + edges[:, k: s - 1].sum(axis=1)
             + ret[arr[:, s - 1], w[0]])
    new_q = (edges[:, : k - 1].sum(axis=1) + link[arr[:, k - 1], w[k]] + w_edges[k: s - 1].sum()
             + ret[w[s - 1], arr[:, 0]])
    same = (arr[:, k:] == w[k:]).all(axis=1)
    return np.where(same, np.inf, np.maximum(new_w, new_q))


def _with(path: ClassPath, k: int, cls: int) -> ClassPath:
    return path[:k] + (cls,) + path[k + 1:]


def improve_groups(graph: ClassGraph, groups: dict[ClassPath, int], max_steps: int = 5000) -> None:
    """Lower the most expensive route while a one-position move or swap lowers it (in place)."""
    residual = [c.copy() for c in graph.capacity]
    for path, units in groups.items():
        for k, c in enumerate(path):
            residual[k][c] -= units
    for _ in range(max_steps):
        worst = max(groups, key=lambda p: (graph.path_cost(p), p))
        move = _best_move(graph, groups, residual, worst)
        if move is None:
            return
        _, new_worst, partner, new_partner = move
        units = groups[worst] if partner is None else min(groups[worst], groups[partner])
        if partner is None:
            k = next(i for i in range(len(worst)) if worst[i] != new_worst[i])
            units = min(units, int(residual[k][new_worst[k]]))
            residual[k][new_worst[k]] -= units
            residual[k][worst[k]] += units
        _take(groups, worst, units)
        _put(groups, new_worst, units)
        if partner is not None and new_partner is not None:
            _take(groups, partner, units)
            _put(groups, new_partner, units)


def _take(groups: dict[ClassPath, int], path: ClassPath, units: int) -> None:
    groups[path] -= units
    if groups[path] == 0:
        del groups[path]


def _put(groups: dict[ClassPath, int], path: ClassPath, units: int) -> None:
    groups[path] = groups.get(path, 0) + units


# ---- exact: path enumeration + CP-SAT bisection on the cost cap --------------------------------


def enumerate_paths(graph: ClassGraph, cap_s: float, limit: int) -> list[tuple[float, ClassPath]] | None:
    """All class paths of cost <= cap_s (sorted by cost), or None if there are more than `limit`."""
    s = graph.stages
    bwd = [np.zeros(0)] * s  # bwd[k][d, j]: cheapest completion from class j of stage k to DH d
    bwd[s - 1] = graph.cost[s - 1].T.copy()
    for k in range(s - 2, 0, -1):
        bwd[k] = (graph.cost[k][None, :, :] + bwd[k + 1][:, None, :]).min(axis=2)
    out: list[tuple[float, ClassPath]] = []
    tol = cap_s + 1e-9 * max(1.0, cap_s)

    def walk(d: int, path: list[int], cost: float) -> bool:
        k = len(path)
        if k == s:
            out.append((cost + float(graph.cost[s - 1][path[-1], d]), tuple(path)))
            return len(out) <= limit
        step = graph.cost[k - 1][path[-1]]
        for j in np.flatnonzero(cost + step + bwd[k][d] <= tol):
            if not walk(d, [*path, int(j)], cost + float(step[j])):
                return False
        return True

    for d in range(len(graph.members[0])):
        if not walk(d, [d], 0.0):
            return None
    out.sort()
    return out


class _PathLP:
    """LP relaxation (GLOP) of the path packing, built once; `carries(n)` uses the n cheapest paths.

    False from `carries` proves that no integer routing on those paths carries `flow`.
    """

    def __init__(self, graph: ClassGraph, paths: list[tuple[float, ClassPath]], flow: int) -> None:
        self.flow = flow
        self.solver = pywraplp.Solver.CreateSolver("GLOP")
        self.ys = [self.solver.NumVar(0.0, float(flow), f"y{i}") for i in range(len(paths))]
        rows: dict[tuple[int, int], pywraplp.Constraint] = {}
        objective = self.solver.Objective()
        for y, (_, path) in zip(self.ys, paths):
            objective.SetCoefficient(y, 1.0)
            for k, c in enumerate(path):
                if (k, c) not in rows:
                    rows[(k, c)] = self.solver.Constraint(0.0, float(graph.capacity[k][c]))
                rows[(k, c)].SetCoefficient(y, 1.0)
        objective.SetMaximization()

    def carries(self, count: int) -> bool | None:
        """False: provably infeasible; True: an integral LP vertex carries the flow; None: unknown."""
        for i, y in enumerate(self.ys):
            y.SetUb(float(self.flow) if i < count else 0.0)
        if self.solver.Solve() != pywraplp.Solver.OPTIMAL:
            return None
        if self.solver.Objective().Value() < self.flow - 1e-6:
            return False
        values = [y.solution_value() for y in self.ys[:count]]
        integral = all(abs(v - round(v)) <= 1e-9 for v in values)
        return True if integral and sum(round(v) for v in values) >= self.flow else None


def _cpsat(graph: ClassGraph, paths: list[tuple[float, ClassPath]], flow: int,
           minimise_sum: bool, time_limit_s: float) -> dict[ClassPath, int] | None:
    """Integer multiplicities on `paths` carrying `flow` within class capacities (None: infeasible)."""
    model = cp_model.CpModel()
    use: dict[tuple[int, int], list[cp_model.IntVar]] = {}
    ys = []
    for i, (_, path) in enumerate(paths):
        ub = min(int(graph.capacity[k][c]) for k, c in enumerate(path))
        y = model.new_int_var(0, min(ub, flow), f"y{i}")
        ys.append(y)
        for k, c in enumerate(path):
            use.setdefault((k, c), []).append(y)
    for (k, c), vs in use.items():
        model.add(sum(vs) <= int(graph.capacity[k][c]))
    model.add(sum(ys) == flow)
    if minimise_sum:
        model.minimize(sum(round(cost * _COST_SCALE) * y for (cost, _), y in zip(paths, ys)))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1  # deterministic
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.solve(model)
    if status == cp_model.INFEASIBLE:
        return None
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise TimeoutError("CP-SAT gave no answer within the time limit")
    return {p: int(solver.value(y)) for (_, p), y in zip(paths, ys) if solver.value(y) > 0}


def exact_groups(graph: ClassGraph, flow: int, paths: list[tuple[float, ClassPath]], lo_s: float,
                 time_limit_s: float) -> dict[ClassPath, int]:
    """Least cap (bisection over the sorted path costs >= lo_s) that carries `flow`; min sum under it."""
    costs = sorted({c for c, _ in paths})
    lo = max(0, int(np.searchsorted(costs, lo_s - 1e-9 * max(1.0, lo_s))) - 1)
    hi = len(costs) - 1  # feasible: the heuristic's routes are among the paths
    lp = _PathLP(graph, paths, flow)
    while lo < hi:
        mid = (lo + hi) // 2
        within = [p for p in paths if p[0] <= costs[mid]]
        verdict = lp.carries(len(within))
        if verdict is None:
            verdict = _cpsat(graph, within, flow, False, time_limit_s) is not None
        if not verdict:
            lo = mid + 1
        else:
            hi = mid
    best = _cpsat(graph, [p for p in paths if p[0] <= costs[lo]], flow, True, time_limit_s)
    if best is None:
        raise RuntimeError("exact optimum: the final cap became infeasible")
    return best


# ---- the entry point ------------------------------------------------------------------------------


def _best_heuristic(graph: ClassGraph, flow: int, max_improve_steps: int) -> dict[ClassPath, int]:
    """Cheapest-first and hardest-first starts, each locally improved; the lower (max, sum) wins."""
    best: tuple[tuple[float, float], dict[ClassPath, int]] | None = None
    for start in (greedy_groups, hardest_first_groups):
        groups = start(graph, flow)
        improve_groups(graph, groups, max_steps=max_improve_steps)
        costs = [(graph.path_cost(p), n) for p, n in groups.items()]
        score = (max(c for c, _ in costs), sum(c * n for c, n in costs))
        if best is None or score < best[0]:
            best = (score, groups)
    assert best is not None
    return best[1]


def optimum(instance: Instance, exact: bool | None = None, time_limit_s: float = 30.0,
            max_improve_steps: int = 5000) -> OptimumResult:
    """Max flow, then min max route cost, then min sum; exact when small (or `exact=True`).

    `exact=None` picks exact for <= EXACT_MAX_NODES nodes when at most EXACT_PATH_LIMIT class
    paths are no dearer than the heuristic's max. `time_limit_s` bounds each CP-SAT solve (wall
    clock); in the automatic choice a solve that gives no answer in time leaves the heuristic's
    result (method "heuristic"), with `exact=True` it raises TimeoutError.
    """
    graph = class_graph(instance)
    if any(not np.isfinite(c).all() for c in graph.cost):
        return _sparse_optimum(instance, graph, time_limit_s)
    flow = _max_flow(graph)
    if flow == 0:
        return OptimumResult([], RouteStats(0, 0.0, 0.0), 0.0, "empty")
    groups = _best_heuristic(graph, flow, max_improve_steps)
    bound = lower_bound(graph, flow)
    method = "heuristic"
    want_exact = exact if exact is not None else len(instance.nodes) <= EXACT_MAX_NODES
    upper = max(graph.path_cost(p) for p in groups)
    if want_exact:
        paths = enumerate_paths(graph, upper, EXACT_PATH_LIMIT if exact is None else 1 << 62)
        if paths is not None:
            try:
                groups = exact_groups(graph, flow, paths, bound, time_limit_s)
                method = "exact-cpsat"
            except TimeoutError:
                if exact:  # asked for exactly: no silent downgrade
                    raise
    routes = split_to_routes(instance, graph, groups)
    stats = evaluate_routes(instance, routes)
    lb = stats.max_route_cost_s if method == "exact-cpsat" else min(bound, stats.max_route_cost_s)
    return OptimumResult(routes, stats, lb, method)


# ---- instances with missing links (instance files' `links`) ------------------------------------


def _sparse_optimum(instance: Instance, graph: ClassGraph, time_limit_s: float) -> OptimumResult:
    """Exact optimum when some pairs have no link (d = inf). A route must come back to its own
    data holder over links that exist, so the single-commodity max flow no longer holds: every
    finite class path is enumerated, CP-SAT finds the max flow on them, then `exact_groups`.

    Raises:
        UserError: more than SPARSE_PATH_LIMIT finite class paths, or CP-SAT out of time.
    """
    paths = enumerate_paths(graph, _FINITE_CAP_S, SPARSE_PATH_LIMIT)
    if paths is None:
        raise UserError(f"instance with missing links has more than {SPARSE_PATH_LIMIT} possible routes: "
                        "too large for the exact optimum (list fewer links, or give a region network)")
    flow = _max_flow_paths(graph, paths, time_limit_s)
    if flow == 0:
        return OptimumResult([], RouteStats(0, 0.0, 0.0), 0.0, "empty")
    try:
        groups = exact_groups(graph, flow, paths, lower_bound(graph, flow), time_limit_s)
    except TimeoutError:
        raise UserError(f"the optimum of this instance did not finish within {time_limit_s:g} s") from None
    routes = split_to_routes(instance, graph, groups)
    stats = evaluate_routes(instance, routes)
    return OptimumResult(routes, stats, stats.max_route_cost_s, "exact-cpsat")


def _max_flow_paths(graph: ClassGraph, paths: list[tuple[float, ClassPath]], time_limit_s: float) -> int:
    """Most routes the finite class paths carry within class capacities (CP-SAT, exact)."""
    if not paths:
        return 0
    model = cp_model.CpModel()
    use: dict[tuple[int, int], list[cp_model.IntVar]] = {}
    ys = []
    for i, (_, path) in enumerate(paths):
        y = model.new_int_var(0, min(int(graph.capacity[k][c]) for k, c in enumerate(path)), f"y{i}")
        ys.append(y)
        for k, c in enumerate(path):
            use.setdefault((k, c), []).append(y)
    for (k, c), vs in use.items():
        model.add(sum(vs) <= int(graph.capacity[k][c]))
    model.maximize(sum(ys))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1  # deterministic
    solver.parameters.max_time_in_seconds = time_limit_s
    if solver.solve(model) != cp_model.OPTIMAL:
        raise UserError(f"the max flow of this instance did not finish within {time_limit_s:g} s")
    return int(round(solver.objective_value))

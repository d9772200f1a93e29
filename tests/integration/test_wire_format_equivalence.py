"""A swarm with bf16 activations and gradients on the wire trains like `gwtf train --local` with
`train.local_rounding` (the same rounding at every stage boundary).

Tolerance: per-iteration loss within rtol 1e-5 of the rounded local run (6 iterations, 2 data
holders, 2 relay replicas). Beyond the fp32 test's float32 summation order, a last-bit weight
difference can flip the bf16 rounding of a boundary value (a 2^-8 relative step on that one
value), so the difference grows a little per step: measured 0 (iteration 0, bit-identical),
5e-8, 4e-7, 8e-7, 2e-6, 3.1e-6. The control: the same swarm is 5.5e-5 from the exact
(unrounded) local run, beyond the bound, so the comparison can fail.
fp32 stays exact: tests/integration/test_swarm_equivalence.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from test_swarm_equivalence import _reference_losses

from gwtf.runtime.swarm import Swarm

BF16 = ("model.stages=2", "train.iterations=6", 'wire.activations="bf16"', 'wire.gradients="bf16"')
RTOL = 1e-5


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_bf16_swarm_matches_local_trainer_with_the_same_rounding(
    make_swarm: Callable[..., Swarm], finish: Callable[..., dict[str, int]], tmp_path: Path
) -> None:
    iterations = 6
    swarm = make_swarm(BF16)
    swarm.start()
    totals = finish(swarm, iterations, 100)
    swarm.close()
    assert totals["expected"] == 4 * iterations * swarm.cfg.model.stages
    got = np.array([r["loss"] for r in swarm.metrics.rows[:iterations]])
    rounded = np.array(_reference_losses((*BF16, "train.local_rounding=true"), tmp_path / "rounded"))
    exact = np.array(_reference_losses(BF16, tmp_path / "exact"))
    rel = np.abs(got - rounded) / np.abs(rounded)
    print(f"bf16 swarm vs rounded local: rel {np.array2string(rel, precision=2)}; "
          f"vs exact local: max rel {(np.abs(got - exact) / np.abs(exact)).max():.2e}")
    np.testing.assert_allclose(got, rounded, rtol=RTOL, atol=0)
    assert not np.allclose(got, exact, rtol=RTOL, atol=0)  # the rounding is really on the wire

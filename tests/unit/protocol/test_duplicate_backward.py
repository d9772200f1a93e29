"""A second gradient for a data holder's microbatch whose embedding backward is still running is
not back-propagated again.

Found by the integration loop (test_join_124m, run 3 at 582beec): a 124m relay was slow while it
exported its state, the leader's collect found the data holder's microbatch incomplete and sent
an aggregation redo; the redo's gradient and the original one both reached the data holder, which
ran `embed_backward` twice. The first consumed the saved graph, the second raised KeyError and the
data holder stopped (a relay already refuses a second backward of a leg in phase "bwd")."""

from __future__ import annotations

from dataclasses import replace

from core_harness import TRAIN, Harness, peers

from gwtf.protocol import messages as m
from gwtf.protocol.kinds import ComputeKind


def test_a_second_backward_during_the_embedding_backward_runs_no_second_job() -> None:
    h = Harness(peers((1, 1, 1)), replace(TRAIN, microbatches=1, iterations=1))
    held: list[tuple[str, m.Backward]] = []

    def hold(src: str, dst: str, msg: object) -> bool:  # keep the gradients for d0 to replay
        if dst == "d0" and isinstance(msg, m.Backward):
            held.append((src, msg))
            return True
        return False

    h.drop = hold
    h.start()
    h.run(30.0, stop=lambda: bool(held))
    assert held, "no gradient reached the data holder"
    src, msg = held[0]
    d0 = h.cores["d0"]
    first = d0.on_message(src, msg, h.now)
    second = d0.on_message(src, msg, h.now)  # e.g. an aggregation redo's gradient, before the job is done
    jobs = [e for e in first + second if isinstance(e, m.Compute) and e.kind == ComputeKind.EMBED_BACKWARD]
    assert len(jobs) == 1, jobs
    assert [e.msg for e in second if isinstance(e, m.Send)] == [m.BackAck(mb=msg.mb)]  # acked, not recomputed

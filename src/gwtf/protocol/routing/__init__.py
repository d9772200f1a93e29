"""gwtf's decentralized flow routing agent (PAPER.md 3.3): `FlowAgent` and its parts.

Modules: `state` (what a node's agent knows: neighbours, flows, costs), `reserve` (phase A and
repairs), `anneal` (phase B), `moves` (the annealing moves as strategies), `messages` (the
"flow.*" wire vocabulary), `agent` (the `Router` the training protocol calls).
"""

from gwtf.protocol.routing.agent import FlowAgent
from gwtf.protocol.routing.state import FlowEntry, FlowKey, FlowState

__all__ = ["FlowAgent", "FlowEntry", "FlowKey", "FlowState"]

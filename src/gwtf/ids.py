"""The vocabulary every layer shares: a node's id.

Owns `NodeId`. A leaf: imports nothing of gwtf, so the cost model (`flow`) and the protocol core
(`protocol`) both name nodes without importing each other (`protocol` uses `flow`'s cost
function; `flow` used to import `protocol.base` for this alias alone: a package cycle).
"""

from __future__ import annotations

NodeId = str
"""A node's id: unique in the swarm, stable for the node's life (a rejoin gets a new id).

On the wire it is `NAME~FINGERPRINT/REGION@HOST:PORT` (`gwtf.runtime.keys`); the simulator uses
plain names."""

"""A node process's wire codec knows every message type of every system from its start.

`StageMove` used to register only when the gwtf rebalancing core was first built, after the
transport had copied the registry: a node refused the leader's move as "unknown type 'mem.move'".
Run in a fresh interpreter, so what pytest already imported cannot hide a lazy registration.
"""

from __future__ import annotations

import subprocess
import sys

PROBE = r"""
import importlib, pkgutil
import gwtf.runtime.node  # what `gwtf node` imports before it opens its transport
import gwtf.protocol
from gwtf.protocol.base import MESSAGE_TYPES
before = set(MESSAGE_TYPES)
for m in pkgutil.iter_modules(gwtf.protocol.__path__):
    importlib.import_module(f"gwtf.protocol.{m.name}")
late = sorted(set(MESSAGE_TYPES) - before)
print("LATE", late)
"""


def test_every_protocol_message_is_registered_before_the_transport_starts() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "LATE []" in out.stdout, out.stdout

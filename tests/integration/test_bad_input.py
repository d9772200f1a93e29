"""Bad input over a real socket: a live node logs the reason, drops that peer, and keeps serving.

One node process (a data holder, the swarm's bootstrap and leader) with a known swarm secret.
The test connects with (1) garbage bytes, (2) a plaintext frame (no handshake) and (3) the wrong
swarm secret; each must produce a log line naming the reason. Then a peer with
the right secret asks to join and must get the leader's Welcome: the node still serves.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from gwtf.config import RuntimeConfig
from gwtf.protocol.base import Message, NodeId
from gwtf.protocol.messages import JoinRequest, Welcome
from gwtf.runtime.codec import MAGIC, PREFIX
from gwtf.runtime.launcher import NodePlan, NodeProcess, ProcessGroup
from gwtf.runtime.status import STDOUT_FILE

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "swarm-test.toml")
SECRET = "integration-test-secret"


def _wait_for_log(proc: NodeProcess, text: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (proc.dir / STDOUT_FILE).read_text(errors="replace"):
        assert proc.alive(), f"node died:\n{proc.log_tail()}"
        assert time.monotonic() < deadline, f"no log line {text!r}:\n{proc.log_tail()}"
        time.sleep(0.02)  # polling period of a bounded wait


def _raw_send(addr: str, data: bytes) -> None:
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(data)
        sock.settimeout(5)
        try:
            while sock.recv(65536):  # read the node's hello until it hangs up on us
                pass
        except (ConnectionResetError, TimeoutError):
            pass


async def _join_as_peer(addr: str, secret: bytes) -> Message:
    from gwtf.runtime.transport import Transport

    got: asyncio.Queue[Message] = asyncio.Queue()

    def on_frame(sender: NodeId, msg: Message, tensors: list[object]) -> None:
        got.put_nowait(msg)

    t = Transport.with_new_key("probe", secret, on_frame, RuntimeConfig(connect_timeout_s=5.0))
    bound = await t.start("127.0.0.1", 0)
    me = f"{t.node_id}/local@{bound}"
    t.node_id = me
    try:
        await t.send(addr, JoinRequest(peer=(me, -1, "local", 1.0, 1, 0, -1)), timeout_s=10)
        async with asyncio.timeout(20):
            while True:
                msg = await got.get()
                if isinstance(msg, Welcome):
                    return msg
    finally:
        await t.close()


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_garbage_unknown_type_and_wrong_secret_are_refused_and_node_keeps_serving(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path, CONFIG, extra_env={"GWTF_SWARM_SECRET": SECRET}) as group:
        node = group.spawn(NodePlan(name="dh0", role="data-holder", stage="0", shard=0))
        group.wait_ready([node], timeout_s=60)
        _raw_send(node.addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4)
        _wait_for_log(node, "bad handshake: bad magic")
        header = b"\x81\xa1t\xa7no.such"  # msgpack {"t": "no.such"}: a plaintext frame of wire 1
        _raw_send(node.addr, PREFIX.pack(MAGIC, 1, 0, len(header), 0) + header)
        _wait_for_log(node, "bad handshake: unsupported wire version 1")
        with pytest.raises(Exception, match="refused|closed|lost|failed"):
            asyncio.run(_join_as_peer(node.addr, b"not-the-secret"))
        _wait_for_log(node, "bad swarm secret")
        welcome = asyncio.run(_join_as_peer(node.addr, SECRET.encode()))
        assert isinstance(welcome, Welcome) and node.node_id in {m[0] for m in welcome.members}
        assert node.alive()

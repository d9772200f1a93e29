"""Swarm secret loading and the HMAC handshake that every connection starts with.

Owns: where the swarm secret comes from (`--secret-file`, else $GWTF_SWARM_SECRET, else a
public dev secret with a warning), the two handshake messages (`Hello`, `Proof`; they live in
their own registry `HANDSHAKE_TYPES`, so no protocol message is even decoded before a peer is
authenticated), and the MAC computation. The transport drives the exchange (docs/wire.md):

    client -> server  Hello(client id, client nonce)     server -> client  Hello(server id, nonce)
    client -> server  Proof(mac("client", ...))          server verifies, then
    server -> client  Proof(mac("server", ...))          client verifies; both are authenticated

mac(role) = HMAC-SHA256(secret, msgpack([label, role, client nonce, server nonce, client id,
server id])). The role makes a proof useless in the other direction; fresh nonces make it useless
on any other connection. Must not import asyncio or socket.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgpack

from gwtf.errors import UserError
from gwtf.protocol.base import Message

log = logging.getLogger(__name__)

SECRET_ENV = "GWTF_SWARM_SECRET"
DEV_SECRET = b"gwtf-dev-secret-do-not-use-in-public-swarms"
"""Used when neither a secret file nor the env var is given: fine on a laptop, open to anyone
who reads this source on a real network."""

NONCE_BYTES = 16
MAC_BYTES = 32
MAX_NODE_ID_CHARS = 256
_LABEL = b"gwtf-handshake-v1"

Role = Literal["client", "server"]


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First frame on every connection, both directions."""

    TYPE = "HELLO"
    node_id: str
    nonce: bytes

    def validate(self) -> None:
        if not 0 < len(self.node_id) <= MAX_NODE_ID_CHARS:
            raise ValueError("bad node id length")
        if len(self.nonce) != NONCE_BYTES:
            raise ValueError("bad nonce length")


@dataclass(frozen=True, slots=True)
class Proof(Message):
    """Second frame: proves knowledge of the swarm secret for this connection's nonces."""

    TYPE = "PROOF"
    mac: bytes

    def validate(self) -> None:
        if len(self.mac) != MAC_BYTES:
            raise ValueError("bad mac length")


HANDSHAKE_TYPES: Mapping[str, type[Message]] = {"HELLO": Hello, "PROOF": Proof}


def load_secret(secret_file: str | None = None, environ: Mapping[str, str] | None = None) -> bytes:
    """The swarm secret: the file's bytes (surrounding whitespace stripped), else $GWTF_SWARM_SECRET,
    else `DEV_SECRET` with a warning.

    Raises:
        UserError: the file is missing, unreadable or empty, or the env var is set but empty.
    """
    env = os.environ if environ is None else environ
    if secret_file:
        path = Path(secret_file)
        try:
            secret = path.read_bytes().strip()
        except OSError as exc:
            raise UserError(f"cannot read swarm secret file {path}: {exc.strerror}") from None
        if not secret:
            raise UserError(f"swarm secret file {path} is empty")
        return secret
    if SECRET_ENV in env:
        value = env[SECRET_ENV].strip()
        if not value:
            raise UserError(f"${SECRET_ENV} is set but empty")
        return value.encode()
    log.warning("no swarm secret given (--secret-file or $%s): using the public dev secret", SECRET_ENV)
    return DEV_SECRET


def new_nonce() -> bytes:
    """A fresh random nonce from the OS CSPRNG (never a seeded RNG: replay protection)."""
    return secrets.token_bytes(NONCE_BYTES)


def handshake_mac(secret: bytes, role: Role, client: Hello, server: Hello) -> bytes:
    """HMAC-SHA256 proof that the `role` side knows `secret`, bound to both hellos."""
    data = msgpack.packb([_LABEL, role, client.nonce, server.nonce, client.node_id, server.node_id])
    return hmac.new(secret, data, hashlib.sha256).digest()


def verify_mac(secret: bytes, role: Role, client: Hello, server: Hello, mac: bytes) -> bool:
    """Constant-time check of a peer's proof."""
    return hmac.compare_digest(handshake_mac(secret, role, client, server), mac)

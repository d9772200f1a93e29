"""Swarm secrets and node key pairs: where they come from, how strong they must be, what ids they make.

Owns: loading the swarm secret (`--secret-file PATH`, else $GWTF_SWARM_SECRET, else the public
development secret, accepted only when every address involved is loopback), its minimum strength
(128 bits), the Noise pre-shared key derived from it, `gwtf secret new`'s file format, each node's
static X25519 key pair (a file in its node folder or `--key-file`, mode 0600), and the key
fingerprint every node id embeds, so an id cannot be claimed without its private key
(docs/security.md). The transport's handshake checks the fingerprint against the peer's
authenticated static key. Must not import asyncio or socket.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from gwtf.errors import UserError

SECRET_ENV = "GWTF_SWARM_SECRET"
DEV_SECRET = b"gwtf-dev-secret-do-not-use-in-public-swarms"
"""Used when no secret is given and every address is loopback: anyone who reads this source knows it."""

MIN_SECRET_BITS = 128
NEW_SECRET_BYTES = 32  # `gwtf secret new`: 256 bits, written as 64 hex digits
KEY_BYTES = 32  # X25519 private and public keys
KEY_FILE = "node.key"  # in the node's folder, next to records.jsonl
FINGERPRINT_CHARS = 16  # base32 characters of sha256(public key): 80 bits
ID_KEY_SEP = "~"  # node id = NAME~FINGERPRINT/REGION@HOST:PORT; '~' is not allowed in names
_PSK_LABEL = b"gwtf-noise-psk-v1"
_HEX = re.compile(r"[0-9a-fA-F]+")
_FINGERPRINT = re.compile(rf"[a-z2-7]{{{FINGERPRINT_CHARS}}}")  # lowercase base32


def secret_bits(secret: bytes) -> int:
    """Strength credited to a secret: 4 bits per hex digit for hex text, else 6 bits per byte
    (as if base64; a passphrase gets no more credit than random base64 of its length)."""
    text = secret.decode("ascii", errors="replace")
    return 4 * len(text) if _HEX.fullmatch(text) else 6 * len(secret)


def is_loopback(host: str) -> bool:
    """True for "localhost" and loopback IPs (127.0.0.0/8, ::1); "" and names are not loopback."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_secret(
    secret_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    hosts: Iterable[str] = ("127.0.0.1",),
) -> bytes:
    """The swarm secret: the file's bytes (surrounding whitespace stripped), else
    $GWTF_SWARM_SECRET, else `DEV_SECRET` when every host in `hosts` (listen and join
    addresses) is loopback.

    Raises:
        UserError: the file is missing, unreadable or empty; the env var is set but empty; the
            secret is below `MIN_SECRET_BITS`; or no secret is given for a non-loopback address.
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
        where = f"swarm secret file {path}"
    elif SECRET_ENV in env:
        secret = env[SECRET_ENV].strip().encode()
        if not secret:
            raise UserError(f"${SECRET_ENV} is set but empty")
        where = f"${SECRET_ENV}"
    else:
        public = [h for h in hosts if not is_loopback(h)]
        if public:
            raise UserError(f"no swarm secret for non-loopback address {public[0]}: create one with "
                            f"`gwtf secret new swarm.secret` and pass --secret-file swarm.secret")
        return DEV_SECRET
    if secret_bits(secret) < MIN_SECRET_BITS:
        raise UserError(f"{where} is too weak ({secret_bits(secret)} bits, need {MIN_SECRET_BITS}): "
                        "create one with `gwtf secret new PATH`")
    return secret


def write_new_secret(path: Path) -> None:
    """Write a fresh 256-bit secret (hex) to `path`, mode 0600; refuses to overwrite.

    Raises:
        UserError: `path` exists or cannot be written.
    """
    data = (secrets.token_hex(NEW_SECRET_BYTES) + "\n").encode()
    _write_private(path, data, what="secret file")


def psk_of(secret: bytes) -> bytes:
    """The 32-byte Noise pre-shared key of a swarm secret (secrets of any length map to one key)."""
    return hashlib.sha256(_PSK_LABEL + secret).digest()


def public_of(private: bytes) -> bytes:
    """The X25519 public key of a 32-byte private key."""
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()


def new_private_key() -> bytes:
    return X25519PrivateKey.generate().private_bytes_raw()


def fingerprint(public: bytes) -> str:
    """The key fingerprint node ids embed: 16 lowercase base32 characters of sha256(public key)."""
    digest = hashlib.sha256(public).digest()
    return base64.b32encode(digest).decode()[:FINGERPRINT_CHARS].lower()


def id_fingerprint(node_id: str) -> str | None:
    """The fingerprint embedded in a node id (`NAME~FP/REGION@ADDR`), or None if it has none."""
    head = node_id.partition("/")[0]
    name, sep, fp = head.rpartition(ID_KEY_SEP)
    return fp if sep and name and _FINGERPRINT.fullmatch(fp) else None


def load_or_create_key(path: Path) -> bytes:
    """The node's static private key from `path` (hex), created (mode 0600) if missing.

    Raises:
        UserError: the file exists but is unreadable, malformed, or readable by others.
    """
    if not path.exists():
        _write_private(path, (new_private_key().hex() + "\n").encode(), what="key file")
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise UserError(f"cannot read key file {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise UserError(f"key file {path} is readable by other users: chmod 600 {path}")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise UserError(f"key file {path} is not a {KEY_BYTES}-byte hex key")
    return key


def _write_private(path: Path, data: bytes, what: str) -> None:
    """Create `path` (mode 0600, never replacing a file) holding `data`, fsynced; a failed write
    leaves no partial file behind."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write {what} {path}: {path.parent}: {exc.strerror}") from None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise UserError(f"{what} {path} already exists: not overwriting it") from None
    except OSError as exc:
        raise UserError(f"cannot write {what} {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise UserError(f"cannot write {what} {path}: {exc.strerror}") from None

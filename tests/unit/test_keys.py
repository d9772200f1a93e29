"""Swarm secrets and node keys (`gwtf.runtime.keys`): the 128-bit minimum, the development secret on
loopback only, secret and key files (mode 0600, never overwritten, refused when others can read
them), and the key fingerprints node ids embed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gwtf.errors import UserError
from gwtf.runtime import keys

NO_ENV: dict[str, str] = {}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(
    ("secret", "ok"),
    [
        ("a" * 32, True),  # 32 hex digits = 128 bits
        ("a" * 31, False),  # 124 bits
        ("Zm9vYmFyYmF6cXV4cXV1eA", True),  # 22 base64-ish characters = 132 bits
        ("Zm9vYmFyYmF6cXV4cXV1e", False),  # 21 = 126 bits
        ("integration-test-secret", True),  # 23 characters = 138 bits
        ("x", False),
    ],
)
def test_a_secret_under_128_bits_is_refused_from_file_and_env(tmp_path: Path, secret: str, ok: bool) -> None:
    f = tmp_path / "s"
    f.write_text(f"  {secret}\n")  # surrounding whitespace is not part of the secret
    for kwargs in ({"secret_file": str(f), "environ": NO_ENV}, {"environ": {keys.SECRET_ENV: secret}}):
        if ok:
            assert keys.load_secret(**kwargs, hosts=["10.0.0.1"]) == secret.encode()  # type: ignore[arg-type]
        else:
            with pytest.raises(UserError, match=r"too weak \(\d+ bits, need 128\)"):
                keys.load_secret(**kwargs)  # type: ignore[arg-type]


def test_secret_sources_file_then_env_then_dev(tmp_path: Path) -> None:
    f, env = tmp_path / "s", {keys.SECRET_ENV: "e" * 40}
    f.write_text("f" * 32)
    assert keys.load_secret(str(f), environ=env) == b"f" * 32  # the file wins
    assert keys.load_secret(None, environ=env) == b"e" * 40
    assert keys.load_secret("", environ=env) == b"e" * 40  # runtime.secret_file = "" means unset
    assert keys.load_secret(None, environ=NO_ENV) == keys.DEV_SECRET
    with pytest.raises(UserError, match="is set but empty"):
        keys.load_secret(None, environ={keys.SECRET_ENV: "  "})


def test_missing_empty_or_unreadable_secret_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot read swarm secret file .*missing: No such file"):
        keys.load_secret(str(tmp_path / "missing"), environ=NO_ENV)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UserError, match="empty"):
        keys.load_secret(str(tmp_path / "empty"), environ=NO_ENV)
    with pytest.raises(UserError, match="Is a directory"):
        keys.load_secret(str(tmp_path), environ=NO_ENV)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LocalHost"])
def test_dev_secret_is_accepted_on_loopback(host: str) -> None:
    assert keys.is_loopback(host)
    assert keys.load_secret(None, environ=NO_ENV, hosts=["127.0.0.1", host]) == keys.DEV_SECRET


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.1", "192.168.1.2", "example.org", "localhost.evil", ""])
def test_dev_secret_is_refused_on_any_other_address(host: str) -> None:
    assert not keys.is_loopback(host)
    with pytest.raises(UserError, match=f"no swarm secret for non-loopback address {host}: .*gwtf secret new"):
        keys.load_secret(None, environ=NO_ENV, hosts=["127.0.0.1", host])
    assert keys.load_secret(None, environ={keys.SECRET_ENV: "k" * 22}, hosts=[host]) == b"k" * 22


def test_new_secret_is_256_bits_mode_0600_and_never_overwritten(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # the file must be private even when the umask would allow more
    try:
        a, b = tmp_path / "sub" / "a.secret", tmp_path / "b.secret"
        keys.write_new_secret(a)
        keys.write_new_secret(b)
    finally:
        os.umask(old_umask)
    text = a.read_text()
    assert _mode(a) == 0o600 and text.endswith("\n") and len(text.strip()) == 64
    int(text, 16)  # hex
    assert keys.secret_bits(keys.load_secret(str(a), environ=NO_ENV, hosts=["10.0.0.1"])) == 256
    assert a.read_text() != b.read_text()
    with pytest.raises(UserError, match="already exists: not overwriting it"):
        keys.write_new_secret(a)
    assert a.read_text() == text


def test_new_secret_in_an_impossible_place_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="cannot write secret file"):
        keys.write_new_secret(tmp_path / "file" / "s")


def test_key_file_is_created_private_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "n" / keys.KEY_FILE
    key = keys.load_or_create_key(path)
    assert len(key) == keys.KEY_BYTES and _mode(path) == 0o600
    assert keys.load_or_create_key(path) == key
    assert keys.load_or_create_key(tmp_path / "other.key") != key


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o666])
def test_key_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / keys.KEY_FILE
    keys.load_or_create_key(path)
    path.chmod(mode)
    with pytest.raises(UserError, match=f"key file {path} is readable by other users: chmod 600"):
        keys.load_or_create_key(path)


@pytest.mark.parametrize("text", ["zz", "ab" * 31, "ab" * 33, ""])
def test_malformed_key_file_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / keys.KEY_FILE
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(UserError, match="is not a 32-byte hex key"):
        keys.load_or_create_key(path)


def test_public_key_and_fingerprint_are_stable() -> None:
    # RFC 7748, section 6.1: Alice's X25519 key pair
    private = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
    public = keys.public_of(private)
    assert public.hex() == "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a"
    # every node id embeds this: a change here changes the id of every existing node key
    assert keys.fingerprint(public) == "gagjzfqdxevewopn"
    others = {keys.fingerprint(keys.public_of(keys.new_private_key())) for _ in range(20)}
    assert len(others) == 20 and keys.fingerprint(public) not in others


def test_id_fingerprint_parses_only_well_formed_ids() -> None:
    fp = keys.fingerprint(keys.public_of(keys.new_private_key()))
    assert keys.id_fingerprint(f"dh0~{fp}/local@10.0.0.1:7000") == fp
    assert keys.id_fingerprint(f"r1a~{fp}/eu@[::1]:7000") == fp
    assert keys.id_fingerprint(fp) is None
    for bad in ("dh0/local@10.0.0.1:7000", f"~{fp}/local@h:1", f"dh0~{fp[:-1]}/local@h:1",
                f"dh0~{fp}x/local@h:1", f"dh0~{fp.upper()}/local@h:1", f"dh0/local@h~{fp}:1",
                "dh0~0189abcdefghijkl/local@h:1"):
        assert keys.id_fingerprint(bad) is None, bad


def test_psk_is_32_bytes_and_depends_on_the_secret() -> None:
    assert len(keys.psk_of(b"a" * 32)) == 32
    assert keys.psk_of(b"a" * 32) == keys.psk_of(b"a" * 32) != keys.psk_of(b"a" * 31 + b"b")

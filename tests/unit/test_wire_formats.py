"""Wire formats of activations/gradients (gwtf.model.wire): error bounds, exact sizes, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gwtf.model.wire import FORMATS, WireFormatError, decode, encode, format_of, roundtrip, wire_bytes
from gwtf.protocol.messages import Forward
from gwtf.runtime.codec import Decoder, encode_bytes


def _values(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp(rng.uniform(-8, 8, n))).astype(np.float32)


def test_fp32_is_exact() -> None:
    x = _values(1000).reshape(10, 100)
    assert np.array_equal(roundtrip(x, "fp32"), x)


def test_bf16_relative_error_and_torch_rounding() -> None:
    x = _values(20_000)
    y = roundtrip(x, "bf16")
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-8)
    ours = encode(x, "bf16")[0].view(np.uint16)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)  # round to nearest even, as torch does
    assert np.isnan(roundtrip(np.array([np.nan], np.float32), "bf16")).all()


def test_fp16_relative_error_in_its_normal_range() -> None:
    x = np.clip(_values(20_000), -6e4, 6e4)
    x = x[np.abs(x) > 2.0**-14]  # fp16 normals
    y = roundtrip(x, "fp16")
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-11)


@pytest.mark.parametrize("block", [1, 7, 64, 4096])
def test_int8_absolute_error_is_at_most_half_a_scale(block: int) -> None:
    x = _values(10_001, seed=block)
    codes, scales = encode(x, "int8", block)
    assert codes.dtype == np.int8 and codes.shape == x.shape
    assert scales.shape == (-(-x.size // block),)
    y = decode([codes, scales], block)
    per_value_scale = np.repeat(scales, block)[: x.size]
    assert np.all(np.abs(y - x) <= per_value_scale * 0.5 * (1 + 1e-5) + 1e-30)
    assert np.max(np.abs(codes)) == 127  # every block's absmax maps to +-127


def test_int8_zero_block_decodes_to_zero() -> None:
    x = np.zeros(100, np.float32)
    x[50:] = 1.0
    y = roundtrip(x, "int8", 50)
    assert np.array_equal(y, x)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("numel", [0, 1, 5, 4096, 4097, 8 * 128 * 64 + 3])
def test_wire_bytes_is_the_codec_body(fmt: str, numel: int) -> None:
    arrays = encode(np.ones(numel, np.float32), fmt, 4096)
    frame = encode_bytes(Forward(mb=("a", 0, 0), flow_id=0, path=(), legs=(), key=("act", "a", 0, 0)), arrays)
    got = Decoder().feed(frame)
    assert len(got) == 1
    header_len = int.from_bytes(frame[6:10], "little")
    body_len = len(frame) - 18 - header_len
    assert body_len == wire_bytes(numel, fmt, 4096)
    assert format_of(got[0].tensors) == fmt
    assert np.array_equal(decode(got[0].tensors, 4096), np.ones(numel, np.float32))


def test_wire_bytes_per_format() -> None:
    n = 8 * 1024 * 768  # a 124m microbatch of 8 x 1024 tokens
    assert wire_bytes(n, "fp32") == 4 * n
    assert wire_bytes(n, "bf16") == wire_bytes(n, "fp16") == 2 * n
    assert wire_bytes(n, "int8", 4096) == n + 4 * (n // 4096)
    with pytest.raises(ValueError):
        wire_bytes(n, "fp8")


def test_refuses_bad_payloads() -> None:
    codes, scales = encode(_values(1000), "int8", 100)
    bad = [
        [np.zeros(4, np.int32)],  # no format is int32
        [np.zeros(4, np.float64)],
        [codes, scales, scales],  # three arrays
        [codes],  # codes without scales
        [codes, scales[:-1]],  # length: 1000 values need 10 scales
        [codes, np.concatenate([scales, scales[:1]])],
        [codes, scales.reshape(2, 5)],
        [codes, np.where(np.arange(10) == 3, np.nan, scales).astype(np.float32)],
        [codes, np.where(np.arange(10) == 3, np.inf, scales).astype(np.float32)],
        [codes, -scales],
        [np.full(1000, -128, np.int8), scales],
    ]
    for arrays in bad:
        with pytest.raises(WireFormatError):
            decode(arrays, 100)
    with pytest.raises(WireFormatError):  # a block size the sender did not use
        decode([codes, scales], 4096)
    assert decode([codes, scales], 100).shape == (1000,)

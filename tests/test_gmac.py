"""AES-256-GMAC through the OpenSSL that CPython links (hetpipe.gmac).

The tags must be those of the standard (NIST's GCM vectors with associated data only),
whatever holds the bytes: split across parts, read-only ZeroMQ frames, a tensor's memory.
"""

from __future__ import annotations

import os

import pytest
import torch
import zmq

from hetpipe import gmac

# NIST CAVP gcmEncryptExtIV256: [Keylen = 256][IVlen = 96][PTlen = 0], AADlen 0 and 128
VECTORS = [
    ("00" * 32, "00" * 12, "", "530f8afbc74536b9a963b4f1c4cb738b"),
    (
        "78dc4e0aaf52d935c3c01eea57428f00ca1fd475f5da86a49c8dd73d68c8e223",
        "d79cf22d504cc793c3fb6c8a",
        "b96baa8c1c75a671bfb2d08d06be5f36",
        "3e5d486aa2e30b22e040b85723a06e76",
    ),
]


@pytest.mark.parametrize(("key", "iv", "aad", "tag"), VECTORS)
def test_tags_are_the_standards(key: str, iv: str, aad: str, tag: str) -> None:
    assert gmac.gmac(bytes.fromhex(key), bytes.fromhex(iv), [bytes.fromhex(aad)]).hex() == tag


def test_parts_and_buffers_of_any_kind_give_the_tag_of_their_bytes() -> None:
    key, iv = os.urandom(32), os.urandom(12)
    data = os.urandom(100_003)
    whole = gmac.gmac(key, iv, [data])
    assert gmac.gmac(key, iv, [data[:7], memoryview(data)[7:4099], data[4099:]]) == whole
    assert gmac.gmac(key, iv, [zmq.Frame(data).buffer]) == whole  # read-only, in place
    t = torch.frombuffer(bytearray(data[:100_000]), dtype=torch.float32)
    assert gmac.gmac(key, iv, [t.numpy()]) == gmac.gmac(key, iv, [data[:100_000]])
    assert gmac.gmac(key, os.urandom(12), [data]) != whole
    flipped = bytearray(data)
    flipped[50_000] ^= 1
    assert gmac.gmac(key, iv, [flipped]) != whole


def test_bad_keys_and_buffers_are_refused() -> None:
    with pytest.raises(ValueError, match="32-byte key and a 12-byte IV"):
        gmac.gmac(b"short", os.urandom(12), [b"x"])
    with pytest.raises(TypeError):
        gmac.gmac(os.urandom(32), os.urandom(12), [12345])

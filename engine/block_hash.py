"""Chain hashes of full KV blocks: what a block holds, whose it is, and everything before it.

A block's hash covers its parent's hash, its token ids and a namespace, so two sequences share
a block only if everything up to its end is the same and they may see each other's cache. The
namespace of a block wholly inside the request's shareable prefix (an operator-shared system
prompt) is `SHARED`; every later block is in the request's own namespace (its user), and a
request without one caches nothing past the shareable prefix.
"""

from __future__ import annotations

import hashlib
from array import array

SHARED = b"\x00shared"


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "little") + data


def extend_hashes(
    hashes: list[bytes],
    token_ids: list[int],
    block_size: int,
    namespace: str | None,
    shareable_prefix: int,
) -> None:
    """Append to `hashes` the chain hash of every further full block of `token_ids` (SHA-256,
    as vLLM does: a collision would hand one user another's KV)."""
    own = None if namespace is None else b"u:" + namespace.encode()
    for i in range(len(hashes), len(token_ids) // block_size):
        end = (i + 1) * block_size
        key = SHARED if end <= shareable_prefix else own
        if key is None:
            return
        h = hashlib.sha256(_field(hashes[i - 1] if i else b""))
        h.update(_field(key))
        h.update(array("q", token_ids[end - block_size : end]).tobytes())
        hashes.append(h.digest())

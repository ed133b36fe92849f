"""Fuzz the KV snapshot reader (sessions/snapshots.py) on whole files: an input's bytes are
written as a session's snapshot, then read as a restore reads it.

`_header` raises only `DAMAGED_FILE_ERRORS` or returns a header inside the file; `kv_file`
returns None or a `KVFile` whose token ids, shape and K/V offsets lie inside the file and
agree with the fingerprint (it never raises for a bad file); `read` returns None or K and V
whose bytes have the header's CRC-32.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import struct
import zlib

import _harness
import atheris

with atheris.instrument_imports(include=["sessions.snapshots", "engine.kv_file"]):
    from engine.kv_file import kv_crc32
    from sessions.snapshots import DAMAGED_FILE_ERRORS, SnapshotFiles, _header

FINGERPRINT = _harness.SEED_FINGERPRINT  # the seeds' (fuzz/make_corpus.py)
SESSION = "s"

logging.disable(logging.WARNING)  # every damaged file logs one; millions of them, here
FILES = SnapshotFiles(_harness.scratch("snapshot_header"))
PATH = FILES.path(SESSION)


def split(data: bytes) -> tuple[dict, bytes] | None:
    """A file's header, as JSON, and its tensor bytes; None where it has no JSON object."""
    if len(data) < 8:
        return None
    (n,) = struct.unpack_from("<Q", data)
    try:
        header = json.loads(data[8 : 8 + n]) if 8 + n <= len(data) else None
    except (ValueError, RecursionError):
        return None
    return (header, data[8 + n :]) if isinstance(header, dict) else None


def join(header: dict, rest: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + rest


def relayout(header: dict, rest: bytes, rng: random.Random) -> bytes:
    """Every tensor's `data_offsets` made true to its shape and dtype again, in the order they
    had, and the data cut or padded to their end: a file the reader takes apart further."""
    names = [k for k, v in header.items() if isinstance(v, dict) and k != "__metadata__"]
    at = 0
    for name in sorted(names, key=lambda k: str(header[k].get("data_offsets"))):
        entry = header[name]
        shape = entry.get("shape")
        size = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8}.get(entry.get("dtype"), 1)
        ok = isinstance(shape, list) and all(isinstance(x, int) and x >= 0 for x in shape)
        if ok and math.prod(shape) * size <= 4096:
            entry["data_offsets"] = [at, at + math.prod(shape) * size]
            at += math.prod(shape) * size
    return rest[:at] + rng.randbytes(max(0, at - len(rest)))


def reseal(header: dict, rest: bytes) -> None:
    """The metadata's token hash and K/V CRC-32 made true to the bytes: a file only its shapes
    (against the fingerprint) can still refuse."""
    meta = header.get("__metadata__")
    try:
        spans = [header[k]["data_offsets"] for k in ("token_ids", "k", "v")]
        ids = rest[spans[0][0] : spans[0][1]]
        meta["token_hash"] = hashlib.sha256(ids[: len(ids) // 8 * 8]).hexdigest()
        crc = zlib.crc32(
            rest[spans[2][0] : spans[2][1]], zlib.crc32(rest[spans[1][0] : spans[1][1]])
        )
        meta["kv_crc32"] = f"{crc:08x}"
    except (KeyError, TypeError, ValueError, IndexError):
        pass


def any_value(rng: random.Random) -> object:
    """A JSON value of any type, from the ones a parser trips on to a nest past Python's limit
    (as text, for the fingerprint, which is JSON inside a string) and one just short of it."""
    simple = [None, True, -1, 0, 2**64, 1.5, "", "BF16", "I64", "0" * 8, [], {}, [0, 0], [[]]]
    i = rng.randrange(len(simple) + 2)
    if i == len(simple):
        return "[" * 5000 + "]" * 5000
    if i == len(simple) + 1:
        return json.loads("[" * 400 + "]" * 400)
    return simple[i]


def nodes(value: object, depth: int = 0) -> list[tuple[dict | list, object]]:
    """(container, key) of the nodes of a JSON value, depth first, down to 20 levels."""
    out: list[tuple[dict | list, object]] = []
    if isinstance(value, dict | list) and depth < 20:
        for key, child in value.items() if isinstance(value, dict) else enumerate(value):
            out.append((value, key))
            out += nodes(child, depth + 1)
    return out


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    """libFuzzer's custom mutator (`change`); where a change trips on a header it did not
    foresee (a node of another type), libFuzzer's own mutation instead."""
    try:
        return change(data, max_size, seed)
    except (TypeError, AttributeError, ValueError, KeyError, IndexError, RecursionError):
        return atheris.Mutate(data, max_size)


def change(data: bytes, max_size: int, seed: int) -> bytes:
    """Where the input has a header, two times in three a change
    that keeps it a header: a tensor's shape or dtype (the offsets and the data then follow,
    and sometimes the hash and CRC), a metadata value or any node replaced or removed, or
    libFuzzer's own mutation of the JSON's bytes with the length prefix kept true. Otherwise
    libFuzzer's mutation of the whole file."""
    rng = random.Random(seed)
    parts = split(data)
    if parts is None or seed % 3 == 0:
        return atheris.Mutate(data, max_size)
    header, rest = parts
    how = rng.randrange(4)
    tensors = [v for k, v in header.items() if isinstance(v, dict) and k != "__metadata__"]
    if how == 0 and tensors:
        entry = rng.choice(tensors)
        shape = entry.get("shape")
        count = rng.choice((0, 1, 2, 7))
        if rng.random() < 0.3 and all(isinstance(header.get(k), dict) for k in ("k", "v")):
            for name, i in (("token_ids", 0), ("k", 1), ("v", 1)):  # another number of tokens
                entry = header.get(name)
                shape = entry.get("shape") if isinstance(entry, dict) else None
                if isinstance(shape, list) and len(shape) > i:
                    shape[i] = count
        elif isinstance(shape, list) and shape and rng.random() < 0.7:
            i = rng.randrange(len(shape))
            shape[i] = rng.choice((0, 1, 2, 3, 5, shape[i] + 1 if isinstance(shape[i], int) else 1))
        else:
            entry["dtype"] = rng.choice(("BF16", "F16", "F32", "I64", "F64", "U8", "bf16"))
        rest = relayout(header, rest, rng)
        if rng.random() < 0.5:
            reseal(header, rest)
    elif how == 1:
        found = nodes(header)
        if found:
            container, key = rng.choice(found)
            if rng.random() < 0.2:
                del container[key]
            else:
                container[key] = any_value(rng)
    elif how == 2 and isinstance(header.get("__metadata__"), dict):
        meta = header["__metadata__"]
        key = rng.choice(("format", "fingerprint", "token_hash", "kv_crc32"))
        fingerprint = {**FINGERPRINT, rng.choice(list(FINGERPRINT)): any_value(rng)}
        meta[key] = rng.choice((any_value(rng), json.dumps(fingerprint), "-1", "fffffffff"))
    else:
        raw = json.dumps(header).encode()
        raw = atheris.Mutate(raw, max(max_size - 8 - len(rest), len(raw)))
        return (struct.pack("<Q", len(raw)) + raw + rest)[:max_size]
    return join(header, rest)[:max_size]


@atheris.instrument_func
def test_one_input(data: bytes) -> None:
    PATH.write_bytes(data)
    with open(PATH, "rb") as f:
        try:
            header, at = _header(f)
        except DAMAGED_FILE_ERRORS:
            header, at = None, None
    if header is not None:
        assert isinstance(header, dict) and 8 <= at <= len(data)

    kv = FILES.kv_file(SESSION, FINGERPRINT)
    if kv is not None:
        assert header is not None and at is not None
        L, T, H, D = kv.shape  # [L, T, H_kv, D]
        assert (L, H, D) == tuple(
            FINGERPRINT[k] for k in ("num_layers", "num_kv_heads", "head_dim")
        )
        assert T == len(kv.token_ids) and all(isinstance(t, int) for t in kv.token_ids)
        nbytes = math.prod(kv.shape) * kv.dtype.itemsize
        for begin in (kv.k_at, kv.v_at):
            assert at <= begin and begin + nbytes <= len(data), (begin, nbytes, len(data))

    got = FILES.read(SESSION, FINGERPRINT)
    if got is not None:
        assert kv is not None
        ids, k, v = got
        assert ids == kv.token_ids and tuple(k.shape) == tuple(v.shape) == kv.shape
        assert k.dtype == v.dtype == kv.dtype and kv_crc32(k, v) == kv.crc32


if __name__ == "__main__":
    _harness.main("snapshot_header", test_one_input, mutate)

"""Fuzz `torch.ops.crowdchat.kv_read_file` (engine/kernels/csrc/kv_copy.cpp), a disk restore's
read of a snapshot's K or V straight into the KV pool, with fuzzed file bytes, offsets, token
counts, slots, pools and CRCs: it raises RuntimeError (bad arguments) or ValueError (a bad file) or
returns zlib's CRC-32 of the bytes it read, having copied them, and only them, where the slots
say; it never crashes, never writes outside the pool and never leaks a file descriptor.

An input is `PARAMS`, then `n_slots` signed bytes (the slots), then the file's bytes. The
sanitized build catches what the oracle cannot see, but under ASan's runtime libFuzzer gets no
coverage (a blind run), so `make fuzz` fuzzes on the plain build and then replays every input
it kept once on the sanitized one:

    CROWDCHAT_KERNEL_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0 \\
        UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 LD_PRELOAD="$(gcc \\
        -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \\
        .venv/bin/python fuzz/fuzz_kv_read_file.py -runs=0 CORPUS_DIR fuzz/corpus/kv_read_file
"""

from __future__ import annotations

import os
import struct
import zlib

import _harness
import atheris
import torch

from engine.kernels import cpu_kernels

# dtype, layers, KV heads, head size, pool slots, flags, slots given, tokens past skip + slots
# (signed); offset, skip, crc (int64 each)
PARAMS = struct.Struct("<7Bb3q")
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float64)
INT64 = (-(2**63), 2**63 - 1)
GUARD = 8  # elements of the pool's buffer on each side of it, which no call may write
# flags
SLOTS_INT32, SLOTS_STRIDED, SLOTS_2D, FILE_MISSING, FILE_IS_DIR, POOL_STRIDED = (
    1 << i for i in range(6)
)
# what the kernel's checks say: one branch each, so that libFuzzer keeps an input per check
# it reaches (the C++ itself is not instrumented)
MESSAGES = (
    "slots: contiguous int64",
    "slot out of range",
    "slots must number",
    "bad offset or crc",
    "pool: contiguous",
    "cannot open",
    "shorter than its tensor",
    "not a regular file",
    "past any file's size",
)

DIR = _harness.scratch("kv_read_file")  # the file, a directory, and a name that is not there
FILE = DIR / "kv.bin"


@atheris.instrument_func
def outcome(error: Exception) -> int:
    """Which of the kernel's checks refused the call (-1: none known, still an allowed type)."""
    text = str(error)
    for i, message in enumerate(MESSAGES):
        if message in text:
            return i
    return -1


def slots_tensor(values: tuple[int, ...], flags: int) -> torch.Tensor:
    """The slots as the call gets them: int64 [n], or a wrong dtype, stride or rank."""
    slots = torch.tensor(values, dtype=torch.int32 if flags & SLOTS_INT32 else torch.int64)
    if flags & SLOTS_STRIDED:
        slots = torch.stack([slots, slots], 1).reshape(-1)[::2]  # the same values, stride 2
    return slots.view(1, -1) if flags & SLOTS_2D else slots


@atheris.instrument_func
def test_one_input(data: bytes) -> None:
    if len(data) < PARAMS.size:
        return
    dtype_i, layers, heads, dim, pool_slots, flags, n, delta, offset, skip, crc = (
        PARAMS.unpack_from(data)
    )
    dtype = DTYPES[dtype_i % len(DTYPES)]
    shape = (layers % 4, heads % 4, dim % 9, pool_slots % 17)  # [L, H_kv, D, slots] for now
    rest = data[PARAMS.size :]
    n = min(n, len(rest))
    values, raw = struct.unpack_from(f"<{n}b", rest), rest[n:]
    tokens = skip + n + delta
    if not INT64[0] <= tokens <= INT64[1]:
        return  # not an int64: torch refuses it before the kernel sees it
    FILE.write_bytes(raw)
    path = DIR / "gone" if flags & FILE_MISSING else DIR if flags & FILE_IS_DIR else FILE

    # the pool: a view inside a larger buffer whose guard bytes must stay as they were
    L, H, D, S = shape
    e = torch.tensor([], dtype=dtype).element_size()
    buffer = torch.full(((2 * GUARD + L * H * S * D) * e,), 0xA5, dtype=torch.uint8)
    typed = buffer.view(dtype)[GUARD : GUARD + L * H * S * D]
    pool = (
        typed.view(L, H, D, S).transpose(2, 3) if flags & POOL_STRIDED else typed.view(L, H, S, D)
    )
    slots, before = slots_tensor(values, flags), buffer.clone()
    fds = len(os.listdir("/proc/self/fd"))
    try:
        got = torch.ops.crowdchat.kv_read_file(str(path), offset, pool, slots, tokens, skip, crc)
    except (RuntimeError, ValueError) as error:
        outcome(error)
        assert len(os.listdir("/proc/self/fd")) == fds, "a refused call leaked its descriptor"
        guards = (slice(0, GUARD * e), slice((GUARD + L * H * S * D) * e, None))
        for g in guards:
            assert torch.equal(buffer[g], before[g]), "a refused call wrote outside the pool"
        return
    assert len(os.listdir("/proc/self/fd")) == fds, "kv_read_file leaked its descriptor"

    # it succeeded: every check it makes held, it read L x tokens x H rows at `offset`, and
    # copied the rows after `skip`, the later of two tokens for one slot winning
    # (a stride on a dimension of size 1, or on an empty tensor, still leaves it contiguous)
    assert pool.is_contiguous() and slots.is_contiguous() and not flags & FILE_MISSING
    assert slots.dtype == torch.int64 and slots.dim() == 1
    assert 0 < tokens and 0 <= skip <= tokens and tokens - skip == n and 0 <= offset
    assert all(0 <= s < S for s in values) and 0 <= crc < 2**32
    row = D * e
    span = raw[offset : offset + L * tokens * H * row]
    assert len(span) == L * tokens * H * row, "it returned without the bytes it needed"
    assert got == zlib.crc32(span, crc), (got, zlib.crc32(span, crc))
    expected = before.clone()
    if span:
        rows = torch.frombuffer(bytearray(span), dtype=torch.uint8).view(L, tokens, H, row)
        into = expected[GUARD * e : (GUARD + L * H * S * D) * e].view(L, H, S, row)
        for t, slot in enumerate(values):
            into[:, :, slot] = rows[:, skip + t]
    assert torch.equal(buffer, expected), "the pool is not what the file and slots say"


if __name__ == "__main__":
    if not cpu_kernels.load():
        raise SystemExit("crowdchat's CPU kernels could not be built (see the log above)")
    _harness.main("kv_read_file", test_one_input)

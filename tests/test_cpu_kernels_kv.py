"""A restore's copy into the pool on crowdchat's CPU kernels (engine/kernels/csrc/kv_copy.cpp):
from memory (`kv_scatter`, bitwise ATen's index_copy_) and straight from a snapshot file
(`kv_read_file`, with its CRC-32); bad arguments and bad files refused, the pool untouched."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_kv_scatter_writes_what_index_copy_writes_and_refuses_bad_slots(kernel, dtype) -> None:
    """A restore's copy into the pool: bitwise ATen's index_copy_ of the transposed export,
    for a few tokens (one thread) and many (all cores); bad inputs raise, the pool untouched."""
    gen = torch.Generator().manual_seed(0)
    for layers, heads, slots, d, t in [(2, 3, 64, 64, 5), (30, 3, 4096, 64, 2005)]:
        pool = torch.randn(layers, heads, slots, d, generator=gen).to(dtype)
        kv = torch.randn(layers, t, heads, d, generator=gen).to(dtype)
        idx = torch.randperm(slots, generator=gen)[:t]
        expected = pool.clone().index_copy_(2, idx, kv.transpose(1, 2))
        before = pool.clone()
        bad = {
            "slot out of range": (kv, idx.clone().fill_(slots)),
            "slot out of range ": (kv, idx.clone().fill_(-1)),
            "slots: contiguous int64": (kv, idx[:-1]),
            "differ in dtype": (kv.double(), idx),
            "kv: contiguous": (kv.transpose(1, 2), idx),
        }
        for message, (x, i) in bad.items():
            with pytest.raises(RuntimeError, match=message.strip()):
                torch.ops.crowdchat.kv_scatter(pool, x, i)
        assert torch.equal(pool.view(torch.uint8), before.view(torch.uint8))
        torch.ops.crowdchat.kv_scatter(pool, kv, idx)
        assert torch.equal(pool.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_kv_read_file_copies_what_kv_scatter_copies_and_checksums_every_byte(
    kernel, dtype, tmp_path: Path
) -> None:
    """A restore straight from a snapshot file: the tokens after `skip` land in the pool
    bitwise as `kv_scatter` puts them, the returned CRC-32 is zlib's over all the tensor's
    bytes (skipped ones too) continued from the one passed in; bad arguments are a
    RuntimeError that leaves the pool as it was, a missing or short file a ValueError (a bad
    snapshot)."""
    gen = torch.Generator().manual_seed(1)
    read = torch.ops.crowdchat.kv_read_file
    for layers, heads, slots, d, t, skip in [(2, 3, 64, 64, 5, 0), (30, 3, 4096, 64, 2005, 48)]:
        kv = torch.randn(layers, t, heads, d, generator=gen).to(dtype)
        raw = kv.view(torch.uint8).numpy().tobytes()
        path = tmp_path / "kv.bin"
        path.write_bytes(b"x" * 13 + raw)  # an odd offset, as nothing aligns it
        pool = torch.randn(layers, heads, slots, d, generator=gen).to(dtype)
        idx = torch.randperm(slots, generator=gen)[: t - skip]
        expected = pool.clone()
        torch.ops.crowdchat.kv_scatter(expected, kv[:, skip:].contiguous(), idx)
        before = pool.clone()
        bad_calls = {
            "slot out of range": (13, idx.clone().fill_(slots), skip, 0),
            "slots must number": (13, idx[:-1], skip, 0),
            "bad offset or crc": (13, idx, skip, 1 << 32),
        }
        for message, (at, i, k, crc) in bad_calls.items():
            with pytest.raises(RuntimeError, match=message):
                read(str(path), at, pool, i, t, k, crc)
        assert torch.equal(pool.view(torch.uint8), before.view(torch.uint8))
        # a bad file may have been copied in part (into blocks the caller then lets go)
        with pytest.raises(ValueError, match="cannot open"):
            read(str(tmp_path / "gone"), 13, pool, idx, t, skip, 0)
        with pytest.raises(ValueError, match="shorter than its tensor"):
            read(str(path), 14, pool, idx, t, skip, 0)
        assert read(str(path), 13, pool, idx, t, skip, 7) == zlib.crc32(raw, 7)
        assert torch.equal(pool.view(torch.uint8), expected.view(torch.uint8))


def test_kv_read_file_refuses_a_token_count_past_any_file_before_it_allocates(
    kernel, tmp_path: Path
) -> None:
    """The kv_read_file fuzzer's finds (issue 34): a `tokens` whose layer size overflows int64
    (undefined behaviour, then a copy outside the read buffer under ASan), or one the file is
    far too short for (a buffer of a terabyte allocated first: std::bad_alloc, and the file's
    descriptor never closed). Now: a RuntimeError for the first, a ValueError (a bad file)
    for the second, and no descriptor left open by any refusal."""
    read = torch.ops.crowdchat.kv_read_file
    path = tmp_path / "kv.bin"
    path.write_bytes(bytes(4096))
    pool = torch.zeros(2, 3, 64, 64, dtype=torch.bfloat16)
    one = torch.tensor([5])
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        with pytest.raises(RuntimeError, match="past any file's size"):
            read(str(path), 0, pool, one, 2**61, 2**61 - 1, 0)
        with pytest.raises(ValueError, match="shorter than its tensor"):
            read(str(path), 0, pool, one, 2**32, 2**32 - 1, 0)  # 1.5 TiB a layer
        with pytest.raises(ValueError, match="not a regular file"):
            read(str(tmp_path), 0, pool, one, 1, 0, 0)
        # a pool of no layers reads nothing, however many tokens (was a buffer sized first)
        empty = torch.zeros(0, 3, 64, 64, dtype=torch.bfloat16)
        assert read(str(path), 0, empty, one, 2**32, 2**32 - 1, 0) == 0
        # nor one of head size 0 (a memcpy from and to null: undefined, UBSan's find)
        flat = torch.zeros(2, 3, 64, 0, dtype=torch.bfloat16)
        assert read(str(path), 0, flat, one, 1, 0, 12345) == 12345
    assert len(os.listdir("/proc/self/fd")) == fds
    assert not pool.any()


def test_crc32_bytes_is_zlibs_crc32_at_every_length_offset_and_start(kernel) -> None:
    """The folded CRC-32 (PCLMULQDQ past 64 bytes, tables for the rest) against zlib.crc32:
    seeded random lengths around the 16- and 64-byte edges and long ones, unaligned starts,
    any CRC to continue from; a non-contiguous tensor and a bad CRC are refused."""
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=gen)
    edges = [0, 1, 15, 16, 17, 63, 64, 65, 79, 80, 127, 128, 129, 1000, 40000]
    lengths = edges + torch.randint(0, 1 << 15, (200,), generator=gen).tolist()
    for i, n in enumerate(lengths):
        start = i % 61
        crc = [0, 0xFFFFFFFF, int(torch.randint(0, 1 << 31, (1,), generator=gen)) * 2 + 1][i % 3]
        chunk = data[start : start + n]
        assert torch.ops.crowdchat.crc32_bytes(chunk, crc) == zlib.crc32(chunk.numpy(), crc)
    wide = torch.randn(300, 7, generator=gen).to(torch.bfloat16)  # any dtype: its bytes
    assert torch.ops.crowdchat.crc32_bytes(wide, 5) == zlib.crc32(wide.view(torch.uint8).numpy(), 5)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.crowdchat.crc32_bytes(wide.t(), 0)
    with pytest.raises(RuntimeError, match="crc: 0 to"):
        torch.ops.crowdchat.crc32_bytes(wide, -1)

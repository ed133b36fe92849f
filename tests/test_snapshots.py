"""KV snapshot files: exact round trips, atomic writes, and every kind of bad file read as None."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest
import torch

from engine.errors import InvalidRequest
from sessions.snapshots import SnapshotFiles, token_hash

FP = {
    "model_id": "m",
    "weights_hash": "abc",
    "dtype": "bfloat16",
    "block_size": 16,
    "num_layers": 2,
    "num_kv_heads": 3,
    "head_dim": 4,
}
IDS = [1, 50, 7, 99, 1000]


def kv(dtype: torch.dtype, tokens: int = len(IDS)) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (FP["num_layers"], tokens, FP["num_kv_heads"], FP["head_dim"])  # [L, T, H, D]
    return (
        torch.randn(shape, generator=gen).to(dtype),
        torch.randn(shape, generator=gen).to(dtype),
    )


@pytest.fixture
def files(tmp_path: Path) -> SnapshotFiles:
    return SnapshotFiles(tmp_path / "snapshots", budget_bytes=None)


@pytest.fixture
def written(files: SnapshotFiles) -> Path:
    k, v = kv(torch.bfloat16)
    path, _ = files.write("s1", IDS, k, v, FP)
    return path


def data_offset(path: Path, tensor: str) -> int:
    """Where `tensor`'s bytes start in the file (parsed from the safetensors header)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n + json.loads(raw[8 : 8 + n])[tensor]["data_offsets"][0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_is_exact(files: SnapshotFiles, dtype: torch.dtype) -> None:
    k, v = kv(dtype)
    path, size = files.write("s1", IDS, k, v, FP)
    assert path == files.path("s1") and path.stat().st_size == size == files.total_bytes()
    got = files.read("s1", dict(FP), token_hash(IDS))
    assert got is not None
    ids, k2, v2 = got
    assert ids == IDS and k2.dtype == dtype and v2.dtype == dtype
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(k2.view(bits), k.view(bits)) and torch.equal(v2.view(bits), v.view(bits))
    assert files.read("s1", FP, None) is not None  # the token hash check is optional


def test_write_is_atomic_and_replaces(files: SnapshotFiles) -> None:
    files.write("s1", IDS, *kv(torch.bfloat16), FP)
    k, v = kv(torch.float32, tokens=2)
    files.write("s1", [4, 5], k, v, FP)
    assert list(files.directory.glob("*.tmp")) == []
    assert [p.name for p in files.directory.iterdir()] == ["s1.safetensors"]
    got = files.read("s1", FP, token_hash([4, 5]))
    assert got is not None and got[0] == [4, 5] and torch.equal(got[1], k)


def test_missing_is_none(files: SnapshotFiles, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert files.read("nobody", FP, None) is None
    assert "missing" in caplog.text


@pytest.mark.parametrize("keep", [0, 7, 100, -1])
def test_truncated_is_none(written: Path, files: SnapshotFiles, keep: int) -> None:
    raw = written.read_bytes()
    written.write_bytes(raw[:keep])
    assert files.read("s1", FP, None) is None


@pytest.mark.parametrize("offset", [3, 8, 20])  # length prefix, JSON opening, JSON body
def test_corrupted_header_is_none(written: Path, files: SnapshotFiles, offset: int) -> None:
    raw = bytearray(written.read_bytes())
    raw[offset : offset + 4] = b"\xff\xfe\x00\x7f"
    written.write_bytes(bytes(raw))
    assert files.read("s1", FP, None) is None


@pytest.mark.parametrize("tensor", ["k", "v", "token_ids"])
def test_flipped_data_byte_is_none(
    written: Path, files: SnapshotFiles, tensor: str, caplog: pytest.LogCaptureFixture
) -> None:
    at = data_offset(written, tensor) + 1
    raw = bytearray(written.read_bytes())
    raw[at] ^= 0x01
    written.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        assert files.read("s1", FP, None) is None
    assert "corrupted" in caplog.text


def test_wrong_fingerprint_is_none(written: Path, files: SnapshotFiles) -> None:
    assert files.read("s1", {**FP, "weights_hash": "other"}, None) is None
    assert files.read("s1", {**FP, "block_size": 32}, None) is None
    assert files.read("s1", FP, None) is not None


def test_wrong_token_hash_is_none(written: Path, files: SnapshotFiles) -> None:
    assert files.read("s1", FP, token_hash(IDS[:-1])) is None
    assert files.read("s1", FP, "0" * 64) is None


def test_shape_not_matching_fingerprint_is_none(files: SnapshotFiles) -> None:
    fp = {**FP, "num_kv_heads": 3}
    k, v = kv(torch.bfloat16)
    files.write("s1", IDS, k[:, :, :2], v[:, :, :2], fp)  # 2 heads, fingerprint says 3
    assert files.read("s1", fp, None) is None


def test_leftover_temp_files_are_swept(files: SnapshotFiles) -> None:
    files.write("s1", IDS, *kv(torch.bfloat16), FP)
    for name in ("s1.abc123.tmp", "s2.xyz.tmp"):
        (files.directory / name).write_bytes(b"half a snapshot")
    reopened = SnapshotFiles(files.directory, budget_bytes=1 << 20)
    assert list(reopened.directory.glob("*.tmp")) == []
    assert reopened.budget_bytes == 1 << 20
    assert reopened.read("s1", FP, token_hash(IDS)) is not None


def test_delete_and_total_bytes(files: SnapshotFiles) -> None:
    _, a = files.write("a", IDS, *kv(torch.bfloat16), FP)
    _, b = files.write("b", IDS, *kv(torch.float32), FP)
    assert files.total_bytes() == a + b
    assert files.delete("a") is True
    assert files.delete("a") is False
    assert files.total_bytes() == b
    assert files.read("a", FP, None) is None


BAD_IDS = ["../../etc/passwd", "a/b", "", "x" * 65, "a.b", "a b", "é", "abc\n"]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_path_like_ids_are_rejected(files: SnapshotFiles, bad: str) -> None:
    k, v = kv(torch.bfloat16)
    for call in (
        lambda: files.write(bad, IDS, k, v, FP),
        lambda: files.read(bad, FP, None),
        lambda: files.delete(bad),
        lambda: files.path(bad),
    ):
        with pytest.raises(InvalidRequest):
            call()
    assert list(files.directory.iterdir()) == []


def test_longest_valid_id(files: SnapshotFiles) -> None:
    sid = "A-z_9" + "x" * 59
    files.write(sid, IDS, *kv(torch.bfloat16), FP)
    assert files.read(sid, FP, token_hash(IDS)) is not None


def test_token_hash_is_stable() -> None:
    assert token_hash([1, 2, 3]) == token_hash([1, 2, 3]) != token_hash([1, 2, 4])
    assert token_hash([]) != token_hash([0])


def test_session_ids_lists_snapshot_files_only(files: SnapshotFiles) -> None:
    for sid in ("b", "a"):
        files.write(sid, IDS, *kv(torch.bfloat16), FP)
    (files.directory / "c.abc.tmp").write_bytes(b"half")
    (files.directory / "not an id.safetensors").write_bytes(b"x")
    assert files.session_ids() == ["a", "b"]


def test_a_snapshot_of_no_tokens_is_none(
    files: SnapshotFiles, caplog: pytest.LogCaptureFixture
) -> None:
    """The snapshot fuzzer's find: a file of 0 tokens, its token hash and CRC-32 true to the
    empty bytes, passed every check, then torch.frombuffer raised a ValueError on the empty K
    (`read` and `kv_file` return None for any bad file, never raise)."""
    k, v = kv(torch.bfloat16, tokens=0)
    files.write("s1", [], k, v, FP)
    with caplog.at_level(logging.WARNING):
        assert files.kv_file("s1", FP, token_hash([])) is None
        assert files.read("s1", FP, None) is None
    assert "holds no tokens" in caplog.text

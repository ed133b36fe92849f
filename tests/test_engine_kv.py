"""A conversation's KV out of the engine and back on the real model: retained and reused,
exported and imported byte-exact (from memory and from a snapshot file), and a failed or
damaged import leaks no block."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Engine, KVFileDamaged, SamplingParams
from engine.chat_format import ChatFormatter
from sessions.snapshots import SnapshotFiles
from tests.conftest import ask

GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


def test_retained_kv_is_reused_and_exports_exactly(
    nf4_engine: Engine, formatter: ChatFormatter
) -> None:
    conv = [{"role": "user", "content": "Name a fruit."}]
    first = nf4_engine.submit(formatter.encode(conv), GREEDY, owner="s1", retain=True)
    reply = first.result()
    resident = nf4_engine.resident_kv()
    assert (
        "s1" in resident and resident["s1"][0] == first.num_prompt_tokens + len(first.token_ids) - 1
    )
    exported = nf4_engine.export_kv("s1")
    assert exported is not None and exported.k.shape[1] == len(exported.token_ids)
    conv += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another?"}]
    second = nf4_engine.submit(formatter.encode(conv), GREEDY, owner="s1", retain=True)
    second.result()
    assert second.num_cached_tokens >= first.num_prompt_tokens  # only the new turn was prefilled
    # export -> drop -> import round trip is byte-exact
    kv = nf4_engine.export_kv("s1")
    assert nf4_engine.drop_kv("s1") and "s1" not in nf4_engine.resident_kv()
    assert nf4_engine.import_kv("s1", kv)
    again = nf4_engine.export_kv("s1")
    assert again.token_ids == kv.token_ids
    assert torch.equal(again.k.view(torch.int16), kv.k.view(torch.int16))
    assert torch.equal(again.v.view(torch.int16), kv.v.view(torch.int16))
    nf4_engine.drop_kv("s1")


def test_a_failed_kv_import_leaks_no_blocks(
    nf4_engine: Engine, formatter: ChatFormatter, monkeypatch: pytest.MonkeyPatch
) -> None:
    nf4_engine.submit(ask(formatter, "Hi"), GREEDY, owner="s", retain=True).result()
    kv = nf4_engine.export_kv("s")
    nf4_engine.drop_kv("s")

    def broken(*args: object) -> None:
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(nf4_engine.cache, "load", broken)
    with pytest.raises(RuntimeError, match="injected"):
        nf4_engine.import_kv("s", kv)
    nf4_engine.check_integrity()
    assert nf4_engine.stats().blocks_used == 0


@pytest.mark.parametrize("reader", ["kernel", "python"])
def test_kv_imported_from_a_file_is_exact_shares_the_cached_head_and_damage_leaks_nothing(
    nf4_engine: Engine, formatter: ChatFormatter, tmp_path: Path, reader: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A snapshot file back into the pool, read straight into reserved blocks off the engine
    thread (the CPU kernel) or read into memory first (CUDA, or no kernels): byte-exact, its
    head found in the prefix cache is shared instead of read, and a flipped byte or a short
    file raises KVFileDamaged with every block let go."""
    conv = [{"role": "user", "content": "Name three rivers and a mountain."}]
    nf4_engine.submit(formatter.encode(conv), GREEDY, owner="s", retain=True, cache_ns="u").result()
    kv = nf4_engine.export_kv("s")
    files = SnapshotFiles(tmp_path / "snapshots")
    files.write("s", kv.token_ids, kv.k, kv.v, nf4_engine.kv_fingerprint)
    where = files.kv_file("s", nf4_engine.kv_fingerprint)
    assert where is not None and where.shape == tuple(kv.k.shape)
    assert nf4_engine.cache.reads_files(where)  # the kernels are built (make kernel)
    if reader == "python":
        monkeypatch.setattr(nf4_engine.cache, "reads_files", lambda kv: False)
    resident = nf4_engine.scheduler.resident
    for shared in (True, False):  # the blocks the first turn cached (namespace "u"), or none
        nf4_engine.drop_kv("s")
        if not shared:
            nf4_engine.reset_prefix_cache()
        before = resident.num_loaded_from_cache
        assert nf4_engine.import_kv_file("s", where, cache_ns="u" if shared else None)
        assert (resident.num_loaded_from_cache > before) == shared
        again = nf4_engine.export_kv("s")
        assert again.token_ids == kv.token_ids
        assert torch.equal(again.k.view(torch.int16), kv.k.view(torch.int16))
        assert torch.equal(again.v.view(torch.int16), kv.v.view(torch.int16))
        nf4_engine.check_integrity()
    nf4_engine.drop_kv("s")
    nf4_engine.reset_prefix_cache()
    raw = bytearray(where.path.read_bytes())
    raw[where.v_at + len(raw[where.v_at :]) // 2] ^= 0x40
    for damaged in (bytes(raw), bytes(raw[: where.v_at + 10])):
        where.path.write_bytes(damaged)
        with pytest.raises(KVFileDamaged):
            nf4_engine.import_kv_file("s", where)
        nf4_engine.check_integrity()
        assert "s" not in nf4_engine.resident_kv() and nf4_engine.stats().blocks_used == 0

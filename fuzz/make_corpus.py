"""Writes the fuzzers' seed corpora (`fuzz/corpus/<target>/`) from real inputs: snapshot files
written by `SnapshotFiles.write`, request bodies as the official OpenAI client sends them,
cookies minted by `BrowserIds.mint`, and `kv_read_file` calls as `KVCache.load_file` makes them
on such a snapshot. `python fuzz/make_corpus.py` rewrites them (the same bytes but for the
random browser ids)."""

from __future__ import annotations

import json
import tempfile
import zlib
from pathlib import Path

import _harness
import httpx
import openai
import torch

from doors.browser_id import BrowserIds
from sessions.snapshots import SnapshotFiles

FINGERPRINT, KEY = _harness.SEED_FINGERPRINT, _harness.SEED_KEY
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fuzz_kv_read_file.DTYPES' first
POOL_SLOTS, BLOCK = 16, 4  # the seeds' pool: 4 blocks of 4 slots


def write(target: str, name: str, data: bytes) -> None:
    folder = _harness.SEEDS / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    print(f"{folder / name}: {len(data)} bytes")


def snapshots(directory: Path) -> list[tuple[str, Path]]:
    """Three snapshots of the fingerprint's model: bf16, f16 and f32, of 5, 3 and 1 tokens."""
    files = SnapshotFiles(directory)
    gen = torch.Generator().manual_seed(0)
    out = []
    for dtype, ids in zip(DTYPES, ([1, 50, 7, 99, 1000], [2, 3, 4], [151]), strict=True):
        shape = (2, len(ids), 3, 4)  # [L, T, H_kv, D]
        k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
        path, _ = files.write(str(dtype).removeprefix("torch."), ids, k, v, FINGERPRINT)
        out.append((path.stem, path))
    return out


def kv_read_file_seeds(directory: Path) -> None:
    """The calls a restore makes on each snapshot: K from token `skip` on, then V with K's CRC
    (fuzz_kv_read_file's input layout: PARAMS, the slots as bytes, the file)."""
    from fuzz_kv_read_file import PARAMS

    files = SnapshotFiles(directory)
    for dtype_i, (session, path) in enumerate(snapshots(directory)):
        kv = files.kv_file(session, FINGERPRINT)
        assert kv is not None
        n, raw = len(kv.token_ids), path.read_bytes()
        skip = n // 2
        table = [3, 1]  # the block table: position p is slot table[p // 4] * 4 + p % 4
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(skip, n)]
        nbytes = kv.shape[0] * n * kv.shape[2] * kv.shape[3] * kv.dtype.itemsize
        k_crc = zlib.crc32(raw[kv.k_at : kv.k_at + nbytes])
        for at, crc, name in ((kv.k_at, 0, "k"), (kv.v_at, k_crc, "v")):
            params = PARAMS.pack(dtype_i, 2, 3, 4, POOL_SLOTS, 0, len(slots), 0, at, skip, crc)
            write("kv_read_file", f"{session}-{name}", params + bytes(slots) + raw)


def chat_request_seeds() -> None:
    """The bodies the official client sends for a plain, a streaming and a sampled request."""
    bodies: list[bytes] = []

    def capture(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        return httpx.Response(400, json={"error": {"message": "captured"}})

    client = openai.OpenAI(
        api_key="none",
        base_url="http://fuzz.invalid/v1",
        http_client=httpx.Client(transport=httpx.MockTransport(capture)),
        max_retries=0,
    )
    calls = [
        {"messages": [{"role": "user", "content": "Hello!"}]},
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Name a prime."}]},
                {"role": "assistant", "content": "7"},
                {"role": "user", "content": "Another?"},
            ],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 32,
        },
        {
            "messages": [
                {"role": "developer", "content": "Be kind."},
                {"role": "user", "content": "Hi"},
            ],
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 42,
            "stop": ["\n\n", "User:"],
            "presence_penalty": 0.5,
            "frequency_penalty": 0.1,
            "max_completion_tokens": 64,
            "n": 1,
            "extra_body": {"top_k": 40, "min_tokens": 2, "repetition_penalty": 1.1},
        },
    ]
    for call in calls:
        try:
            client.chat.completions.create(model="smollm2", **call)
        except openai.BadRequestError:
            pass
    for i, body in enumerate(bodies):
        json.loads(body)  # the client sent JSON
        write("chat_request", f"body-{i}", body)
    write("chat_request", "session", json.dumps({"title": "Notes"}).encode())


def browser_id_seeds() -> None:
    """Two minted cookies, and a bare id (an old BrowserState value)."""
    ids = BrowserIds(KEY, per_minute=10)
    for i in range(2):
        minted = ids.mint("seed")
        assert minted is not None
        write("browser_id", f"cookie-{i}", minted[1].encode())
    write("browser_id", "bare-id", b"0123456789abcdef0123456789abcdef")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for session, path in snapshots(Path(tmp)):
            write("snapshot_header", session, path.read_bytes())
        kv_read_file_seeds(Path(tmp))
    chat_request_seeds()
    browser_id_seeds()


if __name__ == "__main__":
    main()

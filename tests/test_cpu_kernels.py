"""The CPU decode attention kernel (engine/kernels/csrc/paged_decode.cpp) against attention
computed in float64 from the same blocks: seeded random shapes, pool dtypes, block tables and
lengths (chunk edges included); a sequence's output does not depend on the rest of its batch;
bad tables and lengths raise instead of reading outside the pool. Its prefill sibling: causal
within float64 and bitwise the decode of each token. Then the build: its instruction sets and
flags. A restore's copy into the pool is tests/test_cpu_kernels_kv.py's, the steps' glue ops
tests/test_cpu_kernels_ops.py's (the whole layer's bitwise equality is
tests/test_lean_llama.py's). The `kernel` fixture is in tests/conftest.py."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu_kernels

CHUNK = 512  # the kernel's tokens per work item (kChunk)


def random_case(rng: random.Random, gen: torch.Generator) -> dict:
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    hkv, group, d = rng.choice([1, 2, 3]), rng.choice([1, 3, 4]), rng.choice([32, 64, 128])
    bs = rng.choice([8, 16, 32])
    lens = [
        rng.choice([1, bs, CHUNK, CHUNK + 1, 2 * CHUNK, rng.randint(1, 1300)])
        for _ in range(rng.randint(1, 6))
    ]
    nblk = max(-(-n // bs) for n in lens)
    pool_blocks = len(lens) * nblk + rng.randint(0, 20)
    order = torch.randperm(pool_blocks, generator=gen)
    table = torch.zeros(len(lens), nblk, dtype=torch.long)
    for i in range(len(lens)):
        table[i] = order[i * nblk : (i + 1) * nblk]
    return {
        "q": torch.randn(len(lens), hkv * group, d, generator=gen),
        "k": torch.randn(hkv, pool_blocks * bs, d, generator=gen).to(dtype),
        "v": torch.randn(hkv, pool_blocks * bs, d, generator=gen).to(dtype),
        "table": table,
        "lens": torch.tensor(lens),
        "bs": bs,
        "scale": d**-0.5,
    }


def reference(c: dict) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence in float64, K/V rows read through its table."""
    b, h, d = c["q"].shape
    hkv, bs = c["k"].shape[0], c["bs"]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i, n in enumerate(c["lens"].tolist()):
        slots = torch.tensor([int(c["table"][i, t // bs]) * bs + t % bs for t in range(n)])
        k = c["k"][:, slots].double().repeat_interleave(h // hkv, 0)  # [H, n, D]
        v = c["v"][:, slots].double().repeat_interleave(h // hkv, 0)
        w = torch.softmax(torch.einsum("hd,hnd->hn", c["q"][i].double(), k) * c["scale"], -1)
        out[i] = torch.einsum("hn,hnd->hd", w, v)
    return out


def run(kernel: cpu_kernels.Kernel, c: dict) -> torch.Tensor:
    return kernel(c["q"], c["k"], c["v"], c["table"], c["lens"], c["bs"], c["scale"])


@pytest.mark.parametrize("seed", range(6))
def test_the_kernel_equals_float64_attention_over_the_same_blocks(kernel, seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(8):
        c = random_case(rng, gen)
        got = run(kernel, c)
        assert got.dtype == torch.float32 and got.shape == c["q"].shape
        assert (got.double() - reference(c)).abs().max() < 2e-5


def test_a_sequences_output_does_not_depend_on_the_rest_of_its_batch(kernel) -> None:
    rng, gen = random.Random(11), torch.Generator().manual_seed(11)
    for _ in range(6):
        c = random_case(rng, gen)
        batch = run(kernel, c)
        for i in range(len(c["lens"])):
            alone = dict(
                c, q=c["q"][i : i + 1], table=c["table"][i : i + 1], lens=c["lens"][i : i + 1]
            )
            assert torch.equal(run(kernel, alone)[0], batch[i])


def test_bad_tables_lengths_and_shapes_raise_instead_of_reading_outside_the_pool(kernel) -> None:
    c = random_case(random.Random(3), torch.Generator().manual_seed(3))
    pool_blocks = c["k"].shape[1] // c["bs"]
    bad = {
        "block id out of range": dict(c, table=c["table"].clone().fill_(pool_blocks)),
        "block id out of range ": dict(c, table=c["table"].clone().fill_(-1)),
        "context length out of range": dict(c, lens=c["lens"].clone().fill_(0)),
        "context length out of range ": dict(c, lens=c["lens"] + c["table"].shape[1] * c["bs"]),
        "q: contiguous float32": dict(c, q=c["q"].double()),
        "one dtype": dict(c, v=c["v"].double()),
        "block_table": dict(c, table=c["table"].int()),
    }
    for message, case in bad.items():
        with pytest.raises(RuntimeError, match=message.strip()):
            run(kernel, case)
    assert (run(kernel, c).double() - reference(c)).abs().max() < 2e-5  # still fine after


def prefill_case(rng: random.Random, gen: torch.Generator) -> dict:
    """One sequence: `start` cached tokens, then a chunk of n; its table over a shuffled pool."""
    c = random_case(rng, gen)
    n = rng.choice([1, 2, 7, 16, 33, 64])
    start = rng.choice([0, 1, c["bs"] - 1, CHUNK - 3, CHUNK, rng.randint(1, 1300)])
    bs = c["bs"]
    nblk = -(-(start + n) // bs) + rng.randint(0, 2)
    pool_blocks = nblk + rng.randint(0, 20)
    hkv, _, d = c["k"].shape
    return {
        "q": torch.randn(n, c["q"].shape[1], d, generator=gen),
        "k": torch.randn(hkv, pool_blocks * bs, d, generator=gen).to(c["k"].dtype),
        "v": torch.randn(hkv, pool_blocks * bs, d, generator=gen).to(c["k"].dtype),
        "blocks": torch.randperm(pool_blocks, generator=gen)[:nblk].contiguous(),
        "start": start,
        "bs": bs,
        "scale": c["scale"],
    }


def prefill(c: dict) -> torch.Tensor:
    op = torch.ops.crowdchat.paged_prefill_attention
    return op(c["q"], c["k"], c["v"], c["blocks"], c["start"], c["bs"], c["scale"])


def as_decodes(c: dict) -> dict:
    """The chunk's tokens as decodes of one sequence at contexts start + 1 .. start + n."""
    n = c["q"].shape[0]
    return dict(
        c,
        table=c["blocks"].expand(n, -1).contiguous(),
        lens=torch.arange(c["start"] + 1, c["start"] + n + 1),
    )


@pytest.mark.parametrize("seed", range(6))
def test_a_prefill_chunk_is_causal_attention_and_bitwise_the_decode_of_each_token(
    kernel, seed: int
) -> None:
    """Query i of a chunk attends positions up to start + i: within float64 attention of those,
    bitwise what the decode kernel gives the same token at the same context, and bitwise the
    same on one thread as on all (a chunk's work items split over the threads)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(8):
        c = prefill_case(rng, gen)
        got = prefill(c)
        assert got.dtype == torch.float32 and got.shape == c["q"].shape
        decodes = as_decodes(c)
        assert (got.double() - reference(decodes)).abs().max() < 2e-5
        assert torch.equal(got, run(kernel, decodes))
        before = torch.ops.crowdchat.omp_threads(1)
        try:
            alone = prefill(c)
        finally:
            torch.ops.crowdchat.omp_threads(before)
        assert torch.equal(got, alone)


def test_bad_prefill_chunks_raise_instead_of_reading_outside_the_pool(kernel) -> None:
    c = prefill_case(random.Random(5), torch.Generator().manual_seed(5))
    pool_blocks, covered = c["k"].shape[1] // c["bs"], c["blocks"].numel() * c["bs"]
    n = c["q"].shape[0]
    bad = {
        "block id out of range": dict(c, blocks=c["blocks"].clone().fill_(pool_blocks)),
        "block id out of range ": dict(c, blocks=c["blocks"].clone().fill_(-1)),
        "start out of range": dict(c, start=-1),
        "start out of range ": dict(c, start=covered - n + 1),
        "q: contiguous float32": dict(c, q=c["q"].double()),
        "n >= 1": dict(c, q=c["q"][:0]),
        "one dtype": dict(c, v=c["v"].double()),
        "blocks: contiguous int64": dict(c, blocks=c["blocks"].int()),
    }
    for message, case in bad.items():
        with pytest.raises(RuntimeError, match=message.strip()):
            prefill(case)
    assert torch.equal(prefill(c), run(kernel, as_decodes(c)))  # still fine after


@pytest.mark.parametrize("seed", range(4))
def test_many_chunks_in_one_call_are_bitwise_each_chunk_alone(seed: int) -> None:
    """`paged_prefills_attention`: a step's chunks (fresh prompts, chunks after cached tokens,
    of every tail length, on distinct or shared blocks) in one call give each chunk bitwise what
    its own call gives, on one thread as on all; bad sizes and tables raise."""
    if not cpu_kernels.load():
        pytest.skip("crowdchat's CPU kernels are not built here")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    many = torch.ops.crowdchat.paged_prefills_attention
    for _ in range(6):
        base = prefill_case(rng, gen)
        bs, pool_blocks = base["bs"], base["k"].shape[1] // base["bs"]
        chunks = []
        for _ in range(rng.randint(1, 7)):
            n = rng.choice([1, 5, 16, 17, 22, 64])
            start = rng.choice([0, 0, rng.randint(1, 40), rng.randint(1, 600)])
            nblk = -(-(start + n) // bs)
            if nblk > pool_blocks:
                continue
            blocks = torch.randperm(pool_blocks, generator=gen)[:nblk]
            q = torch.randn(n, base["q"].shape[1], base["q"].shape[2], generator=gen)
            chunks.append(dict(base, q=q, blocks=blocks.contiguous(), start=start))
        if not chunks:
            continue
        width = max(c["blocks"].numel() for c in chunks) + rng.randint(0, 2)
        table = torch.zeros(len(chunks), width, dtype=torch.long)
        for i, c in enumerate(chunks):
            table[i, : c["blocks"].numel()] = c["blocks"]
        starts = torch.tensor([c["start"] for c in chunks])
        sizes = torch.tensor([c["q"].shape[0] for c in chunks])
        q = torch.cat([c["q"] for c in chunks])

        def call(q=q, table=table, starts=starts, sizes=sizes, c=base) -> torch.Tensor:
            return many(q, c["k"], c["v"], table, starts, sizes, c["bs"], c["scale"])

        got = call()
        assert torch.equal(got, torch.cat([prefill(c) for c in chunks]))
        before = torch.ops.crowdchat.omp_threads(1)
        try:
            assert torch.equal(call(), got)
        finally:
            torch.ops.crowdchat.omp_threads(before)
    bad = {
        "add up to q's rows": dict(q=torch.cat([q, q[:1]])),
        "each chunk n >= 1": dict(sizes=sizes * 0),
        "starts, sizes: int64": dict(starts=starts[:0]),
        "start out of range": dict(starts=starts * 0 + width * bs),
        "block id out of range": dict(table=table * 0 + pool_blocks),
    }
    for message, change in bad.items():
        with pytest.raises(RuntimeError, match=message):
            call(**change)


def test_the_loaded_build_has_the_instruction_sets_its_target_names() -> None:
    """`make test-avx2` tests the AVX2 loops only if its build really lacks AVX-512."""
    isa = cpu_kernels.isa().split("+")
    if os.environ.get(cpu_kernels.ARCH_VARIABLE) == "x86-64-v3":
        assert "avx2" in isa and "fma" in isa and not any(x.startswith("avx512") for x in isa)
    elif "avx512f" in Path("/proc/cpuinfo").read_text().split():
        assert "avx512f" in isa  # -march=native: this machine's own


def test_a_kernel_target_that_is_no_gcc_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ARCH_VARIABLE, "x86-64-v3 -fno-tree-vectorize")
    with pytest.raises(ValueError, match="not a GCC target name"):
        cpu_kernels.flags()
    monkeypatch.setenv(cpu_kernels.ARCH_VARIABLE, "x86-64-v3")
    monkeypatch.setenv(cpu_kernels.TUNE_VARIABLE, "znver3")
    monkeypatch.delenv(cpu_kernels.SANITIZE_VARIABLE, raising=False)  # a sanitized test run
    assert cpu_kernels.flags() == ["-O3", "-march=x86-64-v3", "-fopenmp", "-mtune=znver3"]
    monkeypatch.setenv(cpu_kernels.SANITIZE_VARIABLE, "1")
    assert "-fsanitize=address,undefined" in cpu_kernels.flags()
    monkeypatch.setenv(cpu_kernels.SANITIZE_VARIABLE, "yes")
    with pytest.raises(ValueError, match="use 1"):
        cpu_kernels.flags()


def test_a_failed_build_is_tried_once_not_in_every_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A build that fails (no compiler, here a stand-in that raises) is remembered in its
    build directory: a later process (a fresh `_loaded`) does not try it again, ~1 minute
    each on 2 cores; `python engine/kernels/cpu_kernels.py` does."""
    from torch.utils import cpp_extension

    tries: list[int] = []

    def failing(**_: object) -> None:
        tries.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a build key with nothing built
    monkeypatch.setattr(cpp_extension, "load", failing)
    for _ in range(2):  # two processes, as far as the module knows
        monkeypatch.setattr(cpu_kernels, "_loaded", [])
        assert cpu_kernels.load() is False
    assert tries == [1]
    assert "no compiler here" in (cpu_kernels.build_dir() / cpu_kernels.FAILED).read_text()
    monkeypatch.setattr(cpu_kernels, "_loaded", [])
    with pytest.raises(SystemExit):  # asked for by hand: tried again
        cpu_kernels.main()
    assert tries == [1, 1]

"""The CPU decode attention kernel (engine/kernels/csrc/paged_decode.cpp) against attention
computed in float64
from the same blocks: seeded random shapes, pool dtypes, block tables and lengths
(chunk edges included); a sequence's output does not depend on the rest of its batch; bad
tables and lengths raise instead of reading outside the pool. Its prefill sibling: causal
within float64 and bitwise the decode of each token. A restore's copy into the pool, from
memory and straight from a file. Then the
steps' glue ops: `rope_store`, `round_to_bf16` and `silu_mul` bitwise what Python and ATen
compute, and bad inputs refused (the whole layer's bitwise equality is
tests/test_lean_llama.py's)."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu_kernels

CHUNK = 512  # the kernel's tokens per work item (kChunk)


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.Kernel:
    k = cpu_kernels.decode_attention()
    assert k is not None, "make builds it: python engine/kernels/cpu_kernels.py"
    return k


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
    and bitwise what the decode kernel gives the same token at the same context."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(8):
        c = prefill_case(rng, gen)
        got = prefill(c)
        assert got.dtype == torch.float32 and got.shape == c["q"].shape
        decodes = as_decodes(c)
        assert (got.double() - reference(decodes)).abs().max() < 2e-5
        assert torch.equal(got, run(kernel, decodes))


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


@pytest.mark.parametrize("seed", range(4))
def test_rope_store_equals_rope_and_index_copy_in_python_bitwise(kernel, seed: int) -> None:
    """`crowdchat::rope_store` against transformers' RoPE (`x * cos + rotate_half(x) * sin`)
    and the pool write as engine.model.attention does it, on seeded shapes and pool dtypes."""
    from transformers.models.llama.modeling_llama import rotate_half

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(5):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        hkv, group, d = rng.choice([1, 2, 3]), rng.choice([1, 3, 4]), rng.choice([32, 64, 128])
        t, slots_n = rng.randint(1, 9), 64
        h = hkv * group
        qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen) * rng.choice([0.01, 1.0, 30.0])
        angles = torch.rand(t, d // 2, generator=gen) * 100
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        slots = torch.randperm(slots_n, generator=gen)[:t]
        kc, vc = (torch.zeros(hkv, slots_n, d, dtype=dtype) for _ in range(2))
        q = torch.ops.crowdchat.rope_store(qkv, cos, sin, kc, vc, slots, h, hkv)
        qk = qkv[:, : (h + hkv) * d].view(t, h + hkv, d)
        qk = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
        ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
        ref_k.index_copy_(1, slots, qk[:, h:].transpose(0, 1).to(dtype))
        ref_v.index_copy_(
            1, slots, qkv[:, (h + hkv) * d :].view(t, hkv, d).transpose(0, 1).to(dtype)
        )
        assert torch.equal(q, qk[:, :h])
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
        with pytest.raises(RuntimeError, match="slot out of range"):
            bad = slots.clone()
            bad[-1] = slots_n
            torch.ops.crowdchat.rope_store(qkv, cos, sin, kc, vc, bad, h, hkv)
        with pytest.raises(RuntimeError, match="qkv"):
            torch.ops.crowdchat.rope_store(qkv[:, 1:], cos, sin, kc, vc, slots, h, hkv)


def test_the_layer_and_norm_ops_refuse_bad_inputs(kernel) -> None:
    x, w = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.crowdchat.rms_norm(x, torch.ones(63), 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.crowdchat.rms_norm(x.double(), w, 1e-5)
    empty = torch.empty(0)
    with pytest.raises(RuntimeError, match="10 tensors"):
        torch.ops.crowdchat.decode_layer(
            x, [w], 1e-5, x, x, empty, empty, empty, empty, empty, 16, 1.0, 1, 1
        )


@pytest.mark.parametrize("seed", range(3))
def test_round_to_bf16_equals_atens_casts_bitwise(kernel, seed: int) -> None:
    """Every float32 bit pattern kind (random bits: normals, subnormals, inf, NaN; values across
    the whole range; ties), out of place and in place, at sizes either side of the thread grain;
    a NaN stays a NaN."""
    gen = torch.Generator().manual_seed(seed)
    n = [7, 1000, (1 << 17) + 3][seed]
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64)
    ties = torch.randint(0, 2**15, (n,), generator=gen, dtype=torch.int64) << 16 | 0x8000
    for x in (
        bits.to(torch.int32).view(torch.float32),
        ties.to(torch.int32).view(torch.float32),
        torch.randn(n, generator=gen) * torch.logspace(-40, 38, n),
        torch.tensor([float("inf"), -float("inf"), 3.4e38, -3.4e38, 0.0, -0.0, 1e-45]),
    ):
        ref = x.to(torch.bfloat16).to(torch.float32)
        for out in (
            torch.ops.crowdchat.round_to_bf16(x),
            torch.ops.crowdchat.round_to_bf16_(x.clone()),
        ):
            nan = ref.isnan()
            assert torch.equal(out.isnan(), nan)
            assert torch.equal(out[~nan].view(torch.int32), ref[~nan].view(torch.int32))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.crowdchat.round_to_bf16(torch.ones(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.crowdchat.round_to_bf16_(torch.ones(4, 4).t())


def test_silu_mul_equals_f_silu_times_up_bitwise(kernel) -> None:
    """On slices of one fused output (as the layers pass them) and on separate tensors."""
    gen = torch.Generator().manual_seed(0)
    for rows, inner in ((1, 1536), (33, 1536), (5, 7)):
        gu = torch.randn(rows, 2 * inner, generator=gen) * 4
        for gate, up in ((gu[:, :inner], gu[:, inner:]), (gu[:, inner:].clone(), gu[:, :inner])):
            ref = torch.nn.functional.silu(gate) * up
            assert torch.equal(torch.ops.crowdchat.silu_mul(gate, up), ref)
    with pytest.raises(RuntimeError, match="gate, up"):
        torch.ops.crowdchat.silu_mul(torch.ones(2, 5), torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="gate, up"):
        torch.ops.crowdchat.silu_mul(torch.ones(5, 2).t(), torch.ones(2, 5))


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

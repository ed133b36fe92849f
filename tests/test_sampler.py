"""The sampler draws from exactly the distribution that temperature, top-k and top-p define;
a seeded request draws the same tokens alone or in any batch."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels import cpu_kernels, triton_attention, triton_sample
from engine.model import sampler
from engine.model.sampler import CANDIDATES, penalize, sample, uniforms
from engine.sequence import SamplingParams, Sequence

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: Triton's interpreter


def triton_picks(rows: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The Triton pick where it runs (a GPU, else the interpreter), back on the rows' device."""
    return triton_sample.sample_rows(rows.to(DEVICE), u.to(DEVICE)).to(rows.device)


@pytest.fixture(params=["aten", "kernel", "triton"])
def plain_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Temperature-only rows picked by ATen's ops, by crowdchat's CPU kernel
    (csrc/sample.cpp) or by the CUDA path's Triton kernel (here under Triton's interpreter),
    whichever the test runs with."""
    if request.param == "kernel":
        if DEVICE == "cuda":  # its load would build the CPU kernels on the GPU machine
            pytest.skip("the CPU kernel's path: tested on CPU machines")
        if not cpu_kernels.load():
            pytest.skip("crowdchat's CPU kernels are not built here")
    elif request.param == "triton":
        if not triton_attention.available():
            pytest.skip("triton not installed")
        monkeypatch.setattr(sampler, "_plain_picks", triton_picks)
        monkeypatch.setattr(cpu_kernels, "loaded", lambda: False)  # not the kernel's own path
    else:
        monkeypatch.setattr(cpu_kernels, "loaded", lambda: False)
    return request.param


def sample_row(row: torch.Tensor, seq: Sequence) -> int:
    """One row sampled alone."""
    return sample(row[None], [seq], stop_ids=[])[0]


def draws(logits: torch.Tensor, params: SamplingParams, n: int, rows: int = 50) -> torch.Tensor:
    """The share of `n` draws that picked each token, `rows` sequences at a time."""
    seqs = [
        Sequence([1], SamplingParams(**{**vars(params), "seed": params.seed + i}))
        for i in range(rows)
    ]
    counts = torch.zeros(logits.numel())
    batch = logits.expand(rows, -1)
    for _ in range(n // rows):
        for t in sample(batch, seqs, stop_ids=[]):
            counts[t] += 1
    return counts / (n // rows * rows)


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The textbook definition: scale, sort everything, cut top-k then top-p, renormalize."""
    row = logits / p.temperature
    vals, idx = torch.sort(row, descending=True)
    if p.top_k:
        vals, idx = vals[: p.top_k], idx[: p.top_k]
    probs = vals.softmax(-1)
    keep = max(int(((probs.cumsum(-1) - probs) < p.top_p).sum()), 1)
    out = torch.zeros_like(logits)
    out[idx[:keep]] = probs[:keep] / probs[:keep].sum()
    return out


def test_matches_the_reference_distribution(plain_path: str) -> None:
    if plain_path == "triton":  # 20,000 programs: minutes in the interpreter
        pytest.skip("the Triton pick is checked against the exact inverse CDF below")
    torch.manual_seed(0)
    logits = torch.randn(40) * 2
    for params in (
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_p=0.8, seed=2),
        SamplingParams(temperature=1.3, top_k=5, seed=3),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.5, seed=4),
    ):
        got = draws(logits, params, 20_000)
        want = reference(logits, params)
        assert (got - want).abs().max() < 0.015, params
        assert got[want == 0].sum() == 0  # nothing outside the nucleus / top-k, ever


def test_flat_distributions_fall_back_to_the_full_sort() -> None:
    logits = torch.zeros(CANDIDATES * 4)  # the top candidates hold only 25% of the mass
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    got = draws(logits, params, 4000)
    assert int((got > 0).sum()) > CANDIDATES * 2  # drew from well beyond the candidates


def test_seeds_reproduce() -> None:
    logits = torch.randn(49152)
    a = [sample_row(logits, s) for s in [Sequence([1], SamplingParams(seed=9))] * 20]
    b = [sample_row(logits, s) for s in [Sequence([1], SamplingParams(seed=9))] * 20]
    assert a == b and len(set(a)) > 5


def test_min_tokens_masks_stop_ids_on_float32_inference_logits() -> None:
    with torch.inference_mode():  # the model's logits are inference tensors
        logits = torch.zeros(2, 8)
        logits[:, 3] = 10.0  # the stop id would win
    seqs = [
        Sequence([1], SamplingParams(temperature=0, min_new_tokens=2)),
        Sequence([1], SamplingParams(temperature=0)),
    ]
    assert sample(logits, seqs, stop_ids=[3]) == [0, 3]


def test_sampling_leaves_the_models_logits_as_they_were() -> None:
    """The sampler works on its own copy (masks, penalties and temperatures in place there):
    the logits it was given, inference tensors or not, bfloat16 or float32, are unchanged."""
    for dtype in (torch.float32, torch.bfloat16):
        with torch.inference_mode():
            logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
        before = logits.clone()
        seqs = [
            Sequence([1, 5], SamplingParams(temperature=0.7, min_new_tokens=2, seed=1)),
            Sequence([1, 5], SamplingParams(temperature=0.9, repetition_penalty=1.3, seed=2)),
            Sequence([1, 5], SamplingParams(temperature=0, presence_penalty=0.5)),
        ]
        picks = sample(logits, seqs, stop_ids=[3])
        assert torch.equal(logits, before)
        for s in seqs:  # the same draws again, on logits given up (worked on in place)
            s.draws = 0
        with torch.inference_mode():
            assert sample(logits.clone(), seqs, stop_ids=[3], owned=True) == picks


def penalized_reference(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """vLLM's `apply_penalties`, written out token by token."""
    p, row = seq.params, logits.clone()
    out = seq.generated_ids
    for t in set(seq.token_ids):
        if p.repetition_penalty != 1:
            v = row[t]
            row[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for t in set(out):
        row[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return row


def test_penalties_match_vllms_formula_and_leave_other_rows_alone() -> None:
    rng = torch.Generator().manual_seed(0)
    for trial in range(20):
        v = 64
        with torch.inference_mode():  # the model's logits are inference tensors
            logits = torch.randn(4, v, generator=rng) * 3
        seqs = []
        for i in range(4):
            ids = torch.randint(0, v, (12,), generator=rng).tolist()
            params = SamplingParams(
                temperature=0,
                presence_penalty=round(float(torch.rand(1, generator=rng)) * 4 - 2, 2),
                frequency_penalty=round(float(torch.rand(1, generator=rng)) * 4 - 2, 2),
                repetition_penalty=round(float(torch.rand(1, generator=rng)) * 1.9 + 0.1, 2),
            )
            seq = Sequence(ids[:5], params if i % 2 else SamplingParams(temperature=0))
            seq.token_ids += ids[5:]  # 7 generated tokens
            seqs.append(seq)
        want = [
            int(penalized_reference(logits[i], s).argmax())
            if s.params.penalized
            else int(logits[i].argmax())
            for i, s in enumerate(seqs)
        ]
        assert sample(logits, seqs, stop_ids=[]) == want, trial
        got = penalize(logits[1::2], seqs[1::2])
        for j, i in enumerate((1, 3)):
            assert torch.allclose(got[j], penalized_reference(logits[i], seqs[i])), trial


def test_a_frequency_penalty_moves_the_pick_off_a_repeated_token() -> None:
    logits = torch.zeros(8)
    logits[5], logits[6] = 3.0, 2.5
    seq = Sequence([1, 2], SamplingParams(temperature=0, frequency_penalty=0.2))
    seq.token_ids += [5, 5, 5]  # generated three times: 3.0 - 0.6 < 2.5
    assert sample(logits[None], [seq], stop_ids=[]) == [6]
    seq = Sequence([5], SamplingParams(temperature=0, repetition_penalty=1.5))  # in the prompt
    assert sample(logits[None], [seq], stop_ids=[]) == [6]  # 3.0 / 1.5 < 2.5


def test_uniforms_are_splitmix64_bit_for_bit() -> None:
    """The counter-based generator in int64 tensor arithmetic (wrapping, logical shifts) against
    splitmix64 in Python integers, for seeds and counters of every size and sign."""
    mask = (1 << 64) - 1

    def splitmix64(seed: int, counter: int) -> float:
        z = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return ((z ^ (z >> 31)) >> 11) * 2.0**-53

    rng = random.Random(0)
    seeds = [0, 1, (1 << 63) - 1, -(1 << 63), -1] + [
        rng.getrandbits(64) - (1 << 63) for _ in range(200)
    ]
    counters = [0, 1, 7, 1 << 40] + [rng.getrandbits(31) for _ in range(201)]
    got = uniforms(torch.tensor(seeds), torch.tensor(counters)).tolist()
    assert got == [splitmix64(s & mask, c) for s, c in zip(seeds, counters, strict=True)]
    assert all(0 <= x < 1 for x in got) and len(set(got)) == len(got)


def test_a_seeded_request_draws_the_same_tokens_alone_or_in_any_batch(plain_path: str) -> None:
    """Seeded random rows of every kind (greedy, temperature only, top-k, top-p, both,
    penalties, min-tokens) sampled together for several steps and each alone: the same
    tokens; rows, vocabulary sizes and parameters seeded at random."""
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for case in range(25):
        n, v = rng.randint(1, 24), rng.choice([2, 37, 1500, CANDIDATES + 5, 50_000])
        logits = torch.randn(n, v, generator=gen) * rng.uniform(0.1, 20)
        params = [
            SamplingParams(
                temperature=rng.choice([0, 0.3, 1.0, 1.7]),
                top_k=rng.choice([0, 0, 1, 5, 40]),
                top_p=rng.choice([1.0, 1.0, 0.5, 0.95]),
                repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
                frequency_penalty=rng.choice([0.0, 0.0, 0.5]),
                min_new_tokens=rng.choice([0, 0, 2]),
                max_new_tokens=8,
                seed=case * 100 + i,
            )
            for i in range(n)
        ]
        prompts = [[rng.randrange(v) for _ in range(rng.randint(1, 6))] for _ in range(n)]
        batched = [Sequence(list(p), sp) for p, sp in zip(prompts, params, strict=True)]
        alone = [Sequence(list(p), sp) for p, sp in zip(prompts, params, strict=True)]
        for _ in range(3):
            got = sample(logits, batched, stop_ids=[0])
            want = [sample(logits[i : i + 1], [alone[i]], stop_ids=[0])[0] for i in range(n)]
            assert got == want, (case, n, v)
            for seq, t in zip(batched + alone, got + want, strict=True):
                seq.token_ids.append(t)


def test_unseeded_requests_draw_differently() -> None:
    logits = torch.zeros(1, 1000)
    picks = {sample(logits, [Sequence([1], SamplingParams())], stop_ids=[])[0] for _ in range(20)}
    assert len(picks) > 10


def inverse_cdf_cases(gen: torch.Generator, sizes: tuple[int, ...]):  # noqa: ANN201
    """Per vocabulary size: float32 rows of one logit vector (a third -inf) under 200
    uniforms spread over [0, 1) (0 and just below 1 among them), the uniforms, the float64
    inverse CDF's picks, where u x total lies clear of a boundary, and the weights."""
    for v in sizes:
        row = torch.randn(v, generator=gen, dtype=torch.float64) * 4
        if v > 2:
            row[torch.randperm(v, generator=gen)[: v // 3]] = float("-inf")
        us = torch.cat([torch.tensor([0.0, 1 - 2**-53]), torch.rand(198, generator=gen).double()])
        rows = row.float()[None].repeat(len(us), 1).contiguous()
        w = (row.float().double() - row.max()).exp()
        cdf = w.cumsum(0)
        at = us * cdf[-1]
        want = torch.searchsorted(cdf, at[:, None], right=True)[:, 0].clamp(max=v - 1)
        clear = (cdf[None, :] - at[:, None]).abs().amin(1) > 1e-5 * cdf[-1]
        yield v, rows, us, want, clear, w


def test_the_triton_sampler_picks_the_float64_inverse_cdf() -> None:
    """The CUDA path's Triton pick (engine/kernels/triton_sample.py, under the interpreter
    here) against the exact inverse CDF: the same token wherever u x total lies clear of a
    boundary, never a -inf logit, one block and several (4,096 logits a pass), no rows."""
    if not triton_attention.available():
        pytest.skip("triton not installed")
    gen = torch.Generator().manual_seed(4)
    for v, rows, us, want, clear, w in inverse_cdf_cases(gen, (1, 5, 64, 65, 4097, 9000)):
        got = triton_picks(rows, us)
        assert torch.equal(got[clear], want[clear]), v
        assert bool((w[got] > 0).all()), v  # never a -inf logit
    assert triton_picks(torch.empty(0, 7), torch.empty(0).double()).numel() == 0


def test_the_cpu_kernel_picks_the_float64_inverse_cdf() -> None:
    """crowdchat::sample_rows_ against the exact inverse CDF in float64, at 200 uniforms a
    row spread over [0, 1): the same token wherever u x total lies clear of a boundary (the
    kernel's exp is within a few ulp of exp); -inf logits (min-tokens' stop ids) never drawn,
    not even at u = 0 or just below 1; rows of every tail length; no rows."""
    if not cpu_kernels.load():
        pytest.skip("crowdchat's CPU kernels are not built here")
    gen = torch.Generator().manual_seed(3)
    for v, rows, us, want, clear, w in inverse_cdf_cases(gen, (1, 5, 16, 63, 64, 65, 1000, 49_152)):
        got = torch.ops.crowdchat.sample_rows_(rows, us)
        assert torch.equal(got[clear], want[clear]), v
        assert bool((w[got] > 0).all()), v  # never a -inf logit
    empty = torch.empty(0, 7)
    assert torch.ops.crowdchat.sample_rows_(empty, torch.empty(0, dtype=torch.float64)).numel() == 0
    with pytest.raises(RuntimeError, match="u: float64"):
        torch.ops.crowdchat.sample_rows_(torch.zeros(2, 3), torch.zeros(2))


def test_the_cpu_kernel_takes_greedy_rows_argmax_as_torch_does() -> None:
    """Temperature 0 in the kernel is torch.argmax: the first of tied largest logits, the
    first NaN where a row holds one, -inf rows; lengths off the vector width; the greedy rows'
    logits left as they were; a negative or NaN temperature refused."""
    if not cpu_kernels.load():
        pytest.skip("crowdchat's CPU kernels are not built here")
    gen = torch.Generator().manual_seed(5)
    for v in (1, 7, 16, 17, 100, 49_152):
        rows = torch.randint(-3, 4, (12, v), generator=gen).float()  # many ties
        rows[1] = float("-inf")
        rows[2, v // 2] = float("nan")
        rows[3, v - 1] = 100.0
        rows[4] = torch.randn(v, generator=gen)
        want, before = rows.argmax(-1), rows.clone()
        got = torch.ops.crowdchat.sample_rows_(rows, torch.zeros(12).double(), torch.zeros(12))
        assert torch.equal(got, want), v
        assert torch.equal(rows.nan_to_num(), before.nan_to_num()), v
    for bad in (-1.0, float("nan")):
        with pytest.raises(RuntimeError, match="temps: none negative"):
            torch.ops.crowdchat.sample_rows_(
                torch.zeros(2, 3), torch.zeros(2).double(), torch.tensor([1.0, bad])
            )


def test_one_kernel_call_picks_what_division_argmax_and_the_kernel_pick_do() -> None:
    """A step of greedy, near-greedy and temperature-only rows in random mixes (one kernel
    call, the temperatures divided inside) picks exactly what ATen's division and argmax
    followed by the kernel's pick of the divided rows give, each row what it picks alone, and
    advances only the sampled rows' draws."""
    if not cpu_kernels.load():
        pytest.skip("crowdchat's CPU kernels are not built here")
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    for trial in range(40):
        n = rng.randint(1, 9)
        temps = [rng.choice([0.0, 1e-6, 0.3, 0.8, 1.0, 1.7]) for _ in range(n)]
        logits = torch.randn(n, 3000, generator=gen) * 4
        seeds = [trial * 100 + i for i in range(n)]

        def seqs(temps: list[float] = temps, seeds: list[int] = seeds) -> list[Sequence]:
            pairs = zip(temps, seeds, strict=True)
            return [Sequence([1], SamplingParams(temperature=t, seed=s)) for t, s in pairs]

        batch = seqs()
        got = sample(logits.clone(), batch, stop_ids=[])
        alone = [
            sample(logits[i : i + 1].clone(), [s], stop_ids=[])[0] for i, s in enumerate(seqs())
        ]
        want = []
        for i, t in enumerate(temps):
            if t < sampler.GREEDY_BELOW:
                want.append(int(logits[i].argmax()))
                continue
            u = uniforms(torch.tensor([seeds[i]]), torch.tensor([0]))
            row = logits[i : i + 1] / torch.tensor([[t]], dtype=torch.float32)
            want.append(int(torch.ops.crowdchat.sample_rows_(row, u)[0]))
        assert got == want == alone, (trial, temps)
        assert [s.draws for s in batch] == [int(t >= sampler.GREEDY_BELOW) for t in temps]

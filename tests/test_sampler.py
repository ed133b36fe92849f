"""The sampler draws from exactly the distribution that temperature, top-k and top-p define."""

from __future__ import annotations

import torch

from engine.model.sampler import CANDIDATES, penalize, sample, sample_row
from engine.sequence import SamplingParams, Sequence


def draws(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    seq = Sequence([1], params)
    counts = torch.zeros(logits.numel())
    for _ in range(n):
        counts[sample_row(logits, seq)] += 1
    return counts / n


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


def test_matches_the_reference_distribution() -> None:
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
        for i in (1, 3):
            got = penalize(logits[i], seqs[i])
            assert torch.allclose(got, penalized_reference(logits[i], seqs[i])), trial


def test_a_frequency_penalty_moves_the_pick_off_a_repeated_token() -> None:
    logits = torch.zeros(8)
    logits[5], logits[6] = 3.0, 2.5
    seq = Sequence([1, 2], SamplingParams(temperature=0, frequency_penalty=0.2))
    seq.token_ids += [5, 5, 5]  # generated three times: 3.0 - 0.6 < 2.5
    assert sample(logits[None], [seq], stop_ids=[]) == [6]
    seq = Sequence([5], SamplingParams(temperature=0, repetition_penalty=1.5))  # in the prompt
    assert sample(logits[None], [seq], stop_ids=[]) == [6]  # 3.0 / 1.5 < 2.5


def test_batched_temperature_rows_pick_what_each_row_alone_picks() -> None:
    """`sample_plain` (all temperature-only rows at once) against `sample_row` per row, each
    with the same seed: seeded random logits, temperatures, vocabulary sizes and row counts
    (a seeded request gives the same reply whoever else is in its batch)."""
    gen = torch.Generator().manual_seed(0)
    for case in range(30):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        v = int(torch.randint(2, 60_000, (1,), generator=gen))
        logits = torch.randn(n, v, generator=gen) * float(torch.rand(1, generator=gen) * 20)
        temps = (torch.rand(n, generator=gen) * 2 + 1e-3).tolist()
        params = [SamplingParams(temperature=t, seed=case * 100 + i) for i, t in enumerate(temps)]
        batched = [Sequence([1], p) for p in params]
        alone = [Sequence([1], p) for p in params]
        for _ in range(3):  # each row's generator advances the same way too
            got = sample(logits, batched, [])
            want = [sample_row(logits[i], alone[i]) for i in range(n)]
            assert got == want, (case, n, v)

"""The sampler draws from exactly the distribution that temperature, top-k and top-p define."""

from __future__ import annotations

import torch

from engine.sampler import CANDIDATES, sample, sample_row
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

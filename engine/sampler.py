"""Turns each sequence's last logits into its next token: greedy, or temperature/top-k/top-p."""

from __future__ import annotations

import torch

from engine.sequence import Sequence

GREEDY_BELOW = 1e-5


def _rng(seq: Sequence) -> torch.Generator:
    if seq.rng is None:
        g = torch.Generator(device="cpu")
        if seq.params.seed is not None:
            g.manual_seed(seq.params.seed & 0xFFFF_FFFF_FFFF_FFFF)  # any int is a valid seed
        else:
            g.seed()
        seq.rng = g
    return seq.rng


def sample(logits: torch.Tensor, seqs: list[Sequence], stop_ids: list[int]) -> list[int]:
    """Next token per row of `logits` ([N, V]), one row per sequence, in order."""
    logits = logits.float()
    early = [i for i, s in enumerate(seqs)
             if s.num_generated < s.params.min_new_tokens and stop_ids]
    if early:
        logits[torch.tensor(early)[:, None], torch.tensor(stop_ids)[None, :]] = float("-inf")
    out = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.temperature < GREEDY_BELOW:
            continue  # tiny temperatures would overflow the logits: they mean greedy
        row = logits[i].to("cpu") / p.temperature  # [V]
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop tokens once the mass before them already reaches top_p (keep at least one)
            drop = probs.cumsum(-1) - probs >= p.top_p
            row = row.index_fill(0, order[drop], float("-inf"))
        probs = row.softmax(-1)
        out[i] = int(torch.multinomial(probs, 1, generator=_rng(seq)))
    return out

"""Turns each sequence's last logits into its next token: greedy, or temperature/top-k/top-p,
after min-tokens and the repetition / frequency / presence penalties of the rows that ask.

Every step samples all its rows at once, on the logits' device: per-row parameters travel
to the device in one non-blocking copy from pinned memory, and the one read back is the
picked token ids (`sample`), so on CUDA nothing in between waits for the host.

Sampling is exact (the same distribution as sorting the whole vocabulary): one uniform number
per row and an inverse-CDF lookup, not `torch.multinomial`. On the CPU top-k and top-p look
among the top 1024 candidates first instead of sorting 49k logits (~2.7 ms a row), falling
back to the sort for a row whose candidates hold less than its top-p; on CUDA every such row
is sorted (fast there, and no check that would wait for the device).

Random numbers are counter-based: a row's uniform is splitmix64 of its request's seed and the
number of draws it has made, computed on the device. A seeded request therefore draws the same
tokens alone or in any batch, on any device; an unseeded one gets a random seed once.
"""

from __future__ import annotations

import secrets

import torch

from engine.kernels import cpu_kernels, triton_sample
from engine.sequence import Sequence

GREEDY_BELOW = 1e-5  # tiny temperatures would overflow the logits: they mean greedy
CANDIDATES = 1024  # where the top-p nucleus is looked for first, on the CPU


def _int64(x: int) -> int:
    """A 64-bit pattern as the signed int64 torch holds it."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


GOLDEN, MIX1, MIX2 = (
    _int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's `>>` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per (seed, counter), int64 tensors: the `counter`-th output of
    splitmix64 seeded with `seed` (int64 arithmetic wraps), its top 53 bits, float64."""
    z = seeds + (counters + 1) * GOLDEN
    z = (z ^ _shr(z, 30)) * MIX1
    z = (z ^ _shr(z, 27)) * MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double() * 2.0**-53


def _seed(seq: Sequence) -> int:
    if seq.seed is None:
        p = seq.params.seed
        seq.seed = _int64(p if p is not None else secrets.randbits(64))
    return seq.seed


def _to(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """`values` on `device`: on CUDA through pinned memory, without waiting."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def _padded(device: torch.device, lists: list[list[int]], pad: int) -> torch.Tensor:
    """Token id lists as one int64 [len(lists), longest] tensor on `device`, `pad` after each."""
    width = max(map(len, lists), default=0) or 1
    return _to(device, [ids + [pad] * (width - len(ids)) for ids in lists], torch.int64)


def penalize(rows: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """`rows` ([N, V] logits, one per sequence) with the sequences' penalties, as vLLM applies
    them: repetition over the prompt and the output, then frequency and presence over the
    output. Out of place (on a copy with a column for the id lists' padding); each penalty
    touches only the tokens it concerns (a gather and a scatter), not the whole vocabulary."""
    n, v = rows.shape
    dev = rows.device
    rep, freq, pres = (
        _to(dev, [getattr(s.params, k) for s in seqs], rows.dtype)[:, None]
        for k in ("repetition_penalty", "frequency_penalty", "presence_penalty")
    )
    # column v takes the padding of the id lists and is dropped at the end; a token listed
    # twice is written twice with the same value
    work = torch.cat([rows, rows.new_zeros(n, 1)], 1)
    seen = _padded(dev, [s.token_ids for s in seqs], v)
    vals = work.gather(1, seen)
    work.scatter_(1, seen, torch.where(vals > 0, vals / rep, vals * rep))  # x / 1 == x * 1 == x
    out = _padded(dev, [s.generated_ids for s in seqs], v)
    counts = torch.zeros(n, v + 1, dtype=rows.dtype, device=dev)
    counts.scatter_add_(1, out, torch.ones_like(out, dtype=rows.dtype))
    delta = freq * counts.gather(1, out) + pres
    work.scatter_(1, out, work.gather(1, out) - delta)
    return work[:, :v]


def _pick(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `weights` ([N, W], non-negative; turned into their running sums in place)
    the index drawn with probability proportional to them, by the row's uniform `u` ([N])."""
    cdf = weights.cumsum_(-1)
    at = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, at, right=True)[:, 0].clamp(max=weights.shape[1] - 1)


def _plain(seq: Sequence) -> bool:
    """Whether a sampled row is temperature-only (no top-k, no top-p): the API's default."""
    return not seq.params.top_k and seq.params.top_p >= 1


def _draws(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    """Each sequence's next uniform (float64, on `device`); their draw counters advance."""
    seeds = _to(device, [_seed(s) for s in seqs], torch.int64)
    u = uniforms(seeds, _to(device, [s.draws for s in seqs], torch.int64))
    for s in seqs:
        s.draws += 1
    return u


def _cpu_picks(logits: torch.Tensor, seqs: list[Sequence], sampled: list[int]) -> torch.Tensor:
    """A step whose rows are all greedy or temperature-only, on crowdchat's CPU kernel
    (csrc/sample.cpp): one call divides, picks and takes the greedy rows' argmax, where ATen's
    division and argmax passes over the step's logits took ~2.3 ms at 32 x 49,152."""
    n = len(seqs)
    temps = torch.zeros(n, dtype=torch.float32)
    u = torch.zeros(n, dtype=torch.float64)
    if sampled:
        at = torch.tensor(sampled, dtype=torch.int64)
        picked = [seqs[i] for i in sampled]
        temps.index_copy_(0, at, torch.tensor([s.params.temperature for s in picked]))
        u.index_copy_(0, at, _draws(picked, logits.device))
    return torch.ops.crowdchat.sample_rows_(logits, u, temps)


def _plain_picks(rows: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Picks for temperature-only rows (`rows` already divided, ours to overwrite): on the CPU
    crowdchat's kernel where it is built (csrc/sample.cpp: two passes a row, the rows over the
    cores: 0.41 ms against 0.92 at 32 x 49,152), on CUDA its Triton one (one launch for the
    batch: engine.kernels.triton_sample), else max, exp and the running sums in ATen."""
    if rows.is_cpu and rows.is_contiguous() and cpu_kernels.loaded():
        return torch.ops.crowdchat.sample_rows_(rows, u)
    if rows.is_cuda and rows.is_contiguous() and triton_sample.available():
        return triton_sample.sample_rows(rows, u)
    return _pick(rows.sub_(rows.amax(-1, keepdim=True)).exp_(), u)


def _filtered(rows: torch.Tensor, seqs: list[Sequence], u: torch.Tensor) -> torch.Tensor:
    """Picks for rows with top-k and/or top-p (`rows` already divided by their temperatures):
    top-k first, then top-p within it (the usual order), among the sorted candidates."""
    n, v = rows.shape
    dev = rows.device
    k = _to(dev, [s.params.top_k or v for s in seqs], torch.int64)[:, None]
    top_p = _to(dev, [s.params.top_p for s in seqs], rows.dtype)[:, None]
    # candidates: the largest top-k, or CANDIDATES where a row has top-p only
    c = max(s.params.top_k or CANDIDATES for s in seqs)
    c = v if dev.type != "cpu" or c > CANDIDATES else min(c, v)
    vals, idx = torch.topk(rows, c) if c < v else torch.sort(rows, descending=True)
    inside = torch.arange(c, device=dev)[None, :] < k
    # top-k rows: probabilities within the top k; others: the true ones (over all of V)
    norm = vals[:, :1]
    if any(not s.params.top_k or s.params.top_k >= v for s in seqs):
        norm = torch.where(k < v, norm, torch.logsumexp(rows, -1, keepdim=True))
    probs = torch.where(inside, (vals - norm).exp(), torch.zeros_like(vals))
    probs = torch.where(k < v, probs / probs.sum(-1, keepdim=True), probs)
    if c < v:  # a flat distribution whose nucleus is not among the candidates: sort it all
        short = ((k >= v) & (probs.sum(-1, keepdim=True) < top_p))[:, 0]
        if bool(short.any()):
            whole = _filtered_sorted(rows[short], top_p[short], u[short])
            picks = _nucleus_pick(probs, idx, top_p, u)
            return picks.index_put((short.nonzero()[:, 0],), whole)
    return _nucleus_pick(probs, idx, top_p, u)


def _filtered_sorted(rows: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Picks for top-p rows without top-k whose nucleus is not among the candidates: the
    whole vocabulary sorted."""
    vals, idx = torch.sort(rows, descending=True)
    probs = (vals - torch.logsumexp(rows, -1, keepdim=True)).exp()
    return _nucleus_pick(probs, idx, top_p, u)


def _nucleus_pick(
    probs: torch.Tensor, idx: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """Cut each row's sorted `probs` to its top-p nucleus (at least one), pick, map back."""
    keep = ((probs.cumsum(-1) - probs) < top_p).sum(-1, keepdim=True).clamp(min=1)
    cols = torch.arange(probs.shape[1], device=probs.device)[None, :]
    probs = torch.where(cols < keep, probs, torch.zeros_like(probs))
    return idx.gather(1, _pick(probs, u)[:, None])[:, 0]


def sample_tensor(
    logits: torch.Tensor, seqs: list[Sequence], stop_ids: list[int], owned: bool = False
) -> torch.Tensor:
    """Next token per row of `logits` ([N, V], one row per sequence) as an int64 tensor on the
    logits' device; each sampled sequence's draw counter advances. `owned`: the caller gives
    the logits up (the runner's step), so float32 ones are worked on in place, not copied."""
    # one float32 tensor of our own, changed in place below: each out-of-place step was
    # another pass over N x V floats (~0.3 ms at 32 x 49,152)
    logits = logits.to(torch.float32, copy=not owned)
    dev, n = logits.device, len(seqs)
    early = [i for i, s in enumerate(seqs) if s.num_generated < s.params.min_new_tokens]
    if early and stop_ids:
        rows = _to(dev, early, torch.int64)[:, None]
        cols = _to(dev, stop_ids, torch.int64)[None, :]
        logits.index_put_((rows, cols), torch.full((), float("-inf"), device=dev))
    penalized = [i for i, s in enumerate(seqs) if s.params.penalized]
    if penalized:
        which = _to(dev, penalized, torch.int64)
        rows = penalize(logits.index_select(0, which), [seqs[i] for i in penalized])
        logits.index_put_((which,), rows)
    sampled = [i for i, s in enumerate(seqs) if s.params.temperature >= GREEDY_BELOW]
    if logits.is_cpu and logits.is_contiguous() and n and cpu_kernels.loaded():
        if all(_plain(seqs[i]) for i in sampled):
            return _cpu_picks(logits, seqs, sampled)
    if not sampled:
        return logits.argmax(-1)
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if len(sampled) < n:  # greedy rows: their argmax
        greedy = _to(dev, sorted(set(range(n)) - set(sampled)), torch.int64)
        out.index_copy_(0, greedy, logits.index_select(0, greedy).argmax(-1))
    picked = [seqs[i] for i in sampled]
    u = _draws(picked, dev)
    temps = _to(dev, [s.params.temperature for s in picked], logits.dtype)[:, None]
    plain = [j for j, s in enumerate(picked) if _plain(s)]
    if len(plain) == n:  # every row temperature-only (the API's default): no index copies
        return _plain_picks(logits.div_(temps), u)
    at = _to(dev, sampled, torch.int64)
    rows = (logits if len(sampled) == n else logits.index_select(0, at)).div_(temps)
    filtered = sorted(set(range(len(picked))) - set(plain))
    picks = torch.empty(len(picked), dtype=torch.int64, device=dev)
    if plain:  # temperature only (the API's default): the whole vocabulary, no sort, in place
        j = _to(dev, plain, torch.int64)
        part = rows if len(plain) == len(picked) else rows.index_select(0, j)
        picks.index_copy_(0, j, _plain_picks(part, u.index_select(0, j)))
    if filtered:
        j = _to(dev, filtered, torch.int64)
        part = [picked[f] for f in filtered]
        picks.index_copy_(0, j, _filtered(rows.index_select(0, j), part, u.index_select(0, j)))
    return out.index_copy_(0, at, picks)


def sample(
    logits: torch.Tensor, seqs: list[Sequence], stop_ids: list[int], owned: bool = False
) -> list[int]:
    """Next token per row of `logits` ([N, V]), one row per sequence, in order: the step's
    one read back from the device (`owned` as `sample_tensor` takes it)."""
    return sample_tensor(logits, seqs, stop_ids, owned).tolist()

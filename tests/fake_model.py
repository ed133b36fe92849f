"""A model-free stand-in for the engine's step runner: the real scheduler, pool, KV cache and
engine loop run around it in milliseconds, and it checks their work on every step.

The fake "model" is a deterministic function of the token ids so far, so every request has one
exact expected reply (`expected_reply`), whatever the batching, chunking, preemption or KV
reuse did. Its KV cache holds each position's token id, so a step that attends to stale or
foreign KV is caught the moment it runs.
"""

from __future__ import annotations

import random
import time

import torch

from engine import Engine, EngineConfig
from engine.block_hash import extend_hashes
from engine.core.scheduler import MIN_PREFILL_CHUNK
from engine.model.kv_cache import KVCache
from engine.model.loader import LoadedModel
from engine.model.plan import StepPlan
from engine.sequence import PLACEHOLDER, Sequence

VOCAB = 1000
EOS = 2


class FakeTokenizer:
    """One lowercase letter per token id; enough for the detokenizer and stop strings."""

    eos_token_id = EOS

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids if t != EOS)


def fake_loaded(max_position: int = 512) -> LoadedModel:
    """A LoadedModel with no weights: 1 layer, 1 KV head of width 1, float32 on the CPU."""
    return LoadedModel.stand_in(FakeTokenizer(), VOCAB, max_position, "fake")  # type: ignore[arg-type]


def next_token(ids: list[int]) -> int:
    """The fake model's greedy choice after `ids`: EOS about one time in 29."""
    h = (sum(ids[-4:]) * 2654435761 + len(ids) * 40503) % 1_000_003
    return EOS if h % 29 == 0 else 3 + h % (VOCAB - 3)


def expected_reply(
    prompt: list[int], max_new_tokens: int, max_model_len: int, ignore_eos: bool = False
) -> list[int]:
    """What a request must produce, run alone and without any cache."""
    ids, out = list(prompt), []
    while True:
        t = next_token(ids)
        ids.append(t)
        out.append(t)
        if (t == EOS and not ignore_eos) or len(out) >= max_new_tokens or len(ids) >= max_model_len:
            return out


class FakeRunner:
    """The StepRunner protocol without a model. On every step it asserts that block
    accounting is exact, the step fits its budget, no prompt token is sampled, and every
    position a sequence attends to holds that sequence's own token in the KV cache."""

    def __init__(self, loaded: LoadedModel, cache: KVCache, step_s_per_token: float = 0.0) -> None:
        self.cache = cache
        self.stop_ids = [EOS]
        self.engine: Engine | None = None  # set right after the engine is built
        self.steps = 0
        self.step_s_per_token = step_s_per_token
        self._checked: dict[int, int] = {}  # seq id -> positions whose KV was checked

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs = self.cache.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def run(self, plan: StepPlan) -> dict[Sequence, int]:
        return self._compute(plan, {})

    def _compute(self, plan: StepPlan, fed: dict[Sequence, int]) -> dict[Sequence, int]:
        """The step; `fed`: the token a decode's placeholder stands for (the device's)."""
        self.steps += 1
        engine = self.engine
        assert engine is not None
        engine.scheduler.check_integrity()
        assert plan.num_tokens <= max(engine.budget.last, len(plan.decodes) + MIN_PREFILL_CHUNK)
        for seq in plan.decodes:
            assert seq.num_uncomputed == 1, f"seq {seq.seq_id}: a prompt token sampled"
        for seq, n in plan.prefills:
            assert 0 < n <= seq.num_uncomputed, (seq.seq_id, n, seq.num_uncomputed)
        # every position attended to holds this sequence's own token (checked once each:
        # a position's KV changes only if its blocks change, which check_integrity covers)
        read, want, write, values = [], [], [], []
        work = [(s, 1) for s in plan.decodes] + plan.prefills
        ids_of = {s: s.token_ids if s not in fed else [*s.token_ids[:-1], fed[s]] for s, _ in work}
        for seq, n in work:
            ids = ids_of[seq]
            assert PLACEHOLDER not in ids, f"seq {seq.seq_id}: a placeholder reached the model"
            start = self._checked.get(seq.seq_id, 0)
            start = 0 if start > seq.num_computed else start  # preempted: recomputed from 0
            read += self._slots(seq, start, seq.num_computed)
            want += ids[start : seq.num_computed]
            self._checked[seq.seq_id] = seq.num_computed + n
            write += self._slots(seq, seq.num_computed, seq.num_computed + n)
            values += ids[seq.num_computed : seq.num_computed + n]
        k = self.cache.k[0][0, :, 0]  # [slots]
        assert k[torch.tensor(read, dtype=torch.long)].long().tolist() == want, "stale KV"
        k[torch.tensor(write, dtype=torch.long)] = torch.tensor(values, dtype=torch.float32)
        out = {
            seq: next_token(ids_of[seq])
            for seq, n in work
            if seq.num_computed + n == seq.num_tokens
        }
        if self.step_s_per_token:
            time.sleep(self.step_s_per_token * plan.num_tokens)
        return out


class FakeTokens:
    """A launched step's picks, which only the "device" knows until the loop reads them."""

    def __init__(self, picks: dict[Sequence, int]) -> None:
        self.sampled = list(picks)
        self.picks = picks
        self.read = False

    def tokens(self) -> list[int]:
        assert not self.read, "a step's tokens read twice"
        self.read = True
        return list(self.picks.values())


class RunAheadFakeRunner(FakeRunner):
    """FakeRunner behind the run-ahead protocol (engine.model.launched.RunsAhead), as the CUDA
    runner is: `launch` keeps a step's picks to itself until the loop reads them, and a step's
    decodes take the previous step's picks "on the device" (`feed`), so the host's token ids
    hold placeholders meanwhile; it refuses a feed one time in `refuse` (the loop must then
    read the last step's tokens first), as the real one does for penalties or wide tables."""

    runs_ahead = True

    def __init__(self, loaded: LoadedModel, cache: KVCache, step_s_per_token: float = 0.0) -> None:
        super().__init__(loaded, cache, step_s_per_token)
        self.rng = random.Random(58)
        self.refuse = 5
        self.fed_steps = 0
        self.launched: FakeTokens | None = None

    def feed(self, plan: StepPlan, prev: FakeTokens) -> dict[Sequence, int] | None:
        assert prev is self.launched and not prev.read, "fed from a step that is not the last"
        if plan.prefills or self.rng.randrange(self.refuse) == 0:
            return None
        fed = {}
        for s in plan.decodes:
            if s.token_ids[s.num_computed] == PLACEHOLDER:
                if s not in prev.picks:
                    return None
                fed[s] = prev.picks[s]
        return fed

    def launch(self, plan: StepPlan, feed: dict[Sequence, int] | None) -> FakeTokens:
        if self.launched is not None and not self.launched.read and feed is None:
            raise AssertionError("launched while the last step's tokens were unread, unfed")
        bs = self.cache.block_size
        for seq in plan.sequences:  # the prefix cache's hashes are of known tokens only
            known = [t for t in seq.token_ids if t != PLACEHOLDER]
            fresh: list[bytes] = []
            extend_hashes(fresh, known, bs, seq.cache_ns, seq.shareable_prefix)
            assert seq.block_hashes == fresh[: len(seq.block_hashes)], seq.seq_id
        self.fed_steps += feed is not None
        self.launched = FakeTokens(self._compute(plan, feed or {}))
        return self.launched


def fake_engine(
    num_blocks: int,
    block_size: int = 16,
    max_position: int = 512,
    step_s_per_token: float = 0.0,
    run_ahead: bool = False,
    **settings: object,
) -> tuple[Engine, FakeRunner]:
    """An Engine over the fake model with a pool of exactly `num_blocks` blocks (`run_ahead`:
    behind the run-ahead protocol, `RunAheadFakeRunner`)."""
    loaded = fake_loaded(max_position)
    per_block = 2 * 4 * block_size  # K and V, 1 layer, 1 head of width 1, float32
    config = EngineConfig(
        block_size=block_size, kv_budget_mb=num_blocks * per_block / 2**20, **settings
    )  # type: ignore[arg-type]
    made: list[FakeRunner] = []

    def factory(loaded: LoadedModel, cache: KVCache, max_model_len: int) -> FakeRunner:
        kind = RunAheadFakeRunner if run_ahead else FakeRunner
        made.append(kind(loaded, cache, step_s_per_token))
        return made[0]

    engine = Engine(config, loaded, runner=factory)
    made[0].engine = engine
    assert engine.pool.num_blocks == num_blocks
    return engine, made[0]

"""A request inside the engine: its tokens, its blocks, its sampling parameters."""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field

from engine.block_hash import extend_hashes
from engine.errors import InvalidRequest, PromptTooLong

MAX_STOP_STRINGS = 8
MAX_STOP_LEN = 256


# A token sampled by a step still running on the device (run-ahead, engine.core.loop): the
# scheduler counts it, the step after feeds it from the device, and the host learns its id a
# step later (`OutputProcessor.emit`). Never a real id: a placeholder that reached an embedding
# on the host would fail loudly.
PLACEHOLDER = -1

PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Temperature 0 is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    # as vLLM applies them, before temperature: the logit of each token generated so far
    # minus `frequency_penalty` x its count and `presence_penalty` once; the logit of each
    # token in the prompt or the output divided by `repetition_penalty` if positive, else
    # multiplied by it (first)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1
        )

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidRequest(msg)

        for name in ("temperature", "top_p", *PENALTIES):
            v = getattr(self, name)
            need(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                f"{name} must be a number, got {v!r}",
            )
        for name in ("top_k", "max_new_tokens", "min_new_tokens"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool), f"{name} must be an integer")
        need(0 <= self.temperature <= 2, f"temperature must be in [0, 2], got {self.temperature}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            need(-2 <= v <= 2, f"{name} must be in [-2, 2], got {v}")
        r = self.repetition_penalty
        need(0 < r <= 2, f"repetition_penalty must be in (0, 2], got {r}")
        need(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        need(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens must be in [0, max_new_tokens]",
        )
        need(
            self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
            "seed must be an integer",
        )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        need(len(stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings")
        need(
            all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LEN for s in stop),
            f"stop strings must be non-empty strings of at most {MAX_STOP_LEN} characters",
        )
        object.__setattr__(self, "stop", stop)


def check_prompt(ids: object, vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt's token ids as a list, or the error saying why it can never be served."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise InvalidRequest("the prompt is empty")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise InvalidRequest("the prompt contains invalid token ids")
    if len(ids) >= max_model_len:
        raise PromptTooLong(
            f"the prompt is {len(ids)} tokens; this server accepts at most "
            f"{max_model_len - 1} (model length and KV pool)"
        )
    return list(ids)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


_ids = itertools.count(1)


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt + generated), the KV blocks that hold them, and progress.

    `num_computed` tokens have their KV in the pool; a step computes the next ones. The last
    generated token is always uncomputed until the next step feeds it back in.
    """

    token_ids: list[int]
    params: SamplingParams
    owner: str | None = None  # whose resident KV this reuses (the session layer: a session id)
    retain: bool = False
    user: str | None = None  # whose fair share this is charged to (an identity; else the owner)
    cache_ns: str | None = None  # whose prefix cache it reads and fills (its user)
    shareable_prefix: int = 0  # leading tokens any user may share (an operator's prompt)
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    num_preemptions: int = 0
    seed: int | None = None  # the sampler's seed (int64), set at its first draw
    draws: int = 0  # random numbers drawn so far (engine/model/sampler.py's counter)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, see block_hash
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    num_hit_tokens: int = 0  # prompt tokens found in the prefix cache when admitted

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def hashes(self, block_size: int) -> list[bytes]:
        """Chain hashes of its full blocks so far (extended as tokens are generated), of
        known tokens only: never over the placeholders of steps still running."""
        ids = self.token_ids
        if ids and ids[-1] == PLACEHOLDER:
            ids = ids[: ids.index(PLACEHOLDER)]
        extend_hashes(self.block_hashes, ids, block_size, self.cache_ns, self.shareable_prefix)
        return self.block_hashes

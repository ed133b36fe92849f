"""A conversation's sampling settings: what the chat page's sliders set, kept with the
conversation like its system prompt (migration 009), and each owner's last choice, which new
conversations start from."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from engine import InvalidRequest, SamplingParams

MAX_TOKENS_STORED = 1 << 20  # a turn is clamped to --max-tokens-per-turn anyway


def _number(name: str, value: object) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value):  # type: ignore[arg-type]
        raise InvalidRequest(f"{name} must be a number, got {value!r}"[:200])
    return float(value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ChatSettings:
    """Temperature, top-p, max new tokens and repetition penalty of a conversation. The
    defaults are the page's; the ranges are the engine's (`SamplingParams`)."""

    temperature: float = 0.7
    top_p: float = 0.9
    max_tokens: int = 512
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty"):
            object.__setattr__(self, name, _number(name, getattr(self, name)))
        tokens = self.max_tokens
        if isinstance(tokens, float) and tokens.is_integer():
            tokens = int(tokens)  # a slider's value arrives as a float
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            raise InvalidRequest(f"max_tokens must be a whole number, got {tokens!r}"[:200])
        if not 1 <= tokens <= MAX_TOKENS_STORED:
            raise InvalidRequest(f"max_tokens must be in [1, {MAX_TOKENS_STORED}], got {tokens}")
        object.__setattr__(self, "max_tokens", tokens)
        self.params()  # the engine's own range checks, with its messages

    def params(self) -> SamplingParams:
        """How the conversation's replies are sampled."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_tokens,
            repetition_penalty=self.repetition_penalty,
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, value: object, base: ChatSettings | None = None) -> ChatSettings:
        """Settings from a JSON object: the fields it names over `base` (or the defaults);
        InvalidRequest for anything else (an unknown field, a wrong type, out of range)."""
        if not isinstance(value, dict):
            raise InvalidRequest("settings must be an object")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InvalidRequest(f"unknown setting {unknown[0]!r}"[:200])
        return cls(**{**(base or cls()).as_dict(), **value})

    @classmethod
    def from_json(cls, text: str | None) -> ChatSettings | None:
        """Stored settings (None for none stored); a row that no longer validates reads as
        the defaults rather than breaking the conversation."""
        if not text:
            return None
        try:
            return cls.from_dict(json.loads(text))
        except (ValueError, InvalidRequest):
            return cls()

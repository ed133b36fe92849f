"""Token ids of long texts (messages over prompt.CACHED_TEXT_CHARS), kept by total characters
rather than by count, so a conversation with long messages is not tokenized again at every
turn while memory stays bounded whatever clients send: the least recently used texts go
first once the characters kept pass the bound."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

# ~8 M characters: ~2 M token ids at ~4 characters a token, ~70 MB as Python ints
LONG_TEXT_CHARS = 8_000_000


class LongTextTokens:
    """(text, user_text) -> token ids, least recently used out past `max_chars`; thread-safe
    (turns encode on many threads)."""

    def __init__(
        self, tokenize: Callable[[str, bool], tuple[int, ...]], max_chars: int = LONG_TEXT_CHARS
    ) -> None:
        self.tokenize = tokenize
        self.max_chars = max_chars
        self.chars = 0
        self._ids: OrderedDict[tuple[str, bool], tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, text: str, user_text: bool) -> tuple[int, ...]:
        key = (text, user_text)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
                return ids
        ids = self.tokenize(text, user_text)  # outside the lock: it can take a while
        if len(text) > self.max_chars:
            return ids
        with self._lock:
            if key not in self._ids:
                self._ids[key] = ids
                self.chars += len(text)
                while self.chars > self.max_chars:
                    (old, _), _ids = self._ids.popitem(last=False)
                    self.chars -= len(old)
        return ids

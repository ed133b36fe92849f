"""bench/near_tie.py tells a near tie from a real difference, on the real embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.near_tie import TIE_NOISE, Reference, classify, greedy_path
from engine import EngineConfig

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
N = 12


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> Reference:
    return Reference.load(EngineConfig(data_dir=model_dir, quant="none", dtype="float32"))


def test_equal_replies_are_the_same(ref: Reference) -> None:
    assert classify(ref, MESSAGES, ("red", "red"), N) == {"verdict": "same"}


def test_replies_on_the_float64_path_cut_differently_are_the_same_path(ref: Reference) -> None:
    _, path, _ = greedy_path(ref, MESSAGES, N)
    whole = ref.tokenizer.decode(path)
    assert classify(ref, MESSAGES, (whole, whole + " and more"), N)["verdict"] == "same_path"


def test_a_reply_that_leaves_the_path_at_a_clear_margin_differs(ref: Reference) -> None:
    ids, path, margins = greedy_path(ref, MESSAGES, N)
    step = max(range(N), key=margins.__getitem__)  # the surest step
    wrong = ref.tokenizer.decode(path[:step]) + " zebra"
    result = classify(ref, MESSAGES, (ref.tokenizer.decode(path), wrong), N)
    assert result["verdict"] == "differs" and result["step"] == step
    assert result["margin"] > TIE_NOISE * result["float32_noise"]
    assert 0 < result["float32_noise"] < 1e-2  # float32 and float64 agree to rounding

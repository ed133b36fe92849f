"""bench/near_tie.py tells a near tie from a real difference, on the real embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.near_tie import TIE_NOISE, Reference, classify, greedy_path, judge_misses, near_tie
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


def test_misses_under_a_quantized_configuration_are_differences_unjudged(tmp_path: Path) -> None:
    miss = {"messages": MESSAGES, "session": "a", "recompute": "b", "n": N}
    judge_misses("--quant nf4 --idle-seconds 2", [miss], tmp_path)
    assert miss["verdict"]["verdict"] == "differs" and not near_tie(miss)


def test_misses_under_float32_are_judged_against_float64(ref: Reference, model_dir: Path) -> None:
    _, path, _ = greedy_path(ref, MESSAGES, N)
    whole = ref.tokenizer.decode(path)
    misses = [
        {"messages": MESSAGES, "session": whole, "recompute": whole + "!", "n": N},
        {"messages": MESSAGES, "session": whole, "recompute": "zebra", "n": N},
    ]
    judge_misses("--quant nf4 --quant none --dtype float32", misses, model_dir)
    assert [near_tie(m) for m in misses] == [True, False]
    assert misses[1]["verdict"]["step"] == 0  # "zebra" is not the first token's text

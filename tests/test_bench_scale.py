"""bench/scale.py's stickiness figure, read from vLLM's request log lines."""

from pathlib import Path

from bench.scale import SEED_BASE, sticky_fraction


def line(stamp: str, seed: int) -> str:
    return (
        f"(APIServer pid=1) INFO 12-01 {stamp} [logger.py:70] Received request cmpl-ab-0: "
        f"params: SamplingParams(n=1, temperature=0.7, top_p=1.0, top_k=0, min_p=0.0, "
        f"seed={seed}, stop=[]), lora_request: None."
    )


def test_every_turn_on_its_first_replica_is_fully_sticky(tmp_path: Path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("\n".join([line("04:00:01", SEED_BASE), line("04:00:05", SEED_BASE)]))
    b.write_text("\n".join([line("04:00:02", SEED_BASE + 1), "noise", line("04:00:09", 42)]))
    assert sticky_fraction([a, b], 2) == (1.0, [1, 1])


def test_a_turn_that_moved_counts_against_its_session(tmp_path: Path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("\n".join([line("04:00:01", SEED_BASE), line("04:00:03", SEED_BASE)]))
    b.write_text("\n".join([line("04:00:07", SEED_BASE), line("04:00:08", SEED_BASE)]))
    assert sticky_fraction([a, b], 1) == (0.5, [1, 0])


def test_no_logged_turns_give_no_figure(tmp_path: Path):
    (tmp_path / "a.log").write_text("nothing here\n")
    assert sticky_fraction([tmp_path / "a.log"], 4) == (None, [])

"""bench/crowd.py: the crowd's load against the real app in both modes, and the arithmetic of
its figures (SLO, capacity, the summary's ratios)."""

import argparse
import asyncio
import random

import pytest

from bench.crowd import capacity, plot_svg, summarize
from bench.crowd_load import Crowd, Load, Sample, conversation_script, judge, run_load
from tests.web import running_server


def test_a_conversation_script_is_varied_and_seeded():
    a = conversation_script(random.Random(1), 6)
    assert len(a) == 6 and a == conversation_script(random.Random(1), 6)
    many = {" ".join(conversation_script(random.Random(s), 6)) for s in range(20)}
    assert len(many) == 20  # not one repeated text


def test_a_request_meets_the_slo_only_within_both_bounds_and_without_error():
    crowd = Crowd(
        samples=[
            Sample(0, True, ttft=0.2, latency=0.2 + 0.05 * 63, tokens=64),  # met
            Sample(1, True, ttft=1.5, latency=2.0, tokens=64),  # TTFT too slow
            Sample(1, True, ttft=0.1, latency=0.1 + 0.2 * 63, tokens=64),  # TPOT too slow
            Sample(2, False, error="http_429"),
        ]
    )
    p = judge(crowd, wall_s=2.0, slo_ttft_s=1.0, slo_tpot_s=0.1)
    assert p["slo_attainment"] == 0.25 and p["goodput_rps"] == 0.5
    assert p["errors"] == {"http_429": 1} and p["refused"] == 1
    assert p["returning_ttft_p50_s"] == 0.8  # rounds after the first: 1.5 and 0.1
    assert p["tpot_p50_s"] == 0.05  # of 0.05, 0.5 / 63 and 0.2 s a token


def test_capacity_is_the_last_rate_meeting_the_slo_before_the_first_that_misses():
    points = [
        {"rate": 1, "slo_attainment": 1.0},
        {"rate": 2, "slo_attainment": 0.97},
        {"rate": 3, "slo_attainment": 0.80},
        {"rate": 4, "slo_attainment": 0.96},  # a lucky point past saturation does not count
    ]
    assert capacity(points, 0.95) == 2
    assert capacity([{"rate": 1, "slo_attainment": 0.5}], 0.95) is None


def test_the_summary_compares_capacity_and_the_tail_with_the_peers(tmp_path):
    def point(server, rate, att, tpot50, tpot95, lat95):
        return {
            "server": server, "mode": "stateless", "rate": rate, "slo_attainment": att,
            "tpot_p50_s": tpot50, "tpot_p95_s": tpot95, "latency_p95_s": lat95,
            "ttft_p95_s": 0.2, "goodput_rps": rate * att, "errors": {},
        }  # fmt: skip

    results = {
        "crowdchat": [point("crowdchat", 1, 1, 0.02, 0.025, 1.4), point("crowdchat", 4, 0.96,
                      0.04, 0.05, 3.0), point("crowdchat", 6, 0.5, 0.1, 0.4, 12)],
        "vllm": [point("vllm", 1, 1, 0.05, 0.06, 3.5), point("vllm", 4, 0.3, 0.15, 0.2, 12.7)],
        "llamacpp": [point("llamacpp", 1, 0.2, 0.1, 0.2, 30)],
    }  # fmt: skip
    args = argparse.Namespace(attainment=0.95)
    s = summarize(results, args)
    assert s["capacity_crowdchat_rps"] == 4 and s["capacity_vllm_rps"] == 1
    assert s["capacity_vs_vllm"] == 4.0 and s["capacity_vs_llamacpp"] is None
    assert s["tpot_p95_over_p50_max"] == 1.25  # up to crowdchat's capacity only
    assert s["latency_p95_vs_vllm_max"] == round(1.4 / 3.5, 2)  # 3.0/12.7 is lower
    plot_svg(results, tmp_path / "goodput.svg")
    assert (tmp_path / "goodput.svg").read_text().count("<polyline") == 3


def test_the_crowd_runs_against_the_real_app_in_both_modes(server):
    base = server[0]
    for mode in ("stateless", "sessions"):
        load = Load(rate=3, seconds=1.5, rounds=2, think_mean_s=0.1, reply_tokens=4, mode=mode)
        crowd, wall = asyncio.run(run_load(base, load, drain_s=120))
        p = judge(crowd, wall, slo_ttft_s=60, slo_tpot_s=10)
        assert crowd.conversations >= 1 and crowd.finished == crowd.conversations, p
        assert p["errors"] == {} and p["requests"] == 2 * crowd.conversations
        assert p["slo_attainment"] == 1.0 and p["returning_ttft_p50_s"] is not None


def test_a_crowd_naming_its_end_users_is_served_where_one_identity_is_refused(
    nf4_model, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # a per-user budget above any one conversation's cost (a ~330-token prompt, then ~60 a
    # round) and below the crowd's: the crowd from one address is served only user by user
    with running_server(
        nf4_model,
        tmp_path_factory.mktemp("crowd_users"),
        session_overrides={"tokens_per_minute": 1000},
    ) as (base, _engine, _sm):
        points = {}
        for end_users in (True, False):
            load = Load(4, 2, rounds=2, think_mean_s=0.1, reply_tokens=32, end_users=end_users)
            crowd, wall = asyncio.run(run_load(base, load, drain_s=120))
            points[end_users] = judge(crowd, wall, slo_ttft_s=60, slo_tpot_s=10)
    assert points[True]["refused"] == 0 and points[True]["errors"] == {}, points[True]
    assert points[False]["refused"] > 0, points[False]

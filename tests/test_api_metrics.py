"""What /metrics shows over a real server, engine and session manager: latency and KV blocks,
the prefix cache (per key, also in a response header), and tokens served per identity."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.served import owner_label
from tests.api_rig import HI, MODEL, LiveServer, owner


def test_metrics_parse_and_show_latency_and_kv_blocks(live: LiveServer) -> None:
    live.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
    r = httpx.get(f"{live.url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    ttft = families["crowdchat_ttft_seconds"]
    assert ttft.type == "histogram"
    inf = [s for s in ttft.samples if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"]
    assert inf and inf[0].value >= 1
    value = {
        n: families[f"crowdchat_kv_blocks_{n}"].samples[0].value for n in ("used", "free", "total")
    }
    assert value["total"] > 0 and value["used"] + value["free"] == value["total"]
    assert families["crowdchat_generated_tokens"].samples[0].value >= 3
    assert 0 < families["crowdchat_step_seconds_p50"].samples[0].value < 60
    states = {s.labels["state"] for s in families["crowdchat_sessions"].samples}
    assert {"active", "resident", "persisted", "cold"} <= states


def test_the_prefix_cache_shows_in_the_header_and_metrics_and_is_per_key(live: LiveServer) -> None:
    messages = [{"role": "user", "content": "Tell me, in short, what a prefix cache keeps."}]
    ids = live.sessions.prompts.encode(messages, live.engine.max_model_len)
    bs = live.engine.config.block_size
    shared = live.sessions.prompts.shareable(ids) // bs * bs  # the template's default head

    def hits() -> float:
        text = httpx.get(f"{live.url}/metrics", timeout=30).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert "crowdchat_prefix_cache_queries" in families
        return families["crowdchat_prefix_cache_hits"].samples[0].value

    def ask(key: str) -> tuple[str | None, float]:
        before = hits()
        r = httpx.post(
            f"{live.url}/v1/chat/completions",
            json={"messages": messages, "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert r.status_code == 200
        return r.headers.get("x-crowdchat-kv"), hits() - before

    ask("pc1")
    assert shared > 0 and ask("pc2") == ("cached", shared)  # another key: the template only
    assert ask("pc1") == ("cached", (len(ids) - 1) // bs * bs)  # its own: all full blocks


def test_metrics_show_served_tokens_per_identity_by_hash(live: LiveServer) -> None:
    key = "fair-share-key-7"
    five = {"ignore_eos": True}  # 5 tokens each: sampled at temperature 1, EOS may come sooner
    live.client(key).chat.completions.create(
        model=MODEL, messages=HI, max_tokens=5, extra_body=five
    )
    sid = httpx.post(
        f"{live.url}/v1/sessions", headers={"authorization": f"Bearer {key}"}, json={}
    ).json()["id"]
    live.client(key).chat.completions.create(
        model=MODEL, messages=HI, max_tokens=5, extra_headers={"x-session-id": sid}, extra_body=five
    )
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    assert key not in text and owner(key) not in text  # neither the key nor its identity
    served = {
        (s.labels["owner"], s.labels["kind"]): s.value
        for f in text_string_to_metric_families(text)
        if f.name == "crowdchat_served_tokens"
        for s in f.samples
    }
    label = owner_label(owner(key))  # one-off and session turns count for the same identity
    assert served[(label, "generated")] >= 10 and served[(label, "prompt")] > 0

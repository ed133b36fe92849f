"""Models other than Llama: tiny random-weight Qwen2, Qwen3, Mistral, Gemma 2 and 3 and Phi-3
(and Llama beside them), built from configs (tests/model_zoo.py), each loaded from a
directory as `--model` loads one. Each keeps float32 batched == solo == transformers'
`generate` (sliding-window layers and soft-capped scores included), serves a streamed chat
turn on the default nf4 path, and persists and restores its KV byte for byte. A model without
a chat template needs --chat-template; one transformers cannot load says so at start."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, ModelLoadError, SamplingParams
from engine.chat_format import ChatFormatter
from engine.model.loader import LoadedModel, load_model
from tests.model_zoo import FAMILIES, build
from tests.rig import close_sessions, make_engine, make_sessions

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
QUESTIONS = (
    "Hello there, how are you doing today?",
    "Tell me a story about a cat and a dog who met in the park one sunny day, please.",
    "Why?",
)
FAST = {"llama"}  # the families the flat Llama forward takes; the rest run transformers' code
GENERAL = {"mistral": "sliding-window", "gemma2": "sliding-window", "gemma3": "sliding-window"}


@pytest.fixture(scope="module")
def zoo(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("zoo")
    for family in FAMILIES:
        build(family, root / f"tiny-{family}", nf4_model.tokenizer)
    return root


def fp32(zoo: Path, family: str, data: Path) -> tuple[EngineConfig, LoadedModel]:
    config = EngineConfig(
        model=str(zoo / f"tiny-{family}"), data_dir=data, quant="none", dtype="float32"
    )
    return config, load_model(config)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float32_batched_equals_solo_equals_transformers_generate(
    family: str, zoo: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config, loaded = fp32(zoo, family, tmp_path)
    with caplog.at_level(logging.INFO, logger="engine.model.runner"):
        engine = make_engine(loaded, tmp_path, quant="none", dtype="float32", model=config.model)
    try:
        said = " ".join(r.getMessage() for r in caplog.records)
        assert ("the fast path" in said) == (family in FAST), said
        assert (GENERAL.get(family, "attention gathered") in said) == (family in GENERAL), said
        fmt = ChatFormatter(loaded.tokenizer)
        prompts = [fmt.encode([{"role": "user", "content": q}]) for q in QUESTIONS]

        def replies(batch: list[list[int]]) -> list[list[int]]:
            handles = [engine.submit(ids, GREEDY) for ids in batch]
            for h in handles:
                h.result()
            return [h.token_ids for h in handles]

        solo = [replies([ids])[0] for ids in prompts]
        assert replies(prompts) == solo
        model = loaded.model
        model.set_attn_implementation("eager")
        for ids, got in zip(prompts, solo, strict=True):
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False
            )
            assert out[0, len(ids) :].tolist() == got
        assert len({tuple(s) for s in solo}) > 1  # the tiny model says different things
    finally:
        engine.check_integrity()
        engine.shutdown()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_streamed_turn_on_the_default_path_persists_and_restores_byte_exact(
    family: str, zoo: Path, tmp_path: Path
) -> None:
    loaded = load_model(EngineConfig(model=str(zoo / f"tiny-{family}"), data_dir=tmp_path))
    assert loaded.quant == "nf4"
    engine, sm = make_sessions(loaded, tmp_path, {"model": str(zoo / f"tiny-{family}")})
    try:
        sid = sm.create_session("ann")["id"]
        deltas = list(sm.chat("ann", sid, QUESTIONS[0], GREEDY))  # streamed, piece by piece
        assert len(deltas) > 1 and sm.messages("ann", sid)[-1]["content"] == "".join(deltas)
        before = engine.export_kv(sid)
        assert sm.persist_now(sid) and sid not in engine.resident_kv()
        assert sm.offload.restore(sid) == "disk"
        after = engine.export_kv(sid)
        assert after.token_ids == before.token_ids
        for a, b in ((after.k, before.k), (after.v, before.v)):
            assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        turn = sm.chat("ann", sid, QUESTIONS[2], GREEDY)
        assert turn.result() and turn.handle.num_cached_tokens > 0
    finally:
        close_sessions(engine, sm)


def test_a_model_without_a_chat_template_needs_the_flag(zoo: Path, tmp_path: Path) -> None:
    base = tmp_path / "tiny-base"
    shutil.copytree(zoo / "tiny-qwen3", base)
    tokenizer_config = base / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings.pop("chat_template", None)
    tokenizer_config.write_text(json.dumps(settings))
    for extra in base.glob("chat_template.*"):
        extra.unlink()
    config = EngineConfig(model=str(base), data_dir=tmp_path / "d", quant="none", dtype="float32")
    with pytest.raises(ModelLoadError, match="tiny-base has no chat template.*--chat-template"):
        load_model(config)
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    loaded = load_model(
        EngineConfig(
            model=str(base),
            data_dir=tmp_path / "d",
            quant="none",
            dtype="float32",
            chat_template=template,
        )
    )
    ids = ChatFormatter(loaded.tokenizer).encode([{"role": "user", "content": "hi"}])
    assert loaded.tokenizer.decode(ids) == "user: hi\nassistant:"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['role'] }")
    with pytest.raises(ModelLoadError, match="--chat-template .*broken.jinja does not render"):
        load_model(EngineConfig(model=str(base), data_dir=tmp_path / "d", chat_template=broken))


def test_an_architecture_transformers_cannot_load_is_named_at_start(
    zoo: Path, tmp_path: Path
) -> None:
    odd = tmp_path / "tiny-odd"
    shutil.copytree(zoo / "tiny-llama", odd)
    config = json.loads((odd / "config.json").read_text())
    config.update(model_type="crowdchat_nonesuch", architectures=["NonesuchForCausalLM"])
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="tiny-odd .*NonesuchForCausalLM"):
        load_model(EngineConfig(model=str(odd), data_dir=tmp_path / "d"))

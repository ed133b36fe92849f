"""The crowd's tail on the real engine: with default settings, a prompt arriving among running
decodes is prefilled in chunks the step timer sizes, not in one step that stalls them all."""

from __future__ import annotations

import time
from pathlib import Path

from engine import SamplingParams
from engine.chat_format import ChatFormatter
from engine.core.budget import AUTO_MIN_CHUNK
from engine.model.loader import LoadedModel
from engine.model.plan import StepPlan
from tests.conftest import make_engine
from tests.step_logits import QUESTIONS


def test_a_long_prompt_among_running_decodes_is_split_into_chunks_by_default(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    formatter = ChatFormatter(nf4_model.tokenizer)
    long_prompt = formatter.encode([{"role": "user", "content": " ".join(QUESTIONS) * 2}])
    assert 200 < len(long_prompt) < 500  # one step's worth under --max-num-batched-tokens 512
    engine = make_engine(nf4_model, tmp_path)
    plans: list[StepPlan] = []
    schedule = engine.scheduler.schedule

    def recorded(budget: int) -> StepPlan:  # runs on the engine thread
        plan = schedule(budget)
        plans.append(plan)
        return plan

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    try:
        params = SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True)
        shorts = [
            engine.submit(formatter.encode([{"role": "user", "content": q}]), params)
            for q in QUESTIONS[:4]
        ]
        streams = [iter(h) for h in shorts]
        for s in streams:
            next(s)  # all four decoding
        deadline = time.monotonic() + 60
        while engine.stats().steps < 24 and time.monotonic() < deadline:
            time.sleep(0.05)  # steps timed: the step timer has a fit
        seen = len(plans)
        reply = engine.generate([long_prompt], SamplingParams(temperature=0, max_new_tokens=4))
        assert reply[0]
        chunks = [
            n
            for plan in plans[seen:]
            for s, n in plan.prefills
            if s.num_prompt_tokens == len(long_prompt)
        ]
        decoding = [len(plan.decodes) for plan in plans[seen:] if plan.prefills]
    finally:
        engine.shutdown()
    assert sum(chunks) == len(long_prompt)
    assert len(chunks) >= 3, chunks  # split, while the four kept decoding
    assert min(chunks[:-1]) >= AUTO_MIN_CHUNK  # and every chunk but the last makes progress
    assert min(decoding) == 4

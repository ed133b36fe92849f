"""Whether two greedy replies to the same prompt differ only past a near tie.

A float32 forward is exact only up to its summation order, and that order is not the same
for a row alone and a row among others: oneDNN/MKL's float32 matmul on the CPU gives a row
other bits below 16 rows than above (the same row of the same matrices; measured on the
Sapphire Rapids Xeon, torch 2.13, K = 576 and 1,536), and the adaptive prefill chunks decide
how many rows a prompt's tokens are computed with. Where the model's two best next tokens are
closer than that noise, two correct computations of the same prompt may pick either. So a
restored session's greedy reply and a recompute's can differ without any byte of KV being
wrong, and `bench/crash_load.py` asks this module which it was.

`classify` recomputes the reply offline in float64 (the reference: its own rounding is ~1e-16
relative) and in float32 teacher-forced on the float64 path (their difference estimates the
float32 noise at each step). The replies are a near tie when both follow the float64 path up
to a step whose top-two margin is within `TIE_NOISE` times that noise; anything else is a
real difference.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.chat_format import ChatFormatter
from engine.config import EngineConfig
from engine.model.loader import load_model
from sessions.prompt import PromptEncoder

TIE_NOISE = 16  # a margin within 16x the measured float32 noise is a near tie


@dataclass
class Reference:
    """The model in float64 and float32, the server's prompt encoder and the stop tokens that
    `min_tokens` masks (a request of exactly n tokens never picks them)."""

    f64: torch.nn.Module
    f32: torch.nn.Module
    tokenizer: object
    encoder: PromptEncoder
    stop_ids: list[int]

    @classmethod
    def load(cls, config: EngineConfig) -> Reference:
        loaded = load_model(config)
        f32 = loaded.model.float()
        gen = getattr(f32, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) or loaded.tokenizer.eos_token_id
        stop = sorted({eos} if isinstance(eos, int) else set(eos or []))
        encoder = PromptEncoder(ChatFormatter(loaded.tokenizer), 1 << 20)
        return cls(copy.deepcopy(f32).double(), f32, loaded.tokenizer, encoder, stop)


@torch.inference_mode()
def greedy_path(
    ref: Reference, messages: list[dict[str, str]], n: int
) -> tuple[torch.Tensor, list[int], list[float]]:
    """The prompt's ids, and the float64 model's `n` greedy tokens with each step's top-two
    margin (stop tokens masked, as `min_tokens` does for a request of exactly n tokens)."""
    ids = torch.tensor([ref.encoder.encode(messages, 1 << 20)])
    out = ref.f64(ids, use_cache=True)
    path: list[int] = []
    margins: list[float] = []
    for _ in range(n):
        logits = out.logits[0, -1].clone()
        logits[ref.stop_ids] = float("-inf")
        top = logits.topk(2)
        margins.append(float(top.values[0] - top.values[1]))
        path.append(int(top.indices[0]))
        out = ref.f64(
            torch.tensor([[path[-1]]]), past_key_values=out.past_key_values, use_cache=True
        )
    return ids, path, margins


@torch.inference_mode()
def classify(
    ref: Reference, messages: list[dict[str, str]], replies: tuple[str, str], n: int
) -> dict:
    """'same', 'same_path', 'near_tie' or 'differs' for two greedy replies of `n` tokens to
    `messages`, with the float64 path's step, margin and the float32 noise where they part."""
    if replies[0] == replies[1]:
        return {"verdict": "same"}
    ids, path, margins = greedy_path(ref, messages, n)
    texts = [ref.tokenizer.decode(path[:s]) for s in range(n + 1)]
    # the first step at which either reply leaves the float64 path
    step = next((s for s in range(n) if not all(r.startswith(texts[s + 1]) for r in replies)), n)
    if step == n:  # both follow it all the way: they differ only in how text was cut
        return {"verdict": "same_path", "step": n}
    full = torch.cat([ids, torch.tensor([path])], dim=1)
    at = ids.shape[1] - 1 + step
    l32 = ref.f32(full[:, : at + 1]).logits[0, -1].double()
    l64 = ref.f64(full[:, : at + 1]).logits[0, -1]
    noise = float((l32 - l64)[l64.topk(2).indices].abs().max())
    margin = margins[step]
    return {
        "verdict": "near_tie" if margin <= TIE_NOISE * max(noise, 1e-9) else "differs",
        "step": step,
        "margin": margin,
        "float32_noise": noise,
        "reference": texts[n],
    }


def _last(words: list[str], flag: str, default: str | None) -> str | None:
    """A flag's value as argparse reads it (the last one wins)."""
    at = [i for i, w in enumerate(words[:-1]) if w == flag]
    return words[at[-1] + 1] if at else default


def judge_misses(server_args: str, misses: list[dict], data_dir: Path) -> None:
    """Give each miss (a dict with `messages`, `session`, `recompute`, `n`) its `verdict`.

    Only the float32 configuration without quantization can be judged against float64: under
    any other server arguments every miss is a difference."""
    words = server_args.split()
    exact = (_last(words, "--quant", "nf4"), _last(words, "--dtype", "auto")) == (
        "none",
        "float32",
    ) and _last(words, "--kv-dtype", "auto") in ("auto", "float32")
    if not exact:
        for e in misses:
            e["verdict"] = {"verdict": "differs", "why": "not the float32 configuration"}
        return
    if not misses:
        return
    config = EngineConfig(
        model=_last(words, "--model", None), data_dir=data_dir, quant="none", dtype="float32"
    )
    ref = Reference.load(config)
    for e in misses:
        e["verdict"] = classify(ref, e["messages"], (e["session"], e["recompute"]), e["n"])


def near_tie(miss: dict) -> bool:
    """A miss that parts from the float64 path only at a near tie (or not at all)."""
    return miss.get("verdict", {}).get("verdict") in ("near_tie", "same_path")

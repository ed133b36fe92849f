"""Tiny random-weight models of the families transformers users load most, built from configs
with the embedded model's tokenizer (and so its chat template), for the tests of other
architectures: each is a directory `--model` loads like any downloaded checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

# The same small shape for every family: 2 layers (so a model with alternating sliding and
# global layers has one of each), 4 query heads over 2 KV heads (GQA), head size 16.
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
# family -> (config class, model class, what the family brings beyond Llama's shape)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # biases on q/k/v
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),  # q and k norms
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "gemma2": (  # sliding-window layers, soft-capped attention and logits, (1 + w) norms
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16},
    ),
    "gemma3": (  # local/global layers with their own RoPE, q and k norms
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),  # fmt: skip
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # fused qkv_proj and gate_up_proj
}


def build(family: str, directory: Path, tokenizer: object, seed: int = 0) -> Path:
    """A random-weight model of `family` saved in `directory` (float32 safetensors, the
    tokenizer beside it); returns the directory."""
    config_name, model_name, extra = FAMILIES[family]
    vocab = len(tokenizer)  # type: ignore[arg-type]
    config = getattr(transformers, config_name)(
        vocab_size=vocab,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id or 0,  # type: ignore[attr-defined]
        tie_word_embeddings=True,
        **SHAPE,
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    std = 0.02 if family.startswith("gemma") else 0.2  # Gemma scales its embeddings up
    with torch.no_grad():  # weights large enough that the tiny model's picks are not ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)  # type: ignore[attr-defined]
    return directory

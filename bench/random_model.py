"""Write a model directory with SmolLM2-135M-Instruct's exact config and tokenizer and random
weights: what `bench/gpu_check.sh` runs on a GPU machine, where the GGUF cannot travel.
`--shape` writes a larger Llama's shape instead (Llama-3.2-1B, Llama-3.1-8B: their layers,
widths, heads and context) over the same tokenizer, so its vocabulary (49,152) and the output
projection stay SmolLM2's: against the real models' 128,256 that leaves out ~14% of the 1B's
weights and ~4% of the 8B's; label such figures "random weights, <shape> shape".

Speed is the real model's when EOS is ignored (same shapes, same kernels); the text is noise,
so label every figure measured on it "random weights". Weights are drawn with std 0.1 rather than
the config's 0.02: at 0.02 the layers barely move the residual stream and greedy decoding just
repeats the prompt's last token, which would hide attention bugs from the exactness tests.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = ROOT / ".gpu" / "smollm2-config"
MARKER = "crowdchat-random.json"
INIT_STD = 0.1  # replies depend on the context; top-2 logit gap ~0.24 std (checked on CPU)
# config fields of the larger shapes (their own config.json files' values), over SmolLM2's
SHAPES: dict[str, dict[str, object]] = {
    "smollm2-135m": {},
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
}


def write_random_model(
    out: Path,
    config_dir: Path = CONFIG_DIR,
    seed: int = 0,
    shape: str = "smollm2-135m",
    device: str = "cpu",
) -> Path:
    """Create `out` (config + tokenizer copied byte for byte, seeded random safetensors); a
    larger `shape` gets its own config.json. `device`: where the weights are drawn (an 8B
    model draws in seconds on a GPU, minutes on the CPU)."""
    if (out / MARKER).is_file():
        return out
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"{config_dir}/config.json missing: run bench/gpu_prep.sh")
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(config_dir, local_files_only=True)
    for key, value in SHAPES[shape].items():
        setattr(config, key, value)
    # for the draw only (config.json is copied or written as is): the residual stream's scale
    # as SmolLM2's at INIT_STD
    config.initializer_range = INIT_STD * (576 / config.hidden_size) ** 0.5
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)  # half the bytes; the loader casts
    del model
    for f in config_dir.iterdir():  # the exact config.json too: same config hash as the real one
        if not (SHAPES[shape] and f.name == "config.json"):
            shutil.copy2(f, tmp / f.name)
    (tmp / MARKER).write_text(json.dumps({"random_weights": True, "seed": seed, "shape": shape}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def is_random(model_dir: str | Path | None) -> bool:
    """Whether figures measured on this model must be labelled "random weights"."""
    return model_dir is not None and (Path(model_dir) / MARKER).is_file()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path, help="model directory to write")
    ap.add_argument("--config-dir", type=Path, default=CONFIG_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cpu", help="where to draw the weights (cuda: fast)")
    args = ap.parse_args()
    path = write_random_model(args.out, args.config_dir, args.seed, args.shape, args.device)
    print(json.dumps({"random_model": str(path), "random_weights": True, "shape": args.shape}))


if __name__ == "__main__":
    sys.exit(main())

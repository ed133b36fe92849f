"""Write a model directory with SmolLM2-135M-Instruct's exact config and tokenizer and random
weights: what `bench/gpu_check.sh` runs on a GPU machine, where the GGUF cannot travel.

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


def write_random_model(out: Path, config_dir: Path = CONFIG_DIR, seed: int = 0) -> Path:
    """Create `out` (config + tokenizer copied byte for byte, seeded random safetensors)."""
    if (out / MARKER).is_file():
        return out
    if not (config_dir / "config.json").is_file():
        raise FileNotFoundError(f"{config_dir}/config.json missing: run bench/gpu_prep.sh")
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(config_dir, local_files_only=True)
    config.initializer_range = INIT_STD  # for the draw only: config.json is copied as is
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)  # half the bytes; the loader casts
    for f in config_dir.iterdir():  # the exact config.json too: same config hash as the real one
        shutil.copy2(f, tmp / f.name)
    (tmp / MARKER).write_text(json.dumps({"random_weights": True, "seed": seed}))
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
    args = ap.parse_args()
    path = write_random_model(args.out, args.config_dir, args.seed)
    print(json.dumps({"random_model": str(path), "random_weights": True}))


if __name__ == "__main__":
    sys.exit(main())

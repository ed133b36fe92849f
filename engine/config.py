"""The engine's frozen configuration, built from flags with CROWDCHAT_* environment overrides."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TypeVar

from engine.errors import InvalidRequest

QUANT_CHOICES = ("nf4", "int8", "none")
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
DEVICE_CHOICES = ("auto", "cpu", "cuda")


T = TypeVar("T")


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    """Build a config dataclass from parsed flags, taking only the fields it has."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(ns).items() if k in names})


def env_default(name: str, default: object) -> object:
    """The value of CROWDCHAT_<NAME> if set, else `default` (argparse converts strings)."""
    return os.environ.get(f"CROWDCHAT_{name.upper()}", default)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to load the model and size its KV pool and batches."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    quant: str = "nf4"
    dtype: str = "auto"
    device: str = "auto"
    data_dir: Path = Path("data")
    block_size: int = 16
    kv_budget_mb: float | None = None  # CPU pool size; None: a share of available RAM
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's own context length
    max_queue: int = 256
    max_num_batched_tokens: int = 512
    target_itl_ms: float | None = None
    threads: int | None = None  # torch intra-op threads on CPU; None: torch's default

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidRequest(f"invalid engine setting: {msg}")

        need(self.quant in QUANT_CHOICES, f"--quant must be one of {QUANT_CHOICES}")
        need(self.dtype in DTYPE_CHOICES, f"--dtype must be one of {DTYPE_CHOICES}")
        need(self.device in DEVICE_CHOICES, f"--device must be one of {DEVICE_CHOICES}")
        need(self.block_size in (8, 16, 32, 64, 128), "--block-size must be 8, 16, 32, 64 or 128")
        need(self.kv_budget_mb is None or self.kv_budget_mb > 0, "--kv-budget-mb must be > 0")
        need(0 < self.gpu_memory_utilization <= 1, "--gpu-memory-utilization must be in (0, 1]")
        need(self.max_num_seqs >= 1, "--max-num-seqs must be >= 1")
        need(self.max_model_len is None or self.max_model_len >= 16,
             "--max-model-len must be >= 16")
        need(self.max_queue >= 0, "--max-queue must be >= 0")
        need(self.max_num_batched_tokens >= 16, "--max-num-batched-tokens must be >= 16")
        need(self.target_itl_ms is None or self.target_itl_ms > 0, "--target-itl-ms must be > 0")
        need(self.threads is None or self.threads >= 1, "--threads must be >= 1")
        object.__setattr__(self, "data_dir", Path(self.data_dir))

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add the engine's flags (each overridable by CROWDCHAT_<FLAG>) to `parser`."""
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=env_default("model", None),
                       help="local Hugging Face model directory or .gguf file "
                            "(default: the embedded SmolLM2-135M-Instruct)")
        g.add_argument("--quant", choices=QUANT_CHOICES, default=env_default("quant", "nf4"))
        g.add_argument("--dtype", choices=DTYPE_CHOICES, default=env_default("dtype", "auto"),
                       help="compute and KV dtype (auto: bfloat16 where supported)")
        g.add_argument("--device", choices=DEVICE_CHOICES, default=env_default("device", "auto"))
        g.add_argument("--data-dir", type=Path, default=env_default("data", "data"),
                       help="where converted models, snapshots and the database live")
        g.add_argument("--block-size", type=int, default=env_default("block_size", 16))
        g.add_argument("--kv-budget-mb", type=float, default=env_default("kv_budget_mb", None),
                       help="KV pool size on CPU (default: a share of available RAM)")
        g.add_argument("--gpu-memory-utilization", type=float,
                       default=env_default("gpu_memory_utilization", 0.9))
        g.add_argument("--max-num-seqs", type=int, default=env_default("max_num_seqs", 64))
        g.add_argument("--max-model-len", type=int, default=env_default("max_model_len", None))
        g.add_argument("--max-queue", type=int, default=env_default("max_queue", 256))
        g.add_argument("--max-num-batched-tokens", type=int,
                       default=env_default("max_num_batched_tokens", 512),
                       help="tokens per step (prefill chunks + decodes)")
        g.add_argument("--target-itl-ms", type=float, default=env_default("target_itl_ms", None),
                       help="size prefill chunks so running users' inter-token latency stays "
                            "under this")
        g.add_argument("--threads", type=int, default=env_default("threads", None))

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EngineConfig:
        """Build the config from parsed flags (unknown attributes are ignored)."""
        return from_namespace(cls, ns)

"""The engine's frozen configuration; its fields define the flags and CROWDCHAT_* overrides."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from engine.errors import InvalidRequest
from engine.settings import Settings, setting

QUANT_CHOICES = ("nf4", "int8", "none")
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
SCHEDULE_CHOICES = ("fair", "fcfs")
ACTIVATION_CHOICES = ("auto", "int8", "bfloat16")
CUDA_ATTENTION_CHOICES = ("triton", "gather")
# --upstream-stream-interval 0 (automatic): the relay costs this front end ~0.3 ms of CPU per
# upstream event (bench/frontend.py); past RELAY_EVENTS_PER_S tokens/s (the turns in flight at
# their recent pace), chunks grow to keep it near that many events/s, but no chunk holds more
# than MAX_CHUNK_S of its own stream's tokens
RELAY_EVENTS_PER_S = 250
MAX_CHUNK_S = 0.1
MAX_STREAM_INTERVAL = 8


@dataclass(frozen=True)
class EngineConfig(Settings):
    """Everything the engine needs to load the model and size its KV pool and batches."""

    section: ClassVar[str] = "engine"

    model: str | None = setting(
        None,
        "local Hugging Face model directory or .gguf file (off: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    chat_template: Path | None = setting(
        None,
        "a Jinja chat template file for a model that has none (base models' GGUF files often "
        "carry none), as vLLM's --chat-template takes it; off: the model's own",
    )
    quant: str = setting(
        "nf4",
        "4-bit (nf4) or 8-bit weights: bitsandbytes on CUDA, PyTorch's int4/int8 kernels on CPU",
        choices=QUANT_CHOICES,
    )
    dtype: str = setting(
        "auto",
        "compute dtype (auto: float32 on a CPU with --quant nf4 and crowdchat's kernels built, "
        "else bfloat16 where native)",
        choices=DTYPE_CHOICES,
    )
    kv_dtype: str = setting(
        "auto",
        "KV pool dtype (auto: bfloat16 on CPU with --quant and float32 compute, where the "
        "kernels already round K and V to bfloat16 before RoPE; else the compute dtype)",
        choices=DTYPE_CHOICES,
    )
    device: str = setting("auto", "auto: CUDA when present", choices=DEVICE_CHOICES)
    cuda_attention: str = setting(
        "triton",
        "CUDA: decode attention read from the KV pool's blocks by crowdchat's Triton kernel "
        "(where Triton is installed, as with PyTorch's CUDA builds), or gathered into a dense "
        "copy for SDPA (gather: the path before it)",
        choices=CUDA_ATTENTION_CHOICES,
    )
    data_dir: Path = setting(
        Path("data"),
        "converted models, crowdchat.db, snapshots/, the browser key",
        env="CROWDCHAT_DATA",
    )
    block_size: int = setting(16, "tokens per KV block")
    kv_budget_mb: float | None = setting(
        None, "KV pool size (off: 25% of free RAM, max 4 GiB, on CPU; free VRAM share on CUDA)"
    )
    gpu_memory_utilization: float = setting(
        0.9, "share of free VRAM after loading used for KV on CUDA"
    )
    max_num_seqs: int = setting(64, "sequences decoding at once (also the page's concurrency)")
    cuda_graph_rows: int | None = setting(
        None,
        "CUDA: steps of up to this many decodes replay a captured CUDA graph, padded to a "
        "bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, ...); off: up to --max-num-seqs; 0: no graphs, "
        "every step eager (vLLM's --enforce-eager), as always with --quant int8",
    )
    max_model_len: int | None = setting(
        None, "tokens per sequence, also capped by the pool (off: the model's context)"
    )
    max_queue: int = setting(256, "waiting requests; beyond it: server busy / HTTP 429")
    max_num_batched_tokens: int = setting(512, "tokens per step (decodes + prefill chunks)")
    target_itl_ms: float | None = setting(
        None,
        "size prefill chunks from measured step times so running users' inter-token "
        "latency stays under this",
    )
    schedule: str = setting(
        "fair",
        "who is admitted and gets the prefill budget first: the user with the least served "
        "work (fair: virtual token counter) or the oldest request (fcfs)",
        choices=SCHEDULE_CHOICES,
    )
    threads: int | None = setting(None, "torch intra-op threads on CPU (off: torch's default)")
    cpu_dense_above: int | None = setting(
        None,
        "CPU with --quant: steps of more rows than this use a dense copy of the same "
        "quantized weights (faster for big batches, more RAM; off: none on crowdchat's "
        "AVX512-BF16 and int8-activation kernels, else 4 where it is float16 on FBGEMM, with "
        "float32 compute, or 16); 0: packed weights only",
    )
    cpu_bf16_above: int = setting(
        0,
        "CPU with AMX and --quant nf4 on the int8-activation kernel: steps of more rows than "
        "this widen the 4-bit weights to bfloat16 and run oneDNN's bf16 GEMM (192: prefills "
        "~1.5x faster at 500 rows, time to first token ~15% shorter under load, but a reply "
        "then depends on how its prompt was batched, within the nf4 tolerance); 0: never",
    )
    cpu_activations: str = setting(
        "auto",
        "CPU with --quant nf4 on crowdchat's kernels: the 4-bit matmuls' inputs rounded to "
        "int8 per group of 32, as llama.cpp does (auto: on AVX2 and AVX512-VNNI CPUs; 1.7-2.5x "
        "faster, no dense copy) or to bfloat16 (PyTorch's int4 kernel's values)",
        choices=ACTIVATION_CHOICES,
    )

    engine_url: str | None = setting(
        None,
        "drive OpenAI-compatible servers (vLLM, llama-server) instead of loading the model "
        "here: one URL or several, comma-separated; each session sticks to one replica",
    )
    upstream_first_token_s: float = setting(
        120.0, "with --engine-url: a turn fails if its first token takes longer than this"
    )
    upstream_idle_s: float = setting(
        60.0, "with --engine-url: a turn fails if its stream is silent longer than this"
    )
    upstream_stream_interval: int = setting(
        0,
        "with --engine-url: tokens an upstream may gather into one streamed chunk (vLLM's "
        "stream_interval: fewer events for this front end to relay); 0: automatic, 1 up to "
        f"{RELAY_EVENTS_PER_S} tokens/s relayed, then about that many events/s, no chunk "
        f"longer than {MAX_CHUNK_S} s of its stream, at most {MAX_STREAM_INTERVAL}",
    )
    health_interval_s: float = setting(
        2.0, "with --engine-url: seconds between health checks", cli=False
    )
    upstream_wait_s: float = setting(
        60.0, "with --engine-url: how long start-up waits for a replica to answer", cli=False
    )

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidRequest(f"invalid engine setting: {msg}")

        need(self.quant in QUANT_CHOICES, f"--quant must be one of {QUANT_CHOICES}")
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", Path(self.chat_template))
            need(
                self.chat_template.is_file(),
                f"--chat-template file not found: {self.chat_template}",
            )
        need(self.dtype in DTYPE_CHOICES, f"--dtype must be one of {DTYPE_CHOICES}")
        need(self.kv_dtype in DTYPE_CHOICES, f"--kv-dtype must be one of {DTYPE_CHOICES}")
        need(self.device in DEVICE_CHOICES, f"--device must be one of {DEVICE_CHOICES}")
        need(
            self.cuda_attention in CUDA_ATTENTION_CHOICES,
            f"--cuda-attention must be one of {CUDA_ATTENTION_CHOICES}",
        )
        need(
            self.cpu_activations in ACTIVATION_CHOICES,
            f"--cpu-activations must be one of {ACTIVATION_CHOICES}",
        )
        need(self.block_size in (8, 16, 32, 64, 128), "--block-size must be 8, 16, 32, 64 or 128")
        need(self.kv_budget_mb is None or self.kv_budget_mb > 0, "--kv-budget-mb must be > 0")
        need(0 < self.gpu_memory_utilization <= 1, "--gpu-memory-utilization must be in (0, 1]")
        need(self.max_num_seqs >= 1, "--max-num-seqs must be >= 1")
        need(
            self.cuda_graph_rows is None or self.cuda_graph_rows >= 0,
            "--cuda-graph-rows must be >= 0 (0: no CUDA graphs)",
        )
        need(
            self.max_model_len is None or self.max_model_len >= 16,
            "--max-model-len must be >= 16",
        )
        need(self.max_queue >= 0, "--max-queue must be >= 0")
        need(self.max_num_batched_tokens >= 16, "--max-num-batched-tokens must be >= 16")
        need(self.target_itl_ms is None or self.target_itl_ms > 0, "--target-itl-ms must be > 0")
        need(self.schedule in SCHEDULE_CHOICES, f"--schedule must be one of {SCHEDULE_CHOICES}")
        need(self.threads is None or self.threads >= 1, "--threads must be >= 1")
        need(
            self.cpu_dense_above is None or self.cpu_dense_above >= 0,
            "--cpu-dense-above must be >= 0",
        )
        need(
            self.cpu_bf16_above >= 0,
            "--cpu-bf16-above must be >= 0",
        )
        need(self.upstream_first_token_s > 0, "--upstream-first-token-s must be > 0")
        need(self.upstream_idle_s > 0, "--upstream-idle-s must be > 0")
        need(
            0 <= self.upstream_stream_interval <= MAX_STREAM_INTERVAL,
            f"--upstream-stream-interval must be 0 (automatic) to {MAX_STREAM_INTERVAL}",
        )
        need(
            self.engine_url is None
            or bool(self.urls())
            and all(u.strip().startswith(("http://", "https://")) for u in self.urls()),
            "--engine-url takes http(s):// URLs, comma-separated",
        )
        object.__setattr__(self, "data_dir", Path(self.data_dir))

    def stream_interval(self, tokens_per_s: float, streams: int) -> int:
        """Tokens per upstream chunk for a new turn joining `streams` turns (itself included)
        that relay about `tokens_per_s` in all."""
        if self.upstream_stream_interval:
            return self.upstream_stream_interval
        fewer_events = math.ceil(tokens_per_s / RELAY_EVENTS_PER_S)
        smooth = int(tokens_per_s / max(streams, 1) * MAX_CHUNK_S)
        return max(1, min(MAX_STREAM_INTERVAL, fewer_events, smooth))

    def urls(self) -> list[str]:
        """The --engine-url replicas (empty: the built-in engine)."""
        return [u.strip() for u in (self.engine_url or "").split(",") if u.strip()]

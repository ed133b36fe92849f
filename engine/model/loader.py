"""Find, convert and load the model: embedded GGUF, any GGUF file or any local HF directory."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub, whatever the caller forgot
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from engine.config import EngineConfig  # noqa: E402
from engine.errors import ModelLoadError  # noqa: E402
from engine.kernels import cpu_kernels, triton_attention, triton_layer  # noqa: E402
from engine.model import cpu_quant, fused_proj, quantize  # noqa: E402
from engine.model.attention import needs_general  # noqa: E402
from engine.model.checkpoint import resolve_checkpoint  # noqa: E402
from engine.model.fingerprint import (  # noqa: E402
    CACHE_FILE,
    config_hash,
    numerics_versions,
    weights_hash,
)
from engine.model.lean_llama import fits  # noqa: E402
from engine.startup import Startup  # noqa: E402
from engine.threads import run_in_fresh_thread  # noqa: E402

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    """`float32` for `torch.float32`: the spelling of `--dtype`, fingerprints and reports."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class LoadedModel:
    """The model on its device, its tokenizer, and the facts the KV pool and snapshots need."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    weights_hash: str
    quant: str
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV pool's (and snapshots') elements
    model_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    kernel: str = ""  # what computes the quantized linears (bitsandbytes, torch-int4g32, ...)
    config_hash: str = ""  # canonical config.json (rope_theta, rope_scaling, ...)
    numerics: str = ""  # versions of the libraries (and on CPU the kernels' ISA) computing K/V
    # CUDA: "triton" where decode attention reads the pool in crowdchat's Triton kernel
    # (engine.kernels.triton_attention), else "gather"; "" on the CPU
    cuda_attention: str = ""
    # CUDA with the Triton kernel: the batch buckets a step of decodes is padded to and
    # replayed as a CUDA graph (engine.model.static_decode); () where steps run eagerly
    decode_buckets: tuple[int, ...] = ()
    # CUDA, bf16/fp16, the flat forward: RoPE with the K/V write and the residual adds with
    # their norms in Triton (engine.kernels.triton_layer; the KV fingerprint names it)
    triton_layers: bool = False

    @classmethod
    def stand_in(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_position: int,
        model_id: str,
    ) -> LoadedModel:
        """A model with no weights for an engine whose runner is a stand-in (the fakes of the
        tests, bench/host_overhead.py): 1 layer, 1 KV head of width 1, float32 on the CPU."""
        return cls(
            model=SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size)),  # type: ignore[arg-type]
            tokenizer=tokenizer,
            model_id=model_id,
            weights_hash="0",
            quant="none",
            device=torch.device("cpu"),
            dtype=torch.float32,
            kv_dtype=torch.float32,
            model_bytes=0,
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            max_position=max_position,
        )

    def fingerprint(self, block_size: int) -> dict[str, str | int]:
        """What a KV snapshot must match to be reused by this model: everything that
        determines its K/V bytes (see `engine.model.fingerprint`) and the KV layout."""
        return {
            "model_id": self.model_id,
            "weights_hash": self.weights_hash,
            "config_hash": self.config_hash,
            "numerics": self.numerics,
            "device": self.device.type,
            "quant": f"{self.quant}/{self.kernel}",
            "dtype": dtype_name(self.dtype),
            "kv_dtype": dtype_name(self.kv_dtype),
            "block_size": block_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }


# the batch sizes a CUDA step of decodes is padded to (each one captured graph)
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def graph_buckets(max_rows: int) -> tuple[int, ...]:
    """The buckets up to `max_rows`, `max_rows` itself the last; () for 0 (no graphs)."""
    if max_rows <= 0:
        return ()
    return tuple(b for b in GRAPH_BUCKETS if b < max_rows) + (max_rows,)


def decode_buckets(config: EngineConfig, cuda_attention: str) -> tuple[int, ...]:
    """The graph buckets of a load: up to --cuda-graph-rows (else --max-num-seqs) where the
    Triton kernel attends; none with --quant int8 (bitsandbytes' 8-bit matmul syncs with the
    host and cannot be captured: every step runs eager)."""
    if cuda_attention != "triton":
        return ()
    if config.quant == "int8":
        log.info("--quant int8: no CUDA graphs (bitsandbytes' 8-bit matmul cannot be captured)")
        return ()
    rows = config.max_num_seqs
    if config.cuda_graph_rows is not None:
        rows = min(rows, config.cuda_graph_rows)
    return graph_buckets(rows)


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present; asking for CUDA without one is an operator error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, own_q4: bool = False) -> torch.dtype:
    """`auto` is bfloat16 where the hardware computes it natively, else float16/float32; on the
    CPU float32 wherever the 4-bit weights run on crowdchat's kernel (`own_q4`: `--quant nf4`
    with engine.kernels.cpu_kernels built), which computes float32 and the decode steps' own path
    with
    it (engine.model.lean_llama `_decodes`). Even where bf16 is native that is faster: on the Zen 5
    EPYC (AVX512-BF16) a one-row step took 9 ms against 21 on PyTorch's bf16 int4 kernel, 63
    against 76 at 32 rows (medians; README "Float32 compute on native-bf16 CPUs too")."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if own_q4:
        return torch.float32
    try:
        native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native_bf16 = False
    return torch.bfloat16 if native_bf16 else torch.float32


def resolve_kv_dtype(name: str, dtype: torch.dtype, cpu_kernels: bool) -> torch.dtype:
    """`auto` is bfloat16 where PyTorch's CPU kernels run a float32 model, else `dtype`.

    Those kernels (and the dense copies beside them, engine.model.cpu_quant) round every
    projection's
    output to bfloat16, so V is bfloat16 already and K differs from it only by RoPE: a bfloat16
    pool stores V exactly, holds twice the tokens of a float32 one, and a decode step reads half
    the bytes gathering context (docs/PERFORMANCE.md).
    """
    if name != "auto":
        return DTYPES[name]
    return torch.bfloat16 if cpu_kernels and dtype == torch.float32 else dtype


def quantization_config(quant: str, dtype: torch.dtype) -> BitsAndBytesConfig | None:
    """The bitsandbytes settings for `--quant` (None for unquantized)."""
    if quant == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
        )
    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def load_model(config: EngineConfig, startup: Startup | None = None) -> LoadedModel:
    """Resolve, convert if needed, and load the model and tokenizer onto the device;
    `startup` hears each step.

    Runs on a short-lived thread (see `engine.threads`) so the caller's thread keeps no
    OpenMP team that would slow the engine thread down.
    """
    startup = startup or Startup()
    return run_in_fresh_thread(lambda: _load_model(config, startup), "crowdchat-loader")


def _load_model(config: EngineConfig, startup: Startup) -> LoadedModel:
    device = resolve_device(config.device)
    # On CPU bitsandbytes dequantizes every weight on every call; PyTorch's weight-only
    # kernels read the packed weights (see engine.model.cpu_quant).
    torch_kernels = device.type == "cpu" and config.quant != "none" and cpu_quant.available()
    with startup.step("loading the CPU kernels"):  # built here if `make` has not yet
        own_q4 = torch_kernels and config.quant == "nf4" and cpu_kernels.q4_linear() is not None
    dtype = resolve_dtype(config.dtype, device, own_q4)
    if config.threads is not None and device.type == "cpu":
        torch.set_num_threads(config.threads)
    with startup.step("converting the GGUF file"):  # once: cached in the data dir
        directory, model_id, files = resolve_checkpoint(config)
    bnb = None if torch_kernels else quantization_config(config.quant, dtype)
    with startup.step("loading the model"):
        tokenizer = _tokenizer(directory, model_id, config.chat_template)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                directory,
                dtype=dtype,
                quantization_config=bnb,
                device_map=str(device),
                local_files_only=True,
            )
        except Exception as e:  # noqa: BLE001 - a one-line error naming the model
            raise ModelLoadError(_unloadable(directory, model_id, e)) from e
    model.eval()
    kernel = "dense" if config.quant == "none" else "bitsandbytes"
    # through bitsandbytes only (importing it costs seconds where it is not used)
    if bnb is not None and config.quant == "nf4" and fused_proj.fuse_bnb_4bit(model):
        kernel = "bitsandbytes-fused"  # q/k/v and gate/up: one 4-bit matmul each
    if torch_kernels:
        with torch.inference_mode(), startup.step("quantizing the model"):
            kernel = quantize.quantize_model(
                model,
                config.quant,
                config.cpu_dense_above,
                config.cpu_activations,
                startup.progress,
                config.cpu_bf16_above,
            )
    mc = model.config
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    kv_heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
    kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype, torch_kernels)
    cuda_attention = ""
    if device.type == "cuda":
        triton = config.cuda_attention == "triton" and triton_attention.available()
        cuda_attention = "triton" if triton and needs_general(mc) is None else "gather"
        group = mc.num_attention_heads // kv_heads
        why = cuda_attention == "triton" and triton_attention.self_check(
            device, kv_dtype, head_dim, group
        )
        if why:
            log.warning("the Triton attention kernel failed its check (%s): gathered instead", why)
            cuda_attention = "gather"
    triton_layers = triton_layer.used(cuda_attention, dtype) and fits(model)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        weights_hash=weights_hash(files, config.data_dir / CACHE_FILE),
        quant=config.quant,
        kernel=kernel,
        device=device,
        dtype=dtype,
        kv_dtype=kv_dtype,
        model_bytes=model.get_memory_footprint() + quantize.dense_copy_bytes(model),
        num_layers=mc.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position=getattr(mc, "max_position_embeddings", 2048),
        config_hash=config_hash(directory / "config.json"),
        # on CPU crowdchat's kernels compute K/V too, with loops chosen by their build's ISA
        numerics=numerics_versions()
        + (f" kernels={cpu_kernels.isa()}" if device.type == "cpu" else "")
        + (f" attention={cuda_attention}" if cuda_attention else "")
        + (" layers=triton" if triton_layers else ""),
        cuda_attention=cuda_attention,
        decode_buckets=decode_buckets(config, cuda_attention),
        triton_layers=triton_layers,
    )
    log.info(
        "loaded %s (%s via %s, %s) on %s: %.1f MB of weights",
        model_id,
        config.quant,
        kernel,
        dtype_name(dtype),
        device,
        loaded.model_bytes / 2**20,
    )
    return loaded


def local_tokenizer(config: EngineConfig) -> tuple[PreTrainedTokenizerBase, str, int, int]:
    """(tokenizer, model id, context length, vocabulary size) of `--model`, read from its
    directory without loading weights (the embedded GGUF is converted once, as vLLM needs)."""
    if config.model is None or config.model.endswith(".gguf"):
        directory, model_id, _ = resolve_checkpoint(config)
    else:
        directory = Path(config.model).expanduser()
        model_id = directory.name
        if not (directory / "config.json").is_file():
            raise ModelLoadError(f"model directory has no config.json: {directory}")
    tokenizer = _tokenizer(directory, model_id, config.chat_template)
    try:
        mc = json.loads((directory / "config.json").read_text())
    except Exception as e:  # noqa: BLE001 - a one-line error naming the path
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {e}") from e
    vocab = max(int(mc.get("vocab_size") or 0), len(tokenizer))
    return tokenizer, model_id, int(mc.get("max_position_embeddings") or 2048), vocab


def _tokenizer(directory: Path, model_id: str, template: Path | None) -> PreTrainedTokenizerBase:
    """The model's tokenizer with a chat template that renders a conversation: its own, or
    `--chat-template`'s; ModelLoadError naming the model and the flag where it has none."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a one-line error naming the model
        raise ModelLoadError(f"cannot read the tokenizer of {model_id} ({directory}): {e}") from e
    if template is not None:
        tokenizer.chat_template = template.read_text(encoding="utf-8")
    if not tokenizer.chat_template:
        raise ModelLoadError(
            f"{model_id} has no chat template (base models' GGUF files often carry none): "
            "start with --chat-template FILE, a Jinja chat template as vLLM's --chat-template "
            "takes it"
        )
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
    except Exception as e:  # noqa: BLE001 - a template error, said in one line
        where = f"--chat-template {template}" if template else f"the chat template of {model_id}"
        raise ModelLoadError(f"{where} does not render a conversation: {e}") from e
    return tokenizer


def _unloadable(directory: Path, model_id: str, error: Exception) -> str:
    """Why transformers cannot load the model, in a line that names it and its architecture."""
    try:
        mc = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        mc = {}
    arch = ", ".join(mc.get("architectures") or []) or mc.get("model_type") or "unknown"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"cannot load {model_id} ({directory}): transformers {transformers.__version__} "
        f"cannot load its architecture {arch}: {first}"
    )

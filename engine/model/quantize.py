"""Which of a model's linears become which of engine.model.cpu_quant's quantized linears.

q/k/v and gate/up are fused first (engine.model.fused_proj), then every other bias-free
linear is swapped in place; the output projection gets int8 (or float16 beside float16 dense
copies). The returned name goes into the KV fingerprint and onto the admin page.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from engine.kernels import cpu_kernels
from engine.model import bf16_gemm, cpu_quant
from engine.model.cpu_quant import (
    GROUP_SIZE,
    DenseCopy,
    DenseKind,
    Fp16Linear,
    Int4Linear,
    Int8Linear,
    QuantLinear,
    split_forward,
)
from engine.model.fused_proj import fuse_projections

log = logging.getLogger("engine.model.cpu_quant")


def quantize_model(
    model: nn.Module,
    quant: str,
    dense_rows: int | None,
    activations: str = "auto",
    progress: Callable[[float], None] | None = None,
    bf16_above: int = 0,
) -> str:
    """Replace the decoder's linears (int4 or int8 per `quant`) and the output projection
    (int8, or float16 beside float16 dense copies) in place; `activations` as
    `--cpu-activations`; `progress(fraction)` of the weights done, as it goes. Returns the
    kernels' name for the KV fingerprint and the admin page. `bf16_above`: as
    `--cpu-bf16-above` (engine.model.bf16_gemm)."""
    dense = cpu_quant.dense_kind(model.dtype, dense_rows)
    # crowdchat's 4-bit kernel where compute is float32 (PyTorch's is fast on native bf16)
    own = quant == "nf4" and model.dtype == torch.float32 and cpu_kernels.q4_linear() is not None
    dot_layout = own and cpu_kernels.q4_dot_layout()
    # int8 activations where crowdchat's kernel has them (AVX512-VNNI with AVX512-BF16, or
    # AVX2: csrc/q8_avx2.cpp), unless asked not to
    q8 = own and activations != "bfloat16" and cpu_kernels.q8_activations()
    if activations == "int8" and not q8:
        log.warning("--cpu-activations int8 needs crowdchat's AVX2 or AVX512-VNNI kernel: bfloat16")
    # on the AVX512-BF16 kernel and on the int8-activation ones no dense copy beside the 4-bit
    # weights, and the output projection in int8 on the same kind of kernel: faster at every
    # row count measured (csrc/q4_linear.cpp, csrc/q8_avx2.cpp), unless the operator asks for
    # a copy (`--cpu-dense-above`)
    dot = (dot_layout or q8) and dense_rows is None

    total = sum(m.weight.numel() for m in model.modules() if type(m) is nn.Linear) or 1
    done = 0

    def tick(weights: int) -> None:
        nonlocal done
        done += weights
        if progress is not None:
            progress(min(done / total, 1.0))

    wide = bf16_gemm.rows_above(bf16_above) if dot and q8 else 0

    def make(w: torch.Tensor, d: DenseKind | None) -> QuantLinear:
        linear = Int4Linear(w, None if dot else d, own, q8) if quant == "nf4" else Int8Linear(w, d)
        if isinstance(linear, Int4Linear) and linear.widens:
            linear.bf16_rows = wide
        tick(w.numel())
        return linear

    # q/k/v and gate/up first, each group as one packed matrix (see engine.model.fused_proj)
    groups = fuse_projections(
        model,
        lambda w: make(w, dense),
        split_forward,
        lambda m: quant != "nf4" or m.in_features % GROUP_SIZE == 0,
    )
    swapped = 0
    head = "int8"
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.bias is not None:
                continue
            if child is model.get_output_embeddings():
                tick(child.weight.numel())
                if dot:  # int8 on crowdchat's kernel: half the bytes of float16
                    setattr(parent, name, Int8Linear(child.weight, None, own=True, q8=q8))
                    isa = "AVX512" if dot_layout else "AVX2"
                    head = f"int8, crowdchat's {isa} kernel, {'int8' if q8 else 'bf16'} x"
                elif dense is not None and dense.fp16:
                    setattr(parent, name, Fp16Linear(child.weight))
                    head = "fp16"
                else:
                    setattr(parent, name, Int8Linear(child.weight, dense))
            elif quant == "nf4" and child.in_features % GROUP_SIZE:
                tick(child.weight.numel())
                continue  # a shape the int4 kernel cannot group: stays dense
            else:
                setattr(parent, name, make(child.weight, dense))
            swapped += 1
    log.info(
        "CPU weight-only %s%s on %d linears + %d fused groups, output projection %s, %s",
        quant,
        (
            f" (crowdchat's AVX512-BF16 kernel, {'int8' if q8 else 'bfloat16'} activations)"
            if dot_layout
            else " (crowdchat's AVX2 kernel, int8 activations)"
            if q8
            else " (crowdchat's kernel)"
        )
        if own
        else "",
        swapped,
        groups,
        head,
        None if dot else dense,
    )
    name = "torch-int8"
    if quant == "nf4":
        name = f"{'crowdchat' if own else 'torch'}{'-dot' if dot_layout else ''}-int4g{GROUP_SIZE}"
        name += "-q8" if q8 else ""
        name += f"-bf16>{wide}" if wide else ""  # many-row steps' activations in bf16
    return name + "+fp16" if dense is not None and dense.fp16 and not dot else name


def dense_copy_bytes(model: nn.Module) -> int:
    """Bytes of the FBGEMM-packed copies, which `get_memory_footprint` (parameters and buffers)
    does not see."""
    return sum(m.packed_bytes for m in model.modules() if isinstance(m, DenseCopy))

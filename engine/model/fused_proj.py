"""One weight-only kernel call for projections that read the same input (q/k/v, gate/up).

At one row a step is mostly per-call overhead, not arithmetic: the int4 kernel takes ~28 us a
call whatever its width, and the embedded model makes 210 of them a token. Quantizing the
concatenated weights of q/k/v (and of gate/up) makes one packed matrix with exactly the same
4-bit values and scales (groups run along each output row), and the kernel computes each output
column the same way whatever the matrix's width (checked bitwise in tests/test_cpu_quant.py),
so fusing changes no result: it only cuts 210 calls to 120.

transformers' model code still calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)` one after the other
on the same tensor; each becomes a `ProjectionPart` of one `FusedProjection`, which computes all
parts on the first call and hands out the others' slices while the input is the same object.
Any other order or input is still correct, only slower (it recomputes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Split = Callable[[nn.Module, torch.Tensor, list[int]], tuple[torch.Tensor, ...]]

# Sibling projections that transformers' decoder layers call on the same input, in this order.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjection(nn.Module):
    """The concatenated linear, and its last input and outputs while the parts are served."""

    def __init__(self, linear: nn.Module, sizes: list[int], split: Split) -> None:
        super().__init__()
        self.linear = linear
        self.sizes = sizes
        self.split = split
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every part's output for `x`, in one kernel call (or one matmul per part on the
        dense copy, as `split` decides)."""
        return self.split(self.linear, x, self.sizes)

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self._input is not x:
            self._parts = self.outputs(x)
            self._input = x
        out = self._parts[i]
        if i == len(self.sizes) - 1:  # the last part in call order: let the step's tensors go
            self._input, self._parts = None, ()
        return out


class ProjectionPart(nn.Module):
    """What `q_proj` (or `k_proj`, ...) becomes: part `index` of a fused projection."""

    def __init__(self, fused: FusedProjection, index: int) -> None:
        super().__init__()
        self.in_features = fused.linear.in_features
        self.out_features = fused.sizes[index]
        self.index = index
        # a plain attribute, not a submodule: the fused weights are registered once, on the
        # parent, and `model.modules()` does not walk them three times
        self.__dict__["fused"] = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.index)


def fuse_groups(
    model: nn.Module, build: Callable[[list[nn.Module | None]], nn.Module | None], split: Split
) -> int:
    """Replace each group of sibling linears of `GROUPS` for which `build(linears)` returns a
    fused linear by parts of that one linear, computed by `split` (`split(linear, x, sizes)`:
    the parts' outputs); `build` gets each group's modules (None where a parent lacks one) and
    returns None where it cannot fuse them. Returns the groups fused."""
    fused = 0
    for parent in list(model.modules()):
        for names in GROUPS:
            linears = [getattr(parent, n, None) for n in names]
            linear = build(linears)
            if linear is None:
                continue
            group = FusedProjection(linear, [m.out_features for m in linears], split)
            parent.register_module("_".join(n.removesuffix("_proj") for n in names), group)
            for i, n in enumerate(names):
                setattr(parent, n, ProjectionPart(group, i))
            fused += 1
    return fused


def fuse_projections(
    model: nn.Module,
    make: Callable[[torch.Tensor], nn.Module],
    split: Split,
    fits: Callable[[nn.Linear], bool],
) -> int:
    """Replace each group of bias-free sibling linears of `GROUPS` that `fits` accepts by parts
    of one linear built by `make` from their concatenated weights, computed by `split`
    (`split(linear, x, sizes)`: the parts' outputs). Returns the groups fused."""

    def build(linears: list[nn.Module | None]) -> nn.Module | None:
        if not all(type(m) is nn.Linear and m.bias is None and fits(m) for m in linears):
            return None
        if len({m.in_features for m in linears}) != 1:
            return None
        return make(torch.cat([m.weight.detach() for m in linears]))

    return fuse_groups(model, build, split)


def _outputs(linear: nn.Module, x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    return linear(x).split(sizes, dim=-1)


def fuse_bnb_4bit(model: nn.Module) -> int:
    """q/k/v and gate/up as one bitsandbytes 4-bit linear each (CUDA, `--quant nf4`), from the
    parts' own quantized bytes: 4-bit weights are quantized in blocks of 64 along the flattened
    `[out, in]` matrix, so where `in` is a multiple of the block size the concatenated bytes and
    block scales are exactly the fused matrix's quantization (tests/test_cuda_fuse.py: the
    dequantized weights bitwise). Returns the groups fused; groups with nested (double-
    quantized) scales, biases or other shapes stay as they are."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState

    def build(linears: list[nn.Module | None]) -> nn.Module | None:
        if not all(type(m) is bnb.nn.Linear4bit and m.bias is None for m in linears):
            return None
        states = [m.weight.quant_state for m in linears]
        first = states[0]
        if first is None or any(
            s is None
            or s.nested
            or (s.blocksize, s.quant_type, s.dtype)
            != (first.blocksize, first.quant_type, first.dtype)
            for s in states
        ):
            return None
        k = linears[0].in_features
        if any(m.in_features != k for m in linears) or k % first.blocksize:
            return None
        n = sum(m.out_features for m in linears)
        state = QuantState(
            absmax=torch.cat([s.absmax for s in states]),
            shape=torch.Size([n, k]),
            code=first.code,
            blocksize=first.blocksize,
            quant_type=first.quant_type,
            dtype=first.dtype,
        )
        data = torch.cat([m.weight.data.reshape(-1) for m in linears]).reshape(-1, 1)
        linear = bnb.nn.Linear4bit(
            k,
            n,
            bias=False,
            compute_dtype=linears[0].compute_dtype,
            compress_statistics=False,
            quant_type=first.quant_type,
            quant_storage=data.dtype,
            device=data.device,
        )
        linear.weight = bnb.nn.Params4bit(
            data,
            requires_grad=False,
            quant_state=state,
            blocksize=first.blocksize,
            compress_statistics=False,
            quant_type=first.quant_type,
            quant_storage=data.dtype,
            module=linear,
            bnb_quantized=True,
        )
        return linear

    return fuse_groups(model, build, _outputs)

"""The KV pool's tensors: sized once from the memory budget, addressed by block tables."""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable

import psutil
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequest, ModelLoadError
from engine.kernels import cpu_kernels
from engine.kv_file import KVFile, KVFileDamaged, check_crc32
from engine.model.loader import LoadedModel

log = logging.getLogger(__name__)

CPU_DEFAULT_SHARE = 0.25  # of available RAM, when --kv-budget-mb is not given
CPU_DEFAULT_CAP = 4 << 30
CUDA_ACTIVATION_SLACK = 512 << 20


def bytes_per_token(loaded: LoadedModel) -> int:
    """KV bytes one token costs: K and V, every layer, every KV head."""
    elem = torch.empty((), dtype=loaded.kv_dtype).element_size()
    return 2 * loaded.num_layers * loaded.num_kv_heads * loaded.head_dim * elem


def kv_budget_bytes(config: EngineConfig, loaded: LoadedModel) -> int:
    """The memory the pool may take: what is left after the model (CUDA) or a RAM share (CPU)."""
    if loaded.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(loaded.device)
        hidden = loaded.model.config.hidden_size
        vocab = loaded.model.config.vocab_size
        activations = (
            config.max_num_batched_tokens * hidden * 16 * 4
            + config.max_num_seqs * vocab * 4 * 2
            + CUDA_ACTIVATION_SLACK
        )
        budget = int(free * config.gpu_memory_utilization) - activations
        if config.kv_budget_mb is not None:  # the operator's cap holds on CUDA too
            budget = min(budget, int(config.kv_budget_mb * 2**20))
        return budget
    available = psutil.virtual_memory().available
    if config.kv_budget_mb is not None:
        budget = int(config.kv_budget_mb * 2**20)
        if budget > available:
            raise ModelLoadError(
                f"--kv-budget-mb {config.kv_budget_mb:.0f} exceeds available RAM "
                f"({available / 2**20:.0f} MB)"
            )
        return budget
    return int(min(available * CPU_DEFAULT_SHARE, CPU_DEFAULT_CAP))


def pool_blocks(config: EngineConfig, loaded: LoadedModel) -> int:
    """How many KV blocks the budget holds (at least 2, or the operator is told what to do)."""
    budget = kv_budget_bytes(config, loaded)
    num_blocks = budget // (bytes_per_token(loaded) * config.block_size)
    if num_blocks < 2:
        raise InvalidRequest(
            f"KV budget {budget / 2**20:.1f} MB holds fewer than 2 blocks; "
            "raise --kv-budget-mb or --gpu-memory-utilization"
        )
    return num_blocks


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """A zeroed CPU tensor on its own anonymous mapping, advised to transparent huge pages
    (where the kernel allows them: `madvise` or `always` mode), and the mapping, which must
    outlive it. The attention kernel reads each sequence's blocks from anywhere in the pool,
    one 2-6 KB block after another; with 4 KB pages nearly every block costs a TLB miss, and
    under a VM's nested paging a slow one. With 2 MB pages one decode step's attention from
    memory took 10-17% less time (30 layers, 32 x 200 / 32 x 400 / 8 x 1,000 tokens: 17.9 ->
    14.9, 29.3 -> 26.9, 20.8 -> 18.6 ms, 2-core Zen 5 EPYC VM). The pages are zeroed as first
    touched: all of them are touched here, at start (as `torch.zeros` did), so that no turn
    pays for faulting them in (`bench/restore.py`'s restores read 407-555 MB/s into untouched
    pages, 720-816 into touched ones)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KB pages then
            pass
    tensor = torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape)).view(shape)
    return tensor.zero_(), mapping


class KVCache:
    """K and V for every layer in one preallocated tensor `[2, L, H_kv, slots, D]`.

    A slot is `block * block_size + offset`. Heads come before slots so that a layer's new
    K/V (`[H_kv, T, D]` as the model makes them) are written without a transpose, and a
    gathered context (`[H_kv, B, L, D]`) is contiguous for the attention matmuls. Only the
    engine thread touches it.
    """

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, block_size: int, scratch: bool = False
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        # with `scratch`, the last block is not the pool's to hand out: padding rows of a
        # static decode step write their K/V there (engine.model.static_decode)
        self.scratch_block: int | None = num_blocks - 1 if scratch else None
        shape = (2, loaded.num_layers, loaded.num_kv_heads, num_blocks * block_size)
        shape += (loaded.head_dim,)
        self.mapping: mmap.mmap | None = None  # the CPU pool's memory (huge pages)
        self._stream: torch.cuda.Stream | None = None  # CUDA: exports' and imports' stream
        if loaded.device.type == "cpu":
            self.data, self.mapping = host_zeros(shape, loaded.kv_dtype)
        else:
            self.data = torch.zeros(shape, dtype=loaded.kv_dtype, device=loaded.device)
        self.k = list(self.data[0])  # per layer: [H_kv, slots, D]
        self.v = list(self.data[1])

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot ids of token positions [start, end) of a sequence.  # [end - start]"""
        bs = self.block_size
        table = torch.tensor(block_table, dtype=torch.long)
        pos = torch.arange(start, end)
        return (table[pos // bs] * bs + pos % bs).to(self.data.device)

    def export(self, block_table: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the KV of a sequence's first `num_tokens` tokens to CPU.  # 2 x [L, T, H_kv, D]"""
        k, v, wait = self.export_async(block_table, num_tokens)
        wait()
        return k, v

    def export_async(
        self, block_table: list[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
        """`export`, and a function that waits until its K and V are filled (call it before
        reading them, off the engine thread). On CUDA the gather and the copy into pinned host
        memory run on a side stream: the engine thread only enqueues them, and its next steps
        wait for the gather alone (after which the blocks may be written again), not for the
        copy to the host."""
        idx = self.slots(block_table, 0, num_tokens)

        def gather() -> list[torch.Tensor]:  # K and V of those slots, [L, T, H_kv, D] each
            return [self.data[i].index_select(2, idx).transpose(1, 2).contiguous() for i in (0, 1)]

        if self.data.device.type != "cuda":
            k, v = gather()
            return k, v, lambda: None
        compute, side = torch.cuda.current_stream(self.data.device), self._side_stream()
        side.wait_stream(compute)  # the steps that wrote this KV
        idx.record_stream(side)  # made on the steps' stream, read on this one
        gathered, copied = torch.cuda.Event(), torch.cuda.Event()
        with torch.cuda.stream(side):
            parts = gather()
            gathered.record(side)
            k, v = (torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in parts)
            k.copy_(parts[0], non_blocking=True)
            v.copy_(parts[1], non_blocking=True)
            copied.record(side)
        compute.wait_event(gathered)
        return k, v, copied.synchronize

    def _side_stream(self) -> torch.cuda.Stream:
        """The stream KV exports and imports run on (CUDA), beside the steps' stream."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.data.device)
        return self._stream

    def load(
        self, block_table: list[int], k: torch.Tensor, v: torch.Tensor, start: int = 0
    ) -> None:
        """Write exported KV (`[L, T, H_kv, D]` each) into positions `start`.. of the blocks."""
        idx = self.slots(block_table, start, start + k.shape[1])
        dev, dt = self.data.device, self.data.dtype
        if dev.type == "cuda":  # on the side stream; the next steps wait for it on the device
            compute, side = torch.cuda.current_stream(dev), self._side_stream()
            side.wait_stream(compute)  # steps still reading these blocks' last owner's KV
            idx.record_stream(side)
            loaded = torch.cuda.Event()
            with torch.cuda.stream(side):
                k = k.to(dev, dt, non_blocking=k.is_pinned())
                v = v.to(dev, dt, non_blocking=v.is_pinned())
                self.data[0].index_copy_(2, idx, k.transpose(1, 2))
                self.data[1].index_copy_(2, idx, v.transpose(1, 2))
                loaded.record(side)
            compute.wait_event(loaded)
            return
        k, v = k.to(dev, dt), v.to(dev, dt)
        if dev.type == "cpu" and cpu_kernels.loaded():  # row copies, on all cores: 2x faster
            torch.ops.crowdchat.kv_scatter(self.data[0], k.contiguous(), idx)
            torch.ops.crowdchat.kv_scatter(self.data[1], v.contiguous(), idx)
            return
        self.data[0].index_copy_(2, idx, k.transpose(1, 2))
        self.data[1].index_copy_(2, idx, v.transpose(1, 2))

    def load_file(self, block_table: list[int], kv: KVFile, start: int) -> None:
        """Write a file's K and V into positions `start`.. of the blocks on the calling thread,
        where `reads_files(kv)`: the blocks are reserved (nothing reads them meanwhile), and
        one pass over the file checksums all its bytes and copies them, with the GIL released.
        Raises KVFileDamaged for a bad file, before or after writing into the blocks (the
        caller then lets them go)."""
        assert self.reads_files(kv)
        n = len(kv.token_ids)
        idx = self.slots(block_table, start, n)
        read = torch.ops.crowdchat.kv_read_file
        try:
            crc = read(str(kv.path), kv.k_at, self.data[0], idx, n, start, 0)
            crc = read(str(kv.path), kv.v_at, self.data[1], idx, n, start, crc)
        except ValueError as e:  # the file, not the call (`kv_read_file`'s own checks)
            raise KVFileDamaged(f"unreadable ({e})") from e
        check_crc32(kv, crc)

    def reads_files(self, kv: KVFile) -> bool:
        """Whether `load_file` can read `kv`: a CPU pool of its dtype, with crowdchat's kernels."""
        cpu = self.data.device.type == "cpu" and kv.dtype == self.data.dtype
        return cpu and cpu_kernels.loaded()

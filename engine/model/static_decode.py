"""A step of decodes on persistent buffers, replayed on CUDA as one captured graph per bucket.

An eager decode step on the GPU is launch-bound: ~40 ATen calls and several bitsandbytes calls
a layer, each paying Python and dispatcher time, and its inputs built as fresh tensors, each a
blocking host-to-device copy. Here a step of n decodes runs as bucket b (the smallest of
`LoadedModel.decode_buckets` >= n, up to `--cuda-graph-rows`):

- its inputs (token ids, positions, slot mapping, context lengths, where a row's token comes
  from the previous step's picks, and an int64 block table as wide as the longest context the
  engine admits) live in one persistent device buffer, filled from a pinned host buffer by one
  non-blocking copy a step. There are two host buffers, taken in turn, each with an event
  recorded after its copy: while step N's copy may still be reading one, step N+1 fills the
  other (engine.core.loop runs a step ahead), and waits on its event first (done unless the
  GPU is more than a step behind);
- a row whose token the previous step sampled on the device and the host has not read yet
  (run-ahead: `engine.sequence.PLACEHOLDER`) takes it from that step's picks on the device;
- rows n..b-1 are padding: length 0 (the Triton kernel writes zeros for them), their new K/V
  written into a scratch block the pool keeps aside (`KVCache(scratch=True)`), so they touch
  no one's context;
- the forward is the lean Llama forward with the Triton decode kernel, whose launch depends on
  the rows and the table's width only (engine.kernels.triton_attention), so on CUDA it is
  captured once per bucket (`torch.cuda.CUDAGraph`, all buckets in one memory pool, largest
  first) and each step is one replay; the logits stay on the device for the sampler, and the
  step reads back only the sampled ids.

On the CPU (tests) the same buffers run eagerly, so the padding, the scratch block and the
fixed-width table are tested without a GPU; `tests/test_cuda.py` tests capture and replay.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from engine.kernels import triton_attention
from engine.kernels.cpu_kernels import Kernel
from engine.model.attention import DecodeGroup, StepMetadata
from engine.model.kv_cache import KVCache
from engine.model.lean_llama import LeanLlama
from engine.sequence import Sequence

log = logging.getLogger(__name__)


class CopyDone:
    """The CPU's stand-in for a CUDA event after a copy: copies there are done when issued."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


# per row before its table: token id, position, slot, context length, and the row of the
# previous step's picks its token id is (-1: the id given)
FIELDS = 5
# A bucket's decode attention is cut into about this many (row, KV head, split) programs: a
# few per SM of an H100 (132) or H200, so one row alone still spreads its context over the
# GPU, while a full bucket takes few long splits and its partial sums ([rows, heads, splits,
# D] float32, written only for splits that hold tokens) stay small: 8B shape at
# --max-model-len 8,192, 32 rows, 4 splits of 2,048 tokens: 2 MB a layer, where one split
# size for every bucket from the model's 131,072 positions made 32 MB.
TARGET_PROGRAMS = 1024
MAX_SPLITS = 64  # at most this many splits a row's KV head (a row alone: 128 tokens each at 8k)
MIN_SPLIT_TOKENS = 64  # shorter splits cost more in merging than they spread


def split_tokens(width_tokens: int, rows: int, kv_heads: int, block_size: int) -> int:
    """Context tokens a program of a `rows`-row bucket takes, for tables `width_tokens` wide:
    enough splits for about `TARGET_PROGRAMS` programs, a whole number of blocks each."""
    splits = min(MAX_SPLITS, max(1, -(-TARGET_PROGRAMS // (rows * kv_heads))))
    split = max(MIN_SPLIT_TOKENS, -(-width_tokens // splits))
    return -(-split // block_size) * block_size


class StaticDecode:
    """`run(decodes)` -> their logits [n, V] (plan order), on buffers that outlive the step."""

    def __init__(
        self,
        lean: LeanLlama,
        cache: KVCache,
        sizes: tuple[int, ...],
        max_model_len: int,
        rope_store: Kernel | None = None,
    ) -> None:
        assert sizes and cache.scratch_block is not None
        self.lean, self.cache, self.sizes, self.rope_store = lean, cache, sizes, rope_store
        self.device = cache.data.device
        bs = cache.block_size
        self.block_size = bs
        # table columns: the blocks of the longest context the engine admits (--max-model-len,
        # at most the pool), not the model's positions (131,072 for Llama 3: 8,192 columns)
        self.width = -(-min(max_model_len, cache.num_blocks * bs) // bs)
        heads = cache.k[0].shape[0]  # KV heads
        self.split_tokens = {b: split_tokens(self.width * bs, b, heads, bs) for b in sizes}
        self.attend = {
            b: functools.partial(triton_attention.paged_decode_attention, split_tokens=t)
            for b, t in self.split_tokens.items()
        }
        rows = sizes[-1]
        self.max_rows = rows
        self.scratch_slot = cache.scratch_block * bs
        # one flat int64 buffer: ids, positions, slots, lengths, sources ([rows] each), then
        # the table; two pinned host buffers taken in turn, each with its last copy's event
        total = rows * (FIELDS + self.width)
        cuda = self.device.type == "cuda"
        self.hosts = [torch.zeros(total, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.copied = [torch.cuda.Event() if cuda else CopyDone() for _ in range(2)]
        self.turn = 0  # the host buffer the next step fills
        self.flat = torch.zeros(total, dtype=torch.long, device=self.device)
        self.ids, self.positions, self.slots, self.lens, self.sources = self.flat[
            : FIELDS * rows
        ].view(FIELDS, rows)
        self.table = self.flat[FIELDS * rows :].view(rows, self.width)
        self.logit_rows = torch.arange(rows, device=self.device)
        for host in self.hosts:
            self._pad(host.numpy(), 0)
        self.flat.copy_(self.hosts[0])
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_bytes = 0

    def fits(self, decodes: list[Sequence]) -> bool:
        """Whether this step of decodes can run here: few enough rows, tables narrow enough."""
        if not decodes or len(decodes) > self.max_rows:
            return False
        bs, width = self.block_size, self.width
        return all(-(-(s.num_computed + 1) // bs) <= width for s in decodes)

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def _pad(self, staged: np.ndarray, first: int) -> None:
        """Rows `first`.. of a host buffer as padding: token 0 at position 0, writing the
        scratch slot, no context (their table rows are never read), no source."""
        rows = self.max_rows
        for f, value in enumerate((0, 0, self.scratch_slot, 0, -1)):
            staged[f * rows + first : (f + 1) * rows] = value

    def _fill(self, decodes: list[Sequence], sources: list[int] | None = None) -> None:
        """The step's rows into the next host buffer, then one copy to the device: the fields
        of every row and the table rows of `decodes` only (a prefix of the flat buffer; padding
        rows have no context, so their table rows are never read). `sources`: each row's index
        in the previous step's picks, or -1 where its token id is known here."""
        turn = self.turn
        self.turn ^= 1
        host, copied = self.hosts[turn], self.copied[turn]
        copied.synchronize()  # the copy that last read this buffer (two steps ago) is done
        rows, bs, staged = self.max_rows, self.block_size, host.numpy()
        table = staged[FIELDS * rows :].reshape(rows, self.width)
        for i, s in enumerate(decodes):
            p = s.num_computed  # the decode token's position
            nblk = p // bs + 1
            staged[i] = s.token_ids[p] if sources is None or sources[i] < 0 else 0
            staged[rows + i] = p
            staged[2 * rows + i] = s.block_table[p // bs] * bs + p % bs
            staged[3 * rows + i] = p + 1
            table[i, :nblk] = np.asarray(s.block_table[:nblk], dtype=np.int64)
        n = len(decodes)
        if sources is not None:
            staged[4 * rows : 4 * rows + n] = sources
        self._pad(staged, n)
        used = FIELDS * rows + n * self.width
        self.flat[:used].copy_(host[:used], non_blocking=True)
        copied.record()

    def _forward(self, b: int) -> torch.Tensor:
        """The lean forward over the first `b` rows of the buffers: logits [b, V]."""
        cache = self.cache
        meta = StepMetadata(
            k_cache=cache.k,
            v_cache=cache.v,
            block_size=self.block_size,
            slot_mapping=self.slots[:b],
            decode_groups=[DecodeGroup(0, b, self.table[:b], None, lens=self.lens[:b])],
            prefills=[],
            decode_kernel=self.attend[b],
            rope_store=self.rope_store,
        )
        ids = self.ids[:b].view(1, b)
        return self.lean.forward(ids, self.positions[:b].view(1, b), meta, self.logit_rows[:b])

    @torch.inference_mode()
    def run(
        self, decodes: list[Sequence], fed: tuple[torch.Tensor, list[int]] | None = None
    ) -> torch.Tensor:
        """The logits of `decodes` (which `fits` accepted), one row each, in their order.
        `fed`: the previous step's picks on the device ([m] int64) and, for each row, the
        index of its token among them (-1: its token id is known on the host)."""
        n = len(decodes)
        b = self.bucket(n)
        self._fill(decodes, None if fed is None else fed[1])
        if fed is not None:  # on the device, before the graph reads the ids: no host wait
            picks, sources = fed[0], self.sources[:n]
            taken = picks.index_select(0, sources.clamp(min=0))
            self.ids[:n].copy_(torch.where(sources >= 0, taken, self.ids[:n]))
        graph = self.graphs.get(b)
        if graph is None:
            return self._forward(b)[:n]
        graph[0].replay()
        return graph[1][:n]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's forward as a CUDA graph (largest first, one memory pool), on
        padding rows only; `graph_bytes` is the memory the graphs keep."""
        assert self.device.type == "cuda"
        self._pad(self.hosts[0].numpy(), 0)
        self.flat.copy_(self.hosts[0])
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for b in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm up: Triton's compile, cuBLAS's handles
                self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(b)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize(self.device)
        self.graph_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info(
            "CUDA graphs: %d decode buckets up to %d rows, %.1f MB",
            len(self.graphs),
            self.max_rows,
            self.graph_bytes / 2**20,
        )

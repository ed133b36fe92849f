"""The only code that runs the model: one flat batched forward per step over the paged cache."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from engine.kernels import cpu_kernels, triton_attention, triton_layer
from engine.kernels.cpu_kernels import Kernel
from engine.model import attention
from engine.model.attention import DecodeGroup, PrefillChunk, PrefillGroup, StepMetadata
from engine.model.kv_cache import KVCache
from engine.model.launched import LaunchedStep, StepTokens
from engine.model.lean_llama import lean_forward
from engine.model.lean_norm import fuse_norms
from engine.model.loader import LoadedModel
from engine.model.plan import StepPlan
from engine.model.sampler import sample, sample_tensor
from engine.model.static_decode import StaticDecode
from engine.sequence import PLACEHOLDER, Sequence

log = logging.getLogger(__name__)


class StepRunner(Protocol):
    """What the engine needs of whatever runs its steps: the model here, a fake in tests. One
    that also has `runs_ahead` set, `feed` and `launch` (engine.model.launched.RunsAhead) is
    run a step ahead by the loop."""

    stop_ids: list[int]  # token ids that end a reply (unless the request ignores EOS)

    def run(self, plan: StepPlan) -> dict[Sequence, int]:
        """Compute the plan's tokens; return the next token of each sequence whose known
        tokens are now all computed (decodes, and prefills that reached their end)."""
        ...


# (the model, its KV pool, the longest context the engine admits: --max-model-len, at most
# the pool) -> the step runner
RunnerFactory = Callable[[LoadedModel, KVCache, int], StepRunner]

# A decode group may pad its shorter contexts up to 25% beyond their own tokens; below
# MIN_SPLIT_WASTE padded tokens one more group (a few small ops per layer) costs more than the
# padding it saves.
MAX_PAD_SHARE = 0.25
MIN_SPLIT_WASTE = 256
# On the CPU every prefill chunk attends on crowdchat's kernel, whatever its size, all of a
# step's chunks in one call a layer (`paged_prefills_attention`): each query is bitwise its
# token's decode, so a token's K/V and logits depend neither on how the scheduler cut its
# prompt nor on the step's other rows (tests/test_prompt_cuts.py). With SDPA above 64 (or 256)
# tokens, a prompt from nothing and the same prompt after the shared system prompt's cached
# blocks left different K/V, and two users sent the same message got different replies
# (tests/test_crash.py). Whole prefill steps, SDPA against the kernel, loaded 2-core AVX2 EPYC
# (load 2.5-4.6, 3 alternating rounds): 512 fresh tokens 3.2-5.1 s against 3.1-5.5, 256 after
# 800 3.6-4.3 against 3.6-4.6, 512 after 4,000 11.9-13.1 against 10.5-12.4.
# On CUDA a chunk after cached tokens of up to this many tokens takes the Triton kernel, a
# longer one SDPA over its context gathered, a fresh one SDPA. Zen 5 EPYC, 2 cores, bf16 pool,
# one layer, the CPU kernel against SDPA: 15 tokens after 2,000 0.47-0.52 ms against 0.91-2.4;
# 64 after 2,000 1.9-2.2 against 2.6-2.8; 128 after 500 1.9-2.2 against 1.5-1.6.
PREFILL_KERNEL_TOKENS = 64
# A CPU step of up to this many rows (decodes plus prefill tokens) runs on the engine thread
# alone. With passive OpenMP waits (engine/threads.py) a parallel region wakes a sleeping thread,
# and where an idle core halts (a VM's vCPU) a wake-up costs tens of microseconds each way; a
# decode step on the 4-bit kernels is one region (`decode_stack`: its rows split over the
# threads), which pays off from a few rows. Zen 5 EPYC, 2-core firecracker VM, decode step
# alone / on both cores: 2 rows 4.9-5.9 / 5.7-6.0 ms, 4 rows 7.0-8.5 / 6.6-9.5, 8 rows
# 10.3-12.1 / 8.0-8.2, 12 rows 18.8-19.7 / 9.8-10.2. Where a few-row decode step splits its
# matmuls' columns over the threads instead (`LeanLlama.shared_decodes`, the int8-activation
# kernels) every step takes all of them: 2-core Sapphire Rapids VM over HTTP, 1 / 2 / 4 users
# 84.6-90.4 / 138.8-164.3 / 226.0-262.5 tokens/s against 68.9-75.2 / 120.0-124.2 /
# 188.2-248.5 with this bound.
SERIAL_ROWS = 3
# A step with prompt tokens runs op by op, each op a parallel region that wakes the other core
# under passive waits; on the AVX512-VNNI kernels (fast enough that the wake-ups dominate) such
# a step of up to this many rows runs on the engine thread alone. Sapphire Rapids VM,
# in-process, one thread against two: prefills of 1 / 8 / 32 / 64 / 128 tokens 19.5 / 25-26 /
# 45-51 / 77-78 / 140-144 ms against 21-24 / 35 / 51-61 / 85-91 / 131-134; 16 decodes with 32
# prompt tokens 67-68 against 75-77, 30 with 26: 90 against 80-83. On the AVX2 build there two
# threads won from 8 tokens (38 against 41 ms; 32 tokens 72 against 96-98): SERIAL_ROWS.
PROMPT_SERIAL_ROWS = 48
# ... unless its attention reads this many (query, key) pairs or more: a returning user's
# message after a long conversation attends over its threads. Sapphire Rapids VM, in-process, a
# chunk after cached tokens alone / on both cores: 25 tokens after 100 / 500 / 2,000 31.5 /
# 44.1 / 81.1 ms against 42.3 / 51.2 / 66.6; 8 after 2,000 37.0 against 34.7; 48 after 500
# 74.1 against 75.2.
PROMPT_SERIAL_PAIRS = 16_384
# A CPU step with prompt tokens whose attention reads fewer (query, key) pairs than this runs as
# one `crowdchat::prompt_stack` call on the int8-activation kernels (each token a row attending
# its own context, as a decode; spin barriers between phases), not op by op. Sapphire Rapids
# VM, in-process, op by op against stacked: prompts of 8 / 22 / 48 tokens 17.2 / 29.5 / 45.7 ms
# against 8.9 / 15.3 / 25.8; 7 decodes and a 26-token message 42.5 against 22.8; 23 prompts x 22
# tokens 283 against 219; 17 messages of 30 tokens after 90 314-327 against 246-254; 25 tokens
# after 2,000 76 against 52; 64 after 2,000 137 against 125 (its attention alone measured past
# the bound: 512 fresh tokens 397-405 against 326-341 (262,144 pairs as counted here), 256
# after 1,000 288-307 against 294-301, 128 after 3,000 287-290 against 312-321).
PROMPT_STACK_PAIRS = 262_144


def decode_groups(lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """Cut ascending context lengths into `[lo, hi)` groups, each padded to its last one's
    blocks, splitting where the padding would exceed `MAX_PAD_SHARE` of the real tokens."""
    groups: list[tuple[int, int]] = []
    lo, used = 0, 0
    for i, n in enumerate(lens):
        padded = (i - lo + 1) * -(-n // block_size) * block_size
        if i > lo and padded - (used + n) > max(MAX_PAD_SHARE * (used + n), MIN_SPLIT_WASTE):
            groups.append((lo, i))
            lo, used = i, 0
        used += n
    if lens:
        groups.append((lo, len(lens)))
    return groups


def _pairs(plan: StepPlan) -> int:
    """The (query, key) pairs a step's attention reads (a chunk's n x its context's length)."""
    pairs = sum(s.num_computed + 1 for s in plan.decodes)
    return pairs + sum(n * (s.num_computed + n) for s, n in plan.prefills)


def prefill_group(chunks: list[tuple[int, int, int, list[int]]], dev: torch.device) -> PrefillGroup:
    """Consecutive chunks of the flat row, each (its first row, its sequence's tokens before
    it, its tokens, its sequence's blocks), as one call of the CPU's prefill kernel."""
    width = max(len(blocks) for *_, blocks in chunks)
    table = torch.zeros(len(chunks), width, dtype=torch.long)
    for row, (*_, blocks) in enumerate(chunks):
        table[row, : len(blocks)] = torch.tensor(blocks)
    start, end = chunks[0][0], chunks[-1][0] + chunks[-1][2]
    starts = torch.tensor([p0 for _, p0, _, _ in chunks])
    sizes = torch.tensor([n for _, _, n, _ in chunks])
    return PrefillGroup(start, end, table.to(dev), starts.to(dev), sizes.to(dev))


class ModelRunner:
    """Builds a step's inputs from the plan, runs the model once, samples next tokens."""

    def __init__(self, loaded: LoadedModel, cache: KVCache, max_model_len: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.cache = cache
        self.model.set_attn_implementation(attention.IMPLEMENTATION)
        fuse_norms(
            self.model
        )  # bitwise the same outputs, 1 op instead of 8 (engine.model.lean_norm)
        # Llama-shaped decoders run as one flat function, bitwise the same (engine.model.lean_llama)
        self.lean = lean_forward(self.model)
        # decode attention straight from the pool's blocks: on the CPU crowdchat's C++ kernels
        # (engine.kernels.cpu_kernels), on CUDA its Triton ones (engine.kernels.triton_attention)
        general = attention.needs_general(self.model.config)
        cpu = self.device.type == "cpu" and general is None
        self.decode_kernel = cpu_kernels.decode_attention() if cpu else None
        # and a step's short prefill chunks (new prompts, a returning user's message), in one
        # call a layer on the CPU; CUDA's Triton kernel takes one chunk after cached tokens
        self.prefills_kernel = cpu_kernels.prefills_attention() if self.decode_kernel else None
        self.prefill_kernel: Kernel | None = None
        self.rope_store: Kernel | None = None
        if loaded.cuda_attention == "triton":
            self.decode_kernel = triton_attention.paged_decode_attention
            self.prefill_kernel = triton_attention.paged_prefill_attention
            self.prefills_kernel = None
        if loaded.triton_layers and self.lean is not None:
            self.rope_store = triton_layer.rope_store
            self.lean.norm_kernel = triton_layer.add_rms_norm
        # CUDA with the Triton kernel: steps of decodes on persistent buffers, one captured
        # graph per batch bucket (engine.model.static_decode); the CPU runs them eagerly (tests)
        self.static: StaticDecode | None = None
        self.graph_error: str | None = None  # why capture failed, where it did
        if (
            loaded.decode_buckets
            and loaded.cuda_attention == "triton"
            and self.lean is not None
            and cache.scratch_block is not None
        ):
            self.static = StaticDecode(
                self.lean, cache, loaded.decode_buckets, max_model_len, self.rope_store
            )
            if self.device.type == "cuda":
                self._capture()
        # CUDA launches each step and reads its tokens one step later, the next step's decodes
        # taking them on the device (engine.core.loop); the CPU's forward is the engine
        # thread's own work, with nothing to overlap: every step runs with `run`
        self.runs_ahead = self.device.type == "cuda" and self.static is not None
        arch = (getattr(self.model.config, "architectures", None) or ["?"])[0]
        if self.lean is not None:
            log.info("%s: the fast path (a flat Llama forward, crowdchat's kernels)", arch)
        else:
            why = f"; attention gathered: {general}" if general else ""
            log.info("%s: transformers' own forward with paged attention%s", arch, why)
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) or loaded.tokenizer.eos_token_id
        self.stop_ids: list[int] = sorted({eos} if isinstance(eos, int) else set(eos or []))
        self._team = 0  # the engine thread's OpenMP threads for this step: 1 or all of them
        self._all_threads = 0  # its own default, read on that thread at its first step
        # rows up to which a step with prompt tokens runs alone where decodes split columns
        # (a probe of crowdchat's CPU kernels, only where they attend: on CUDA it would build
        # them, ~1 minute with `-march=native`, for nothing)
        vnni = self.prefills_kernel is not None and cpu_kernels.q4_dot_layout()
        self._prompt_serial_rows = PROMPT_SERIAL_ROWS if vnni else SERIAL_ROWS

    def _metadata(self, plan: StepPlan) -> tuple[StepMetadata, list[int], list[int], list[int]]:
        """Flat input ids, positions and which rows need logits, plus the attention metadata.

        Decodes go first in the row, sorted by context length: one group for the CPU kernel,
        which reads each one's own blocks, else cut into groups that are each padded only to
        their own longest context; `logit_rows` keeps the plan's order.
        """
        cache, dev, bs = self.cache, self.device, self.cache.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = [0] * len(plan.decodes)
        groups: list[DecodeGroup] = []
        order = sorted(range(len(plan.decodes)), key=lambda i: plan.decodes[i].num_computed)
        kernel = self.decode_kernel
        all_lens = [plan.decodes[i].num_computed + 1 for i in order]
        if kernel is None:
            spans = decode_groups(all_lens, bs)
        else:
            spans = [(0, len(order))] if order else []
        for lo, hi in spans:
            lens = all_lens[lo:hi]
            nblk = -(-lens[-1] // bs)
            table = torch.zeros(hi - lo, nblk, dtype=torch.long)
            for row, i in enumerate(order[lo:hi], start=lo):
                s = plan.decodes[i]
                blocks = s.block_table[:nblk]
                table[row - lo, : len(blocks)] = torch.tensor(blocks)
                p = s.num_computed  # the decode token's own position
                ids.append(s.token_ids[p])
                pos.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
                logit_rows[i] = row
            if kernel is not None:
                lens_t = torch.tensor(lens).to(dev)
                groups.append(DecodeGroup(lo, hi, table.to(dev), None, lens=lens_t))
                continue
            pad = None
            if lens[0] != nblk * bs:
                pad = (torch.arange(nblk * bs)[None, :] >= torch.tensor(lens)[:, None]).to(dev)
            groups.append(DecodeGroup(lo, hi, table.to(dev), pad))
        slot_parts = [torch.tensor(slots, dtype=torch.long)]
        prefills = []
        grouped: list[tuple[int, int, int, list[int]]] = []  # the CPU kernel's: every chunk
        for seq, n in plan.prefills:
            start, p0 = len(ids), seq.num_computed
            ids += seq.token_ids[p0 : p0 + n]
            pos += range(p0, p0 + n)
            slot_parts.append(cache.slots(seq.block_table, p0, p0 + n).cpu())
            if self.prefills_kernel is not None:  # any size: see PREFILL_KERNEL_TOKENS
                grouped.append((start, p0, n, seq.block_table[: -(-(p0 + n) // bs)]))
                prefills.append(PrefillChunk(start, start + n, None, None, grouped=True))
            elif p0 == 0:
                prefills.append(PrefillChunk(start, start + n, None, None))
            elif self.prefill_kernel is not None and n <= PREFILL_KERNEL_TOKENS:
                table = torch.tensor(seq.block_table[: -(-(p0 + n) // bs)], dtype=torch.long)
                prefills.append(PrefillChunk(start, start + n, None, None, table.to(dev), p0))
            else:
                ctx = cache.slots(seq.block_table, 0, p0 + n)
                mask = torch.ones(n, p0 + n, dtype=torch.bool).tril(diagonal=p0).to(dev)
                prefills.append(PrefillChunk(start, start + n, ctx, mask))
            if p0 + n == seq.num_tokens:
                logit_rows.append(start + n - 1)
        row_tables = None
        if self._stacks_prompt(plan):  # one `prompt_stack` call: each row's table and length
            # the decodes' rows are their group's table; a chunk's rows all share its blocks
            chunks = [
                seq.block_table[: -(-(seq.num_computed + n) // bs)] for seq, n in plan.prefills
            ]
            decodes = groups[0].blocks.cpu() if groups else torch.zeros(0, 0, dtype=torch.long)
            width = max([decodes.shape[1], *map(len, chunks)])
            table = torch.zeros(len(ids), width, dtype=torch.long)
            table[: len(plan.decodes), : decodes.shape[1]] = decodes
            lens = list(all_lens)
            for (seq, n), blocks in zip(plan.prefills, chunks, strict=True):
                table[len(lens) : len(lens) + n, : len(blocks)] = torch.tensor(blocks)
                lens += range(seq.num_computed + 1, seq.num_computed + n + 1)
            row_tables = (table.to(dev), torch.tensor(lens).to(dev))
        meta = StepMetadata(
            row_tables=row_tables,
            prefills_kernel=self.prefills_kernel,
            prefill_groups=[prefill_group(grouped, dev)] if grouped else [],
            k_cache=cache.k,
            v_cache=cache.v,
            slot_mapping=torch.cat(slot_parts).to(dev),
            block_size=bs,
            decode_groups=groups,
            prefills=prefills,
            decode_kernel=kernel,
            prefill_kernel=self.prefill_kernel,
            rope_store=self.rope_store,
        )
        return meta, ids, pos, logit_rows

    def _capture(self) -> None:
        """The static step's CUDA graphs; where capture fails (a kernel that cannot be captured
        on this GPU), steps run as they would with --cuda-graph-rows 0, said in the log."""
        assert self.static is not None
        try:
            self.static.capture()
        except Exception as e:  # noqa: BLE001 - any capture failure leaves the eager path
            log.warning("CUDA graph capture failed, every step runs eager: %s", e)
            self.graph_error = f"{type(e).__name__}: {e}"[:300]  # in stats(): not silent
            self.static = None
            torch.cuda.empty_cache()

    @property
    def graph_bytes(self) -> int:
        """Device memory the captured CUDA graphs keep (0 without)."""
        return self.static.graph_bytes if self.static is not None else 0

    @property
    def graphs_captured(self) -> int:
        """How many decode buckets replay as CUDA graphs (0: every step eager)."""
        return len(self.static.graphs) if self.static is not None else 0

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run one step; the logits of each row that ends its sequence's known tokens.  # [N, V]"""
        static = self.static
        if static is not None and not plan.prefills and static.fits(plan.decodes):
            return static.run(plan.decodes)
        meta, ids, pos, rows = self._metadata(plan)
        dev = self.device
        input_ids = torch.tensor([ids], device=dev)
        positions = torch.tensor([pos], device=dev)
        logit_rows = torch.tensor(rows, dtype=torch.long, device=dev)
        if self.lean is not None:
            return self.lean.forward(input_ids, positions, meta, logit_rows)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            logits_to_keep=logit_rows,
            use_cache=False,
            crowdchat=meta,
        )
        return out.logits[0]

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> dict[Sequence, int]:
        """Run one step; return the sampled next token of each sequence that reached its end."""
        if self.decode_kernel is not None and self.device.type == "cpu":  # crowdchat's kernels
            rows = len(plan.decodes) + sum(n for _, n in plan.prefills)
            pairs = _pairs(plan) if plan.prefills else 0
            if self._stacks_prompt(plan):  # one parallel region: every thread
                self._use_threads(rows)
            else:
                self._use_threads(rows, bool(plan.prefills), pairs)
        logits = self.forward(plan)
        sampled = plan.decodes + [s for s, n in plan.prefills if s.num_computed + n == s.num_tokens]
        if not sampled:
            return {}
        picks = sample(logits, sampled, self.stop_ids, owned=True)  # the step's own logits
        return dict(zip(sampled, picks, strict=True))

    def feed(self, plan: StepPlan, prev: StepTokens) -> tuple[torch.Tensor, list[int]] | None:
        """`prev`'s picks on the device and where each of `plan`'s decodes takes its token
        among them (-1: known here), if the plan runs on the static path and no row needs its
        ids on the host (penalties read them); else None."""
        static = self.static
        assert isinstance(prev, LaunchedStep)
        if static is None or plan.prefills or prev.picks is None or not static.fits(plan.decodes):
            return None
        rows = prev.rows
        sources = []
        for s in plan.decodes:
            if s.params.penalized:
                return None
            if s.token_ids[s.num_computed] == PLACEHOLDER:
                at = rows.get(s)
                if at is None:
                    return None
                sources.append(at)
            else:
                sources.append(-1)
        return prev.picks, sources

    @torch.inference_mode()
    def launch(
        self, plan: StepPlan, feed: tuple[torch.Tensor, list[int]] | None = None
    ) -> LaunchedStep:
        """Start one step and its sampling on the device; its tokens are read later
        (`LaunchedStep.tokens`). `feed`: `feed`'s answer for the step launched before."""
        if feed is not None:
            assert self.static is not None
            logits = self.static.run(plan.decodes, feed)
        else:
            logits = self.forward(plan)
        sampled = plan.decodes + [s for s, n in plan.prefills if s.num_computed + n == s.num_tokens]
        picks = sample_tensor(logits, sampled, self.stop_ids, owned=True) if sampled else None
        return LaunchedStep(sampled, picks)

    def _stacks_prompt(self, plan: StepPlan) -> bool:
        """Whether a CPU step with prompt tokens runs as one `crowdchat::prompt_stack` call
        (`LeanLlama._prompt_stack`): on the int8-activation kernels (where every chunk takes
        the prefill kernel, whose queries are bitwise the decode kernel's: the values do not
        depend on the choice, nor on the batch) where its attention reads fewer than
        `PROMPT_STACK_PAIRS` (query, key) pairs (each token reads its whole context alone,
        where the prefill kernel shares each block among 16 tokens)."""
        if not plan.prefills or self.prefills_kernel is None or self.lean is None:
            return False
        if not getattr(self.lean, "prompt_stacks", False):
            return False
        rows = len(plan.decodes) + sum(n for _, n in plan.prefills)
        fits = 0 < rows <= self.lean.prompt_stack_rows()
        return fits and _pairs(plan) < PROMPT_STACK_PAIRS

    def _use_threads(self, rows: int, prompt: bool = False, pairs: int = 0) -> None:
        """One OpenMP thread for a step of up to `SERIAL_ROWS` rows, else as many as the engine
        thread started with (`--threads`, or torch's default). Where few-row decode steps split
        their matmuls' columns over the threads, a step of decodes only always takes them all,
        and on the AVX512-VNNI kernels one with `prompt` tokens up to `PROMPT_SERIAL_ROWS`
        rows runs alone unless its attention has `PROMPT_SERIAL_PAIRS` (query, key) `pairs`."""
        self._all_threads = self._all_threads or torch.get_num_threads()
        serial = SERIAL_ROWS
        if getattr(self.lean, "shared_decodes", False):
            serial = self._prompt_serial_rows if prompt else 0
            if prompt and pairs >= PROMPT_SERIAL_PAIRS:
                serial = min(serial, SERIAL_ROWS)
        team = 1 if rows <= serial else self._all_threads
        if team != self._team:
            torch.ops.crowdchat.omp_threads(team)
            self._team = team

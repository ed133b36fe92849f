"""The only code that runs the model: one flat batched forward per step over the paged cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from engine import attention
from engine.attention import PrefillChunk, StepMetadata
from engine.kv_cache import KVCache
from engine.loader import LoadedModel
from engine.sampler import sample
from engine.scheduler import StepPlan
from engine.sequence import Sequence


class StepRunner(Protocol):
    """What the engine needs of whatever runs its steps: the model here, a fake in tests."""

    stop_ids: list[int]  # token ids that end a reply (unless the request ignores EOS)

    def run(self, plan: StepPlan) -> dict[Sequence, int]:
        """Compute the plan's tokens; return the next token of each sequence whose known
        tokens are now all computed (decodes, and prefills that reached their end)."""
        ...


RunnerFactory = Callable[[LoadedModel, KVCache], StepRunner]


class ModelRunner:
    """Builds a step's inputs from the plan, runs the model once, samples next tokens."""

    def __init__(self, loaded: LoadedModel, cache: KVCache) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.cache = cache
        self.model.set_attn_implementation(attention.IMPLEMENTATION)
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) or loaded.tokenizer.eos_token_id
        self.stop_ids: list[int] = sorted({eos} if isinstance(eos, int) else set(eos or []))

    def _metadata(self, plan: StepPlan) -> tuple[StepMetadata, list[int], list[int], list[int]]:
        """Flat input ids, positions and which rows need logits, plus the attention metadata."""
        cache, dev = self.cache, self.device
        ids: list[int] = []
        pos: list[int] = []
        slot_parts: list[torch.Tensor] = []
        logit_rows: list[int] = []
        decode_blocks = decode_pad = None
        if plan.decodes:
            bs = cache.block_size
            lens = torch.tensor([s.num_computed + 1 for s in plan.decodes])
            nblk = -(-int(lens.max()) // bs)
            table = torch.zeros(len(lens), nblk, dtype=torch.long)
            for i, s in enumerate(plan.decodes):
                row = s.block_table[:nblk]
                table[i, : len(row)] = torch.tensor(row)
            decode_blocks = table.to(dev)
            decode_pad = (torch.arange(nblk * bs)[None, :] >= lens[:, None]).to(dev)
            last = lens - 1  # each decode token's own position
            slot_parts.append(table[torch.arange(len(lens)), last // bs] * bs + last % bs)
            for i, s in enumerate(plan.decodes):
                ids.append(s.token_ids[s.num_computed])
                pos.append(s.num_computed)
                logit_rows.append(i)
        prefills = []
        for seq, n in plan.prefills:
            start, p0 = len(ids), seq.num_computed
            ids += seq.token_ids[p0 : p0 + n]
            pos += range(p0, p0 + n)
            slot_parts.append(cache.slots(seq.block_table, p0, p0 + n).cpu())
            if p0 == 0:
                prefills.append(PrefillChunk(start, start + n, None, None))
            else:
                ctx = cache.slots(seq.block_table, 0, p0 + n)
                mask = torch.ones(n, p0 + n, dtype=torch.bool).tril(diagonal=p0).to(dev)
                prefills.append(PrefillChunk(start, start + n, ctx, mask))
            if p0 + n == seq.num_tokens:
                logit_rows.append(start + n - 1)
        meta = StepMetadata(
            k_cache=cache.k,
            v_cache=cache.v,
            slot_mapping=torch.cat(slot_parts).to(dev),
            num_decodes=len(plan.decodes),
            block_size=cache.block_size,
            decode_blocks=decode_blocks,
            decode_pad=decode_pad,
            prefills=prefills,
        )
        return meta, ids, pos, logit_rows

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run one step; the logits of each row that ends its sequence's known tokens.  # [N, V]"""
        meta, ids, pos, rows = self._metadata(plan)
        dev = self.device
        out = self.model(
            input_ids=torch.tensor([ids], device=dev),
            position_ids=torch.tensor([pos], device=dev),
            logits_to_keep=torch.tensor(rows, dtype=torch.long, device=dev),
            use_cache=False,
            crowdchat=meta,
        )
        return out.logits[0]

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> dict[Sequence, int]:
        """Run one step; return the sampled next token of each sequence that reached its end."""
        logits = self.forward(plan)
        sampled = plan.decodes + [s for s, n in plan.prefills if s.num_computed + n == s.num_tokens]
        if not sampled:
            return {}
        return dict(zip(sampled, sample(logits, sampled, self.stop_ids), strict=True))

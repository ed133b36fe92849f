"""The only code that runs the model: one flat batched forward per step over the paged cache."""

from __future__ import annotations

import torch

from engine import attention
from engine.attention import PrefillChunk, StepMetadata
from engine.kv_cache import KVCache
from engine.loader import LoadedModel
from engine.sampler import sample
from engine.scheduler import StepPlan
from engine.sequence import Sequence


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
        decode_slots = decode_pad = None
        if plan.decodes:
            lens = [s.num_computed + 1 for s in plan.decodes]
            lmax = max(lens)
            nblk = -(-lmax // cache.block_size)
            table = torch.zeros(len(lens), nblk, dtype=torch.long)
            for i, s in enumerate(plan.decodes):
                table[i, : len(s.block_table)] = torch.tensor(s.block_table[:nblk])
            offs = torch.arange(cache.block_size)
            all_slots = (table[:, :, None] * cache.block_size + offs).reshape(len(lens), -1)
            all_slots = all_slots[:, :lmax]  # [B, Lmax]
            length = torch.tensor(lens)
            valid = torch.arange(lmax)[None, :] < length[:, None]  # [B, Lmax]
            decode_slots = torch.where(valid, all_slots, 0).to(dev)
            decode_pad = ~valid[:, None, None, :].to(dev)
            slot_parts.append(all_slots[torch.arange(len(lens)), length - 1])
            for i, s in enumerate(plan.decodes):
                ids.append(s.token_ids[s.num_computed])
                pos.append(s.num_computed)
                logit_rows.append(i)
        prefills = []
        for seq, n in plan.prefills:
            start, p0 = len(ids), seq.num_computed
            ids += seq.token_ids[p0:p0 + n]
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
            k_cache=cache.k, v_cache=cache.v,
            slot_mapping=torch.cat(slot_parts).to(dev),
            num_decodes=len(plan.decodes),
            decode_slots=decode_slots, decode_pad=decode_pad, prefills=prefills,
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
            logits_to_keep=torch.tensor(rows, device=dev),
            use_cache=False,
            crowdchat=meta,
        )
        return out.logits[0]

    def run(self, plan: StepPlan) -> dict[Sequence, int]:
        """Run one step; return the sampled next token of each sequence that reached its end."""
        logits = self.forward(plan)
        sampled = plan.decodes + [s for s, n in plan.prefills if s.num_computed + n == s.num_tokens]
        return dict(zip(sampled, sample(logits, sampled, self.stop_ids))) if sampled else {}

"""The built-in engine: its thread (`engine.Engine`), the scheduler and its token budget, the
paged block pool with its prefix hashes, resident KV, fair share, and the output side
(detokenizing, streaming to handles). Pure Python over `engine.model`'s tensors."""

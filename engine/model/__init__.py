"""The model: loading (GGUF conversion, quantization, the KV fingerprint), the forward pass
(transformers' model, or the lean Llama loop over fused projections), attention over the paged
KV pool, and sampling. Everything here touches torch tensors; nothing here schedules."""

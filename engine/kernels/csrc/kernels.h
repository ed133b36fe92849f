// crowdchat's CPU kernels as C++ functions (each registered as `torch.ops.crowdchat.<name>` in
// its own file), for the ops that call others without the dispatcher (decode_layer.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace crowdchat {

// A float32 rounded to bfloat16 (to nearest even) and kept as float32, bitwise as ATen's
// `x.to(torch.bfloat16).to(torch.float32)`; a NaN becomes 0xffff, as in ATen's vectorized cast
inline float bf16_rounded(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  u = nan ? 0xffff0000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// The KV pool of one layer, as rope_store writes it and paged_decode_attention reads it
inline void check_pool(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache, v_cache: contiguous [H_kv, slots, D], one dtype");
}

// f(T{}) with T the pool's element type: float, c10::BFloat16 or c10::Half
template <class F>
void with_pool_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    default:
      TORCH_CHECK(false, "KV pool dtype must be float32, bfloat16 or float16");
  }
}

// csrc/elementwise.cpp: float32 rounded to bfloat16 and back (as ATen's casts), out of place or
// in place; SiLU of the gate times up, [T, I] each (rows contiguous) -> [T, I]
at::Tensor round_to_bf16(const at::Tensor& x);
at::Tensor& round_to_bf16_(at::Tensor& x);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

// csrc/paged_decode.cpp: q [B, H, D] float32 against each row's blocks of the pool -> [B, H, D]
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, int64_t block_size,
                                  double scale);

// csrc/q4_linear.cpp: x [M, K] float32 times the 4-bit weights' transpose -> [M, N]
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scales_zeros);

// csrc/q8_avx2.cpp (AVX2 and FMA builds): x rounded to int8 per group of 32 times the 4-bit
// weights' transpose (packed uint8 [N/8, K/32, 128], bfloat16 scales and zeros [N/8, K/32,
// 16]) or the int8 weights' (packed int8 [N/8, K/4, 32], float32 scales [N]); `q8_avx2`:
// whether this build has them (elsewhere they refuse)
at::Tensor q4_linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz);
at::Tensor int8_linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales);
bool q8_avx2();

// csrc/rms_norm.cpp: float32 RMSNorm of the last dimension, as transformers' Llama computes it
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// csrc/rope_store.cpp: RoPE on the fused q/k/v output, K/V into the pool -> roped q [T, H, D]
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                      int64_t heads, int64_t kv_heads);

}  // namespace crowdchat

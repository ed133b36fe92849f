// RoPE on a step's fused q/k/v output and the new K/V written into the paged pool, in one call
// (engine/lean_llama.py's decode path; engine/cpu_kernels.py builds it).
//
// In Python this glue was ~20 ATen calls a layer (split, cat, the two products and rotate_half's
// slices, negation and cat, the sum, views, casts, two index_copy_), 5-10 us each with their
// Python on the 2-core EPYC: more than the layer's attention. The arithmetic is transformers'
// own, element for element: `x * cos + rotate_half(x) * sin` with each product rounded to
// float32 before the sum (no fused multiply-add: the pragma below), and the K/V rounded to the
// pool's dtype as PyTorch's copy rounds (to nearest, ties to even). So the query, the keys and
// the values are bitwise those of the Python path (tests/test_lean_llama.py).
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>

namespace {

constexpr int64_t kParallelValues = int64_t{1} << 16;  // fewer: one thread does them all

// out[i] = x[i] * c[i] + rotate_half(x)[i] * s[i] for one head of `d` values
inline void rope_head(const float* x, const float* c, const float* s, float* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i] * c[i];
    const float b = -x[i + half] * s[i];
    out[i] = a + b;
  }
  for (int64_t i = half; i < d; ++i) {
    const float a = x[i] * c[i];
    const float b = x[i - half] * s[i];
    out[i] = a + b;
  }
}

template <typename T>
void store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
           at::Tensor& k_cache, at::Tensor& v_cache, const int64_t* slots, int64_t heads,
           int64_t kv_heads, at::Tensor& q_out) {
  const int64_t t = qkv.size(0), d = k_cache.size(2), slots_n = k_cache.size(1);
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q_out.data_ptr<float>();
  T* kp = k_cache.data_ptr<T>();
  T* vp = v_cache.data_ptr<T>();
  // a prefill's rows over the threads (rows write their own slots: the same either way); a
  // decode's few rows, or any inside decode_stack's parallel region, on the calling thread
  const int64_t grain = std::max<int64_t>(1, kParallelValues / ((heads + 2 * kv_heads) * d));
  at::parallel_for(0, t, grain, [&](int64_t r0, int64_t r1) {
    float roped[256];
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = src + r * qkv.size(1);
      const float* c = cp + r * d;
      const float* s = sp + r * d;
      for (int64_t h = 0; h < heads; ++h)
        rope_head(row + h * d, c, s, qp + (r * heads + h) * d, d);
      const float* k = row + heads * d;
      const float* v = k + kv_heads * d;
      for (int64_t h = 0; h < kv_heads; ++h) {
        rope_head(k + h * d, c, s, roped, d);
        T* kd = kp + (h * slots_n + slots[r]) * d;
        T* vd = vp + (h * slots_n + slots[r]) * d;
        for (int64_t i = 0; i < d; ++i) {
          kd[i] = static_cast<T>(roped[i]);
          vd[i] = static_cast<T>(v[h * d + i]);
        }
      }
    }
  });
}

}  // namespace

namespace crowdchat {

// qkv [T, (H + 2 H_kv) D] float32 (q, k, v side by side, as the fused projection gives them);
// cos, sin [T, D] float32; k_cache, v_cache [H_kv, slots, D]; slots [T] int64. Writes each
// token's roped key and its value at its slot; returns the roped queries [T, H, D].
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                      int64_t heads, int64_t kv_heads) {
  check_pool(k_cache, v_cache);
  const int64_t d = k_cache.size(2), t = qkv.size(0);
  TORCH_CHECK(heads > 0 && kv_heads == k_cache.size(0) && d % 2 == 0 && d <= 256,
              "head shapes differ");
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous() &&
                  qkv.size(1) == (heads + 2 * kv_heads) * d,
              "qkv: contiguous float32 [T, (H + 2 H_kv) D]");
  for (const auto* x : {&cos, &sin})
    TORCH_CHECK(x->dim() == 2 && x->scalar_type() == at::kFloat && x->is_contiguous() &&
                    x->size(0) == t && x->size(1) == d,
                "cos, sin: contiguous float32 [T, D]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == t && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "slots: contiguous int64 [T]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r)
    TORCH_CHECK(sl[r] >= 0 && sl[r] < k_cache.size(1), "slot out of range");
  auto q = at::empty({t, heads, d}, qkv.options());
  with_pool_type(k_cache.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    store<T>(qkv, cos, sin, k_cache, v_cache, sl, heads, kv_heads, q);
  });
  return q;
}

}  // namespace crowdchat

TORCH_LIBRARY_FRAGMENT(crowdchat, m) {
  m.def(
      "rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slots, int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(crowdchat, CPU, m) {
  m.impl("rope_store", &crowdchat::rope_store);
}

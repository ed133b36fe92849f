// One decoder layer of a decode step on the 4-bit kernel, in one call (engine/lean_llama.py
// `_decodes`, up to 4 rows where compute is float32).
//
// From Python the layer was ~14 calls (two norms, four projections, RoPE with the K/V write,
// attention, two residual adds, SiLU and its product, slicing), each with its Python and its
// turn at the GIL: at one row that overhead was a fifth of the step on the 2-core EPYC. Here the
// same kernels are called as C++ functions (csrc/kernels.h), SiLU by ATen as in Python, and the
// residual adds are plain float32 operations, each rounded as ATen rounds them: the layer's
// output, the keys and the values are bitwise those of the Python loop (tests/test_lean_llama.py).
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "kernels.h"

namespace {

// a + b for contiguous float32 tensors of one shape
at::Tensor plus(const at::Tensor& a, const at::Tensor& b) {
  auto out = at::empty_like(a);
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < a.numel(); ++i) op[i] = ap[i] + bp[i];
  return out;
}

}  // namespace

namespace crowdchat {

// h [T, C] float32; weights: the first norm's weight, q/k/v's (fused) packed and scales_zeros,
// o's, the second norm's weight, gate/up's (fused), down's; the rest as rope_store and
// paged_decode_attention take them. Returns the layer's output [T, C].
at::Tensor decode_layer(const at::Tensor& h, at::TensorList weights, double eps,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                        at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& blocks,
                        const at::Tensor& lens, int64_t block_size, double scale, int64_t heads,
                        int64_t kv_heads) {
  TORCH_CHECK(weights.size() == 10, "weights: 10 tensors");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(),
              "h: contiguous float32 [T, C]");
  const auto& w = weights;
  const int64_t t = h.size(0);
  auto x = rms_norm(h, w[0], eps);
  const auto q = rope_store(q4_linear(x, w[1], w[2]), cos, sin, k_cache, v_cache, slots, heads,
                            kv_heads);
  const auto o = paged_decode_attention(q, k_cache, v_cache, blocks, lens, block_size, scale);
  const auto attended = plus(h, q4_linear(o.view({t, -1}), w[3], w[4]));
  x = rms_norm(attended, w[5], eps);
  const auto gate_up = q4_linear(x, w[6], w[7]);  // [T, 2 I]: gate's outputs, then up's
  const int64_t inner = gate_up.size(1) / 2;
  const auto product = silu_mul(gate_up.narrow(1, 0, inner), gate_up.narrow(1, inner, inner));
  return plus(attended, q4_linear(product, w[8], w[9]));
}

// Every layer of a decode step (`decode_layer` for each; weights: 10 a layer, in order; the
// pool's halves one a layer), its rows split over the threads: each thread takes rows i,
// i + n, i + 2n, ... (the rows come sorted by context length: like shares of attention) through
// all the layers on its own, in one parallel region a step. Split op by op, each of a layer's
// ~6 parallel regions woke the other core's sleeping thread (passive waits, engine/threads.py)
// and waited for it at its end: on the 2-core Zen 5 EPYC, a firecracker VM where an idle vCPU
// halts, 32 rows at context 200 took ~28.5 ms a step that way against ~21 with spinning waits.
// Each row's values are what `decode_layer` gives it in any batch (its kernels are
// batch-invariant), so the output is bitwise the per-layer loop's.
at::Tensor decode_stack(const at::Tensor& h, at::TensorList weights, double eps,
                        const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
                        at::TensorList v_caches, const at::Tensor& slots,
                        const at::Tensor& blocks, const at::Tensor& lens, int64_t block_size,
                        double scale, int64_t heads, int64_t kv_heads) {
  const auto layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && v_caches.size() == k_caches.size() &&
                  static_cast<int64_t>(weights.size()) == 10 * layers,
              "decode_stack: 10 weights and a K and V pool half a layer");
  TORCH_CHECK(h.dim() == 2 && h.size(0) > 0, "h: [T, C] with T >= 1");
  const auto run = [&](const at::Tensor& x, const at::Tensor& c, const at::Tensor& s,
                       const at::Tensor& sl, const at::Tensor& b, const at::Tensor& n) {
    auto out = x;
    for (int64_t l = 0; l < layers; ++l)
      out = decode_layer(out, weights.slice(10 * l, 10), eps, c, s, k_caches[l], v_caches[l], sl,
                         b, n, block_size, scale, heads, kv_heads);
    return out;
  };
  const int64_t t = h.size(0), parts = std::min<int64_t>(at::get_num_threads(), t);
  if (parts <= 1) return run(h, cos, sin, slots, blocks, lens);
  std::vector<at::Tensor> rows(parts), outs(parts);
  for (int64_t p = 0; p < parts; ++p) rows[p] = at::arange(p, t, parts, slots.options());
  at::parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const auto& r = rows[p];
      outs[p] = run(h.index_select(0, r), cos.index_select(0, r), sin.index_select(0, r),
                    slots.index_select(0, r), blocks.index_select(0, r), lens.index_select(0, r));
    }
  });
  auto out = at::empty_like(h);
  for (int64_t p = 0; p < parts; ++p) out.index_copy_(0, rows[p], outs[p]);
  return out;
}

}  // namespace crowdchat

TORCH_LIBRARY_FRAGMENT(crowdchat, m) {
  m.def(
      "decode_stack(Tensor h, Tensor[] weights, float eps, Tensor cos, Tensor sin, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor blocks, Tensor lens, "
      "int block_size, float scale, int heads, int kv_heads) -> Tensor");
  m.def(
      "decode_layer(Tensor h, Tensor[] weights, float eps, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor blocks, Tensor lens, "
      "int block_size, float scale, int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(crowdchat, CPU, m) {
  m.impl("decode_layer", &crowdchat::decode_layer);
  m.impl("decode_stack", &crowdchat::decode_stack);
}

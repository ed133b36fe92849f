// Elementwise glue of a many-row step on float32 activations (engine/cpu_quant.py DenseCopy,
// engine/lean_llama.py `_decodes`), one pass each where ATen made two or three.
//
// `round_to_bf16`: float32 values rounded to bfloat16 and back (csrc/kernels.h `bf16_rounded`,
// bitwise ATen's casts), in one pass and one allocation instead of two of each: around each dense
// copy's GEMM, in and out, those casts were a sixth of a 32-row step on the Zen 5 EPYC.
// `silu_mul`: SiLU of the gate times up (slices of the fused gate/up output), ATen's SiLU (the
// same vectorized code as F.silu) and a plain float32 product, bitwise `F.silu(gate) * up`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>

namespace {

// elements per thread below which one thread does it all (waking the other costs more)
constexpr int64_t kGrain = int64_t{1} << 16;

void round_range(const float* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = crowdchat::bf16_rounded(src[i]);
}

void check_float(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x: contiguous float32 on the CPU");
}

}  // namespace

namespace crowdchat {

at::Tensor round_to_bf16(const at::Tensor& x) {
  check_float(x);
  auto out = at::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, x.numel(), kGrain,
                   [&](int64_t lo, int64_t hi) { round_range(src + lo, dst + lo, hi - lo); });
  return out;
}

at::Tensor& round_to_bf16_(at::Tensor& x) {
  check_float(x);
  float* p = x.data_ptr<float>();
  at::parallel_for(0, x.numel(), kGrain,
                   [&](int64_t lo, int64_t hi) { round_range(p + lo, p + lo, hi - lo); });
  return x;
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 &&
                  up.stride(1) == 1 && gate.scalar_type() == at::kFloat &&
                  up.scalar_type() == at::kFloat && gate.device().is_cpu() && up.device().is_cpu(),
              "gate, up: float32 [T, I] on the CPU, each row contiguous");
  const int64_t t = gate.size(0), inner = gate.size(1), ld = up.stride(0);
  const auto act = at::silu(gate).contiguous();
  auto product = at::empty({t, inner}, gate.options().memory_format(at::MemoryFormat::Contiguous));
  const float* ap = act.data_ptr<float>();
  const float* up_p = up.data_ptr<float>();
  float* pp = product.data_ptr<float>();
  // a prefill's rows over the threads (each value its own product: the same either way)
  at::parallel_for(0, t, std::max<int64_t>(1, kGrain / std::max<int64_t>(inner, 1)),
                   [&](int64_t r0, int64_t r1) {
                     for (int64_t r = r0; r < r1; ++r)
                       for (int64_t i = 0; i < inner; ++i)
                         pp[r * inner + i] = ap[r * inner + i] * up_p[r * ld + i];
                   });
  return product;
}

}  // namespace crowdchat

TORCH_LIBRARY_FRAGMENT(crowdchat, m) {
  m.def("round_to_bf16(Tensor x) -> Tensor");
  m.def("round_to_bf16_(Tensor(a!) x) -> Tensor(a!)");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
}

TORCH_LIBRARY_IMPL(crowdchat, CPU, m) {
  m.impl("round_to_bf16", &crowdchat::round_to_bf16);
  m.impl("round_to_bf16_", &crowdchat::round_to_bf16_);
  m.impl("silu_mul", &crowdchat::silu_mul);
}

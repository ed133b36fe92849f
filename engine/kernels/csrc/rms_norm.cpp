// RMSNorm in float32 as transformers' Llama computes it, in one call (engine/lean_norm.py).
//
// `torch.rms_norm` on the CPU is a composite of ~10 ATen calls (pow, mean as sum and div_,
// add_, rsqrt, two mul, casts): ~50-60 us a call on the 2-core EPYC for one row of 576, 61
// calls a token on the embedded model. This makes the one call whose order of summation matters
// (the sum of squares, by ATen's own reduction, so the same in every row whatever the batch)
// and computes the rest in plain float32 steps, each rounded as the ATen op rounds it:
// `(x * (1 / sqrt(sum(x * x) / C + eps))) * weight`. Bitwise transformers' values
// (tests/test_lean_norm.py).
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "kernels.h"

#include <cmath>

namespace crowdchat {

// Below this many values one thread normalizes them all (a decode step's rows); above, rows
// of about kRowGrain values a task (a 1,280-token prefill's norms: 46 -> ~25 ms a step on 2
// cores)
constexpr int64_t kParallelElements = int64_t{1} << 16, kRowGrain = int64_t{1} << 14;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x: contiguous float32 [..., C]");
  const int64_t c = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == c && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous(),
              "weight: contiguous float32 [C]");
  auto out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const auto rows = x.view({-1, c});
  const int64_t t = rows.size(0);
  auto squares = at::empty_like(rows);
  const float* xp = rows.data_ptr<float>();
  float* sq = squares.data_ptr<float>();
  // a prefill's rows over the threads (each row's values are its own: the same either way);
  // a decode's few rows on the calling thread
  const int64_t grain = t * c < kParallelElements ? t : std::max<int64_t>(1, kRowGrain / c);
  at::parallel_for(0, t, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * c; i < r1 * c; ++i) sq[i] = xp[i] * xp[i];  // pow(x, 2) is x * x
  });
  const auto sums = at::sum(squares, {1});  // [T], ATen's order: as `mean` sums
  const float* sp = sums.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float n = static_cast<float>(c), e = static_cast<float>(eps);
  at::parallel_for(0, t, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float var = sp[r] / n + e;  // mean's div_, then add_(eps): each rounded
      const float inv = 1.0f / std::sqrt(var);  // ATen's rsqrt
      const float* xr = xp + r * c;
      float* o = op + r * c;
      for (int64_t i = 0; i < c; ++i) {
        const float y = xr[i] * inv;
        o[i] = y * w[i];
      }
    }
  });
  return out;
}

}  // namespace crowdchat

TORCH_LIBRARY_FRAGMENT(crowdchat, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(crowdchat, CPU, m) {
  m.impl("rms_norm", &crowdchat::rms_norm);
}

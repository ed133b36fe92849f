// The pick of a temperature-only row (engine/model/sampler.py, the API's default sampling) on
// the CPU: one token drawn with probability exp(x - max) / sum by inverse CDF, for the row's
// uniform u. ATen took ~0.9 ms a 32-row step of 49,152 logits (2-core Sapphire Rapids-class
// Xeon) in five passes over N x V floats (max, subtract, exp, a cumulative sum accumulated in
// float64, a binary search); here a row is two passes on one thread, the rows over the cores:
// its max, then each weight (written over the logits) with the sums of blocks of kBlock; the
// draw walks the block sums to the block where the running sum passes u x total, then that
// block's weights. A token at -inf (min-tokens' stop ids) weighs exactly 0 and is never drawn.
// The same row gives the same pick in any batch. A row's temperature, where given, divides its
// logits in the first pass (the same float32 quotients ATen's division gives); a row of
// temperature 0 is greedy: its first largest logit (a NaN, as torch.argmax, if it holds one),
// one pass where ATen's argmax took ~2.3 ms a 32-row step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "attention.h"         // exp_nonpositive: Cephes' expf for x <= 0
#include "attention_avx2.h"    // the same on 8 lanes (AVX2 builds)
#include "attention_avx512.h"  // and on 16

namespace {

constexpr int64_t kBlock = 64;
constexpr float kInf = std::numeric_limits<float>::infinity();

// the row's largest value, in 16 (or 8) independent lanes: one running max was a 4-cycle
// chain an element; `temp` > 0 divides each value first, in place
float row_max(float* __restrict x, int64_t v, float temp) {
  const bool divide = temp > 0.f;
  float m = -kInf;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(-kInf);
  const __m512 tv = _mm512_set1_ps(temp);
  for (; t + 16 <= v; t += 16) {
    __m512 xv = _mm512_loadu_ps(x + t);
    if (divide) _mm512_storeu_ps(x + t, xv = _mm512_div_ps(xv, tv));
    mv = _mm512_max_ps(mv, xv);
  }
  m = _mm512_reduce_max_ps(mv);
#else
  std::array<float, 8> lanes;
  lanes.fill(-kInf);
  for (; t + 8 <= v; t += 8)
    for (int j = 0; j < 8; ++j) {
      if (divide) x[t + j] /= temp;
      lanes[j] = std::max(lanes[j], x[t + j]);
    }
  m = *std::max_element(lanes.begin(), lanes.end());
#endif
  for (; t < v; ++t) {
    if (divide) x[t] /= temp;
    m = std::max(m, x[t]);
  }
  return m;
}

// torch.argmax of a row: the first of its largest values, or its first NaN
int64_t argmax_row(const float* __restrict x, int64_t v) {
  float m = -kInf;
  bool nan = false;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(-kInf);
  __mmask16 unordered = 0;
  for (; t + 16 <= v; t += 16) {
    const __m512 xv = _mm512_loadu_ps(x + t);
    unordered |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
    mv = _mm512_max_ps(mv, xv);
  }
  m = _mm512_reduce_max_ps(mv);
  nan = unordered != 0;
#else
  std::array<float, 8> lanes;
  lanes.fill(-kInf);
  for (; t + 8 <= v; t += 8)
    for (int j = 0; j < 8; ++j) {
      nan |= x[t + j] != x[t + j];
      lanes[j] = std::max(lanes[j], x[t + j]);
    }
  m = *std::max_element(lanes.begin(), lanes.end());
#endif
  for (; t < v; ++t) {
    nan |= x[t] != x[t];
    m = std::max(m, x[t]);
  }
  for (int64_t i = 0; i < v; ++i)
    if (nan ? x[i] != x[i] : x[i] == m) return i;
  return 0;
}

int64_t pick_row(float* __restrict x, int64_t v, double u, float temp, double* __restrict sums) {
  const float m = row_max(x, v, temp);
  if (!(m > -kInf)) return 0;  // nothing drawable (or NaN)
  const int64_t blocks = (v + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    float* xb = x + b * kBlock;
    const int64_t n = std::min(kBlock, v - b * kBlock);
    float s = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 mb = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-kInf);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 xv = _mm512_loadu_ps(xb + i);
      const __mmask16 live = _mm512_cmp_ps_mask(xv, ninf, _CMP_NEQ_OQ);
      const __m512 w = _mm512_maskz_mov_ps(
          live, crowdchat_attention::exp16_nonpositive(_mm512_sub_ps(xv, mb)));
      _mm512_storeu_ps(xb + i, w);
      acc = _mm512_add_ps(acc, w);
    }
    s = _mm512_reduce_add_ps(acc);
#elif defined(CROWDCHAT_ATTENTION_AVX2)
    const __m256 mb = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-kInf);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 xv = _mm256_loadu_ps(xb + i);
      const __m256 live = _mm256_cmp_ps(xv, ninf, _CMP_NEQ_OQ);
      const __m256 w = _mm256_and_ps(
          live, crowdchat_attention::exp8_nonpositive(_mm256_sub_ps(xv, mb)));
      _mm256_storeu_ps(xb + i, w);
      acc = _mm256_add_ps(acc, w);
    }
    s = crowdchat_attention::sum8(acc);
#endif
    for (; i < n; ++i) {
      xb[i] = xb[i] == -kInf ? 0.f : crowdchat_attention::exp_nonpositive(xb[i] - m);
      s += xb[i];
    }
    sums[b] = s;
    total += s;
  }
  const double target = u * total;
  double run = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (sums[b] <= 0.0) continue;
    if (b + 1 < blocks && run + sums[b] <= target) {  // the draw lies past this block
      run += sums[b];
      continue;
    }
    const int64_t n = std::min(kBlock, v - b * kBlock);
    for (int64_t i = 0; i < n; ++i) {
      const float w = x[b * kBlock + i];
      if (w <= 0.f) continue;
      run += w;
      if (run > target) return b * kBlock + i;
    }  // not passed (the block's float sum rounded up): on to the next block
  }
  // the sums' rounding put the target at or past the end: the last token of positive weight
  // (there is one: the max weighs exp(0) = 1)
  for (int64_t j = v - 1; j > 0; --j)
    if (x[j] > 0.f) return j;
  return 0;
}

}  // namespace

namespace crowdchat {

// rows: [N, V] float32 logits, overwritten with their weights; u: [N] float64 uniforms in
// [0, 1); temps: none (the rows are divided already), or [N] float32 temperatures, 0 for a
// greedy row (its u unused, its logits left as they are). Returns the picked ids, int64 [N].
at::Tensor sample_rows_(at::Tensor& rows, const at::Tensor& u,
                        const std::optional<at::Tensor>& temps) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.is_contiguous() &&
                  rows.device().is_cpu() && rows.size(1) > 0,
              "rows: contiguous float32 [N, V] on the CPU, V >= 1");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == rows.size(0) && u.scalar_type() == at::kDouble,
              "u: float64 [N]");
  TORCH_CHECK(!temps || (temps->dim() == 1 && temps->size(0) == rows.size(0) &&
                         temps->scalar_type() == at::kFloat && temps->device().is_cpu()),
              "temps: float32 [N] on the CPU");
  const int64_t n = rows.size(0), v = rows.size(1);
  auto out = at::empty({n}, rows.options().dtype(at::kLong));
  const auto uc = u.contiguous();
  const auto tc = temps ? temps->contiguous() : at::Tensor();
  const double* up = uc.data_ptr<double>();
  const float* tp = temps ? tc.data_ptr<float>() : nullptr;
  for (int64_t r = 0; tp && r < n; ++r)
    TORCH_CHECK(tp[r] >= 0.f, "temps: none negative or NaN, row ", r, " has ", tp[r]);
  float* xp = rows.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // one row is ~25 us of work (a greedy one ~5): a few rows stay on the calling thread
  at::parallel_for(0, n, 4, [&](int64_t r0, int64_t r1) {
    std::vector<double> sums((v + kBlock - 1) / kBlock);
    for (int64_t r = r0; r < r1; ++r) {
      const float temp = tp ? tp[r] : -1.f;  // -1: divided already
      op[r] = temp == 0.f ? argmax_row(xp + r * v, v)
                          : pick_row(xp + r * v, v, up[r], temp, sums.data());
    }
  });
  return out;
}

}  // namespace crowdchat

TORCH_LIBRARY_FRAGMENT(crowdchat, m) {
  m.def("sample_rows_(Tensor(a!) rows, Tensor u, Tensor? temps=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(crowdchat, CPU, m) { m.impl("sample_rows_", &crowdchat::sample_rows_); }

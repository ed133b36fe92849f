// 4-bit weight-only linear for few rows on CPUs whose compute is float32 (engine/cpu_quant.py).
//
// y = x W^T with W in groups of 32 along K, each weight `(q - 8) * scale + zero`, q in 0..15
// (GGUF's Q4_1 values, the same model `_weight_int4pack_mm_for_cpu` computes). PyTorch's kernel
// takes bfloat16 activations, and on CPUs without native bfloat16 it widens them group by group;
// here each group's 32 nibbles are widened once to float32 in registers (in-lane byte shuffles,
// not the slower cross-lane sign extension) and multiplied with up to kRows rows of x,
// accumulating in float32. x is rounded to bfloat16 first and y after, as around PyTorch's kernel,
// so both compute the same model (to accumulation order: at most one bfloat16 ulp apart).
//
// Layout (engine/cpu_quant.py): packed uint8 [N, K/32, 16], byte j of a group holding q[j] in
// its low nibble and q[j + 16] in its high one; each group's scale and zero, bfloat16
// [N, K/32, 2] (the sums run as `scale * sum(q x) + (zero - 8 scale) * sum(x)`, the second
// factor exact in float32 for bfloat16 operands a few binades apart).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <immintrin.h>

#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRows = 4;  // rows of x sharing one widening of a group's weights
// below this many weights x rows in a call, one thread does it all: waking the other threads
// (passive OpenMP waits, engine/threads.py) costs more than they would save: on the 2-core
// EPYC one row through 576 x 576 or 576 x 1536 weights was faster alone, 3072 x 576 was not
constexpr int64_t kSerialWork = int64_t{1} << 20;

inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Output rows [n0, n1) for R rows of x (`xr`: [R, K] rounded, `xs`: [R, K/32] group sums).
template <int R>
void rows_block(const uint8_t* packed, const uint16_t* scales_zeros, const float* xr,
                const float* xs, float* y, int64_t ldy, int64_t k, int64_t n0, int64_t n1) {
  const int64_t groups = k / kGroup;
  // byte j (low half) or 8 + j (high half) of the group into the low byte of lane j
  const __m256i pick0 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1,
                                         -1, 4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1,
                                         -1, -1);
  const __m256i pick1 = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1,
                                         -1, 12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15,
                                         -1, -1, -1);
  const __m256i low = _mm256_set1_epi32(0x0f), high = _mm256_set1_epi32(0xf0);
  const __m256 sixteenth = _mm256_set1_ps(1.0f / 16);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* p = packed + n * groups * 16;
    const uint16_t* sz = scales_zeros + n * groups * 2;
    __m256 acc[R];
    float zsum[R];  // sum over groups of (zero - 8 scale) * (the group's sum of x)
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      zsum[r] = 0.0f;
    }
    for (int64_t g = 0; g < groups; ++g) {
      // the group's 16 bytes in both halves; each shuffle puts 8 of them in int32 lanes, the
      // low nibbles masked as q, the high ones as 16 q (the 1/16 goes with the scale)
      const __m256i b = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + g * 16)));
      const __m256i b0 = _mm256_shuffle_epi8(b, pick0), b1 = _mm256_shuffle_epi8(b, pick1);
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, high));
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, high));
      const float s = from_bf16(sz[2 * g]), offset = from_bf16(sz[2 * g + 1]) - 8 * s;
      const __m256 sg = _mm256_set1_ps(s);
      for (int r = 0; r < R; ++r) {
        const float* x = xr + r * k + g * kGroup;
        const __m256 lo =
            _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), _mm256_mul_ps(w0, _mm256_loadu_ps(x)));
        const __m256 hi = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24),
                                          _mm256_mul_ps(w2, _mm256_loadu_ps(x + 16)));
        acc[r] = _mm256_fmadd_ps(_mm256_fmadd_ps(hi, sixteenth, lo), sg, acc[r]);
        zsum[r] += offset * xs[r * groups + g];
      }
    }
    for (int r = 0; r < R; ++r) y[r * ldy + n] = crowdchat::bf16_rounded(hsum(acc[r]) + zsum[r]);
  }
}

}  // namespace

namespace crowdchat {

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scales_zeros) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == 16,
              "packed: uint8 [N, K/32, 16]");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(k == groups * kGroup, "x has ", k, " columns, the weights ", groups * kGroup);
  TORCH_CHECK(scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.dim() == 3 &&
                  scales_zeros.size(0) == n && scales_zeros.size(1) == groups &&
                  scales_zeros.size(2) == 2,
              "scales_zeros: bfloat16 [N, K/32, 2]");
  TORCH_CHECK(packed.is_contiguous() && scales_zeros.is_contiguous(),
              "weights must be contiguous");
  auto y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  // x rounded to bfloat16, and each group's sum (the zeros' term)
  std::vector<float> xr(m * k), xs(m * groups);
  const auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  for (int64_t i = 0; i < m * k; ++i) xr[i] = crowdchat::bf16_rounded(xp[i]);
  for (int64_t i = 0; i < m * groups; ++i) {
    float t = 0.0f;
    for (int64_t j = 0; j < kGroup; ++j) t += xr[i * kGroup + j];
    xs[i] = t;
  }
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  // each thread takes a range of output rows, for every kRows rows of x
  at::parallel_for(0, n, m * n * k < kSerialWork ? n + 1 : 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      const float* xr0 = xr.data() + r0 * k;
      const float* xs0 = xs.data() + r0 * groups;
      float* y0 = yp + r0 * n;
      switch (std::min<int64_t>(kRows, m - r0)) {
        case 1: rows_block<1>(pp, sp, xr0, xs0, y0, n, k, n0, n1); break;
        case 2: rows_block<2>(pp, sp, xr0, xs0, y0, n, k, n0, n1); break;
        case 3: rows_block<3>(pp, sp, xr0, xs0, y0, n, k, n0, n1); break;
        default: rows_block<4>(pp, sp, xr0, xs0, y0, n, k, n0, n1); break;
      }
    }
  });
  return y;
}

}  // namespace crowdchat

TORCH_LIBRARY_FRAGMENT(crowdchat, m) {
  m.def("q4_linear(Tensor x, Tensor packed, Tensor scales_zeros) -> Tensor");
}

TORCH_LIBRARY_IMPL(crowdchat, CPU, m) {
  m.impl("q4_linear", &crowdchat::q4_linear);
}

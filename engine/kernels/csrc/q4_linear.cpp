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
//
// On CPUs with AVX512-BF16 (Zen 4/5, Sapphire Rapids and later) a second layout and kernel run
// instead, at every row count: `vdpbf16ps` multiplies pairs of bfloat16 values into float32
// sums, twice the rate of float32 FMAs. Each group's nibbles become bfloat16 `q - 8` (exact)
// by one table lookup (`vpermw`), are multiplied with up to kDotRows rows of bfloat16 x, and
// each group's sum is scaled in float32: `scale * sum((q - 8) x) + zero * sum(x)`. Products
// of bfloat16 operands are exact, so this computes the same model as the other kernel (to
// accumulation order). Layout (engine/cpu_quant.py `pack_for_dot`): output columns in blocks
// of 16, packed uint8 [N/16, K/32, 256]: within a group, 32 bytes per 4 values of K, byte i
// for column i / 2, its low nibble q[4t + i % 2] and its high one q[4t + 2 + i % 2] (the pairs
// `vdpbf16ps` takes, for 16 columns at once); scales and zeros bfloat16 [N/16, K/32, 2, 16].
// On the 2-core Zen 5 EPYC the embedded model's 4-bit linears (30 layers, weights streamed
// from memory) took 2.3 / 4.8 / 15.9 / 241 ms at 1 / 8 / 32 / 512 rows, the AVX2 kernel 5.1 /
// 15.0 / 58.1 / -, FBGEMM's fp16 GEMM on a dense copy 8.1 / 9.2 / 22.8 / 292 (best of 3,
// README "An AVX512-BF16 kernel"): so no dense copy is kept by default there. The output
// projection's int8 weights run there on a kernel of the same kind (`int8_dot`, below).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <immintrin.h>

#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using crowdchat::kGroup;
using crowdchat::kMatmulSerialWork;
using crowdchat::NoStart;
using crowdchat::over_blocks;
constexpr int64_t kRows = 4;  // rows of x sharing one widening of a group's weights

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

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define CROWDCHAT_Q4_DOT 1

constexpr int kDotRows = 8;       // rows of x sharing one group's bfloat16 weights
constexpr int64_t kDotChunk = 64;  // rows of x (their bf16 copy in L2) per pass over weights

// 16 floats rounded to bfloat16 as crowdchat::bf16_rounded rounds them (NaN to 0xffff0000)
inline __m512 rounded(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i v = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  v = _mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_castsi512_ps(
      _mm512_mask_mov_epi32(v, nan, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// R rows of x (bfloat16 bits `xb` [R, K], group sums `xs` [R, K/32]) through one block of 16
// output columns (`pw` its packed groups, `psz` its scales and zeros) into `y` (row stride ldy)
template <int R>
void dot_block(const uint8_t* pw, const uint16_t* psz, const uint16_t* xb, const float* xs,
               int64_t k, int64_t groups, float* y, int64_t ldy) {
  // bfloat16 of q - 8 for q = 0..15
  alignas(64) static const uint16_t kValues[32] = {0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080,
                                                   0xc040, 0xc000, 0xbf80, 0,      0x3f80,
                                                   0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0,
                                                   0x40e0};
  const __m512i values = _mm512_load_si512(kValues);
  const __m512i low = _mm512_set1_epi16(0x0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512bh w[16];  // the group's 16 pairs of K for the 16 columns
    const uint8_t* p = pw + g * 256;
    for (int t = 0; t < 8; ++t) {
      const __m512i b = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + t * 32)));
      w[2 * t] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(b, low), values);
      w[2 * t + 1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), values);
    }
    const auto widen = [](const uint16_t* v) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v))), 16));
    };
    const __m512 scale = widen(psz + g * 32), zero = widen(psz + g * 32 + 16);
    for (int r = 0; r < R; ++r) {
      const uint16_t* x = xb + r * k + g * kGroup;
      __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();  // two chains
      for (int i = 0; i < 16; i += 2) {
        int32_t a, b;
        std::memcpy(&a, x + 2 * i, sizeof(a));
        std::memcpy(&b, x + 2 * i + 2, sizeof(b));
        s0 = _mm512_dpbf16_ps(s0, w[i], (__m512bh)_mm512_set1_epi32(a));
        s1 = _mm512_dpbf16_ps(s1, w[i + 1], (__m512bh)_mm512_set1_epi32(b));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_add_ps(s0, s1), scale,
                               _mm512_fmadd_ps(zero, _mm512_set1_ps(xs[r * groups + g]), acc[r]));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, rounded(acc[r]));
}

// rows [m0, m1) of x as bfloat16 bits, and (where `xs` is given) each group's sum of them
void to_bf16(const float* x, int64_t m0, int64_t m1, int64_t k, uint16_t* xb, float* xs) {
  const int64_t groups = k / kGroup;
  for (int64_t i = m0 * groups; i < m1 * groups; ++i) {
    const __m512 lo = rounded(_mm512_loadu_ps(x + i * kGroup));
    const __m512 hi = rounded(_mm512_loadu_ps(x + i * kGroup + 16));
    // the upper halves of the rounded values are their bfloat16 bits
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + i * kGroup),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(lo), 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + i * kGroup + 16),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(hi), 16)));
    if (xs != nullptr) xs[i] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
  }
}

// x [M, K] (K a multiple of 32) as bfloat16 bits, and each group's sum if `sums`
struct Bf16Rows {
  std::vector<uint16_t> bits;
  std::vector<float> sums;
};

Bf16Rows bf16_rows(const at::Tensor& x, bool sums) {
  const int64_t m = x.size(0), k = x.size(1);
  const auto xc = x.contiguous();
  Bf16Rows rows{std::vector<uint16_t>(m * k), std::vector<float>(sums ? m * (k / kGroup) : 0)};
  at::parallel_for(0, m, m * k < kMatmulSerialWork ? m + 1 : 8, [&](int64_t m0, int64_t m1) {
    to_bf16(xc.data_ptr<float>(), m0, m1, k, rows.bits.data(), sums ? rows.sums.data() : nullptr);
  });
  return rows;
}

at::Tensor q4_dot(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz) {
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(k == groups * kGroup, "x has ", k, " columns, the weights ", groups * kGroup);
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.size(0) == blocks &&
                  sz.size(1) == groups && sz.size(2) == 32,
              "scales_zeros: bfloat16 [N/16, K/32, 32]");
  const int64_t n = blocks * 16;
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const Bf16Rows xr = bf16_rows(x, true);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  over_blocks<kDotRows>(m, blocks, kDotChunk, m * n * k, [&](auto rows, int64_t b, int64_t r0) {
    dot_block<decltype(rows)::value>(pp + b * groups * 256, sp + b * groups * 32,
                                     xr.bits.data() + r0 * k, xr.sums.data() + r0 * groups, k,
                                     groups, yp + r0 * n + b * 16, n);
  });
  return y;
}

// The output projection in int8 (engine/cpu_quant.py Int8Linear: one bfloat16 scale per output
// column, y = scale * sum(q x)): int8 values are exact in bfloat16, widened in registers.
// Layout: int8 [N/16, K/2, 32], byte i of a pair of K for column i / 2, K = 2p + i % 2.
template <int R>
void int8_block(const int8_t* pw, const float* scales, const uint16_t* xb, int64_t k, float* y,
                int64_t ldy) {
  __m512 acc[R][2];  // two chains a row (even and odd pairs of K)
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const auto widen = [](const int8_t* b) {  // 32 int8 weights to bfloat16, lanes in order
    const __m512 lo = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0-15 from lo, 16-31 from hi
  };
  for (int64_t p = 0; p < k / 2; p += 2) {  // K is a multiple of 32
    const __m512bh w0 = widen(pw + p * 32), w1 = widen(pw + p * 32 + 32);
    for (int r = 0; r < R; ++r) {
      int32_t a, b;
      std::memcpy(&a, xb + r * k + 2 * p, sizeof(a));
      std::memcpy(&b, xb + r * k + 2 * p + 2, sizeof(b));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, (__m512bh)_mm512_set1_epi32(a));
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, (__m512bh)_mm512_set1_epi32(b));
    }
  }
  const __m512 scale = _mm512_loadu_ps(scales);
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(y + r * ldy,
                     rounded(_mm512_mul_ps(_mm512_add_ps(acc[r][0], acc[r][1]), scale)));
}

#if defined(__AVX512VNNI__)
at::Tensor int8_dot_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales);
#endif

at::Tensor int8_dot(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [M, K]");
  const bool q8 = packed.scalar_type() == at::kByte;  // the int8-activation kernel's layout
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                  (q8 ? packed.size(2) == 64 : packed.scalar_type() == at::kChar &&
                                                   packed.size(2) == 32),
              "packed: contiguous int8 [N/16, K/2, 32] (or uint8 [N/16, K/4, 64])");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), n = blocks * 16;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.size(0) == n &&
                  scales.is_contiguous(),
              "scales: float32 [N]");
#if defined(__AVX512VNNI__)
  if (q8) return int8_dot_q8(x, packed, scales);
#endif
  TORCH_CHECK(!q8, "this build has no int8-activation kernel (AVX512-VNNI)");
  TORCH_CHECK(k % kGroup == 0 && k == 2 * packed.size(1), "x has ", k, " columns, the weights ",
              2 * packed.size(1), " (a multiple of 32)");
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const Bf16Rows xr = bf16_rows(x, false);
  const int8_t* pp = packed.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_blocks<kDotRows>(m, blocks, kDotChunk, m * n * k, [&](auto rows, int64_t b, int64_t r0) {
    int8_block<decltype(rows)::value>(pp + b * k * 16, sp + b * 16, xr.bits.data() + r0 * k, k,
                                      yp + r0 * n + b * 16, n);
  });
  return y;
}

#if defined(__AVX512VNNI__)
#define CROWDCHAT_Q8_ACT 1

constexpr int kTileRows = 16;        // rows of x in an AMX tile
constexpr int64_t kHeadChunk = 32;  // int8_dot_q8's rows of x a pass over the weights
constexpr int64_t kTileMinRows = 10;  // fewer rows: `vpdpbusd` (at 8, AMX was 0.9-1.0x)
std::atomic<bool> amx_wanted{true};  // `set_amx`

// x's rows in int8, as llama.cpp quantizes activations for its 4-bit weights (Q8_1): per
// group of 32 values a scale d = max|x| / 127, q = round(x / d) (to nearest even), the group's
// sum of q, and d times it (the zeros' term)
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
  std::vector<int32_t> qsum;
};

// (`tiles`: q has zero rows after the last up to a multiple of kTileRows, for whole AMX tiles)
Int8Rows int8_rows(const at::Tensor& x, bool tiles) {
  const int64_t m = x.size(0), k = x.size(1), groups = m * (k / kGroup);
  const int64_t pad = tiles ? kTileRows : 1;
  const auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  Int8Rows rows{std::vector<int8_t>((m + pad - 1) / pad * pad * k), std::vector<float>(groups),
                std::vector<float>(groups), std::vector<int32_t>(groups)};
  const int64_t grain = m * k < kMatmulSerialWork ? groups + 1 : 64;
  at::parallel_for(0, groups, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const __m512 a = _mm512_loadu_ps(xp + i * kGroup), b = _mm512_loadu_ps(xp + i * kGroup + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(rows.q.data() + i * kGroup),
                       _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(rows.q.data() + i * kGroup + 16),
                       _mm512_cvtsepi32_epi8(qb));
      rows.d[i] = amax / 127.0f;
      rows.qsum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
      rows.dsum[i] = rows.d[i] * static_cast<float>(rows.qsum[i]);
    }
  });
  return rows;
}

// One group of 32 values of K for R rows: `w` its 8 vectors of 16 columns' 4 unsigned bytes
// (K = 4t .. 4t + 3), `xq` the rows' int8 values from the group's first (row stride k); s[r]
// the 16 columns' exact integer sums for row r
template <int R>
inline void group_sums(const __m512i (&w)[8], const int8_t* xq, int64_t k, __m512i (&s)[R]) {
  for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
  for (int t = 0; t < 8; ++t) {
    for (int r = 0; r < R; ++r) {
      int32_t a;
      std::memcpy(&a, xq + r * k + 4 * t, sizeof(a));
      s[r] = _mm512_dpbusd_epi32(s[r], w[t], _mm512_set1_epi32(a));
    }
  }
}

// Where the integer sums come from: `vpdpbusd` on the group's weights unpacked in registers
// (a few rows), on weights unpacked before into L1 (many rows), or AMX tiles
enum class Sums { kRegisters, kCached, kTiles };

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define CROWDCHAT_AMX 1

// AMX (Sapphire Rapids and later Xeons): one `tdpbsud` multiplies a tile of 16 rows of x's
// int8 values (one group, 32 bytes a row) by the group's weights in the very layout
// `vpdpbusd` takes (8 rows of 16 columns' 4 bytes) into 16 x 16 int32 sums, 8,192 products an
// instruction against `vpdpbusd`'s 64. The sums are exact integers, so every float operation
// after them, and so the result, is bitwise the `vpdpbusd` path's. The groups of 32 bound the
// gain: each group's sums go through memory (no tile-to-register move before AMX-AVX512) and
// take 4 float operations a row to scale. On the Sapphire Rapids KVM guest a tile load took
// 16-40 cycles, a store 23, a product 13 (K = 32 runs no faster than 64): ~40 cycles a group
// against ~115 for 16 rows of `vpdpbusd`, and the scaling after it as much again. Measured
// there: the embedded model's 4-bit linears 1.1-1.25x at 16-500 rows, the output projection
// 1.15-1.35x; with every group's sums buffered first (four products in flight) it was slower.

// Linux hands a process AMX's 8 KB of tile state only when asked (arch_prctl), once
bool amx_permitted() {
  constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
  static const bool ok = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return ok;
}

bool amx_on() { return amx_wanted.load(std::memory_order_relaxed) && amx_permitted(); }

// A thread's tile configuration for the time it computes (`over_blocks`' `around`), released
// after (the tile state is then not saved at every context switch): tmm0 and tmm3 the sums (16
// rows of 16 int32), tmm1 and tmm4 16 rows of a group of x (32 bytes each), tmm2 and tmm5 a
// group's weights (8 rows of 64 bytes): two groups in flight
struct Tiles {
  template <typename F>
  void operator()(const F& f) const {
    alignas(64) uint8_t config[64] = {};
    config[0] = 1;  // palette 1
    const auto tile = [&config](int t, int rows, uint16_t bytes) {
      std::memcpy(config + 16 + 2 * t, &bytes, sizeof(bytes));
      config[48 + t] = static_cast<uint8_t>(rows);
    };
    for (int t = 0; t < 6; t += 3) {
      tile(t, kTileRows, 64);
      tile(t + 1, kTileRows, kGroup);
      tile(t + 2, kGroup / 4, 64);
    }
    _tile_loadconfig(config);
    f();
    _tile_release();
  }
};

// `group_sums` on AMX for every group of a block (x padded to kTileRows rows: int8_rows'
// `pad`; `w` the groups' weights, 512 bytes each): add(g, s) for each group g, s(r) its sums
// for row r. Tiles are not renamed as registers are, and a group's sums reach the vector
// registers only through memory, so two groups alternate between two sets of tiles: the next
// group's product runs while this one's sums are scaled (one set: no faster than `vpdpbusd`)
template <typename Add>
void tile_groups(const uint8_t* w, const int8_t* xq, int64_t k, int64_t groups, const Add& add) {
  alignas(64) int32_t sums[2][kTileRows * 16];
  const auto even = [&](int64_t g) {
    _tile_zero(0);
    _tile_loadd(1, xq + g * kGroup, k);
    _tile_loadd(2, w + g * 512, 64);
    _tile_dpbsud(0, 1, 2);
  };
  const auto odd = [&](int64_t g) {
    _tile_zero(3);
    _tile_loadd(4, xq + g * kGroup, k);
    _tile_loadd(5, w + g * 512, 64);
    _tile_dpbsud(3, 4, 5);
  };
  const auto row = [&sums](int set) {
    return [&sums, set](int r) { return _mm512_load_si512(sums[set] + 16 * r); };
  };
  even(0);
  for (int64_t g = 0; g < groups; g += 2) {
    if (g + 1 < groups) odd(g + 1);
    _tile_stored(0, sums[0], 64);
    if (g + 2 < groups) even(g + 2);
    add(g, row(0));
    if (g + 1 < groups) {
      _tile_stored(3, sums[1], 64);
      add(g + 1, row(1));
    }
  }
}
#else
bool amx_on() { return false; }
#endif

// whether a matmul of m rows takes AMX tiles
bool use_tiles(int64_t m) { return m >= kTileMinRows && amx_on(); }

// The int8-activation kernels' loop (over_blocks): tiles of kTileRows rows inside each
// thread's tile configuration where `tiles`, else of kDotRows rows; `chunk` rows of x a pass
// over the weights; `share`: only those blocks, on the calling thread
template <typename Tile, typename Start = NoStart>
void over_blocks_q8(bool tiles, int64_t m, int64_t blocks, int64_t work, const Tile& tile,
                    const Start& start = Start{}, int64_t chunk = kDotChunk,
                    crowdchat::BlockShare share = crowdchat::BlockShare::all()) {
#ifdef CROWDCHAT_AMX
  if (tiles) return over_blocks<kTileRows>(m, blocks, chunk, work, tile, start, Tiles{}, share);
#endif
  over_blocks<kDotRows>(m, blocks, chunk, work, tile, start, crowdchat::Plain{}, share);
}

// One block's 4-bit groups as `vpdpbusd` (and an AMX tile) takes them, into `w` (8 vectors
// a group): vector t holds the 16 columns' q[4t .. 4t + 3], a 32-bit lane each. Their layout
// (engine/model/cpu_quant.py `pack_for_dot(..., q8=True)`): per group 4 x 64 bytes, byte i of
// the p-th holding byte i of vector 2p in its low nibble and of vector 2p + 1 in its high
// one, so a vector is one mask, or one shift and one mask (with the bfloat16 kernel's layout
// it took 6 instructions, unpacking was ~1/3 of a 16-row AMX matmul). Unpacked once per block
// and chunk of rows, then read from L1 by every tile, or in registers for a few rows.
void unpack_q8(const uint8_t* pw, int64_t groups, __m512i* w) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t i = 0; i < groups * 4; ++i) {
    const __m512i b = _mm512_loadu_si512(pw + i * 64);
    w[2 * i] = _mm512_and_si512(b, low);
    w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
  }
}

// R rows of int8 x through one block of 16 output columns (`pw`, `unpack_q8`'s layout; its
// groups unpacked into `wu` but for kRegisters): each group's 4-bit weights as
// unsigned bytes, 4 values of K a lane, and `vpdpbusd` multiplies them with 4 int8 values of
// x into int32 sums, 64 products an instruction (twice `vdpbf16ps`'s 32, at the same rate on
// Zen 4/5): y = sum over groups of d (scale * sum(q x) + (zero - 8 scale) * sum(x)), the
// integer sums exact
template <int R, Sums How>
void dot_block_q8(const uint8_t* pw, const __m512i* wu, const float* pso, const int8_t* xq,
                  const float* xd, const float* xds, int64_t k, int64_t groups, float* y,
                  int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const auto add = [&](int64_t g, const auto& s) {  // group g's sums s(r) into acc
    const __m512 scale = _mm512_loadu_ps(pso + g * 32), offset = _mm512_loadu_ps(pso + g * 32 + 16);
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * groups + g;
      const __m512 sum = _mm512_mul_ps(_mm512_cvtepi32_ps(s(r)), _mm512_set1_ps(xd[i]));
      acc[r] = _mm512_fmadd_ps(scale, sum, _mm512_fmadd_ps(offset, _mm512_set1_ps(xds[i]), acc[r]));
    }
  };
  if constexpr (How == Sums::kTiles) {  // (only where built for AMX: `use_tiles`)
#ifdef CROWDCHAT_AMX
    tile_groups(reinterpret_cast<const uint8_t*>(wu), xq, k, groups, add);
#endif
  } else {
    for (int64_t g = 0; g < groups; ++g) {
      __m512i w[8];
      if constexpr (How == Sums::kCached) {  // unpacked before, for many rows
        for (int t = 0; t < 8; ++t) w[t] = _mm512_load_si512(wu + g * 8 + t);
      } else {  // a few rows: unpacked here, in registers
        unpack_q8(pw + g * 256, 1, w);
      }
      __m512i s[R];
      group_sums<R>(w, xq + g * kGroup, k, s);
      add(g, [&s](int r) { return s[r]; });
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, rounded(acc[r]));
}

// `so`: float32 [N/16, K/32, 32], per group the 16 columns' scales, then their offsets
// zero - 8 scale (engine/cpu_quant.py `pack_for_dot(..., q8=True)`)
// (y [M, N] float32: `share`'s columns written)
void q4_dot_q8_into(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& so,
                    at::Tensor& y, crowdchat::BlockShare share) {
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(k == groups * kGroup, "x has ", k, " columns, the weights ", groups * kGroup);
  TORCH_CHECK(so.dim() == 3 && so.size(0) == blocks && so.size(1) == groups && so.size(2) == 32,
              "scales_offsets: float32 [N/16, K/32, 32]");
  const int64_t n = blocks * 16;
  TORCH_CHECK(y.dim() == 2 && y.size(0) == m && y.size(1) == n && y.is_contiguous() &&
                  y.scalar_type() == at::kFloat,
              "y: contiguous float32 [M, N]");
  if (m == 0) return;
  const bool tiles = use_tiles(m);
  const Int8Rows xr = int8_rows(x, tiles);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = so.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // on AMX, or past 16 rows (at 16, a decode_stack thread's half of 32 rows, it did not pay
  // for `vpdpbusd`), a block's groups are unpacked once per chunk of rows into `wu` (L1), then
  // every tile reads them
  const Sums how = tiles ? Sums::kTiles : m > 2 * kDotRows ? Sums::kCached : Sums::kRegisters;
  thread_local std::vector<__m512i> wu;  // each thread's own
  const auto tile = [&](auto rows, int64_t b, int64_t r0) {
    constexpr int R = decltype(rows)::value;
    const auto f = how == Sums::kTiles    ? dot_block_q8<R, Sums::kTiles>
                   : how == Sums::kCached ? dot_block_q8<R, Sums::kCached>
                                          : dot_block_q8<R, Sums::kRegisters>;
    f(pp + b * groups * 256, wu.data(), sp + b * groups * 32, xr.q.data() + r0 * k,
      xr.d.data() + r0 * groups, xr.dsum.data() + r0 * groups, k, groups, yp + r0 * n + b * 16,
      n);
  };
  const auto unpack = [&](int64_t b) {
    if (how != Sums::kRegisters) {
      wu.resize(groups * 8);
      unpack_q8(pp + b * groups * 256, groups, wu.data());
    }
  };
  over_blocks_q8(tiles, m, blocks, m * n * k, tile, unpack, kDotChunk, share);
}

at::Tensor q4_dot_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& so) {
  auto y = at::empty({x.size(0), packed.size(0) * 16}, x.options());
  q4_dot_q8_into(x, packed, so, y, crowdchat::BlockShare::all());
  return y;
}

// The output projection's int8 weights with int8 x (`int8_dot` with uint8 weights): each
// weight plus 128 as an unsigned byte (`vpdpbusd` takes one operand unsigned), layout uint8
// [N/16, K/4, 64], byte 4c + j for column c and K = 4t + j; per group of 32 the integer sum
// less 128 times the group's sum of x's int8 values is exact, then scaled by d
template <int R, Sums How>
void int8_block_q8(const uint8_t* pw, const float* scales, const int8_t* xq, const float* xd,
                   const int32_t* xqs, int64_t k, int64_t groups, float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const auto add = [&](int64_t g, const auto& s) {  // group g's sums s(r) into acc
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * groups + g;
      const __m512i exact = _mm512_sub_epi32(s(r), _mm512_set1_epi32(128 * xqs[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(xd[i]), acc[r]);
    }
  };
  if constexpr (How == Sums::kTiles) {  // the weights are in the tiles' layout
#ifdef CROWDCHAT_AMX
    tile_groups(pw, xq, k, groups, add);
#endif
  } else {
    for (int64_t g = 0; g < groups; ++g) {
      __m512i w[8];
      for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(pw + (g * 8 + t) * 64);
      __m512i s[R];
      group_sums<R>(w, xq + g * kGroup, k, s);
      add(g, [&s](int r) { return s[r]; });
    }
  }
  const __m512 scale = _mm512_loadu_ps(scales);
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(y + r * ldy, rounded(_mm512_mul_ps(acc[r], scale)));
}

at::Tensor int8_dot_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), n = blocks * 16;
  TORCH_CHECK(packed.size(2) == 64 && k == 4 * packed.size(1) && k % kGroup == 0, "x has ", k,
              " columns, the weights ", 4 * packed.size(1), " (a multiple of 32)");
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const bool tiles = use_tiles(m);
  const Int8Rows xr = int8_rows(x, tiles);
  const int64_t groups = k / kGroup;
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const auto tile = [&](auto rows, int64_t b, int64_t r0) {
    constexpr int R = decltype(rows)::value;
    const auto f = tiles ? int8_block_q8<R, Sums::kTiles> : int8_block_q8<R, Sums::kRegisters>;
    f(pp + b * k * 16, sp + b * 16, xr.q.data() + r0 * k, xr.d.data() + r0 * groups,
      xr.qsum.data() + r0 * groups, k, groups, yp + r0 * n + b * 16, n);
  };
  // 32 rows a pass (their int8 x stays in L1): the output projection at 64 / 96 / 128 rows
  // took 5.6 / 9.5 / 15.3 ms on tiles with 64 a pass against 4.0 / 5.8 / 8.2, on `vpdpbusd`
  // (AMX off) 5.8-6.2 / 8.7-8.8 / 12.3-13.0 against 5.3-5.4 / 7.6-7.7 / 10.4-10.6 (2-core
  // Sapphire Rapids VM; 32 rows the same). The 4-bit kernels keep 64: they unpack a block's
  // weights once a pass
  over_blocks_q8(tiles, m, blocks, m * n * k, tile, NoStart{}, kHeadChunk);
  return y;
}
#endif  // __AVX512VNNI__
#endif

}  // namespace

namespace crowdchat {

// whether the 4-bit kernel of this build's layout has an int8-activation variant
bool q8_activations() {
#if defined(CROWDCHAT_Q8_ACT)
  return true;
#elif defined(CROWDCHAT_Q4_DOT)
  return false;
#else
  return q8_avx2();
#endif
}

// whether the int8-activation kernels run on AMX tiles: built for AMX-INT8, Linux lets this
// process use it, and not turned off by `set_amx(false)` (which returns the state before)
bool amx_tiles() {
#if defined(CROWDCHAT_Q8_ACT)
  return amx_on();
#else
  return false;
#endif
}

bool set_amx(bool on) {
  const bool before = amx_tiles();
#if defined(CROWDCHAT_Q8_ACT)
  amx_wanted.store(on);
#endif
  return before;
}

// the AVX512-VNNI int8-activation layout (q4_dot_q8)
static bool vnni_layout(const at::Tensor& packed, const at::Tensor& sz) {
#ifdef CROWDCHAT_Q8_ACT
  return packed.dim() == 3 && packed.size(2) == 256 && sz.scalar_type() == at::kFloat;
#else
  (void)packed, (void)sz;
  return false;
#endif
}

bool q4_linear_shares(const at::Tensor& packed, const at::Tensor& sz) {
  const bool avx2 = packed.dim() == 3 && packed.size(2) == 128 && q8_avx2();
  return packed.scalar_type() == at::kByte && packed.is_contiguous() && sz.is_contiguous() &&
         (vnni_layout(packed, sz) || avx2);
}

void q4_linear_share(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                     int64_t part, int64_t parts, at::Tensor& y) {
  TORCH_CHECK(q4_linear_shares(packed, sz), "q4_linear_share: the int8-activation layouts only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [M, K]");
  TORCH_CHECK(parts > 0 && part >= 0 && part < parts, "share ", part, " of ", parts);
  const auto share = BlockShare::of(packed.size(0), part, parts);
#ifdef CROWDCHAT_Q8_ACT
  if (vnni_layout(packed, sz)) return q4_dot_q8_into(x, packed, sz, y, share);
#endif
  q4_linear_q8_into(x, packed, sz, y, share);
}

bool q4_dot_layout() {
#ifdef CROWDCHAT_Q4_DOT
  return true;
#else
  return false;
#endif
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scales_zeros) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed: contiguous uint8 [N, K/32, 16] (or [N/16, K/32, 256], [N/8, K/32, 128])");
#ifdef CROWDCHAT_Q4_DOT
  if (packed.size(2) == 256) {
    TORCH_CHECK(scales_zeros.is_contiguous(), "weights must be contiguous");
#ifdef CROWDCHAT_Q8_ACT
    // float32 scales and offsets: the int8-activation kernel's weights
    if (scales_zeros.scalar_type() == at::kFloat) return q4_dot_q8(x, packed, scales_zeros);
#endif
    return q4_dot(x, packed, scales_zeros);
  }
#endif
  // the AVX2 int8-activation kernel's layout (csrc/q8_avx2.cpp)
  if (packed.size(2) == 128) return crowdchat::q4_linear_q8(x, packed, scales_zeros);
  TORCH_CHECK(packed.size(2) == 16, "packed: uint8 [N, K/32, 16]");
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
  at::parallel_for(0, n, m * n * k < kMatmulSerialWork ? n + 1 : 16, [&](int64_t n0, int64_t n1) {
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
  // whether this build packs for the AVX512-BF16 kernel (no tensor: a catch-all kernel)
  m.def("q4_dot_layout() -> bool", &crowdchat::q4_dot_layout);
  m.def("int8_dot(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  // whether this build has the int8-activation 4-bit kernel (AVX512-VNNI)
  m.def("q8_activations() -> bool", &crowdchat::q8_activations);
  m.def("amx_tiles() -> bool", &crowdchat::amx_tiles);
  m.def("set_amx(bool on) -> bool", &crowdchat::set_amx);
}

TORCH_LIBRARY_IMPL(crowdchat, CPU, m) {
  m.impl("q4_linear", &crowdchat::q4_linear);
#ifdef CROWDCHAT_Q4_DOT
  m.impl("int8_dot", &int8_dot);
#else  // int8 weights with int8 x only (csrc/q8_avx2.cpp)
  m.impl("int8_dot", &crowdchat::int8_linear_q8);
#endif
}

// Int8-activation matmuls for CPUs with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2/3, most
// Intel client parts, Skylake to Ice Lake servers): llama.cpp's model of a 4-bit matmul (its
// Q4_1 x Q8_1 dot product), in a layout of crowdchat's own (engine/cpu_quant.py
// `pack_for_avx2`).
//
// x's rows are rounded to int8 per group of 32 as the AVX512-VNNI kernel rounds them (scale
// d = max|x| / 127, q = round(x / d) to nearest even: the same values bit for bit). The weights
// lie in blocks of 8 output columns, a 32-bit lane each: per 4 values of K a mask (and every
// other time a shift) gives the 8 columns' 4 nibbles as unsigned bytes, and `vpmaddubsw`
// multiplies them with those 4 values of x (broadcast) into pairs of products in int16 lanes,
// which add up over the group's 32 values before one `vpmaddwd` a group widens them to 8
// exact int32 sums; only then is each group's sum scaled, 8 columns at once, in float32:
// y += d (scale sum(q x) + (zero - 8 scale) sum(x)). That is 2 instructions per 32
// multiply-adds where float32 FMAs take 4, on a quarter of the bytes of x, and no horizontal
// sums. One block's groups are unpacked once for up to 4 rows. Each output is computed in
// the same order whatever the rows beside it or the threads: a row's result is bitwise the
// same alone or in any batch.
//
// The output projection's int8 weights (engine/cpu_quant.py Int8Linear) run on the same
// rounding of x: `vpmaddubsw` takes one operand unsigned, so it multiplies |w| with x carrying
// w's sign (`vpsignb`), as llama.cpp's Q8_0 dot product does (|w| <= 127: a pair of products
// stays within int16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define CROWDCHAT_Q8_AVX2 1

namespace {

using crowdchat::kGroup;
using crowdchat::kMatmulSerialWork;
using crowdchat::over_blocks;
constexpr int kTileRows = 4;       // rows of x sharing one block's unpacked group
constexpr int64_t kRowChunk = 64;  // rows of x per pass over a thread's columns

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// x [M, K] in int8 per group of 32: values, scales d, and d times each group's sum of values
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
};

Int8Rows int8_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), groups = m * (k / kGroup);
  const auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  Int8Rows rows{std::vector<int8_t>(m * k), std::vector<float>(groups), std::vector<float>(groups)};
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const int64_t grain = m * k < kMatmulSerialWork ? groups + 1 : 64;
  at::parallel_for(0, groups, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      __m256 a[4];
      for (int j = 0; j < 4; ++j) a[j] = _mm256_loadu_ps(xp + i * kGroup + 8 * j);
      const __m256 m01 = _mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1]));
      const __m256 m23 = _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3]));
      const float amax = hmax(_mm256_max_ps(m01, m23));
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m256i q[4];
      for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(a[j], inv));
      // packing works within 128-bit lanes: the permutation puts the 32 bytes back in order
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                               _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows.q.data() + i * kGroup),
                          _mm256_permutevar8x32_epi32(bytes, order));
      const int32_t sum =
          hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
      rows.d[i] = amax / 127.0f;
      rows.dsum[i] = rows.d[i] * static_cast<float>(sum);
    }
  });
  return rows;
}

// y's 8 columns rounded to bfloat16 as crowdchat::bf16_rounded rounds them (NaN to 0xffff0000)
inline __m256 rounded(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i v = _mm256_and_si256(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)),
      _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  return _mm256_castsi256_ps(
      _mm256_blendv_epi8(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u)), nan));
}

// 8 bfloat16 values (bits) as float32
inline __m256 widen(const uint16_t* v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))), 16));
}

// 4 int8 values of x (K = 4t .. 4t + 3) in every 32-bit lane
inline __m256i quad(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return _mm256_set1_epi32(v);
}

// One 32-byte load of a block's group (`pack_for_avx2`): the 8 columns' next 4 values of K
// (low nibbles, [0]) and the 4 after them (high nibbles, [1]) as unsigned bytes
struct Nibbles {
  __m256i w[2];
};
inline Nibbles nibbles(const uint8_t* p, __m256i low) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {{_mm256_and_si256(b, low), _mm256_and_si256(_mm256_srli_epi16(b, 4), low)}};
}

// 8 lanes += the sums of 4 products of unsigned bytes `u` with signed bytes `s`, exact:
// `vpmaddubsw` (pairs, |sum| <= 2 * 255 * 127 < 2^15) then `vpmaddwd` with ones
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

// Rows [r0, r0 + R) of y through one block of 8 columns of 4-bit weights (engine/cpu_quant.py
// `pack_for_avx2`): `pw` the block's groups, 128 bytes each: per 8 values of K 32 bytes, byte
// 4c + j holding column c's q[8p + j] (low nibble) and q[8p + 4 + j] (high nibble), so a mask
// gives 8 columns' first 4 values, a 32-bit lane each, and a shift and a mask the next 4
// (a 2-core Zen 3, 30 layers' 4-bit linears of SmolLM2-135M: 1 / 8 / 32 rows 3.1-3.2 /
// 8.4-8.6 / 29.1-29.4 ms against 3.8-3.9 / 9.1-9.2 / 31.7-34.9 with 16 bytes and a lane
// insert per 4 values); `psz` bfloat16 per group
// the 8 scales, then the 8 zeros. Per group the integer sums are exact, then
// y += scale d sum(q x) + (zero - 8 scale) d sum(x) in float32.
template <int R>
void q4_tile(const uint8_t* pw, const uint16_t* psz, const Int8Rows& x, int64_t k, int64_t r0,
             float* y, int64_t ldy) {
  const int64_t groups = k / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // pairs of products in int16 lanes, summed over the group's 8 quads before `vpmaddwd`
    // adds each lane's two: |q x| <= 15 * 128, so a lane holds at most 8 * 2 * 1,920 = 30,720
    // (no `vpmaddubsw` saturates, no sum wraps) and the int32 sums are dot4's exactly
    __m256i pairs[R];
    const int8_t* xg = x.q.data() + r0 * k + g * kGroup;
    {  // the group's first 8 values of K start the sums (no zeroed sums to add to: on a
       // 2-core Zen 3, 30 layers' 4-bit linears at 8 / 32 / 64 rows 6.8-6.9 / 23.3-23.6 /
       // 45.4-46.1 ms against 7.7-8.1 / 25.2-28.1 / 49.1-49.3)
      const Nibbles first = nibbles(pw + g * 128, low);
      for (int r = 0; r < R; ++r)
        pairs[r] = _mm256_add_epi16(_mm256_maddubs_epi16(first.w[0], quad(xg + r * k)),
                                    _mm256_maddubs_epi16(first.w[1], quad(xg + r * k + 4)));
    }
    // not unrolled: unrolled, GCC hoisted every broadcast of x ahead and spilled the products
    // to the stack (on a 2-core Zen 3, 30 layers' 4-bit linears at 8 / 32 / 64 rows 7.2-7.3 /
    // 25.0-25.2 / 48.7-49.2 ms against 8.4-8.6 / 29.1-29.4 / 56.8; one row the same)
#pragma GCC unroll 1
    for (int p = 1; p < 4; ++p) {  // 8 values of K: one load, two masks
      const Nibbles next = nibbles(pw + g * 128 + p * 32, low);
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r)
          pairs[r] = _mm256_add_epi16(
              pairs[r], _mm256_maddubs_epi16(next.w[h], quad(xg + r * k + 8 * p + 4 * h)));
    }
    const __m256 scale = widen(psz + g * 16), zero = widen(psz + g * 16 + 8);
    const __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero);  // 8 scale exact
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * groups + g;
      const __m256i sums = _mm256_madd_epi16(pairs[r], _mm256_set1_epi16(1));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                               _mm256_mul_ps(scale, _mm256_set1_ps(x.d[i])), acc[r]);
      acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x.dsum[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * ldy, rounded(acc[r]));
}

// The same for one block of 8 columns of int8 weights (Int8Linear's AVX2 layout): per 4
// values of K 32 bytes, bytes 4c .. 4c + 3 column c's; y = scale * sum over groups d sum(q x)
template <int R>
void i8_tile(const int8_t* pw, const float* scales, const Int8Rows& x, int64_t k, int64_t r0,
             float* y, int64_t ldy) {
  const int64_t groups = k / kGroup;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    const int8_t* xg = x.q.data() + r0 * k + g * kGroup;
    for (int t = 0; t < 8; ++t) {
      const __m256i w =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pw + (g * 8 + t) * 32));
      const __m256i magnitude = _mm256_abs_epi8(w);  // <= 127: w is never -128
      for (int r = 0; r < R; ++r)
        sums[r] = dot4(sums[r], magnitude, _mm256_sign_epi8(quad(xg + r * k + 4 * t), w));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * groups + g;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(x.d[i]), acc[r]);
    }
  }
  const __m256 scale = _mm256_loadu_ps(scales);
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(y + (r0 + r) * ldy, rounded(_mm256_mul_ps(acc[r], scale)));
}

at::Tensor check_x(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x: float32 [M, K]");
  TORCH_CHECK(x.size(1) == k && k % kGroup == 0, "x has ", x.size(1), " columns, the weights ", k,
              " (a multiple of 32)");
  return x.contiguous();
}

}  // namespace

namespace crowdchat {

void q4_linear_q8_into(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                       at::Tensor& y, BlockShare share) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == 128 &&
                  packed.is_contiguous(),
              "packed: contiguous uint8 [N/8, K/32, 128]");
  const int64_t blocks = packed.size(0), groups = packed.size(1), k = groups * kGroup;
  const auto xc = check_x(x, k);
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 && sz.size(0) == blocks &&
                  sz.size(1) == groups && sz.size(2) == 16 && sz.is_contiguous(),
              "scales_zeros: contiguous bfloat16 [N/8, K/32, 16]");
  const int64_t m = xc.size(0), n = blocks * 8;
  TORCH_CHECK(y.dim() == 2 && y.size(0) == m && y.size(1) == n && y.is_contiguous() &&
                  y.scalar_type() == at::kFloat,
              "y: contiguous float32 [M, N]");
  if (m == 0 || n == 0) return;
  const Int8Rows rows = int8_rows(xc);
  const uint8_t* pw = packed.data_ptr<uint8_t>();
  const auto* psz = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const auto tile = [&](auto r, int64_t b, int64_t r0) {
    q4_tile<decltype(r)::value>(pw + b * groups * 128, psz + b * groups * 16, rows, k, r0,
                                yp + b * 8, n);
  };
  over_blocks<kTileRows>(m, blocks, kRowChunk, m * n * k, tile, NoStart{}, Plain{}, share);
}

at::Tensor q4_linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz) {
  auto y = at::empty({x.size(0), packed.size(0) * 8}, x.options());
  q4_linear_q8_into(x, packed, sz, y, BlockShare::all());
  return y;
}

at::Tensor int8_linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == 32 &&
                  packed.is_contiguous(),
              "packed: contiguous int8 [N/8, K/4, 32]");
  const int64_t blocks = packed.size(0), k = 4 * packed.size(1), n = blocks * 8;
  const auto xc = check_x(x, k);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.size(0) == n &&
                  scales.is_contiguous(),
              "scales: float32 [N]");
  const int64_t m = xc.size(0);
  auto y = at::empty({m, n}, xc.options());
  if (m == 0 || n == 0) return y;
  const Int8Rows rows = int8_rows(xc);
  const int8_t* pw = packed.data_ptr<int8_t>();
  const float* ps = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_blocks<kTileRows>(m, blocks, kRowChunk, m * n * k, [&](auto r, int64_t b, int64_t r0) {
    i8_tile<decltype(r)::value>(pw + b * k * 8, ps + b * 8, rows, k, r0, yp + b * 8, n);
  });
  return y;
}

}  // namespace crowdchat
#else
namespace crowdchat {

at::Tensor q4_linear_q8(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "this build has no int8-activation kernel (AVX2)");
}

void q4_linear_q8_into(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                       BlockShare) {
  TORCH_CHECK(false, "this build has no int8-activation kernel (AVX2)");
}

at::Tensor int8_linear_q8(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "this build has no int8-activation kernel (AVX2)");
}

}  // namespace crowdchat
#endif  // AVX2 and FMA

namespace crowdchat {

bool q8_avx2() {
#ifdef CROWDCHAT_Q8_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace crowdchat

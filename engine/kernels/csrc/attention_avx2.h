// The paged attention work item on AVX2 and FMA for head sizes of 64 and 128, for CPUs without
// AVX-512 (paged_decode.cpp; an AVX-512 build runs attention_avx512.h instead). The same
// steps as the AVX-512 loop on 8 lanes: K rows widened once per block, 8 tokens' dot products
// per head summed in registers and reduced together by one horizontal-add tree, exp 8 scores
// at a time, each head's V sums kept in registers over a block. Every sum is in intrinsics, so
// its order is the source's: a prefill chunk's query is bitwise the decode of its token.
#pragma once

#include "attention.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define CROWDCHAT_ATTENTION_AVX2 1
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <limits>

namespace crowdchat_attention {

inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 widen8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// exp_nonpositive on 8 lanes (the same steps, the same roundings)
inline __m256 exp8_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// lane i of the result: the sum of a[i]'s 8 lanes (lane i reads a[i] alone)
inline __m256 sum8x8(const __m256* a) {
  const __m256 b0 = _mm256_hadd_ps(a[0], a[1]), b1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 b2 = _mm256_hadd_ps(a[4], a[5]), b3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);
  return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}

// the sum of v's 8 lanes, in one fixed order
inline float sum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// a mask of the first n < 8 lanes
inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <typename T, int DIM>
void attend_chunk_avx2(const float* __restrict q, const T* __restrict kh, const T* __restrict vh,
                       const int64_t* __restrict blocks, int64_t bs, int64_t t0, int64_t t1,
                       int64_t G, const int64_t* __restrict limit, float* __restrict scores,
                       float* __restrict buf, float* __restrict part) {
  constexpr int NV = DIM / 8;  // vectors per row
  const int64_t n = t1 - t0, stride = DIM + 2;
  const BlockRows<T> at(blocks, bs, t0, n, DIM);
  const auto widen_row = [](const T* src, float* dst) {
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(dst + 8 * j, widen8(src + 8 * j));
  };
  auto widen_block = [&](const T* base, const T* then, int64_t t) {
    return at.widen_block(base, then, t, buf, widen_row);
  };
  for (int64_t t = 0; t < n;) {
    const int64_t rows = widen_block(kh, vh, t);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * DIM;
      float* sg = scores + g * kChunk + t;
      for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        const int64_t nr = std::min<int64_t>(8, rows - r0);
        const float* kb = buf + r0 * DIM;
        __m256 acc[8];
        if (nr == 8) {  // unrolled: the accumulators stay in registers
#pragma GCC unroll 8
          for (int r = 0; r < 8; ++r) {
            acc[r] = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(kb + r * DIM));
#pragma GCC unroll 16
            for (int j = 1; j < NV; ++j)
              acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j),
                                       _mm256_loadu_ps(kb + r * DIM + 8 * j), acc[r]);
          }
          _mm256_storeu_ps(sg + r0, sum8x8(acc));
        } else {  // a block's last rows: the same sums, the missing rows' left at zero
          for (int r = 0; r < 8; ++r) {
            acc[r] = _mm256_setzero_ps();
            if (r < nr) {
              acc[r] = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(kb + r * DIM));
              for (int j = 1; j < NV; ++j)
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j),
                                         _mm256_loadu_ps(kb + r * DIM + 8 * j), acc[r]);
            }
          }
          _mm256_maskstore_ps(sg + r0, first_lanes(nr), sum8x8(acc));
        }
      }
    }
    t += rows;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * kChunk;
    const int64_t nv = valid_keys(limit, g, t0, n);
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < nv; ++t) m = std::max(m, sg[t]);
    const __m256 mb = _mm256_set1_ps(m);
    __m256 lv = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= nv; t += 8) {
      const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mb));
      _mm256_storeu_ps(sg + t, e);
      lv = _mm256_add_ps(lv, e);
    }
    if (t < nv) {  // the last scores: the lanes past them add zeros
      const __m256i k = first_lanes(nv - t);
      const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(sg + t, k), mb));
      _mm256_maskstore_ps(sg + t, k, e);
      lv = _mm256_add_ps(lv, _mm256_and_ps(e, _mm256_castsi256_ps(k)));
    }
    float* pg = part + g * stride;
    pg[0] = m, pg[1] = sum8(lv);
    std::fill_n(pg + 2, DIM, 0.f);
  }
  // values: a head's sums 64 at a time (8 registers) over the block's rows
  for (int64_t t = 0; t < n;) {
    const int64_t rows = widen_block(vh, nullptr, t);
    for (int64_t g = 0; g < G; ++g) {
      const float* w = scores + g * kChunk + t;
      float* acc = part + g * stride + 2;
      const int64_t used = std::min(rows, valid_keys(limit, g, t0, n) - t);
      for (int j0 = 0; j0 < NV && used > 0; j0 += 8) {
        __m256 a[8];
        for (int j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(acc + 8 * (j0 + j));
        for (int64_t r = 0; r < used; ++r) {
          const __m256 wr = _mm256_set1_ps(w[r]);
          const float* vr = buf + r * DIM + 8 * j0;
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j)
            a[j] = _mm256_fmadd_ps(wr, _mm256_loadu_ps(vr + 8 * j), a[j]);
        }
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc + 8 * (j0 + j), a[j]);
      }
    }
    t += rows;
  }
}

}  // namespace crowdchat_attention
#endif

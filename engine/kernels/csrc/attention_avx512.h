// The paged attention work item on AVX-512 for head sizes of 64 and 128 (paged_decode.cpp).
#pragma once

#include "attention.h"

#if defined(__AVX512F__)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <limits>
#include <type_traits>

namespace crowdchat_attention {

// The same work item on AVX-512 for head sizes of 64 and 128 (perf, 32 rows of ~300 tokens: the
// generic loop's exp was scalar, each token's 3 dot products ended in horizontal reductions and
// the V sums went through memory for every token). Here: K rows widened once per block into a
// buffer, 16 tokens' dot products per head summed in registers and reduced together by one
// transpose-add tree, exp 16 scores at a time, each head's V sums kept in registers over a
// block; the block two ahead prefetched a row per row widened (BlockRows).
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp_nonpositive on 16 lanes (the same steps)
inline __m512 exp16_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// lane i of the result: the sum of a[i]'s 16 lanes
inline __m512 sum16x16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                  _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                  _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

template <typename T, int DIM>
void attend_chunk_avx512(const float* __restrict q, const T* __restrict kh,
                         const T* __restrict vh, const int64_t* __restrict blocks, int64_t bs,
                         int64_t t0, int64_t t1, int64_t G, const int64_t* __restrict limit,
                         float* __restrict scores, float* __restrict buf,
                         float* __restrict part) {
  constexpr int NV = DIM / 16;  // vectors per row
  const int64_t n = t1 - t0, stride = DIM + 2;
  // the rows of K or V from position t0 + t to the end of its block (at most kMaxBlock) or of
  // the chunk, widened into `buf`, the block ahead prefetched meanwhile; returns how many
  const BlockRows<T> at(blocks, bs, t0, n, DIM);
  const auto widen_row = [](const T* src, float* dst) {
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(dst + 16 * j, widen16(src + 16 * j));
  };
  auto widen_block = [&](const T* base, const T* then, int64_t t) {
    return at.widen_block(base, then, t, buf, widen_row);
  };
  for (int64_t t = 0; t < n;) {
    const int64_t rows = widen_block(kh, vh, t);
    for (int64_t g = 0; g < G; ++g) {
      __m512 qv[NV];
      for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(q + g * DIM + 16 * j);
      float* sg = scores + g * kChunk + t;
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t nr = std::min<int64_t>(16, rows - r0);
        const float* kb = buf + r0 * DIM;
        __m512 acc[16];
        if (nr == 16) {  // unrolled: the accumulators stay in registers
#pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) {
            acc[r] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kb + r * DIM));
#pragma GCC unroll 8
            for (int j = 1; j < NV; ++j)
              acc[r] = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kb + r * DIM + 16 * j), acc[r]);
          }
        } else {  // a block's last rows: the same sums, the missing rows' left at zero
          for (int r = 0; r < 16; ++r) {
            acc[r] = _mm512_setzero_ps();
            if (r < nr) {
              acc[r] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kb + r * DIM));
              for (int j = 1; j < NV; ++j)
                acc[r] = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kb + r * DIM + 16 * j), acc[r]);
            }
          }
        }
        _mm512_mask_storeu_ps(sg + r0, static_cast<__mmask16>((1u << nr) - 1), sum16x16(acc));
      }
    }
    t += rows;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * kChunk;
    const int64_t nv = valid_keys(limit, g, t0, n);
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 16 <= nv; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sg + t));
    float m = _mm512_reduce_max_ps(mv);
    for (; t < nv; ++t) m = std::max(m, sg[t]);
    const __m512 mb = _mm512_set1_ps(m);
    __m512 lv = _mm512_setzero_ps();
    for (t = 0; t < nv; t += 16) {
      const __mmask16 k = static_cast<__mmask16>(nv - t >= 16 ? 0xffff : (1u << (nv - t)) - 1);
      const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + t), mb));
      _mm512_mask_storeu_ps(sg + t, k, e);
      lv = _mm512_add_ps(lv, _mm512_maskz_mov_ps(k, e));
    }
    float* pg = part + g * stride;
    pg[0] = m, pg[1] = _mm512_reduce_add_ps(lv);
    std::fill_n(pg + 2, DIM, 0.f);
  }
  // values: each head's sums stay in registers over a block, kHeads heads at a time, the rows
  // outer (one V row feeds all of them: independent FMA chains in flight, where one head's
  // rows were one chain per vector). Few heads (a decode's G): V rows widened in registers,
  // never stored; many (a prefill tile's): widened once into `buf` for all the groups. Each
  // head's sum runs over the rows in order, as before: the same values, bitwise.
  constexpr int kHeads = DIM == 64 ? 4 : 2;
  const bool in_regs = G <= kHeads;
  for (int64_t t = 0; t < n;) {
    const int64_t rows = at.rows(t);
    const T* src = at.row(vh, t);
    const char* pf = in_regs ? at.ahead(vh, nullptr, t) : nullptr;
    if (!in_regs) widen_block(vh, nullptr, t);
    const auto row = [&](int64_t r, __m512* v) {
      if (in_regs) {
        at.prefetch_row(pf, r);
        for (int j = 0; j < NV; ++j) v[j] = widen16(src + r * DIM + 16 * j);
      } else {
        for (int j = 0; j < NV; ++j) v[j] = _mm512_loadu_ps(buf + r * DIM + 16 * j);
      }
    };
    int64_t r_done = 0;
    for (int64_t g0 = 0; g0 < G; g0 += kHeads) {
      const int64_t gn = std::min<int64_t>(kHeads, G - g0);
      int64_t all = rows;  // rows every head of the group uses (all of them, but in a prefill)
      for (int64_t g = 0; g < gn; ++g)
        all = std::min(all, valid_keys(limit, g0 + g, t0, n) - t);
      all = std::max<int64_t>(all, 0);
      r_done = std::max(r_done, all);
      const auto heads = [&](auto count) {  // the group's rows below `all`, `count` heads
        constexpr int GN = decltype(count)::value;
        __m512 a[GN][NV];
        for (int g = 0; g < GN; ++g)
          for (int j = 0; j < NV; ++j)
            a[g][j] = _mm512_loadu_ps(part + (g0 + g) * stride + 2 + 16 * j);
        for (int64_t r = 0; r < all; ++r) {
          __m512 v[NV];
          row(r, v);
#pragma GCC unroll 4
          for (int g = 0; g < GN; ++g) {
            const __m512 wr = _mm512_set1_ps(scores[(g0 + g) * kChunk + t + r]);
#pragma GCC unroll 8
            for (int j = 0; j < NV; ++j) a[g][j] = _mm512_fmadd_ps(wr, v[j], a[g][j]);
          }
        }
        for (int g = 0; g < GN; ++g)
          for (int j = 0; j < NV; ++j)
            _mm512_storeu_ps(part + (g0 + g) * stride + 2 + 16 * j, a[g][j]);
      };
      switch (gn) {
        case 1: heads(std::integral_constant<int, 1>{}); break;
        case 2: heads(std::integral_constant<int, 2>{}); break;
        case 3: if constexpr (kHeads >= 3) heads(std::integral_constant<int, 3>{}); break;
        default: if constexpr (kHeads >= 4) heads(std::integral_constant<int, 4>{}); break;
      }
      // a prefill's heads whose causal limit lies past `all`: their further rows one by one
      for (int64_t g = g0; g < g0 + gn; ++g) {
        const int64_t used = std::min(rows, valid_keys(limit, g, t0, n) - t);
        float* acc = part + g * stride + 2;
        for (int64_t r = all; r < used; ++r) {
          __m512 v[NV];
          row(r, v);
          const __m512 wr = _mm512_set1_ps(scores[g * kChunk + t + r]);
          for (int j = 0; j < NV; ++j)
            _mm512_storeu_ps(acc + 16 * j,
                             _mm512_fmadd_ps(wr, v[j], _mm512_loadu_ps(acc + 16 * j)));
        }
        r_done = std::max(r_done, used);
      }
    }
    // the block ahead's rows past those read here (a prefill's causal limit) prefetched too
    for (int64_t r = r_done; in_regs && r < rows; ++r) at.prefetch_row(pf, r);
    t += rows;
  }
}

}  // namespace crowdchat_attention
#endif  // __AVX512F__

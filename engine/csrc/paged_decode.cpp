// Decode attention read straight from the paged KV pool, on the CPU (engine/cpu_kernels.py).
//
// One query token per sequence against its own cached tokens: the K/V rows are read from their
// blocks where they lie, widened to float32 in registers, and never copied into a padded dense
// tensor. Work items are (sequence, KV head, chunk of kChunk tokens); a sequence's chunks are
// merged with their softmax maxima and sums (as flash-decoding does). How a sequence is split
// depends on its own length only, so its output is the same whatever else is in the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kChunk = 512;  // tokens per work item
constexpr int64_t kQueryTile = 16;  // a prefill chunk's tokens per work item
// below this many (token, KV head) pairs in a call, one thread does it all: waking the other
// threads (passive OpenMP waits, engine/threads.py) costs more than they would save (2-core
// EPYC: one row of 200 tokens, 3 KV heads, ~40 us alone, ~60 with the second thread woken)
constexpr int64_t kSerialWork = 2048;
constexpr int64_t kMaxDim = 256;
constexpr int64_t kMaxBlock = 128;
// blocks ahead of the one being read whose rows are prefetched meanwhile (BlockRows): from
// memory, 32 rows x 200 tokens x 30 layers took 14.3 ms with none, 8.9 with 1, 7.6-8.1 with 2,
// 7.7 with 3 (2-core Zen 5 EPYC, the blocks scattered over a 1.5 GB pool)
constexpr int64_t kAhead = 2;

// exp(x) for x <= 0 (scores minus their maximum), in plain arithmetic the compiler vectorizes:
// Cephes' expf (range reduction by ln 2, degree-6 polynomial, within 2 ulp); std::exp is a
// library call per score, which was a third of the kernel's time.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below that exp underflows: 2**-125 stands in for 0
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// `n` elements of the pool, widened to float32.
template <typename T>
inline void widen(const T* __restrict src, float* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

struct Item {
  int64_t seq, kv_head, chunk;
};

// How many of the keys [t0, t0 + n) query g attends: all of them, or those before `limit[g]`
// (a prefill chunk's causal mask: query i sees positions up to its own)
inline int64_t valid_keys(const int64_t* limit, int64_t g, int64_t t0, int64_t n) {
  return limit ? std::clamp<int64_t>(limit[g] - t0, 0, n) : n;
}

// A work item's keys [t0, t0 + n) in the pool's blocks (`table`: the sequence's blocks of bs
// slots, rows of D values), read a block at a time. Meanwhile the rows of the block kAhead
// blocks on are prefetched, one per row read (in the K pass past the chunk's end: V's first
// blocks): the blocks lie anywhere in the pool, so the hardware's prefetchers cannot see the
// next one coming, and a whole block prefetched at once was no faster (too many misses in
// flight: dropped), nor were whole items ahead.
template <typename T>
struct BlockRows {
  const int64_t* table;
  int64_t bs, t0, n, D, first, count;
  BlockRows(const int64_t* table, int64_t bs, int64_t t0, int64_t n, int64_t D)
      : table(table), bs(bs), t0(t0), n(n), D(D), first(t0 / bs),
        count((t0 + n - 1) / bs - t0 / bs + 1) {}
  // rows from position t0 + t to the end of its block or of the chunk
  int64_t rows(int64_t t) const { return std::min(bs - (t0 + t) % bs, n - t); }
  const T* row(const T* base, int64_t t) const {
    return base + (table[(t0 + t) / bs] * bs + (t0 + t) % bs) * D;
  }
  // the block to prefetch while the one at t is read (`then`: the pool read after this one)
  const char* ahead(const T* base, const T* then, int64_t t) const {
    const int64_t i = (t0 + t) / bs - first + kAhead;
    if (i < count) return reinterpret_cast<const char*>(base + table[first + i] * bs * D);
    if (then != nullptr && i - count < count)
      return reinterpret_cast<const char*>(then + table[first + i - count] * bs * D);
    return nullptr;
  }
  void prefetch_row(const char* block, int64_t r) const {
    if (block == nullptr) return;
    const int64_t bytes = D * int64_t{sizeof(T)};
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(block + r * bytes + o, 0, 3);
  }
  // widens the rows at t into `buf` by `widen_row(src, dst)`, one row each, meanwhile
  // prefetching the block ahead (`then`: the pool read after `base`); returns how many
  template <typename WidenRow>
  int64_t widen_block(const T* base, const T* then, int64_t t, float* buf,
                      const WidenRow& widen_row) const {
    const int64_t m = rows(t);
    const T* src = row(base, t);
    const char* pf = ahead(base, then, t);
    for (int64_t r = 0; r < m; ++r) {
      prefetch_row(pf, r);
      widen_row(src + r * D, buf + r * D);
    }
    return m;
  }
};

// One work item: query heads [G, D] (scaled) against tokens [t0, t1) of one sequence and one
// KV head; leaves each head's max score, sum of exp and exp-weighted V sum in `part`.
// `DIM` is the head size when known at compile time (0: `d`), so the loops over it unroll.
template <typename T, int DIM>
void attend_chunk(const float* __restrict q, const T* __restrict kh, const T* __restrict vh,
                  const int64_t* __restrict blocks, int64_t bs, int64_t t0, int64_t t1,
                  int64_t G, int64_t d_runtime, const int64_t* __restrict limit,
                  float* __restrict scores, float* __restrict buf, float* __restrict part) {
  const int64_t D = DIM ? DIM : d_runtime, n = t1 - t0, stride = D + 2;
  // scores: a block's K rows are contiguous in the pool; widen them once, then four tokens
  // at a time per head (four independent sums in flight)
  const BlockRows<T> at(blocks, bs, t0, n, D);
  const auto widen_row = [D](const T* src, float* dst) { widen(src, dst, D); };
  for (int64_t t = 0; t < n;) {
    const int64_t rows = at.widen_block(kh, vh, t, buf, widen_row);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float* sg = scores + g * kChunk + t;
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) {
        const float *k0 = buf + r * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t i = 0; i < D; ++i) {
          s0 += qg[i] * k0[i];
          s1 += qg[i] * k1[i];
          s2 += qg[i] * k2[i];
          s3 += qg[i] * k3[i];
        }
        sg[r] = s0, sg[r + 1] = s1, sg[r + 2] = s2, sg[r + 3] = s3;
      }
      for (; r < rows; ++r) {
        const float* k0 = buf + r * D;
        float s0 = 0.f;
#pragma omp simd reduction(+ : s0)
        for (int64_t i = 0; i < D; ++i) s0 += qg[i] * k0[i];
        sg[r] = s0;
      }
    }
    t += rows;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * kChunk;
    const int64_t nv = valid_keys(limit, g, t0, n);
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < nv; ++t) m = std::max(m, sg[t]);
    float l = 0.f;
#pragma omp simd reduction(+ : l)
    for (int64_t t = 0; t < nv; ++t) {
      sg[t] = exp_nonpositive(sg[t] - m);
      l += sg[t];
    }
    float* pg = part + g * stride;
    pg[0] = m, pg[1] = l;
    std::fill_n(pg + 2, D, 0.f);
  }
  // values: widen a block's V rows once, then each head's sum over them
  for (int64_t t = 0; t < n;) {
    const int64_t rows = at.widen_block(vh, nullptr, t, buf, widen_row);
    for (int64_t g = 0; g < G; ++g) {
      const float* w = scores + g * kChunk + t;
      float* __restrict acc = part + g * stride + 2;
      const int64_t used = std::min(rows, valid_keys(limit, g, t0, n) - t);
      for (int64_t r = 0; r < used; ++r) {
        const float wr = w[r];
        const float* vr = buf + r * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) acc[i] += wr * vr[i];
      }
    }
    t += rows;
  }
}

#if defined(__AVX512F__)
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
  for (int64_t t = 0; t < n;) {
    const int64_t rows = widen_block(vh, nullptr, t);
    for (int64_t g = 0; g < G; ++g) {
      const float* w = scores + g * kChunk + t;
      float* acc = part + g * stride + 2;
      const int64_t used = std::min(rows, valid_keys(limit, g, t0, n) - t);
      if (used <= 0) continue;
      __m512 a[NV];
      for (int j = 0; j < NV; ++j) a[j] = _mm512_loadu_ps(acc + 16 * j);
      for (int64_t r = 0; r < used; ++r) {
        const __m512 wr = _mm512_set1_ps(w[r]);
        for (int j = 0; j < NV; ++j)
          a[j] = _mm512_fmadd_ps(wr, _mm512_loadu_ps(buf + r * DIM + 16 * j), a[j]);
      }
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + 16 * j, a[j]);
    }
    t += rows;
  }
}
#endif

// One work item on the best loop this CPU and head size have
template <typename T>
void attend(const float* q, const T* kh, const T* vh, const int64_t* blocks, int64_t bs,
            int64_t t0, int64_t t1, int64_t G, int64_t D, const int64_t* limit, float* scores,
            float* buf, float* part) {
#if defined(__AVX512F__)
  if (D == 64)
    return attend_chunk_avx512<T, 64>(q, kh, vh, blocks, bs, t0, t1, G, limit, scores, buf,
                                      part);
  if (D == 128)
    return attend_chunk_avx512<T, 128>(q, kh, vh, blocks, bs, t0, t1, G, limit, scores, buf,
                                       part);
#endif
  if (D == 64)
    return attend_chunk<T, 64>(q, kh, vh, blocks, bs, t0, t1, G, D, limit, scores, buf, part);
  if (D == 128)
    return attend_chunk<T, 128>(q, kh, vh, blocks, bs, t0, t1, G, D, limit, scores, buf, part);
  attend_chunk<T, 0>(q, kh, vh, blocks, bs, t0, t1, G, D, limit, scores, buf, part);
}

// One query's output from its `chunks` partials (max, sum of exp, V sums; `step` floats
// apart), merged in chunk order
inline void merge(const float* p0, int64_t chunks, int64_t step, int64_t D, float* o) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < chunks; ++c) m = std::max(m, p0[c * step]);
  float l = 0.f;
  std::fill_n(o, D, 0.f);
  for (int64_t c = 0; c < chunks; ++c) {
    const float* pc = p0 + c * step;
    const float w = std::exp(pc[0] - m);
    l += pc[1] * w;
    for (int64_t d = 0; d < D; ++d) o[d] += pc[2 + d] * w;
  }
  for (int64_t d = 0; d < D; ++d) o[d] /= l;
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
         const std::vector<int64_t>& lens, int64_t bs, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t HKV = kc.size(0), S = kc.size(1), G = H / HKV, NB = table.size(1);
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* tp = table.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  // the queries, scaled once
  std::vector<float> qs(q.data_ptr<float>(), q.data_ptr<float>() + B * H * D);
  for (auto& x : qs) x *= static_cast<float>(scale);

  std::vector<Item> items;
  std::vector<int64_t> first(B + 1);  // each sequence's first item
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) {
    work += lens[b] * HKV;
    first[b] = static_cast<int64_t>(items.size());
    const int64_t chunks = (lens[b] + kChunk - 1) / kChunk;
    for (int64_t h = 0; h < HKV; ++h)
      for (int64_t c = 0; c < chunks; ++c) items.push_back({b, h, c});
  }
  first[B] = static_cast<int64_t>(items.size());
  // per item and query head of its group: the chunk's max score, sum of exp, weighted V sum
  const int64_t stride = D + 2;
  std::vector<float> part(items.size() * G * stride);

  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, n_items, work < kSerialWork ? n_items + 1 : 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(G * kChunk), buf(kMaxBlock * D);
    for (int64_t i = lo; i < hi; ++i) {
      const Item it = items[i];
      const int64_t t0 = it.chunk * kChunk, t1 = std::min(lens[it.seq], t0 + kChunk);
      const float* qg = qs.data() + (it.seq * H + it.kv_head * G) * D;
      const T* kh = kp + it.kv_head * S * D;
      const T* vh = vp + it.kv_head * S * D;
      const int64_t* blocks = tp + it.seq * NB;
      float* pi = part.data() + i * G * stride;
      attend<T>(qg, kh, vh, blocks, bs, t0, t1, G, D, nullptr, scores.data(), buf.data(), pi);
    }
  });

  // merge each query head's chunks, in chunk order
  for (int64_t b = 0; b < B; ++b) {
    const int64_t chunks = (first[b + 1] - first[b]) / HKV;
    for (int64_t h = 0; h < HKV; ++h) {
      for (int64_t g = 0; g < G; ++g)
        merge(part.data() + ((first[b] + h * chunks) * G + g) * stride, chunks, G * stride, D,
              op + (b * H + h * G + g) * D);
    }
  }
}

// A prefill chunk of n tokens at positions [start, start + n) of one sequence whose K/V (the
// cached ones and the chunk's own) are in the pool. A work item takes the G query vectors of
// up to kQueryTile tokens at once (a block's K and V rows widened once for all of them); query
// i attends positions up to start + i. Every query's chunks, sums and merge are those of a
// decode of the same token at the same context, so its output is bitwise the decode kernel's.
template <typename T>
void run_prefill(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                 const int64_t* blocks, int64_t start, int64_t bs, double scale, at::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t HKV = kc.size(0), S = kc.size(1), G = H / HKV, M = n * G;
  const int64_t len = start + n, chunks = (len + kChunk - 1) / kChunk, stride = D + 2;
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const float* qp = q.data_ptr<float>();
  // per KV head its M = n x G query vectors (m = i * G + g), scaled once, and their limits
  std::vector<float> qs(HKV * M * D);
  std::vector<int64_t> limit(M);
  for (int64_t m = 0; m < M; ++m) limit[m] = start + m / G + 1;
  for (int64_t h = 0; h < HKV; ++h)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const float* src = qp + (i * H + h * G + g) * D;
        float* dst = qs.data() + (h * M + i * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * static_cast<float>(scale);
      }
  // work items: (KV head, chunk of keys, tile of kQueryTile tokens' queries), but none for a
  // chunk that starts after all of its tile's queries' positions
  struct PrefillItem {
    int64_t h, t0, m0, m1;
  };
  std::vector<PrefillItem> items;
  for (int64_t h = 0; h < HKV; ++h)
    for (int64_t t0 = 0; t0 < len; t0 += kChunk)
      for (int64_t i0 = 0; i0 < n; i0 += kQueryTile) {
        const int64_t i1 = std::min(n, i0 + kQueryTile);
        if (t0 < start + i1) items.push_back({h, t0, i0 * G, i1 * G});
      }
  std::vector<float> part(HKV * chunks * M * stride);
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, n_items, len * HKV < kSerialWork ? n_items + 1 : 1, [&](int64_t lo,
                                                                              int64_t hi) {
    std::vector<float> scores(kQueryTile * G * kChunk), buf(kMaxBlock * D);
    for (int64_t i = lo; i < hi; ++i) {
      const PrefillItem it = items[i];
      float* pi = part.data() + ((it.h * chunks + it.t0 / kChunk) * M + it.m0) * stride;
      attend<T>(qs.data() + (it.h * M + it.m0) * D, kp + it.h * S * D, vp + it.h * S * D, blocks,
                bs, it.t0, std::min(len, it.t0 + kChunk), it.m1 - it.m0, D,
                limit.data() + it.m0, scores.data(), buf.data(), pi);
    }
  });
  float* op = out.data_ptr<float>();
  for (int64_t h = 0; h < HKV; ++h)
    for (int64_t m = 0; m < M; ++m)
      merge(part.data() + (h * chunks * M + m) * stride, (limit[m] + kChunk - 1) / kChunk,
            M * stride, D, op + ((m / G) * H + h * G + m % G) * D);
}

}  // namespace

namespace crowdchat {

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, int64_t block_size,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q: contiguous float32 [B, H, D]");
  check_pool(k_cache, v_cache);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), HKV = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == D && D <= kMaxDim && H % HKV == 0, "head shapes differ");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == B &&
                  block_table.scalar_type() == at::kLong && block_table.is_contiguous(),
              "block_table: contiguous int64 [B, blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == B &&
                  context_lens.scalar_type() == at::kLong,
              "context_lens: int64 [B]");
  TORCH_CHECK(block_size > 0 && block_size <= kMaxBlock && k_cache.size(1) % block_size == 0,
              "block_size");
  const int64_t pool_blocks = k_cache.size(1) / block_size, NB = block_table.size(1);
  const auto lens_t = context_lens.contiguous();
  std::vector<int64_t> lens(lens_t.data_ptr<int64_t>(), lens_t.data_ptr<int64_t>() + B);
  const int64_t* tp = block_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] > 0 && lens[b] <= NB * block_size, "context length out of range");
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(tp[b * NB + j] >= 0 && tp[b * NB + j] < pool_blocks, "block id out of range");
  }
  auto out = at::empty({B, H, D}, q.options());
  with_pool_type(k_cache.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    run<T>(q, k_cache, v_cache, block_table, lens, block_size, scale, out);
  });
  return out;
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& blocks,
                                   int64_t start, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.size(0),
              "q: contiguous float32 [n, H, D], n >= 1");
  check_pool(k_cache, v_cache);
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), HKV = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == D && D <= kMaxDim && H % HKV == 0, "head shapes differ");
  TORCH_CHECK(blocks.dim() == 1 && blocks.scalar_type() == at::kLong && blocks.is_contiguous(),
              "blocks: contiguous int64 [blocks]");
  TORCH_CHECK(block_size > 0 && block_size <= kMaxBlock && k_cache.size(1) % block_size == 0,
              "block_size");
  const int64_t pool_blocks = k_cache.size(1) / block_size, len = start + n;
  TORCH_CHECK(start >= 0 && len <= blocks.size(0) * block_size, "start out of range");
  const int64_t* bp = blocks.data_ptr<int64_t>();
  for (int64_t j = 0; j < (len + block_size - 1) / block_size; ++j)
    TORCH_CHECK(bp[j] >= 0 && bp[j] < pool_blocks, "block id out of range");
  auto out = at::empty({n, H, D}, q.options());
  with_pool_type(k_cache.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    run_prefill<T>(q, k_cache, v_cache, bp, start, block_size, scale, out);
  });
  return out;
}

}  // namespace crowdchat

TORCH_LIBRARY(crowdchat, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor context_lens, int block_size, float scale) -> Tensor");
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, "
      "int start, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(crowdchat, CPU, m) {
  m.impl("paged_decode_attention", &crowdchat::paged_decode_attention);
  m.impl("paged_prefill_attention", &crowdchat::paged_prefill_attention);
}

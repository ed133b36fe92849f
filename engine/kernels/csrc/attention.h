// What the paged attention loops share (paged_decode.cpp and its per-ISA loops): the work item
// sizes, the exp and multiply-add every loop rounds alike, and BlockRows, the reader of a work
// item's blocks.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace crowdchat_attention {

constexpr int64_t kChunk = 512;  // tokens per work item
constexpr int64_t kQueryTile = 16;  // a prefill chunk's tokens per work item
// below this many (query, key) pairs x KV heads in a call, one thread does it all: waking the
// other threads (passive OpenMP waits, engine/threads.py) costs more than they would save
// (2-core EPYC: one row of 200 tokens, 3 KV heads, ~40 us alone, ~60 with the second woken)
constexpr int64_t kSerialWork = 2048;
constexpr int64_t kMaxDim = 256;
constexpr int64_t kMaxBlock = 128;
// blocks ahead of the one being read whose rows are prefetched meanwhile (BlockRows): from
// memory, 32 rows x 200 tokens x 30 layers took 14.3 ms with none, 8.9 with 1, 7.6-8.1 with 2,
// 7.7 with 3 (2-core Zen 5 EPYC, the blocks scattered over a 1.5 GB pool)
constexpr int64_t kAhead = 2;

// a + b * c, fused where the hardware has a fused multiply-add: written out, because whether
// the compiler fuses `a += b * c` itself depends on its tuning (GCC's Zen tunings leave
// accumulation chains unfused in some loops, fuse them in others), so two loops computing
// the same sum could round it differently
inline float madd(float a, float b, float c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return std::fma(b, c, a);
#else
  return a + b * c;
#endif
}

// exp(x) for x <= 0 (scores minus their maximum), in plain arithmetic the compiler vectorizes:
// Cephes' expf (range reduction by ln 2, degree-6 polynomial, within 2 ulp); std::exp is a
// library call per score, which was a third of the kernel's time.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below that exp underflows: 2**-125 stands in for 0
  const float n = std::floor(madd(0.5f, x, 1.44269504088896341f));
  const float r = madd(madd(x, n, -0.693359375f), n, 2.12194440e-4f);
  float p = 1.9875691500e-4f;
  p = madd(1.3981999507e-3f, p, r);
  p = madd(8.3334519073e-3f, p, r);
  p = madd(4.1665795894e-2f, p, r);
  p = madd(1.6666665459e-1f, p, r);
  p = madd(5.0000001201e-1f, p, r);
  const float y = madd(r, p * r, r) + 1.0f;
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

// The generic loop's sums are taken in kLanes explicit lanes, then one fixed tree: a sum's
// rounding is then the source's, whatever the compiler vectorizes. `omp simd reduction` let it
// reorder them, and it did so differently for the 4-row and 1-row loops and the exp sums of
// different lengths per -march tuning: on Zen 3 (`-march=znver3`) a prefill chunk's scores
// differed from the decode of the same token in the last bit.
constexpr int kLanes = 8;
using Lanes = std::array<float, kLanes>;

inline float sum(const Lanes& a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// x[0] + ... + x[n - 1], in lanes
inline float lane_sum(const float* __restrict x, int64_t n) {
  Lanes a{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) a[j] += x[i + j];
  for (; i < n; ++i) a[i % kLanes] += x[i];
  return sum(a);
}

// q . k over D values
inline float dot(const float* __restrict q, const float* __restrict k, int64_t D) {
  Lanes a{};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes)
    for (int j = 0; j < kLanes; ++j) a[j] = madd(a[j], q[i + j], k[i + j]);
  for (; i < D; ++i) a[i % kLanes] = madd(a[i % kLanes], q[i], k[i]);
  return sum(a);
}

// dot(q, k + r * D, D) for r < 4, four sums in flight: each one's steps are dot's
inline void dot4(const float* __restrict q, const float* __restrict k, int64_t D,
                 float* __restrict out) {
  Lanes a[4] = {};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes)
    for (int r = 0; r < 4; ++r)
      for (int j = 0; j < kLanes; ++j) a[r][j] = madd(a[r][j], q[i + j], k[r * D + i + j]);
  for (; i < D; ++i)
    for (int r = 0; r < 4; ++r) a[r][i % kLanes] = madd(a[r][i % kLanes], q[i], k[r * D + i]);
  for (int r = 0; r < 4; ++r) out[r] = sum(a[r]);
}

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

}  // namespace crowdchat_attention

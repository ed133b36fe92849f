// Decode attention read straight from the paged KV pool, on the CPU (engine/cpu_kernels.py).
//
// One query token per sequence against its own cached tokens: the K/V rows are read from their
// blocks where they lie, widened to float32 in registers, and never copied into a padded dense
// tensor. Work items are (sequence, KV head, chunk of kChunk tokens); a sequence's chunks are
// merged with their softmax maxima and sums (as flash-decoding does). How a sequence is split
// depends on its own length only, so its output is the same whatever else is in the batch.
// A work item runs on the loop of this build's instruction set and head size: AVX-512
// (attention_avx512.h), AVX2 (attention_avx2.h), else the plain C++ one here; each takes its
// sums in an order of its source's, so a prefill chunk's query is bitwise its token's decode.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "attention.h"
#include "attention_avx2.h"
#include "attention_avx512.h"
#include "kernels.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace crowdchat_attention;

struct Item {
  int64_t seq, kv_head, chunk;
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
      for (; r + 4 <= rows; r += 4) dot4(qg, buf + r * D, D, sg + r);
      for (; r < rows; ++r) sg[r] = dot(qg, buf + r * D, D);
    }
    t += rows;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * kChunk;
    const int64_t nv = valid_keys(limit, g, t0, n);
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < nv; ++t) m = std::max(m, sg[t]);
#pragma omp simd
    for (int64_t t = 0; t < nv; ++t) sg[t] = exp_nonpositive(sg[t] - m);
    float* pg = part + g * stride;
    pg[0] = m, pg[1] = lane_sum(sg, nv);
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
        for (int64_t i = 0; i < D; ++i) acc[i] = madd(acc[i], wr, vr[i]);
      }
    }
    t += rows;
  }
}

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
#elif defined(CROWDCHAT_ATTENTION_AVX2)
  if (D == 64)
    return attend_chunk_avx2<T, 64>(q, kh, vh, blocks, bs, t0, t1, G, limit, scores, buf, part);
  if (D == 128)
    return attend_chunk_avx2<T, 128>(q, kh, vh, blocks, bs, t0, t1, G, limit, scores, buf, part);
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
    l = madd(l, pc[1], w);
    for (int64_t d = 0; d < D; ++d) o[d] = madd(o[d], pc[2 + d], w);
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

// Prefill chunks of one step, chunk c: n_c tokens at positions [start_c, start_c + n_c) of its
// sequence, whose K/V (the cached ones and the chunk's own) are in the pool; its queries are
// rows [row_c, row_c + n_c) of q, the chunks' rows one after another. A work item takes the G
// query vectors of up to kQueryTile tokens of one chunk at once (a block's K and V rows
// widened once for all of them); query i attends positions up to start_c + i. Every query's
// chunks, sums and merge are those of a decode of the same token at the same context, so its
// output is bitwise the decode kernel's, whichever chunks share the call.
template <typename T>
void run_prefill(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                 const int64_t* blocks, int64_t blocks_stride, const std::vector<int64_t>& starts,
                 const std::vector<int64_t>& sizes, int64_t bs, double scale, at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2), stride = D + 2;
  const int64_t HKV = kc.size(0), S = kc.size(1), G = H / HKV;
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const float* qp = q.data_ptr<float>();
  struct Chunk {
    int64_t row, n, start, len, key_chunks, M, qs, limit, part;
  };
  std::vector<Chunk> chunks;
  int64_t row = 0, qs_size = 0, limit_size = 0, part_size = 0, work = 0;
  for (size_t c = 0; c < starts.size(); ++c) {
    const int64_t n = sizes[c], start = starts[c], len = start + n, M = n * G;
    const int64_t key_chunks = (len + kChunk - 1) / kChunk;
    chunks.push_back({row, n, start, len, key_chunks, M, qs_size, limit_size, part_size});
    row += n, qs_size += HKV * M * D, limit_size += M, part_size += HKV * key_chunks * M * stride;
    // (query, key) pairs x KV heads, as the decode kernel counts its rows' (the chunk's length
    // alone counted one query: 30 tokens after 100 ran on one thread, 141 us a call on the
    // Sapphire Rapids VM against 86-93 on two)
    work += (n * start + n * (n + 1) / 2) * HKV;
  }
  // per chunk and KV head its M = n x G query vectors (m = i * G + g), scaled once, and their
  // limits
  std::vector<float> qs(qs_size);
  std::vector<int64_t> limit(limit_size);
  for (const Chunk& ch : chunks) {
    for (int64_t m = 0; m < ch.M; ++m) limit[ch.limit + m] = ch.start + m / G + 1;
    for (int64_t h = 0; h < HKV; ++h)
      for (int64_t i = 0; i < ch.n; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const float* src = qp + ((ch.row + i) * H + h * G + g) * D;
          float* dst = qs.data() + ch.qs + (h * ch.M + i * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * static_cast<float>(scale);
        }
  }
  // work items: (chunk, KV head, chunk of keys, tile of kQueryTile tokens' queries), but none
  // for a chunk of keys that starts after all of its tile's queries' positions
  struct PrefillItem {
    int64_t c, h, t0, m0, m1;
  };
  std::vector<PrefillItem> items;
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    const Chunk& ch = chunks[c];
    for (int64_t h = 0; h < HKV; ++h)
      for (int64_t t0 = 0; t0 < ch.len; t0 += kChunk)
        for (int64_t i0 = 0; i0 < ch.n; i0 += kQueryTile) {
          const int64_t i1 = std::min(ch.n, i0 + kQueryTile);
          if (t0 < ch.start + i1) items.push_back({c, h, t0, i0 * G, i1 * G});
        }
  }
  std::vector<float> part(part_size);
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, n_items, work < kSerialWork ? n_items + 1 : 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(kQueryTile * G * kChunk), buf(kMaxBlock * D);
    for (int64_t i = lo; i < hi; ++i) {
      const PrefillItem it = items[i];
      const Chunk& ch = chunks[it.c];
      const int64_t key_chunk = it.h * ch.key_chunks + it.t0 / kChunk;
      float* pi = part.data() + ch.part + (key_chunk * ch.M + it.m0) * stride;
      attend<T>(qs.data() + ch.qs + (it.h * ch.M + it.m0) * D, kp + it.h * S * D,
                vp + it.h * S * D, blocks + it.c * blocks_stride, bs, it.t0,
                std::min(ch.len, it.t0 + kChunk), it.m1 - it.m0, D,
                limit.data() + ch.limit + it.m0, scores.data(), buf.data(), pi);
    }
  });
  float* op = out.data_ptr<float>();
  for (const Chunk& ch : chunks)
    for (int64_t h = 0; h < HKV; ++h)
      for (int64_t m = 0; m < ch.M; ++m)
        merge(part.data() + ch.part + (h * ch.key_chunks * ch.M + m) * stride,
              (limit[ch.limit + m] + kChunk - 1) / kChunk, ch.M * stride, D,
              op + ((ch.row + m / G) * H + h * G + m % G) * D);
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

// Prefill chunks' attention in one call: q [R, H, D], chunk c its sizes[c] rows after the rows
// of the chunks before it, after starts[c] tokens of its sequence, whose blocks are row c of
// `blocks` [C, NB].
at::Tensor paged_prefills_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, const at::Tensor& blocks,
                                    const at::Tensor& starts, const at::Tensor& sizes,
                                    int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.size(0),
              "q: contiguous float32 [n, H, D], n >= 1");
  check_pool(k_cache, v_cache);
  const int64_t H = q.size(1), D = q.size(2), HKV = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == D && D <= kMaxDim && H % HKV == 0, "head shapes differ");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kLong && blocks.is_contiguous(),
              "blocks: contiguous int64 [chunks, blocks]");
  const int64_t C = blocks.size(0), NB = blocks.size(1);
  TORCH_CHECK(starts.dim() == 1 && sizes.dim() == 1 && starts.size(0) == C &&
                  sizes.size(0) == C && starts.scalar_type() == at::kLong &&
                  sizes.scalar_type() == at::kLong,
              "starts, sizes: int64 [chunks]");
  TORCH_CHECK(block_size > 0 && block_size <= kMaxBlock && k_cache.size(1) % block_size == 0,
              "block_size");
  const auto st = starts.contiguous(), sz = sizes.contiguous();
  std::vector<int64_t> s0(st.data_ptr<int64_t>(), st.data_ptr<int64_t>() + C);
  std::vector<int64_t> n(sz.data_ptr<int64_t>(), sz.data_ptr<int64_t>() + C);
  const int64_t pool_blocks = k_cache.size(1) / block_size;
  const int64_t* bp = blocks.data_ptr<int64_t>();
  int64_t rows = 0;
  for (int64_t c = 0; c < C; ++c) {
    TORCH_CHECK(n[c] >= 1, "sizes: each chunk n >= 1");
    const int64_t len = s0[c] + n[c];
    TORCH_CHECK(s0[c] >= 0 && len <= NB * block_size, "start out of range");
    for (int64_t j = 0; j < (len + block_size - 1) / block_size; ++j)
      TORCH_CHECK(bp[c * NB + j] >= 0 && bp[c * NB + j] < pool_blocks, "block id out of range");
    rows += n[c];
  }
  TORCH_CHECK(rows == q.size(0), "sizes: they add up to q's rows");
  auto out = at::empty({rows, H, D}, q.options());
  with_pool_type(k_cache.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    run_prefill<T>(q, k_cache, v_cache, bp, NB, s0, n, block_size, scale, out);
  });
  return out;
}

// One chunk of n tokens after `start` tokens of its sequence (blocks [NB]).
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& blocks,
                                   int64_t start, int64_t block_size, double scale) {
  TORCH_CHECK(blocks.dim() == 1 && blocks.scalar_type() == at::kLong && blocks.is_contiguous(),
              "blocks: contiguous int64 [blocks]");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.size(0),
              "q: contiguous float32 [n, H, D], n >= 1");
  const auto one = [](int64_t v) { return at::full({1}, v, at::kLong); };
  return paged_prefills_attention(q, k_cache, v_cache, blocks.view({1, -1}), one(start),
                                  one(q.size(0)), block_size, scale);
}

}  // namespace crowdchat

TORCH_LIBRARY(crowdchat, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor context_lens, int block_size, float scale) -> Tensor");
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, "
      "int start, int block_size, float scale) -> Tensor");
  m.def(
      "paged_prefills_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, "
      "Tensor starts, Tensor sizes, int block_size, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(crowdchat, CPU, m) {
  m.impl("paged_decode_attention", &crowdchat::paged_decode_attention);
  m.impl("paged_prefill_attention", &crowdchat::paged_prefill_attention);
  m.impl("paged_prefills_attention", &crowdchat::paged_prefills_attention);
}

// crowdchat's CPU kernels as C++ functions (each registered as `torch.ops.crowdchat.<name>` in
// its own file), for the ops that call others without the dispatcher (decode_layer.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace crowdchat {

// The 4-bit weights' group along K (engine/model/cpu_quant.py GROUP_SIZE), also the groups
// x is rounded to int8 in
constexpr int64_t kGroup = 32;

// Below this many weights x rows in a matmul call, one thread does it all: waking the other
// threads (passive OpenMP waits, engine/threads.py) costs more than they would save: on the
// 2-core EPYC one row through 576 x 576 or 576 x 1536 weights was faster alone, 3072 x 576 was
// not
constexpr int64_t kMatmulSerialWork = int64_t{1} << 20;

// f(std::integral_constant<int, R>{}) for R = `rows`, 1 to Max (more than Max: Max)
template <int Max, int R = 1, typename F>
inline void with_rows(int64_t rows, const F& f) {
  if constexpr (R == Max) {
    f(std::integral_constant<int, R>{});
  } else if (rows == R) {
    f(std::integral_constant<int, R>{});
  } else {
    with_rows<Max, R + 1>(rows, f);
  }
}

struct NoStart {
  void operator()(int64_t) const {}
};

// Runs a thread's share of over_blocks as it is (another `around` sets up and releases
// per-thread state, such as AMX's tile configuration, once per share)
struct Plain {
  template <typename F>
  void operator()(const F& f) const {
    f();
  }
};

// A share of a matmul's blocks of output columns for one thread: blocks [b0, b1); `all()`:
// every block, split over the threads by over_blocks
struct BlockShare {
  int64_t b0 = -1, b1 = -1;
  static BlockShare all() { return {}; }
  bool whole() const { return b0 < 0; }
  // share `part` of `parts` of `blocks`, whole blocks each
  static BlockShare of(int64_t blocks, int64_t part, int64_t parts) {
    return {blocks * part / parts, blocks * (part + 1) / parts};
  }
};

// The matmul kernels' loop: calls `tile(rows, b, r0)` (`rows` a std::integral_constant, 1 to
// Rows) for every block b of output columns and every Rows rows of x [m, K] from r0. Each
// thread takes a range of blocks; per chunk of `chunk` rows it calls `start(b)` once, then a
// block's weights (a few KB) are read from memory once and reused from L1 by every tile.
// `work` (weights x rows) below kMatmulSerialWork: one thread. Each thread's share runs inside
// `around(share)`. With a `share` other than `all()`: only its blocks, on the calling thread
// (a thread of a parallel region that splits the columns itself, decode_layer.cpp).
template <int Rows, typename Tile, typename Start = NoStart, typename Around = Plain>
void over_blocks(int64_t m, int64_t blocks, int64_t chunk, int64_t work, const Tile& tile,
                 const Start& start = Start{}, const Around& around = Around{},
                 BlockShare share = BlockShare::all()) {
  const auto blocks_of = [&](int64_t b0, int64_t b1) {
    around([&] {
      for (int64_t c0 = 0; c0 < m; c0 += chunk) {
        const int64_t c1 = std::min(m, c0 + chunk);
        for (int64_t b = b0; b < b1; ++b) {
          start(b);
          for (int64_t r0 = c0; r0 < c1; r0 += Rows) {
            with_rows<Rows>(c1 - r0, [&](auto rows) { tile(rows, b, r0); });
          }
        }
      }
    });
  };
  if (!share.whole()) return blocks_of(share.b0, share.b1);
  const int64_t grain = work < kMatmulSerialWork ? blocks + 1 : 1;
  at::parallel_for(0, blocks, grain, blocks_of);
}

// A float32 rounded to bfloat16 (to nearest even) and kept as float32, bitwise as ATen's
// `x.to(torch.bfloat16).to(torch.float32)`; a NaN becomes 0xffff, as in ATen's vectorized cast
inline float bf16_rounded(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  u = nan ? 0xffff0000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// The KV pool of one layer, as rope_store writes it and paged_decode_attention reads it
inline void check_pool(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache, v_cache: contiguous [H_kv, slots, D], one dtype");
}

// f(T{}) with T the pool's element type: float, c10::BFloat16 or c10::Half
template <class F>
void with_pool_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    default:
      TORCH_CHECK(false, "KV pool dtype must be float32, bfloat16 or float16");
  }
}

// csrc/elementwise.cpp: float32 rounded to bfloat16 and back (as ATen's casts), out of place or
// in place; SiLU of the gate times up, [T, I] each (rows contiguous) -> [T, I]
at::Tensor round_to_bf16(const at::Tensor& x);
at::Tensor& round_to_bf16_(at::Tensor& x);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

// csrc/paged_decode.cpp: q [B, H, D] float32 against each row's blocks of the pool -> [B, H, D]
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, int64_t block_size,
                                  double scale);

// csrc/q4_linear.cpp: x [M, K] float32 times the 4-bit weights' transpose -> [M, N]
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed,
                     const at::Tensor& scales_zeros);

// csrc/q8_avx2.cpp (AVX2 and FMA builds): x rounded to int8 per group of 32 times the 4-bit
// weights' transpose (packed uint8 [N/8, K/32, 128], bfloat16 scales and zeros [N/8, K/32,
// 16]) or the int8 weights' (packed int8 [N/8, K/4, 32], float32 scales [N]); `q8_avx2`:
// whether this build has them (elsewhere they refuse)
at::Tensor q4_linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz);
void q4_linear_q8_into(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                       at::Tensor& y, BlockShare share);
// csrc/q4_linear.cpp: whether `q4_linear_share` takes these weights (the int8-activation
// layouts: AVX512-VNNI's, AVX2's), and `q4_linear` of x for the output columns of share
// `part` of `parts` of the weights' blocks, on the calling thread only, written into y ([M, N]
// float32, contiguous; the other columns untouched): each column's values are `q4_linear`'s,
// bitwise
bool q4_linear_shares(const at::Tensor& packed, const at::Tensor& sz);
void q4_linear_share(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                     int64_t part, int64_t parts, at::Tensor& y);
at::Tensor int8_linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales);
bool q8_avx2();

// csrc/rms_norm.cpp: float32 RMSNorm of the last dimension, as transformers' Llama computes it
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// csrc/rope_store.cpp: RoPE on the fused q/k/v output, K/V into the pool -> roped q [T, H, D]
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
                      int64_t heads, int64_t kv_heads);

}  // namespace crowdchat

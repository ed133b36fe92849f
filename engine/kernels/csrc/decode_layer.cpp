// One decoder layer of a decode step on the 4-bit kernel, in one call (engine/lean_llama.py
// `_decodes`, up to 4 rows where compute is float32).
//
// From Python the layer was ~14 calls (two norms, four projections, RoPE with the K/V write,
// attention, two residual adds, SiLU and its product, slicing), each with its Python and its
// turn at the GIL: at one row that overhead was a fifth of the step on the 2-core EPYC. Here the
// same kernels are called as C++ functions (csrc/kernels.h), SiLU by ATen as in Python, and the
// residual adds are plain float32 operations, each rounded as ATen rounds them: the layer's
// output, the keys and the values are bitwise those of the Python loop (tests/test_lean_llama.py).
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels.h"

namespace {

// a + b for contiguous float32 tensors of one shape, into `out` (a new tensor if undefined)
at::Tensor plus(const at::Tensor& a, const at::Tensor& b, at::Tensor out = {}) {
  if (!out.defined()) out = at::empty_like(a);
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < a.numel(); ++i) op[i] = ap[i] + bp[i];
  return out;
}

// `decode_stack` splits each matmul's output columns over the threads (set_shared_decode) up
// to kSharedRows rows a thread. A decode step at context 100 on the 2-core Sapphire Rapids
// VM, two alternating runs, the rows split against the columns: 1 / 2 / 4 / 8 / 16 / 32 / 64
// rows 10.3-11.0 / 9.0-9.2 / 11.2-11.9 / 13.7-14.3 / 18.1-18.6 / 26.6-27.2 / 45.6-46.6 ms
// against 6.3-6.5 / 7.6 / 8.9-10.5 / 11.5-12.3 / 17.6-18.2 / 27.3-28.9 / 52.0-52.6. Past 16 rows
// a thread (32 rows, 16 a thread) the 4-bit kernel costs no less a row for more rows, and the
// row split's weights are shared through L3 anyway
constexpr int64_t kSharedRows = 8;
std::atomic<bool> shared_wanted{true};

// A barrier for the threads of one parallel region, between the phases of a decode step. It
// spins: OpenMP's own barriers with passive waits (engine/threads.py) put a waiting thread to
// sleep, and waking a halted vCPU cost tens of microseconds on the VMs measured, where a
// spinning pair crossed this one in ~0.25 us (2-core Sapphire Rapids VM). After kSpins it
// yields (a thread of the team preempted); `abort` lets every waiter go (an error in a phase).
class SpinBarrier {
 public:
  void reset(int n) { n_ = n; }
  // false once aborted
  bool wait() {
    const int gen = gen_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      gen_.store(gen + 1, std::memory_order_release);
    } else {
      for (int64_t spins = 0; gen_.load(std::memory_order_acquire) == gen; ++spins) {
        if (aborted_.load(std::memory_order_relaxed)) return false;
        if (spins < kSpins) {
          __builtin_ia32_pause();
        } else {
          std::this_thread::yield();
        }
      }
    }
    return !aborted_.load(std::memory_order_relaxed);
  }
  void abort() { aborted_.store(true); }

 private:
  static constexpr int64_t kSpins = int64_t{1} << 12;
  int n_ = 1;
  std::atomic<int> arrived_{0}, gen_{0};
  std::atomic<bool> aborted_{false};
};

}  // namespace

namespace crowdchat {

// h [T, C] float32; weights: the first norm's weight, q/k/v's (fused) packed and scales_zeros,
// o's, the second norm's weight, gate/up's (fused), down's; the rest as rope_store and
// paged_decode_attention take them. Returns the layer's output [T, C].
at::Tensor decode_layer(const at::Tensor& h, at::TensorList weights, double eps,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                        at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& blocks,
                        const at::Tensor& lens, int64_t block_size, double scale, int64_t heads,
                        int64_t kv_heads) {
  TORCH_CHECK(weights.size() == 10, "weights: 10 tensors");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(),
              "h: contiguous float32 [T, C]");
  const auto& w = weights;
  const int64_t t = h.size(0);
  auto x = rms_norm(h, w[0], eps);
  const auto q = rope_store(q4_linear(x, w[1], w[2]), cos, sin, k_cache, v_cache, slots, heads,
                            kv_heads);
  const auto o = paged_decode_attention(q, k_cache, v_cache, blocks, lens, block_size, scale);
  const auto attended = plus(h, q4_linear(o.view({t, -1}), w[3], w[4]));
  x = rms_norm(attended, w[5], eps);
  const auto gate_up = q4_linear(x, w[6], w[7]);  // [T, 2 I]: gate's outputs, then up's
  const int64_t inner = gate_up.size(1) / 2;
  const auto product = silu_mul(gate_up.narrow(1, 0, inner), gate_up.narrow(1, inner, inner));
  return plus(attended, q4_linear(product, w[8], w[9]));
}

// `decode_stack` with every matmul's output columns split over the threads instead of the
// rows: each thread computes all the rows for its share of a layer's weights, so the weights
// stream from memory once a step, not once a thread, and a block's unpacked weights serve
// every row (on AMX two tiles of 16 where the row split gave each thread one). The row-wise
// phases between the matmuls (norms, residual adds, SiLU x up) take contiguous ranges of
// rows, RoPE with the K/V write and the attention take rows t, t + n, ... (the rows come
// sorted by context length); spin barriers separate the phases, 7 a layer, in one parallel
// region a step. One row's step runs its matmuls on both cores too. Each value is computed by
// the same kernel on the same row as in the row split (the kernels are batch-invariant), so
// the output is the same, bitwise. Weights in the int8-activation layouts only
// (`q4_linear_shares`).
at::Tensor decode_stack_shared(const at::Tensor& h, at::TensorList weights, double eps,
                               const at::Tensor& cos, const at::Tensor& sin,
                               at::TensorList k_caches, at::TensorList v_caches,
                               const at::Tensor& slots, const at::Tensor& blocks,
                               const at::Tensor& lens, int64_t block_size, double scale,
                               int64_t heads, int64_t kv_heads, bool prompt = false) {
  const auto layers = static_cast<int64_t>(k_caches.size());
  const int64_t t = h.size(0), c = h.size(1), d = k_caches[0].size(2);
  const auto opts = h.options();
  auto cur = h.contiguous().clone();  // the residual stream
  auto x = at::empty({t, c}, opts);  // the normed rows a matmul takes
  // the MLP's inner size: down's K (packed [N/16 or N/8, K/32, ...] in both layouts)
  const int64_t inner = weights[8].size(1) * kGroup;
  auto qkv = at::empty({t, (heads + 2 * kv_heads) * d}, opts);
  auto o = at::empty({t, heads * d}, opts);
  auto attn = at::empty({t, c}, opts);
  auto attended = at::empty({t, c}, opts);
  auto gate_up = at::empty({t, 2 * inner}, opts);
  auto product = at::empty({t, inner}, opts);
  auto down = at::empty({t, c}, opts);
  SpinBarrier barrier;
  std::exception_ptr error;
  std::mutex error_lock;
  const int team = std::max(1, at::get_num_threads());
  const at::ThreadLocalState state;  // the caller's (inference mode, ...), for every thread
#pragma omp parallel num_threads(team)
  {
    const at::ThreadLocalStateGuard as_caller(state);
#pragma omp single
    barrier.reset(omp_get_num_threads());  // (the team OpenMP gave; single's barrier after)
    const int64_t n = omp_get_num_threads(), p = omp_get_thread_num();
    try {
      const int64_t r0 = t * p / n, r1 = t * (p + 1) / n;  // rows of the row-wise phases
      const auto rows = [r0, r1](const at::Tensor& a) { return a.narrow(0, r0, r1 - r0); };
      const auto mine = at::arange(p, t, n, slots.options());  // RoPE and attention rows
      const int64_t tp = mine.size(0);
      at::Tensor cos_p, sin_p, slots_p, blocks_p, lens_p;
      if (tp > 0) {
        cos_p = cos.index_select(0, mine), sin_p = sin.index_select(0, mine);
        slots_p = slots.index_select(0, mine), blocks_p = blocks.index_select(0, mine);
        lens_p = lens.index_select(0, mine);
      }
      bool go = true;
      for (int64_t l = 0; l < layers && go; ++l) {
        const auto w = weights.slice(10 * l, 10);
        if (r1 > r0) {
          if (l > 0) plus(rows(attended), rows(down), rows(cur));  // the last layer's output
          rows(x).copy_(rms_norm(rows(cur), w[0], eps));
        }
        go = barrier.wait();
        if (go) crowdchat::q4_linear_share(x, w[1], w[2], p, n, qkv);
        go = go && barrier.wait();
        at::Tensor q;
        if (go && tp > 0)
          q = rope_store(qkv.index_select(0, mine), cos_p, sin_p, k_caches[l], v_caches[l],
                         slots_p, heads, kv_heads);
        // a prompt's tokens attend to each other's K/V: every row's written first
        if (prompt) go = go && barrier.wait();
        if (go && tp > 0) {
          const auto a = paged_decode_attention(q, k_caches[l], v_caches[l], blocks_p, lens_p,
                                                block_size, scale);
          o.index_copy_(0, mine, a.view({tp, -1}));
        }
        go = go && barrier.wait();
        if (go) crowdchat::q4_linear_share(o, w[3], w[4], p, n, attn);
        go = go && barrier.wait();
        if (go && r1 > r0) {
          plus(rows(cur), rows(attn), rows(attended));
          rows(x).copy_(rms_norm(rows(attended), w[5], eps));
        }
        go = go && barrier.wait();
        if (go) crowdchat::q4_linear_share(x, w[6], w[7], p, n, gate_up);
        go = go && barrier.wait();
        if (go && r1 > r0) {
          const auto gu = rows(gate_up);
          rows(product).copy_(silu_mul(gu.narrow(1, 0, inner), gu.narrow(1, inner, inner)));
        }
        go = go && barrier.wait();
        if (go) crowdchat::q4_linear_share(product, w[8], w[9], p, n, down);
        go = go && barrier.wait();
      }
      if (go && r1 > r0) plus(rows(attended), rows(down), rows(cur));
    } catch (...) {
      const std::lock_guard<std::mutex> hold(error_lock);
      if (!error) error = std::current_exception();
      barrier.abort();
    }
  }
  if (error) std::rethrow_exception(error);
  return cur;
}

// whether every layer's weights (10 a layer, as decode_stack takes them) are in a layout
// `decode_stack_shared` takes
bool stack_shares(at::TensorList weights) {
  bool shares = !weights.empty() && weights.size() % 10 == 0;
  for (size_t l = 0; shares && l < weights.size(); l += 10)
    for (const size_t i : {1, 3, 6, 8})
      shares = shares && q4_linear_shares(weights[l + i], weights[l + i + 1]);
  return shares;
}

// whether decode_stack splits columns (`decode_stack_shared`); returns the setting before
bool set_shared_decode(bool on) { return shared_wanted.exchange(on); }

// the checks of a stack's arguments (`name`: the op's)
void check_stack(const at::Tensor& h, at::TensorList weights, at::TensorList k_caches,
                 at::TensorList v_caches, const char* name) {
  const auto layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && v_caches.size() == k_caches.size() &&
                  static_cast<int64_t>(weights.size()) == 10 * layers,
              name, ": 10 weights and a K and V pool half a layer");
  TORCH_CHECK(h.dim() == 2 && h.size(0) > 0, "h: [T, C] with T >= 1");
}

// A step with prompt tokens as `decode_stack_shared` runs a few-row decode step, in one
// parallel region: each token a row attending to its own first `lens` tokens through its own
// row of `blocks` (a prompt token's attention is bitwise its decode's: paged_decode.cpp), the
// K/V of every row written before any row attends. The other values come from the same kernels
// on the same rows as the op-by-op loop, so they are bitwise the same. Where op by op each of
// a layer's ~20 parallel regions woke the other core (passive waits), here spin barriers
// separate 8 phases a layer.
at::Tensor prompt_stack(const at::Tensor& h, at::TensorList weights, double eps,
                        const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
                        at::TensorList v_caches, const at::Tensor& slots,
                        const at::Tensor& blocks, const at::Tensor& lens, int64_t block_size,
                        double scale, int64_t heads, int64_t kv_heads) {
  check_stack(h, weights, k_caches, v_caches, "prompt_stack");
  TORCH_CHECK(h.scalar_type() == at::kFloat, "h: float32");
  TORCH_CHECK(!at::in_parallel_region() && stack_shares(weights),
              "prompt_stack: the int8-activation layouts, outside a parallel region");
  return decode_stack_shared(h, weights, eps, cos, sin, k_caches, v_caches, slots, blocks, lens,
                             block_size, scale, heads, kv_heads, true);
}

// Every layer of a decode step (`decode_layer` for each; weights: 10 a layer, in order; the
// pool's halves one a layer), its rows split over the threads: each thread takes rows i,
// i + n, i + 2n, ... (the rows come sorted by context length: like shares of attention) through
// all the layers on its own, in one parallel region a step. Split op by op, each of a layer's
// ~6 parallel regions woke the other core's sleeping thread (passive waits, engine/threads.py)
// and waited for it at its end: on the 2-core Zen 5 EPYC, a firecracker VM where an idle vCPU
// halts, 32 rows at context 200 took ~28.5 ms a step that way against ~21 with spinning waits.
// Each row's values are what `decode_layer` gives it in any batch (its kernels are
// batch-invariant), so the output is bitwise the per-layer loop's. Few rows with the
// int8-activation kernels take `decode_stack_shared` instead.
at::Tensor decode_stack(const at::Tensor& h, at::TensorList weights, double eps,
                        const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
                        at::TensorList v_caches, const at::Tensor& slots,
                        const at::Tensor& blocks, const at::Tensor& lens, int64_t block_size,
                        double scale, int64_t heads, int64_t kv_heads) {
  check_stack(h, weights, k_caches, v_caches, "decode_stack");
  const auto layers = static_cast<int64_t>(k_caches.size());
  const int64_t threads = at::get_num_threads();
  if (shared_wanted.load() && threads > 1 && h.size(0) <= kSharedRows * threads &&
      !at::in_parallel_region() && h.scalar_type() == at::kFloat && stack_shares(weights))
    return decode_stack_shared(h, weights, eps, cos, sin, k_caches, v_caches, slots, blocks, lens,
                               block_size, scale, heads, kv_heads);
  const auto run = [&](const at::Tensor& x, const at::Tensor& c, const at::Tensor& s,
                       const at::Tensor& sl, const at::Tensor& b, const at::Tensor& n) {
    auto out = x;
    for (int64_t l = 0; l < layers; ++l)
      out = decode_layer(out, weights.slice(10 * l, 10), eps, c, s, k_caches[l], v_caches[l], sl,
                         b, n, block_size, scale, heads, kv_heads);
    return out;
  };
  const int64_t t = h.size(0), parts = std::min<int64_t>(at::get_num_threads(), t);
  if (parts <= 1) return run(h, cos, sin, slots, blocks, lens);
  std::vector<at::Tensor> rows(parts), outs(parts);
  for (int64_t p = 0; p < parts; ++p) rows[p] = at::arange(p, t, parts, slots.options());
  at::parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p) {
      const auto& r = rows[p];
      outs[p] = run(h.index_select(0, r), cos.index_select(0, r), sin.index_select(0, r),
                    slots.index_select(0, r), blocks.index_select(0, r), lens.index_select(0, r));
    }
  });
  auto out = at::empty_like(h);
  for (int64_t p = 0; p < parts; ++p) out.index_copy_(0, rows[p], outs[p]);
  return out;
}

}  // namespace crowdchat

TORCH_LIBRARY_FRAGMENT(crowdchat, m) {
  m.def(
      "decode_stack(Tensor h, Tensor[] weights, float eps, Tensor cos, Tensor sin, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor blocks, Tensor lens, "
      "int block_size, float scale, int heads, int kv_heads) -> Tensor");
  m.def(
      "prompt_stack(Tensor h, Tensor[] weights, float eps, Tensor cos, Tensor sin, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor blocks, Tensor lens, "
      "int block_size, float scale, int heads, int kv_heads) -> Tensor");
  m.def("set_shared_decode(bool on) -> bool", &crowdchat::set_shared_decode);
  // whether decode_stack can split these weights' columns over the threads (few rows)
  m.def("decode_stack_shares(Tensor[] weights) -> bool");
  m.def(
      "decode_layer(Tensor h, Tensor[] weights, float eps, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor blocks, Tensor lens, "
      "int block_size, float scale, int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(crowdchat, CPU, m) {
  m.impl("decode_layer", &crowdchat::decode_layer);
  m.impl("decode_stack", &crowdchat::decode_stack);
  m.impl("prompt_stack", &crowdchat::prompt_stack);
  m.impl("decode_stack_shares", &crowdchat::stack_shares);
}

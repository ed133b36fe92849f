// A sequence's exported K or V back into the paged pool (engine/kv_cache.py `load`: a restore
// from host memory or disk). The pool half is [L, H_kv, slots, D]; the export is
// [L, T, H_kv, D], token t going to slot slots[t]. ATen's index_copy_ of the transposed export
// moved one element at a time: 11-14 ms for the 46 MB of a 2,000-token SmolLM2 conversation on
// the 2-core Zen 5 EPYC, on the engine thread, so every decoding user waited for the restore.
// Here each (layer, KV head, token) row of D values is one memcpy, the (layer, head) pairs
// split over the cores: 5-6 ms. Bytes are copied, not converted: both sides have the pool's
// dtype. (The other way, a persist's index_select, measured 8 ms against 6.5: left to ATen.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

namespace {

// the element size, after checking that a pool half, an export and the slots agree
int64_t check(const at::Tensor& pool, const at::Tensor& kv, const at::Tensor& slots) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous(), "pool: contiguous [L, H_kv, slots, D]");
  TORCH_CHECK(kv.dim() == 4 && kv.is_contiguous(), "kv: contiguous [L, T, H_kv, D]");
  TORCH_CHECK(kv.scalar_type() == pool.scalar_type(), "kv and pool differ in dtype");
  TORCH_CHECK(kv.size(0) == pool.size(0) && kv.size(2) == pool.size(1) &&
                  kv.size(3) == pool.size(3),
              "kv [L, T, H_kv, D] does not match the pool's layers, heads or head size");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.size(0) == kv.size(1),
              "slots: contiguous int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < pool.size(2), "slot out of range");
  return pool.element_size();
}

}  // namespace

namespace crowdchat {

// pool[l, h, slots[t]] = kv[l, t, h] for every layer, head and token
void kv_scatter(at::Tensor pool, const at::Tensor& kv, const at::Tensor& slots) {
  const int64_t e = check(pool, kv, slots);
  const int64_t L = pool.size(0), H = pool.size(1), S = pool.size(2), D = pool.size(3);
  const int64_t T = kv.size(1), row = D * e;
  auto* pp = static_cast<char*>(pool.data_ptr());
  const auto* kp = static_cast<const char*>(kv.data_ptr());
  const int64_t* sp = slots.data_ptr<int64_t>();
  // 256 KB a (layer, head) pair at 2,000 tokens of 64 bf16 values; a few tokens' worth is
  // copied by this thread alone (waking the others would cost more)
  const int64_t grain = T * row < 65536 ? L * H + 1 : 1;
  at::parallel_for(0, L * H, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t l = i / H, h = i % H;
      char* base = pp + (l * H + h) * S * row;
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(base + sp[t] * row, kp + ((l * T + t) * H + h) * row, row);
    }
  });
}

}  // namespace crowdchat

TORCH_LIBRARY_FRAGMENT(crowdchat, m) {
  m.def("kv_scatter(Tensor(a!) pool, Tensor kv, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(crowdchat, CPU, m) {
  m.impl("kv_scatter", &crowdchat::kv_scatter);
}

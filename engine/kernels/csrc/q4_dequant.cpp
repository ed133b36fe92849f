// The 4-bit weights of the int8-activation layout (engine/model/cpu_quant.py `pack_for_dot`
// with q8) widened back to bfloat16, transposed ([K, columns]), for a many-row step's matmul
// on oneDNN's bf16 GEMM (engine/model/bf16_gemm.py; AMX tiles on Sapphire Rapids and later,
// where 504 rows through a layer's four projections took 3.2 ms this way, the widening 0.4 of
// them, against 4.9 on the int8 kernel, whose per-group float scaling leaves the tiles mostly
// idle). Each weight is `q * scale + offset` (one fused multiply-add in float32), rounded to
// nearest even.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace crowdchat {

// out [K, 16 * blocks] (bfloat16, contiguous) takes the columns of blocks [first, first +
// out.size(1) / 16) of `packed` (uint8 [N/16, K/32, 256]) and `so` (float32 [N/16, K/32, 32]:
// a block's 16 scales, then its 16 offsets, per group of 32 along K)
at::Tensor& q4_dequant_bf16_(const at::Tensor& packed, const at::Tensor& so, at::Tensor& out,
                             int64_t first) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 256 && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous(),
              "packed: contiguous uint8 [N/16, K/32, 256]");
  const int64_t blocks = packed.size(0), groups = packed.size(1), k = groups * 32;
  TORCH_CHECK(so.scalar_type() == at::kFloat && so.is_contiguous() &&
                  so.sizes() == at::IntArrayRef({blocks, groups, 32}),
              "so: contiguous float32 [N/16, K/32, 32]");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kBFloat16 && out.is_contiguous() &&
                  out.size(0) == k && out.size(1) % 16 == 0,
              "out: contiguous bfloat16 [K, a multiple of 16]");
  const int64_t nb = out.size(1) / 16;
  TORCH_CHECK(first >= 0 && first + nb <= blocks, "blocks out of range");
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const uint8_t* pw = packed.data_ptr<uint8_t>();
  const float* ps = so.data_ptr<float>();
  auto* po = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t ld = out.size(1);
  const __m512i nibble = _mm512_set1_epi32(0xF);
  // a thread's blocks side by side for each group: consecutive stores fill a row's lines
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t at = (first + b) * groups + g;
        const __m512 s = _mm512_loadu_ps(ps + at * 32), o = _mm512_loadu_ps(ps + at * 32 + 16);
        uint16_t* col = po + g * 32 * ld + b * 16;
        for (int p = 0; p < 4; ++p) {
          // dword c: column c's q at K = 8p + j (byte j's low nibble) and 8p + 4 + j (high)
          const __m512i d = _mm512_loadu_si512(pw + at * 256 + 64 * p);
          for (int j = 0; j < 4; ++j) {
            const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(d, 8 * j), nibble);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(d, 8 * j + 4), nibble);
            const __m512 wl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), s, o);
            const __m512 wh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), s, o);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(col + (8 * p + j) * ld),
                                reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(wl)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(col + (8 * p + 4 + j) * ld),
                                reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(wh)));
          }
        }
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "q4_dequant_bf16_: built without AVX512-BF16");
#endif
}

}  // namespace crowdchat

TORCH_LIBRARY_FRAGMENT(crowdchat, m) {
  m.def("q4_dequant_bf16_(Tensor packed, Tensor so, Tensor(a!) out, int first) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(crowdchat, CPU, m) { m.impl("q4_dequant_bf16_", &crowdchat::q4_dequant_bf16_); }

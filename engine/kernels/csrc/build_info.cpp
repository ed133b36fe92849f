// Which instruction sets this build of the kernels was compiled for (engine/cpu_kernels.py
// `isa`): the loops each kernel runs follow from them, so a KV snapshot's fingerprint names
// them, and K/V computed by one build is never continued by another that rounds differently.
#include <torch/library.h>

#include <string>

namespace crowdchat {

std::string kernel_isa() {
  std::string isa;
  const auto add = [&isa](const char* name) {
    isa += (isa.empty() ? "" : "+") + std::string(name);
  };
#if defined(__AVX2__)
  add("avx2");
#endif
#if defined(__FMA__)
  add("fma");
#endif
#if defined(__AVX512F__)
  add("avx512f");
#endif
#if defined(__AVX512BF16__)
  add("avx512bf16");
#endif
#if defined(__AVX512VNNI__)
  add("avx512vnni");
#endif
#if defined(__ARM_NEON)
  add("neon");
#endif
  return isa.empty() ? "generic" : isa;
}

}  // namespace crowdchat

TORCH_LIBRARY_FRAGMENT(crowdchat, m) {
  m.def("kernel_isa() -> str", &crowdchat::kernel_isa);
}

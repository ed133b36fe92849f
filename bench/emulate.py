"""An AVX2 CPU's code paths on an AVX-512 machine, for benchmarks (`--isa avx2`).

Most CPUs a team has at hand have AVX2 and FMA but no AVX-512 (AMD Zen 2/3, most Intel client
parts). On a box with AVX-512 every library picks its widest kernels at run time; these
settings hold each one to AVX2, so one machine measures both paths in the same run:

- crowdchat's kernels built for `x86-64-v3` tuned for Zen 3 (engine/kernels/cpu_kernels.py),
- PyTorch's ATen kernels (`ATEN_CPU_CAPABILITY`), FBGEMM (`FBGEMM_ENABLE_INSTRUCTIONS`) and
  oneDNN (`ONEDNN_MAX_CPU_ISA`),
- llama-server built without `GGML_NATIVE` (its default x86 set: AVX, AVX2, BMI2, FMA, F16C,
  the set a native build on Zen 3 gets), in a build directory of its own.

What stays the machine's own: its clock, caches and memory bandwidth. A figure from this mode
says "AVX2 code on <this CPU>", and peers are compared in the same run, on the same paths.
"""

from __future__ import annotations

ISAS = ("native", "avx2")

AVX2_ENV = {
    "CROWDCHAT_KERNEL_ARCH": "x86-64-v3",
    "CROWDCHAT_KERNEL_TUNE": "znver3",
    "ATEN_CPU_CAPABILITY": "avx2",
    "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}

# -march=native without AMX: a VM can list amx_tile among its CPU's flags yet not grant the
# tile state (this project's Sapphire Rapids box: llama-server died with SIGILL at its first
# matmul); explicit -mno-* flags win over -march whatever their order
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def server_env(isa: str) -> dict[str, str]:
    """Environment for crowdchat's server process under `isa`."""
    return dict(AVX2_ENV) if isa == "avx2" else {}


def llama_build(isa: str) -> tuple[str, list[str]]:
    """llama-server's build directory name and cmake flags for `isa` (a build each, so a build
    for one is never reused for the other)."""
    if isa == "avx2":
        return "llama-build-avx2", ["-DGGML_NATIVE=OFF"]
    native = ["-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return "llama-build-noamx", native

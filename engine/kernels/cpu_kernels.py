"""crowdchat's own CPU kernels (C++, `engine/kernels/csrc/`), built once per machine.

- `paged_decode_attention` (`csrc/paged_decode.cpp`): decode attention read straight from the
  paged KV pool. The gather path (`engine.model.attention`) copies every decoding sequence's blocks
  into a dense tensor, widens a bf16 pool to float32, then calls SDPA: three passes over the
  context's bytes and a padded batch. On the 2-core AVX2 EPYC that was ~40% of a 32-row decode
  step, and one long conversation slowed everyone (issue 9). The kernel reads each K/V row from
  its block where it lies and widens it in registers, splits long contexts into chunks over the
  cores, and merges them as flash-decoding does: 3-4x faster than the gather at 32 rows of 200
  tokens and at one row of 6,000 (bench/kernel_speed.py). PyTorch has no paged attention for
  the CPU (flex_attention over a paged block mask compiled, and ran ~15x slower than the gather).
  `paged_prefills_attention`, the same work items for a step's short prefill chunks in one
  call (new prompts, a returning user's next message; `paged_prefill_attention` takes one
  chunk): each chunk's n x G query vectors
  per KV head share each widened block, and each query's output is bitwise the decode
  kernel's for that token, where the gather path copied the whole context into a dense tensor
  and SDPA took an explicit mask.
- `q4_linear` (`csrc/q4_linear.cpp`): the 4-bit weights' matmul for few rows where compute is
  float32 (engine.model.cpu_quant): PyTorch's int4 kernel widens bfloat16 activations group by group
  on CPUs without native bfloat16; this one widens each group's weights once for up to 4 rows.
  On CPUs with AVX512-BF16 it is a `vdpbf16ps` kernel with its own layout, faster than a dense
  float16 copy on FBGEMM at every row count measured (1 to 512), so no dense copy is kept.
  With int8 activations (`--cpu-activations auto`) x is rounded to int8 per group of 32, as
  llama.cpp rounds it, and the sums run in integers: `vpdpbusd` on AVX512-VNNI, and on AVX2
  `vpmaddubsw` + `vpmaddwd` over a layout of its own (`csrc/q8_avx2.cpp`, also the output
  projection's int8 weights), 2x faster than the float32 kernel at one row and 1.6x faster than
  FBGEMM's float16 copy at 32 (bench/step_profile.py), so no dense copy is kept there either.
  On AMX (Sapphire Rapids and later Xeons) the integer sums of 10 rows and more come from
  tiles (`tdpbsud`), bitwise the same; `CROWDCHAT_KERNEL_AMX=0` keeps them on `vpdpbusd`.
  `q4_dequant_bf16_` (`csrc/q4_dequant.cpp`) widens that layout's weights back to bfloat16 for
  steps of many rows on oneDNN's bf16 GEMM where AMX is there (engine.model.bf16_gemm).
- `rope_store` (`csrc/rope_store.cpp`) and `rms_norm` (`csrc/rms_norm.cpp`): the glue of a
  decode step (engine.model.lean_llama `_decodes`, engine.model.lean_norm), one call each where
  Python made
  ~20 and ~10 ATen calls, computing bitwise the same values; `decode_layer`
  (`csrc/decode_layer.cpp`): a whole layer of a few-row decode step over these, from C++.
- `kv_scatter` (`csrc/kv_copy.cpp`): a restore's copy of exported K/V into the pool, one
  `memcpy` per row over all cores, 2x faster than `index_copy_` of the transposed export;
  `kv_read_file`, a disk restore's read of a snapshot straight into reserved blocks of the
  pool: a layer at a time read, checksummed (PyTorch's own CRC-32 header) and copied in one
  pass on the restore thread, the GIL released.
- `sample_rows_` (`csrc/sample.cpp`): the draw of temperature-only rows (engine.model.sampler),
  two passes a row where ATen took five over the whole step's logits.
- `omp_threads` (`csrc/threads.cpp`): the calling thread's OpenMP team size, for the engine
  thread's few-row steps, which run on it alone (engine/model/runner.py `SERIAL_ROWS`).

They are built with PyTorch's own extension builder (a C++ compiler and ninja; ~1 minute on 2
cores) into `~/.cache/crowdchat/kernels/`, `-march=native` for the CPU they run on; `make`
builds them first (`python engine/kernels/cpu_kernels.py`, which imports no more than torch).
`CROWDCHAT_KERNEL_ARCH` names another `-march` target and `CROWDCHAT_KERNEL_TUNE` an `-mtune`
one, a build each, so that one machine tests the loops of CPUs it is not: `make test` runs the
kernel tests again on `x86-64-v3` (AVX2 and FMA, no AVX-512) tuned for Zen 3, whose tuning
once made the generic attention loop round a prefill chunk unlike the decode. Where
they cannot be built, decode attention gathers and the 4-bit weights run on PyTorch's kernel,
as before, and the log says why.

`CROWDCHAT_KERNEL_SANITIZE=1` builds them (a build of its own) with AddressSanitizer and
UndefinedBehaviorSanitizer (`-fsanitize=address,undefined -fno-omit-frame-pointer -g`), for the
kernel tests (`make test-sanitize`) and the fuzzers (`make fuzz`). The ASan runtime must come
first in a process that loads it, and libstdc++ with it (else ASan cannot intercept a C++
throw and aborts on the first TORCH_CHECK that fails):
`LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"`, with
`ASAN_OPTIONS=detect_leaks=0` (Python itself never frees some of its memory) and
`UBSAN_OPTIONS=halt_on_error=1` so undefined behaviour fails instead of printing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import re
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).with_name("csrc").glob("*.cpp"))
HEADERS = sorted(Path(__file__).with_name("csrc").glob("*.h"))
NAME = "crowdchat_cpu_kernels"
FAILED = "build-failed.txt"  # in the build's directory: why it failed (`_failed_before`)
ARCH_VARIABLE, TUNE_VARIABLE = "CROWDCHAT_KERNEL_ARCH", "CROWDCHAT_KERNEL_TUNE"
SANITIZE_VARIABLE = "CROWDCHAT_KERNEL_SANITIZE"
AMX_VARIABLE = "CROWDCHAT_KERNEL_AMX"
SANITIZERS = "-fsanitize=address,undefined"


def _target(variable: str) -> str:
    """A GCC target name from `variable`, "" where it is unset."""
    name = os.environ.get(variable, "")
    if name and not re.fullmatch(r"[a-z0-9][a-z0-9.+_-]*", name):
        raise ValueError(f"{variable}={name!r} is not a GCC target name such as x86-64-v3")
    return name


def sanitized() -> bool:
    """Whether $CROWDCHAT_KERNEL_SANITIZE asks for the ASan and UBSan build ("1"; unset, "" or
    "0": the plain one)."""
    value = os.environ.get(SANITIZE_VARIABLE, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{SANITIZE_VARIABLE}={value!r}: use 1 (sanitizers) or 0")
    return value == "1"


def amx_wanted() -> bool:
    """Whether the int8-activation kernels may use AMX tiles where built for them:
    $CROWDCHAT_KERNEL_AMX unset, "" or "1"; "0" holds them to `vpdpbusd` (the same results,
    for A/B timings)."""
    value = os.environ.get(AMX_VARIABLE, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{AMX_VARIABLE}={value!r}: use 0 (no AMX) or 1")
    return value != "0"


def flags() -> list[str]:
    """This process's compiler flags: `-march=native` unless $CROWDCHAT_KERNEL_ARCH names
    another target (`x86-64-v3`), `-mtune` from $CROWDCHAT_KERNEL_TUNE where set, and the
    sanitizers where $CROWDCHAT_KERNEL_SANITIZE is 1."""
    out = ["-O3", f"-march={_target(ARCH_VARIABLE) or 'native'}", "-fopenmp"]
    tune = _target(TUNE_VARIABLE)
    out += [f"-mtune={tune}"] if tune else []
    return [*out, SANITIZERS, "-fno-omit-frame-pointer", "-g"] if sanitized() else out


Kernel = Callable[..., torch.Tensor]
_lock = threading.Lock()
_loaded: list[bool] = []  # once tried: whether the library loaded


def build_dir() -> Path:
    """Where this machine's build lives: one per source, CPU model and instruction sets, and
    torch version (the code is compiled for the CPU it runs on; a home directory shared by
    machines of different CPUs gets one build each)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:  # the model and its instruction sets (one per core)
            cpu += "".join(dict.fromkeys(x for x in f if x.startswith(("model name", "flags"))))
    except OSError:
        pass
    what = f"{cpu}|{torch.__version__}|{flags()}|".encode()
    what += b"".join(p.name.encode() + p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(what).hexdigest()[:12]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "crowdchat" / "kernels" / key


def load() -> bool:
    """Whether the kernels are loaded (built on first use on this machine) as
    `torch.ops.crowdchat.*`; False where they cannot be built."""
    with _lock:
        if not _loaded:
            _loaded.append(_build())
        return _loaded[0]


def loaded() -> bool:
    """Whether the kernels were loaded (by an earlier `load`): a check without the lock, for
    the per-call paths."""
    return bool(_loaded) and _loaded[0]


def decode_attention() -> Kernel | None:
    """The paged decode attention op, or None where the kernels cannot be built."""
    return torch.ops.crowdchat.paged_decode_attention if load() else None


def prefills_attention() -> Kernel | None:
    """The paged attention op for many short prefill chunks of a step in one call, or None
    where the kernels cannot be built."""
    return torch.ops.crowdchat.paged_prefills_attention if load() else None


def q4_dot_layout() -> bool:
    """Whether the 4-bit kernel was built for AVX512-BF16 (csrc/q4_linear.cpp): its weights
    then take that kernel's layout (engine.model.cpu_quant `pack_for_dot`) and need no dense
    copy."""
    return load() and torch.ops.crowdchat.q4_dot_layout()


def q8_activations() -> bool:
    """Whether the 4-bit kernel of this build's layout has an int8-activation variant
    (`--cpu-activations`): AVX512-VNNI beside AVX512-BF16, or AVX2 and FMA without
    AVX512-BF16."""
    return load() and bool(torch.ops.crowdchat.q8_activations())


def amx_tiles() -> bool:
    """Whether the int8-activation kernels run their many-row matmuls on AMX tiles (Sapphire
    Rapids and later Xeons, where Linux grants the tile state; bitwise the results of
    `vpdpbusd`, so not part of the KV fingerprint)."""
    return load() and bool(torch.ops.crowdchat.amx_tiles())


def isa() -> str:
    """The instruction sets the loaded kernels were built for (`avx2+fma+avx512f+...`), or
    `none` where they cannot be built: the K/V they compute depends on it (engine.model.loader's
    fingerprint)."""
    return str(torch.ops.crowdchat.kernel_isa()) if load() else "none"


def q4_linear() -> Kernel | None:
    """The 4-bit weights' few-row matmul op, or None where the kernels cannot be built."""
    return torch.ops.crowdchat.q4_linear if load() else None


def _failed_before(where: Path) -> str | None:
    """Why this build failed in an earlier process (None if it did not): a failed build
    (no compiler, no ninja, an error) is tried once per build key, not in every process (a
    try costs ~1 minute on 2 cores); `python engine/kernels/cpu_kernels.py` tries again."""
    try:
        return (where / FAILED).read_text(errors="replace").strip() or "unknown"
    except OSError:
        return None


def _build() -> bool:
    from torch.utils import cpp_extension

    where = build_dir()
    built = where / f"{NAME}.so"
    failed = None if built.exists() else _failed_before(where)
    if failed is not None:
        log.warning(
            "crowdchat's CPU kernels unavailable (their build failed before: %s; "
            "`python engine/kernels/cpu_kernels.py` tries again): decode attention gathers, "
            "4-bit weights run on PyTorch's int4 kernel",
            failed,
        )
        return False
    try:
        if sanitized() and "libasan" not in os.environ.get("LD_PRELOAD", ""):
            # loading it otherwise aborts the process ("ASan runtime does not come first")
            raise RuntimeError(f"{SANITIZE_VARIABLE}=1 needs LD_PRELOAD=<gcc's libasan.so>")
        if built.exists():  # cpp_extension.load would take ~3 s to find it up to date
            torch.ops.load_library(str(built))
        else:  # builds it and loads it
            where.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name=NAME,
                sources=[str(p) for p in SOURCES],
                extra_cflags=flags(),
                extra_ldflags=[SANITIZERS] if sanitized() else [],
                build_directory=str(where),
                is_python_module=False,
            )
        torch.ops.crowdchat.set_amx(amx_wanted())
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: gather
        if not built.exists():  # remembered for later processes (not a load of a good build)
            with contextlib.suppress(OSError):
                where.mkdir(parents=True, exist_ok=True)
                (where / FAILED).write_text(f"{type(e).__name__}: {e}"[:2000])
        log.warning(
            "crowdchat's CPU kernels unavailable (%s): decode attention gathers, 4-bit weights "
            "run on PyTorch's int4 kernel",
            e,
        )
        return False
    return True


def main() -> None:
    """`python engine/kernels/cpu_kernels.py`: build the kernels now (`make kernel` does)."""
    logging.basicConfig(level=logging.INFO)
    (build_dir() / FAILED).unlink(missing_ok=True)  # asked for: try a failed build again
    if not load():
        raise SystemExit("crowdchat's CPU kernels could not be built (see above)")
    print(f"crowdchat's CPU kernels: {build_dir()}")


if __name__ == "__main__":
    main()

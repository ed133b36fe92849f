"""Decode attention read straight from the paged KV pool on the CPU: a C++ kernel of our own.

The gather path (`engine.attention`) copies every decoding sequence's blocks into a dense
tensor, widens a bf16 pool to float32, then calls SDPA: three passes over the context's bytes
and a padded batch. On the 2-core AVX2 EPYC that was ~40% of a 32-row decode step, and one long
conversation slowed everyone (issue 9). `csrc/paged_decode.cpp` reads each K/V row from its
block where it lies and widens it in registers, splits long contexts into chunks over the
cores, and merges them as flash-decoding does: 3-4x faster than the gather at 32 rows of 200
tokens and at one row of 6,000 (bench/kernel_speed.py). PyTorch has no paged attention for the
CPU (flex_attention over a paged block mask compiled, and ran ~15x slower than the gather).

It is built once per machine with PyTorch's own extension builder (a C++ compiler and ninja;
~25 s on 2 cores) into `~/.cache/crowdchat/kernels/`, `-march=native` for the CPU it runs on;
`make` builds it first (`python engine/paged_kernel.py`, which imports no more than torch).
Where it cannot be built, decode attention gathers, as before, and the log says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
NAME = "crowdchat_paged_decode"
FLAGS = ["-O3", "-march=native", "-fopenmp"]

DecodeKernel = Callable[..., torch.Tensor]
_lock = threading.Lock()
_loaded: dict[str, DecodeKernel | None] = {}


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
    what = f"{cpu}|{torch.__version__}|{FLAGS}|".encode() + SOURCE.read_bytes()
    key = hashlib.sha256(what).hexdigest()[:12]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "crowdchat" / "kernels" / key


def load() -> DecodeKernel | None:
    """The kernel op (built on first use on this machine), or None where it cannot be built."""
    with _lock:
        if NAME not in _loaded:
            _loaded[NAME] = _build()
        return _loaded[NAME]


def _build() -> DecodeKernel | None:
    from torch.utils import cpp_extension

    where = build_dir()
    built = where / f"{NAME}.so"
    try:
        if built.exists():  # cpp_extension.load would take ~3 s to find it up to date
            torch.ops.load_library(str(built))
        else:  # builds it and loads it
            where.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name=NAME,
                sources=[str(SOURCE)],
                extra_cflags=FLAGS,
                build_directory=str(where),
                is_python_module=False,
            )
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: gather
        log.warning("CPU decode attention kernel unavailable (%s); decode attention gathers", e)
        return None
    return torch.ops.crowdchat.paged_decode_attention


def main() -> None:
    """`python engine/paged_kernel.py`: build the kernel now (`make kernel` does)."""
    logging.basicConfig(level=logging.INFO)
    if load() is None:
        raise SystemExit("the CPU decode attention kernel could not be built (see above)")
    print(f"CPU decode attention kernel: {build_dir()}")


if __name__ == "__main__":
    main()

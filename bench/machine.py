"""Where a benchmark's figures come from: the CPU and its vector extensions, the commit and the
date (the same benchmark reads 2x apart on AVX2 and AVX-512 boxes)."""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

VECTOR_FLAGS = (
    *("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl"),
    *("avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"),
)


def machine(cpuinfo: str) -> dict:
    """The CPU every figure of the run comes from (text of /proc/cpuinfo), with its vector
    extensions: the same benchmark reads 2x apart on AVX2 and AVX-512 boxes."""
    fields = dict(ln.split(":", 1) for ln in cpuinfo.splitlines()[::-1] if ":" in ln)
    fields = {k.strip(): v.strip() for k, v in fields.items()}  # the first CPU's values win
    flags = set(fields.get("flags", "").split())
    return {
        "cpu": fields.get("model name", ""),
        "cores": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "vector_extensions": [f for f in VECTOR_FLAGS if f in flags],
    }


def git_commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain") else "")


def provenance() -> dict:
    """Where and when a run's figures come from: the machine, the commit and the date."""
    return {
        "machine": machine(Path("/proc/cpuinfo").read_text()),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }

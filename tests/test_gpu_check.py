"""bench/gpu_check.sh's plan: headline figures first, transformers' baselines last, and the
steps' limits within a budget that fits one device command; no machine's path in the GPU
scripts. (GPU_CHECK_SMOKE=1 rehearses every step on the CPU: too slow for the suite.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def plan(**env: str) -> tuple[int, dict]:
    out = subprocess.run(
        ["bash", str(SCRIPT)],
        env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_PLAN": "1", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.returncode, json.loads(out.stdout.strip().splitlines()[-1])


def test_the_plan_puts_the_headline_first_and_fits_one_device_command() -> None:
    rc, got = plan()
    assert rc == 0 and got["fits"]
    steps = got["plan"]
    assert steps[:3] == ["env", "random_model", "throughput"]  # the 135M shape with graphs
    assert steps.index("throughput_llama-3.1-8b") < steps.index("throughput_eager")
    assert steps.index("throughput_eager") < steps.index("tests") < steps.index("http")
    assert steps.index("restore_llama-3.1-8b") < steps.index("throughput_llama-3.2-1b")
    assert steps[-1] == "hf_generate"  # transformers' baselines (a torch.compile) last
    assert got["sum_s"] <= got["budget_s"] and got["budget_s"] < got["command_s"] <= 580


def test_a_plan_over_the_budget_is_refused() -> None:
    rc, got = plan(GPU_CHECK_BUDGET_S="300")
    assert rc == 1 and not got["fits"]


def test_no_machines_path_in_the_gpu_scripts() -> None:
    for name in ("gpu_check.sh", "gpu_prep.sh"):
        text = (ROOT / "bench" / name).read_text()
        assert "/work/" not in text and "/home/" not in text, name

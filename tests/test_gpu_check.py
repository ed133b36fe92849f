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


def test_a_smoke_run_records_every_planned_step_in_order(tmp_path: Path) -> None:
    """The rehearsal's plumbing with every step stubbed (a "python" that prints a JSON line
    for a step's command and is the real one for the script's own helpers): each planned step
    is recorded once, in PLAN's order, the larger shapes as skipped in their place, each row
    with its wall and limit seconds, and the run says the order held."""
    stub = tmp_path / "python"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        'case "$1 $2" in\n'
        '  "-c "*"import json, subprocess"*) echo \'{"stub": "env"}\' ;;\n'
        f'  "- "*|"-c "*) exec {sys.executable} "$@" ;;\n'
        "  *) echo '{\"stub\": true}' ;;\n"
        "esac\n"
    )
    stub.chmod(0o755)
    env = {**os.environ, "PYTHON": str(stub), "GPU_CHECK_SMOKE": "1", "OUT": str(tmp_path)}
    env["GPU_CHECK_SITE"] = str(tmp_path / "site")
    out = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "step" in r]
    assert steps == plan()[1]["plan"]
    assert all(r["rc"] == "skipped" for r in rows if "llama" in r.get("step", ""))
    assert all("wall_s" in r and "limit_s" in r for r in rows if r.get("rc") == 0)
    assert rows[-1] == {"order": "as planned", "steps": len(steps)}

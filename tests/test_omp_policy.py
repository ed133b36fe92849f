"""The engine asks libgomp for passive waits unless the operator chose a policy, and the
server's OpenMP threads really get it (engine/threads.py says why)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE = (
    "import os, engine, torch; "
    "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
)


def probe(extra: dict[str, str], code: str = PROBE) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(extra)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@pytest.mark.parametrize(
    ("extra", "seen"),
    [
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE None"),  # the operator's choice stays
        ({"GOMP_SPINCOUNT": "300000"}, "None 300000"),  # libgomp's own default, asked for
    ],
)
def test_wait_policy_unless_chosen(extra: dict[str, str], seen: str) -> None:
    assert probe(extra) == seen


def test_too_late_once_torch_is_loaded() -> None:
    """libgomp read its settings when torch loaded: changing the variable then would only
    mislead, so the engine leaves it alone."""
    code = "import os, torch, engine; print(os.environ.get('OMP_WAIT_POLICY'))"
    assert probe({}, code) == "None"


def test_server_process_gets_it() -> None:
    """The default, in the server: app.py imports gradio, then the engine, and nothing
    before the engine loads torch."""
    code = "import sys, app, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    assert probe({}, code) == "PASSIVE"

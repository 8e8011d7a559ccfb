"""`bench/gpu_run.sh`, the one command a GPU machine runs (issue 32), on a CPU: its `gpu` tests are collected and
skipped (no CUDA here) and its bench runs, so a device call is never spent on an import error (GPU run 4's first
call was: the script ran pytest without the conftest that puts `tests/` on the path)."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_script_collects_its_tests_and_runs_its_bench_on_a_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PY": sys.executable, "TESTS_TIMEOUT": "300", "BENCH_BUDGET": "0"}
    env.pop("PYTHONPATH", None)
    run = subprocess.run(["bash", "bench/gpu_run.sh", "--smoke", "--sessions", ""], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "== gpu tests: exit 0" in run.stdout and "== bench: exit 0" in run.stdout, run.stdout[-3000:]
    suite = ET.parse(tmp_path / "gpu_tests.xml").getroot().find("testsuite")
    assert int(suite.get("errors")) == 0 and int(suite.get("failures")) == 0
    assert int(suite.get("tests")) >= 10 and int(suite.get("skipped")) == int(suite.get("tests"))  # (needs CUDA)

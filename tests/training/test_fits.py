"""The fit check's one command reproduces the shipped file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from models.fits import SHIPPED, FitCheck

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_command_reproduces_the_shipped_fit_check(tmp_path):
    out = tmp_path / "fits.safetensors"
    done = subprocess.run([sys.executable, "-m", "training.fits", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    made, shipped = FitCheck.load(out), FitCheck.load(SHIPPED)
    assert made.key_encoder == shipped.key_encoder
    # the same data, seed and full-batch steps: the same check up to the encoder's float noise under other threads
    assert abs(made.threshold - shipped.threshold) < 0.05
    for split in ("train", "eval"):
        for what in ("told_read_right", "untold_read_nothing", "near_miss_read_nothing"):
            assert abs(made.report[split]["score and fit"][what] - shipped.report[split]["score and fit"][what]) <= 0.02
    held_out = made.report["eval"]["score and fit"]
    assert held_out["untold_read_nothing"] >= 0.85 and held_out["told_read_right"] >= 0.88
    # near misses ("What colour is my boat?" beside a favourite colour): the score alone reads something for 0.8
    assert held_out["near_miss_read_nothing"] >= 0.7 > made.report["eval"]["score alone"]["near_miss_read_nothing"]

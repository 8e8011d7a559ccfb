"""The write decision's one command reproduces the shipped file, and its held-out split is new in form and names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.remember import SHIPPED, WriteDecision
from training.remember import TELLS, messages

ROOT = Path(__file__).resolve().parents[2]


def test_the_held_out_messages_share_no_template_and_no_message_with_training():
    assert not set(TELLS["train"]) & set(TELLS["eval"])
    train, _ = messages("train", 400)
    held_out, _ = messages("eval", 200)
    assert not set(train) & set(held_out)


@pytest.mark.slow
def test_the_command_reproduces_the_shipped_decision(tmp_path):
    out = tmp_path / "decision.safetensors"
    done = subprocess.run([sys.executable, "-m", "training.remember", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    made, shipped = WriteDecision.load(out), WriteDecision.load(SHIPPED)
    assert made.key_encoder == shipped.key_encoder
    # the same data and L-BFGS from zeros: the same weights up to the encoder's float noise under other threads
    assert torch.allclose(made.weight, shipped.weight, atol=1e-2) and abs(made.threshold - shipped.threshold) < 1e-2
    assert made.report["eval"]["false_writes"] <= 0.03 and made.report["eval"]["write_recall"] >= 0.95

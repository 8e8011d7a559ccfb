"""bench/gpu.py's logic end to end on a tiny shape on the CPU (`--smoke`): the script only ever runs on a lent GPU,
so this is what keeps it working between those runs. It checks what the measures found, never their times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_bench_runs_every_measure_on_a_tiny_shape(tmp_path, smollm2_dir):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--smoke", "--out", str(tmp_path),
                           "--tokenizer", str(smollm2_dir)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    model = json.loads((tmp_path / "results.json").read_text())["models"]["tiny (smoke)"]
    failed = {k: v for k, v in model.items() if isinstance(v, dict) and ({"error", "skipped"} & set(v))}
    assert not failed, failed
    # (the step's agreement with eager `generate` is reported, not asserted: a tiny random model's near ties may
    # fall either way under other kernels; the chat on the step and the step itself run the same computation)
    assert "/" in model["graph step"]["agrees_with_eager"] and set(model["same_greedy_answer"]) >= {"graph", "chat"}
    assert model["chat on the graph step"]["same_tokens_as_the_step"] is True
    assert model["graph step, every page processor"]["in_graph"] is True  # (not the host-side fallback)
    frozen = model["graph step, frozen"]  # (its tokens against the plain step's: reported; test_graph.py checks them)
    assert "/" in frozen["agrees_with_eager"] and isinstance(frozen["same_tokens_as_the_step"], bool)
    assert frozen["frozen"] is True
    # the step as the chat's defaults make it (`model.graph_fuse`): q/k/v and gate/up one matmul each (on a CPU the
    # default `model.graph_matvec` is cuBLAS's way: matmuls); its operators over 32 tokens: the eager prefill's 7
    # matmuls a layer and the head's, then 31 steps of 4 a layer and the head's
    assert model["graph step"]["fuse"] is True and model["graph step"]["matvec"] == "cublas"
    kernels, layers = model["graph step, kernels"], model["layers"]
    assert kernels["what"] == "cpu_op" and kernels["busy_ms_per_call"] > 0
    mm = next(t["per_call"] for t in kernels["top"] if t["name"] == "aten::mm")
    assert mm * 32 == 31 * (4 * layers + 1) + 7 * layers + 1
    recall = model["recall"]["2000"]  # (the largest bank: what the head and the span's replay run)
    assert {"aten::mm", "aten::addmv_"} & {t["name"] for t in recall["head_kernels"]["top"]}  # (the keys' product)
    assert recall["span_kernels"]["per_call"] > 15
    assert recall["lookup_ms"] > 0  # (the memory's token ids looked up: part of the recall, between head and span)
    steps = (recall["head_ms"] + recall["lookup_ms"] + recall["span_ms"]) / model["graph step"]["ms_per_token"]
    assert recall["decode_steps"] == pytest.approx(steps)
    step_ms = model["graph step"]["ms_per_token"]
    assert recall["decoder_recall_ms"] == pytest.approx(recall["decoder_recall_steps"] * step_ms)
    plain = model["graph step, variant: not fused"]  # (the same model, each module's own rows)
    assert plain["fuse"] is False and isinstance(plain["same_tokens_as_the_step"], bool)
    packed = model["graph step, variant: packed attention"]  # (a twin: 4 query heads on 2 key/value heads)
    assert packed["gqa"] == "packed" and model["graph step"]["gqa"] == "repeat" and packed["fuse"] is True
    assert isinstance(packed["same_tokens_as_the_step"], bool)
    tuned = model["graph step, variant: packed attention, autotuned"]  # (the candidates for the next defaults)
    assert tuned["autotune"] is True and tuned["gqa"] == "packed" and model["graph step"]["autotune"] is False
    for variant in (plain, packed, tuned):  # (each its recall's span, and a recall in its steps with the head's time)
        assert variant["span_ms"] > 0 and variant["recall_decode_steps"] > 0 and "span_replay_ms" not in variant
    assert {k for k in model if k.startswith("graph step, variant")} == {
        "graph step, variant: not fused", "graph step, variant: packed attention",
        "graph step, variant: packed attention, autotuned"}
    assert "span_replay_ms" not in recall  # (a CPU has no captured graph to replay)
    long = model["graph step, long cache"]  # (its time is measured, not checked: 6 tokens, 1 repeat under load can
    assert long["positions"] == 512 and isinstance(long["ms_per_token"], float)  # come out below zero)
    assert all(r["recalled_through_the_decoder"] and r["slots"] == 16 for r in model["recall"].values())
    sessions = model["sessions"]  # through the chat service: one alone on the graph step, two at once in the rows
    assert sessions["1"]["tokens"] == 6 and sessions["2"]["tokens"] == 12 and sessions["batch_forwards"] == 0
    assert sessions["1"]["on_the_single_step"] == 1 and sessions["2"]["on_the_single_step"] in (0, 1)  # (reported)
    assert sessions["rows_replays"] >= 5  # (the two sessions at once: their tokens after their first, in the rows)
    only = sessions["rows only"]  # every answer a row (the other policy): the lone session's 5 tokens after its first
    assert only["1"]["tokens"] == 6 and only["2"]["tokens"] == 12 and only["rows_replays"] >= 10
    assert only["1"]["on_the_single_step"] == only["2"]["on_the_single_step"] == 0
    assert "| tiny (smoke)" in (tmp_path / "results.md").read_text()

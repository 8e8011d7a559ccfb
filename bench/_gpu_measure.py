"""How `bench/gpu.py` runs and times a measure: the run's results, log and time budget (`Run`), device-synchronised
timing, the per-token time of an answer, and what a call runs on the device (`device_profile`)."""

from __future__ import annotations

import json
import statistics
import time
import traceback
from pathlib import Path

import torch

from bench._gpu_report import table


class Run:
    """The results so far, the log and the time budget."""

    def __init__(self, out: Path, budget: float):
        self.out, self.budget, self.t0 = out, budget, time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(out / "bench_gpu.log", "a")
        self.results: dict = {"models": {}}

    def log(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def measure(self, model: str, name: str, cost: float, fn) -> None:
        """Run one measure unless less than `cost` seconds of budget are left; record its result or its error."""
        into = self.results["models"].setdefault(model, {})
        if self.left() < cost:
            into[name] = {"skipped": f"time budget: {self.left():.0f} s left, needs about {cost:.0f} s"}
            self.log(f"{model} / {name}: skipped ({into[name]['skipped']})")
            return
        self.log(f"{model} / {name} ...")
        t = time.perf_counter()
        try:
            into[name] = fn()
        except Exception as e:  # noqa: BLE001 - one failed measure must not cost the others
            into[name] = {"error": f"{type(e).__name__}: {e}"}
            self.log(traceback.format_exc())
        self.log(f"{model} / {name}: {json.dumps(into[name])[:400]} ({time.perf_counter() - t:.1f} s)")
        self.save()

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1))
        (self.out / "results.md").write_text(table(self.results))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def device_profile(fn, calls: int = 1) -> dict:
    """What `fn` runs, a `calls`-th of it (torch.profiler): on a GPU its kernels (those inside a captured graph's
    replays too), on a CPU its operators: how many, their time in ms, and the 12 that take the most."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    events = [e for e in prof.events() if (e.device_type.name == "CUDA") == cuda and
              (not cuda or e.device_time_total > 0)]
    per: dict[str, list[float]] = {}
    for e in events:
        per.setdefault(e.name, []).append(e.device_time_total if cuda else e.self_cpu_time_total)
    total = sum(sum(v) for v in per.values())  # microseconds
    top = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {"what": "kernel" if cuda else "cpu_op", "calls": calls, "per_call": len(events) / calls,
            "busy_ms_per_call": total / calls / 1e3,
            "top": [{"name": k[:90], "per_call": len(v) / calls, "us_per_call": sum(v) / calls} for k, v in top]}


def per_token(run, n: int, repeats: int) -> dict:
    """{ms_per_token, ttft_ms}: (T(n) - T(1)) / (n - 1) and T(1), medians over `repeats`."""
    ones, rates = [], []
    for _ in range(repeats):
        one, many = timed(lambda: run(1)), timed(lambda: run(n))
        ones.append(one)
        rates.append((many - one) / (n - 1))
    return {"ms_per_token": statistics.median(rates) * 1e3, "ttft_ms": statistics.median(ones) * 1e3}

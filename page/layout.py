"""The page's layout: its components, and every event wired to its handler (`page.handlers`)."""

from __future__ import annotations

import gradio as gr

from chat.api import ChatService
from chat.banks import BANK_TYPES
from chat.service import EXAMPLE_IMAGES
from chat.session import Session
from chat.view import RECALL_COLUMNS
from page.controls import settings_tab
from page.handlers import Handlers

THEME = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],  # system fonts: nothing fetched
                          font_mono=["ui-monospace", "Consolas", "monospace"])
CSS = "#status {min-height: 1.6em} #answer .textfield {line-height: 1.9}"
MODEL_EVENTS = dict(concurrency_id="model", concurrency_limit=64)  # the service's queue runs them one at a time


def _memory_tab() -> dict[str, gr.Component]:
    c: dict[str, gr.Component] = {}
    c["bank_md"] = gr.Markdown(elem_id="bank-info", label="bank")
    c["bank_use"] = gr.Radio(["shared", "example", "own"], label="Use bank", value=None)
    c["bank_file"] = gr.File(label="Upload a bank (.pt, .safetensors, .npy)", file_types=list(BANK_TYPES),
                             type="filepath", height=110, elem_id="bank-upload")
    c["sample"] = gr.Dataframe(headers=["memory", "text", "slots", "key norm"], label="Entries (first 8)", interactive=False,
                               wrap=True, max_height=620, column_widths=["12%", "64%", "10%", "14%"])
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
            c["fmt"] = gr.Radio(list(BANK_TYPES), value=".pt", label="format (.npy: vector banks only, no texts)")
            c["download_btn"] = gr.Button("Save bank for download")
        c["bank_out"] = gr.File(label="Bank file", interactive=False)
    return c


def _about_tab() -> dict[str, gr.Component]:
    c: dict[str, gr.Component] = {}
    c["about_md"] = gr.Markdown(elem_id="about-info")
    c["about_query"] = gr.Textbox(label="Search your memories", elem_id="about-query")
    c["about"] = gr.Dataframe(headers=["id", "written", "text"], label="What you told me (newest first)",
                              interactive=False, wrap=True, max_height=300, column_widths=["22%", "22%", "56%"],
                              elem_id="about-list")
    with gr.Row():
        c["about_text"] = gr.Textbox(label="Remember (or the new text of the memory below)", scale=3,
                                     elem_id="about-text")
        c["about_add"] = gr.Button("Remember", scale=1, elem_id="about-add")
    with gr.Row():
        c["about_ids"] = gr.Textbox(label="Memory id(s)", scale=2, elem_id="about-ids")
        c["about_edit"] = gr.Button("Edit (one id)", scale=1, elem_id="about-edit")
        c["about_delete"] = gr.Button("Delete", variant="stop", scale=1, elem_id="about-delete")
    with gr.Row():
        c["about_all"] = gr.Button("Forget everything", variant="stop", elem_id="about-all")
        c["about_export"] = gr.Button("Export (JSON)")
        c["about_import"] = gr.UploadButton("Import (JSON)", file_types=[".json"], type="filepath")
    c["about_file"] = gr.File(label="Your memories", interactive=False)
    return c


def _conversation_tab() -> dict[str, gr.Component]:
    c: dict[str, gr.Component] = {}
    with gr.Row():
        c["regen"] = gr.Button("Regenerate", elem_id="regenerate")
        c["clear"] = gr.Button("Clear", elem_id="clear")
    c["save"] = gr.Button("Save conversation (JSON)")
    c["load"] = gr.UploadButton("Load conversation", file_types=[".json"], type="filepath")
    c["file"] = gr.File(label="Conversation file", interactive=False)
    return c


def build_demo(service: ChatService) -> gr.Blocks:
    """The page over `service`: every control wired to its handler, and each handler to its API name."""
    cfg, h = service.cfg, Handlers(service)
    # (the files a person downloads, a bank or their memories, leave Gradio's cache within half an hour)
    with gr.Blocks(title="recall chat", delete_cache=(900, 900)) as demo:
        # Plain functions, never bound methods: every page load deep-copies component props, and a
        # bound method would copy its object (the service and the model weights) with it.
        def new_session() -> Session:
            return service.new_session()

        def end_session(s: Session | None) -> None:
            service.end_session(s)

        # one Session per browser tab or API client, freed when the page closes; what it holds is freed after the idle
        # time to live by the janitor (`chat.janitor`), which keeps the object, so its next message can say so
        # (Gradio's own time_to_live replaced it with a new, empty one without a word)
        session = gr.State(new_session, delete_callback=end_session)
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
                with gr.Row(elem_id="memory-change"):  # what the last message wrote to the user's memory
                    change_md = gr.Markdown(visible=False, elem_id="change-note")
                    undo_btn = gr.Button("Undo", visible=False, size="sm", scale=0, elem_id="undo-change")
                with gr.Row():
                    recall_first = gr.Checkbox(cfg.app.recall_first, label="recall first: start every answer with "
                                               "<recall>", elem_id="recall-first")
                    example_btn = gr.Button("Build example bank", variant="primary", elem_id="build-example")
                vision = service.lm is None or service.lm.is_vision  # (an image example only for a model that reads it)
                gr.Examples([{"text": "Who keeps the lighthouse of Port Avel?", "files": []},
                             {"text": "When does the ferry to Lune Island leave?", "files": []}]
                            + [{"text": "What does this picture show?", "files": [str(EXAMPLE_IMAGES[0])]}] * vision,
                            inputs=[box], label="Try")
                answer = gr.HighlightedText(label="Last answer: memory markers show where memories were injected",
                                            combine_adjacent=False, show_legend=False, elem_id="answer")
                recall_log = gr.Dataframe(headers=RECALL_COLUMNS, label="Recall log (every injection)",
                                          interactive=False, wrap=True, max_height=240, elem_id="recall-log")
                decoding_plot = gr.Plot(label="How the last answer was decoded: entropy over layers (layer "
                                        "decoding) or α* per token (mixture)", visible=False, elem_id="decoding-plot")
            with gr.Column(scale=2):
                with gr.Tab("Memory"):
                    with gr.Accordion("About you: what you told me", open=True, elem_id="about-you"):
                        a = _about_tab()
                    with gr.Accordion("Banks", open=True):
                        m = _memory_tab()
                for tab in ("Decoding", "Recall", "Mixture"):
                    with gr.Tab(tab):
                        controls.update(settings_tab(cfg, tab))
                        if tab == "Decoding":
                            with gr.Accordion("More processors", open=False, elem_id="more-processors"):
                                controls.update(settings_tab(cfg, "More"))
                with gr.Tab("Conversation"):
                    c = _conversation_tab()

        if service.backend() == "llamacpp":  # (what llama.cpp cannot run: `decoding.backend.require`)
            for name in ("entropy_decoding", "entropy_record_tokens", "mixture", "guidance_scale", "negative_prompt"):
                controls[name].interactive = False
                controls[name].info = "runs on transformers (model.backend: transformers); this server runs llama.cpp"
        auto_alpha = controls["mixture_alpha_auto"]
        auto_alpha.change(lambda auto: gr.Slider(interactive=not auto), auto_alpha, controls["mixture_alpha"],
                          api_visibility="private", queue=False)
        view = [chatbot, answer, recall_log, status]
        bank_outputs = [m["bank_md"], m["sample"], status, m["bank_use"]]
        # (`shown`: the messages the page shows, to tell its next message when the server no longer holds them)
        sent = box.submit(h.chat, [box, recall_first, session], [*view, decoding_plot, box],
                          inputs_kwargs={**controls, "shown": chatbot}, api_name="chat", **MODEL_EVENTS)
        box.stop(h.stop, session, status, api_name="stop", concurrency_limit=None)
        c["regen"].click(h.regenerate, [session], [*view, decoding_plot], inputs_kwargs=controls,
                         api_name="regenerate", **MODEL_EVENTS)
        c["clear"].click(h.clear, session, [*view, c["file"]], api_name="clear", concurrency_limit=None)
        # (the chatbot's own trash icon emptied the page alone: the next message read the old turns again)
        chatbot.clear(h.clear, session, [*view, c["file"]], api_visibility="private", concurrency_limit=None)
        c["save"].click(h.save_conversation, session, [c["file"], status], api_name="save_conversation")
        c["load"].upload(h.load_conversation, [c["load"], session], view, api_name="load_conversation")
        example_btn.click(h.build_example, session, bank_outputs, api_name="build_example_bank", **MODEL_EVENTS)
        _wire_banks(h, m, session, bank_outputs, status)
        about, q = _wire_about(h, a, session, status)
        sent.then(h.about_list, [session, q], about[:2], api_visibility="private").then(  # what the message wrote
            h.change_row, session, [change_md, undo_btn], api_visibility="private")
        undo_btn.click(h.undo_change, [q, session], [*about, change_md, undo_btn], api_name="undo_memory_change",
                       **MODEL_EVENTS)
        demo.load(h.on_load, session, bank_outputs, api_visibility="private", **MODEL_EVENTS).then(
            h.about_list, session, about[:2], api_visibility="private")
        demo.unload(h.unload)
    return demo


def _wire_banks(h: Handlers, m: dict, session: gr.State, bank_outputs: list, status: gr.Markdown) -> None:
    """The Banks accordion's events: upload, choose, write, find, delete, download."""
    m["bank_file"].upload(h.upload_bank, [m["bank_file"], session], [*bank_outputs, m["bank_file"]],
                          api_name="upload_bank")
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


def _wire_about(h: Handlers, a: dict, session: gr.State, status: gr.Markdown) -> tuple[list, gr.Textbox]:
    """The "About you" accordion's events: search, remember, edit, delete, forget all, export, import; returns its
    outputs and its search box (the chat refreshes them after a message)."""
    about = [a["about_md"], a["about"], status]
    q = a["about_query"]
    q.change(h.about_view, [session, q], about, api_name="my_memories")
    a["about_add"].click(h.remember, [a["about_text"], q, session], about, api_name="remember", **MODEL_EVENTS)
    a["about_edit"].click(h.edit_memory, [a["about_ids"], a["about_text"], q, session], about,
                          api_name="edit_memory", **MODEL_EVENTS)
    a["about_delete"].click(h.forget_memories, [a["about_ids"], q, session], about, api_name="forget_memories")
    a["about_all"].click(h.forget_everything, [q, session], about, api_name="forget_all_memories")
    a["about_export"].click(h.export_memories, session, [a["about_file"], status], api_name="export_memories")
    a["about_import"].upload(h.import_memories, [a["about_import"], q, session], about, api_name="import_memories",
                             **MODEL_EVENTS)
    return about, q

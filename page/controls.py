"""The page's settings: one table (`CONTROLS`) that lays out the Decoding, Recall and Mixture tabs and maps every
request's control values onto the configuration's settings."""

from __future__ import annotations

from typing import Any

import gradio as gr

from chat.config import Config, request_settings, setting_value
from decoding.settings import DRAFTS, GAMMA_RULES, GenerationSettings, RecallSettings

# The settings on the page, one row each: API parameter name -> (setting, tab, control for its value and the
# config[, (control value, every control's value) -> setting value]). The same table lays out the page and maps
# every request's values onto the settings.
ENTROPY_MODES = {"off": None, "trough": "trough", "random_after": "random_after"}
CONTROLS: dict[str, tuple] = {
    "do_sample": ("generation.do_sample", "Decoding", lambda v, cfg: gr.Checkbox(v, label="sampling (off = greedy)")),
    "temperature": ("generation.temperature", "Decoding",
                    lambda v, cfg: gr.Slider(0.05, 2, v, step=0.05, label="temperature (sampling; greedy: "
                                             "sampling off)")),
    "top_k": ("generation.top_k", "Decoding", lambda v, cfg: gr.Slider(0, 200, v, step=1, precision=0,
                                                                       label="top-k (0 = off)")),
    "top_p": ("generation.top_p", "Decoding", lambda v, cfg: gr.Slider(0, 1, v, step=0.01, label="top-p (1 = off)")),
    "min_p": ("generation.min_p", "Decoding", lambda v, cfg: gr.Slider(0, 1, v, step=0.01, label="min-p (0 = off)")),
    "typical_p": ("generation.typical_p", "Decoding",
                  lambda v, cfg: gr.Slider(0.01, 1, v, step=0.01, label="typical-p (1 = off)")),
    "repetition_penalty": ("generation.repetition_penalty", "Decoding",
                           lambda v, cfg: gr.Slider(0.01, 2, v, step=0.01, label="repetition penalty (1 = off)")),
    "no_repeat_ngram_size": ("generation.no_repeat_ngram_size", "Decoding",
                             lambda v, cfg: gr.Slider(0, 10, v, step=1, precision=0,
                                                      label="no-repeat n-gram size (0 = off)")),
    "max_new_tokens": ("generation.max_new_tokens", "Decoding",  # no more than a request may ask for
                       lambda v, cfg: gr.Slider(1, cfg.app.max_new_tokens_cap, v, step=1, precision=0,
                                                label="max new tokens")),
    # (a text box: Gradio's Number shows and sends 0 for an empty value, so every answer drew with seed 0)
    "seed": ("generation.seed", "Decoding",
             lambda v, cfg: gr.Textbox("" if v is None else str(v), label="seed (empty = random)", elem_id="seed"),
             lambda text, values: _seed(text)),
    "entropy_decoding": ("generation.entropy_decoding", "Decoding",
                         lambda v, cfg: gr.Radio(list(ENTROPY_MODES), value="off" if v is None else v,
                                                 label="layer each token is decoded from: the last (off), the one "
                                                       "whose next-token distribution has the least entropy "
                                                       "(trough), or one drawn from there to the last (random_after)",
                                                 elem_id="entropy-mode"),
                         lambda choice, values: ENTROPY_MODES.get(choice, choice)),
    "entropy_record_tokens": ("generation.entropy_record_tokens", "Decoding",
                              lambda v, cfg: gr.Checkbox(v, label="layer decoding: write each layer's own next token "
                                                                  "in the picture", elem_id="entropy-tokens")),
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
                      lambda v, cfg: gr.Radio(_drafts(cfg), value=v, label="draft: gguf = llama.cpp on a quantized "
                                                                          "copy, theta / target = one of the two "
                                                                          "models, ngram = prompt lookup, head = a "
                                                                          "trained EAGLE head")),
    "mixture_gamma": ("mixture.gamma", "Mixture",
                      lambda v, cfg: gr.Slider(1, 8, v, step=1, precision=0, label="γ: drafted tokens per verify")),
    "mixture_gamma_rule": ("mixture.gamma_rule", "Mixture",
                           lambda v, cfg: gr.Radio(list(GAMMA_RULES), value=v, label="γ each round: fixed, seed = "
                                                   "from α* (seed 003's adaptive k), acceptance = from the last "
                                                   "rounds' kept drafts; within max(3, γ-2) .. min(10, γ+3)")),
    # the rest of seed 004's catalogue that takes plain values, in the Decoding tab's "More processors" (token-id
    # lists, a prefix function and the encoder penalties stay in the configuration and the API's `settings`)
    "stop_strings": ("generation.stop_strings", "More",
                     lambda v, cfg: gr.Textbox("\n".join(v), lines=2, label="stop strings, one a line: the answer "
                                               "ends after the first one it writes", elem_id="stop-strings"),
                     lambda text, values: tuple(line for line in (text or "").splitlines() if line)),
    "min_new_tokens": ("generation.min_new_tokens", "More",
                       lambda v, cfg: gr.Slider(0, cfg.app.max_new_tokens_cap, v, step=1, precision=0,
                                                label="min new tokens: no end of text before (0 = off)")),
    "epsilon_cutoff": ("generation.epsilon_cutoff", "More",
                       lambda v, cfg: gr.Slider(0, 0.01, v, step=0.0001, label="epsilon cutoff: drop tokens under this "
                                                "probability when sampling (0 = off; 3e-4 to 9e-4 is usual)")),
    "eta_cutoff": ("generation.eta_cutoff", "More",
                   lambda v, cfg: gr.Slider(0, 0.01, v, step=0.0001, label="eta cutoff: entropy-dependent epsilon when "
                                            "sampling (0 = off)")),
    "guidance_scale": ("generation.guidance_scale", "More",
                       lambda v, cfg: gr.Slider(0, 3, v, step=0.05, label="classifier-free guidance scale: the answer "
                                                "against the model without the conversation (1 = off)",
                                                elem_id="guidance-scale")),
    "negative_prompt": ("generation.negative_prompt", "More",
                        lambda v, cfg: gr.Textbox(v or "", label="negative prompt: what guidance steers away from "
                                                  "(empty = the model alone)"),
                        lambda text, values: (text or "").strip() or None),
    "watermark": ("generation.watermark", "More",
                  lambda v, cfg: gr.Checkbox(v, label="watermark the answer (Kirchenbauer et al.'s green-list bias)")),
    "max_time": ("generation.max_time", "More",
                 lambda v, cfg: gr.Slider(0, 600, v or 0, step=1, precision=0, label="time limit of an answer, in "
                                          "seconds (0 = none)"),
                 lambda seconds, values: seconds or None),
    "recall_enabled": ("recall.enabled", "Recall", lambda v, cfg: gr.Checkbox(v, label="recall enabled")),
    "recall_sampling": ("recall.use_sampling", "Recall",
                        lambda v, cfg: gr.Checkbox(v, label="sample the memory (off = most similar)")),
    "recall_temperature": ("recall.temperature", "Recall",
                           lambda v, cfg: gr.Slider(0.05, 2, v, step=0.05, label="memory temperature (sampling)")),
    "recall_top_k": ("recall.top_k", "Recall",
                     lambda v, cfg: gr.Slider(0, 50, v, step=1, precision=0, label="memory top-k (0 = all)")),
    "recall_top_p": ("recall.top_p", "Recall",
                     lambda v, cfg: gr.Slider(0.01, 1, v, step=0.01, label="memory top-p (1 = off)")),
    "recall_min_score": ("recall.min_score", "Recall",
                         lambda v, cfg: gr.Slider(-1, 1, v, step=0.01, label="memory min score: under it nothing "
                                                  "fits, the model answers from what it knows (-1 = off)")),
}


def _drafts(cfg: Config) -> list[str]:
    """The drafts this server can run: `head` only with a trained head (`generation.mixture.head`)."""
    head = cfg.generation.mixture.head is not None
    return [d for d in DRAFTS if d != "head" or head]


def settings_tab(cfg: Config, tab: str) -> dict[str, gr.Component]:
    """The controls of one tab, at the configuration's values."""
    return {name: row[2](setting_value(cfg, row[0]), cfg) for name, row in CONTROLS.items() if row[1] == tab}


def _seed(text: Any) -> int | None:
    """The seed box: empty (or None from an API client) = a new random seed each answer, else an integer."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    try:
        return int(text.strip() if isinstance(text, str) else text)
    except (TypeError, ValueError):
        raise ValueError(f"seed: expected an integer from 0 to 2**64 - 1, or empty for a random one, "
                         f"got {text!r}") from None


def settings(cfg: Config, values: dict[str, Any]) -> tuple[GenerationSettings, RecallSettings]:
    """A request's settings from its control values (by API parameter name); `ValueError` naming a wrong one."""
    parse = lambda name, value: CONTROLS[name][3](value, values) if len(CONTROLS[name]) > 3 else value  # noqa: E731
    return request_settings(cfg, {CONTROLS[name][0]: parse(name, value) for name, value in values.items()})

"""Every slider of the page reaches only values its setting accepts: a slider end the server refuses is a control
that fails when a person moves it all the way (the memory top-p slider went down to 0; the server takes (0, 1]).
Every choice of a radio is one the server takes, and reaches its setting."""

from __future__ import annotations

import gradio as gr
import pytest

from chat.config import load_config, setting_value
from page.controls import CONTROLS, settings


CFG = load_config(environ={})
PAGE = {name: row[2](setting_value(CFG, row[0]), CFG) for name, row in CONTROLS.items()}


@pytest.mark.parametrize("name", sorted(n for n, c in PAGE.items() if isinstance(c, gr.Slider)))
def test_every_slider_end_is_a_value_the_server_accepts(name):
    cfg, page = CFG, PAGE
    values = {n: c.value for n, c in page.items()}
    if name == "mixture_alpha":
        values["mixture_alpha_auto"] = False  # the slider counts only when α is not automatic
    if name == "min_new_tokens":  # (at most max_new_tokens, whose slider goes as far)
        values["max_new_tokens"] = page["max_new_tokens"].maximum
    for end in (page[name].minimum, page[name].maximum):
        settings(cfg, {**values, name: end})  # raises ValueError naming the setting when the server refuses it
        # and with sampling on, where a temperature of 0 was refused
        settings(cfg, {**values, "do_sample": True, "recall_sampling": True, name: end})


@pytest.mark.parametrize("name", sorted(n for n, c in PAGE.items() if isinstance(c, gr.Radio)))
def test_every_radio_choice_is_a_value_the_server_accepts(name):
    values = {n: c.value for n, c in PAGE.items()}
    for _, choice in PAGE[name].choices:
        settings(CFG, {**values, name: choice})


def test_the_gamma_rule_radio_reaches_the_mixture():
    values = {n: c.value for n, c in PAGE.items()}
    assert values["mixture_gamma_rule"] == "fixed"
    assert settings(CFG, {**values, "mixture_gamma_rule": "seed"})[0].mixture.gamma_rule == "seed"


def test_the_seed_box_starts_empty_and_empty_is_a_random_seed():
    """Gradio's Number showed and sent 0 for the configured `seed: null`, so "Regenerate" with sampling on drew the
    same answer every time. The box starts empty; empty (or None from an API client) is no seed; a number is that
    seed; anything else is refused by name."""
    values = {n: c.value for n, c in PAGE.items()}
    assert CFG.generation.seed is None and values["seed"] == ""
    assert settings(CFG, values)[0].seed is None and settings(CFG, {**values, "seed": None})[0].seed is None
    assert settings(CFG, {**values, "seed": " 42 "})[0].seed == 42 and settings(CFG, {**values, "seed": 7})[0].seed == 7
    with pytest.raises(ValueError, match=r"seed: expected an integer from 0 to 2\*\*64 - 1, or empty .* got 'abc'"):
        settings(CFG, {**values, "seed": "abc"})
    with pytest.raises(ValueError, match=r"seed is 1180591620717411303424: must be from 0 to 2\*\*64 - 1"):
        settings(CFG, {**values, "seed": str(2 ** 70)})


def test_the_more_tab_reaches_the_rest_of_the_catalogue():
    """Stop strings one a line, an empty negative prompt as none, a time limit of 0 as none; each control reaches
    its setting, and what the settings refuse together (a negative prompt without guidance) is refused by name."""
    values = {n: c.value for n, c in PAGE.items()}
    plain = settings(CFG, values)[0]
    assert plain.stop_strings == () and plain.negative_prompt is None and plain.max_time is None
    more = settings(CFG, {**values, "stop_strings": "The end\n\n###\n", "max_time": 30, "guidance_scale": 1.5,
                          "negative_prompt": "  a rude reply ", "min_new_tokens": 5, "epsilon_cutoff": 0.0003,
                          "eta_cutoff": 0.0009, "watermark": True})[0]
    assert more.stop_strings == ("The end", "###") and more.max_time == 30 and more.guidance_scale == 1.5
    assert more.negative_prompt == "a rude reply" and more.min_new_tokens == 5 and more.watermark
    assert (more.epsilon_cutoff, more.eta_cutoff) == (0.0003, 0.0009)
    with pytest.raises(ValueError, match="negative_prompt is 'no'.*guidance_scale"):
        settings(CFG, {**values, "negative_prompt": "no"})


def test_the_head_draft_is_offered_only_with_a_trained_head():
    """A `head` draft with no `generation.mixture.head` failed every answer; it is on the page when there is one."""
    from page.controls import _drafts

    assert "head" not in _drafts(CFG) and "gguf" in _drafts(CFG)
    with_head = load_config(overrides=["generation.mixture.head=/some/head"], environ={})
    assert "head" in _drafts(with_head)

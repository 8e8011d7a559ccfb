"""What the model reads of a conversation: the earlier turns (`app.history_turns`), the tokens (`app.max_input_tokens`
and the model's context less the answer's), and what happens past them (`app.context_overflow`): the oldest turns
leave what it reads, still shown and saved, or the message is refused naming the sizes. A client's own history (the
OpenAI API's `messages`) is read within them from the start."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from chat.config import AppConfig
from chat.inputs import Limits
from chat.session import Conversation, Message
from chat.worker import Notice, ServiceError
from decoding.settings import GenerationSettings


class Window:
    """The limits of what the model reads (`turns`: the earlier turns read with a new message; 0: all)."""

    def __init__(self, app: AppConfig, limits: Limits, turns: int):
        self.app, self.limits, self.turns = app, limits, turns

    def budget(self, conv: Conversation, settings: GenerationSettings) -> tuple[int, int]:
        """(the most tokens the conversation may have before its answer, the model's context)."""
        context = conv.lm.spec.context or 2 ** 31
        return min(self.limits.max_input_tokens, context - settings.max_new_tokens), context

    def slide(self, conv: Conversation) -> Iterator[Notice]:
        """Past `turns` earlier turns, move the oldest out of what the model reads (the page still shows them) down
        to half of them, at once: the turns kept are read again (their positions move), so once every few turns.
        The first time in a conversation, a notice says so."""
        if self.turns and len(conv.messages) > 2 * self.turns:
            first = not conv.earlier
            conv.drop_oldest_turns((len(conv.messages) - 2 * (self.turns // 2) + 1) // 2)
            if first:
                yield Notice(f"from here the model reads at most your last {self.turns} turns (app.history_turns); "
                             "the earlier ones stay in the conversation, and what you told it stays in your memory")

    def fit(self, conv: Conversation, text: str, images: Sequence[str], settings: GenerationSettings,
            recall_first: bool) -> int:
        """Make the conversation fit the limits with this message (drop the oldest turns when configured, as many
        at once as cover what is over); returns how many turns were dropped, or raises naming the limit and the
        size."""
        budget = self.budget(conv, settings)[0]
        dropped = 0
        while (need := conv.length_with(text, images, recall_first)) > budget:
            turns = len(conv.messages) // 2
            if self.app.context_overflow != "drop_oldest" or not turns:
                raise self.too_long(conv, need, settings)
            starts = [m.start for m in conv.messages[2::2]] + [len(conv.ids)]  # (where each turn after the first
            over = need - budget  # starts: the turns to drop, at once, whose tokens cover what is over; read again)
            k = next((k for k in range(1, turns + 1) if starts[k - 1] >= over), turns)
            conv.drop_oldest_turns(k)
            dropped += k
        return dropped

    def too_long(self, conv: Conversation, need: int, settings: GenerationSettings,
                 at_least: bool = False) -> ServiceError:
        """The refusal of a conversation of `need` tokens with its new message (`at_least`: counted by its texts)."""
        budget, context = self.budget(conv, settings)
        if budget == self.limits.max_input_tokens:  # the configured cap, under the model's context
            why, api = "app.max_input_tokens", "the server's app.max_input_tokens"
        else:
            why = f"the model's context of {context} tokens less max_new_tokens={settings.max_new_tokens}"
            api = (f"the model's context of {context} tokens less the {settings.max_new_tokens} kept for the answer, "
                   "max_tokens")
        got = f"at least {need}" if at_least else f"{need}"
        return ServiceError(f"the conversation would have {got} tokens with this message, over the limit of {budget} "
                            f"({why}): clear the conversation or send less",
                            api=f"messages: expected at most {budget} tokens ({api}), got {got}")

    def read(self, conv: Conversation, history: Sequence[tuple[str, str, Sequence[str]]], text: str,
             settings: GenerationSettings) -> int:
        """The earlier messages of a conversation its client keeps (role, text, image paths), before its new message
        `text`: the system prompt, user messages, answers given as text. Only those the model can read are read:
        past `turns`, and past the budget by their texts alone (a lower bound: refused at once, or with
        `context_overflow: drop_oldest` left out), the older turns are kept as shown, never read, as `slide` and
        `fit` would move them (499 long messages read one by one, then dropped a turn at a time, held the model for
        many minutes). Returns how many messages are not read."""
        for role, past, _ in history:
            if role == "system":
                conv.system_prompt = past
        turns = [(role, past, images) for role, past, images in history if role != "system"]
        cut = len(turns) - 2 * (self.turns // 2) if len(turns) > 2 * self.turns > 0 else 0
        tok, budget = conv.lm.tokenizer, self.budget(conv, settings)[0]
        need, fits = len(tok(text, add_special_tokens=False)["input_ids"]), len(turns)
        for j in range(len(turns) - 1, cut - 1, -1):  # (newest first, until the budget is past: its text alone)
            need += len(tok(turns[j][1], add_special_tokens=False)["input_ids"])
            if need > budget:
                break
            fits = j
        if fits > cut and need > budget:
            if self.app.context_overflow != "drop_oldest":
                raise self.too_long(conv, need, settings, at_least=True)
            cut = fits
        while cut < len(turns) and turns[cut][0] != "user":  # (what is read starts with a user's message)
            cut += 1
        conv.earlier += [(Message(role, past, list(images)), (past,) if role == "assistant" and past else ())
                         for role, past, images in turns[:cut]]
        for role, past, images in turns[cut:]:
            if role == "user":
                conv.build_inputs(past, images)
            else:
                conv.add_answer_text(past)
        return cut

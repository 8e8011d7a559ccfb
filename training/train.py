"""Train the embedded SmolLM2 to recall: a LoRA adapter, the new tokens' rows and a memory projector.

    python -m training.train --out assets/recall-smollm2            # the shipped adapter (CPU, about 1 h)
    python -m training.train --out /tmp/a --set steps=50            # any recipe field, as KEY=VALUE

The base weights stay frozen. One step: each fact question's memory is the fact's value in a value
kind drawn per example (`tokens`: the text's own token embeddings, a slot a token; `chunks:N`: the
mean of N token embeddings a slot; `mean`: one slot), the compressed kinds through the memory
projector; the k slots follow `<recall>` and `</recall>` closes them, exactly as the generation loop
injects them; and the losses are
  (a) cross-entropy of the answer read from the injected memory (its value tokens weighted more),
  (b) cross-entropy of the recall decision: `<recall>` after a fact question, the base model's own
      first token after an ordinary prompt; on the rest of that reply, the KL divergence from the
      base model's own next-token distribution (adapter off), to keep general quality.
Questions and prompts sometimes follow an earlier ordinary turn (`history`), so recall is learnt in
the middle of a conversation too. Which memory to recall is the key encoder's job
(`training/keys.py`), not the adapter's. A fixed seed makes a run repeatable on the same machine;
the losses go to `training_log.csv`, with held-out measures every `eval_every` steps and at step 0.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from tqdm.auto import tqdm

from decoding.memory import inject_memories
from models.encoder import MemoryEncoder, MemoryProjector, ValueKind
from models.modeling import backbone_and_head, head_logits
from models.text_keys import TextEncoder
from training.data import IGNORE, Batch, BatchRecipe, answer_ids, batches, prompt_ids, value_tokens
from training.facts import chat_prompts, general_questions, make_facts
from training.losses import masked_means


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    steps: int = 320  # 7-12 s a step on 2 CPU cores: about an hour
    facts_per_batch: int = 12  # fact questions a step
    chats_per_batch: int = 5  # negatives
    repeats_per_batch: int = 1  # facts of the batch also asked to be repeated whole (autoencoding)
    chat_prompts: int = 400  # distinct ordinary prompts, answered once by the base model
    history: float = 0.3  # share of questions and prompts that follow an earlier ordinary turn
    people_per_batch: int = 0  # things people told about themselves, each asked three ways (`training.data`)
    general_questions: int = 0  # general knowledge questions among the ordinary prompts (`training.facts`)
    wrong_reads: bool = True  # people's things also read from another memory, answered "you haven't told me"
    init: str | None = None  # an adapter folder to go on training from (its LoRA, new rows and projector)
    reply_tokens: int = 32  # length of those answers
    values: tuple[str, ...] = ("tokens", "chunks:2", "chunks:4", "mean")  # value kinds a memory is read in
    value_weights: tuple[float, ...] = (0.3, 0.1, 0.2, 0.4)  # how often each (tokens are read almost untrained)
    lr: float = 8e-4
    projector_lr: float = 2.4e-3
    warmup: int = 30
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    projector_inner: int = 1152
    w_answer: float = 1.0
    w_value: float = 3.0  # weight of the answer's value tokens within the answer loss (only the memory knows them)
    w_decision: float = 1.0
    w_reply: float = 2.0  # KL from the base model on ordinary replies
    eval_every: int = 80
    eval_facts: int = 64

    def __post_init__(self):
        for name in ("steps", "facts_per_batch", "lora_r", "projector_inner"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} is {getattr(self, name)}: must be >= 1")
        if not 0 <= self.history <= 1:
            raise ValueError(f"history is {self.history}: must be in [0, 1]")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        object.__setattr__(self, "values", tuple(self.values))
        object.__setattr__(self, "value_weights", tuple(float(w) for w in self.value_weights))
        if len(self.values) != len(self.value_weights) or not self.values:
            raise ValueError(f"values {self.values} and value_weights {self.value_weights}: one weight a kind")
        for kind in self.values:
            if ValueKind.parse(kind).kind not in ("tokens", "chunks", "mean"):
                raise ValueError(f"values: {kind!r} is not trained here; kinds: tokens, chunks:N, mean")


def lr_at(step: int, recipe: Recipe) -> float:
    """Linear warm-up, then cosine decay to 10 %."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    t = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def replies(model, tok, prompts: list[str], max_new_tokens: int, batch_size: int = 16, desc: str | None = "replies",
            **generate) -> list[list[int]]:
    """`model`'s replies to chat prompts (ids, up to and with EOS), `batch_size` left-padded prompts a
    `generate` call with the `generate` keywords (no progress bar when `desc` is None)."""
    out, device = [], next(model.parameters()).device
    for s in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch", disable=desc is None):
        seqs = [prompt_ids(tok, p) for p in prompts[s:s + batch_size]]
        width = max(map(len, seqs))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(q)) + q for q in seqs])
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in seqs])
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **generate)
        for row in gen[:, width:].tolist():
            out.append(row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return out


def base_replies(lm, prompts: list[str], max_new_tokens: int, batch_size: int = 16) -> dict[str, list[int]]:
    """The base model's own greedy replies (self-distillation targets for the negatives)."""
    banned = [[t] for t in (lm.tokens.recall, lm.tokens.recall_end, lm.tokens.memory_pad)]
    return dict(zip(prompts, replies(lm.model, lm.tokenizer, prompts, max_new_tokens, batch_size, "base replies",
                                     do_sample=False, bad_words_ids=banned)))


def memory_values(model, encoder: MemoryEncoder, memories: list[tuple[list[int], str]]) -> torch.Tensor:
    """The input embeddings of every memory slot of a batch, in row order [sum k, H] (differentiable in the
    projector): each memory's value in its kind, through the memory embedding."""
    parts = []
    for ids, kind in memories:
        kind = ValueKind.parse(kind)
        parts.append(encoder.embedding(encoder.with_values(kind).token_values(model, ids), kind))
    return torch.cat(parts)


def step_losses(model, encoder: MemoryEncoder, batch: Batch, special: tuple[int, int],
                recipe: Recipe) -> dict[str, torch.Tensor]:
    """The losses of one batch (see the module docstring); `special`: the ids of <recall> and <|memory_pad|>."""
    recall_id, memory_pad = special
    device = next(model.parameters()).device
    backbone, head = backbone_and_head(model)
    b = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                                      if isinstance(getattr(batch, f.name), torch.Tensor)})
    embeds = inject_memories(model.get_input_embeddings()(b.input_ids), b.input_ids, memory_pad,
                             memory_values(model, encoder, b.memories))
    hidden = backbone(inputs_embeds=embeds, use_cache=False).last_hidden_state  # [B, S, H]

    rows = torch.arange(len(b.input_ids), device=device)
    reads = len(b.memories)  # the first rows read a memory, the others are ordinary replies
    kind = torch.full_like(b.labels, -1)  # 0 decision, 1 answer (from memory, or saying there is none), 2 reply
    kind[b.labels != IGNORE] = 2
    kind[:reads] = torch.where(b.labels[:reads] != IGNORE, 1, -1)
    kind[b.answered] = torch.where(b.labels[b.answered] != IGNORE, 1, -1)
    kind[rows, b.decision] = 0
    sel = kind >= 0
    logits = head_logits(model, head, hidden[sel])  # [N, V] only where a token is predicted
    suppressed = torch.zeros_like(b.labels, dtype=torch.bool)  # decisions made as `NoMemory` makes them
    suppressed[rows, b.decision] = b.no_recall
    if bool(suppressed.any()):
        banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=device)
        banned[[recall_id, memory_pad]] = True
        logits = logits.masked_fill(suppressed[sel][:, None] & banned, -float("inf"))
    token_loss = F.cross_entropy(logits, b.labels[sel], reduction="none")  # [N]
    decision, _, _ = masked_means(token_loss, kind[sel], 3)
    reply = _base_kl(model, backbone, b.input_ids, kind == 2, logits[kind[sel] == 2], head)
    weight = (1 + (recipe.w_value - 1) * b.value[sel].float()) * (kind[sel] == 1)  # [N]
    answer = (token_loss * weight).sum() / weight.sum().clamp_min(1)
    with torch.no_grad():
        correct = logits.argmax(-1) == b.labels[sel]
    total = recipe.w_decision * decision + recipe.w_answer * answer + recipe.w_reply * reply
    return {"loss": total, "decision": decision, "answer": answer, "reply": reply,
            "decision_acc": correct[kind[sel] == 0].float().mean(), "answer_acc": correct[kind[sel] == 1].float().mean()}


def _base_kl(model, backbone, input_ids: torch.Tensor, where: torch.Tensor, logits: torch.Tensor, head) -> torch.Tensor:
    """Mean KL(base ‖ adapted) of the next-token distributions at the positions `where` [B, S] (ordinary
    replies, whose adapted logits [N, V] are given): the base model is the PEFT model, adapter off."""
    rows = where.any(dim=1)
    if not bool(rows.any()):
        return logits.sum() * 0
    with torch.no_grad(), model.disable_adapter():
        hidden = backbone(input_ids=input_ids[rows], use_cache=False).last_hidden_state
        base = head_logits(model, head, hidden[where[rows]]).float().log_softmax(-1)  # [N, V]
    return F.kl_div(logits.float().log_softmax(-1), base, log_target=True, reduction="batchmean")


@torch.no_grad()
def value_reading(model, tokenizer, tokens, encoder: MemoryEncoder, facts, kind: str) -> dict[str, float]:
    """How well the answers' value tokens are read from memories of `kind`, teacher-forced: their mean NLL
    with each fact's own memory (`right`) and with another fact's (`wrong`: the gap is what the model reads
    from memory), and the share of facts whose value tokens are all the argmax (`exact`)."""
    device = next(model.parameters()).device
    backbone, head = backbone_and_head(model)
    out = {}
    for wrong in (False, True):
        nll, count, exact = 0.0, 0, 0
        for i, fact in enumerate(facts):
            memory = facts[(i + 1) % len(facts)] if wrong else fact
            values = memory_values(model, encoder, [(tokenizer(memory.text, add_special_tokens=False)["input_ids"],
                                                     kind)])
            prompt, answer = prompt_ids(tokenizer, fact.questions[0]), answer_ids(tokenizer, fact.answer)
            ids = torch.tensor([prompt + [tokens.recall] + [tokens.memory_pad] * len(values) + [tokens.recall_end]
                                + answer], device=device)
            embeds = inject_memories(model.get_input_embeddings()(ids), ids, tokens.memory_pad, values)
            logp = head_logits(model, head, backbone(inputs_embeds=embeds).last_hidden_state[0]).log_softmax(-1)
            start = len(prompt) + len(values) + 1  # the </recall> position predicts the first answer token
            hits = []
            for j in value_tokens(tokenizer, fact.answer, fact.value):
                nll -= float(logp[start + j, answer[j]])
                hits.append(int(logp[start + j].argmax()) == answer[j])
            count += len(hits)
            exact += bool(hits) and all(hits)
        out["wrong" if wrong else "right"] = nll / max(count, 1)
        if not wrong:
            out["exact"] = exact / len(facts)
    return out


@torch.no_grad()
def quick_eval(model, tokenizer, tokens, encoder: MemoryEncoder, n: int, seed: int,
               kinds: tuple[str, ...] = ("tokens", "mean")) -> dict[str, float]:
    """Held-out facts (entities and templates never trained on): p(<recall>) after fact questions vs
    ordinary prompts, and for each value kind in `kinds` how well 32 of them are read (`value_reading`)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    backbone, head = backbone_and_head(model)
    facts = make_facts(n, "eval", seed)
    p = {}
    for name, prompts in (("fact", [f.questions[0] for f in facts]), ("chat", chat_prompts(n, "eval", seed))):
        probs = []
        for prompt in prompts:
            h = backbone(input_ids=torch.tensor([prompt_ids(tokenizer, prompt)], device=device)).last_hidden_state[0, -1]
            probs.append(float(head_logits(model, head, h).softmax(-1)[tokens.recall]))
        p[name] = sum(probs) / len(probs)
    out = {"eval_p_recall_fact": p["fact"], "eval_p_recall_chat": p["chat"]}
    for kind in kinds:
        reading = value_reading(model, tokenizer, tokens, encoder, facts[:32], kind)
        out.update({f"eval_{kind}_nll": reading["right"], f"eval_{kind}_nll_wrong": reading["wrong"],
                    f"eval_{kind}_exact": reading["exact"]})
    model.train(was_training)
    return out


def train(lm, recipe: Recipe, out: Path, log_every: int = 10, keys: TextEncoder | None = None):
    """Train on `lm` (a loaded model with the recall tokens, no adapter); write the adapter to `out`.

    Returns (the PEFT model, wrapping `lm.model` in place, and the trained memory encoder, whose keys come
    from `keys`, the shipped key encoder by default)."""
    from peft import LoraConfig, get_peft_model

    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    out.mkdir(parents=True, exist_ok=True)
    tok, tokens = lm.tokenizer, lm.tokens
    prompts = chat_prompts(recipe.chat_prompts, "train", recipe.seed) + general_questions(recipe.general_questions)
    replies = base_replies(lm, prompts, recipe.reply_tokens)

    config = LoraConfig(r=recipe.lora_r, lora_alpha=recipe.lora_alpha, lora_dropout=0.0,
                        target_modules=list(recipe.lora_targets),
                        trainable_token_indices=[tokens.recall, tokens.recall_end, tokens.memory_pad])
    if recipe.init:
        from peft import PeftModel

        model = PeftModel.from_pretrained(lm.model, recipe.init, is_trainable=True)
        projector = MemoryEncoder.load(recipe.init, lm.hidden_size).projector.to(lm.device).requires_grad_(True)
    else:
        model = get_peft_model(lm.model, config)
        embedding_norm = float(lm.model.get_input_embeddings().weight.detach().norm(dim=-1).mean())
        projector = MemoryProjector(lm.hidden_size, recipe.projector_inner, embedding_norm).to(lm.device)
    encoder = MemoryEncoder("tokens", keys or TextEncoder(), projector=projector, name=f"recall-smollm2-s{recipe.seed}",
                            placement="answer", close="</recall>")
    params = [p for p in model.parameters() if p.requires_grad] + list(projector.parameters())
    optimizer = torch.optim.AdamW([{"params": params[:-len(list(projector.parameters()))], "scale": 1.0},
                                   {"params": list(projector.parameters()), "scale": recipe.projector_lr / recipe.lr}],
                                  lr=recipe.lr, weight_decay=0.0)
    model.train()

    stream = batches(tok, tokens, replies, BatchRecipe(recipe.facts_per_batch, recipe.chats_per_batch, recipe.seed,
                                                       recipe.repeats_per_batch, recipe.history,
                                                       tuple(zip(recipe.values, recipe.value_weights)),
                                                       recipe.people_per_batch, recipe.wrong_reads))
    evaluate = lambda: {k: round(v, 4) for k, v in  # noqa: E731
                        quick_eval(model, tok, tokens, encoder, recipe.eval_facts, recipe.seed).items()}
    started = time.perf_counter()
    with open(out / "training_log.csv", "w", newline="") as fh:
        writer = None
        before = evaluate() if recipe.eval_every else {}  # step 0: the held-out measures before any update
        bar = tqdm(range(recipe.steps), desc="training", unit="step")
        for step in bar:
            batch, _ = next(stream)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, recipe) * group["scale"]
            losses = step_losses(model, encoder, batch, (tokens.recall, tokens.memory_pad), recipe)
            optimizer.zero_grad(set_to_none=True)
            losses["loss"].backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            row = {"step": step + 1, "seconds": round(time.perf_counter() - started, 1), "lr": lr_at(step, recipe),
                   **{k: round(float(v.detach()), 4) for k, v in losses.items()}}
            if recipe.eval_every and ((step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps):
                row.update(evaluate())
                tqdm.write(f"step {step + 1}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k.startswith("eval")))
            if writer is None:
                writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys([*row, *before])))
                writer.writeheader()
                if before:
                    writer.writerow({"step": 0, "seconds": 0.0, **before})
            writer.writerow(row)
            fh.flush()
            if (step + 1) % log_every == 0:
                bar.set_postfix(loss=f"{row['loss']:.3f}", ans=f"{row['answer']:.3f}", dec=f"{row['decision']:.3f}",
                                kl=f"{row['reply']:.3f}")
    minutes = (time.perf_counter() - started) / 60
    model.eval()
    projector.eval().requires_grad_(False)
    model.save_pretrained(out, save_embedding_layers=False)  # the new rows are saved as trainable tokens
    encoder.save(out)
    (out / "recipe.json").write_text(json.dumps({**dataclasses.asdict(recipe), "train_minutes": round(minutes, 1),
                                                 "device": str(lm.device), "threads": torch.get_num_threads()},
                                                indent=2) + "\n")
    return model, encoder


def parse_fields(cls, items: list[str]):
    """A recipe dataclass `cls` with `--set KEY=VALUE` items (YAML values) over its defaults."""
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    fields = set(types)
    values = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(fields))}")
        value = yaml.safe_load(raw)
        if isinstance(value, str) and types[key] in (float, "float"):  # YAML reads 4e-4 as a string (no dot)
            try:
                value = float(value)
            except ValueError:
                raise SystemExit(f"--set {item!r}: expected a number") from None
        values[key] = value
    return cls(**values)


def parse_recipe(items: list[str]) -> Recipe:
    return parse_fields(Recipe, items)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write the adapter into")
    parser.add_argument("--model", help="local base model folder (default: the embedded SmolLM2)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    from models import LoadOptions, load_model

    recipe = parse_recipe(args.overrides)
    torch.manual_seed(recipe.seed)  # the new tokens' rows start from seeded noise
    lm = load_model(args.model, LoadOptions(adapter=None, device=args.device))  # train from the base model
    train(lm, recipe, Path(args.out))


if __name__ == "__main__":
    main()

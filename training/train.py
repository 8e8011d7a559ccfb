"""Train the embedded SmolLM2 to recall: a LoRA adapter, the new tokens' rows and a memory projector.

    python -m training.train --out assets/recall-smollm2            # the shipped adapter (CPU, < 1 h)
    python -m training.train --out /tmp/a --set steps=50            # any recipe field, as KEY=VALUE

The base weights stay frozen. One step: encode the batch's facts into memory vectors (the memory
encoder, adapter on, projector), inject each at its `<|memory_pad|>` exactly as the generation loop
does, and minimise
  (a) cross-entropy of the answer read from the injected memory,
  (b) cross-entropy of the recall decision: `<recall>` after a fact question, the base model's own
      first token after an ordinary prompt; on the rest of that reply, the KL divergence from the
      base model's own next-token distribution (adapter off), to keep general quality,
  (c) InfoNCE between the final hidden state at `<recall>` (the memory head's query) and the
      memory vectors: in-batch negatives plus the last batches' memories.
Questions and prompts sometimes follow an earlier ordinary turn (`history`), so recall is learnt in
the middle of a conversation too. The memory encoder is the token embeddings' mean (layer 0): a
memory then carries its words in the very space the model reads its input from, which it learns to
read within tens of steps (a final-layer state was not read at all after 300 steps), and writing a
bank costs an embedding lookup. A fixed seed makes a run repeatable on the same machine; the losses
go to `training_log.csv`.
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
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from tqdm.auto import tqdm

from decoding.memory import inject_memories
from models.modeling import backbone_and_head, head_logits
from models.encoder import HiddenStateSpec, MemoryEncoder, MemoryProjector
from training.data import IGNORE, Batch, batches, positive, prompt_ids, value_tokens
from training.facts import chat_prompts, make_facts
from training.losses import info_nce, masked_means


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    steps: int = 450  # ~7 s a step on 2 CPU cores: under an hour
    facts_per_batch: int = 16  # positives, and the InfoNCE batch
    chats_per_batch: int = 4  # negatives
    repeats_per_batch: int = 4  # facts of the batch also asked to be repeated whole (autoencoding)
    chat_prompts: int = 400  # distinct ordinary prompts, answered once by the base model
    history: float = 0.3  # share of questions and prompts that follow an earlier ordinary turn
    reply_tokens: int = 32  # length of those answers
    lr: float = 1e-3
    warmup: int = 30
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    encoder_layer: int = 0  # the token embeddings (see the module docstring)
    encoder_pooling: str = "mean"
    projector_inner: int = 1152
    tau: float = 0.05
    queue: int = 256  # earlier memories kept as extra InfoNCE negatives
    w_answer: float = 1.0
    w_value: float = 4.0  # weight of the answer's value tokens within the answer loss (only the memory knows them)
    w_decision: float = 1.0
    w_reply: float = 1.0  # KL from the base model on ordinary replies
    w_nce: float = 1.0
    w_align: float = 1.0  # cosine distance of the query to the encoding of the question text
    eval_every: int = 100
    eval_facts: int = 64

    def __post_init__(self):
        for name in ("steps", "facts_per_batch", "lora_r", "projector_inner"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} is {getattr(self, name)}: must be >= 1")
        if not 0 <= self.history <= 1:
            raise ValueError(f"history is {self.history}: must be in [0, 1]")
        if not 0 < self.tau <= 1:
            raise ValueError(f"tau is {self.tau}: must be in (0, 1]")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))


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


def step_losses(model, encoder: MemoryEncoder, batch: Batch, memory_pad: int, recipe: Recipe,
                queue: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The losses of one batch (see the module docstring); also returns the batch's memory vectors."""
    device = next(model.parameters()).device
    backbone, head = backbone_and_head(model)
    b = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)})
    memories = encoder(model, {"input_ids": b.fact_ids, "attention_mask": b.fact_mask})  # [P, H]
    embeds = inject_memories(model.get_input_embeddings()(b.input_ids), b.input_ids, memory_pad,
                             encoder.embedding(memories[b.memory_of]))
    hidden = backbone(inputs_embeds=embeds, use_cache=False).last_hidden_state  # [B, S, H]

    rows = torch.arange(len(b.input_ids), device=device)
    kind = torch.full_like(b.labels, -1)  # 0 decision, 1 answer from memory, 2 ordinary reply
    kind[b.labels != IGNORE] = 2
    kind[b.memory_rows] = torch.where(b.labels[b.memory_rows] != IGNORE, 1, -1)
    kind[rows, b.decision] = 0
    sel = kind >= 0
    logits = head_logits(model, head, hidden[sel])  # [N, V] only where a token is predicted
    token_loss = F.cross_entropy(logits, b.labels[sel], reduction="none")  # [N]
    decision, _, _ = masked_means(token_loss, kind[sel], 3)
    reply = _base_kl(model, backbone, head, b.input_ids, kind == 2, logits[kind[sel] == 2])
    weight = (1 + (recipe.w_value - 1) * b.value[sel].float()) * (kind[sel] == 1)  # [N]
    answer = (token_loss * weight).sum() / weight.sum().clamp_min(1)
    with torch.no_grad():
        correct = logits.argmax(-1) == b.labels[sel]
        recall_ok = correct[kind[sel] == 0]
    queries = hidden[b.recall_rows, b.recall_at]  # [P, H]
    nce, nce_acc = info_nce(queries, memories, recipe.tau, queue)
    with torch.no_grad():  # where the question's own text lands in memory space: the query's target
        target = encoder(model, {"input_ids": b.question_ids, "attention_mask": b.question_mask})
    align = 1 - F.cosine_similarity(queries.float(), target, dim=-1).mean()
    total = (recipe.w_decision * decision + recipe.w_answer * answer + recipe.w_reply * reply
             + recipe.w_nce * nce + recipe.w_align * align)
    with torch.no_grad():
        q = F.normalize(queries.float(), dim=-1)
        spread = ((q @ q.T).sum() - len(q)) / max(1, len(q) * (len(q) - 1))  # mean cosine between queries
    return {"loss": total, "decision": decision, "answer": answer, "reply": reply, "nce": nce, "align": align,
            "query_cos": spread,
            "nce_acc": nce_acc, "decision_acc": recall_ok.float().mean(),
            "answer_acc": correct[kind[sel] == 1].float().mean()}, memories.detach()


def _base_kl(model, backbone, head, input_ids: torch.Tensor, where: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
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
def value_nll(model, tokenizer, tokens, encoder: MemoryEncoder, facts, shuffle: bool) -> float:
    """Mean NLL of the answers' value tokens, read with each fact's own memory (or, with `shuffle`,
    another fact's): the gap between the two says how much the model reads from memory."""
    device = next(model.parameters()).device
    backbone, head = backbone_and_head(model)
    memories = encoder.embedding(encoder.encode_texts(model, tokenizer, [f.text for f in facts], 16, False).to(device))
    if shuffle:
        memories = memories.roll(1, dims=0)
    total, count = 0.0, 0
    for fact, memory in zip(facts, memories):
        example = positive(tokenizer, tokens, fact, fact.questions[0])
        ids = torch.tensor([example.ids], device=device)
        embeds = inject_memories(model.get_input_embeddings()(ids), ids, tokens.memory_pad, memory[None])
        logp = head_logits(model, head, backbone(inputs_embeds=embeds).last_hidden_state[0]).log_softmax(-1)
        first = example.recall_at + 1  # the <|memory_pad|> position predicts the first answer token
        answer = tokenizer(fact.answer, add_special_tokens=False)["input_ids"]
        for i in value_tokens(tokenizer, fact.answer, fact.value):
            total -= float(logp[first + i, answer[i]])
            count += 1
    return total / max(count, 1)


@torch.no_grad()
def quick_eval(model, tokenizer, tokens, encoder: MemoryEncoder, n: int, seed: int) -> dict[str, float]:
    """Held-out facts: retrieval@1 of the <recall> query among their n memories, p(<recall>)
    after fact questions vs ordinary prompts, and the value tokens' NLL with the right memory vs a
    wrong one (evaluation entities and templates are never trained on)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    backbone, head = backbone_and_head(model)
    facts = make_facts(n, "eval", seed)
    memories = encoder.encode_texts(model, tokenizer, [f.text for f in facts], batch_size=16, progress=False)
    queries, p_fact = [], []
    for f in facts:
        ids = torch.tensor([prompt_ids(tokenizer, f.questions[0]) + [tokens.recall]], device=device)
        h = backbone(input_ids=ids).last_hidden_state[0]  # [S, H]
        queries.append(h[-1].float().cpu())
        p_fact.append(float(head_logits(model, head, h[-2]).softmax(-1)[tokens.recall]))
    p_chat = []
    for prompt in chat_prompts(n, "eval", seed):
        ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=device)
        h = backbone(input_ids=ids).last_hidden_state[0, -1]
        p_chat.append(float(head_logits(model, head, h).softmax(-1)[tokens.recall]))
    sims = F.normalize(torch.stack(queries), dim=-1) @ F.normalize(memories, dim=-1).T  # [n, n]
    out = {"eval_retrieval@1": float((sims.argmax(-1) == torch.arange(n)).float().mean()),
           "eval_p_recall_fact": sum(p_fact) / n, "eval_p_recall_chat": sum(p_chat) / len(p_chat),
           "eval_value_nll": value_nll(model, tokenizer, tokens, encoder, facts[:32], shuffle=False),
           "eval_value_nll_wrong": value_nll(model, tokenizer, tokens, encoder, facts[:32], shuffle=True)}
    model.train(was_training)
    return out


def train(lm, recipe: Recipe, out: Path, log_every: int = 10):
    """Train on `lm` (a loaded model with the recall tokens, no adapter); write the adapter to `out`.

    Returns (the PEFT model, wrapping `lm.model` in place, and the trained memory encoder)."""
    from peft import LoraConfig, get_peft_model

    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    out.mkdir(parents=True, exist_ok=True)
    tok, tokens = lm.tokenizer, lm.tokens
    replies = base_replies(lm, chat_prompts(recipe.chat_prompts, "train", recipe.seed), recipe.reply_tokens)

    config = LoraConfig(r=recipe.lora_r, lora_alpha=recipe.lora_alpha, lora_dropout=0.0,
                        target_modules=list(recipe.lora_targets),
                        trainable_token_indices=[tokens.recall, tokens.recall_end, tokens.memory_pad])
    model = get_peft_model(lm.model, config)
    hidden = lm.hidden_size
    embedding_norm = float(lm.model.get_input_embeddings().weight.detach().norm(dim=-1).mean())
    projector = MemoryProjector(hidden, recipe.projector_inner, embedding_norm).to(lm.device)
    spec = HiddenStateSpec(recipe.encoder_layer, recipe.encoder_pooling)
    with torch.no_grad():  # per-dimension standardisation, from facts of the training split
        sample = MemoryEncoder(spec).encode_texts(model, tok, [f.text for f in make_facts(512, "train", recipe.seed + 1)],
                                                  batch_size=32, progress=False)
    encoder = MemoryEncoder(spec, projector, center=sample.mean(0).to(lm.device),
                            scale=sample.std(0).clamp_min(1e-3).to(lm.device))
    model.train()  # (before the first encoder call, whose hook must see the trained model)
    params = [p for p in model.parameters() if p.requires_grad] + list(projector.parameters())
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    model.train()

    stream = batches(tok, tokens, replies, recipe.facts_per_batch, recipe.chats_per_batch, recipe.seed,
                     recipe.repeats_per_batch, recipe.history)
    queue: deque[torch.Tensor] = deque(maxlen=max(1, recipe.queue // recipe.facts_per_batch))
    log_path = out / "training_log.csv"
    started = time.perf_counter()
    with open(log_path, "w", newline="") as fh:
        writer = None
        if recipe.eval_every:  # step 0: the held-out measures before any update, the baseline of the curve
            before = {k: round(v, 4) for k, v in
                      quick_eval(model, tok, tokens, encoder, recipe.eval_facts, recipe.seed).items()}
        bar = tqdm(range(recipe.steps), desc="training", unit="step")
        for step in bar:
            batch, _ = next(stream)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, recipe)
            extra = torch.cat(list(queue)) if queue and recipe.queue else None
            losses, memories = step_losses(model, encoder, batch, tokens.memory_pad, recipe, extra)
            optimizer.zero_grad(set_to_none=True)
            losses["loss"].backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            queue.append(memories)
            row = {"step": step + 1, "seconds": round(time.perf_counter() - started, 1), "lr": lr_at(step, recipe),
                   **{k: round(float(v.detach()), 4) for k, v in losses.items()}}
            if recipe.eval_every and ((step + 1) % recipe.eval_every == 0 or step + 1 == recipe.steps):
                row.update({k: round(v, 4) for k, v in
                            quick_eval(model, tok, tokens, encoder, recipe.eval_facts, recipe.seed).items()})
            if writer is None:
                fields = list(row) + ["eval_retrieval@1", "eval_p_recall_fact", "eval_p_recall_chat",
                                      "eval_value_nll", "eval_value_nll_wrong"]
                writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(fields)))
                writer.writeheader()
                if recipe.eval_every:
                    writer.writerow({"step": 0, "seconds": 0.0, **before})
            writer.writerow(row)
            fh.flush()
            if (step + 1) % log_every == 0:
                bar.set_postfix(loss=f"{row['loss']:.3f}", ans=f"{row['answer']:.3f}", nce=f"{row['nce']:.3f}",
                                dec=f"{row['decision']:.3f}")
            if "eval_retrieval@1" in row:
                tqdm.write(f"step {step + 1}: " + ", ".join(f"{k}={v}" for k, v in row.items() if k.startswith("eval")))
    minutes = (time.perf_counter() - started) / 60
    model.eval()
    projector.eval().requires_grad_(False)
    encoder = MemoryEncoder(encoder.spec, projector, f"recall-smollm2-s{recipe.seed}", encoder.center, encoder.scale)
    model.save_pretrained(out, save_embedding_layers=False)  # the new rows are saved as trainable tokens
    encoder.save(out)
    (out / "recipe.json").write_text(json.dumps({**dataclasses.asdict(recipe), "train_minutes": round(minutes, 1),
                                                 "device": str(lm.device), "threads": torch.get_num_threads()},
                                                indent=2) + "\n")
    return model, encoder


def parse_recipe(items: list[str]) -> Recipe:
    fields = {f.name for f in dataclasses.fields(Recipe)}
    values = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(sorted(fields))}")
        values[key] = yaml.safe_load(raw)
    return Recipe(**values)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write the adapter into")
    parser.add_argument("--model", help="local base model folder (default: the embedded SmolLM2)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    from models import load_model

    recipe = parse_recipe(args.overrides)
    torch.manual_seed(recipe.seed)  # the new tokens' rows start from seeded noise
    lm = load_model(args.model, adapter=None, device=args.device)  # train from the base model
    train(lm, recipe, Path(args.out))


if __name__ == "__main__":
    main()

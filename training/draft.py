"""Train the EAGLE draft head (decoding/draft_head.py) for the mixture's speculative sampling.

    .venv/bin/python -m training.draft [--prompts 640] [--steps 1200] [--out FOLDER]

then `generation.mixture: {speculative: true, draft: head, head: FOLDER}` (or bench/mixture.py --head).

1. Text: θ (the embedded model, recall adapter merged) answers `--prompts` chat prompts of its own
   (sampled at temperature 1 and 0.7, as the mixture is used); the prompts come from templates and
   topics that the benchmark and the held-out evaluation never use.
2. Features: θ and its base (the adapter off) read every prompt + answer; per position we keep θ's
   final hidden state h_θ and the mixture's feature f* = α* h_θ + (1 - α*) h_t, with α* the balance
   point of the pair at temperature 1 (decoding.mixture.solve_alpha).
3. Training: the head reads [embedding of x_t ; h_θ,t-1] (plus a little noise, as EAGLE does) and is
   fit to f*_t: smooth-L1 on the feature plus the KL from q* = softmax(lm_head f*) to the head's
   softmax(lm_head f̂) on a sample of positions.
4. Evaluation on the answers to held-out prompts (training/facts.py's eval split): how often the
   head's greedy draft equals q*'s argmax, and the expected acceptance E[Σ min(q*, d)] of its first
   draft step (the verify keeps a draft with that probability at temperature 1).

Steps 1 and 2 are cached under the cache root (draft-head/), so a second run only trains. CPU only;
measured times and results are in the README (no head ships: on this CPU it drafts too poorly to pay).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from decoding.draft_head import DraftHead, head_config
from decoding.forward import Forward
from decoding.mixture import solve_alpha
from models.modeling import backbone_and_head
from models import LoadOptions, load_model
from models.embedded import cache_root
from training.data import prompt_ids
from training.train import replies


_TEMPLATES = [
    "Tell me about {t}.", "Write a short story about {t}.", "Explain {t} to a ten-year-old.",
    "What are the main facts about {t}?", "Give me three tips related to {t}.", "Write a poem about {t}.",
    "What is the history of {t}?", "Describe {t} in detail.", "Why do people care about {t}?",
    "Write an email to a friend about {t}.", "List the pros and cons of {t}.", "How does {t} work?",
    "Write a blog post about {t}.", "What would a beginner need to know about {t}?",
    "Compare {t} with something similar.", "Write a dialogue between two people discussing {t}.",
    "Summarise what you know about {t}.", "What are common mistakes people make with {t}?",
    "Write a product description for {t}.", "Plan a weekend around {t}.",
]
_TOPICS = [  # none of the benchmark's subjects (lighthouses, photosynthesis, hiking and packing)
    "coffee", "the moon", "volcanoes", "honey bees", "chess", "the Roman Empire", "bread baking", "jazz music",
    "electric cars", "rain forests", "the human heart", "learning a language", "recycling", "dinosaurs", "tea",
    "the ocean tides", "a city park", "winter sports", "octopuses", "the printing press", "solar panels",
    "birthday parties", "a public library", "knitting", "the violin", "mountain lakes", "football", "deserts",
    "a train journey", "computers", "the stock market", "gardening", "elephants", "the weather", "cooking pasta",
    "a small bakery", "space travel", "penguins", "friendship", "running a marathon", "old castles", "rivers",
    "painting with watercolours", "the internet", "a fishing village", "vaccines", "earthquakes", "owls",
    "cheese making", "bicycles", "the Olympic Games", "ancient Egypt", "a rainy afternoon", "robots",
    "classical music", "tigers", "board games", "the Arctic", "a farmer's market", "writing a novel", "salt",
    "wind power", "museums", "sleep", "the piano", "sharks", "kites", "the Great Wall of China", "glass",
    "a busy airport", "mushrooms", "photography", "whales", "the brain", "autumn leaves", "a science fair",
    "origami", "pizza", "thunderstorms", "maps", "the Amazon river", "a school trip", "camels", "poetry",
    "submarines", "a night market", "clocks", "yoga", "coral reefs", "the alphabet", "snow", "butterflies",
    "a first job interview", "bridges", "chocolate", "satellites", "a summer festival", "wolves", "money",
]


def draft_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(f"draft:{seed}")
    pool = [t.format(t=topic) for t in _TEMPLATES for topic in _TOPICS]
    rng.shuffle(pool)
    return pool[:n]


def answers(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 24) -> list[list[int]]:
    """prompt + θ's sampled answer, as token ids (batches alternate temperature 1 and 0.7)."""
    out = []
    for i, s in enumerate(tqdm(range(0, len(prompts), batch_size), desc="answers", unit="batch")):
        chunk = prompts[s:s + batch_size]
        rows = replies(model, tokenizer, chunk, max_new_tokens, batch_size, None, do_sample=True,
                       temperature=1.0 if i % 2 == 0 else 0.7, top_k=0, top_p=1.0)
        out += [prompt_ids(tokenizer, p) + row for p, row in zip(chunk, rows)]
    return out


@torch.no_grad()
def features(theta, base, seqs: list[list[int]], chunk: int = 256) -> list[dict[str, torch.Tensor]]:
    """Per sequence: ids [L], h_θ [L, H] and f* [L, H] (bfloat16), α* [L] (see the module doc)."""
    (theta_body, head), (base_body, _) = backbone_and_head(theta), backbone_and_head(base)
    out = []
    for seq in tqdm(seqs, desc="features", unit="seq"):
        ids = torch.tensor([seq])
        h_theta = theta_body(input_ids=ids).last_hidden_state[0]  # [L, H], normed
        h_base = base_body(input_ids=ids).last_hidden_state[0]
        alphas = []
        for s in range(0, len(seq), chunk):
            lp = torch.log_softmax(head(h_theta[s:s + chunk]).float(), -1)
            lr = torch.log_softmax(head(h_base[s:s + chunk]).float(), -1)
            alphas.append(solve_alpha(lp, lr, tol=1e-4))  # a target for a draft: float32, 1e-4 is plenty
        alpha = torch.cat(alphas).float()[:, None]
        target = alpha * h_theta.float() + (1 - alpha) * h_base.float()
        out.append({"ids": ids[0], "h": h_theta.bfloat16(), "f": target.bfloat16(), "alpha": alpha[:, 0]})
    return out


def _batch(rows: list[dict], embed):
    """Right-padded training batch: inputs (embeds of x_1.., h_θ of x_0..), targets f* of x_1.., mask."""
    n = max(len(r["ids"]) for r in rows) - 1
    H = rows[0]["h"].shape[-1]
    emb, feat, tgt = (torch.zeros(len(rows), n, H) for _ in range(3))
    mask = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        m = len(r["ids"]) - 1
        emb[i, :m] = embed(r["ids"][1:])
        feat[i, :m] = r["h"][:-1].float()
        tgt[i, :m] = r["f"][1:].float()
        mask[i, :m] = True
    return emb, feat, tgt, mask


@dataclass(frozen=True)
class DraftRecipe:
    """How the head is trained (the defaults are `main`'s): `steps` of `batch` sequences at peak learning rate
    `lr`, input features jittered by uniform `noise`, the KL on `kl_positions` sampled positions weighted
    `w_kl`, seeded by `seed`; the held-out evaluation every `eval_every` steps (0: never during training)."""

    steps: int = 1200
    batch: int = 16
    lr: float = 1e-3
    noise: float = 0.1
    kl_positions: int = 384
    w_kl: float = 0.1
    seed: int = 0
    eval_every: int = 0


def train(head: DraftHead, data: list[dict], embed, lm_head, recipe: DraftRecipe, *, log=print,
          held_out: list[dict] | None = None) -> list[dict]:
    """AdamW with warm-up and cosine decay; teacher-forced (true features in, as EAGLE-1)."""
    steps, lr, eval_every = recipe.steps, recipe.lr, recipe.eval_every
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, steps // 20)
    history = []
    head.train()
    t0 = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        emb, feat, tgt, mask = _batch(rng.sample(data, recipe.batch), embed)
        feat = feat + recipe.noise * (torch.rand_like(feat) * 2 - 1)
        positions = torch.arange(emb.shape[1])[None].expand(emb.shape[0], -1) + 1
        pred = head(emb, feat, positions)  # [B, S, H]
        reg = torch.nn.functional.smooth_l1_loss(pred[mask], tgt[mask])
        idx = mask.nonzero()
        pick = idx[torch.randperm(len(idx))[:recipe.kl_positions]]  # the KL on a sample: the lm_head is 49k wide
        with torch.autocast("cpu", dtype=torch.bfloat16):
            log_d = torch.log_softmax(lm_head(pred[pick[:, 0], pick[:, 1]]).float(), -1)
            with torch.no_grad():
                log_q = torch.log_softmax(lm_head(tgt[pick[:, 0], pick[:, 1]]).float(), -1)
        kl = (log_q.exp() * (log_q - log_d)).sum(-1).mean()
        loss = reg + recipe.w_kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        row = {"step": step + 1, "reg": reg.item(), "kl": kl.item(), "s": round(time.perf_counter() - t0, 1)}
        if held_out and eval_every and (step + 1) % eval_every == 0:
            head.eval()
            row["held_out"] = evaluate(head, held_out, embed, lm_head)
            head.train()
        history.append(row)
        if (step + 1) % 25 == 0 or step == 0 or "held_out" in row:
            extra = (f"  held-out acceptance {row['held_out']['acceptance_t1']:.3f}, argmax "
                     f"{row['held_out']['argmax_match']:.3f}") if "held_out" in row else ""
            log(f"step {step + 1}/{steps}  reg {row['reg']:.4f}  kl {row['kl']:.3f}  {row['s']:.0f} s{extra}")
    head.eval()
    return history


@torch.no_grad()
def evaluate(head: DraftHead, data: list[dict], embed, lm_head) -> dict[str, float]:
    """First draft step on held-out answers (true features in; the prompt's positions are not
    counted): argmax match with q*, and the expected acceptance Σ min(q*, d) at temperature 1."""
    match = accept = count = 0.0
    for r in data:
        emb, feat, tgt, _ = _batch([r], embed)
        positions = torch.arange(emb.shape[1])[None] + 1
        skip = max(0, r.get("start", 0) - 2)  # index i predicts token i + 2: count the answer's tokens
        pred = head(emb, feat, positions)[0, skip:]
        d = torch.softmax(lm_head(pred).float(), -1)
        q = torch.softmax(lm_head(tgt[0, skip:]).float(), -1)
        match += float((d.argmax(-1) == q.argmax(-1)).sum())
        accept += float(torch.minimum(d, q).sum())
        count += d.shape[0]
    return {"argmax_match": match / count, "acceptance_t1": accept / count, "positions": int(count)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=640)
    ap.add_argument("--answer-tokens", type=int, default=160)
    ap.add_argument("--eval-prompts", type=int, default=40)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--kl-positions", type=int, default=384)
    ap.add_argument("--w-kl", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=100, help="held-out evaluation every N steps (0 = only at the end)")
    ap.add_argument("--stage", choices=["data", "all"], default="all")
    ap.add_argument("--out", type=Path, default=None, help="the head's folder (default: the cache root's draft-head/head)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    lm = load_model(None, LoadOptions(device="cpu"))
    theta, tok = lm.merged(), lm.tokenizer
    base = lm.mixture_target(None)
    work = cache_root() / "draft-head"
    work.mkdir(parents=True, exist_ok=True)
    key = f"p{args.prompts}-a{args.answer_tokens}-s{args.seed}"
    from training.facts import chat_prompts
    held_out = chat_prompts(args.eval_prompts, "eval", args.seed)
    datasets, fast = {}, None
    for name, prompts in (("train", draft_prompts(args.prompts, args.seed)), ("eval", held_out)):
        path = work / f"{name}-{key if name == 'train' else f'e{args.eval_prompts}-a{args.answer_tokens}-s{args.seed}'}.pt"
        if path.is_file():
            datasets[name] = torch.load(path, weights_only=True)
        else:
            torch.manual_seed(args.seed)
            if fast is None:  # bfloat16 copies (AMX): 1.6x faster answers; f* moves 1.6 % (a draft's target)
                fast = copy.deepcopy(theta).to(torch.bfloat16), copy.deepcopy(base).to(torch.bfloat16)
            seqs = answers(fast[0], tok, prompts, args.answer_tokens)
            datasets[name] = features(fast[0], fast[1], seqs)
            torch.save(datasets[name], path)
        for row, prompt in zip(datasets[name], prompts):
            row["start"] = len(prompt_ids(tok, prompt))  # where the answer begins
    if args.stage == "data":
        return
    fwd = Forward(theta)
    embed, lm_head = fwd.embed, fwd.head
    for p in theta.parameters():
        p.requires_grad_(False)
    head = DraftHead(head_config(theta.config.get_text_config(decoder=True)))
    before = evaluate(head, datasets["eval"], embed, lm_head)
    recipe = DraftRecipe(steps=args.steps, batch=args.batch, lr=args.lr, noise=args.noise,
                         kl_positions=args.kl_positions, w_kl=args.w_kl, seed=args.seed, eval_every=args.eval_every)
    history = train(head, datasets["train"], embed, lm_head, recipe, held_out=datasets["eval"])
    after = evaluate(head, datasets["eval"], embed, lm_head)
    tokens = sum(len(r["ids"]) for r in datasets["train"])
    meta = {"recipe": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "train_tokens": tokens, "held_out": {"untrained": before, "trained": after},
            "train_seconds": history[-1]["s"]}
    head.save(args.out or work / "head", **meta)
    print(f"draft head written to {args.out or work / 'head'}; use it with generation.mixture: "
          "{speculative: true, draft: head, head: <that folder>}")
    print(json.dumps(meta["held_out"], indent=2))


if __name__ == "__main__":
    main()

"""Train the key encoder: a LoRA adapter on all-MiniLM-L6-v2 for retrieval among many similar memories.

    python -m training.keys --out assets/recall-keys             # what ships (CPU, about 5 minutes)
    python -m training.keys --out /tmp/k --set steps=50          # any recipe field, as KEY=VALUE

A memory's key is the encoder's embedding of its text, and the memory head's query the embedding of
the user's message. The stock encoder confuses facts that share a template and names that share
fragments ("Leda Thath" / "Leda Thurn", the ferry to "Port Hollwick" / "Homwick"): among 10,000
distractors it finds 96 of 100 held-out facts. Training: question -> fact pairs of the training split
(entities never seen in evaluation), InfoNCE over the batch's facts and, per question, a hard negative
mined from the pool (one of the 8 facts the stock encoder puts closest: same template and relation,
similar names). `keys_log.json` records the held-out retrieval of the stock and the trained encoder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from training.facts import make_facts
from training.train import parse_fields


@dataclass(frozen=True)
class KeyRecipe:
    seed: int = 0
    steps: int = 300
    batch: int = 32  # questions a step; each brings its fact and a hard negative
    pool: int = 20_000  # training facts to draw from and mine negatives in
    hard: int = 8  # a question's hard negative is one of its fact's `hard` nearest facts
    lr: float = 1e-3
    lora_r: int = 8
    tau: float = 0.05
    eval_facts: int = 100
    eval_distractors: int = 10_000

    def __post_init__(self):
        for name in ("steps", "batch", "pool", "hard", "lora_r"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} is {getattr(self, name)}: must be >= 1")


def retrieval(model, questions: list[str], texts: list[str], sizes: tuple[int, ...]) -> list[float]:
    """retrieval@1 of question i -> text i among the first `len(questions) + n` texts, for each n in `sizes`."""
    with torch.no_grad():
        keys = torch.from_numpy(model.encode(texts, batch_size=256, normalize_embeddings=True))
        queries = torch.from_numpy(model.encode(questions, batch_size=256, normalize_embeddings=True))
    target = torch.arange(len(questions))
    return [round(float(((queries @ keys[:len(questions) + n].T).argmax(-1) == target).float().mean()), 3)
            for n in sizes]


def held_out(recipe: KeyRecipe) -> tuple[list[str], list[str]]:
    """Evaluation questions and texts: `eval_facts` facts, then distractors of other entities (never trained on)."""
    facts = make_facts(recipe.eval_facts, "eval", seed=1)
    asked = {f.questions[0] for f in facts}
    others = [f for f in make_facts(recipe.eval_distractors + recipe.eval_facts, "eval", seed=2)
              if f.questions[0] not in asked][:recipe.eval_distractors]
    return [f.questions[0] for f in facts], [f.text for f in facts + others]


def train_keys(recipe: KeyRecipe, out: Path) -> dict:
    from peft import LoraConfig, get_peft_model
    from sentence_transformers import SentenceTransformer

    from models.text_keys import default_model_path

    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    out.mkdir(parents=True, exist_ok=True)
    model = SentenceTransformer(default_model_path(), device="cpu")
    questions, texts = held_out(recipe)
    sizes = (0, 1000, recipe.eval_distractors)
    stock = retrieval(model, questions, texts, sizes)
    pool = make_facts(recipe.pool, "train", recipe.seed)
    with torch.no_grad():  # hard negatives: the facts the stock encoder confuses with each fact
        keys = torch.from_numpy(model.encode([f.text for f in pool], batch_size=256, normalize_embeddings=True))
        near = []
        for s in range(0, len(keys), 2048):
            sim = keys[s:s + 2048] @ keys.T
            sim[torch.arange(len(sim)), torch.arange(s, s + len(sim))] = -2
            near.append(sim.topk(recipe.hard, dim=-1).indices)
        near = torch.cat(near)
    adapted = get_peft_model(model[0].auto_model, LoraConfig(  # LoRA layers go into the encoder in place
        r=recipe.lora_r, lora_alpha=2 * recipe.lora_r, target_modules=["query", "key", "value", "dense"]))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr)
    rng = random.Random(f"keys:{recipe.seed}")

    def embed(batch: list[str]) -> torch.Tensor:
        features = model.preprocess(batch) if hasattr(model, "preprocess") else model.tokenize(batch)
        return F.normalize(model(features)["sentence_embedding"], dim=-1)

    started, losses = time.perf_counter(), []
    model.train()
    for _ in tqdm(range(recipe.steps), desc="key encoder", unit="step"):
        idx = [rng.randrange(len(pool)) for _ in range(recipe.batch)]
        negatives = [int(near[i, rng.randrange(recipe.hard)]) for i in idx]
        queries = embed([rng.choice(pool[i].questions) for i in idx])  # [B, D]
        facts = embed([pool[i].text for i in idx + negatives])  # [2B, D]: the facts, then the hard negatives
        loss = F.cross_entropy(queries @ facts.T / recipe.tau, torch.arange(len(idx)))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(round(float(loss), 4))
    model.eval()
    trained = retrieval(model, questions, texts, sizes)
    adapted.save_pretrained(out)  # the adapter alone (sentence-transformers' own save would write the whole model)
    log = {"recipe": dataclasses.asdict(recipe), "minutes": round((time.perf_counter() - started) / 60, 1),
           "threads": torch.get_num_threads(), "distractors": list(sizes),
           "retrieval@1_stock": stock, "retrieval@1_trained": trained, "loss": losses}
    (out / "keys_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="python -m training.keys", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write the key encoder's adapter into")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    log = train_keys(parse_fields(KeyRecipe, args.overrides), Path(args.out))
    print(f"held-out retrieval@1 at {log['distractors']} distractors: stock {log['retrieval@1_stock']}, "
          f"trained {log['retrieval@1_trained']} ({log['minutes']} min)")


if __name__ == "__main__":
    main()

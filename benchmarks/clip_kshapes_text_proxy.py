"""A CPU-cheap proxy of the kshapes recall benchmark: does knowledge reach held-out entities?

The image tower is replaced by the sum of learned embeddings of each image's true attributes
(colour, shape, background, position, read from metadata.jsonl), so only the text side is
trained: a tiny-BERT KnowledgeTextEncoder (the same code ``rapiddiff train clip`` builds), the
same InfoNCE loss, entity-token and knowledge-item dropout. Text→"image" R@1/5/10 on the test
split, for captions naming held-out entities, seen entities, and attributes; the ground truth of a
caption is every test image with its four attributes. Held-out entities never occur in a training
caption, so without knowledge their captions carry only background and position.

    python benchmarks/clip_kshapes_text_proxy.py --kshapes DIR --store STORE --knowledge on \\
        [--entity-token-dropout 1.0] [--item-dropout 0.0] [--steps 1000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rapiddiff.eval.recall import retrieval_recall
from rapiddiff.train.clip import CLIPTraining

KEYS = ("colour", "shape", "background", "position")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kshapes", type=Path, required=True)
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--knowledge", choices=("on", "off"), default="on")
    ap.add_argument("--entity-token-dropout", type=float, default=1.0)
    ap.add_argument("--item-dropout", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--text-tower", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    on = args.knowledge == "on"
    module = CLIPTraining(
        text_tower=args.text_tower,
        max_length=32,
        image_tower="resnet10",  # unused: replaced by attribute embeddings below
        image_size=32,
        embed_dim=64,
        pooling="mean",
        knowledge_store=str(args.store) if on else None,
        knowledge=on,
        entity_token_dropout=args.entity_token_dropout,
        knowledge_item_dropout=args.item_dropout,
    )
    clip = module.model

    def rows(split: str) -> list[dict]:
        text = (args.kshapes / split / "metadata.jsonl").read_text("utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    train, test = rows("train"), rows("test")
    vocab = {k: sorted({r[k] for r in train + test}) for k in KEYS}
    emb = torch.nn.ModuleDict({k: torch.nn.Embedding(len(vocab[k]), 64) for k in KEYS})

    def images(rs: list[dict]) -> torch.Tensor:
        return sum(emb[k](torch.tensor([vocab[k].index(r[k]) for r in rs])) for k in KEYS)

    params = [
        *clip.text_encoder.parameters(),
        *clip.text_projection.parameters(),
        clip.logit_scale,
        *emb.parameters(),
    ]
    opt = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(args.seed)
    start = time.time()
    for step in range(args.steps):
        batch = [train[i] for i in torch.randint(len(train), (args.batch_size,), generator=g).tolist()]
        tok = clip.text_encoder.tokenize([r["text"] for r in batch])
        ids = module.hide_entity_tokens(tok["input_ids"], tok["token_entity_ids"]) if on else tok["input_ids"]
        text = clip.text_features(ids, tok["attention_mask"], tok["token_entity_ids"])
        loss = clip.contrastive_loss(text, images(batch))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 200 == 0:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    clip.eval()
    held = {
        ln.strip()
        for ln in (args.kshapes / "heldout_entities.txt").read_text("utf-8").splitlines()
        if ln.strip()
    }
    with torch.no_grad():
        gallery = F.normalize(images(test), dim=-1)
        texts = [r["text"] for r in test]
        feats = torch.cat([clip.encode_text(texts[i : i + 128]) for i in range(0, len(texts), 128)])
        sim = feats @ gallery.T
    groups = {
        "heldout": lambda r: r["entity"] in held,
        "seen": lambda r: bool(r["entity"]) and r["entity"] not in held,
        "attribute": lambda r: not r["entity"],
    }
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "train_seconds": round(time.time() - start)}
    for name, select in groups.items():
        q = [i for i, r in enumerate(test) if select(r)]
        gt = [{j for j, s in enumerate(test) if all(s[k] == test[i][k] for k in KEYS)} for i in q]
        top = sim[q].argmax(1).tolist()
        result[name] = {
            **retrieval_recall(sim[q], gt),
            "queries": len(q),
            "top1_colour_acc": sum(
                test[j]["colour"] == test[i]["colour"] for i, j in zip(q, top, strict=True)
            )
            / len(q),
            "top1_shape_acc": sum(test[j]["shape"] == test[i]["shape"] for i, j in zip(q, top, strict=True))
            / len(q),
        }
    print(json.dumps(result, ensure_ascii=False, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n", "utf-8")


if __name__ == "__main__":
    main()

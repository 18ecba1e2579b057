"""Images the built-in model draws right, as ``tests/infer/test_builtin_model.py`` counts them: for
the seen entities (the first 12 by name of the objects its captions named) and the held-out ones
(knowledge/kg_only_entities.json), "灰色背景上有一个{entity}" at seeds 0–2, 20 PNDM steps, on the CPU;
colour and shape read by the kshapes detector against the model's own KG. It prints one JSON line per
knowledge mode × guidance, the figures the test's thresholds and the guidance default were set from.

    python benchmarks/builtin_entity_counts.py --guidance 5.0 7.5 --knowledge default embed off
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

BACKGROUND, SEEDS, STEPS = "灰色", (0, 1, 2), 20  # as in tests/infer/test_builtin_model.py


def entity_splits(model_dir: Path, store) -> dict[str, list[str]]:
    record = json.loads((model_dir / "knowledge" / "kg_only_entities.json").read_text("utf-8"))
    never = set(record["never_named_in_training"])
    colour, shape = (store.relation_names.index(r) for r in ("颜色", "形状"))
    heads = {int(h) for h, r, _ in store.triples.tolist() if r == colour} & {
        int(h) for h, r, _ in store.triples.tolist() if r == shape
    }
    seen = sorted(n for n in (store.entity_names[h] for h in heads) if n not in never)[:12]
    return {"seen": seen, "heldout": list(record["heldout"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="builtin:kshapes", help="model folder or builtin:NAME (default: builtin:kshapes)"
    )
    parser.add_argument("--guidance", type=float, nargs="+", default=[None], help="default: the model's")
    parser.add_argument(
        "--knowledge", nargs="+", default=["default"], help="default, embed, both, text or off"
    )
    args = parser.parse_args()

    import torch

    from rapiddiff.data.kshapes import detect_attributes
    from rapiddiff.infer.generate_cli import DEFAULT_SAMPLING, model_sampling_defaults, resolve_model_dir
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    torch.set_num_threads(2)
    model_dir = resolve_model_dir(args.model)
    pipe = RapidDiffusionPipeline.from_pretrained(model_dir, device="cpu")
    store = pipe.text_encoder.store
    sampling = {**DEFAULT_SAMPLING, **model_sampling_defaults(pipe.model_path)}
    colour, shape = (store.relation_names.index(r) for r in ("颜色", "形状"))

    def fact(name: str, rel: int) -> str:
        return next(store.entity_names[t] for r, t in store.facts(store.id_of(name)) if r == rel)

    for mode in args.knowledge:
        for guidance in args.guidance:
            for split, names in entity_splits(model_dir, store).items():
                start = time.perf_counter()
                out = pipe(
                    [f"{BACKGROUND}背景上有一个{n}" for n in names for _ in SEEDS],
                    num_inference_steps=STEPS,
                    guidance_scale=sampling["guidance_scale"] if guidance is None else guidance,
                    seed=[s for _ in names for s in SEEDS],
                    scheduler=sampling["scheduler"],
                    progress=False,
                    **({} if mode == "default" else {"knowledge": mode}),
                )
                want = [(fact(n, colour), fact(n, shape)) for n in names for _ in SEEDS]
                found = [detect_attributes(image) for image in out.images]
                row = {
                    "knowledge": mode,
                    "guidance": sampling["guidance_scale"] if guidance is None else guidance,
                    "split": split,
                    "images": len(found),
                    "both": sum(
                        d["colour"] == c and d["shape"] == s for d, (c, s) in zip(found, want, strict=True)
                    ),
                    "colour": sum(d["colour"] == c for d, (c, _) in zip(found, want, strict=True)),
                    "shape": sum(d["shape"] == s for d, (_, s) in zip(found, want, strict=True)),
                    "seconds": round(time.perf_counter() - start, 1),
                }
                print(json.dumps(row, ensure_ascii=False), flush=True)


if __name__ == "__main__":
    main()

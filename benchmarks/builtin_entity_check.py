"""Count what `tests/infer/test_builtin_model.py` asserts, for any model folder: seen and held-out
entities drawn with their KG colour and shape right, with the test's prompts, seeds and steps and
the folder's own sampler and guidance (the test asserts floors; this prints the counts, so a
candidate can be compared with the shipped model before it replaces it).

    python benchmarks/builtin_entity_check.py MODEL [MODEL ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests/ is not installed

from rapiddiff.data.kshapes import detect_attributes
from rapiddiff.infer.generate_cli import DEFAULT_SAMPLING, model_sampling_defaults
from rapiddiff.infer.pipeline import RapidDiffusionPipeline
from tests.infer import test_builtin_model as t  # the test's prompts, seeds and KG lookups


def main(models: list[str]) -> None:
    for model in models:
        pipe = RapidDiffusionPipeline.from_pretrained(model, device="cpu")
        sampling = {**DEFAULT_SAMPLING, **model_sampling_defaults(pipe.model_path)}
        for split in ("seen", "heldout"):
            names = t._split_entities(pipe, split)
            out = pipe(
                [f"{t.BACKGROUND}背景上有一个{n}" for n in names for _ in t.SEEDS],
                num_inference_steps=t.STEPS,
                guidance_scale=sampling["guidance_scale"],
                seed=[s for _ in names for s in t.SEEDS],
                scheduler=sampling["scheduler"],
                progress=False,
            )
            expected = [
                (t._kg_fact(pipe, n, "颜色"), t._kg_fact(pipe, n, "形状")) for n in names for _ in t.SEEDS
            ]
            found = [detect_attributes(image) for image in out.images]
            both = sum(
                d["colour"] == c and d["shape"] == s for d, (c, s) in zip(found, expected, strict=True)
            )
            print(
                f"{model}\t{split}\t{sampling['scheduler']}\t{both} of {len(found)} (test floor {t.MIN_BOTH[split]})"
            )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])

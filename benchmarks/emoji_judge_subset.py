"""A small emoji-zh-shaped folder from the npm packages, for a judge run on the CPU.

    python benchmarks/emoji_judge_subset.py --pkgs PKGS --n 100 --out /tmp/emoji-subset
    python -m rapiddiff eval judge-train --data /tmp/emoji-subset --out /tmp/judge --device cpu ...

Writes entities.jsonl (id, subcategory, category from emoji-datasource's emoji.json) and
glyphs/<style>/<id>.png (the first N emoji with an image in every style, every k-th one so that
many subcategories are present). Stands in for `rapiddiff data emoji` where only the judge is measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

STYLES = {"google": "emoji-datasource-google-16.0.0", "twitter": "emoji-datasource-twitter-16.0.0"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pkgs", type=Path, required=True, help="folder holding the extracted npm packages")
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    meta = json.loads((args.pkgs / STYLES["google"] / "package" / "emoji.json").read_text())
    dirs = {s: args.pkgs / p / "package" / "img" / s / "64" for s, p in STYLES.items()}
    rows = [m for m in meta if all((d / m["image"]).is_file() for d in dirs.values())]
    step = max(1, len(rows) // args.n)
    rows = sorted(rows, key=lambda m: m["sort_order"])[::step][: args.n]
    entities = []
    for m in rows:
        entity = m["image"].removesuffix(".png")
        entities.append(
            {"id": entity, "category": m["category"], "subcategory": m["subcategory"], "styles": list(dirs)}
        )
        for style, d in dirs.items():
            (args.out / "glyphs" / style).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(d / m["image"], args.out / "glyphs" / style / f"{entity}.png")
    with (args.out / "entities.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(e, ensure_ascii=False) + "\n" for e in entities)
    print(f"{len(entities)} entities, {len({e['subcategory'] for e in entities})} subcategories → {args.out}")


if __name__ == "__main__":
    main()

"""A labelled grid of the built-in model's images: knowledge on vs off, seen vs held-out entities.

Rows: a few seen and a few held-out kshapes entities ("{background}背景上有一个{entity}");
columns: knowledge on × seeds, then knowledge off × the same seeds (so each pair differs only in
the knowledge switch, ``RapidDiffusionPipeline(..., knowledge=...)``). Each row is labelled with
the entity and its colour/shape from the model's own knowledge graph; each image with the colour
the kshapes detector reads off it, ✓ where it is the KG's colour.

    python benchmarks/builtin_grid.py --out docs/images/builtin_grid.png
    python benchmarks/builtin_grid.py --model /tmp/bi/builtin --kshapes /tmp/ksfull --steps 25

Held-out entities come from ``--heldout``, ``--kshapes DIR`` (its heldout_entities.txt) or, by default,
the model folder's knowledge/kg_only_entities.json (the chain writes it).
Labels need a font with Chinese glyphs: ``--font``, else the first ``fc-list :lang=zh`` finds;
with none, rows are labelled in English (colour, shape, entity number) and the entity names are
listed in ``OUT.txt`` beside the PNG.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

# English for the KG's attribute names, for labels drawn without a Chinese font.
ENGLISH = {
    "红色": "red", "黄色": "yellow", "绿色": "green", "蓝色": "blue", "紫色": "purple",
    "橙色": "orange", "白色": "white", "黑色": "black", "粉色": "pink", "棕色": "brown",
    "灰色": "grey", "圆形": "circle", "椭圆形": "ellipse", "方形": "square", "三角形": "triangle",
    "星形": "star", "长条形": "bar",
}  # fmt: skip
CELL_GAP = 2


def find_cjk_font(explicit: str | None) -> str | None:
    """A font file that draws Chinese: ``explicit``, else fontconfig's first zh font, else None."""
    if explicit:
        if not Path(explicit).is_file():
            raise FileNotFoundError(f"--font: no such file: {explicit}")
        return explicit
    try:
        listing = subprocess.run(
            ["fc-list", ":lang=zh", "file"], capture_output=True, text=True, check=False, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    files = sorted(line.split(":")[0].strip() for line in listing.splitlines() if line.strip())
    return files[0] if files else None


def kg_attributes(store: Any, name: str) -> dict[str, str]:
    """The entity's 颜色 and 形状 facts from the model's KnowledgeStore."""
    entity = store.id_of(name)
    if entity is None:
        raise ValueError(f"'{name}' is not an entity of the model's knowledge store; pick another")
    names = store.relation_names
    return {names[rel]: store.entity_names[tail] for rel, tail in store.facts(entity)}


def read_heldout(kshapes: Path | None, given: str | None, model_dir: Path) -> list[str]:
    if given:
        return [n.strip() for n in given.split(",") if n.strip()]
    if kshapes is None:
        # The chain records its test held-out entities in the model folder it exports.
        record = model_dir / "knowledge" / "kg_only_entities.json"
        if record.is_file():
            return list(json.loads(record.read_text(encoding="utf-8"))["heldout"])
        raise ValueError(
            f"held-out entities unknown: {record} not found; pass --kshapes DIR (the kshapes data the "
            "model was trained on) or --heldout NAME,NAME"
        )
    file = kshapes / "heldout_entities.txt"
    if not file.is_file():
        raise FileNotFoundError(f"--kshapes: {file} not found (made by `rapiddiff data kshapes`)")
    return [line.strip() for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]


def spread_colours(names: list[str], colours: dict[str, str], n: int) -> list[str]:
    """Up to ``n`` names, different KG colours first (a grid of three red things says less)."""
    picked: list[str] = []
    for name in names:
        if len(picked) < n and colours[name] not in {colours[p] for p in picked}:
            picked.append(name)
    picked += [name for name in names if name not in picked][: n - len(picked)]
    return picked


def draw_grid(rows: list[dict[str, Any]], columns: list[str], cell: int, font_path: str | None) -> Any:
    """PIL grid; ``rows`` hold "label" (lines), "images" and "notes" (one per column)."""
    from PIL import Image, ImageDraw, ImageFont

    size = max(11, cell // 10)
    if font_path:
        font = ImageFont.truetype(font_path, size)
        small = ImageFont.truetype(font_path, size - 2)
    else:
        font = ImageFont.load_default(size)
        small = ImageFont.load_default(size - 2)
    label_w, head_h, note_h = 11 * size, 2 * size, size + 4
    width = label_w + len(columns) * (cell + CELL_GAP)
    height = head_h + len(rows) * (cell + note_h + CELL_GAP)
    grid = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(grid)
    for c, title in enumerate(columns):
        x = label_w + c * (cell + CELL_GAP)
        draw.text((x + cell // 2, head_h // 2), title, fill="black", font=font, anchor="mm")
    for r, row in enumerate(rows):
        y = head_h + r * (cell + note_h + CELL_GAP)
        for k, line in enumerate(row["label"]):
            draw.text((4, y + 4 + k * (size + 4)), line, fill="black", font=font)
        for c, (image, note) in enumerate(zip(row["images"], row["notes"], strict=True)):
            x = label_w + c * (cell + CELL_GAP)
            grid.paste(image.convert("RGB").resize((cell, cell)), (x, y))
            ok = note.endswith("✓") or note.endswith("ok")
            draw.text((x + 2, y + cell + 1), note, fill="darkgreen" if ok else "firebrick", font=small)
    return grid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="builtin:kshapes", help="model folder or builtin:NAME (default: builtin:kshapes)"
    )
    parser.add_argument("--kshapes", type=Path, help="kshapes data folder (for heldout_entities.txt)")
    parser.add_argument("--heldout", help="held-out entities to show, comma-separated (instead of --kshapes)")
    parser.add_argument("--seen", default="番茄,橘子,蓝莓", help="seen entities, comma-separated")
    parser.add_argument("--rows", type=int, default=3, help="held-out entities shown (default 3)")
    parser.add_argument("--seeds", default="0,1", help="seeds, comma-separated (default 0,1)")
    parser.add_argument("--background", default="灰色", help="background named in the prompts")
    parser.add_argument("--steps", type=int, help="denoising steps (default: the model's, as generate)")
    parser.add_argument("--font", help="a font file with Chinese glyphs (default: fc-list :lang=zh)")
    parser.add_argument("--cell", type=int, default=128, help="pixels per image in the grid (default 128)")
    parser.add_argument("--out", type=Path, default=Path("docs/images/builtin_grid.png"), help="PNG to write")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)

    from PIL import Image

    from rapiddiff.data.kshapes import detect_attributes
    from rapiddiff.infer.generate_cli import DEFAULT_SAMPLING, model_sampling_defaults, resolve_model_dir
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline
    from rapiddiff.utils.device import resolve_device, resolve_dtype
    from rapiddiff.utils.io import atomic_open, atomic_write_text

    model_dir = resolve_model_dir(args.model)
    try:  # bad input is reported before the model is loaded
        heldout_names = read_heldout(args.kshapes, args.heldout, model_dir)
        font_path = find_cjk_font(args.font)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    seeds = [int(s) for s in args.seeds.split(",")]
    device = resolve_device(args.device)
    pipe = RapidDiffusionPipeline.from_pretrained(
        model_dir, device=device, dtype=resolve_dtype("auto", device)
    )
    store = pipe.text_encoder.store
    if store is None:
        raise ValueError(f"{model_dir} has no knowledge store: there is nothing to switch on and off")
    sampling = {**DEFAULT_SAMPLING, **model_sampling_defaults(model_dir)}
    if args.steps:
        sampling["num_inference_steps"] = args.steps

    seen = [n.strip() for n in args.seen.split(",") if n.strip()]
    heldout_all = [n for n in heldout_names if store.id_of(n) is not None]
    attrs = {n: kg_attributes(store, n) for n in seen + heldout_all}
    clash = sorted(set(seen) & set(heldout_all))
    if clash:
        raise ValueError(f"--seen names held-out entities: {', '.join(clash)}")
    heldout = spread_colours(heldout_all, {n: attrs[n].get("颜色", "") for n in heldout_all}, args.rows)
    entities = [(n, "seen") for n in seen] + [(n, "held-out") for n in heldout]

    prompts = [f"{args.background}背景上有一个{name}" for name, _ in entities for _ in seeds]
    all_seeds = [s for _ in entities for s in seeds]
    runs = {}
    for knowledge in (True, False):
        out = pipe(prompts, seed=all_seeds, knowledge=knowledge, **sampling)
        runs[knowledge] = out.images

    columns = [f"{'KG on' if k else 'KG off'} s{s}" for k in (True, False) for s in seeds]
    rows, scores = [], {"seen": {True: 0, False: 0}, "held-out": {True: 0, False: 0}}
    for i, (name, split) in enumerate(entities):
        colour, shape = attrs[name].get("颜色", "?"), attrs[name].get("形状", "?")
        if font_path:
            label = [name, split, f"{colour} {shape}"]
        else:
            label = [f"#{store.id_of(name)} {split}", ENGLISH.get(colour, "?"), ENGLISH.get(shape, "?")]
        images, notes = [], []
        for knowledge in (True, False):
            for j in range(len(seeds)):
                image = runs[knowledge][i * len(seeds) + j]
                found = detect_attributes(image)["colour"]
                right = found == colour
                scores[split][knowledge] += right
                shown = found if font_path else ENGLISH.get(found, str(found))
                images.append(image)
                notes.append(f"{shown} {'✓' if font_path else 'ok'}" if right else str(shown))
        rows.append({"label": label, "images": images, "notes": notes})

    grid = draw_grid(rows, columns, args.cell, font_path)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(args.out, "wb") as handle:
        # A 256-colour palette halves the file (flat kshapes colours survive it; no dithering noise).
        palette = grid.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        palette.save(handle, format="PNG", optimize=True)
    summary = {
        "model": str(model_dir),
        "sampling": sampling,
        "background": args.background,
        "seeds": seeds,
        "font": font_path,
        "rows": [{"entity": n, "split": s, **attrs[n]} for n, s in entities],
        "kg_colour_detected": {
            split: {"knowledge_on": v[True], "knowledge_off": v[False]} for split, v in scores.items()
        },
        "images_per_cell": {split: len(seeds) * sum(s == split for _, s in entities) for split in scores},
    }
    atomic_write_text(args.out.with_suffix(".json"), json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    if not font_path:
        names = [f"#{store.id_of(n)} = {n}" for n, _ in entities]
        atomic_write_text(args.out.with_suffix(".txt"), "\n".join(names) + "\n")
        print("no font with Chinese glyphs here (fc-list :lang=zh is empty): English labels; names in "
              f"{args.out.with_suffix('.txt')}", file=sys.stderr)  # fmt: skip
    size_kb = args.out.stat().st_size / 1024
    print(f"wrote {args.out} ({grid.size[0]}×{grid.size[1]}, {size_kb:.0f} KB)")
    print(json.dumps(summary["kg_colour_detected"], ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``rapiddiff eval report``: one self-contained HTML page (and a PNG grid) for an eval run.

The page holds, with nothing fetched from anywhere (images are base64 PNG thumbnails):
the metrics table (every JSON file under ``RUN/metrics/`` plus any ``--metrics`` file, e.g. the
output of ``eval recall --out``), a grid of samples per prompt for the run and for every
sub-run (``knowledge_on/``, ``knowledge_off/``: seen side by side), and the model's config.
A few lines of inline script count the images the browser decoded and write the count into
``<body data-images-loaded="k/n">``, so a headless browser can check the page renders.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rapiddiff.eval.common import INDEX_NAME, METRICS_DIR, SAMPLE_INFO, open_rgb, read_index

_CSS = """
body{font-family:system-ui,"Noto Sans CJK SC","Microsoft YaHei",sans-serif;margin:24px;color:#222}
h1{font-size:22px} h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0} td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px;
vertical-align:top} th{background:#f3f3f3} td.num{text-align:right;font-variant-numeric:tabular-nums}
.grid td{border:none;padding:2px} .prompt{font-size:13px;max-width:260px} img{display:block}
.warn{color:#a40} pre{background:#f7f7f7;padding:8px;font-size:12px;overflow:auto;max-height:480px}
.small{color:#666;font-size:12px} img{image-rendering:pixelated} td.gap{width:16px}
"""

_SCRIPT = """
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute('data-images-loaded', ok + '/' + imgs.length);
});
"""


def sample_sets(run: Path) -> list[tuple[str, Path]]:
    """The run itself (if it has an index) and its immediate sub-runs, by name."""
    sets = [(run.name, run)] if (run / INDEX_NAME).is_file() else []
    sets += [(p.name, p) for p in sorted(run.iterdir()) if p.is_dir() and (p / INDEX_NAME).is_file()]
    return sets


def grouped(
    index: Sequence[dict[str, Any]], max_prompts: int, max_images: int
) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Index rows grouped by prompt (in prompt order), capped."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in index:
        groups.setdefault((int(row.get("index", 0)), row["prompt"]), []).append(row)
    return [(rows[0], rows[:max_images]) for _, rows in list(groups.items())[:max_prompts]]


def thumbnail(path: Path, size: int) -> Any:
    img = open_rgb(path)
    img.thumbnail((size, size))
    return img


def data_uri(img: Any) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def load_metrics(run: Path, extra: Sequence[Path] = ()) -> list[dict[str, Any]]:
    files = sorted((run / METRICS_DIR).glob("*.json")) if (run / METRICS_DIR).is_dir() else []
    records = []
    for path in [*files, *extra]:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable metrics JSON file ({err})") from err
        records.append({"_file": str(path), **(data if isinstance(data, dict) else {"value": data})})
    return records


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.1f}"
    return html.escape(str(value))


def _flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Numeric leaves of a JSON object as (dotted key, value); for files in other formats (recall)."""
    out: list[tuple[str, Any]] = []
    if isinstance(data, dict):
        for k, v in data.items():
            if not str(k).startswith("_"):
                out += _flatten(v, f"{prefix}{k}.")
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        out.append((prefix.rstrip("."), data))
    return out


def _table(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td class='num'>{_fmt(r.get(k))}</td>"
            if isinstance(r.get(k), (int, float))
            else f"<td>{_fmt(r.get(k, ''))}</td>"
            for k in keys
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def metrics_html(records: Sequence[dict[str, Any]]) -> str:
    if not records:
        return "<p class='small'>No metrics yet: run <code>rapiddiff eval fid|clipscore|knowledge</code> first.</p>"
    rows, extras = [], []
    for r in records:
        source = html.escape(Path(r["_file"]).name)
        if "label" in r and "value" in r:
            d = r.get("details", {})
            how = "; ".join(
                f"{k}: {d[k]}"
                for k in ("library", "extractor", "resize", "statistics", "convention", "detector")
                if k in d
            )
            n = ", ".join(f"{k} {d[k]}" for k in ("n_real", "n_fake", "pairs", "images_per_mode") if k in d)
            warn = "".join(f"<div class='warn'>⚠ {html.escape(w)}</div>" for w in r.get("warnings", []))
            value = "—" if r["value"] is None else _fmt(r["value"])
            rows.append(
                f"<tr><td>{html.escape(str(r['label']))}</td><td class='num'>{value}</td>"
                f"<td class='small'>{html.escape(n)}</td><td class='small'>{html.escape(how)}{warn}</td>"
                f"<td class='small'>{source}</td></tr>"
            )
            if r.get("table"):
                extras.append(f"<h3>{html.escape(str(r['label']))}</h3>" + _table(r["table"]))
        else:  # a file in another format, e.g. `eval recall --out`: its numbers, flattened
            for key, value in _flatten(r):
                rows.append(
                    f"<tr><td>{html.escape(key)}</td><td class='num'>{_fmt(value)}</td><td></td><td></td>"
                    f"<td class='small'>{source}</td></tr>"
                )
    head = "<tr><th>metric</th><th>value</th><th>images</th><th>how it was measured</th><th>file</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>" + "".join(extras)


def comparable(sets: Sequence[tuple[str, Path]]) -> bool:
    """Do the sample sets share one prompt list (e.g. knowledge_on / knowledge_off, or two
    checkpoints sampled from one prompt file)? Then they are shown side by side."""
    if len(sets) < 2:
        return False
    keys = [[(r.get("index"), r["prompt"]) for r in read_index(path)] for _, path in sets]
    return all(sorted(set(k)) == sorted(set(keys[0])) for k in keys[1:])


def _cell(run: Path, row: dict[str, Any], thumb: int) -> str:
    path = run / row["file"]
    if not path.is_file():
        return f"<td class='small'>missing: {html.escape(row['file'])}</td>"
    alt = html.escape(f"{row['prompt']} (seed {row.get('seed')})", quote=True)
    img = thumbnail(path, thumb)
    # Small images (kshapes' 64-128 px) are shown enlarged to the thumbnail box, pixel for pixel.
    scale = thumb / max(img.size)
    w, h = round(img.width * scale), round(img.height * scale)
    return f"<td><img src='{data_uri(img)}' width='{w}' height='{h}' alt='{alt}' title='{alt}'></td>"


def grid_html(sets: Sequence[tuple[str, Path]], max_prompts: int, max_images: int, thumb: int) -> str:
    """One grid, rows = prompts, a column group per set (sets that share prompts) or one per set."""
    indexes = {name: grouped(read_index(path), 10**9, max_images) for name, path in sets}
    cols = {name: max(len(rows) for _, rows in groups) for name, groups in indexes.items()}
    names = ", ".join(f"{name} ({len(read_index(path))} images)" for name, path in sets)
    parts = [f"<h2>Samples: {html.escape(names)}</h2>", "<table class='grid'>"]
    if len(sets) > 1:
        parts.append(
            "<tr><th></th>"
            + "".join(f"<th colspan='{cols[name] + 1}'>{html.escape(name)}</th>" for name, _ in sets)
            + "</tr>"
        )
    base_name = sets[0][0]
    by_key = {
        name: {(f.get("index"), f["prompt"]): rows for f, rows in groups} for name, groups in indexes.items()
    }
    for first, _ in indexes[base_name][:max_prompts]:
        key = (first.get("index"), first["prompt"])
        tags = " ".join(f"{k}={first[k]}" for k in ("entity", "split", "colour", "shape") if first.get(k))
        cells = []
        for name, path in sets:
            rows = by_key[name].get(key, [])
            cells += [_cell(path, row, thumb) for row in rows]
            cells += ["<td></td>"] * (cols[name] - len(rows)) + ["<td class='gap'></td>"] * (len(sets) > 1)
        parts.append(
            f"<tr><td class='prompt'>{html.escape(first['prompt'])}<div class='small'>"
            f"{html.escape(tags)}</div></td>{''.join(cells)}</tr>"
        )
    parts.append("</table>")
    return "".join(parts)


def png_grid(
    sets: Sequence[tuple[str, Path]], out: Path, max_prompts: int = 16, max_images: int = 8, thumb: int = 128
) -> Path:
    """Prompts as rows, each set's images as a column group (a wider gap between sets), on white."""
    from PIL import Image

    from rapiddiff.utils.io import atomic_open

    groups = {
        name: {
            (f.get("index"), f["prompt"]): rows for f, rows in grouped(read_index(path), 10**9, max_images)
        }
        for name, path in sets
    }
    keys = list(groups[sets[0][0]])[:max_prompts]
    cols = max(len(rows) for g in groups.values() for rows in g.values())
    gap, set_gap = 4, 4 * thumb // 16
    width = len(sets) * (cols * (thumb + gap)) + (len(sets) - 1) * set_gap + gap
    canvas = Image.new("RGB", (width, len(keys) * (thumb + gap) + gap), "white")
    for s, (name, path) in enumerate(sets):
        x0 = gap + s * (cols * (thumb + gap) + set_gap)
        for r, key in enumerate(keys):
            for c, row in enumerate(groups[name].get(key, [])):
                if (path / row["file"]).is_file():
                    img = thumbnail(path / row["file"], thumb)
                    img = img.resize((thumb, round(thumb * img.height / img.width)), Image.Resampling.NEAREST)
                    canvas.paste(img, (x0 + c * (thumb + gap), gap + r * (thumb + gap)))
    with atomic_open(out) as handle:
        canvas.save(handle, format="PNG")
    return out


def build_report(
    run: str | Path,
    *,
    extra_metrics: Sequence[Path] = (),
    model: Path | None = None,
    max_prompts: int = 32,
    max_images: int = 8,
    thumb: int = 128,
    title: str | None = None,
) -> str:
    """The HTML text of the report."""
    from rapiddiff import __version__

    run = Path(run)
    sets = sample_sets(run)
    if not sets:
        raise FileNotFoundError(
            f"{run}: no index.jsonl in it or its subfolders; make samples with `rapiddiff eval sample --out {run}` "
            "or `rapiddiff eval knowledge --out ...`"
        )
    config: dict[str, Any] | None = None
    if model is not None:
        from rapiddiff.eval.sample import model_config

        config = model_config(model)
    settings = {}
    for _, path in sets:
        if (path / SAMPLE_INFO).is_file():
            info = json.loads((path / SAMPLE_INFO).read_text(encoding="utf-8"))
            settings[path.name] = info.get("settings", {})
            config = config or info.get("model_config")
    title = title or f"rapiddiff evaluation: {run.name}"
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='small'>{html.escape(str(run.resolve()))} · rapiddiff {__version__}</p>",
        "<h2>Metrics</h2>",
        metrics_html(load_metrics(run, extra_metrics)),
        *(
            [grid_html(sets, max_prompts, max_images, thumb)]
            if comparable(sets)
            else [grid_html([one], max_prompts, max_images, thumb) for one in sets]
        ),
        "<h2>Sampling settings</h2>",
        f"<pre>{html.escape(json.dumps(settings, ensure_ascii=False, indent=2))}</pre>",
        "<h2>Model config</h2>",
        f"<pre>{html.escape(json.dumps(config, ensure_ascii=False, indent=2)) if config else 'not recorded'}</pre>",
    ]
    return (
        "<!DOCTYPE html><html lang='zh'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style><script>{_SCRIPT}</script></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "One self-contained HTML page for an eval run (images embedded as base64 thumbnails): the metrics "
        "table from RUN/metrics/*.json (and --metrics files), a sample grid per prompt for the run and its "
        "sub-runs, the sampling settings and the model's config. Also writes a PNG grid."
    )
    parser.add_argument("run", type=Path, help="eval run folder (eval sample / eval knowledge output)")
    parser.add_argument("--out", type=Path, help="HTML file (default: RUN/report.html)")
    parser.add_argument("--png", type=Path, help="PNG grid (default: RUN/report.png)")
    parser.add_argument(
        "--metrics", type=Path, nargs="*", default=[], help="more metrics JSON files to include"
    )
    parser.add_argument("--model", type=Path, help="model folder whose config to show (default: as recorded)")
    parser.add_argument("--max-prompts", type=int, default=32, help="prompts per sample grid (default: 32)")
    parser.add_argument("--max-images", type=int, default=8, help="images per prompt (default: 8)")
    parser.add_argument("--thumb", type=int, default=128, help="thumbnail size in pixels (default: 128)")
    parser.add_argument("--title", help="page title")


def run(args: argparse.Namespace) -> int:
    from rapiddiff.utils.io import atomic_write_text

    for path in args.metrics:
        if not path.is_file():
            raise FileNotFoundError(f"--metrics: file not found: {path}")
    page = build_report(
        args.run,
        extra_metrics=args.metrics,
        model=args.model,
        max_prompts=args.max_prompts,
        max_images=args.max_images,
        thumb=args.thumb,
        title=args.title,
    )
    out = args.out or args.run / "report.html"
    atomic_write_text(out, page)
    sets = sample_sets(args.run)
    png = png_grid(
        sets if comparable(sets) else sets[:1],
        args.png or args.run / "report.png",
        max_prompts=min(args.max_prompts, 16),
        max_images=args.max_images,
        thumb=args.thumb,
    )
    print(f"report → {out} ({len(page) / 1e6:.1f} MB), grid → {png}")
    return 0

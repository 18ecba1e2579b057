"""``rapiddiff eval report``: the page a person shares — one self-contained HTML file (and a PNG grid).

Top to bottom: the results (knowledge accuracy for seen / held-out entities × knowledge on / off
with 95 % Wilson intervals and the on − off lift — and, where ``eval knowledge`` wrote them, the
attribute split, background / position / all-named accuracy, render PSNR / SSIM and modes text /
both; retrieval recall with intervals over the queries; FID, CLIPScore and any other metric file
under ``RUN/metrics/`` or given with ``--metrics``), bar charts drawn as inline SVG where they read
better than numbers, the render-consistency grid (``RUN/render_consistency.png``), then a block
per prompt with each set's images large (``knowledge_on`` beside ``knowledge_off``), and last the
sampling settings and model config, folded. Nothing is fetched: images are embedded, text uses a
font stack that renders Chinese on Linux, macOS and Windows. A few lines of inline script record
in ``<body>`` how many images the browser decoded and the smallest drawn width, for a headless
browser to check.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rapiddiff import __version__
from rapiddiff.eval.common import INDEX_NAME, METRICS_DIR, SAMPLE_INFO, open_rgb, read_index
from rapiddiff.eval.knowledge import wilson_interval
from rapiddiff.eval.sample import model_config
from rapiddiff.utils.io import atomic_open, atomic_write_text

# Fonts that render Chinese on common systems (Linux: Noto/Source Han/WenQuanYi; macOS: PingFang;
# Windows: Microsoft YaHei), then the browser's sans-serif. Nothing is downloaded.
FONT_STACK = (
    '"Noto Sans CJK SC", "Source Han Sans SC", "PingFang SC", "Microsoft YaHei", '
    '"WenQuanYi Micro Hei", sans-serif'
)

_CSS = """
:root{--ink:#1d2330;--muted:#5b6474;--line:#d9dde5;--on:#2f6fdb;--off:#9aa3b2;--bg:#fafbfc}
body{font-family:FONTS;margin:0;color:var(--ink);background:#fff;line-height:1.45}
main{max-width:1320px;margin:0 auto;padding:28px 32px 64px}
h1{font-size:28px;margin:0 0 4px} h2{font-size:21px;margin:36px 0 12px;padding-bottom:6px;
border-bottom:2px solid var(--line)} h3{font-size:16px;margin:22px 0 8px}
.small{color:var(--muted);font-size:13px} .warn{color:#a4400a;font-size:13px}
table{border-collapse:collapse;margin:6px 0 10px;font-size:15px}
th,td{border-bottom:1px solid var(--line);padding:7px 14px;text-align:left;vertical-align:top}
th{background:var(--bg);font-weight:600;font-size:14px}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.num .ci{color:var(--muted);font-size:12px;margin-left:6px}
tr.lift td{background:#f4f8ff;font-weight:600}
table.knowledge td:nth-child(-n+2){white-space:nowrap}
tr.groups th{background:#fff;color:var(--muted);font-weight:500;font-size:12px;text-align:center;border-bottom:none;padding-bottom:0}
.plots{display:flex;flex-wrap:wrap;gap:28px} .plots figure{margin:0}
figcaption{font-size:13px;color:var(--muted);max-width:460px}
svg text{font-family:FONTS}
.prompt{margin:26px 0 6px;font-size:19px;font-weight:600} .tags{font-size:13px;color:var(--muted)}
.sets{display:flex;flex-wrap:wrap;gap:22px;align-items:flex-start}
.set h4{margin:4px 0;font-size:14px;color:var(--muted);font-weight:600}
.set.on h4{color:var(--on)}
.images{display:flex;flex-wrap:wrap;gap:6px}
.images img{display:block;border-radius:3px;background:#eee}
img.pixel{image-rendering:pixelated}
details{margin-top:10px} pre{background:var(--bg);padding:10px;font-size:12px;overflow:auto;max-height:480px}
""".replace("FONTS", FONT_STACK)

# After load, the page writes what a headless browser needs to check it rendered: images decoded
# (naturalWidth > 0) of all, and the smallest width an image of the grids is drawn at.
_SCRIPT = """
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  var widths = imgs.map(function (i) { return Math.round(i.getBoundingClientRect().width); });
  document.body.setAttribute('data-images-loaded', ok + '/' + imgs.length);
  document.body.setAttribute('data-min-image-width', widths.length ? Math.min.apply(null, widths) : 0);
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
    """Numeric leaves of a JSON object as (dotted key, value); for files in other formats."""
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


# ---------------------------------------------------------------------------- metrics, first
Interval = tuple[float, float]
SPLIT_NAMES = {
    "seen": "seen",
    "heldout": "held-out",
    "attribute": "attribute captions",
    "attribute_val": "attribute captions (validation)",
}


def wilson(percent: float, n: int) -> Interval:
    """95 % Wilson interval (percent) of an accuracy given in percent over ``n`` trials."""

    return wilson_interval(round(percent * n / 100), n)


def _pct(value: float | None, ci: Interval | None = None) -> str:
    if value is None:
        return "<td class='num'>—</td>"
    interval = f"<span class='ci'>{ci[0]:.1f}–{ci[1]:.1f}</span>" if ci else ""
    return f"<td class='num'>{value:.1f} %{interval}</td>"


def _is_knowledge(r: dict[str, Any]) -> bool:
    return r.get("metric") == "knowledge" and isinstance(r.get("table"), list)


def _is_recall(r: dict[str, Any]) -> bool:
    return isinstance(r.get("text_to_image"), dict) and isinstance(r.get("image_to_text"), dict)


MODE_NAMES = {
    "text": "text (KG facts in the prompt)",
    "both": "both (KG facts + vectors)",
    "embed": "embed (KG vectors)",
}
"""How a knowledge mode reads in the table ("both" is not the "both right" column)."""
EXTRA_PCT = (("background", "background"), ("position", "position"), ("all", "all named"))
"""Accuracy columns `eval knowledge` writes since the attribute split (None: no prompt names it)."""


def knowledge_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The knowledge table's rows with 95 % Wilson intervals for colour, shape, both and "all named"
    (every record has an all_ok, so its n is the images; background and position are over the
    prompts naming them, a count the JSON does not keep: no interval)."""
    rows = []
    for row in record["table"]:
        n = int(row.get("images", 0))
        ci = {
            k: wilson(float(row[k]), n) for k in ("colour", "shape", "both", "all") if row.get(k) is not None
        }
        if row.get("both_ci95"):
            ci["both"] = tuple(row["both_ci95"])  # as eval knowledge computed it
        rows.append({**row, "ci": ci})
    return rows


def _has(rows: Sequence[dict[str, Any]], key: str) -> bool:
    return any(r.get(key) is not None for r in rows)


def _diff(on: dict[str, Any], off: dict[str, Any], key: str, unit: str, digits: int) -> str:
    if on.get(key) is None or off.get(key) is None:
        return "<td></td>"
    return f"<td class='num'>{on[key] - off[key]:+.{digits}f}{unit}</td>"


def knowledge_html(record: dict[str, Any]) -> str:
    rows = knowledge_rows(record)
    # Columns of newer runs, shown when the JSON has them (old runs: the table as it always was).
    extra = [(k, name) for k, name in EXTRA_PCT if _has(rows, k)]
    render = _has(rows, "psnr") or _has(rows, "ssim")
    head = "<th>entities</th><th>knowledge</th><th>images</th><th>colour right</th><th>shape right</th><th>both right</th>"
    head += "".join(f"<th>{name} right</th>" for _, name in extra)
    head += "<th>render PSNR</th><th>render SSIM</th>" if render else ""
    if extra or render:  # a row over the header naming the column groups
        groups = "<th colspan='3'></th><th colspan='3'>colour and shape (95 % Wilson interval)</th>"
        groups += f"<th colspan='{len(extra)}'>what else the prompt names</th>" if extra else ""
        groups += "<th colspan='2'>render consistency</th>" if render else ""
        head = f"<tr class='groups'>{groups}</tr><tr>{head}</tr>"
    else:
        head = f"<tr>{head}</tr>"
    out = [
        "<h3>Knowledge accuracy: does the image show the entity's colour and shape"
        + (", and what else the prompt names?</h3>" if extra else "?</h3>"),
        f"<table class='knowledge'>{head}",
    ]

    def cells(r: dict[str, Any]) -> str:
        text = "".join(_pct(r.get(k), r["ci"].get(k)) for k in ("colour", "shape", "both"))
        text += "".join(_pct(r.get(k), r["ci"].get(k)) for k, _ in extra)
        if render:
            psnr, ssim = r.get("psnr"), r.get("ssim")
            text += f"<td class='num'>{'—' if psnr is None else f'{psnr:.2f} dB'}</td>"
            text += f"<td class='num'>{'—' if ssim is None else f'{ssim:.4f}'}</td>"
        return text

    def lift(on: dict[str, Any], off: dict[str, Any]) -> str:
        text = "".join(_diff(on, off, k, " pt", 1) for k in ("colour", "shape", "both"))
        text += "".join(_diff(on, off, k, " pt", 1) for k, _ in extra)
        if render:
            text += _diff(on, off, "psnr", " dB", 2) + _diff(on, off, "ssim", "", 4)
        return text

    # One block per split (and per prompt variant, for prompts_robust.jsonl), its modes in order,
    # then each knowledge mode's lift over "off".
    for split, variant in dict.fromkeys((r["split"], r.get("variant")) for r in rows):
        name = SPLIT_NAMES.get(split, split) + (f", {variant}" if variant else "")
        by_mode = {r["knowledge"]: r for r in rows if (r["split"], r.get("variant")) == (split, variant)}
        for mode, r in by_mode.items():
            entities = f" ({r['entities']})" if "entities" in r else ""
            out.append(
                f"<tr><td>{html.escape(name)}{entities}</td>"
                f"<td>{html.escape(MODE_NAMES.get(str(mode), str(mode)))}</td>"
                f"<td class='num'>{r.get('images', '')}</td>{cells(r)}</tr>"
            )
        for mode in (m for m in by_mode if m != "off" and "off" in by_mode):
            out.append(
                f"<tr class='lift'><td>{html.escape(name)}</td><td>{html.escape(str(mode))} − off</td>"
                f"<td></td>{lift(by_mode[mode], by_mode['off'])}</tr>"
            )
    out.append("</table>")
    chance = record.get("details", {}).get("chance")
    note = "95 % Wilson intervals in grey (images treated as independent draws)."
    if chance:
        note += (
            f" Chance (uniform guess): colour {chance['colour']:.1f} %, shape {chance['shape']:.1f} %, "
            f"both {chance['both']:.1f} %."
        )
    if extra:
        note += (
            " Background and position are scored over the prompts that name them (— : none does; the "
            "attribute split's captions name all four), with no interval (the JSON does not keep how "
            "many prompts named them); all named: every attribute the prompt names, right."
        )
    if render:
        how = record.get("details", {}).get("render_consistency", {})
        ssim = f" (SSIM: {how['ssim']})" if how.get("ssim") else ""
        note += (
            " Render PSNR / SSIM: each image against kshapes' renderer drawing what the detector read off "
            f"it, the mean over the images{html.escape(ssim)}: how crisp and flat the drawings are, not "
            "whether they are right."
        )
    out.append(f"<p class='small'>{note}</p>")
    out += [f"<div class='warn'>⚠ {html.escape(w)}</div>" for w in record.get("warnings", [])]
    return "".join(out)


def _recall_label(r: dict[str, Any]) -> str:
    parts = [Path(r["_file"]).stem]
    if "knowledge" in r:
        parts.append(f"knowledge {'on' if r['knowledge'] else 'off'}")
    if r.get("entities"):
        parts.append(f"captions naming {len(r['entities'])} listed entities")
    return " · ".join(parts)


def recall_html(records: Sequence[dict[str, Any]]) -> str:
    ks = [k for k in records[0]["text_to_image"] if k.startswith("R@")]
    head = "".join(f"<th>{html.escape(k)}</th>" for k in ks)
    out = [
        "<h3>Retrieval recall (Chinese-CLIP protocol)</h3>",
        f"<table class='recall'><tr><th>run</th><th>direction</th>{head}<th>mean</th><th>queries</th></tr>",
    ]
    for r in records:
        for key, name, nq in (
            ("text_to_image", "text → image", "num_text_queries"),
            ("image_to_text", "image → text", "num_image_queries"),
        ):
            n = int(r.get(nq, 0))
            row = r[key]
            out.append(
                f"<tr><td>{html.escape(_recall_label(r))}</td><td>{name}</td>"
                + "".join(_pct(row.get(k), wilson(row[k], n) if n and k in row else None) for k in ks)
                + f"<td class='num'>{row.get('mean', 0):.1f}</td><td class='num'>{n}</td></tr>"
            )
    out.append("</table><p class='small'>95 % Wilson intervals over the queries in grey.</p>")
    return "".join(out)


def other_metrics_html(records: Sequence[dict[str, Any]]) -> str:
    rows = []
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
            if r["value"] is not None and d.get("std") is not None and d.get("pairs", 0) > 1:
                half = 1.96 * float(d["std"]) / float(d["pairs"]) ** 0.5  # normal approximation of the mean
                value += f"<span class='ci'>± {half:.2f}</span>"
            rows.append(
                f"<tr><td>{html.escape(str(r['label']))}</td><td class='num'>{value}</td>"
                f"<td class='small'>{html.escape(n)}</td><td class='small'>{html.escape(how)}{warn}</td>"
                f"<td class='small'>{source}</td></tr>"
            )
            if r.get("table"):
                rows.append(f"<tr><td colspan='5'>{_table(r['table'])}</td></tr>")
        else:  # another format: its numbers, flattened
            for key, value in _flatten(r):
                rows.append(
                    f"<tr><td>{html.escape(key)}</td><td class='num'>{_fmt(value)}</td><td></td><td></td>"
                    f"<td class='small'>{source}</td></tr>"
                )
    if not rows:
        return ""
    head = "<tr><th>metric</th><th>value</th><th>images</th><th>how it was measured</th><th>file</th></tr>"
    return f"<h3>Other metrics</h3><table class='other'>{head}{''.join(rows)}</table>"


def metrics_html(records: Sequence[dict[str, Any]]) -> str:
    """The results: knowledge accuracy (seen / held-out × on / off), recall, then the rest."""
    if not records:
        return "<p class='small'>No metrics yet: run <code>rapiddiff eval fid|clipscore|knowledge</code> first.</p>"
    knowledge = [r for r in records if _is_knowledge(r)]
    recall = [r for r in records if _is_recall(r)]
    rest = [r for r in records if not _is_knowledge(r) and not _is_recall(r)]
    parts = [knowledge_html(r) for r in knowledge]
    if recall:
        parts.append(recall_html(recall))
    parts.append(other_metrics_html(rest))
    return "".join(parts)


# ---------------------------------------------------------------------------- plots (inline SVG)
def bar_chart_svg(
    title: str,
    groups: Sequence[str],
    series: Sequence[tuple[str, str]],
    values: dict[tuple[str, str], tuple[float, Interval | None]],
    *,
    reference: tuple[float, str] | None = None,
    width: int = 380,
    height: int = 280,
) -> str:
    """Grouped bars (0–100 %) with 95 % interval whiskers; ``series`` is (name, colour)."""
    left, right, top, bottom = 44, 12, 46, 34
    plot_w, plot_h = width - left - right, height - top - bottom

    def y(v: float) -> float:
        return top + plot_h * (1 - max(0.0, min(100.0, v)) / 100)

    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' role='img' aria-label='{html.escape(title, quote=True)}'>",
        f"<text x='{left}' y='18' font-size='14' font-weight='600' fill='#1d2330'>{html.escape(title)}</text>",
    ]
    for tick in (0, 25, 50, 75, 100):
        parts.append(
            f"<line x1='{left}' x2='{left + plot_w}' y1='{y(tick):.1f}' y2='{y(tick):.1f}' stroke='#e3e6ec'/>"
            f"<text x='{left - 6}' y='{y(tick) + 4:.1f}' font-size='11' text-anchor='end' fill='#5b6474'>{tick}</text>"
        )
    for k, (name, colour) in enumerate(series):  # legend
        x = left + k * 120
        parts.append(
            f"<rect x='{x}' y='27' width='11' height='11' fill='{colour}'/>"
            f"<text x='{x + 16}' y='37' font-size='12' fill='#1d2330'>{html.escape(name)}</text>"
        )
    group_w = plot_w / max(1, len(groups))
    bar_w = min(46.0, group_w * 0.8 / max(1, len(series)))
    for g, group in enumerate(groups):
        x0 = left + g * group_w + (group_w - bar_w * len(series)) / 2
        for k, (name, colour) in enumerate(series):
            if (group, name) not in values:
                continue
            value, ci = values[(group, name)]
            x = x0 + k * bar_w
            parts.append(
                f"<rect class='bar' x='{x + 2:.1f}' y='{y(value):.1f}' width='{bar_w - 4:.1f}' "
                f"height='{y(0) - y(value):.1f}' fill='{colour}'><title>{html.escape(group)}, "
                f"{html.escape(name)}: {value:.1f} %</title></rect>"
            )
            mid = x + bar_w / 2
            if ci:
                parts.append(
                    f"<path d='M{mid:.1f},{y(ci[0]):.1f}V{y(ci[1]):.1f}M{mid - 5:.1f},{y(ci[0]):.1f}"
                    f"h10M{mid - 5:.1f},{y(ci[1]):.1f}h10' stroke='#1d2330' stroke-width='1.2' fill='none'/>"
                )
            label_y = min(y(value), y(ci[1]) if ci else y(value)) - 4
            parts.append(
                f"<text x='{mid:.1f}' y='{label_y:.1f}' font-size='11' text-anchor='middle' "
                f"fill='#1d2330'>{value:.0f}</text>"
            )
        parts.append(
            f"<text x='{left + (g + 0.5) * group_w:.1f}' y='{height - 12}' font-size='13' "
            f"text-anchor='middle' fill='#1d2330'>{html.escape(group)}</text>"
        )
    if reference is not None:  # a dashed line across the plot, named in the legend row
        ref, label = reference
        x = left + len(series) * 120
        parts.append(
            f"<line x1='{left}' x2='{left + plot_w}' y1='{y(ref):.1f}' y2='{y(ref):.1f}' "
            "stroke='#a4400a' stroke-dasharray='4 3'/>"
            f"<line x1='{x}' x2='{x + 14}' y1='32.5' y2='32.5' stroke='#a4400a' stroke-dasharray='4 3'/>"
            f"<text x='{x + 18}' y='37' font-size='12' fill='#a4400a'>{html.escape(label)}</text>"
        )
    parts.append(f"<line x1='{left}' x2='{left + plot_w}' y1='{y(0)}' y2='{y(0)}' stroke='#1d2330'/></svg>")
    return "".join(parts)


ON, OFF = "#2f6fdb", "#9aa3b2"
PALETTE = ("#2f6fdb", "#9aa3b2", "#e0892b", "#3aa17e", "#8a5cc9", "#c94f6d")


def plots_html(records: Sequence[dict[str, Any]]) -> str:
    """Bar charts where they read better than the table: accuracy on/off per split, recall per run."""
    figures = []
    for record in (r for r in records if _is_knowledge(r)):
        rows = [r for r in knowledge_rows(record) if not r.get("variant")]  # overall rows per split
        splits = list(dict.fromkeys(r["split"] for r in rows))
        modes = list(dict.fromkeys(r["knowledge"] for r in rows))
        # on and off keep their colours; other modes (text, both, embed) take the palette's others.
        others = iter(PALETTE[2:] * len(modes))
        series = [(f"knowledge {m}", {"on": ON, "off": OFF}.get(m) or next(others)) for m in modes]
        chance = record.get("details", {}).get("chance", {})
        charts = [("both", "colour and shape right"), ("colour", "colour right"), ("shape", "shape right")]
        if _has(rows, "all"):  # runs with the attribute split: every attribute the prompt names
            charts.append(("all", "all named attributes right"))
        for key, what in charts:
            values = {
                (SPLIT_NAMES.get(r["split"], r["split"]), f"knowledge {r['knowledge']}"): (
                    float(r[key]),
                    r["ci"].get(key),
                )
                for r in rows
                if r.get(key) is not None
            }
            ref = (chance[key], f"chance {chance[key]:.0f} %") if key in chance else None
            svg = bar_chart_svg(
                f"{what}, %", [SPLIT_NAMES.get(s, s) for s in splits], series, values, reference=ref
            )
            figures.append(
                f"<figure>{svg}<figcaption>{html.escape(what)}: per prompt split, knowledge on vs off "
                "(and any other mode run); whiskers are 95 % Wilson intervals.</figcaption></figure>"
            )
    recall = [r for r in records if _is_recall(r)]
    if recall:
        ks = [k for k in recall[0]["text_to_image"] if k.startswith("R@")]
        series = [(_recall_label(r), PALETTE[i % len(PALETTE)]) for i, r in enumerate(recall)]
        values = {}
        for r, (name, _) in zip(recall, series, strict=True):
            n = int(r.get("num_text_queries", 0))
            for k in ks:
                if k in r["text_to_image"]:
                    v = float(r["text_to_image"][k])
                    values[(k, name)] = (v, wilson(v, n) if n else None)
        svg = bar_chart_svg("text → image recall, %", ks, series, values, width=max(380, 140 * len(series)))
        figures.append(
            f"<figure>{svg}<figcaption>Text → image recall at K per run; whiskers are 95 % Wilson "
            "intervals over the queries.</figcaption></figure>"
        )
    if not figures:
        return ""
    return f"<section id='plots'><h2>Plots</h2><div class='plots'>{''.join(figures)}</div></section>"


def render_grid_path(record: dict[str, Any], run: Path) -> Path | None:
    """The render-consistency grid a knowledge record names (details.render_grid, relative to its
    run folder: RUN/metrics/knowledge.json → RUN/), else in the report's run; None when unnamed."""
    name = record.get("details", {}).get("render_grid")
    if not name:
        return None
    beside = Path(record["_file"]).resolve().parent.parent / name
    return beside if beside.is_file() else run / name


def consistency_html(records: Sequence[dict[str, Any]], run: Path, max_width: int = 1256) -> str:
    """The render-consistency grid of each knowledge record that has one (generated | re-render
    pairs, a row per split / knowledge mode), embedded and enlarged pixel for pixel to fit."""
    figures = []
    for record in (r for r in records if _is_knowledge(r)):
        path = render_grid_path(record, run)
        if path is None:
            continue
        if not path.is_file():
            figures.append(f"<p class='warn'>⚠ render-consistency grid missing: {html.escape(str(path))}</p>")
            continue
        uri, w, h = embed(path, 4096)
        # Small grids (64 px tiles) enlarged by whole multiples, pixels kept square; large ones fit the page.
        scale = max(1, min(3, max_width // max(1, w))) if w <= max_width else max_width / w
        cls = " class='pixel'" if scale > 1 else ""
        alt = "render consistency: generated image | kshapes re-render of what the detector read"
        figures.append(
            f"<figure><img src='{uri}'{cls} width='{round(w * scale)}' height='{round(h * scale)}' alt='{alt}' "
            f"title='{alt}'><figcaption>Each pair: the generated image, then kshapes' renderer drawing "
            "what the detector read off it (colour, shape, background, place and size); one row per "
            "split / knowledge mode, the split's first images. Its PSNR / SSIM are the table's render "
            f"columns. ({html.escape(path.name)})</figcaption></figure>"
        )
    if not figures:
        return ""
    return f"<section id='consistency'><h2>Render consistency</h2>{''.join(figures)}</section>"


# ---------------------------------------------------------------------------- sample grids
def comparable(sets: Sequence[tuple[str, Path]]) -> bool:
    """Do the sample sets share one prompt list (e.g. knowledge_on / knowledge_off, or two
    checkpoints sampled from one prompt file)? Then they are shown side by side."""
    if len(sets) < 2:
        return False
    keys = [[(r.get("index"), r["prompt"]) for r in read_index(path)] for _, path in sets]
    return all(sorted(set(k)) == sorted(set(keys[0])) for k in keys[1:])


def embed(path: Path, size: int) -> tuple[str, int, int]:
    """(data URI, width, height) of an image no larger than ``size``: PNG, or JPEG where that is
    much smaller (photographic samples), so a page of hundreds of large images stays shareable."""
    img = thumbnail(path, size)
    uri = data_uri(img)
    if len(uri) > 60_000:
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        jpeg = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        uri = jpeg if len(jpeg) < 0.7 * len(uri) else uri
    return uri, img.width, img.height


def _image(run: Path, row: dict[str, Any], size: int) -> str:
    path = run / row["file"]
    if not path.is_file():
        return f"<span class='small'>missing: {html.escape(row['file'])}</span>"
    alt = html.escape(f"{row['prompt']} (seed {row.get('seed')})", quote=True)
    uri, w, h = embed(path, size)
    # Small images (kshapes' 64–128 px) are drawn enlarged, pixel for pixel, to the display size.
    scale = size / max(w, h)
    cls = " class='pixel'" if scale > 1 else ""
    return (
        f"<img src='{uri}'{cls} width='{round(w * scale)}' height='{round(h * scale)}' alt='{alt}' "
        f"title='{alt}'>"
    )


def _set_order(name: str) -> tuple[int, str]:
    return (1 if name.endswith("_off") else 0, name)  # knowledge_on before knowledge_off


def grid_html(sets: Sequence[tuple[str, Path]], max_prompts: int, max_images: int, image_size: int) -> str:
    """A block per prompt (grouped by split when the prompts carry one): the prompt in large type,
    then each set's images at ``image_size`` px, sets side by side."""
    sets = sorted(sets, key=lambda s: _set_order(s[0]))
    indexes = {name: grouped(read_index(path), 10**9, max_images) for name, path in sets}
    by_key = {
        name: {(f.get("index"), f["prompt"]): rows for f, rows in groups} for name, groups in indexes.items()
    }
    firsts = [first for first, _ in indexes[sets[0][0]]][:max_prompts]
    splits = list(dict.fromkeys(f.get("split") for f in firsts))
    order = {s: i for i, s in enumerate(["seen", "heldout", *splits])}
    firsts.sort(key=lambda f: order[f.get("split")])  # stable: prompt order within a split
    names = ", ".join(f"{name} ({len(read_index(path))} images)" for name, path in sets)
    parts = [f"<h2>Samples</h2><p class='small'>{html.escape(names)}</p>"]
    current: Any = object()
    for first in firsts:
        if first.get("split") != current and len(splits) > 1:
            current = first.get("split")
            parts.append(f"<h3>{html.escape(SPLIT_NAMES.get(current, str(current)))} entities</h3>")
        key = (first.get("index"), first["prompt"])
        tags = " · ".join(f"{k} {first[k]}" for k in ("entity", "colour", "shape") if first.get(k))
        blocks = []
        for name, path in sets:
            rows = by_key[name].get(key, [])
            images = "".join(_image(path, row, image_size) for row in rows)
            cls = "set on" if name.endswith("_on") else "set"
            blocks.append(
                f"<div class='{cls}'><h4>{html.escape(name)}</h4><div class='images'>{images}</div></div>"
            )
        parts.append(
            f"<div class='sample'><div class='prompt'>{html.escape(first['prompt'])}</div>"
            f"<div class='tags'>{html.escape(tags)}</div><div class='sets'>{''.join(blocks)}</div></div>"
        )
    return "<section class='samples'>" + "".join(parts) + "</section>"


def png_grid(
    sets: Sequence[tuple[str, Path]], out: Path, max_prompts: int = 16, max_images: int = 8, thumb: int = 128
) -> Path:
    """Prompts as rows, each set's images as a column group (a wider gap between sets), on white."""
    from PIL import Image

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
    max_images: int = 4,
    image_size: int = 256,
    title: str | None = None,
) -> str:
    """The HTML text of the report: results first, then plots, samples, and how they were made."""
    run = Path(run)
    if not run.is_dir():
        raise FileNotFoundError(
            f"eval run folder not found: {run} (the --out of `rapiddiff eval sample` or `rapiddiff eval knowledge`)"
        )
    sets = sample_sets(run)
    if not sets:
        raise FileNotFoundError(
            f"{run}: no index.jsonl in it or its subfolders; make samples with `rapiddiff eval sample --out {run}` "
            "or `rapiddiff eval knowledge --out ...`"
        )
    config: dict[str, Any] | None = None
    if model is not None:
        config = model_config(model)
    settings = {}
    for _, path in sets:
        if (path / SAMPLE_INFO).is_file():
            info = json.loads((path / SAMPLE_INFO).read_text(encoding="utf-8"))
            settings[path.name] = info.get("settings", {})
            config = config or info.get("model_config")
    records = load_metrics(run, extra_metrics)
    title = title or f"rapiddiff evaluation: {run.name}"
    grids = (
        [grid_html(sets, max_prompts, max_images, image_size)]
        if comparable(sets)
        else [grid_html([one], max_prompts, max_images, image_size) for one in sets]
    )
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='small'>{html.escape(str(run.resolve()))} · rapiddiff {__version__} · "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}</p>",
        f"<section id='metrics'><h2>Results</h2>{metrics_html(records)}</section>",
        plots_html(records),
        consistency_html(records, run),
        *grids,
        "<section id='settings'><h2>How these were made</h2>",
        "<details><summary>Sampling settings</summary>"
        f"<pre>{html.escape(json.dumps(settings, ensure_ascii=False, indent=2))}</pre></details>",
        "<details><summary>Model config</summary><pre>"
        f"{html.escape(json.dumps(config, ensure_ascii=False, indent=2)) if config else 'not recorded'}"
        "</pre></details></section>",
    ]
    return (
        "<!DOCTYPE html><html lang='zh-CN'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style><script>{_SCRIPT}</script></head>"
        f"<body><main>{''.join(body)}</main></body></html>\n"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "One self-contained HTML page for an eval run, to share: the results first (knowledge accuracy "
        "seen / held-out × on / off and recall, with 95 % intervals; background, position, all named and "
        "render PSNR/SSIM when eval knowledge wrote them; FID, CLIPScore), bar charts, the render-consistency "
        "grid, large "
        "sample images per prompt for the run and its sub-runs side by side, then the sampling settings "
        "and model config. Images are embedded; nothing is fetched. Also writes a PNG grid."
    )
    parser.add_argument("run", type=Path, help="eval run folder (eval sample / eval knowledge output)")
    parser.add_argument("--out", type=Path, help="HTML file (default: RUN/report.html)")
    parser.add_argument("--png", type=Path, help="PNG grid (default: RUN/report.png)")
    parser.add_argument(
        "--metrics",
        type=Path,
        nargs="*",
        default=[],
        help="more metrics JSON files to include (e.g. eval recall --out)",
    )
    parser.add_argument("--model", type=Path, help="model folder whose config to show (default: as recorded)")
    parser.add_argument("--max-prompts", type=int, default=32, help="prompts shown (default: 32)")
    parser.add_argument("--max-images", type=int, default=4, help="images per prompt and set (default: 4)")
    parser.add_argument(
        "--image-size", type=int, default=256, help="size images are shown at in the page, px (default: 256)"
    )
    parser.add_argument(
        "--thumb", type=int, default=128, help="image size in the PNG grid, px (default: 128)"
    )
    parser.add_argument("--title", help="page title")


def run(args: argparse.Namespace) -> int:

    for path in args.metrics:
        if not path.is_file():
            raise FileNotFoundError(f"--metrics: file not found: {path}")
    if args.image_size < 16 or args.thumb < 8:
        raise ValueError("--image-size must be ≥ 16 and --thumb ≥ 8")
    page = build_report(
        args.run,
        extra_metrics=args.metrics,
        model=args.model,
        max_prompts=args.max_prompts,
        max_images=args.max_images,
        image_size=args.image_size,
        title=args.title,
    )
    out = args.out or args.run / "report.html"
    atomic_write_text(out, page)
    sets = sorted(sample_sets(args.run), key=lambda s: _set_order(s[0]))
    png = png_grid(
        sets if comparable(sets) else sets[:1],
        args.png or args.run / "report.png",
        max_prompts=min(args.max_prompts, 16),
        max_images=args.max_images,
        thumb=args.thumb,
    )
    print(f"report → {out} ({len(page) / 1e6:.1f} MB), grid → {png}")
    return 0

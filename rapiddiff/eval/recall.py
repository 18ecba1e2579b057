"""``rapiddiff eval recall``: text→image and image→text retrieval recall (R@1/5/10, mean recall).

The protocol is Chinese-CLIP's (``cn_clip/eval/evaluation.py`` and ``evaluation_tr.py``):
features are L2-normalised, similarity is their dot product, and a query is a hit at K when any
of its ground-truth items is among its top K. Every caption row is its own query, with the
images of that row as its ground truth — identical captions are not merged (merging turns a
tie between two same-caption images into a hit for both). A query with no ground truth counts
as a miss. Images are the distinct images of the data (the same file in two rows is one gallery
item); an image's queries for image→text are the captions that list it. Equal scores are broken
by id (the lower id ranks first), so the figures are deterministic.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapiddiff.utils.device import resolve_device
from rapiddiff.utils.io import atomic_write_text, read_text_lines

if TYPE_CHECKING:
    import torch

# Modules that load torch, numpy or PIL are imported inside the functions that use them:
# `rapiddiff eval --help` imports every eval module.

KS = (1, 5, 10)


def retrieval_recall(
    similarity: torch.Tensor, ground_truth: Sequence[Iterable[int]] | torch.Tensor, ks: Sequence[int] = KS
) -> dict[str, float]:
    """Recall@K in percent for each K, and their mean (``"mean"``).

    ``similarity`` is [Q, N] (queries × gallery); ``ground_truth`` is one set of gallery ids per
    query or a bool matrix [Q, N]. Ranking is by score, descending; ties go to the lower id. A
    query without ground truth is a miss at every K (as in cn_clip's scorer).
    """
    import torch

    sim = torch.as_tensor(similarity).float()
    if sim.ndim != 2:
        raise ValueError(f"similarity must be [queries, gallery], got shape {list(sim.shape)}")
    q, n = sim.shape
    if isinstance(ground_truth, torch.Tensor):
        gt = ground_truth.bool()
        if gt.shape != sim.shape:
            raise ValueError(f"ground_truth matrix {list(gt.shape)} != similarity {list(sim.shape)}")
    else:
        if len(ground_truth) != q:
            raise ValueError(f"ground_truth has {len(ground_truth)} entries for {q} queries")
        gt = torch.zeros(q, n, dtype=torch.bool)
        for i, items in enumerate(ground_truth):
            for j in items:
                if not 0 <= j < n:
                    raise ValueError(f"ground truth id {j} of query {i} outside the gallery (0..{n - 1})")
                gt[i, j] = True
    # A stable sort of -score keeps equal scores in id order: lower id first.
    order = torch.sort(-sim, dim=1, stable=True).indices  # (Q, N)
    hits_in_order = torch.gather(gt, 1, order)  # (Q, N): is the r-th ranked item a ground truth?
    # Rank of the best-ranked ground truth; n (never < k) for a query without any.
    first_hit = torch.where(hits_in_order.any(1), hits_in_order.float().argmax(1), n)
    result = {f"R@{k}": 100.0 * float((first_hit < k).float().mean()) if q else 0.0 for k in ks}
    result["mean"] = sum(result[f"R@{k}"] for k in ks) / len(ks)
    return result


def retrieval_report(
    text_features: torch.Tensor,
    image_features: torch.Tensor,
    images_of_text: Sequence[Iterable[int]],
    *,
    query_texts: Sequence[int] | None = None,
    ks: Sequence[int] = KS,
) -> dict[str, Any]:
    """Both directions from features: texts [T, D], images [I, D]; ``images_of_text[t]`` is the
    ground truth of text ``t`` (the images it captions; empty makes it a miss).

    Every text is a query for text→image, and every image that some queried text lists is a
    query for image→text, its ground truth being every text that lists it. ``query_texts``
    restricts the text queries (and so the image queries) while the galleries stay whole —
    used for seen / held-out breakdowns.
    """
    import torch

    t = torch.nn.functional.normalize(text_features.float(), dim=-1)
    v = torch.nn.functional.normalize(image_features.float(), dim=-1)
    if len(images_of_text) != len(t):
        raise ValueError(f"images_of_text has {len(images_of_text)} entries for {len(t)} texts")
    gt = [set(items) for items in images_of_text]
    texts_of_image: list[set[int]] = [set() for _ in range(len(v))]
    for tid, items in enumerate(gt):
        for i in items:
            if not 0 <= i < len(v):
                raise ValueError(
                    f"ground truth image {i} of text {tid} outside the gallery (0..{len(v) - 1})"
                )
            texts_of_image[i].add(tid)
    texts = list(range(len(t))) if query_texts is None else sorted(set(query_texts))
    images = sorted({i for tid in texts for i in gt[tid]})
    t2i = retrieval_recall(t[texts] @ v.T, [gt[tid] for tid in texts], ks)
    i2t = retrieval_recall(v[images] @ t.T, [texts_of_image[i] for i in images], ks)
    return {
        "text_to_image": t2i,
        "image_to_text": i2t,
        "mean_recall": (t2i["mean"] + i2t["mean"]) / 2,
        "num_text_queries": len(texts),
        "num_image_queries": len(images),
        "text_queries_without_ground_truth": sum(not gt[tid] for tid in texts),
        "gallery": {"images": len(v), "texts": len(t)},
    }


def format_table(report: dict[str, Any], ks: Sequence[int] = KS) -> str:
    header = "direction       " + "".join(f"{f'R@{k}':>8}" for k in ks) + f"{'mean':>8}{'queries':>9}"
    lines = [header, "-" * len(header)]
    for key, label, nq in (
        ("text_to_image", "text → image", "num_text_queries"),
        ("image_to_text", "image → text", "num_image_queries"),
    ):
        row = report[key]
        lines.append(
            f"{label:16s}"
            + "".join(f"{row[f'R@{k}']:8.2f}" for k in ks)
            + f"{row['mean']:8.2f}{report[nq]:9d}"
        )
    lines.append(f"mean recall: {report['mean_recall']:.2f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, type=Path, help="a KnowledgeCLIP folder (rapiddiff train clip)"
    )
    parser.add_argument(
        "--data",
        required=True,
        type=Path,
        help="image–caption data: imagefolder with metadata.jsonl, or CSV/TSV/JSONL/parquet",
    )
    parser.add_argument(
        "--out",
        help="write the figures as JSON here; with several --knowledge settings or --filter-entities files, "
        "a path with {knowledge} and {entities} in it (on/off; each file's name without .txt), "
        "e.g. results/recall_test-{knowledge}_{entities}.json",
    )
    parser.add_argument(
        "--knowledge",
        default="on",
        metavar="on|off|on,off",
        help="knowledge fusion on, off for the ablation, or on,off for both from one encoding of the images",
    )
    parser.add_argument(
        "--filter-entities",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="score only captions that mention one of these entities (one name a line), e.g. "
        "heldout_entities.txt; several files: one evaluation each, the images encoded once",
    )
    parser.add_argument(
        "--ground-truth",
        choices=("pairs", "attributes"),
        default="pairs",
        help="pairs: a caption's own images (Chinese-CLIP's protocol); attributes: every image whose "
        "metadata.jsonl attributes (colour, shape, and background/position where the caption names "
        "them) match the caption's — for synthetic data such as kshapes, where many images fit a caption",
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")


def run(args: argparse.Namespace) -> int:
    import json

    settings = [k.strip() for k in args.knowledge.split(",") if k.strip()]
    if not settings or any(k not in ("on", "off") for k in settings) or len(set(settings)) < len(settings):
        raise ValueError(f"--knowledge {args.knowledge!r}: give on, off or on,off")
    lists: dict[str, list[str] | None] = {"": None}
    if args.filter_entities:
        lists = {}
        for path in args.filter_entities:
            if not path.is_file():
                raise FileNotFoundError(f"--filter-entities: file not found: {path}")
            names = [ln.strip() for _, ln in read_text_lines(path, what="--filter-entities")]
            if not names:
                raise ValueError(f"{path}: no entity names in it")
            if path.stem in lists:
                raise ValueError(
                    f"--filter-entities: two files named {path.stem!r}; their figures would collide"
                )
            lists[path.stem] = names
    several = len(settings) * len(lists) > 1
    if several and args.out is not None:
        needed = [
            f"{{{key}}}" for key, n in (("knowledge", len(settings)), ("entities", len(lists))) if n > 1
        ]
        missing = [key for key in needed if key not in args.out]
        if missing:
            raise ValueError(
                f"--out {args.out!r}: {len(settings) * len(lists)} evaluations need {' and '.join(missing)} "
                "in the path, e.g. results/recall_test-{knowledge}_{entities}.json"
            )
    reports = evaluate_folder_grid(
        args.model,
        args.data,
        device=resolve_device(args.device),
        knowledge=[k == "on" for k in settings],
        entity_lists=lists,
        batch_size=args.batch_size,
        ground_truth=args.ground_truth,
    )
    for (knowledge, name), report in reports.items():
        if several:
            print(f"\nknowledge {'on' if knowledge else 'off'}" + (f", entities {name}" if name else ""))
        print(format_table(report))
        if args.out is not None:
            out = args.out.replace("{knowledge}", "on" if knowledge else "off").replace("{entities}", name)
            atomic_write_text(Path(out), json.dumps(report, ensure_ascii=False, indent=2) + "\n")
    return 0


def evaluate_folder(
    model_dir: str | Path,
    data: str | Path,
    *,
    device: Any = "cpu",
    knowledge: bool = True,
    entities: Sequence[str] | None = None,
    batch_size: int = 128,
    ground_truth: str = "pairs",
) -> dict[str, Any]:
    """Load a KnowledgeCLIP and a dataset, encode both, and return :func:`retrieval_report`'s dict."""
    reports = evaluate_folder_grid(
        model_dir, data, device=device, knowledge=[knowledge], entity_lists={"": entities},
        batch_size=batch_size, ground_truth=ground_truth,
    )  # fmt: skip
    return reports[knowledge, ""]


def evaluate_folder_grid(
    model_dir: str | Path,
    data: str | Path,
    *,
    device: Any = "cpu",
    knowledge: Sequence[bool] = (True,),
    entity_lists: dict[str, Sequence[str] | None] | None = None,
    batch_size: int = 128,
    ground_truth: str = "pairs",
) -> dict[tuple[bool, str], dict[str, Any]]:
    """:func:`evaluate_folder` for each knowledge setting × entity list (name → names; None: every
    caption), keyed (knowledge, name): the model loaded and the images encoded once, the captions
    once per knowledge setting (the images do not depend on it)."""
    import torch
    from tqdm import tqdm

    from rapiddiff.data.loader import ImageTextDataset
    from rapiddiff.models.clip import KnowledgeCLIP

    entity_lists = {"": None} if entity_lists is None else entity_lists
    model = KnowledgeCLIP.from_pretrained(model_dir).to(device).eval()
    dataset = ImageTextDataset(str(data), image_size=model.image_size)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, collate_fn=_collate)
    image_features, captions, rows = [], [], []
    with torch.no_grad():
        for batch in tqdm(loader, desc="images", unit="batch"):
            image_features.append(model.encode_image(batch["pixel_values"].to(device)).cpu())
            captions.extend(batch["text"])
            rows.extend(batch["index"])
    if not captions:
        raise ValueError(f"{data}: no usable image–caption pairs")
    # Identical captions share one encoding but stay separate queries (one per row).
    unique = list(dict.fromkeys(captions))
    text_id = {c: i for i, c in enumerate(unique)}
    # The gallery holds each distinct image once (the same file captioned twice is one image).
    image_of_row, first_row = _distinct_images(dataset, rows)
    features = torch.cat(image_features)[first_row]  # (I, D)
    images_of_text: list[set[int]] = [{image_of_row[k]} for k in range(len(rows))]
    if ground_truth == "attributes":
        matches = _attribute_matches(Path(data), unique, captions, rows)
        for k, caption in enumerate(captions):
            images_of_text[k] |= {image_of_row[i] for i in matches[text_id[caption]]}
    tagged = _caption_entities(Path(data)) if any(v is not None for v in entity_lists.values()) else {}
    queries_of: dict[str, list[int] | None] = {}
    for name, entities in entity_lists.items():
        if entities is None:
            queries_of[name] = None
            continue
        wanted = set(entities)
        queries_of[name] = [
            k for k, c in enumerate(captions) if tagged.get(c) in wanted or any(n in c for n in entities)
        ]
        if not queries_of[name]:
            raise ValueError(f"no caption in {data} mentions any of the {len(entities)} given entities")
    reports: dict[tuple[bool, str], dict[str, Any]] = {}
    for setting in knowledge:
        model.text_encoder.knowledge = setting
        with torch.no_grad():
            unique_features = torch.cat(
                [
                    model.encode_text(unique[i : i + batch_size]).cpu()
                    for i in tqdm(range(0, len(unique), batch_size), desc="texts", unit="batch")
                ]
            )
        text_features = unique_features[[text_id[c] for c in captions]]  # (T, D), one per row
        for name, entities in entity_lists.items():
            report = retrieval_report(text_features, features, images_of_text, query_texts=queries_of[name])
            report.update(
                model=str(model_dir),
                data=str(data),
                knowledge=setting,
                entities=list(entities or []),
                ground_truth=ground_truth,
            )
            reports[setting, name] = report
    return reports


def _caption_entities(data: Path) -> dict[str, str]:
    """caption → entity from an imagefolder's metadata.jsonl ``entity`` field (kshapes writes it), so
    captions that use an alias (车厘子 for 樱桃) still count as mentions; {} when there is none."""
    from rapiddiff.data.loader import parse_json_lines

    meta = data / "metadata.jsonl" if data.is_dir() else None
    if meta is None or not meta.is_file():
        return {}
    out = {}
    for row in parse_json_lines(meta):  # malformed lines carry no entity (the loader skips them)
        if isinstance(row.get("entity"), str) and isinstance(row.get("text"), str):
            out[row["text"]] = row["entity"]
    return out


def _attribute_matches(data: Path, unique: list[str], captions: list[str], rows: list[int]) -> list[set[int]]:
    """For each caption, the images whose metadata matches every attribute the caption states.

    Colour and shape are always stated (by attribute words or by the entity); background and
    position count when their names appear in the caption.
    """
    from rapiddiff.data.loader import ERROR_COLUMN, parse_json_lines

    meta = data / "metadata.jsonl"
    if not meta.is_file():
        raise FileNotFoundError(
            f"--ground-truth attributes needs {meta} (with colour, shape, background, position)"
        )
    # Record k is the loader's row k (the k-th non-blank line), malformed lines included.
    table = list(parse_json_lines(meta))
    good = next((row for row in table if not row.get(ERROR_COLUMN)), {})
    missing = [k for k in ("colour", "shape", "background", "position") if k not in good]
    if missing:
        raise ValueError(f"{meta}: --ground-truth attributes needs the keys {missing} in every row")
    items = [table[r] for r in rows]  # metadata of gallery image i
    first: dict[str, int] = {}
    for i, c in enumerate(captions):
        first.setdefault(c, i)
    out = []
    for text in unique:
        ref = items[first[text]]
        keys = ["colour", "shape"] + [k for k in ("background", "position") if str(ref[k]) in text]
        out.append({i for i, it in enumerate(items) if all(it[k] == ref[k] for k in keys)})
    return out


def _distinct_images(dataset: Any, rows: Sequence[int]) -> tuple[list[int], list[int]]:
    """(gallery image id of each position in ``rows``, first position of each gallery image).

    Two rows are one image when their image cells are equal (the same path, or the same bytes).
    """
    import hashlib

    image_of_row: list[int] = []
    first_row: list[int] = []
    seen: dict[Any, int] = {}
    for k, row in enumerate(rows):
        value = dataset.image_cell(row)
        if isinstance(value, dict):
            value = value.get("bytes") or value.get("path")
        key = hashlib.sha1(bytes(value)).hexdigest() if isinstance(value, (bytes, bytearray)) else str(value)
        if key not in seen:
            seen[key] = len(first_row)
            first_row.append(k)
        image_of_row.append(seen[key])
    return image_of_row, first_row


def _collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    return {
        "pixel_values": torch.stack([it["pixel_values"] for it in items]),
        "text": [it["text"] for it in items],
        "index": [int(it["index"]) for it in items],
    }

"""retrieval_recall against hand-computed figures (ties, several ground truths, both GT forms) and
against Chinese-CLIP's own scorer (cn_clip/eval/evaluation.py, evaluation_tr.py) on the same top-K lists."""

from __future__ import annotations

import json

import pytest
import torch

from rapiddiff.eval.recall import format_table, retrieval_recall, retrieval_report


def test_recall_matches_hand_computed_values_with_ties_and_multiple_ground_truths():
    sim = torch.tensor(
        [
            # q0: GT {2}; ranking 2,0,1,3 → rank 0
            [0.5, 0.1, 0.9, 0.0],
            # q1: GT {3}; all tied → id order 0,1,2,3 → rank 3
            [0.2, 0.2, 0.2, 0.2],
            # q2: GT {1, 3}; ranking 0(0.9), 1 and 3 tie at 0.5 → 1 first → rank 1
            [0.9, 0.5, 0.1, 0.5],
            # q3: GT {0}; 0 ties with 2 at top → lower id 0 first → rank 0
            [0.7, 0.3, 0.7, 0.1],
        ]
    )
    gt = [{2}, {3}, {1, 3}, {0}]
    got = retrieval_recall(sim, gt, ks=(1, 2, 3))
    # ranks 0, 3, 1, 0 → R@1 = 2/4, R@2 = 3/4, R@3 = 3/4
    assert got == pytest.approx({"R@1": 50.0, "R@2": 75.0, "R@3": 75.0, "mean": (50 + 75 + 75) / 3})
    matrix = torch.zeros(4, 4, dtype=torch.bool)
    for i, items in enumerate(gt):
        matrix[i, list(items)] = True
    assert retrieval_recall(sim, matrix, ks=(1, 2, 3)) == got


def test_tie_break_prefers_lower_id_even_when_ground_truth_is_higher():
    sim = torch.ones(1, 12)
    assert retrieval_recall(sim, [{11}])["R@10"] == 0.0  # rank 11
    assert retrieval_recall(sim, [{9}])["R@10"] == 100.0  # rank 9
    assert retrieval_recall(sim, [{4}]) == {"R@1": 0.0, "R@5": 100.0, "R@10": 100.0, "mean": 200 / 3}


def test_bad_ground_truth_is_an_error_and_a_query_without_any_is_a_miss():
    with pytest.raises(ValueError, match="outside the gallery"):
        retrieval_recall(torch.zeros(1, 3), [{3}])
    # cn_clip counts a text whose image_ids are empty as a query that never hits.
    got = retrieval_recall(torch.eye(2, 3), [{0}, set()], ks=(1, 3))
    assert got == {"R@1": 50.0, "R@3": 50.0, "mean": 50.0}


def test_report_keeps_identical_captions_as_separate_queries_and_filters_queries():
    # Texts 0 and 3 are the same caption (same features); images 0 and 3 are theirs.
    texts = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0]])
    images = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [0.9, 0.1, 0]])
    report = retrieval_report(texts, images, [{0}, {1}, {2}, {3}], ks=(1,))
    # Text 3's best image is image 0 (text 0's): a miss, as in Chinese-CLIP; merged captions
    # would have counted it a hit.
    assert report["text_to_image"]["R@1"] == 75.0
    assert report["num_text_queries"] == 4 and report["num_image_queries"] == 4
    # Image 0 and 3's best text is text 0 (tie with text 3, lower id first): image 3 misses.
    assert report["image_to_text"]["R@1"] == 75.0
    only = retrieval_report(texts, images, [{0}, {1}, {2}, {3}], query_texts=[0, 3], ks=(1,))
    assert only["num_text_queries"] == 2 and only["num_image_queries"] == 2
    assert "text → image" in format_table(report, ks=(1,))
    lonely = retrieval_report(texts, images, [{0}, {1}, {2}, set()], ks=(1,))
    assert lonely["text_queries_without_ground_truth"] == 1
    assert lonely["text_to_image"]["R@1"] == 75.0  # the text without an image is a miss


def _top_k(sim: torch.Tensor, k: int) -> list[list[int]]:
    """Top-K ids per row, in the order retrieval_recall ranks them (ties: lower id first)."""
    return torch.sort(-sim, dim=1, stable=True).indices[:, :k].tolist()


def test_recall_equals_chinese_clip_scorer_on_the_same_top_k_lists(tmp_path):
    """Chinese-CLIP's protocol on a set with repeated captions, shared images and a text without
    an image, scored by cn_clip's own compute_score from the same top-10 lists."""
    cn_eval = pytest.importorskip("cn_clip.eval.evaluation", reason="cn_clip is not installed")
    cn_eval_tr = pytest.importorskip("cn_clip.eval.evaluation_tr")
    g = torch.Generator().manual_seed(0)
    n_images, dim = 40, 16
    images = torch.randn(n_images, dim, generator=g)
    captions = torch.randn(50, dim, generator=g)
    # Texts: 50 distinct captions + 6 repeats (10 %), each text near its own image.
    caption_of_text = [*range(50), 3, 7, 11, 19, 23, 42]
    image_of_text = [t % n_images for t in range(50)] + [30, 31, 32, 33, 34, 35]
    noise = 0.8 * torch.randn(len(caption_of_text), dim, generator=g)
    texts = captions[caption_of_text] + images[image_of_text] + noise
    texts[50:] = texts[caption_of_text[50:]]  # a repeated caption has the very same features
    gt = [{i} for i in image_of_text]
    gt[5] = set()  # a text whose image is missing: a miss, not an error
    ours = retrieval_report(texts, images, gt)

    t = torch.nn.functional.normalize(texts, dim=-1)
    v = torch.nn.functional.normalize(images, dim=-1)

    def write(name: str, rows: list[dict]) -> str:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return str(path)

    golden = write("t2i_gold.jsonl", [{"text_id": q, "image_ids": sorted(ids)} for q, ids in enumerate(gt)])
    pred = write(
        "t2i_pred.jsonl", [{"text_id": q, "image_ids": top} for q, top in enumerate(_top_k(t @ v.T, 10))]
    )
    mean, r1, r5, r10 = cn_eval.compute_score(golden, pred)
    assert ours["text_to_image"] == pytest.approx({"R@1": r1, "R@5": r5, "R@10": r10, "mean": mean})
    # Image→text as cn_clip derives it (transform_ir_annotation_to_tr.py): images that some text
    # lists, each with every text that lists it.
    texts_of_image: dict[int, list[int]] = {}
    for q, ids in enumerate(gt):
        for i in ids:
            texts_of_image.setdefault(i, []).append(q)
    sim = v @ t.T
    golden = write("i2t_gold.jsonl", [{"image_id": i, "text_ids": q} for i, q in texts_of_image.items()])
    pred = write(
        "i2t_pred.jsonl", [{"image_id": i, "text_ids": _top_k(sim[i : i + 1], 10)[0]} for i in texts_of_image]
    )
    mean, r1, r5, r10 = cn_eval_tr.compute_score(golden, pred)
    assert ours["image_to_text"] == pytest.approx({"R@1": r1, "R@5": r5, "R@10": r10, "mean": mean})
    assert ours["num_text_queries"] == 56 and ours["num_image_queries"] == len(texts_of_image)


def _recall_command(tmp_path):
    """A tiny KnowledgeCLIP and an imagefolder of 8 captioned images in tmp_path; the `eval recall`
    command line on them, before --out and the options a test adds."""
    from tests.models.test_clip import _tiny_resnet_clip
    from tests.models.test_text_encoder import _store
    from tests.train.test_clip import _write_imagefolder

    _write_imagefolder(tmp_path / "data")
    _tiny_resnet_clip(_store()).save_pretrained(tmp_path / "clip")
    return [
        "eval",
        "recall",
        "--model",
        str(tmp_path / "clip"),
        "--data",
        str(tmp_path / "data"),
        "--device",
        "cpu",
    ]


def test_eval_recall_command_end_to_end(tmp_path):
    import json

    from rapiddiff.cli import main

    (tmp_path / "ents.txt").write_text("黄色\n", encoding="utf-8")
    out = tmp_path / "recall.json"
    args = _recall_command(tmp_path)
    assert main([*args, "--out", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["gallery"] == {"images": 8, "texts": 8}
    assert set(report["text_to_image"]) == {"R@1", "R@5", "R@10", "mean"}
    assert report["text_to_image"]["R@10"] == 100.0  # a gallery of 8: every ground truth is in the top 10
    assert (
        main(
            [*args, "--out", str(out), "--knowledge", "off", "--filter-entities", str(tmp_path / "ents.txt")]
        )
        == 0
    )
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["num_text_queries"] == 2 and report["knowledge"] is False  # 左边/右边有一个黄色


def test_report_with_widened_ground_truth_counts_any_matching_image():
    texts = torch.eye(2)
    images = torch.tensor(
        [[0.0, 1.0], [1.0, 0.0], [0.9, 0.1]]
    )  # image 1 fits text 0 best, but it is text 1's
    pairs = retrieval_report(texts, images, [{0, 2}, {1}], ks=(1,))
    assert pairs["text_to_image"]["R@1"] == 0.0  # text 0's top image is 1 (text 1's), text 1's is 0
    wide = retrieval_report(texts, images, [{0, 1, 2}, {1}], ks=(1,))
    assert wide["text_to_image"]["R@1"] == 50.0  # now text 0's top image counts
    assert wide["image_to_text"]["R@1"] == pytest.approx(
        100 * 2 / 3
    )  # image 1 lists texts 0 and 1; image 0 misses


def test_eval_recall_keeps_repeated_captions_as_queries_and_shared_images_as_one(tmp_path):
    from rapiddiff.eval.recall import evaluate_folder
    from tests.models.test_clip import _tiny_resnet_clip
    from tests.models.test_text_encoder import _store
    from tests.train.test_clip import _write_imagefolder

    data = tmp_path / "data"
    _write_imagefolder(data)
    meta = data / "metadata.jsonl"
    rows = [json.loads(line) for line in meta.read_text(encoding="utf-8").splitlines()]
    rows[4]["text"] = rows[0]["text"]  # a repeated caption on another image
    rows.append({"file_name": rows[1]["file_name"], "text": "同一张图的第二个描述"})  # a second caption
    meta.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    _tiny_resnet_clip(_store()).save_pretrained(tmp_path / "clip")
    report = evaluate_folder(tmp_path / "clip", data)
    assert report["num_text_queries"] == 9  # every caption row, the repeated one too
    assert report["gallery"] == {"images": 8, "texts": 9}  # 001.png listed twice is one image
    assert report["num_image_queries"] == 8
    assert report["text_queries_without_ground_truth"] == 0


def test_eval_recall_grid_equals_one_evaluation_at_a_time(tmp_path, capsys):
    """--knowledge on,off with several --filter-entities files: one process, the images encoded once,
    each figure what its own run gives; --out must name {knowledge} and {entities}."""
    import json

    from rapiddiff.cli import main

    (tmp_path / "yellow.txt").write_text("黄色\n", encoding="utf-8")
    (tmp_path / "red.txt").write_text("红色\n", encoding="utf-8")
    args = _recall_command(tmp_path)
    lists = [str(tmp_path / "yellow.txt"), str(tmp_path / "red.txt")]
    grid = str(tmp_path / "grid" / "recall_{knowledge}_{entities}.json")
    assert main([*args, "--knowledge", "on,off", "--filter-entities", *lists, "--out", grid]) == 0
    for knowledge in ("on", "off"):
        for name in ("yellow", "red"):
            single = tmp_path / f"single_{knowledge}_{name}.json"
            assert main([*args, "--knowledge", knowledge, "--filter-entities", str(tmp_path / f"{name}.txt"),
                         "--out", str(single)]) == 0  # fmt: skip
            got = json.loads((tmp_path / "grid" / f"recall_{knowledge}_{name}.json").read_text("utf-8"))
            assert got == json.loads(single.read_text("utf-8")) and got["knowledge"] is (knowledge == "on")
    assert (
        main([*args, "--knowledge", "off", "--filter-entities", *lists, "--out", str(tmp_path / "x.json")])
        == 2
    )
    assert "{entities}" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
    assert main([*args, "--knowledge", "on,of"]) == 2
    assert "give on, off or on,off" in capsys.readouterr().err

"""retrieval_recall against hand-computed figures: ties, several ground truths, both GT forms."""

from __future__ import annotations

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


def test_bad_ground_truth_is_an_error():
    with pytest.raises(ValueError, match="outside the gallery"):
        retrieval_recall(torch.zeros(1, 3), [{3}])
    with pytest.raises(ValueError, match="no ground-truth"):
        retrieval_recall(torch.zeros(2, 3), [{0}, set()])


def test_report_groups_identical_captions_and_filters_queries():
    # 3 texts, 4 images; images 0 and 3 share text 0. Features: image i aligned with its text.
    texts = torch.eye(3)
    images = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [0.9, 0.1, 0]])
    report = retrieval_report(texts, images, [0, 1, 2, 0], ks=(1,))
    assert report["text_to_image"]["R@1"] == 100.0
    assert report["image_to_text"]["R@1"] == 100.0
    only = retrieval_report(texts, images, [0, 1, 2, 0], query_texts=[0], ks=(1,))
    assert only["num_text_queries"] == 1 and only["num_image_queries"] == 2
    assert "text → image" in format_table(report, ks=(1,))


def test_eval_recall_command_end_to_end(tmp_path):
    import json

    from rapiddiff.cli import main
    from tests.models.test_clip import _tiny_resnet_clip
    from tests.models.test_text_encoder import _store
    from tests.train.test_clip import _write_imagefolder

    _write_imagefolder(tmp_path / "data")
    _tiny_resnet_clip(_store()).save_pretrained(tmp_path / "clip")
    (tmp_path / "ents.txt").write_text("黄色\n", encoding="utf-8")
    out = tmp_path / "recall.json"
    args = [
        "eval",
        "recall",
        "--model",
        str(tmp_path / "clip"),
        "--data",
        str(tmp_path / "data"),
        "--device",
        "cpu",
    ]
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
    pairs = retrieval_report(texts, images, [0, 1, 0], ks=(1,))
    assert pairs["text_to_image"]["R@1"] == 0.0  # text 0's top image is 1 (text 1's), text 1's is 0
    wide = retrieval_report(texts, images, [0, 1, 0], images_of_text=[{1}, set()], ks=(1,))
    assert wide["text_to_image"]["R@1"] == 50.0  # now text 0's top image counts
    assert wide["image_to_text"]["R@1"] == pytest.approx(
        100 * 2 / 3
    )  # image 1 lists texts 0 and 1; image 0 misses

"""``label_smoothing_style``: pykeen >= 1.x cross-entropy smoothing vs the per-label smoothing of
pykeen <= 1.0 that pykeen's ablation configs (configs/kg/kinships.yaml) were tuned with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rapiddiff.kg.transe import TransEConfig, make_loss
from rapiddiff.utils.config import ConfigError, load_config

EPS = 0.8


def _cfg(**kw: object) -> TransEConfig:
    base = dict(dataset="kinships", training_loop="lcwa", loss="crossentropy", label_smoothing=EPS)
    return TransEConfig(**{**base, **kw})


def _manual_per_label(scores: torch.Tensor, labels: torch.Tensor, eps: float) -> torch.Tensor:
    c = labels.shape[-1]
    smoothed = labels * (1 - eps) + (1 - labels) * eps / (c - 1)
    target = smoothed / smoothed.sum(-1, keepdim=True)
    return -(target * scores.log_softmax(-1)).sum(-1).mean()


def test_label_style_smooths_each_label_then_normalises_the_row() -> None:
    torch.manual_seed(0)
    scores = torch.randn(3, 6)
    labels = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0], [1, 0, 0, 0, 1, 0]], dtype=torch.float)
    loss = make_loss(_cfg(label_smoothing_style="label"))
    got = loss.process_lcwa_scores(scores, labels, label_smoothing=EPS, num_entities=6)
    assert got.item() == pytest.approx(_manual_per_label(scores, labels, EPS).item(), rel=1e-6)
    # pykeen's own (row) style differs once a row has several true tails
    row = make_loss(_cfg())
    assert row == "crossentropy"
    from pykeen.losses import CrossEntropyLoss

    ref = CrossEntropyLoss().process_lcwa_scores(scores, labels, label_smoothing=EPS, num_entities=6)
    assert abs(ref.item() - got.item()) > 1e-3
    # without smoothing both styles are the same loss
    plain = loss.process_lcwa_scores(scores, labels, label_smoothing=0.0, num_entities=6)
    assert plain.item() == pytest.approx(
        CrossEntropyLoss().process_lcwa_scores(scores, labels).item(), rel=1e-6
    )


def test_label_style_is_only_for_crossentropy(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "dataset: nations\ntraining_loop: lcwa\nloss: bcewithlogits\nlabel_smoothing_style: label\n"
    )
    with pytest.raises(ConfigError, match="only changes loss crossentropy"):
        load_config(TransEConfig, path)
    path.write_text("dataset: nations\nlabel_smoothing_style: rows\n")
    with pytest.raises(ConfigError, match="label_smoothing_style: 'rows' is not one of 'row', 'label'"):
        load_config(TransEConfig, path)

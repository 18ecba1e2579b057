"""TransE through pykeen: configs validate, Nations reaches published-level Hits@10 offline,
and ``rapiddiff kg train`` writes a store that loads, links and describes itself."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest

from rapiddiff.cli import main
from rapiddiff.kg.store import KnowledgeStore
from rapiddiff.kg.transe import TransEConfig, load_transe_config, train_transe
from rapiddiff.utils.config import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "kg").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_transe_config(path)
    assert isinstance(cfg, TransEConfig)
    assert (cfg.dataset is None) != (cfg.triples is None)


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("dataset: nations\nembeding_dim: 8\n")
    with pytest.raises(
        ConfigError, match=r"unknown key 'embeding_dim' \(did you mean 'embedding_dim'\?\).*Valid keys"
    ):
        load_transe_config(path)
    path.write_text("dataset: nations\nloss: hinge\n")
    with pytest.raises(ConfigError, match="unknown loss 'hinge'; choose one of: marginranking"):
        load_transe_config(path)
    path.write_text("triples: t.tsv\nsplit: [0.5, 0.5]\n")
    with pytest.raises(ConfigError, match="'split' must be three positive ratios"):
        load_transe_config(path)
    path.write_text("lr: 0.01\n")
    with pytest.raises(ConfigError, match="exactly one of 'dataset'"):
        load_transe_config(path)
    path.write_text("dataset: nations\ntraining_loop: lcwa\nloss: marginranking\n")
    with pytest.raises(ConfigError, match="needs sampled negatives"):
        load_transe_config(path)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_nations_reaches_published_hits_at_10_offline(tmp_path: Path, no_network: None) -> None:
    # Nations ships inside the pykeen wheel; published TransE filtered Hits@10 on it is > 0.9.
    cfg = load_transe_config(
        Path(__file__).resolve().parents[2] / "configs" / "kg" / "nations.yaml",
        out=tmp_path / "nations",
        device="cpu",
        progress=False,
    )
    _, metrics = train_transe(cfg)
    assert metrics["hits_at_10"] >= 0.90, metrics
    assert 0 < metrics["hits_at_1"] <= metrics["hits_at_3"] <= metrics["hits_at_10"]
    assert 0 < metrics["mrr"] <= 1
    loaded = KnowledgeStore.load(tmp_path / "nations")
    assert len(loaded) == 14 and len(loaded.relation_names) == 55 and loaded.dim == 32
    assert loaded.config["metrics"]["hits_at_10"] == pytest.approx(metrics["hits_at_10"])
    # all 1992 facts of Nations (train + validation + test) are the store's facts
    assert len(loaded.triples) == 1992
    assert loaded.relation_vectors.shape == (55, 32)


def _tiny_kg(folder: Path) -> tuple[Path, Path]:
    colours, shapes = ["红色", "黄色", "绿色", "紫色"], ["圆形", "长条形", "方形"]
    lines = ["# head\trelation\ttail"]
    for i in range(24):
        item = f"物品{i}"
        lines += [
            f"{item}\t颜色\t{colours[i % 4]}",
            f"{item}\t形状\t{shapes[i % 3]}",
            f"{item}\t类别\t类别{i % 2}",
        ]
    lines.append(lines[1])  # a duplicate: dropped and counted
    triples = folder / "triples.tsv"
    triples.write_text("\n".join(lines) + "\n", encoding="utf-8")
    aliases = folder / "aliases.tsv"
    aliases.write_text("物品0\t零号物品|ＷＰ０\n红色\t赤色\n", encoding="utf-8")
    return triples, aliases


def test_kg_train_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    triples, aliases = _tiny_kg(tmp_path)
    config = tmp_path / "tiny.yaml"
    config.write_text(
        f"triples: {triples}\naliases: {aliases}\nout: {tmp_path / 'unused'}\nembedding_dim: 16\n"
        "epochs: 10\nbatch_size: 64\nlr: 0.05\nnegatives_per_positive: 4\nearly_stopping: true\n"
        "early_stopping_frequency: 5\nearly_stopping_patience: 1\ntrain_on_all: true\nprogress: false\n",
        encoding="utf-8",
    )
    out = tmp_path / "store"
    assert main(["kg", "train", "--config", str(config), "--out", str(out), "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["store"] == str(out) and 0 <= printed["hits_at_10"] <= 1

    store = KnowledgeStore.load(out)
    assert len(store) == 24 + 4 + 3 + 2
    assert set(store.relation_names) == {"类别", "形状", "颜色"}
    assert len(store.triples) == 72  # every distinct fact, duplicates dropped
    assert store.aliases[store.id_of("物品0")] == ["零号物品", "ＷＰ０"]
    assert store.id_of("赤色") == store.id_of("红色")
    facts = {(store.relation_names[r], store.entity_names[t]) for r, t in store.facts(store.id_of("物品5"))}
    assert facts == {("颜色", "黄色"), ("形状", "方形"), ("类别", "类别1")}
    saved = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert set(saved["metrics"]) == {"mrr", "mean_rank", "hits_at_1", "hits_at_3", "hits_at_10"}
    assert saved["vectors_from"].startswith("all triples")
    assert saved["training"]["config"]["embedding_dim"] == 16

    assert main(["kg", "link", "一个红色的零号物品，还有ｗｐ０", "--store", str(out)]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.strip().splitlines()]
    assert rows == [
        ["2", "4", "红色", "红色"],
        ["5", "9", "零号物品", "物品0"],
        ["12", "15", "ｗｐ０", "物品0"],
    ]

    assert main(["kg", "info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "entities:   33" in text and "hits_at_10" in text


def test_kg_train_skips_malformed_lines_and_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default ``bad_lines: skip``: a broken line of the triples or aliases is left out, and
    every one is counted and named (file:line, reason) in skipped_lines.tsv and config.json; with
    ``bad_lines: error`` the first one stops the run, naming it."""
    triples, aliases = _tiny_kg(tmp_path)
    with triples.open("ab") as f:
        f.write("物品99\t颜色\n物品98\t\t红色\n".encode() + b"\xb7\xac\t\xe9\xa2\x9c\xe8\x89\xb2\tx\n")
    aliases.write_text("物品0\t零号物品\n不存在\t别名\n红色\t赤色||x\n", encoding="utf-8")
    config = tmp_path / "tiny.yaml"
    config.write_text(
        f"triples: {triples}\naliases: {aliases}\nembedding_dim: 8\nepochs: 1\nearly_stopping: false\n"
        "progress: false\n",
        encoding="utf-8",
    )
    out = tmp_path / "store"
    assert main(["kg", "train", "--config", str(config), "--out", str(out), "--device", "cpu"]) == 0
    listed = (out / "skipped_lines.tsv").read_text(encoding="utf-8").splitlines()
    assert [row.split("\t")[0] for row in listed] == [
        "where",
        f"{triples}:75",
        f"{triples}:76",
        f"{triples}:77",
        f"{aliases}:2",
        f"{aliases}:3",
    ]
    assert "not valid UTF-8" in listed[3] and "unknown entity '不存在'" in listed[4]
    store = KnowledgeStore.load(out)
    assert len(store.triples) == 72 and "物品99" not in store.entity_names
    assert store.aliases[store.id_of("物品0")] == ["零号物品"]
    saved = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert saved["training"]["skipped_lines"] == 5
    capsys.readouterr()
    assert main(["kg", "info", str(out)]) == 0
    assert "skipped:    5 malformed source line(s), listed in skipped_lines.tsv" in capsys.readouterr().out

    capsys.readouterr()
    config.write_text(config.read_text(encoding="utf-8") + "bad_lines: error\n", encoding="utf-8")
    assert main(["kg", "train", "--config", str(config), "--out", str(tmp_path / "s")]) == 2
    assert f"{triples}:75: expected 3 tab-separated columns" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("inverse", [False, True])
def test_coverage_split_equals_pykeens_split(inverse: bool) -> None:
    """The vectorised split gives pykeen's parts triple for triple, on a graph where many entities
    occur only as tails and relations rarely (so every step of the cover decides where they go)."""
    import numpy as np
    import torch
    from pykeen.triples import TriplesFactory

    from rapiddiff.kg.transe import coverage_split
    from rapiddiff.kg.triples import group_triples

    rng = np.random.default_rng(3)
    n_ent, n_rel, n = 400, 30, 3000
    ids = np.stack(
        [(n_ent * rng.random(n) ** 2).astype(int), (n_rel * rng.random(n) ** 3).astype(int), rng.integers(0, n_ent, n)],
        axis=1,
    )  # fmt: skip
    ids = group_triples(ids, n_ent, n_rel)
    used = np.unique(ids[:, [0, 2]])  # compact ids, as a file's labelling gives them
    ids[:, 0], ids[:, 2] = np.searchsorted(used, ids[:, 0]), np.searchsorted(used, ids[:, 2])
    full = TriplesFactory(
        mapped_triples=torch.from_numpy(ids),
        entity_to_id={f"e{i}": i for i in range(len(used))},
        relation_to_id={f"r{i}": i for i in range(n_rel)},
        create_inverse_triples=inverse,
    )
    for ratios, seed in (([0.8, 0.1, 0.1], 42), ([0.98, 0.01, 0.01], 7)):
        ours = coverage_split(full, ratios, seed)
        theirs = full.split(ratios, random_state=seed)
        assert [len(p.mapped_triples) for p in ours] == [len(p.mapped_triples) for p in theirs]
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.mapped_triples, b.mapped_triples)
            assert a.create_inverse_triples == b.create_inverse_triples
        assert len(np.unique(ours[0].mapped_triples[:, [0, 2]])) == len(used)  # every entity in training


def test_sampled_filtered_evaluation_equals_pykeens() -> None:
    """eval_max_triples' evaluation (filter triples made distinct by int64 keys) ranks exactly as
    pykeen's own filtered evaluator with every split (all test triples too) as filter triples."""
    import torch
    from pykeen.evaluation import RankBasedEvaluator

    from rapiddiff.kg import transe

    cfg = TransEConfig(
        dataset="nations", embedding_dim=8, epochs=2, batch_size=256, early_stopping=False,
        eval_max_triples=60, eval_batch_size=16, progress=False, device="cpu",
    )  # fmt: skip
    dataset, _, _ = transe._load_data(cfg)
    model, _, _ = transe._train_loop(cfg, dataset, torch.device("cpu"), epochs=cfg.epochs)
    sample = transe._evaluation_sample(cfg, dataset)
    assert sample is not None and len(sample) == 60
    ours = transe._metrics(transe._filtered_evaluation(cfg, model, dataset, sample))
    theirs = RankBasedEvaluator(filtered=True).evaluate(
        model,
        sample,
        additional_filter_triples=[
            p.mapped_triples for p in (dataset.training, dataset.validation, dataset.testing)
        ],
        batch_size=16,
        use_tqdm=False,
    )
    assert ours == transe._metrics(theirs)
    # and the filter mattered: filtering only the training triples ranks worse
    fewer = RankBasedEvaluator(filtered=True).evaluate(
        model,
        sample,
        additional_filter_triples=[dataset.training.mapped_triples],
        batch_size=16,
        use_tqdm=False,
    )
    assert ours["mean_rank"] < transe._metrics(fewer)["mean_rank"]


def test_a_small_kg_trains_from_a_triples_file_alone(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three triples over five entities: every triple covers an entity, so nothing can be held
    out. `kg train --triples FILE` (no YAML) still trains, says what it did, and the store notes
    that its metrics are on the training triples."""
    triples = tmp_path / "tiny.tsv"
    triples.write_text("番茄\t颜色\t红色\n香蕉\t颜色\t黄色\n番茄\t类别\t水果\n", encoding="utf-8")
    aliases = tmp_path / "aliases.tsv"
    aliases.write_text("番茄\t西红柿\n", encoding="utf-8")
    out = tmp_path / "store"
    args = ["kg", "train", "--triples", str(triples), "--aliases", str(aliases), "--out", str(out)]
    logger = logging.getLogger("rapiddiff")
    logger.addHandler(caplog.handler)  # the CLI's own handler keeps rapiddiff's records from the root
    try:
        assert main([*args, "--epochs", "2", "--device", "cpu"]) == 0
    finally:
        logger.removeHandler(caplog.handler)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["store"] == str(out) and printed["test_triples"] == 3
    assert "cannot hold one triple of each of the 5 entities and 2 relations" in caplog.text
    store = KnowledgeStore.load(out)
    assert len(store) == 5 and store.id_of("西红柿") == store.id_of("番茄")
    assert "on the training triples" in store.config["evaluation"]


@pytest.mark.parametrize("n_extra", [0, 10])
def test_coverage_split_of_a_small_kg_trains_the_cover_and_holds_out_the_rest(n_extra: int) -> None:
    """Where the ratio's training part is smaller than the cover, the cover trains and the
    remaining triples are held out in the configured validation : test proportion."""
    import numpy as np
    import torch
    from pykeen.triples import TriplesFactory

    from rapiddiff.kg.transe import coverage_split

    rows = [["a", "r", "b"], ["c", "r", "d"], ["e", "s", "f"]]  # the cover: one triple of each
    more = ["brc", "dre", "fra", "bsd", "cse", "asf", "era", "fsb", "dsa", "cra"]  # among the same
    rows += [list(t) for t in more[:n_extra]]
    factory = TriplesFactory.from_labeled_triples(np.array(rows))
    parts = coverage_split(factory, [0.1, 0.45, 0.45], seed=0)
    train, validation, test = (p.num_triples for p in parts)
    assert train + validation + test == len(rows) and train > 0.1 * len(rows)  # the cover, not 10 %
    assert validation == test == (len(rows) - train) // 2  # the rest held out, 0.45 : 0.45
    assert n_extra or train == 3  # nothing left to hold out
    covered = torch.cat([parts[0].mapped_triples[:, 0], parts[0].mapped_triples[:, 2]]).unique()
    assert len(covered) == factory.num_entities

"""benchmarks/kshapes_chain.py's evaluation: the commands it runs and the measures its summary takes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chain():
    spec = importlib.util.spec_from_file_location("kshapes_chain", ROOT / "benchmarks" / "kshapes_chain.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kshapes_chain"] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("kshapes_chain", None)


def _row(split, mode, both, **extra):
    return {"split": split, "knowledge": mode, "colour": both + 10, "shape": both + 5, "both": both, **extra}


def _seed(
    out: Path,
    seed: int,
    text: float,
    both: float,
    embed: float,
    attribute_all: float,
    val_both: float | None = None,
) -> None:
    results = out / f"seed-{seed}" / "results"
    attribute = {"background": 40.0, "position": 90.0, "all": attribute_all, "psnr": 22.0, "ssim": 0.88}
    tables = {
        "knowledge_unet-on": [
            _row("heldout", "on", embed, psnr=24.0 + seed, ssim=0.9),
            _row("heldout", "text", text, psnr=23.0, ssim=0.8),
            _row("heldout", "both", both, psnr=25.0, ssim=0.95),
            _row("val", "on", 30.0 + seed),
            *([_row("val", "both", val_both)] if val_both is not None else []),
            _row("heldout", "on", 1.0, variant="alias"),  # per-variant rows: only "both"
        ],
        "knowledge_attribute_unet-on": [
            _row("attribute", "on", 60.0, **attribute),
            _row("attribute", "off", 5.0, **{**attribute, "all": 1.0}),
        ],
    }
    for name, table in tables.items():
        (results / name / "metrics").mkdir(parents=True)
        (results / name / "metrics" / "knowledge.json").write_text(json.dumps({"table": table}), "utf-8")


def test_summary_has_the_new_measures_and_the_ceiling_is_the_better_of_text_and_both(chain, tmp_path):
    _seed(tmp_path, 0, text=2.0, both=40.0, embed=30.0, attribute_all=20.0)
    _seed(tmp_path, 1, text=50.0, both=25.0, embed=45.0, attribute_all=30.0)
    m0 = chain.seed_measures(tmp_path / "seed-0")
    # "text" alone is off-distribution for a U-Net trained with the attribute words' vectors: the
    # ceiling is "both" there (40), "text" where it is better (50).
    assert m0["U-Net on | heldout | ceiling both % (best of text, both)"] == 40.0
    assert m0["U-Net on | heldout | TransE (on) / ceiling both, ratio %"] == 75.0
    m1 = chain.seed_measures(tmp_path / "seed-1")
    assert m1["U-Net on | heldout | TransE (on) / ceiling both, ratio %"] == 90.0
    assert m0["U-Net on | attribute | knowledge on | all %"] == 20.0
    assert m0["U-Net on | attribute | knowledge on | background %"] == 40.0
    assert m0["U-Net on | attribute | knowledge on | position %"] == 90.0
    assert m0["U-Net on | heldout | knowledge both | render PSNR dB"] == 25.0
    assert m0["U-Net on | attribute | knowledge on | render SSIM"] == 0.88
    assert m0["U-Net on | attribute | knowledge off | all %"] == 1.0
    assert "U-Net on | heldout | knowledge on | background %" not in m0  # only the attribute split's
    assert "U-Net on | heldout alias | knowledge on | both %" in m0
    assert not any(k.startswith("U-Net on | heldout alias") and "render" in k for k in m0)

    (tmp_path / "seed-1" / "results" / "timings.json").write_text('{"kg": 31.0, "unet_on": 139.5}', "utf-8")
    summary = chain.summarise_seeds(tmp_path, [0, 1])
    assert summary["timings"] == {1: {"kg": 31.0, "unet_on": 139.5}}  # seed 0 kept none
    table = summary["measures"]
    assert table["U-Net on | attribute | knowledge on | all %"]["mean"] == 25.0
    assert table["U-Net on | heldout | knowledge on | render PSNR dB"]["values"] == {0: 24.0, 1: 25.0}
    md = (tmp_path / "summary.md").read_text(encoding="utf-8")
    assert "| U-Net on | attribute | knowledge on | all % | 25.00 ± 7.07 | 2 |" in md
    assert "| U-Net on | heldout | TransE (on) / ceiling both, ratio % | 82.50 ± 10.61 | 2 |" in md
    assert "| U-Net on | attribute | knowledge on | render SSIM | 0.8800 ± 0.0000 | 2 |" in md
    assert summary["selection"]["best_seed"] == 1 and summary["selection"]["knowledge_mode"] == "embed"
    assert "- seed 1: kg 31, unet_on 139.5" in md


def test_part_summary_joins_seeds_run_in_separate_calls_and_names_a_missing_one(
    chain, tmp_path, monkeypatch, capsys
):
    """With a soup a seed, each seed's U-Net part is its own device call; --part summary takes their
    folders, unpacked into one OUT, without training, and stops naming a seed that has no results."""
    _seed(tmp_path, 0, text=2.0, both=40.0, embed=30.0, attribute_all=20.0)
    _seed(tmp_path, 2, text=50.0, both=25.0, embed=45.0, attribute_all=30.0)
    argv = ["kshapes_chain.py", "--out", str(tmp_path), "--part", "summary", "--seeds"]
    monkeypatch.setattr(sys, "argv", [*argv, "0,2"])
    assert chain.main() == 0
    summary = json.loads((tmp_path / "summary.json").read_text("utf-8"))
    assert summary["measures"]["U-Net on | attribute | knowledge on | all %"]["mean"] == 25.0
    assert "seeds 0, 2" in capsys.readouterr().out
    assert not (tmp_path / "seed-0.log").exists()  # nothing was started
    monkeypatch.setattr(sys, "argv", [*argv, "0,1,2"])
    with pytest.raises(SystemExit, match=r"seeds \[1\]"):
        chain.main()
    monkeypatch.setattr(sys, "argv", argv[:-1])
    with pytest.raises(SystemExit):  # argparse: --part summary needs --seeds
        chain.main()


def test_the_seed_and_its_knowledge_mode_are_chosen_together_on_validation(chain, tmp_path):
    """The shipped mode's validation score picks the seed: seed 0 is best in mode "both" (40 against
    seed 1's 35) though seed 1 is best on the vectors alone (31 against 30); a tie prefers "embed"."""
    _seed(tmp_path, 0, text=2.0, both=40.0, embed=30.0, attribute_all=20.0, val_both=40.0)
    _seed(tmp_path, 1, text=2.0, both=40.0, embed=30.0, attribute_all=20.0, val_both=35.0)
    selection = chain.summarise_seeds(tmp_path, [0, 1])["selection"]
    assert (selection["best_seed"], selection["knowledge_mode"]) == (0, "both")
    assert selection["scores"] == {"0:embed": 30.0, "0:both": 40.0, "1:embed": 31.0, "1:both": 35.0}
    assert "0:both" in (tmp_path / "summary.md").read_text(encoding="utf-8")
    _seed(
        tmp_path / "tie", 1, text=2.0, both=40.0, embed=30.0, attribute_all=20.0, val_both=31.0
    )  # ties 1:embed
    selection = chain.summarise_seeds(tmp_path / "tie", [1])["selection"]
    assert (selection["best_seed"], selection["knowledge_mode"]) == (1, "embed")


def test_the_chain_evaluates_both_modes_and_the_attribute_split(chain, tmp_path, monkeypatch):
    cfg = chain.load_config(chain.ChainConfig, ROOT / "configs" / "kshapes" / "chain.yaml")
    assert cfg.eval_attribute and cfg.eval_text_mode
    cfg.guidance_candidates = []  # the trained folder's scale (the sweep: the test below)
    run = chain.Chain(tmp_path, cfg, smoke=True)
    jobs: dict[str, list[str]] = {}
    monkeypatch.setattr(run, "run_parallel", lambda batch: jobs.update(batch))
    run.evaluate()

    def arg(cmd, flag):
        return cmd[cmd.index(flag) + 1]

    on = jobs["knowledge_unet-on"]
    assert arg(on, "--modes") == "on,off,text,both" and arg(on, "--splits") == "seen,heldout,val"
    robust = jobs["knowledge_robust_unet-on"]
    assert arg(robust, "--splits") == "seen,heldout,val" and arg(robust, "--modes") == "on,off"
    attribute = jobs["knowledge_attribute_unet-on"]
    assert arg(attribute, "--splits") == "attribute" and arg(attribute, "--modes") == "on,off"
    assert arg(attribute, "--kshapes") == str(tmp_path / "data") and arg(attribute, "--model").endswith(
        "unet_soup"  # the chain config's U-Net: the soup of its draws
    )
    assert not any("--batch-size" in cmd for cmd in jobs.values())  # eval knowledge's own default
    jobs.clear()
    cfg.eval_attribute = cfg.eval_text_mode = False
    run2 = chain.Chain(tmp_path / "b", cfg, smoke=True)
    monkeypatch.setattr(run2, "run_parallel", lambda batch: jobs.update(batch))
    run2.evaluate()
    assert arg(jobs["knowledge_unet-on"], "--modes") == "on,off,both"  # "both": the shipped mode
    assert "knowledge_attribute_unet-on" not in jobs


def test_a_finished_evaluation_runs_again_only_for_a_mode_it_lacks(chain, tmp_path, monkeypatch):
    cfg = chain.load_config(chain.ChainConfig, ROOT / "configs" / "kshapes" / "chain.yaml")
    cfg.guidance_candidates = []
    cfg.eval_text_mode = cfg.eval_robust = cfg.eval_attribute = False
    run = chain.Chain(tmp_path, cfg, smoke=True)
    for name, modes in (("knowledge_unet-on", "on,off,both"), ("knowledge_unet-off", "off")):
        (run.results / name / "metrics").mkdir(parents=True)
        (run.results / name / "metrics" / "knowledge.json").write_text("{}", "utf-8")
        for mode in modes.split(","):
            (run.results / name / f"knowledge_{mode}").mkdir()
    jobs: dict[str, list[str]] = {}
    monkeypatch.setattr(run, "run_parallel", lambda batch: jobs.update(batch))
    run.evaluate()
    assert not any(name.startswith("knowledge_") for name in jobs)  # finished with its modes: not redone
    run.cfg.eval_text_mode = True  # switched on for the resume: the entity evaluation lacks "text"
    run.evaluate()
    assert [name for name in jobs if name.startswith("knowledge_")] == ["knowledge_unet-on"]
    cmd = jobs["knowledge_unet-on"]
    assert cmd[cmd.index("--modes") + 1] == "on,off,text,both"


def test_the_guidance_is_chosen_on_validation_entities_and_captions_and_used_by_every_evaluation(
    chain, tmp_path, monkeypatch
):
    cfg = chain.load_config(chain.ChainConfig, ROOT / "configs" / "kshapes" / "chain.yaml")
    assert cfg.guidance_candidates, "the chain config sweeps the guidance"
    cfg.guidance_candidates, cfg.eval_batch_size = [2.0, 3.0, 5.0], 128
    run = chain.Chain(tmp_path, cfg, smoke=True)
    # validation both % per scale and mode: 3.0 wins in mode "both", 5.0 would win on "on" alone;
    # with the validation attribute captions' all-four % averaged in, 2.0 wins: (50 + 90) / 2 against
    # (70 + 60) / 2; the test captions (split "attribute", best at 5.0 here) are never looked at
    val = {2.0: (20.0, 50.0), 3.0: (40.0, 70.0), 5.0: (60.0, 55.0)}
    attribute = {2.0: 90.0, 3.0: 60.0, 5.0: 40.0}
    swept: list[str] = []
    jobs: dict[str, list[str]] = {}

    def fake_parallel(batch):
        for name, cmd in batch.items():
            assert cmd[cmd.index("--batch-size") + 1] == "128"  # the sweep's and every evaluation's
            if not name.startswith("guidance_"):
                jobs[name] = cmd
                continue
            swept.append(name)
            assert (
                cmd[cmd.index("--splits") + 1] == "val,attribute_val"
                and cmd[cmd.index("--modes") + 1] == "on,both"
            )
            g = float(cmd[cmd.index("--guidance") + 1])
            metrics = Path(cmd[cmd.index("--out") + 1]) / "metrics"
            metrics.mkdir(parents=True)
            table = [_row("val", "on", val[g][0]), _row("val", "both", val[g][1]), _row("val", "off", 99.0)]
            table += [
                _row("attribute_val", "on", 0.0, all=attribute[g]),
                _row("attribute_val", "both", 0.0, all=99.0),
                _row("attribute", "on", 0.0, all=100.0 if g == 5.0 else 0.0),
            ]
            (metrics / "knowledge.json").write_text(json.dumps({"table": table}), "utf-8")

    monkeypatch.setattr(run, "run_parallel", fake_parallel)
    run.evaluate()
    assert sorted(swept) == ["guidance_2", "guidance_3", "guidance_5"]
    assert all(cmd[cmd.index("--guidance") + 1] == "2.0" for cmd in jobs.values())  # every evaluation
    recorded = json.loads((tmp_path / "results" / "guidance.json").read_text("utf-8"))
    assert recorded == {"scores": {"2": 70.0, "3": 65.0, "5": 50.0}, "chosen": 2.0}
    swept.clear()
    assert run.choose_guidance() == 2.0 and not swept  # recorded: a resumed chain does not sweep again
    measures = chain.seed_measures(tmp_path)
    assert measures["guidance | chosen"] == 2.0
    assert measures["guidance | 5 | selection score"] == 50.0
    # ties go to the lower scale (the off mode, 99 % above, never counted)
    assert chain.pick_guidance({4.0: 70.0, 3.0: 70.0, 5.0: 10.0}) == 3.0
    cfg.eval_batch_size = 0  # refused before the first stage, not after the U-Nets trained
    with pytest.raises(SystemExit, match="eval_batch_size: 1 or more"):
        chain.Chain(tmp_path / "x", cfg, smoke=True)


def test_a_second_unet_round_trains_on_the_first_rounds_encoders_and_is_the_one_evaluated(
    chain, tmp_path, monkeypatch
):
    cfg = chain.load_config(chain.ChainConfig, ROOT / "configs" / "kshapes" / "chain.yaml")
    cfg.guidance_candidates = []
    cfg.unet_rounds, cfg.train_off, cfg.unet_soup = 2, True, 1  # a second round: one draw a round
    run = chain.Chain(tmp_path, cfg, smoke=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.jsonl").write_text("", "utf-8")  # the data exists
    (tmp_path / "data" / "train").mkdir()
    lines = [
        {"file_name": "0.png", "text": "一个鸡蛋", "shape": "椭圆形"},
        {
            "file_name": "1.png",
            "text": "一个番茄",
            "shape": "圆形",
            "background": "深绿色",
        },  # not named: once
    ]
    metadata = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    (tmp_path / "data" / "train" / "metadata.jsonl").write_text(metadata, "utf-8")
    batches: list[dict[str, list[str]]] = []

    def fake_parallel(batch):
        batches.append(batch)
        for name in batch:
            if name.startswith("unet_"):  # a trained folder is one that holds something
                (tmp_path / name).mkdir()
                (tmp_path / name / "model_index.json").write_text("{}", "utf-8")

    monkeypatch.setattr(run, "run_parallel", fake_parallel)
    monkeypatch.setattr(run, "assemble_builtin", lambda: None)
    run.unet_and_eval()

    def arg(cmd, flag):
        return next(a.split("=", 1)[1] for a in cmd if a.startswith(flag + "="))

    # round one (knowledge on and off side by side), then round two alone, on round one's encoders
    assert [sorted(b) for b in batches[:2]] == [["unet_off", "unet_on"], ["unet_on_r2"]]
    assert arg(batches[0]["unet_on"], "--model.text_encoder") == str(tmp_path / "clip_on")
    second = batches[1]["unet_on_r2"]
    assert arg(second, "--model.text_encoder") == str(tmp_path / "unet_on")
    assert (
        arg(second, "--output") == str(tmp_path / "unet_on_r2") and "--model.trainable=[unet]" not in second
    )
    # the chain's weak cells (the ellipse) come unet_weak_cells_factor times in every U-Net's data
    table = tmp_path / "data" / "train" / "unet_weak_cells.jsonl"
    assert {arg(cmd, "--data.train") for b in batches[:2] for cmd in b.values()} == {str(table)}
    assert [json.loads(x)["file_name"] for x in table.read_text("utf-8").splitlines()] == ["0.png"] * 3 + [
        "1.png"
    ]
    evaluated = {name: cmd[cmd.index("--model") + 1] for name, cmd in batches[2].items()}
    assert (
        evaluated["knowledge_unet-on"]
        == evaluated["knowledge_attribute_unet-on"]
        == str(tmp_path / "unet_on_r2")
    )
    assert evaluated["knowledge_unet-off"] == str(tmp_path / "unet_off")
    batches.clear()
    run.unet_and_eval()  # resumed: every round is done, nothing trains again
    assert not any(name.startswith("unet_") for b in batches for name in b)
    cfg.unet_rounds = 3
    with pytest.raises(SystemExit, match="unet_rounds: 1 or 2"):
        chain.Chain(tmp_path / "x", cfg, smoke=True)
    cfg.unet_rounds, cfg.unet_weak_cells = 1, {"shapes": ["椭圆形"]}
    with pytest.raises(SystemExit, match="shapes\\? the attributes are colour, shape"):
        chain.Chain(tmp_path, cfg, smoke=True)
    cfg.unet_weak_cells = None
    assert chain.Chain(tmp_path, cfg, smoke=True).unet_train_data() == tmp_path / "data" / "train"
    # unet_train_fusion=false: the knowledge U-Net trains alone, on its encoders' states cached once
    cfg.unet_rounds = 1
    commands = {}
    for train_fusion in (True, False):
        cfg.unet_train_fusion = train_fusion
        run = chain.Chain(tmp_path / str(train_fusion), cfg, smoke=True)
        commands[train_fusion] = run.unet_training("unet_on", "clip_on", True, [])
    for flag in ("--model.trainable=[unet]", "--model.speed.cache_text=true"):
        assert flag in commands[False] and flag not in commands[True]
    # unet_architecture: the U-Nets start from a random init of the preset with those keys changed
    assert not any(a.startswith("--model.unet=") for a in commands[True])  # None: the stage's preset
    cfg.unet_architecture = {"block_out_channels": [128, 256, 256]}
    run = chain.Chain(tmp_path / "wide", cfg, smoke=True)
    written = Path(arg(run.unet_training("unet_on", "clip_on", True, []), "--model.unet"))
    config = json.loads(written.read_text("utf-8"))
    assert config["block_out_channels"] == [128, 256, 256] and config["cross_attention_dim"] == 128
    cfg.unet_architecture = {"block_out_channel": [128, 256, 256]}
    with pytest.raises(SystemExit, match="did you mean 'block_out_channels'"):
        chain.Chain(tmp_path / "typo", cfg, smoke=True).unet_training("unet_on", "clip_on", True, [])


def test_a_pack_between_rounds_carries_round_ones_encoders_and_only_preps_results(
    chain, tmp_path, monkeypatch
):
    """--part pack after round one (three device calls: prep, round one, round two): the next call
    gets round one's text side as unet_on — what round two trains on, encoding as before — and
    prep's results, never round one's guidance choice or evaluations (they would be reused)."""
    import shutil

    import torch

    from rapiddiff.models.text_encoder import KnowledgeTextEncoder

    builtin = ROOT / "rapiddiff" / "assets" / "kshapes"
    first = tmp_path / "first"
    for part in ("text_encoder", "tokenizer", "knowledge"):
        shutil.copytree(builtin / part, first / "unet_on" / part)
    (first / "unet_on" / "unet").mkdir()  # round one's U-Net: stays behind
    (first / "unet_on" / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"x" * 1000)
    prompts = ["浅蓝色背景上有一个红色的三角形", "草莓"]
    (first / "data").mkdir()
    (first / "data" / "prompts.jsonl").write_text(
        "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in prompts), "utf-8"
    )
    results = first / "results"
    for name in ("guidance/g3/metrics", "knowledge_unet-on/metrics"):
        (results / name).mkdir(parents=True)
    (results / "guidance.json").write_text('{"chosen": 3.0}', "utf-8")
    (results / "recall_clip-on_test-on_val.json").write_text("{}", "utf-8")

    packed = chain.pack(first, tmp_path / "round1" / "seed-0.tgz", with_vae=False)
    second = tmp_path / "second"
    chain.unpack(packed, second)
    assert sorted(p.name for p in (second / "results").iterdir()) == ["recall_clip-on_test-on_val.json"]
    assert not (second / "unet_on" / "unet").exists()
    # mode "embed", a chain's round one's: the built-in folder's "both" spells facts with tokens these
    # two prompts lack (pruned to [UNK]); in the chain every such token was pruned before round one
    before = KnowledgeTextEncoder.from_pretrained(builtin, knowledge_mode="embed").eval()
    after = KnowledgeTextEncoder.from_pretrained(second / "unet_on", knowledge_mode="embed").eval()
    assert {p.dtype for p in after.fusion.parameters()} == {torch.float32}  # round two trains it
    with torch.no_grad():
        torch.testing.assert_close(after.encode(prompts), before.encode(prompts))

    # a prep pack unpacked into a resumed chain casts what it brought, not the chain's own U-Net folder
    from safetensors.torch import load_file, save_file

    (first / "unet_on").rename(first / "clip_on")
    shutil.rmtree(first / "clip_on" / "unet")
    prep = chain.pack(first, tmp_path / "prep" / "seed-0.tgz", with_vae=False)
    resumed = tmp_path / "resumed"
    (resumed / "unet_on" / "unet").mkdir(parents=True)
    save_file({"w": torch.ones(2, dtype=torch.float16)}, str(resumed / "unet_on" / "unet" / "w.safetensors"))
    chain.unpack(prep, resumed)
    assert load_file(str(resumed / "unet_on" / "unet" / "w.safetensors"))["w"].dtype == torch.float16
    assert {
        v.dtype for v in load_file(str(resumed / "clip_on" / "text_encoder" / "model.safetensors")).values()
    } == {torch.float32}

    # the third call: round one counts as done, round two trains on the unpacked encoders
    cfg = chain.load_config(
        chain.ChainConfig, ROOT / "configs" / "kshapes" / "chain.yaml", unet_rounds=2, unet_soup=1
    )
    cfg.unet_weak_cells = None  # the data folder here has no training lines to repeat
    run = chain.Chain(second, cfg, smoke=True)
    trained: list[str] = []
    monkeypatch.setattr(run, "run_parallel", lambda batch: trained.extend(batch))
    data: list[dict[str, bool]] = []
    monkeypatch.setattr(run, "ensure_data", lambda **kw: data.append(kw))
    monkeypatch.setattr(run, "assemble_builtin", lambda: None)
    monkeypatch.setattr(run, "evaluate", lambda: None)
    run.unet_and_eval()
    assert trained == ["unet_on_r2"]
    assert data == [{"hr_copies": False}]  # only the prep's upscaler reads hr/


def test_one_guidance_candidate_is_used_unswept_and_set_overrides_the_config(chain, tmp_path, monkeypatch):
    overrides = chain._parse_sets(
        ["unet_rounds=2", "unet_soup=1", "guidance_candidates=[3.0]", "eval_text_mode=false"]
    )
    cfg = chain.load_config(chain.ChainConfig, ROOT / "configs" / "kshapes" / "chain.yaml", **overrides)
    assert (cfg.unet_rounds, cfg.guidance_candidates, cfg.eval_text_mode) == (2, [3.0], False)
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        chain._parse_sets(["unet_rounds"])
    with pytest.raises(SystemExit, match="not valid YAML"):
        chain._parse_sets(["guidance_candidates=[3.0"])
    run = chain.Chain(tmp_path, cfg, smoke=True)
    jobs: dict[str, list[str]] = {}
    monkeypatch.setattr(run, "run_parallel", jobs.update)
    run.evaluate()
    assert not any(name.startswith("guidance_") for name in jobs)  # nothing to choose: no sweep
    on = jobs["knowledge_unet-on"]
    assert on[on.index("--guidance") + 1] == "3.0"
    assert on[on.index("--modes") + 1] == "on,off,both"  # the shipped mode, without the text ceiling


def test_the_chains_relation_keys_reach_the_knowledge_clip_only(chain, tmp_path, monkeypatch):
    """clip_hide_relations / clip_fusion_relations / clip_hard_negatives become the knowledge CLIP's
    options; the knowledge-off CLIP gets none of them; unset keys add nothing."""
    cfg = chain.load_config(chain.ChainConfig, ROOT / "configs" / "kshapes" / "chain.yaml")
    cfg.train_off = True
    cfg.clip_hide_relations, cfg.clip_hard_negatives = ["颜色", "形状"], ["颜色"]
    run = chain.Chain(tmp_path, cfg, smoke=True)
    (tmp_path / "kg").mkdir()
    (tmp_path / "kg" / "config.json").write_text("{}", "utf-8")  # TransE done
    jobs: dict[str, list[str]] = {}
    monkeypatch.setattr(run, "ensure_data", lambda: None)
    monkeypatch.setattr(run, "run_parallel", jobs.update)
    monkeypatch.setattr(run, "recall", lambda: None)
    run.prep()
    on = [a for a in jobs["clip_on"] if "relations=" in a]
    assert on == [
        "--model.entity_token_dropout_relations=[颜色,形状]",
        "--model.hard_negative_relations=[颜色]",
    ]
    assert not [a for a in jobs["clip_off"] if "relations=" in a]


def test_a_soup_trains_forks_from_the_trunks_checkpoint_and_is_the_folder_evaluated(
    chain, tmp_path, monkeypatch
):
    """unet_soup: 3 — the trunk keeps its checkpoint at unet_soup_fork_at of the steps, two forks resume
    it with seeds of their own, and the mean of the three is what the chain evaluates and ships."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = chain.load_config(chain.ChainConfig, ROOT / "configs" / "kshapes" / "chain.yaml")
    cfg.guidance_candidates, cfg.unet_weak_cells, cfg.unet_soup, cfg.unet_soup_fork_at = [], None, 3, 0.5
    run = chain.Chain(tmp_path, cfg, smoke=True)
    (tmp_path / "data" / "train").mkdir(parents=True)
    (tmp_path / "data" / "prompts.jsonl").write_text("", "utf-8")
    batches: list[dict[str, list[str]]] = []

    def fake_parallel(batch):
        batches.append(batch)
        for i, name in enumerate(sorted(n for n in batch if n.startswith("unet_"))):
            (tmp_path / name / "unet").mkdir(parents=True)
            save_file({"w": torch.full((2,), float(i))}, str(tmp_path / name / "unet" / "w.safetensors"))

    monkeypatch.setattr(run, "run_parallel", fake_parallel)
    monkeypatch.setattr(run, "assemble_builtin", lambda: None)
    run.unet_and_eval()

    def args(cmd, flag):
        return [a.split("=", 1)[1] for a in cmd if a.startswith(flag + "=")]

    first = batches[0]
    assert sorted(first) == ["unet_on", "unet_on_f1", "unet_on_f2"]
    ckpt = str(tmp_path / "runs" / "unet_on" / "checkpoints" / "step=0000002.ckpt")  # 0.5 of 4 smoke steps
    assert args(first["unet_on"], "--checkpoint.every_n_train_steps") == ["2"]
    assert args(first["unet_on"], "--checkpoint.save_top_k") == ["-1"] and not args(
        first["unet_on"], "--ckpt_path"
    )
    seeds = {name: args(cmd, "--model.seed")[-1] for name, cmd in first.items()}  # the last value wins
    assert seeds == {"unet_on": "0", "unet_on_f1": "1000", "unet_on_f2": "2000"}
    for fork in ("unet_on_f1", "unet_on_f2"):
        assert args(first[fork], "--ckpt_path") == [ckpt]
        assert args(first[fork], "--model.text_encoder") == [str(tmp_path / "clip_on")]
    assert torch.all(load_file(tmp_path / "unet_soup" / "unet" / "w.safetensors")["w"] == 1.0)  # (0+1+2)/3
    evaluated = {name: cmd[cmd.index("--model") + 1] for name, cmd in batches[1].items()}
    assert set(evaluated.values()) == {str(tmp_path / "unet_soup")}
    batches.clear()
    run.unet_and_eval()  # resumed: the members and the soup are done, nothing trains or averages again
    assert not any(name.startswith("unet_") for b in batches for name in b)
    cfg.unet_soup_fork_at = 1.0
    with pytest.raises(SystemExit, match="unet_soup_fork_at: in \\(0, 1\\)"):
        chain.Chain(tmp_path / "x", cfg, smoke=True)
    cfg.unet_soup_fork_at, cfg.unet_rounds = 0.25, 2
    with pytest.raises(SystemExit, match="set unet_rounds: 1"):
        chain.Chain(tmp_path / "y", cfg, smoke=True)


def test_a_job_that_resumes_a_checkpoint_starts_when_it_appears(chain, tmp_path):
    """run_parallel starts a fork once the trunk has written the checkpoint it names, and fails it
    (naming why) when every other job ended without writing it."""
    cfg = chain.load_config(chain.ChainConfig, ROOT / "configs" / "kshapes" / "chain.yaml")
    run = chain.Chain(tmp_path, cfg, smoke=True)
    ckpt, started = tmp_path / "step.ckpt", tmp_path / "fork_started"
    trunk = [
        sys.executable,
        "-c",
        f"import time, pathlib; time.sleep(1.5); pathlib.Path({str(ckpt)!r}).write_text('x')",
    ]
    fork = [
        sys.executable,
        "-c",
        f"import pathlib, sys; pathlib.Path({str(started)!r}).write_text(str(pathlib.Path({str(ckpt)!r}).exists()))",
        f"--ckpt_path={ckpt}",
    ]
    run.run_parallel({"trunk": trunk, "fork": fork})
    assert started.read_text() == "True"  # it started after the file was there
    ckpt.unlink()
    with pytest.raises(SystemExit, match="failed: fork"):
        run.run_parallel({"trunk": [sys.executable, "-c", "pass"], "fork": fork})
    assert "never started: no" in (tmp_path / "logs" / "fork.log").read_text("utf-8")


def test_the_chain_scores_recall_in_one_process_a_clip_folder(chain, tmp_path, monkeypatch):
    """prep's recall: one `eval recall` a CLIP folder for every entity list and knowledge setting (the
    test images encoded once), its --out naming the files the summary reads; nothing when they exist."""
    cfg = chain.load_config(chain.ChainConfig, ROOT / "configs" / "kshapes" / "chain.yaml")
    run = chain.Chain(tmp_path, cfg, smoke=True)
    run.data.mkdir(parents=True)
    (run.data / "heldout_entities.txt").write_text("草莓\n", "utf-8")
    (run.data / "validation_entities.txt").write_text("黄瓜\n", "utf-8")
    (run.data / "entities.json").write_text('["草莓", "黄瓜", "番茄"]', "utf-8")
    jobs: dict[str, list[str]] = {}
    monkeypatch.setattr(run, "run_parallel", lambda batch: jobs.update(batch))
    run.recall()
    assert list(jobs) == ["recall_clip-on"]
    cmd = jobs["recall_clip-on"]
    lists = cmd[cmd.index("--filter-entities") + 1 : cmd.index("--out")]
    assert [Path(p).stem for p in lists] == ["seen", "heldout", "val"]
    assert Path(lists[0]).read_text("utf-8") == "番茄\n"
    assert cmd[cmd.index("--knowledge") + 1] == "on,off"
    template = cmd[cmd.index("--out") + 1]
    for knowledge in ("on", "off"):
        for split in ("seen", "heldout", "val"):
            name = template.replace("{knowledge}", knowledge).replace("{entities}", split)
            Path(name).write_text("{}", "utf-8")
    assert (
        sorted(p.name for p in run.results.glob("recall_*.json"))[0] == "recall_clip-on_test-off_heldout.json"
    )
    jobs.clear()
    run.recall()
    assert jobs == {}

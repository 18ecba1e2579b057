"""rapiddiff train unet: runs from its shipped config, learns, resumes exactly, stops on NaN, exports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rapiddiff.train import unet as unet_stage
from rapiddiff.train.finite import NonFiniteLossError
from rapiddiff.train.unet_data import encode_dataset
from tests.train.helpers import read_losses, tiny_unet_args, write_imagefolder


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_imagefolder(tmp_path_factory.mktemp("unet") / "data")


def test_runs_from_config_and_exports_a_diffusers_folder(data: Path, tmp_path: Path) -> None:
    root = tmp_path / "run"
    # Data from a licensed folder (emoji-zh writes LICENSES/ and ATTRIBUTION.md beside train/).
    (data.parent / "ATTRIBUTION.md").write_text("artwork: Noto Emoji (Apache-2.0)\n", encoding="utf-8")
    (data.parent / "LICENSES").mkdir(exist_ok=True)
    (data.parent / "LICENSES" / "noto.txt").write_text("Apache License 2.0\n", encoding="utf-8")
    # bf16-mixed as the shipped config: frozen VAE and text tower run in bf16, the U-Net in fp32.
    unet_stage.cli_main([*tiny_unet_args(data, root, max_steps=3), "--trainer.precision=bf16-mixed"])
    names = {p.name for p in (root / "checkpoints").glob("*.ckpt")}
    assert names >= {"step=0000002.ckpt", "last.ckpt"}
    assert (root / "checkpoints" / "config.yaml").is_file()  # the resolved config beside them
    grids = sorted(root.rglob("samples/step=*.png"))
    assert [g.name for g in grids] == ["step=0000002.png", "step=0000003.png"]
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(root / "model", safety_checker=None)
    assert pipe.unet.config.cross_attention_dim == 32
    assert (root / "model" / "training_config.yaml").is_file()
    assert (root / "model" / "ATTRIBUTION.md").read_text(encoding="utf-8").startswith("artwork: Noto")
    assert (root / "model" / "LICENSES" / "noto.txt").is_file()
    from safetensors.torch import load_file

    vae_weights = load_file(root / "model" / "vae" / "diffusion_pytorch_model.safetensors")
    assert {t.dtype for t in vae_weights.values()} == {torch.float32}  # saved in full precision again
    # The exported U-Net is the EMA of the trained weights, not the init.
    fresh = unet_stage.LatentDiffusion(unet="tiny", vae="tiny", text_encoder="tiny")
    assert not torch.equal(pipe.unet.conv_in.weight, fresh.unet.conv_in.weight)


@pytest.fixture(scope="module")
def uninterrupted(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], Path]:
    root = tmp_path_factory.mktemp("whole")
    record = "--trainer.callbacks+=tests.train.helpers.RecordLosses"
    unet_stage.cli_main(
        [*tiny_unet_args(data, root, 5), record, f"--trainer.callbacks.path={root / 'a.txt'}"]
    )
    return read_losses(root / "a.txt"), root / "model"


@pytest.mark.parametrize("stop", [3, 2])  # 2 batches an epoch: mid-epoch, and at an epoch's end
def test_ctrl_c_saves_and_resume_reproduces_the_uninterrupted_losses(
    data: Path, tmp_path: Path, uninterrupted: tuple[dict[int, float], Path], stop: int
) -> None:
    parts = tmp_path / "parts"
    record = "--trainer.callbacks+=tests.train.helpers.RecordLosses"
    unet_stage.cli_main(
        [
            *tiny_unet_args(data, parts, 5),
            record,
            f"--trainer.callbacks.path={tmp_path / 'b.txt'}",
            "--trainer.callbacks+=tests.train.helpers.SendCtrlC",
            f"--trainer.callbacks.step={stop}",
        ]
    )
    assert (parts / "checkpoints" / "last.ckpt").is_file()
    assert not (parts / "model").exists()  # an interrupted run exports nothing
    assert max(read_losses(tmp_path / "b.txt")) == stop
    unet_stage.cli_main(
        [
            *tiny_unet_args(data, parts, 5),
            record,
            f"--trainer.callbacks.path={tmp_path / 'c.txt'}",
            "--ckpt_path=last",
        ]
    )
    assert sorted(read_losses(tmp_path / "c.txt")) == list(range(stop + 1, 6))  # it went on from `stop`
    expected, whole_model = uninterrupted
    resumed = {**read_losses(tmp_path / "b.txt"), **read_losses(tmp_path / "c.txt")}
    assert sorted(resumed) == sorted(expected) == [1, 2, 3, 4, 5]
    assert resumed == expected  # exactly: same data order, noise and optimizer state
    # The exported weights are the EMA's: equal only if the EMA state was restored too.
    from safetensors.torch import load_file

    ours = load_file(parts / "model" / "unet" / "diffusion_pytorch_model.safetensors")
    theirs = load_file(whole_model / "unet" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_fork_resumes_another_runs_checkpoint_with_its_own_seed_and_the_soup_loads(
    data: Path, tmp_path: Path, uninterrupted: tuple[dict[int, float], Path]
) -> None:
    """benchmarks/kshapes_soup_device.sh: a fork goes on from the trunk's step with its own data order
    and noise, to the trunk's end; the mean of the two exported folders is a model folder that samples."""
    import importlib.util

    # Both runs take their frozen parts from one folder, as the device script's do (a preset's random
    # init would follow each run's seed).
    frozen = uninterrupted[1]
    record = "--trainer.callbacks+=tests.train.helpers.RecordLosses"

    def run(root: Path, *extra: str) -> dict[int, float]:
        unet_stage.cli_main(
            [
                *tiny_unet_args(data, root, 5),
                f"--model.vae={frozen / 'vae'}",
                f"--model.text_encoder={frozen}",
                record,
                f"--trainer.callbacks.path={root}.txt",
                *extra,
            ]
        )
        return read_losses(Path(f"{root}.txt"))

    trunk_losses = run(tmp_path / "trunk")
    seed = ["--seed_everything=7", "--model.seed=7", "--data.seed=7"]
    fork_ckpt = f"--ckpt_path={tmp_path / 'trunk' / 'checkpoints' / 'step=0000002.ckpt'}"
    losses = run(tmp_path / "fork", fork_ckpt, *seed)
    assert sorted(losses) == [3, 4, 5]  # on from the trunk's step 2 to the same end
    assert all(losses[step] != trunk_losses[step] for step in losses)  # its own draws
    spec = importlib.util.spec_from_file_location(
        "kshapes_soup", Path(__file__).parents[2] / "benchmarks" / "kshapes_soup.py"
    )
    soup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soup)
    trunk_model, fork_model = tmp_path / "trunk" / "model", tmp_path / "fork" / "model"
    averaged = soup.average_folders([trunk_model, fork_model], tmp_path / "soup")
    assert "unet/diffusion_pytorch_model.safetensors" in averaged
    assert "vae/diffusion_pytorch_model.safetensors" not in averaged  # frozen: the same bytes
    from safetensors.torch import load_file

    from rapiddiff.models.bundle import load_model_folder

    bundle = load_model_folder(tmp_path / "soup", device="cpu")
    a, b = (load_file(m / "unet" / "diffusion_pytorch_model.safetensors") for m in (trunk_model, fork_model))
    weight = bundle.unet.conv_in.weight.detach()
    assert torch.allclose(weight, (a["conv_in.weight"] + b["conv_in.weight"]) / 2)


@pytest.mark.parametrize(
    ("sync_every", "every", "kept"),
    [
        (1, 2, {"step=0000002.ckpt", "last.ckpt"}),
        # The flag is read at steps 2 and 5; the save at step 4 reads it first and is not written.
        (3, 2, {"step=0000002.ckpt", "last.ckpt"}),
        # Never read during the 6 steps: the end of the run reads it before the export.
        (10, 100, set()),
    ],
)
def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(
    data: Path, tmp_path: Path, sync_every: int, every: int, kept: set[str]
) -> None:
    root = tmp_path / "run"
    args = [
        *tiny_unet_args(data, root, 6),
        f"--checkpoint.every_n_train_steps={every}",
        f"--samples.every_n_steps={every}",
        f"--model.speed.sync_every={sync_every}",
        "--trainer.callbacks+=tests.train.helpers.PoisonWeights",
        "--trainer.callbacks.step=3",
    ]
    with pytest.raises(NonFiniteLossError, match="step 3"):
        unet_stage.cli_main(args)
    names = {p.name for p in (root / "checkpoints").glob("*.ckpt")}
    assert names == kept
    if not kept:
        assert not (root / "model").exists()
        return
    module = unet_stage.LatentDiffusion.load_from_checkpoint(root / "checkpoints" / "last.ckpt")
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert not (root / "model").exists()


def test_loss_falls_when_overfitting_one_batch(data: Path) -> None:
    from rapiddiff.train.data import ImageTextData

    module = unet_stage.LatentDiffusion(unet="tiny", vae="tiny", text_encoder="tiny", ema=None)
    dm = ImageTextData(str(data), image_size=16, batch_size=2, num_workers=0)
    dm.setup("fit")
    batch = next(iter(torch.utils.data.DataLoader(dm.train_set, batch_size=2)))
    optimizer = torch.optim.AdamW(module.trainable_parameters(), lr=2e-3)
    losses = []
    for _ in range(25):
        torch.manual_seed(0)  # the same noise, timesteps and dropout every step: a fixed target
        loss = module.training_step(batch, 0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"trainable": ["fusion"]}, "needs a knowledge store"),
        ({"trainable": ["vae"]}, "unknown part"),
        ({"text_encoder_lr": 1e-5}, "'text_encoder' in model.trainable"),
        ({"trainable": ["unet", "text_encoder"], "text_encoder_lr": 0.0}, "needs a value > 0"),
    ],
)
def test_bad_settings_raise_clear_errors(options: dict, match: str) -> None:
    kwargs = {"unet": "tiny", "vae": "tiny", "text_encoder": "tiny", **options}
    with pytest.raises(ValueError, match=match):
        unet_stage.LatentDiffusion(**kwargs)


def test_text_encoder_lr_gives_the_tower_its_own_rate_on_the_shared_schedule() -> None:
    import pytorch_lightning as pl

    module = unet_stage.LatentDiffusion(
        unet="tiny", vae="tiny", text_encoder="tiny", trainable=["unet", "text_encoder"], text_encoder_lr=1e-5,
        optim=unet_stage.OptimConfig(lr=2e-4, schedule="cosine", warmup_steps=2),
    )  # fmt: skip
    module.trainer = pl.Trainer(max_steps=10, logger=False)  # the schedule's length
    config = module.configure_optimizers()
    unet_group, tower_group = config["optimizer"].param_groups
    tower = set(map(id, module._part("text_encoder").parameters()))
    assert tower == set(map(id, tower_group["params"])) and not tower & set(map(id, unet_group["params"]))
    assert {id(p) for g in (unet_group, tower_group) for p in g["params"]} == set(
        map(id, module.trainable_parameters())
    )  # every trained parameter in exactly one group
    scheduler = config["lr_scheduler"]["scheduler"]
    for _ in range(5):
        config["optimizer"].step()
        scheduler.step()
    assert 0 < unet_group["lr"] < 2e-4  # past the warm-up, on the cosine's way down
    assert tower_group["lr"] == pytest.approx(unet_group["lr"] / 20)  # 1e-5 / 2e-4 all along


def test_loss_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="caption_dropout must be in"):
        unet_stage.DiffusionLoss(caption_dropout=1.5)


def test_missing_folder_names_what_was_expected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="expected a vae folder or a model folder"):
        unet_stage.LatentDiffusion(unet="tiny", vae=str(tmp_path), text_encoder="tiny")


def test_a_config_file_builds_a_fresh_unet_of_that_architecture(tmp_path: Path) -> None:
    import json

    from rapiddiff.models.presets import unet_config

    config = {**unet_config("tiny"), "block_out_channels": [32, 32]}
    (tmp_path / "unet.json").write_text(json.dumps(config), encoding="utf-8")
    module = unet_stage.LatentDiffusion(unet=str(tmp_path / "unet.json"), vae="tiny", text_encoder="tiny")
    assert list(module.unet.config.block_out_channels) == [32, 32]
    # built from the file, not the preset
    assert module.unet.down_blocks[1].resnets[0].conv1.out_channels == 32
    # diffusers would build a U-Net from a VAE's config.json, or ignore a misspelt key: both are refused
    vae_config = {"_class_name": "AutoencoderKL", "block_out_channels": [32, 32]}
    (tmp_path / "vae.json").write_text(json.dumps(vae_config), encoding="utf-8")
    with pytest.raises(ValueError, match="_class_name is AutoencoderKL; expected a UNet2DConditionModel"):
        unet_stage.LatentDiffusion(unet=str(tmp_path / "vae.json"), vae="tiny", text_encoder="tiny")
    (tmp_path / "typo.json").write_text(json.dumps({**config, "layers_per_blok": 2}), encoding="utf-8")
    with pytest.raises(ValueError, match="did you mean 'layers_per_block'"):
        unet_stage.LatentDiffusion(unet=str(tmp_path / "typo.json"), vae="tiny", text_encoder="tiny")
    (tmp_path / "weights.bin").write_bytes(b"\x00\xff not json")  # e.g. a weights file given by mistake
    with pytest.raises(ValueError, match=r"weights\.bin: not a U-Net config\.json"):
        unet_stage.LatentDiffusion(unet=str(tmp_path / "weights.bin"), vae="tiny", text_encoder="tiny")


def test_v_prediction_min_snr_and_noise_offset(data: Path) -> None:
    from rapiddiff.train.unet import DiffusionLoss

    loss_cfg = DiffusionLoss(prediction_type="v_prediction", snr_gamma=5.0, noise_offset=0.1)
    module = unet_stage.LatentDiffusion(unet="tiny", vae="tiny", text_encoder="tiny", loss=loss_cfg, ema=None)
    assert module.noise_scheduler.config.prediction_type == "v_prediction"
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    t = torch.tensor([10, 900])
    assert torch.equal(
        module.target(latents, noise, t), module.noise_scheduler.get_velocity(latents, noise, t)
    )
    # min-SNR: high-SNR (small t) errors are down-weighted relative to plain MSE.
    pred = torch.zeros_like(latents)
    plain = ((pred - noise) ** 2).mean(dim=(1, 2, 3))
    weighted = module.diffusion_loss(pred, noise, t)
    assert weighted < plain.mean()


def test_caption_dropout_and_latent_cache(data: Path) -> None:
    from rapiddiff.train.data import ImageTextData

    module = unet_stage.LatentDiffusion(unet="tiny", vae="tiny", text_encoder="tiny", ema=None)
    captions = ["一", "二", "三"]
    assert module.drop_captions(captions) != [""] * 3 or module.loss_cfg.caption_dropout == 1
    object.__setattr__(module, "loss_cfg", unet_stage.DiffusionLoss(caption_dropout=1.0))
    assert module.drop_captions(captions) == ["", "", ""]
    object.__setattr__(module, "loss_cfg", unet_stage.DiffusionLoss(caption_dropout=0.0))
    assert module.drop_captions(captions) == captions

    dm = ImageTextData(str(data), image_size=16, batch_size=2, num_workers=0)
    dm.setup("fit")
    loader = torch.utils.data.DataLoader(dm.train_set, batch_size=3)
    batch = next(iter(torch.utils.data.DataLoader(dm.train_set, batch_size=2, shuffle=True)))
    torch.manual_seed(1)
    direct = module.encode_images(batch)
    module._latents, module._filled = encode_dataset(module, loader)  # what cache_latents does at train start
    torch.manual_seed(1)
    cached = module.encode_images(batch)
    torch.testing.assert_close(cached, direct, rtol=1e-4, atol=1e-5)


def test_cached_latents_stop_image_decoding_and_tokens_are_memoised(data: Path, tmp_path: Path) -> None:
    from rapiddiff.train.data import ImageTextData

    module = unet_stage.LatentDiffusion(unet="tiny", vae="tiny", text_encoder="tiny", ema=None)
    dm = ImageTextData(str(data), image_size=16, batch_size=2, num_workers=0)
    dm.setup("fit")
    dataset = dm.train_set
    module._latents, module._filled = encode_dataset(
        module, torch.utils.data.DataLoader(dataset, batch_size=3)
    )
    dataset.decode_images = False  # what on_train_start does once the cache is filled
    item = dataset[1]
    assert "pixel_values" not in item and item["index"] == dataset.indices[1]
    batch = torch.utils.data.default_collate([dataset[0], dataset[1]])
    assert module.encode_images(batch).shape[0] == 2  # latents come from the cache alone

    captions = [dataset.texts[0], dataset.texts[1], dataset.texts[0], ""]
    expected = module.text_encoder.tokenize(captions)
    for _ in range(2):  # the second call is served from the memo
        got = module._tokenize(captions)
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key])

    # End to end: a run with cache_latents trains (its workers then skip decoding).
    unet_stage.cli_main([*tiny_unet_args(data, tmp_path / "run", max_steps=2), "--model.cache_latents=true"])
    assert (tmp_path / "run" / "model" / "unet").is_dir()


def test_knowledge_fusion_trains_with_the_unet_and_is_exported(data: Path, tmp_path: Path) -> None:
    from rapiddiff.kg.store import KnowledgeStore
    from rapiddiff.models.bundle import load_model_folder
    from rapiddiff.train.data import ImageTextData

    store = KnowledgeStore.from_arrays(
        ["番茄", "红色", "圆形"],
        ["颜色", "形状"],
        torch.randn(3, 8),
        torch.randn(2, 8),
        triples=[(0, 0, 1), (0, 1, 2)],
    )
    store.save(tmp_path / "kg")
    module = unet_stage.LatentDiffusion(
        unet="tiny",
        vae="tiny",
        text_encoder="tiny",
        knowledge=str(tmp_path / "kg"),
        trainable=["unet", "fusion"],
    )
    dm = ImageTextData(str(data), image_size=16, batch_size=2, num_workers=0)
    dm.setup("fit")
    batch = next(
        iter(torch.utils.data.DataLoader(dm.train_set, batch_size=4))
    )  # captions name 番茄, 红色, 圆形
    object.__setattr__(module, "loss_cfg", unet_stage.DiffusionLoss(caption_dropout=0.0))
    module.training_step(batch, 0).backward()
    gates = module.text_encoder.fusion.gates
    assert gates.grad is not None and gates.grad.abs().sum() > 0  # knowledge reaches the loss
    assert module.text_encoder.text_model.embeddings.word_embeddings.weight.grad is None  # tower frozen
    module.export(tmp_path / "model")
    bundle = load_model_folder(tmp_path / "model")
    assert bundle.text_encoder.store is not None and bundle.text_encoder.has_knowledge


def test_input_perturbation_moves_the_input_not_the_target() -> None:
    from rapiddiff.train.unet import DiffusionLoss

    module = unet_stage.LatentDiffusion(
        unet="tiny", vae="tiny", text_encoder="tiny", loss=DiffusionLoss(input_perturbation=0.5), ema=None
    )
    seen: dict[str, torch.Tensor] = {}
    add_noise, target = module.noise_scheduler.add_noise, module.target

    def recording_add_noise(latents, noise, timesteps):
        seen["input"] = noise
        return add_noise(latents, noise, timesteps)

    def recording_target(latents, noise, timesteps):
        seen["target"] = noise
        return target(latents, noise, timesteps)

    module.noise_scheduler.add_noise, module.target = recording_add_noise, recording_target
    torch.manual_seed(0)
    module.denoising_loss(torch.randn(4, 4, 8, 8), module.encode_text(["a", "b", "c", "d"]))
    extra = (seen["input"] - seen["target"]) / 0.5
    assert 0.9 < float(extra.std()) < 1.1  # noise + 0.5 * N(0, 1) in, the noise itself as the target
    with pytest.raises(ValueError, match="input_perturbation must be >= 0"):
        DiffusionLoss(input_perturbation=-0.1)


def test_no_sampling_prompts_means_no_grid() -> None:
    """`--model.sampling.prompts=[]` skips the grid; the tokenizer used to fail on an empty batch."""
    module = unet_stage.LatentDiffusion(
        unet="tiny", vae="tiny", text_encoder="tiny", ema=None, sampling=unet_stage.SamplingConfig(prompts=())
    )
    assert module.sample_images() is None

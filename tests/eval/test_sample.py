"""eval sample: deterministic names, an index, resuming, and refusing to mix experiments."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from rapiddiff.cli import main
from rapiddiff.eval.common import read_index
from rapiddiff.eval.sample import SampleSettings, generate, plan_jobs, read_prompts

PROMPTS = [
    {"text": "蓝色背景上有一个番茄", "entity": "番茄"},
    {"text": "米色背景上有一个香蕉", "entity": "香蕉"},
    {"text": "一个红色的圆形", "entity": None},
]


def _prompt_file(tmp_path, rows=PROMPTS):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _sample(model, prompts, out, *extra):
    return main(
        [
            "eval",
            "sample",
            "--model",
            str(model),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--steps",
            "2",
            "--images-per-prompt",
            "2",
            "--batch-size",
            "4",
            "--device",
            "cpu",
            *extra,
        ]
    )


def test_sample_writes_index_and_resumes(tmp_path, tiny_model):
    prompts, run = _prompt_file(tmp_path), tmp_path / "run"
    assert _sample(tiny_model, prompts, run) == 0
    index = read_index(run)
    assert [r["file"] for r in index] == [
        f"images/{i:06d}_s{i * 2 + j}.png" for i in range(3) for j in range(2)
    ]
    assert index[0]["prompt"] == PROMPTS[0]["text"] and index[0]["entity"] == "番茄" and index[3]["seed"] == 3
    info = json.loads((run / "sample.json").read_text())
    assert info["settings"]["steps"] == 2 and info["last_run"]["generated"] == 6
    assert info["model_config"]["unet"]["sample_size"] == 8  # the model's config is recorded

    first = np.asarray(Image.open(run / index[2]["file"]))
    (run / index[2]["file"]).unlink()
    assert _sample(tiny_model, prompts, run) == 0
    info = json.loads((run / "sample.json").read_text())
    assert info["last_run"] == {**info["last_run"], "generated": 1, "skipped_existing": 5}
    # The remade image is the same image: names, seeds and sampling are deterministic.
    np.testing.assert_array_equal(np.asarray(Image.open(run / index[2]["file"])), first)


def test_resuming_with_other_settings_or_prompts_is_refused(tmp_path, tiny_pipe, capsys, tiny_model):
    run = tmp_path / "run"
    settings = SampleSettings(model="tiny", steps=2)
    generate(tiny_pipe, plan_jobs(PROMPTS[:1], 1, 0), run, settings)
    with pytest.raises(ValueError, match=r"steps: 2 → 3"):
        generate(tiny_pipe, plan_jobs(PROMPTS[:1], 1, 0), run, SampleSettings(model="tiny", steps=3))
    with pytest.raises(ValueError, match="another prompt list"):
        generate(tiny_pipe, plan_jobs(PROMPTS[1:2], 1, 0), run, settings)
    # The CLI refuses before it loads the model, with the reason on stderr.
    assert _sample(tiny_model, _prompt_file(tmp_path, PROMPTS[:1]), run, "--guidance", "3") == 2
    assert "other settings" in capsys.readouterr().err


def test_read_prompts(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("一个番茄\n\n 一个香蕉 \n", encoding="utf-8")
    assert read_prompts(txt) == [{"text": "一个番茄"}, {"text": "一个香蕉"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"prompt": "b"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"record 2 has no string 'text'"):
        read_prompts(bad)


def test_fast_path_gives_the_eager_images(tiny_pipe, tiny_model):
    """The fast path (its CPU-safe switches, on its own pipeline) draws the same noise per seed as the eager one."""
    from rapiddiff.eval.sample import load_pipeline
    from rapiddiff.infer.accelerate import accelerate

    kw = dict(num_inference_steps=2, guidance_scale=7.5, scheduler="pndm", knowledge=True, upscale=False)
    eager = tiny_pipe(["一个番茄", "一个香蕉"], seed=[5, 6], progress=False, **kw)
    fast = accelerate(
        load_pipeline(tiny_model, device="cpu", dtype="float32"),
        dtype=None,
        compile_unet=None,
        compile_vae=None,
        loop="eager",
        attention="default",
        channels_last=False,
    )
    assert fast.fixed_batch  # eval keeps its batches full for the captured loops
    out = fast(["一个番茄", "一个香蕉"], seed=[5, 6], progress=False, **kw)
    for a, b in zip(out.images, eager.images, strict=True):
        np.testing.assert_allclose(np.asarray(a, float), np.asarray(b, float), atol=1)


def test_eval_sample_and_generate_make_the_same_png(tmp_path, tiny_model):
    """Same model, prompt and seed: `eval sample` and `generate` give the same pixels — both read the
    model's sampling defaults (here 3 dpm++ steps) and upscale with its upscaler."""
    from rapiddiff.models.bundle import load_model_folder, save_model_folder
    from rapiddiff.models.sampling import SamplingDefaults
    from rapiddiff.models.upscaler import build_rrdb

    bundle = load_model_folder(tiny_model)
    bundle.upscaler = build_rrdb(num_blocks=1, num_feat=8).eval()
    bundle.sampling = SamplingDefaults(num_inference_steps=3, guidance_scale=5.0, scheduler="dpm++")
    model = save_model_folder(bundle, tmp_path / "model")
    prompts = tmp_path / "p.txt"
    prompts.write_text("蓝色背景上有一个番茄\n", encoding="utf-8")
    assert main(["eval", "sample", "--model", str(model), "--prompts", str(prompts), "--seed", "5",
                 "--out", str(tmp_path / "run"), "--device", "cpu"]) == 0  # fmt: skip
    assert main(["generate", "蓝色背景上有一个番茄", "--model", str(model), "--seed", "5",
                 "--out", str(tmp_path / "gen"), "--device", "cpu", "--no-progress"]) == 0  # fmt: skip
    evaluated = np.asarray(Image.open(tmp_path / "run" / "images" / "000000_s5.png"))
    generated = np.asarray(Image.open(tmp_path / "gen" / "00001-5.png"))
    assert evaluated.shape == (64, 64, 3)  # upscaled ×4 from the model's 16²
    np.testing.assert_array_equal(evaluated, generated)
    info = json.loads((tmp_path / "run" / "sample.json").read_text(encoding="utf-8"))["settings"]
    assert (info["steps"], info["guidance"], info["scheduler"], info["upscale"]) == (3, 5.0, "dpm++", True)


def test_sample_from_dataset_captions_with_real_images(tmp_path, tiny_model):
    data = tmp_path / "data"
    data.mkdir()
    rows = []
    for i, colour in enumerate([(200, 30, 30), (30, 30, 200), (30, 200, 30)]):
        Image.new("RGB", (24, 24), colour).save(data / f"{i}.png")
        rows.append({"file_name": f"{i}.png", "text": f"第{i}张图"})
    (data / "metadata.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    run = tmp_path / "run"
    code = main(
        [
            "eval",
            "sample",
            "--model",
            str(tiny_model),
            "--dataset",
            str(data),
            "--limit",
            "2",
            "--save-real",
            "--steps",
            "2",
            "--out",
            str(run),
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    index = read_index(run)
    assert [r["prompt"] for r in index] == ["第0张图", "第1张图"]
    real = sorted((run / "real").glob("*.png"))
    assert len(real) == 2 and Image.open(real[1]).size == (16, 16)  # the model's size: 8² latents, 2× VAE
    assert np.asarray(Image.open(real[1]))[8, 8, 2] > 150  # the second (blue) image, in order

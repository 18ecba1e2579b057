"""``rapiddiff generate`` with ControlNets end to end on a tiny model folder, and the PNG round trip
(``--from-png`` remakes a controlled image, and says what it needs when the control image is gone)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rapiddiff.cli import main
from rapiddiff.infer.png import read_png_metadata
from tests.infer.test_controlnet import write_tiny_controlnet

FAST = ["--steps", "2", "--device", "cpu", "--no-progress", "--seed", "3"]


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("cn-cli")
    nets = [write_tiny_controlnet(root / f"net{k}", tiny_model / "unet", seed=k) for k in range(2)]
    rng = np.random.default_rng(2)
    images = []
    for k in range(2):
        images.append(root / f"c{k}.png")
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(images[-1])
    return {"model": str(tiny_model), "nets": [str(n) for n in nets], "images": [str(i) for i in images]}


def _pngs(folder):
    return sorted(p for p in folder.glob("*.png") if "grid" not in p.name)


def _pixels(path):
    return np.asarray(Image.open(path).convert("RGB"))


def test_generate_with_two_nets_and_remake_from_png(setup, tmp_path):
    nets, images = setup["nets"], setup["images"]
    out = tmp_path / "a"
    args = ["generate", "熊猫", "--model", setup["model"], "--out", str(out), *FAST]
    control = ["--controlnet", nets[0], "--control-image", images[0], "--controlnet", nets[1]]
    control += ["--control-image", images[1], "--control-scale", "0.5", "1.5", "--control-end", "0.5", "1"]
    assert main([*args, *control]) == 0
    (first,) = _pngs(out)
    meta = read_png_metadata(first)["control"]
    assert [c["controlnet"] for c in meta] == [
        str(tmp.resolve()) for tmp in map(__import__("pathlib").Path, nets)
    ]
    assert [(c["scale"], c["start"], c["end"]) for c in meta] == [(0.5, 0.0, 0.5), (1.5, 0.0, 1.0)]
    assert [c["image"] for c in meta] == [str(Path(i).resolve()) for i in images]

    # No control: another image.
    assert main([*args[:4], "--out", str(tmp_path / "plain"), *FAST]) == 0
    assert not np.array_equal(_pixels(_pngs(tmp_path / "plain")[0]), _pixels(first))

    # --from-png finds the nets and the control images it names: the same image again.
    again = tmp_path / "b"
    assert main(["generate", "--from-png", str(first), "--out", str(again), "--no-progress"]) == 0
    np.testing.assert_array_equal(_pixels(_pngs(again)[0]), _pixels(first))


def test_from_png_says_it_needs_the_control_image(setup, tmp_path, capsys):
    image = tmp_path / "edge.png"
    shutil.copy(setup["images"][0], image)
    out = tmp_path / "a"
    args = ["--controlnet", setup["nets"][0], "--control-image", str(image)]
    assert main(["generate", "熊猫", "--model", setup["model"], "--out", str(out), *FAST, *args]) == 0
    (first,) = _pngs(out)
    image.unlink()
    capsys.readouterr()
    assert main(["generate", "--from-png", str(first), "--out", str(tmp_path / "b"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "control image" in err and "--control-image" in err
    # Given again (a copy), the image is remade.
    shutil.copy(setup["images"][0], tmp_path / "copy.png")
    remade = tmp_path / "c"
    assert main(["generate", "--from-png", str(first), "--control-image", str(tmp_path / "copy.png"),
                 "--out", str(remade), "--no-progress"]) == 0  # fmt: skip
    np.testing.assert_array_equal(_pixels(_pngs(remade)[0]), _pixels(first))


BAD = {
    "no net": (lambda s, t: ["--control-image", s["images"][0]], "has no ControlNet"),
    "missing net": (
        lambda s, t: ["--controlnet", str(t / "none"), "--control-image", s["images"][0]],
        "not found",
    ),
    "net without image": (lambda s, t: ["--controlnet", s["nets"][0]], "--controlnet needs --control-image"),
    "scale without image": (lambda s, t: ["--control-scale", "0.5"], "--control-scale needs --control-image"),
    "two images, one net": (
        lambda s, t: ["--controlnet", s["nets"][0], *["--control-image", s["images"][0]] * 2],
        "one control image per ControlNet",
    ),
    "three scales, one net": (
        lambda s, t: [
            "--controlnet",
            s["nets"][0],
            "--control-image",
            s["images"][0],
            "--control-scale",
            "1",
            "2",
            "3",
        ],
        "give one, or one per net",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_control_flags_are_clear_errors(setup, tmp_path, capsys, case):
    make, message = BAD[case]
    assert (
        main(
            [
                "generate",
                "x",
                "--model",
                setup["model"],
                "--out",
                str(tmp_path),
                *FAST,
                *make(setup, tmp_path),
            ]
        )
        == 2
    )
    assert message in capsys.readouterr().err


def test_help_documents_the_pairing(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert "--controlnet" in text and "--control-image" in text and "k-th --control-image" in text

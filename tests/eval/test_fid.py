"""FID: the statistics against closed forms and torchmetrics; the weights gate before any image."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rapiddiff.cli import main
from rapiddiff.eval import inception
from rapiddiff.eval.fid import callable_extractor, compute_fid, feature_statistics, fid_from_features


def _closed_form(mu1, s1, mu2, s2) -> float:
    # pytorch-fid's formula with scipy.linalg.sqrtm: an independent route to the same number.
    from scipy import linalg

    covmean = linalg.sqrtm(s1 @ s2)
    covmean = covmean.real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def _gaussians(seed: int = 0, n: int = 400, d: int = 16):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, d)) @ rng.normal(size=(d, d)) * 0.5
    b = rng.normal(loc=0.3, size=(n, d)) @ rng.normal(size=(d, d)) * 0.7 + 1.0
    return a, b


def test_fid_matches_scipy_closed_form_and_torchmetrics():
    from torchmetrics.image.fid import FrechetInceptionDistance

    real, fake = _gaussians()
    ours = fid_from_features(real, fake)
    mu1, s1 = np.mean(real, 0), np.cov(real, rowvar=False)
    mu2, s2 = np.mean(fake, 0), np.cov(fake, rowvar=False)
    assert ours == pytest.approx(_closed_form(mu1, s1, mu2, s2), rel=1e-6)

    class Identity(torch.nn.Module):
        num_features = real.shape[1]

        def forward(self, x):
            return x

    metric = FrechetInceptionDistance(feature=Identity())
    metric.update(torch.from_numpy(real), real=True)
    metric.update(torch.from_numpy(fake), real=False)
    assert ours == pytest.approx(float(metric.compute()), rel=1e-6)
    assert ours > 1.0  # the two sets really differ


def test_fid_of_identical_sets_is_zero_and_statistics_are_float64():
    real, _ = _gaussians(1)
    mu, sigma = feature_statistics(real.astype(np.float32))
    assert mu.dtype == np.float64 and sigma.dtype == np.float64
    assert abs(fid_from_features(real, real)) < 1e-8


def _write_images(folder: Path, n: int, seed: int, size: int = 16) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / f"{i:03d}.png")


def test_compute_fid_on_folders_with_a_pluggable_extractor(tmp_path):
    _write_images(tmp_path / "a", 6, 0)
    _write_images(tmp_path / "b", 6, 1)

    # Mean colour + brightness spread: a cheap, deterministic images → features callable.
    def fn(x):
        x = x.double()
        return torch.cat([x.mean((2, 3)), x.std((2, 3))], 1)

    ext = callable_extractor(fn, "toy")
    same = compute_fid(tmp_path / "a", tmp_path / "a", ext, batch_size=4)
    other = compute_fid(tmp_path / "a", tmp_path / "b", ext, batch_size=4)
    assert abs(same["value"]) < 1e-8 and other["value"] > 0
    assert other["label"] == "FID-toy"  # never plain "FID" for a non-standard extractor
    assert other["details"]["n_real"] == 6 and "eigenvalue" in other["details"]["statistics"]
    assert other["warnings"] and "2048" in other["warnings"][0]


def test_constants_match_torch_fidelity():
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    assert inception.INCEPTION_URL == URL_INCEPTION_V3
    assert URL_INCEPTION_V3.endswith(inception.INCEPTION_FILE)
    # torch hub's naming convention: the suffix is the first hex digits of the file's SHA-256.
    suffix = inception.INCEPTION_FILE.rsplit("-", 1)[1].split(".")[0]
    assert inception.INCEPTION_SHA256.startswith(suffix)


def test_missing_weights_fail_before_any_image_is_read(tmp_path, monkeypatch):
    monkeypatch.delenv(inception.WEIGHTS_ENV, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    for name in ("real", "fake"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "broken.png").write_bytes(b"not a png at all")  # would crash if decoded
    with pytest.raises(inception.MissingInceptionWeightsError) as err:
        inception.resolve_inception_weights(None)
    message = str(err.value)
    for needle in (
        inception.INCEPTION_FILE,
        inception.INCEPTION_URL,
        inception.INCEPTION_SHA256,
        "--inception-weights",
        inception.WEIGHTS_ENV,
    ):
        assert needle in message
    # The command: exit 2 with that message, and not one image opened.
    import rapiddiff.eval.common as common

    opened = []
    monkeypatch.setattr(common, "open_rgb", lambda path: opened.append(path))
    code = main(["eval", "fid", "--real", str(tmp_path / "real"), "--fake", str(tmp_path / "fake")])
    assert code == 2 and opened == []


def test_missing_weights_message_reaches_the_user(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(inception.WEIGHTS_ENV, str(tmp_path / "nowhere.pth"))
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "x.png").write_bytes(b"garbage")
    assert main(["eval", "fid", "--real", str(tmp_path / "r"), "--fake", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert inception.INCEPTION_SHA256 in err and "nowhere.pth" in err and "not a readable image" not in err


@pytest.fixture(scope="module")
def random_weights(tmp_path_factory):
    """A file in the real format (torch-fidelity's state dict), random values; (path, sha256)."""
    import torch_fidelity.feature_extractor_inceptionv3 as fe

    with pytest.MonkeyPatch.context() as m:
        m.setattr(fe.FeatureExtractorInceptionV3, "load_state_dict", lambda self, sd: None)
        m.setattr(fe, "load_state_dict_from_url", lambda *a, **k: {})
        model = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    path = tmp_path_factory.mktemp("inception") / inception.INCEPTION_FILE
    torch.save(model.state_dict(), path)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def test_inception_path_end_to_end_with_verified_weights(random_weights):
    weights, digest = random_weights
    with pytest.raises(ValueError, match="sha256"):
        inception.load_inception(weights)  # the random file is not the published one
    model = inception.load_inception(weights, expected_sha256=digest)
    feats = model(torch.randint(0, 256, (2, 3, 24, 24), dtype=torch.uint8))[0]
    assert feats.shape == (2, 2048)


def test_weights_that_need_unpickling_are_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pth"
    torch.save({"x": Evil()}, path)
    from rapiddiff.utils.io import UnsafeCheckpointError

    with pytest.raises(UnsafeCheckpointError):
        inception.load_inception(path, expected_sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def test_fid_command_writes_labelled_json(tmp_path, monkeypatch, random_weights):
    """The CLI path with the InceptionV3 network (random weights, sha256 of that file patched in)."""
    import rapiddiff.eval.inception as inc

    weights, digest = random_weights
    monkeypatch.setattr(inc, "INCEPTION_SHA256", digest)
    _write_images(tmp_path / "real", 2, 0, size=20)
    _write_images(tmp_path / "fake", 2, 1, size=20)
    out = tmp_path / "fid.json"
    code = main(
        [
            "eval",
            "fid",
            "--real",
            str(tmp_path / "real"),
            "--fake",
            str(tmp_path / "fake"),
            "--inception-weights",
            str(weights),
            "--out",
            str(out),
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    record = json.loads(out.read_text())
    assert record["label"] == "FID" and record["value"] > 0
    assert "torch-fidelity" in record["details"]["library"] and "299" in record["details"]["resize"]
    assert record["details"]["n_fake"] == 2 and record["warnings"]

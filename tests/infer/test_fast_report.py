"""The typed fast-path report: each switch's status as code reads it and as people read it."""

from __future__ import annotations

import json

import pytest

from rapiddiff.infer.fast_report import OFF, FastPathReport, SwitchStatus, fallback


def test_status_renders_the_lines_people_read():
    assert str(SwitchStatus("on")) == "on"
    assert str(SwitchStatus("on", reason="12 attention layers")) == "on (12 attention layers)"
    assert str(SwitchStatus("on", "float16")) == "float16"
    assert str(SwitchStatus("off", reason="kept torch.float32")) == "off (kept torch.float32)"
    assert str(fallback("no CUDA here", "resident")) == "fallback: resident (no CUDA here)"
    assert str(fallback("merge the LoRA first")) == "fallback: merge the LoRA first"
    with pytest.raises(ValueError, match="on, off or fallback"):
        SwitchStatus("maybe")  # type: ignore[arg-type]


def test_report_keeps_the_typed_status_behind_each_line(caplog):
    report = FastPathReport()
    report.set("fuse_qkv", SwitchStatus("on", reason="4 attention layers"))
    report.set("loop", fallback("CUDA graphs need a CUDA device", "resident"))
    assert report.is_on("fuse_qkv") and not report.is_on("loop")
    assert report.status("loop").state == "fallback" and report.status("loop").value == "resident"
    assert report.status("never_reported") == OFF  # an unknown switch reads as off, never as on
    assert json.loads(json.dumps(report)) == {
        "fuse_qkv": "on (4 attention layers)",
        "loop": "fallback: resident (CUDA graphs need a CUDA device)",
    }
    assert (
        report.line()
        == "fuse_qkv: on (4 attention layers); loop: fallback: resident (CUDA graphs need a CUDA device)"
    )
    assert any("loop → fallback" in r.getMessage() for r in caplog.records)  # fallbacks are logged

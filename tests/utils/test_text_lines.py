"""Prompt files in the encodings Chinese users save them in (issue 15, item 7): UTF-8 with or
without a BOM, UTF-16 with a BOM, GB18030/GBK read when it is unambiguously Chinese text, and
anything else refused with the file, the line and the fix."""

from __future__ import annotations

import pytest

from rapiddiff.utils.io import TextEncodingError, decode_text, read_text_lines

PROMPTS = ["一只熊猫在竹林里吃竹子", "", "长城上的日出，水墨画风格", "a photo of 达·芬奇的《蒙娜丽莎》"]
EXPECTED = [(1, PROMPTS[0]), (3, PROMPTS[2]), (4, PROMPTS[3])]


@pytest.mark.parametrize(
    "encoding,prefix",
    [
        ("utf-8", b""),
        ("utf-8", b"\xef\xbb\xbf"),  # Notepad's "UTF-8 with BOM"
        ("utf-16-le", b"\xff\xfe"),  # Notepad's "Unicode"
        ("gb18030", b""),
        ("gbk", b""),  # GBK is a subset of GB18030
    ],
)
def test_prompt_files_in_common_encodings_read_the_same(tmp_path, encoding, prefix):
    path = tmp_path / "prompts.txt"
    path.write_bytes(prefix + ("\r\n".join(PROMPTS) + "\r\n").encode(encoding))
    assert read_text_lines(path) == EXPECTED


def test_latin1_is_refused_with_file_line_and_fix(tmp_path):
    path = tmp_path / "prompts.txt"
    # cp1252 bytes decode under GB18030 only by accident, and not to Chinese text.
    path.write_bytes("a cat\nun café crème\n".encode("cp1252"))
    with pytest.raises(TextEncodingError) as info:
        read_text_lines(path)
    message = str(info.value)
    assert f"{path}:2:" in message
    assert "not valid UTF-8 (byte b'\\xe9' at column 7)" in message
    assert "iconv -f" in message and "UTF-8" in message


def test_gb18030_that_does_not_decode_names_the_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes("熊猫\n".encode() + "竹林".encode("gb18030") + b"\x81\n")  # a cut double byte
    with pytest.raises(TextEncodingError, match=r"prompts\.txt:2: not valid UTF-8"):
        read_text_lines(path)


def test_decode_text_reports_the_encoding_and_prefers_utf8():
    assert decode_text("水墨画".encode("gb18030"), "x.txt") == ("水墨画", "gb18030")
    assert decode_text("水墨画".encode(), "x.txt") == ("水墨画", "utf-8")
    # These GB18030 bytes of 水墨 are also valid UTF-8 (ˮī): UTF-8 wins, as the rule says.
    assert decode_text("水墨".encode("gb18030"), "x.txt") == ("ˮī", "utf-8")


def test_sample_reads_gbk_prompts_and_jsonl(tmp_path):
    from rapiddiff.eval.sample import read_prompts

    plain = tmp_path / "prompts.txt"
    plain.write_bytes("\n".join(PROMPTS).encode("gbk"))
    assert [row["text"] for row in read_prompts(plain)] == [text for _, text in EXPECTED]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_bytes('{"text": "长城"}\n\n{"text": "熊猫"}\n'.encode("gb18030"))
    assert [row["text"] for row in read_prompts(jsonl)] == ["长城", "熊猫"]
    jsonl.write_bytes('{"text": "长城"}\n\n{"text": 熊猫}\n'.encode())
    with pytest.raises(ValueError, match=r"prompts\.jsonl:3: not valid JSON"):
        read_prompts(jsonl)


@pytest.mark.parametrize("command", ["generate", "eval sample"])
def test_cli_names_file_and_line_of_a_prompt_file_in_another_encoding(tmp_path, capsys, command):
    from rapiddiff.cli import main

    bad = tmp_path / "prompts.txt"
    bad.write_bytes("熊猫\n".encode() + "crème brûlée\n".encode("cp1252"))
    args = [*command.split(), "--prompts", str(bad), "--out", str(tmp_path / "out")]
    (tmp_path / "model").mkdir()  # empty: the prompt file is read first and is the error
    args += ["--model", str(tmp_path / "model")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: not valid UTF-8" in err
    assert "utf-8' codec can't decode" not in err


def test_generate_reads_a_gb18030_prompt_file(tmp_path, capsys):
    from rapiddiff.cli import main

    good = tmp_path / "prompts.txt"
    good.write_bytes("\n".join(PROMPTS).encode("gb18030"))
    # The prompts are read before the model: a missing model is the first error, not the encoding.
    assert main(["generate", "--prompts", str(good), "--model", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "error: model folder not found" in err
    assert "not valid UTF-8" not in err and "codec" not in err

"""The `rapiddiff` command: a mistyped subcommand or choice gets a "did you mean"."""

from __future__ import annotations

import pytest

from rapiddiff.cli import main


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["generte", "x"], "invalid choice: 'generte' (did you mean 'generate'?)"),
        (["kg", "trian"], "invalid choice: 'trian' (did you mean 'train'?)"),
        (["train", "unte"], "invalid choice: 'unte' (did you mean 'unet'?)"),
        (["generate", "x", "--knowledge", "bth"], "invalid choice: 'bth' (did you mean 'both'?)"),
    ],
)
def test_a_mistyped_choice_gets_a_suggestion(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert hint in capsys.readouterr().err


def test_no_suggestion_where_nothing_is_close(capsys):
    with pytest.raises(SystemExit):
        main(["zzzz"])
    err = capsys.readouterr().err
    assert "invalid choice: 'zzzz'; choose from 'kg'" in err and "did you mean" not in err

"""Every example prompt a user is shown (README.md, every ``--help`` text, the web page's default)
must be one the built-in model it is meant for draws right: the model an example names
(``--model builtin:NAME``, ``"model": "builtin:NAME"``), else the default built-in model. Its words
are that model's vocabulary, on a background it knows; a kshapes image shows the object in the
colour and shape its KG gives (read by the kshapes detector; other built-in models have no
deterministic detector, so only their vocabulary is checked here).

The README is read as it is, so whatever it says is guarded.
"""

from __future__ import annotations

import argparse
import re
from functools import cache
from pathlib import Path

import pytest

from rapiddiff.cli import build_parser
from rapiddiff.data.kshapes.palette import BACKGROUNDS, COLOURS, SHAPES
from rapiddiff.models.builtin import builtin_model_dir, default_builtin

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "rapiddiff" / "serve" / "page" / "index.html"
# `rapiddiff generate "PROMPT" [flags]` on one line, and a JSON body with "prompt": "PROMPT" (the
# curl examples); the model each names, if any.
COMMAND = re.compile(r'rapiddiff generate "([^"]+)"([^\n]*)')
BODY = re.compile(r'\{[^{}]*"prompt":\s*"([^"]+)"[^{}]*\}')
NAMED = re.compile(r'(?:--model\s+|"model":\s*")builtin:(\w+)')
SEEDS = (7, 8)  # the README's seed and the next one


def _prompts_in(text: str) -> set[tuple[str, str]]:
    """(prompt, built-in model name) of every example in ``text``: the one it names, else the default."""
    found = set()
    for match in [*COMMAND.finditer(text), *BODY.finditer(text)]:
        named = NAMED.search(match.group(0))
        found.add((match.group(1), named.group(1) if named else default_builtin()))
    return found


def _help_texts(parser: argparse.ArgumentParser, name: str = "rapiddiff") -> dict[str, str]:
    """``--help`` of the parser and of every subcommand under it, by command line."""
    texts = {name: parser.format_help()}
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                texts.update(_help_texts(sub, f"{name} {sub_name}"))
    return texts


def _page_default() -> str:
    match = re.search(r'<textarea id="prompt"[^>]*>([^<]*)</textarea>', PAGE.read_text("utf-8"))
    assert match, f"{PAGE}: no <textarea id=prompt>"
    return match.group(1).strip()


@cache
def example_prompts() -> dict[tuple[str, str], set[str]]:
    """(prompt, the built-in model it is meant for) → where it is shown."""
    found: dict[tuple[str, str], set[str]] = {}
    sources = {"README.md": (ROOT / "README.md").read_text("utf-8")}
    sources.update({f"`{cmd} --help`": text for cmd, text in _help_texts(build_parser()).items()})
    for where, text in sources.items():
        for example in _prompts_in(text):
            found.setdefault(example, set()).add(where)
    # the page shows the served model's, and `rapiddiff serve` serves the default one
    found.setdefault((_page_default(), default_builtin()), set()).add(str(PAGE.relative_to(ROOT)))
    return found


def test_the_examples_are_found():
    """The collector sees the places examples live (a regex gone blind would pass everything)."""
    places = set().union(*example_prompts().values())
    assert {"README.md", "`rapiddiff generate --help`", "`rapiddiff serve --help`"} <= places
    assert any("rapiddiff/serve/page" in p for p in places)
    assert ("一只熊猫", "kshapes") in example_prompts()  # `--model builtin:kshapes` in generate's --help


def test_examples_are_matched_to_the_model_they_name():
    text = (
        'rapiddiff generate "一只熊猫" --model builtin:kshapes --seed 7\n'
        'rapiddiff generate "一个苹果"\n'
        """-d '{"prompt": "香蕉", "model": "builtin:emoji", "n": 1}'"""
    )
    assert _prompts_in(text) == {("一只熊猫", "kshapes"), ("一个苹果", default_builtin()), ("香蕉", "emoji")}


@cache
def _store(model: str):
    from rapiddiff.kg.linker import EntityLinker
    from rapiddiff.kg.store import KnowledgeStore

    path = builtin_model_dir(model) / "knowledge" / "store"
    if not path.is_dir():
        pytest.fail(f"the built-in model builtin:{model}'s knowledge store is missing: {path}")
    store = KnowledgeStore.load(path)
    return store, EntityLinker.from_store(store)


def _fact(store, name: str, relation: str) -> str | None:
    rel = store.relation_names.index(relation)
    tails = [store.entity_names[t] for r, t in store.facts(store.id_of(name)) if r == rel]
    return tails[0] if tails else None


def expected_attributes(prompt: str, model: str) -> dict[str, str]:
    """What built-in model ``model`` must draw for ``prompt``: the background it names, and (kshapes)
    the object's colour and shape, named in the prompt, else the object's KG facts. Fails where a
    word is no part of the model's vocabulary."""
    store, linker = _store(model)
    names = [store.entity_names[span.entity_id] for span in linker.link(prompt)]
    want: dict[str, str] = {}
    if "背景" in prompt:
        background = prompt.split("背景")[0].strip()
        assert background in BACKGROUNDS, (
            f"{prompt!r}: {background!r} is no background of builtin:{model} (it knows "
            f"{', '.join(BACKGROUNDS)}), so it is read as something else, e.g. the object's colour"
        )
        assert background in names, f"{prompt!r}: the linker does not link the background {background!r}"
        want["background"] = background
        names.remove(background)
    objects = [n for n in names if n not in COLOURS and n not in SHAPES]
    assert len(objects) <= 1, f"{prompt!r}: more than one object ({objects}); the examples draw one"
    if model != "kshapes":  # the object must be one of its entities; what it looks like, no detector reads
        assert objects, f"{prompt!r}: no entity of builtin:{model} in it ({names})"
        return want
    for key, vocabulary, relation in (("colour", COLOURS, "颜色"), ("shape", SHAPES, "形状")):
        named = [n for n in names if n in vocabulary]
        value = named[0] if named else (_fact(store, objects[0], relation) if objects else None)
        assert value is not None, f"{prompt!r}: no {relation} named and no object whose KG gives it ({names})"
        want[key] = value
    return want


@pytest.mark.parametrize(("prompt", "model"), sorted(example_prompts()))
def test_example_prompt_words_are_the_models(prompt, model):
    expected_attributes(prompt, model)


@pytest.fixture(scope="module")
def pipe():
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    return RapidDiffusionPipeline.from_pretrained(builtin_model_dir("kshapes"), device="cpu")


def test_example_prompts_are_drawn_right(pipe):
    """Each kshapes example, with the model's own sampling settings (as `rapiddiff generate` runs it,
    no upscaling), at two seeds (about 10 s on a CPU): the detector reads what the prompt and the KG say."""
    from rapiddiff.data.kshapes import detect_attributes

    prompts = sorted(p for p, model in example_prompts() if model == "kshapes")
    # generate --help always shows one (`--model builtin:kshapes`): none means the examples lost it
    assert prompts, "no example is meant for builtin:kshapes: the detector check would test nothing"
    wants = [expected_attributes(p, "kshapes") for p in prompts]
    out = pipe([p for p in prompts for _ in SEEDS], seed=[s for _ in prompts for s in SEEDS], progress=False)
    wrong = []
    for k, image in enumerate(out.images):
        prompt, want = prompts[k // len(SEEDS)], wants[k // len(SEEDS)]
        got = detect_attributes(image)
        if any(got[key] != value for key, value in want.items()):
            where = ", ".join(sorted(example_prompts()[prompt, "kshapes"]))
            wrong.append(
                f"{prompt!r} (in {where}), seed {out.seeds[k]}: want {want}, drawn {got['colour']} "
                f"{got['shape']} on {got['background']}"
            )
    assert not wrong, "example prompts the built-in model draws wrong:\n" + "\n".join(wrong)

"""Every example prompt a user is shown (README.md, every ``--help`` text, the web page's default)
must be one the built-in model draws right: its words are the model's vocabulary, and the image
shows the object in the colour and shape its KG gives, on the background it names.

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
from rapiddiff.infer.generate_cli import default_model_dir

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "rapiddiff" / "serve" / "page" / "index.html"
# `rapiddiff generate "PROMPT"` and a JSON body's "prompt": "PROMPT" (the curl examples).
PATTERNS = (r'rapiddiff generate "([^"]+)"', r'"prompt":\s*"([^"]+)"')
SEEDS = (7, 8)  # the README's seed and the next one


def _prompts_in(text: str) -> set[str]:
    return {m for pattern in PATTERNS for m in re.findall(pattern, text)}


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
def example_prompts() -> dict[str, set[str]]:
    """prompt → where it is shown."""
    found: dict[str, set[str]] = {}
    sources = {"README.md": (ROOT / "README.md").read_text("utf-8")}
    sources.update({f"`{cmd} --help`": text for cmd, text in _help_texts(build_parser()).items()})
    for where, text in sources.items():
        for prompt in _prompts_in(text):
            found.setdefault(prompt, set()).add(where)
    found.setdefault(_page_default(), set()).add(str(PAGE.relative_to(ROOT)))
    return found


def test_the_examples_are_found():
    """The collector sees the places examples live (a regex gone blind would pass everything)."""
    places = set().union(*example_prompts().values())
    assert {"README.md", "`rapiddiff generate --help`", "`rapiddiff serve --help`"} <= places
    assert any("rapiddiff/serve/page" in p for p in places)


@cache
def _store():
    from rapiddiff.kg.linker import EntityLinker
    from rapiddiff.kg.store import KnowledgeStore

    path = default_model_dir() / "knowledge" / "store"
    if not path.is_dir():
        pytest.fail(f"the built-in model's knowledge store is missing: {path}")
    store = KnowledgeStore.load(path)
    return store, EntityLinker.from_store(store)


def _fact(store, name: str, relation: str) -> str | None:
    rel = store.relation_names.index(relation)
    tails = [store.entity_names[t] for r, t in store.facts(store.id_of(name)) if r == rel]
    return tails[0] if tails else None


def expected_attributes(prompt: str) -> dict[str, str]:
    """What the built-in model must draw for ``prompt``: the background it names, and the object's
    colour and shape (named in the prompt, else the object's KG facts). Fails where a word is no
    part of the model's vocabulary."""
    store, linker = _store()
    names = [store.entity_names[span.entity_id] for span in linker.link(prompt)]
    want: dict[str, str] = {}
    if "背景" in prompt:
        background = prompt.split("背景")[0].strip()
        assert background in BACKGROUNDS, (
            f"{prompt!r}: {background!r} is no background of the built-in model (it knows "
            f"{', '.join(BACKGROUNDS)}), so it is read as something else, e.g. the object's colour"
        )
        assert background in names, f"{prompt!r}: the linker does not link the background {background!r}"
        want["background"] = background
        names.remove(background)
    objects = [n for n in names if n not in COLOURS and n not in SHAPES]
    assert len(objects) <= 1, f"{prompt!r}: more than one object ({objects}); the examples draw one"
    for key, vocabulary, relation in (("colour", COLOURS, "颜色"), ("shape", SHAPES, "形状")):
        named = [n for n in names if n in vocabulary]
        value = named[0] if named else (_fact(store, objects[0], relation) if objects else None)
        assert value is not None, f"{prompt!r}: no {relation} named and no object whose KG gives it ({names})"
        want[key] = value
    return want


@pytest.mark.parametrize("prompt", sorted(example_prompts()))
def test_example_prompt_words_are_the_models(prompt):
    expected_attributes(prompt)


@pytest.fixture(scope="module")
def pipe():
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    return RapidDiffusionPipeline.from_pretrained(default_model_dir(), device="cpu")


def test_example_prompts_are_drawn_right(pipe):
    """Each example, with the model's own sampling settings (as `rapiddiff generate` runs it, no
    upscaling), at two seeds (about 10 s on a CPU): the detector reads what the prompt and the KG say."""
    from rapiddiff.data.kshapes import detect_attributes

    prompts = sorted(example_prompts())
    wants = [expected_attributes(p) for p in prompts]
    out = pipe([p for p in prompts for _ in SEEDS], seed=[s for _ in prompts for s in SEEDS], progress=False)
    wrong = []
    for k, image in enumerate(out.images):
        prompt, want = prompts[k // len(SEEDS)], wants[k // len(SEEDS)]
        got = detect_attributes(image)
        if any(got[key] != value for key, value in want.items()):
            where = ", ".join(sorted(example_prompts()[prompt]))
            wrong.append(
                f"{prompt!r} (in {where}), seed {out.seeds[k]}: want {want}, drawn {got['colour']} "
                f"{got['shape']} on {got['background']}"
            )
    assert not wrong, "example prompts the built-in model draws wrong:\n" + "\n".join(wrong)

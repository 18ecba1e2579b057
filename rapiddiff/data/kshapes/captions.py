"""Chinese caption templates for kshapes: name the attributes, or only the entity."""

from __future__ import annotations

# {bg}: background name, {pos}: position word, {c}: colour, {s}: shape, {e}: entity (or alias).
ATTRIBUTE_TEMPLATES: tuple[str, ...] = (
    "{bg}背景上有一个{c}的{s}",
    "{pos}有一个{c}{s}",
    "{bg}背景的{pos}有一个{c}的{s}",
    "一个{c}的{s}在{bg}背景的{pos}",
    "{c}{s}，{bg}背景",
    "画面{pos}是一个{c}的{s}",
)
ENTITY_TEMPLATES: tuple[str, ...] = (
    "{bg}背景上有一个{e}",
    "{pos}有一个{e}",
    "{bg}背景的{pos}有一个{e}",
    "一个{e}在{bg}背景的{pos}",
    "{e}，{bg}背景",
    "画面{pos}是一个{e}",
)
# Evaluation prompts name background and position, so every attribute of the image is asked for.
PROMPT_TEMPLATES: tuple[str, ...] = ("{bg}背景上有一个{e}", "{bg}背景的{pos}有一个{e}")
# Attribute-caption evaluation (prompts_attribute.jsonl, split "attribute"): the training attribute
# templates that name all four of colour, shape, background and position, so an image is right only
# when all four are — the base generator's own test, with no entity and no knowledge needed.
ATTRIBUTE_PROMPT_TEMPLATES: tuple[str, ...] = (
    "{bg}背景的{pos}有一个{c}的{s}",
    "一个{c}的{s}在{bg}背景的{pos}",
)

# Robustness set (prompts_robust.jsonl): sentence shapes that no training caption uses — kept out
# of training on purpose (tests/data/test_kshapes.py checks that every one of them has wording no
# training template has). Each names the entity, the background and, where it has {pos}, the
# position. Variants: "sentence" (the entity's name), "alias" (an alias), "traditional" (the
# whole prompt in traditional characters, OpenCC s2t), "distractor" (a second, different entity
# {d} named as what the object is not).
ROBUST_TEMPLATES: tuple[str, ...] = (
    "画一个{e}，背景是{bg}",
    "{bg}的底色上，{pos}放着一个{e}",
    "这张图里只有一个{e}，位于{pos}，背景为{bg}",
    "请画出{bg}背景前的一个{e}",
)
DISTRACTOR_TEMPLATES: tuple[str, ...] = (
    "画一个{e}，不是{d}，背景是{bg}",
    "{bg}的底色上，{pos}放着的是{e}而不是{d}",
)
ROBUST_VARIANTS: tuple[str, ...] = ("sentence", "alias", "traditional", "distractor")

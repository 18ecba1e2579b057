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

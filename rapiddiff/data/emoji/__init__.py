"""emoji-zh: real emoji artwork and CLDR's Chinese names → images, captions, a KG and splits.

:func:`build_emoji` writes, into one folder: ``train/ val/ test/`` (imagefolders, metadata.jsonl),
``kg/triples.tsv`` and ``kg/aliases.tsv``, ``glyphs/<style>/<id>.png`` (the packages' artwork),
``entities.jsonl``, ``splits.json``, ``kg_only_entities.json``, ``prompts.jsonl``, ``LICENSES/``,
``ATTRIBUTION.md`` and ``build.json`` (docs/data/emoji.md has every field).
"""

from rapiddiff.data.emoji.build import EmojiConfig, build_emoji
from rapiddiff.data.emoji.licenses import copy_licenses
from rapiddiff.data.emoji.packages import REQUIRED, MissingPackageError, find_packages

__all__ = ["REQUIRED", "EmojiConfig", "MissingPackageError", "build_emoji", "copy_licenses", "find_packages"]

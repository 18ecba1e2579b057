"""Licences and attributions of the emoji data, written into the data folder and copied into
every model folder trained on it (:func:`rapiddiff.data.licenses.copy_licenses`)."""

from __future__ import annotations

import shutil
from pathlib import Path

from rapiddiff.data.emoji.packages import OPTIONAL, Package, pack_name
from rapiddiff.data.licenses import ATTRIBUTION, LICENSES_DIR, copy_licenses

__all__ = ["ATTRIBUTION", "LICENSES_DIR", "copy_licenses", "write_licenses"]
# The artwork's licences are not in the npm packages (emoji-datasource's LICENSE is MIT for its
# data files); Debian's copy of Apache-2.0 is added where the machine has it.
APACHE_TEXT = Path("/usr/share/common-licenses/Apache-2.0")

ATTRIBUTION_TEXT = """# Attribution

This data set was built by `rapiddiff data emoji` from the packages below. Its images are
compositions of their artwork; its names, keywords and knowledge graph come from CLDR.

- **Noto Color Emoji** artwork (style `google`, via npm `emoji-datasource-google` {google}):
  Copyright Google Inc., licensed under the Apache License 2.0
  (https://www.apache.org/licenses/LICENSE-2.0; text in LICENSES/Apache-2.0 where present).
- **Twemoji** artwork (style `twitter`, via npm `emoji-datasource-twitter` {twitter}):
  Copyright Twitter, Inc. and other contributors, licensed under CC-BY 4.0
  (https://creativecommons.org/licenses/by/4.0/). Images were resized and placed on backgrounds.
- **emoji-datasource** data files (emoji.json): MIT licence, Copyright Cal Henderson
  (LICENSES/emoji-datasource-google.LICENSE).
- **Unicode CLDR** annotations and character labels (npm `cldr-annotations-full`,
  `cldr-annotations-derived-full`, `cldr-misc-full`): Unicode License v3
  (LICENSES/cldr-*.LICENSE). Copyright © Unicode, Inc.
- **emojibase-data** (Chinese subcategory labels): MIT licence, Copyright Miles Johnson
  (LICENSES/emojibase-data.LICENSE).

{hr}A model trained on this data must keep this file and LICENSES/ beside its weights.
"""
HR_ATTRIBUTION = """## The hr/ copies (4× images for the upscaler)

Drawn from the same artwork as SVG, rasterised by resvg (each glyph's SVG checked against its PNG):

{lines}
"""
HR_LINES = {
    "@iconify-json/noto": "- **Noto Emoji** SVGs (style `google`, via npm `@iconify-json/noto` {version}): Copyright "
    "Google Inc., Apache License 2.0 (LICENSES/iconify-json-noto.LICENSE).",
    "@iconify-json/twemoji": "- **Twemoji** SVGs (style `twitter`, via npm `@iconify-json/twemoji` {version}): "
    "Copyright Twitter, Inc. and other contributors, CC-BY 4.0 "
    "(https://creativecommons.org/licenses/by/4.0/; LICENSES/iconify-json-twemoji.LICENSE). "
    "Images were resized and placed on backgrounds.",
}


def _licence_file(root: Path) -> Path | None:
    return next(
        (
            p
            for p in sorted(root.iterdir())
            if p.is_file() and p.name.upper().startswith(("LICENSE", "LICENCE"))
        ),
        None,
    )


def write_licenses(out: Path, packages: dict[str, Package]) -> list[str]:
    """LICENSES/<package>.LICENSE for every package (and Apache-2.0's text), ATTRIBUTION.md."""
    folder = out / LICENSES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, package in sorted(packages.items()):
        source = _licence_file(package.root)
        if name in OPTIONAL:
            # Iconify packages declare their artwork's licence in info.json (twemoji ships no file).
            from rapiddiff.data.emoji.vector import license_text

            shipped = f"\n{source.read_text(encoding='utf-8')}" if source else ""
            (folder / f"{pack_name(name)}.LICENSE").write_text(
                license_text(package) + shipped, encoding="utf-8"
            )
            written.append(f"{pack_name(name)}.LICENSE")
            continue
        if source is None:
            raise FileNotFoundError(f"{package.root}: {name} ships no LICENSE file; is the package complete?")
        shutil.copyfile(source, folder / f"{name}.LICENSE")
        written.append(f"{name}.LICENSE")
    if APACHE_TEXT.is_file():
        shutil.copyfile(APACHE_TEXT, folder / "Apache-2.0")
        written.append("Apache-2.0")
    versions = {k: packages[f"emoji-datasource-{k}"].version for k in ("google", "twitter")}
    lines = [HR_LINES[n].format(version=packages[n].version) for n in OPTIONAL if n in packages]
    hr = HR_ATTRIBUTION.format(lines="\n".join(lines)) + "\n" if lines else ""
    (out / ATTRIBUTION).write_text(ATTRIBUTION_TEXT.format(**versions, hr=hr), encoding="utf-8")
    return written

"""Find the npm packages the emoji builder reads: extracted folders or ``npm pack`` tarballs.

Nothing is fetched: a package that is not among the paths given raises
:class:`MissingPackageError`, which names the package and the command that gets it.
"""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

REQUIRED: dict[str, str] = {
    "emoji-datasource-google": "Noto artwork (64 px PNGs) and emoji.json (categories)",
    "emoji-datasource-twitter": "Twemoji artwork (64 px PNGs)",
    "cldr-annotations-full": "CLDR zh / zh-Hant names and keywords",
    "cldr-annotations-derived-full": "CLDR names of flags and sequences",
    "emojibase-data": "Chinese labels of the emoji subcategories",
    "cldr-misc-full": "CLDR's Chinese labels of the emoji categories",
}
# What the builder reads of each package (paths under package/): a tarball is unpacked only there.
MEMBERS: dict[str, tuple[str, ...]] = {
    "emoji-datasource-google": ("emoji.json", "img/google/64/"),
    "emoji-datasource-twitter": ("emoji.json", "img/twitter/64/"),
    "cldr-annotations-full": ("annotations/zh/", "annotations/zh-Hant/"),
    "cldr-annotations-derived-full": ("annotationsDerived/zh/", "annotationsDerived/zh-Hant/"),
    "emojibase-data": ("zh/messages.json",),
    "cldr-misc-full": ("main/zh/characterLabels.json",),
}
# Optional: the same styles as SVG (Iconify JSON), for the hr/ copies (vector.py).
VECTOR_PACKAGES: dict[str, str] = {"google": "@iconify-json/noto", "twitter": "@iconify-json/twemoji"}
OPTIONAL: dict[str, str] = {
    "@iconify-json/noto": "Noto Emoji SVGs (for the 4× hr/ copies)",
    "@iconify-json/twemoji": "Twemoji SVGs (for the 4× hr/ copies)",
}
MEMBERS |= {name: ("icons.json", "chars.json", "info.json") for name in OPTIONAL}
STYLES: dict[str, str] = {"google": "emoji-datasource-google", "twitter": "emoji-datasource-twitter"}
_TARBALL = re.compile(r"^(?P<name>.+?)-(?P<version>\d+\.\d+\.\d+[^/]*)\.tgz$")


class MissingPackageError(FileNotFoundError):
    """A package the builder needs is not among the paths given."""


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    root: Path
    """The folder holding the package's package.json."""
    source: str
    """What the user gave: the folder or the tarball."""


def _from_folder(folder: Path) -> Package | None:
    meta = folder / "package.json"
    if not meta.is_file():
        return None
    info = json.loads(meta.read_text(encoding="utf-8"))
    return Package(info["name"], str(info.get("version", "?")), folder, str(folder))


def _candidates(path: Path) -> list[Path]:
    """The package folders and tarballs at ``path`` (itself, its children, NAME/package/, node_modules/)."""
    if path.is_file():
        return [path]
    if (path / "package.json").is_file():
        return [path]
    found = []
    for child in sorted(path.iterdir()):
        if child.suffix == ".tgz" or (child / "package.json").is_file():
            found.append(child)
        elif (child / "package" / "package.json").is_file():
            found.append(child / "package")
        elif child.name == "node_modules":
            found += _candidates(child)
    return found


def pack_name(name: str) -> str:
    """The file name stem ``npm pack`` gives a package: @scope/name → scope-name."""
    return name.lstrip("@").replace("/", "-")


def _extract(tarball: Path, name: str, cache: Path) -> Path:
    """Unpack what the builder reads of an npm tarball (:data:`MEMBERS`, package.json, LICENSE)
    into ``cache``; tarfile's "data" filter refuses unsafe paths."""
    target = cache / tarball.stem
    wanted = (
        "package/package.json",
        "package/LICEN",
        "package/licen",
        *(f"package/{m}" for m in MEMBERS.get(name, ("",))),
    )
    log.info("extracting %s", tarball)
    with tarfile.open(tarball) as archive:
        members = [m for m in archive if m.name.startswith(wanted)]
        archive.extractall(target, members=members, filter="data")
    return target / "package"


def find_packages(
    paths: Sequence[str | Path],
    cache: Path,
    names: Sequence[str] = tuple(REQUIRED),
    optional: Sequence[str] = (),
) -> dict[str, Package]:
    """Each package of ``names`` (and those of ``optional`` that are there) from ``paths`` (a folder
    wins over a tarball of the same name); tarballs are unpacked into ``cache``. Raises
    :class:`MissingPackageError` naming every missing one of ``names``."""
    folders: dict[str, Package] = {}
    tarballs: dict[str, tuple[Path, str]] = {}
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"--package {path}: no such file or folder")
        for item in _candidates(path):
            match = _TARBALL.match(item.name) if item.is_file() else None
            if match:
                tarballs.setdefault(match["name"], (item, match["version"]))
            elif (package := _from_folder(item)) is not None:
                folders.setdefault(package.name, package)
    found: dict[str, Package] = {}
    for name in (*names, *optional):
        if name in folders:
            found[name] = folders[name]
        elif pack_name(name) in tarballs:
            tarball, version = tarballs[pack_name(name)]
            found[name] = Package(name, version, _extract(tarball, name, cache), str(tarball))
    missing = [n for n in names if n not in found]
    if missing:
        lines = "\n".join(f"  {n}: {REQUIRED.get(n, '')} — get it with `npm pack {n}`" for n in missing)
        raise MissingPackageError(
            f"missing package(s) among --package {', '.join(map(str, paths)) or '(none given)'}:\n{lines}\n"
            f"Run `npm pack {' '.join(missing)}` in a folder and pass it with --package FOLDER."
        )
    return found

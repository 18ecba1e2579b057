"""Issue 18: the weights of U-Net draws that share a warm start, averaged into one model folder.

Each 2-head U-Net draw misses the attribute captions in a cell of its own (BENCHMARKS.md, issue 18,
"where the three draws miss", "weak cells"): one draws blue as purple, another squares as ellipses.
Draws forked from one run's early checkpoint (the same first steps, then their own data order and
noise) stay in one basin of the loss, so their weights can be averaged ("model soups", Wortsman et al.
2022; the linear connectivity of forks after the first part of training, Frankle et al. 2020), and an
average may keep what the draws agree on and lose each one's own weak cell.

    python benchmarks/kshapes_soup.py --out SOUP MODEL_A MODEL_B ...

Every ``.safetensors`` file whose tensors differ between the members (the U-Net's, the fusion's when the
U-Net stage trained it) becomes their mean, in the first member's dtypes; the other files (the frozen
text tower, VAE, store, configs) must be identical and are copied from the first member, except each
run's ``training_config.yaml``, which the soup leaves out: its ``soup.json`` names the members instead.
The mean is taken in fp32. Why our own code: torch's ``swa_utils.AveragedModel`` and diffusers' ``EMAModel`` average
one live module over steps, not saved folders; this is the plain mean of files.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

PROVENANCE = {"training_config.yaml"}  # the run's resolved config: a member's, not the soup's


def same_config(files: list[Path]) -> bool:
    """JSON files equal but for diffusers' ``_name_or_path`` (the folder each was loaded from)."""
    try:
        configs = [json.loads(f.read_text(encoding="utf-8")) for f in files]
    except ValueError:
        return False
    if not all(isinstance(c, dict) for c in configs):
        return False
    stripped = [{k: v for k, v in c.items() if k != "_name_or_path"} for c in configs]
    return all(c == stripped[0] for c in stripped[1:])


def _load(path: Path) -> dict[str, torch.Tensor]:
    """A member's weights; a file that is not safetensors is named, not a library traceback."""
    try:
        return load_file(path)
    except SafetensorError as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from err


def average_folders(members: list[Path], out: Path) -> list[str]:
    """Write the mean of ``members`` (model folders of one layout) to ``out``; return the averaged files."""
    if len(members) < 2:
        raise ValueError("a soup needs at least two model folders")
    if out.exists():
        raise ValueError(f"{out} exists: give a new folder")
    first = members[0]
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    for member in members[1:]:
        theirs = sorted(p.relative_to(member) for p in member.rglob("*") if p.is_file())
        if theirs != files:
            extra = sorted(set(theirs) ^ set(files))
            raise ValueError(f"{member} and {first} hold different files: {', '.join(map(str, extra[:5]))}")
    averaged: list[str] = []
    dropped: list[str] = []
    staging = out.with_name(out.name + ".partial")  # renamed to out when complete
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(first, staging)
    try:
        for rel in files:
            if all(filecmp.cmp(first / rel, m / rel, shallow=False) for m in members[1:]):
                continue  # the same bytes in every member: already copied
            if rel.suffix == ".json" and same_config([m / rel for m in members]):
                continue  # differ only in where each member was loaded from (diffusers' _name_or_path)
            if rel.name in PROVENANCE:  # each member's own record; the soup records its members instead
                (staging / rel).unlink()
                dropped.append(str(rel))
                continue
            if rel.suffix != ".safetensors":
                raise ValueError(
                    f"{rel} differs between the members and is not weights: not one warm start's draws"
                )
            states = [_load(m / rel) for m in members]
            mean = {}
            for key, tensor in states[0].items():
                others = [s.get(key) for s in states[1:]]
                if any(o is None or o.shape != tensor.shape for o in others):
                    raise ValueError(f"{rel}: tensor {key} is missing or of another shape in a member")
                if not tensor.is_floating_point():
                    if any(not torch.equal(o, tensor) for o in others):
                        raise ValueError(f"{rel}: integer tensor {key} differs between the members")
                    mean[key] = tensor
                    continue
                mean[key] = torch.stack([t.float() for t in (tensor, *others)]).mean(0).to(tensor.dtype)
            save_file(mean, str(staging / rel), metadata={"format": "pt"})
            averaged.append(str(rel))
        record = {"members": [str(m) for m in members], "averaged": averaged, "dropped": dropped}
        (staging / "soup.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.rename(out)
    return averaged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("members", type=Path, nargs="+", help="model folders (rapiddiff's layout)")
    parser.add_argument("--out", type=Path, required=True, help="the averaged model folder (new)")
    args = parser.parse_args(argv)
    try:
        averaged = average_folders(args.members, args.out)
    except (ValueError, OSError) as err:  # a wrong folder: one line, no traceback
        parser.error(str(err))
    print(f"{args.out}: mean of {len(args.members)} members in {', '.join(averaged) or 'no file'}")


if __name__ == "__main__":
    sys.exit(main())

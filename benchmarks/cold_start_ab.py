"""Cold `rapiddiff generate` of two trees, interleaved, beside the floor of the libraries it imports.

    python benchmarks/cold_start_ab.py --before DIR [--after DIR] [--rounds 5] [--only VARIANT ...] [--out DIR]

Each round runs, in a rotating order, fresh processes of (with ``PYTHONPATH`` set to the tree):

* ``before`` / ``after``: ``python -m rapiddiff.cli generate PROMPT --seed 1 --no-progress`` of each
  tree (the built-in model; the PNGs of a round must have the same pixels and metadata — the
  model's path, which is inside each tree, aside — else it stops);
* ``floor: libraries``: ``import torch; from diffusers import UNet2DConditionModel, AutoencoderKL;
  from transformers import BertModel`` — the classes the built-in model is made of, imported the
  usual way;
* ``floor: narrow imports``: the same classes (and the PNDM scheduler, the BERT tokenizer) imported
  as the ``after`` tree imports them (only their own files: ``rapiddiff.utils.imports``);
* ``before: own start-up`` / ``after: own start-up``: the narrow imports first, then (timed inside
  the child) the load of the built-in model and the prompt's encoding, entity linking included:
  the start-up that is rapiddiff's own, above the floor;
* ``before: phases`` / ``after: phases``: each tree's generate phase by phase
  (``cold_start_phases.py``'s child): start-up apart from the image's own seconds (encode + 25
  steps + decode, the ×4 upscale), which on a busy machine vary more than start-up does.

Wall seconds (``time.perf_counter`` around the child), the child's CPU seconds (user + sys) and
the 1-minute load average at its start are printed per run, then the median and range per variant.
Run one warm-up generate per tree first (numba and the on-disk caches are built on a first run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "浅蓝色背景上有一个番茄"

LIBRARIES = (
    "import torch\n"
    "from diffusers import UNet2DConditionModel, AutoencoderKL\n"
    "from transformers import BertModel\n"
    "BertModel.__name__\n"
)
NARROW = (
    "import torch\n"
    "from rapiddiff.models.bundle import diffusers_class\n"
    "from rapiddiff.models.text_encoder import _TEXT_MODEL_MODULES\n"
    "from rapiddiff.utils.imports import import_module\n"
    "diffusers_class('UNet2DConditionModel'); diffusers_class('AutoencoderKL'); diffusers_class('PNDMScheduler')\n"
    "import_module(_TEXT_MODEL_MODULES['BertModel'], defer=['transformers.models']).BertModel\n"
    "from transformers import BertTokenizerFast\n"
    "BertTokenizerFast.__name__\n"
)

# Start-up above that floor: with the model's library classes imported first (NARROW), the load of
# the built-in model and the prompt's encoding (entity linking included), in CPU and wall seconds.
OWN = (
    NARROW + "import json, resource, time\n"
    "def cpu():\n"
    "    u = resource.getrusage(resource.RUSAGE_SELF)\n"
    "    return u.ru_utime + u.ru_stime\n"
    "wall, used = time.perf_counter(), cpu()\n"
    "from rapiddiff.infer.generate_cli import default_model_dir\n"
    "from rapiddiff.infer.pipeline import RapidDiffusionPipeline\n"
    "pipe = RapidDiffusionPipeline.from_pretrained(default_model_dir())\n"
    f"pipe.encode_prompt([{PROMPT!r}])\n"
    "print(json.dumps([time.perf_counter() - wall, cpu() - used]))\n"
)


def _run(argv: list[str], tree: Path, cwd: Path) -> tuple[float, float, float, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, load, done.stdout


def _fingerprint(png: Path, tree: Path) -> str:
    """sha256 of the pixels and the metadata, the model's path (inside each tree) written as TREE."""
    from PIL import Image

    with Image.open(png) as image:
        text = json.dumps(image.info, sort_keys=True, default=str).replace(str(tree.resolve()), "TREE")
        return hashlib.sha256(image.tobytes() + text.encode()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, type=Path, help="the tree to compare against")
    parser.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed generates per tree first")
    parser.add_argument("--only", nargs="+", help="run only these variants (names as printed)")
    parser.add_argument("--out", type=Path, help="folder for the PNGs and results.json (default: temporary)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="cold-start-ab-"))
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cold_start_phases import CHILD

    def generate(tree: Path, name: str) -> list[str]:
        folder = out / name
        folder.mkdir(exist_ok=True)
        return [sys.executable, "-m", "rapiddiff.cli", "generate", PROMPT, "--seed", "1", "--no-progress",
                "--out", str(folder)]  # fmt: skip

    variants = {
        "before": (args.before, lambda: generate(args.before, "before")),
        "after": (args.after, lambda: generate(args.after, "after")),
        "floor: libraries": (args.after, lambda: [sys.executable, "-c", LIBRARIES]),
        "floor: narrow imports": (args.after, lambda: [sys.executable, "-c", NARROW]),
        "before: own start-up": (args.before, lambda: [sys.executable, "-c", OWN]),
        "after: own start-up": (args.after, lambda: [sys.executable, "-c", OWN]),
        "before: phases": (args.before, lambda: [sys.executable, "-c", CHILD, str(out)]),
        "after: phases": (args.after, lambda: [sys.executable, "-c", CHILD, str(out)]),
    }
    if args.only:
        variants = {name: variants[name] for name in args.only}
    for _ in range(args.warmup):
        for name in [n for n in ("before", "after") if n in variants]:
            tree, argv = variants[name]
            _run(argv(), tree, out)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    phases: dict[str, list[list[list[object]]]] = {"before: phases": [], "after: phases": []}
    names = list(variants)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        pngs = {}
        for name in order:
            tree, argv = variants[name]
            folder = out / name
            if name in ("before", "after"):
                for old in folder.glob("*.png"):
                    old.unlink()
            wall, cpu, load, stdout = _run(argv(), tree, out)
            results[name].append({"wall": wall, "cpu": cpu, "load": load})
            if name in ("before", "after"):
                (png,) = folder.glob("*.png")
                pngs[name] = _fingerprint(png, tree)
            if name in phases:
                phases[name].append(json.loads(stdout.strip().splitlines()[-1])["rows"])
            if name.endswith("own start-up"):
                own_wall, own_cpu = json.loads(stdout.strip().splitlines()[-1])
                results[name][-1].update(own_wall=own_wall, own_cpu=own_cpu)
                print(f"  (above the floor: wall {own_wall:.2f} s, cpu {own_cpu:.2f} s)", flush=True)
            print(
                f"round {r + 1} {name:22s} wall {wall:6.2f} s  cpu {cpu:6.2f} s  load {load:5.2f}", flush=True
            )
        if "before" in pngs and "after" in pngs and pngs["before"] != pngs["after"]:
            raise SystemExit(f"round {r + 1}: the two trees wrote different images: {pngs}")
    _report(results, phases, out)


def _report(
    results: dict[str, list[dict[str, float]]], phases: dict[str, list[list[list[object]]]], out: Path
) -> None:
    """The tables of the rounds (variants, start-up above the floor, phases) and results.json."""
    print("\n| variant | wall s, median (min–max) | CPU s, median | load at start |\n|---|---|---|---|")
    for name, runs in results.items():
        walls = [x["wall"] for x in runs]
        loads = [x["load"] for x in runs]
        print(
            f"| {name} | {statistics.median(walls):.2f} ({min(walls):.2f}–{max(walls):.2f}) | "
            f"{statistics.median(x['cpu'] for x in runs):.2f} | {min(loads):.1f}–{max(loads):.1f} |"
        )
    print(
        "\n| start-up above the floor | wall s, median (min–max) | CPU s, median (min–max) |\n|---|---|---|"
    )
    for name in [n for n in ("before: own start-up", "after: own start-up") if n in results]:
        walls = [x["own_wall"] for x in results[name]]
        cpus = [x["own_cpu"] for x in results[name]]
        print(
            f"| {name.split(':')[0]} | {statistics.median(walls):.2f} ({min(walls):.2f}–{max(walls):.2f}) | "
            f"{statistics.median(cpus):.2f} ({min(cpus):.2f}–{max(cpus):.2f}) |"
        )
    if not all(phases.values()):
        (out / "results.json").write_text(json.dumps({"runs": results, "phases": phases}, indent=1))
        return
    print("\n| phase | before: wall s, CPU s (medians) | after: wall s, CPU s (medians) |\n|---|---|---|")
    for k, (name, _, _) in enumerate(phases["after: phases"][0]):
        cells = []
        for rows in phases.values():
            wall = statistics.median(float(p[k][1]) for p in rows)
            cpus = [float(p[k][2]) for p in rows if p[k][2] is not None]
            cells.append(f"{wall:.2f}, {statistics.median(cpus):.2f}" if cpus else f"{wall:.2f}")
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    (out / "results.json").write_text(json.dumps({"runs": results, "phases": phases}, indent=1))
    print(f"\nSame pixels and metadata in every round; results in {out / 'results.json'}")


if __name__ == "__main__":
    main()

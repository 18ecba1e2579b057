"""The rapiddiff chain on emoji-zh (real artwork, CLDR's Chinese names, a KG built from them), from
the npm packages to a built-in model, with its ablation arms and 3 seeds.

    python benchmarks/emoji_chain.py --out runs/ec --packages PKGS              # everything (GPU)
    python benchmarks/emoji_chain.py --out /tmp/ec --packages PKGS --smoke      # every stage, a few steps (CPU)
    python benchmarks/emoji_chain.py --out runs/ec --part summary               # the tables again

Stages, each the `rapiddiff` command a user runs with the stage's shipped config
(``configs/<stage>/emoji.yaml``) and this chain's paths and budgets (``configs/emoji/chain.yaml``):
data (once: the splits are chosen once and never tuned) → TransE (a seed each) → knowledge CLIP (a
seed each), with the VAE variants (seed 0, shared by every seed) training beside both from the start →
the judge reads each VAE's reconstructions of validation renders (the arm's VAE ``best`` is chosen on
them, never on the test side) → the U-Nets (one per arm and seed, side by side on one GPU) → a guidance sweep on the *validation*
entities → `rapiddiff eval emoji` with the frozen judge (knowledge embed, both, text and off on the
same model) → the summary (mean ± sd over seeds for each arm) and the built-in model (the main arm's
seed chosen on validation, fp16, pruned vocabulary, the data's licences).

Every stage whose output exists is skipped, so a chain cut by a time limit resumes where it stopped.
The judge's top-1 on a VAE's reconstructions of real renders is the ceiling any U-Net on that VAE can
reach: ``results/vae_judge_<name>.json`` has it on validation (the choice) and on test (the report).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # kshapes_chain, emoji_builtin: beside this file

from rapiddiff.utils.config import ConfigError, load_config  # noqa: E402

VAE_4X = {  # three blocks: two downsamplings, 128² ↔ 32² latents
    "block_out_channels": [64, 64, 64],
    "down_block_types": ["DownEncoderBlock2D"] * 3,
    "up_block_types": ["UpDecoderBlock2D"] * 3,
}


@dataclass
class StageBudget:
    """Wall-clock minutes and a step cap (the cosine schedule's length) for one training stage."""

    minutes: float = 3.0
    max_steps: int = 100000


@dataclass
class VaeVariant:
    """One VAE the chain trains: its latent side and the architecture keys over that side's base."""

    latent: int = 32
    """16 (the kshapes preset: 8×, as SD) or 32 (three blocks: 4×)."""
    changes: dict[str, Any] = field(default_factory=dict)
    """AutoencoderKL keys over the base (e.g. ``latent_channels: 8``)."""

    def architecture(self) -> dict[str, Any]:
        return {**(VAE_4X if self.latent == 32 else {}), **self.changes}


@dataclass
class Arm:
    """One U-Net recipe of the ablation: its architecture and latent size, and the seeds it runs."""

    unet: str = "kshapes"
    """a U-Net preset name, or a mapping of UNet2DConditionModel keys over the kshapes preset."""
    changes: dict[str, Any] = field(default_factory=dict)
    latent: int = 16
    """16 (the 8× VAE) or 32 (the 4× VAE)."""
    vae: str = "best"
    """a name of ``vaes``, or ``best``: of the variants of the arm's latent side, the one the judge
    reads best on validation renders (measured in the prep)."""
    seeds: list[int] = field(default_factory=lambda: [0])
    eval_modes: str = "embed,both,text,off"
    max_steps: int | None = None
    """the arm's U-Net steps (its cosine schedule's length; None: the chain's ``unet.max_steps``):
    the arms train side by side in the same minutes, and a bigger U-Net makes fewer steps in them."""


@dataclass
class EmojiChainConfig:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """the main arm's seeds (each its own TransE, CLIP, U-Net and sampling seed)."""
    main_arm: str = "s16"
    arms: dict[str, Arm] = field(default_factory=dict)
    vaes: dict[str, VaeVariant] = field(default_factory=dict)
    """the VAE variants (default: one per latent side the arms ask for, each side's base)."""
    workers: int = 3
    clip: StageBudget = field(default_factory=lambda: StageBudget(minutes=3.0))
    vae: StageBudget = field(default_factory=lambda: StageBudget(minutes=4.0))
    unet: StageBudget = field(default_factory=lambda: StageBudget(minutes=6.5))
    unet_batch_size: int = 64
    eval_steps: int = 25
    eval_images_per_prompt: int = 2
    eval_limit: int = 300
    """prompts per split (seen 1,620 and alias 3,214 are sampled down to this; held-out and
    validation have fewer)."""
    eval_batch_size: int = 64
    guidance_candidates: list[float] = field(default_factory=lambda: [3.0])
    """CFG scales tried on the validation entities (knowledge embed; scored by subcategory % + top-5 %)."""


def load_chain_config(path: str | Path, overrides: dict[str, Any] | None = None) -> EmojiChainConfig:
    cfg = load_config(EmojiChainConfig, path, **(overrides or {}))
    cfg.arms = {
        name: load_config(Arm, arm) if isinstance(arm, dict) else arm for name, arm in cfg.arms.items()
    }
    if cfg.main_arm not in cfg.arms:
        raise ConfigError(f"main_arm {cfg.main_arm!r} is not one of the arms: {', '.join(cfg.arms)}")
    cfg.arms[cfg.main_arm].seeds = list(cfg.seeds)
    cfg.vaes = {
        name: load_config(VaeVariant, vae) if isinstance(vae, dict) else vae for name, vae in cfg.vaes.items()
    }
    for name, arm in cfg.arms.items():
        if arm.latent not in (16, 32):
            raise ConfigError(f"arms.{name}.latent: 16 or 32, got {arm.latent}")
    if not cfg.vaes:
        cfg.vaes = {
            f"{side}": VaeVariant(latent=side) for side in sorted({a.latent for a in cfg.arms.values()})
        }
    for name, arm in cfg.arms.items():
        if arm.vae != "best" and arm.vae not in cfg.vaes:
            raise ConfigError(f"arms.{name}.vae: 'best' or one of {', '.join(cfg.vaes)}, got {arm.vae!r}")
        if arm.vae != "best" and cfg.vaes[arm.vae].latent != arm.latent:
            raise ConfigError(
                f"arms.{name}.vae: {arm.vae} has {cfg.vaes[arm.vae].latent}² latents, the arm {arm.latent}²"
            )
        if not any(v.latent == arm.latent for v in cfg.vaes.values()):
            raise ConfigError(f"arms.{name}.latent: {arm.latent}, but no VAE of vaes has that latent side")
    for name, vae in cfg.vaes.items():
        if vae.latent not in (16, 32):
            raise ConfigError(f"vaes.{name}.latent: 16 or 32, got {vae.latent}")
    return cfg


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _done(folder: Path) -> bool:
    """A stage's output folder is complete (each writes its index file last; DONE marks a packed one)."""
    names = ("model_index.json", "config.json", "clip_config.json", "DONE")
    return any((folder / name).exists() for name in names)


class EmojiChain:
    def __init__(self, out: Path, cfg: EmojiChainConfig, packages: list[str], smoke: bool) -> None:
        self.out, self.cfg, self.packages, self.smoke = out, cfg, packages, smoke
        self.data = out / "data"
        self.logs, self.results = out / "logs", out / "results"
        for folder in (self.logs, self.results):
            folder.mkdir(parents=True, exist_ok=True)
        self.on_gpu = _has_cuda()
        self.timings: dict[str, float] = {}

    # ---- running ------------------------------------------------------------------------------
    def rapiddiff(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "rapiddiff", *args]

    def start(self, jobs: dict[str, list[str]]) -> dict[str, tuple[subprocess.Popen, Any, float]]:
        """Start every job (each logging to ``logs/<name>.log``); :meth:`wait` collects them."""
        procs = {}
        for name, cmd in jobs.items():
            log = open(self.logs / f"{name}.log", "w", encoding="utf-8")  # noqa: SIM115 (closed below)
            log.write(" ".join(cmd) + "\n\n")
            log.flush()
            print(f"[emoji-chain] start {name}", flush=True)
            procs[name] = (
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT),
                log,
                time.time(),
            )
        return procs

    def wait(self, procs: dict[str, tuple[subprocess.Popen, Any, float]]) -> list[str]:
        """Wait for every started job; returns the names that failed (their logs' tails printed)."""
        failed = []
        while procs:
            for name, (proc, log, begun) in list(procs.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del procs[name]
                self.timings[name] = round(time.time() - begun, 1)
                print(
                    f"[emoji-chain] {name}: exit {proc.returncode} after {self.timings[name]} s", flush=True
                )
                if proc.returncode != 0:
                    failed.append(name)
                    tail = (self.logs / f"{name}.log").read_text("utf-8").splitlines()[-30:]
                    print(f"----- tail of {self.logs / (name + '.log')}\n" + "\n".join(tail), flush=True)
            time.sleep(1)
        self.write_timings()
        return failed

    def run_parallel(self, jobs: dict[str, list[str]]) -> list[str]:
        """Start every job, wait for all; returns the names that failed."""
        return self.wait(self.start(jobs))

    def must(self, jobs: dict[str, list[str]]) -> None:
        failed = self.run_parallel(jobs) if jobs else []
        if failed:
            raise SystemExit(f"[emoji-chain] failed: {', '.join(failed)}")

    def write_timings(self) -> None:
        path = self.results / "timings.json"
        old = json.loads(path.read_text("utf-8")) if path.exists() else {}
        path.write_text(json.dumps({**old, **self.timings}, indent=1), "utf-8")

    def training(
        self, stage: str, budget: StageBudget, output: Path, seed: int, *overrides: str
    ) -> list[str]:
        seconds = 20 if self.smoke else int(budget.minutes * 60)
        steps = 3 if self.smoke else budget.max_steps
        own_seed = [f"--model.seed={seed}"] if stage in ("vae", "unet") else []
        return self.rapiddiff(
            "train", stage, "--config", str(ROOT / f"configs/{stage}/emoji.yaml"),
            f"--trainer.max_steps={steps}",
            f"--trainer.max_time=00:00:{seconds // 60:02d}:{seconds % 60:02d}",
            f"--trainer.precision={'bf16-mixed' if self.on_gpu else '32-true'}",
            f"--trainer.default_root_dir={output.parent / ('run_' + output.name)}",
            f"--output={output}", f"--data.train={self.data / 'train'}", f"--data.val={self.data / 'val'}",
            f"--data.num_workers={0 if self.smoke else self.cfg.workers}",
            *(["--data.batch_size=4"] if self.smoke else []),
            f"--seed_everything={seed}", f"--data.seed={seed}", *own_seed, *overrides,
        )  # fmt: skip

    # ---- stages -------------------------------------------------------------------------------
    def all_seeds(self) -> list[int]:
        return sorted({s for arm in self.cfg.arms.values() for s in arm.seeds})

    def arm_vae(self, arm: Arm) -> str:
        """The arm's VAE variant: named, or ``best``: the judge's top-1 on validation reconstructions."""
        if arm.vae != "best":
            return arm.vae
        names = [n for n, v in self.cfg.vaes.items() if v.latent == arm.latent]
        scores = {n: self.vae_val_score(n) for n in names}
        return max(names, key=lambda n: scores[n])  # ties: the first listed

    def vae_val_score(self, name: str) -> float:
        path = self.results / f"vae_judge_{name}.json"
        return json.loads(path.read_text("utf-8"))["val"]["top1"] if path.exists() else float("-inf")

    def seed_dir(self, seed: int) -> Path:
        return self.out / f"seed-{seed}"

    def vae_dir(self, name: str) -> Path:
        return self.out / f"vae_{name}"

    def ensure_data(self) -> None:
        if (self.data / "build.json").exists():
            return
        if not self.packages:
            raise SystemExit("--packages: the folder(s) of emoji-zh's npm packages (tarballs or folders)")
        extra = ["--limit", "40"] if self.smoke else []
        cmd = self.rapiddiff(
            "data", "emoji", "--config", str(ROOT / "configs/data/emoji.yaml"), "--out", str(self.data),
            *[a for p in self.packages for a in ("--package", p)], *extra,
        )  # fmt: skip
        self.must({"data": cmd})

    def prep(self) -> None:
        """TransE then CLIP for each seed, the VAEs beside both from the start (they need neither),
        then the judge on each VAE's reconstructions."""
        self.ensure_data()
        vaes = {}
        for name, vae in self.cfg.vaes.items():
            if not _done(self.vae_dir(name)):
                arch = (
                    [f"--model.architecture={json.dumps(vae.architecture())}"] if vae.architecture() else []
                )
                vaes[f"vae_{name}"] = self.training("vae", self.cfg.vae, self.vae_dir(name), 0, *arch)
        vae_procs = self.start(vaes)
        jobs = {}
        for seed in self.all_seeds():
            store = self.seed_dir(seed) / "kg"
            if not (store / "config.json").exists():
                jobs[f"kg_s{seed}"] = self.rapiddiff(
                    "kg", "train", "--config", str(ROOT / "configs/kg/emoji.yaml"),
                    "--triples", str(self.data / "kg/triples.tsv"), "--aliases", str(self.data / "kg/aliases.tsv"),
                    "--out", str(store), "--seed", str(seed), *(["--epochs", "5"] if self.smoke else []),
                )  # fmt: skip
        self.must(jobs)
        jobs = {}
        for seed in self.all_seeds():
            clip = self.seed_dir(seed) / "clip"
            if not _done(clip):
                store = f"--model.knowledge_store={self.seed_dir(seed) / 'kg'}"
                jobs[f"clip_s{seed}"] = self.training("clip", self.cfg.clip, clip, seed, store)
        self.must(jobs)
        failed = self.wait(vae_procs)
        if failed:
            raise SystemExit(f"[emoji-chain] failed: {', '.join(failed)}")
        self.must(self.vae_judge_jobs())
        for name, arm in self.cfg.arms.items():
            print(f"[emoji-chain] arm {name}: VAE {self.arm_vae(arm)}", flush=True)

    def unet_jobs(self) -> dict[str, list[str]]:
        jobs = {}
        speed = ["--model.speed.gpu_data=true", "--model.speed.foreach_ema=true", "--model.speed.cuda_graph=true",
                 "--model.optim.fused=true", "--model.speed.sync_every=10"] if self.on_gpu else []  # fmt: skip
        for name, arm in self.cfg.arms.items():
            unet = self.architecture(name, arm)
            for seed in arm.seeds:
                folder = self.seed_dir(seed) / f"unet_{name}"
                if _done(folder):
                    continue
                budget = StageBudget(self.cfg.unet.minutes, arm.max_steps or self.cfg.unet.max_steps)
                jobs[f"unet_{name}_s{seed}"] = self.training(
                    "unet", budget, folder, seed, f"--model.unet={unet}",
                    f"--model.vae={self.vae_dir(self.arm_vae(arm))}", f"--model.text_encoder={self.seed_dir(seed) / 'clip'}",
                    f"--data.batch_size={4 if self.smoke else self.cfg.unet_batch_size}", *speed,
                    *(["--model.sampling.num_inference_steps=2", "--model.sampling.seeds=[0]"] if self.smoke else []),
                )  # fmt: skip
        return jobs

    def architecture(self, name: str, arm: Arm) -> str:
        """The arm's U-Net: OUT/unet_<arm>.json, the preset with the arm's latent side, its VAE's
        latent channels and the arm's changes."""
        from rapiddiff.models.presets import check_unet_config, unet_config

        vae = json.loads((self.vae_dir(self.arm_vae(arm)) / "config.json").read_text("utf-8"))
        channels = int(vae.get("latent_channels", 4))
        config = {**unet_config(arm.unet), "sample_size": arm.latent, "in_channels": channels,
                  "out_channels": channels, **arm.changes}  # fmt: skip
        check_unet_config(config, f"arms.{name}.changes")
        path = self.out / f"unet_{name}.json"
        path.write_text(json.dumps(config, indent=1), "utf-8")
        return str(path)

    def vae_judge_jobs(self) -> dict[str, list[str]]:
        jobs = {}
        for name in self.cfg.vaes:
            target = self.results / f"vae_judge_{name}.json"
            if not target.exists():
                jobs[f"vae_judge_{name}"] = [
                    sys.executable, __file__, "--part", "vae-judge", "--out", str(self.out),
                    "--vae", str(self.vae_dir(name)), "--target", str(target), *(["--smoke"] if self.smoke else []),
                ]  # fmt: skip
        return jobs

    def eval_cmd(
        self, model: Path, out: Path, splits: str, modes: str, seed: int, guidance: float | None
    ) -> list[str]:
        return self.rapiddiff(
            "eval", "emoji", "--model", str(model), "--data", str(self.data), "--judge", str(ROOT / "benchmarks/emoji_judge"),
            "--out", str(out), "--splits", splits, "--modes", modes,
            "--steps", "3" if self.smoke else str(self.cfg.eval_steps),
            "--images-per-prompt", "1" if self.smoke else str(self.cfg.eval_images_per_prompt),
            "--limit", "4" if self.smoke else str(self.cfg.eval_limit), "--seed", str(seed),
            "--batch-size", str(self.cfg.eval_batch_size),
            *(["--guidance", str(guidance)] if guidance is not None else []),
        )  # fmt: skip

    def choose_guidance(self) -> dict[tuple[str, int], float | None]:
        """Each (arm, seed)'s CFG scale, chosen on the validation entities only."""
        runs, jobs = {}, {}
        for name, arm in self.cfg.arms.items():
            for seed in arm.seeds:
                for g in self.cfg.guidance_candidates if len(self.cfg.guidance_candidates) > 1 else []:
                    run = self.seed_dir(seed) / "guidance" / f"{name}_g{g:g}"
                    runs.setdefault((name, seed), {})[g] = run
                    if not (run / "metrics/emoji.json").exists():
                        model = self.seed_dir(seed) / f"unet_{name}"
                        jobs[f"guidance_{name}_s{seed}_g{g:g}"] = self.eval_cmd(
                            model, run, "val", "embed", seed, g
                        )
        self.run_parallel(jobs) if jobs else None
        chosen: dict[tuple[str, int], float | None] = {}
        for name, arm in self.cfg.arms.items():
            for seed in arm.seeds:
                if (name, seed) not in runs:
                    chosen[name, seed] = (
                        self.cfg.guidance_candidates[0] if self.cfg.guidance_candidates else None
                    )
                    continue
                scores = {g: val_score(run) for g, run in runs[name, seed].items()}
                chosen[name, seed] = max(scores, key=lambda g: (scores[g], -abs(g - 3.0)))
                (self.seed_dir(seed) / "guidance" / f"{name}.json").write_text(
                    json.dumps(
                        {"scores": {f"{g:g}": s for g, s in scores.items()}, "chosen": chosen[name, seed]}
                    ),
                    "utf-8",
                )
        return chosen

    def evaluate(self) -> None:
        chosen = self.choose_guidance()
        jobs = {}
        for name, arm in self.cfg.arms.items():
            for seed in arm.seeds:
                run = self.seed_dir(seed) / f"eval_{name}"
                if not (run / "metrics/emoji.json").exists():
                    model = self.seed_dir(seed) / f"unet_{name}"
                    jobs[f"eval_{name}_s{seed}"] = self.eval_cmd(
                        model, run, "seen,alias,heldout,val", arm.eval_modes, seed, chosen[name, seed]
                    )
        failed = self.run_parallel(jobs) if jobs else []
        if failed:
            print(f"[emoji-chain] evaluations failed: {', '.join(failed)}", flush=True)

    def unet_and_eval(self) -> None:
        self.ensure_data()  # a fresh machine after --unpack: the data is rebuilt, not carried
        self.must(self.vae_judge_jobs())  # an archive from before the judge ran in the prep
        jobs = self.unet_jobs()
        failed = self.run_parallel(jobs) if jobs else []
        if any(f.startswith("unet_") for f in failed):
            raise SystemExit(f"[emoji-chain] failed: {', '.join(failed)}")
        self.evaluate()

    # ---- the built-in model ---------------------------------------------------------------------
    def assemble(self, summary: dict[str, Any]) -> None:
        seed = summary.get("best_seed")
        if seed is None:
            return
        target = self.out / "builtin"
        if _done(target):
            return
        from emoji_builtin import assemble_emoji_model

        guidance = summary["arms"][self.cfg.main_arm]["guidance"].get(str(seed))
        assemble_emoji_model(
            self.seed_dir(seed) / f"unet_{self.cfg.main_arm}", self.data, target,
            steps=self.cfg.eval_steps, guidance=guidance,
        )  # fmt: skip


# ---- between device calls ----------------------------------------------------------------------


def chain_texts(data: Path) -> list[str]:
    """Every text the chain tokenizes: captions and evaluation prompts (the pruned vocabulary keeps
    the store's names and aliases itself)."""
    files = [data / split / "metadata.jsonl" for split in ("train", "val", "test")] + [data / "prompts.jsonl"]
    return [
        json.loads(line)["text"] for file in files if file.exists() for line in file.open(encoding="utf-8")
    ]


def pack(chain: EmojiChain, target: Path) -> Path:
    """What the U-Nets need from the prep, small enough to travel between two device calls (a warm
    machine keeps /tmp only 30 s after a call): each seed's TransE store and the CLIP stage's text side
    (vocabulary pruned to the chain's texts: identical outputs on them), the VAEs, in fp16, and the
    prep's logs and results. The data is not packed: it is rebuilt from the packages (~20 s)."""
    import tarfile
    import tempfile

    from kshapes_chain import cast_safetensors

    from rapiddiff.models.text_encoder import KnowledgeTextEncoder
    from rapiddiff.models.vocab import prune_vocabulary

    texts = chain_texts(chain.data)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        for seed in chain.all_seeds():
            src, dst = chain.seed_dir(seed), stage / f"seed-{seed}"
            shutil.copytree(src / "kg", dst / "kg")
            encoder = KnowledgeTextEncoder.from_pretrained(src / "clip")
            print(
                f"[emoji-chain] pack seed {seed}: vocabulary {prune_vocabulary(encoder, texts)}", flush=True
            )
            encoder.save_pretrained(dst / "clip")
            (dst / "clip" / "DONE").write_text("the CLIP stage's text side, packed\n", "utf-8")
        for name in chain.cfg.vaes:
            shutil.copytree(chain.vae_dir(name), stage / chain.vae_dir(name).name)
        shutil.copytree(chain.results, stage / "results")
        shutil.copytree(chain.logs, stage / "logs")
        cast_safetensors(stage, "float16")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(target, "w:gz") as tar:
            tar.add(stage, arcname=".")
    print(f"[emoji-chain] packed {target} ({target.stat().st_size / 1e6:.1f} MB)", flush=True)
    return target


def unpack(source: Path, out: Path) -> None:
    """Extract a :func:`pack` archive into ``out``, its weights back to fp32 for training."""
    import tarfile

    from kshapes_chain import cast_safetensors

    if not source.is_file():
        raise SystemExit(f"--unpack: {source} not found (write it with --part prep --pack FILE)")
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(source) as tar:
        tar.extractall(out, filter="data")
    weights = [p for p in sorted(out.glob("seed-*/clip")) + sorted(out.glob("vae*")) if p.is_dir()]
    cast_safetensors(out, "float32", only=weights)


# ---- scores and the summary --------------------------------------------------------------------


def _rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics/emoji.json"
    return json.loads(path.read_text("utf-8"))["table"] if path.exists() else []


def val_score(run: Path) -> float:
    """The guidance sweep's score: validation subcategory % + top-5 % (knowledge embed)."""
    for row in _rows(run):
        if row["split"] == "val" and "kind" not in row:
            return (row["subcategory"] or 0.0) + (row["top5"] or 0.0)
    return float("-inf")


MEASURES = ("top1", "top5", "subcategory", "background", "position")


def seed_measures(run: Path) -> dict[str, float]:
    """Flat ``split[/kind]/mode/measure`` → value of one evaluation, plus the Fréchet rows."""
    found = {}
    for row in _rows(run):
        key = f"{row['split']}{'/' + row['kind'] if 'kind' in row else ''}/{row['knowledge']}"
        for m in MEASURES:
            if row.get(m) is not None:
                found[f"{key}/{m}"] = row[m]
    path = run / "metrics/emoji.json"
    if path.exists():
        for f in json.loads(path.read_text("utf-8"))["details"].get("frechet", []):
            found[f"{f['split']}/{f['knowledge']}/frechet"] = f["generated_vs_real"]
            if f.get("style_vs_style") is not None:
                found[f"{f['split']}/real/style_vs_style"] = f["style_vs_style"]
    return found


def summarise(chain: EmojiChain) -> dict[str, Any]:
    cfg, out = chain.cfg, chain.out
    summary: dict[str, Any] = {"arms": {}, "main_arm": cfg.main_arm}
    for name, arm in cfg.arms.items():
        per_seed = {s: seed_measures(chain.seed_dir(s) / f"eval_{name}") for s in arm.seeds}
        per_seed = {s: m for s, m in per_seed.items() if m}
        keys = sorted({k for m in per_seed.values() for k in m})
        table = {}
        for key in keys:
            values = [m[key] for m in per_seed.values() if key in m]
            table[key] = {
                "mean": round(statistics.fmean(values), 2),
                "sd": round(statistics.stdev(values), 2) if len(values) > 1 else None,
                "values": values,
            }
        guidance = {}
        for s in arm.seeds:
            g = chain.seed_dir(s) / "guidance" / f"{name}.json"
            guidance[str(s)] = (
                json.loads(g.read_text("utf-8"))["chosen"]
                if g.exists()
                else (cfg.guidance_candidates[0] if cfg.guidance_candidates else None)
            )
        steps = {}
        for s in arm.seeds:
            steps[str(s)] = _last_step(chain.logs / f"unet_{name}_s{s}.log")
        summary["arms"][name] = {"seeds": sorted(per_seed), "measures": table, "guidance": guidance, "unet_steps": steps,
                                 "unet": arm.unet, "changes": arm.changes, "latent": arm.latent,
                                 "vae": chain.arm_vae(arm)}  # fmt: skip
    main = {s: seed_measures(chain.seed_dir(s) / f"eval_{cfg.main_arm}") for s in cfg.seeds}
    scored = {
        s: m.get("val/embed/subcategory", -1) + m.get("val/embed/top5", -1) for s, m in main.items() if m
    }
    summary["best_seed"] = max(scored, key=scored.get) if scored else None
    summary["vae_judge"] = {
        p.stem.removeprefix("vae_judge_"): json.loads(p.read_text("utf-8"))
        for p in sorted(chain.results.glob("vae_judge_*.json"))
    }
    kg = {s: json.loads((chain.seed_dir(s) / "kg/config.json").read_text("utf-8")).get("metrics", {})
          for s in chain.all_seeds() if (chain.seed_dir(s) / "kg/config.json").exists()}  # fmt: skip
    summary["transe"] = kg
    summary["timings"] = (
        json.loads((chain.results / "timings.json").read_text("utf-8"))
        if (chain.results / "timings.json").exists()
        else {}
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False), "utf-8")
    (out / "summary.md").write_text(summary_markdown(summary), "utf-8")
    print(summary_markdown(summary), flush=True)
    return summary


def _last_step(log: Path) -> int | None:
    """The last step a training log reports (its progress lines: ``step N/M``). Not last.ckpt: that
    is written every ``every_n_train_steps``, so a run ending between two is under-counted."""
    import re

    if not log.exists():
        return None
    steps = re.findall(r"^step (\d+)/\d+", log.read_text("utf-8", errors="replace"), flags=re.MULTILINE)
    return int(steps[-1]) if steps else None


ROWS = [  # (label, key) of the summary table, in the order
    ("seen, top-1", "seen/{m}/top1"), ("seen, top-5", "seen/{m}/top5"),
    ("seen, background", "seen/{m}/background"), ("seen, position", "seen/{m}/position"),
    ("alias, top-1", "alias/{m}/top1"), ("alias zh-Hant, top-1", "alias/zh_hant/{m}/top1"),
    ("alias keyword, top-1", "alias/keyword/{m}/top1"),
    ("held-out, subcategory", "heldout/{m}/subcategory"), ("held-out, top-5", "heldout/{m}/top5"),
    ("held-out, top-1", "heldout/{m}/top1"), ("validation, subcategory", "val/{m}/subcategory"),
    ("judge-feature Fréchet, seen", "seen/{m}/frechet"),
]  # fmt: skip


def _cell(table: dict[str, Any], key: str) -> str:
    v = table.get(key)
    if v is None:
        return "–"
    return f"{v['mean']:.1f}" + (f" ± {v['sd']:.1f}" if v["sd"] is not None else "")


def summary_markdown(summary: dict[str, Any]) -> str:
    lines = ["# emoji-zh chain", ""]
    for name, arm in summary["arms"].items():
        t = arm["measures"]
        lines += [f"## arm {name} (U-Net {arm['unet']} {arm['changes'] or ''}, {arm['latent']}² latents, "
                  f"VAE {arm.get('vae')}; "
                  f"seeds {arm['seeds']}; steps {arm['unet_steps']}; guidance {arm['guidance']})", "",
                  "| measure | embed | both | text | off |", "|---|---:|---:|---:|---:|"]  # fmt: skip
        for label, key in ROWS:
            lines.append(
                f"| {label} | "
                + " | ".join(_cell(t, key.format(m=m)) for m in ("embed", "both", "text", "off"))
                + " |"
            )
        style = t.get("seen/real/style_vs_style")
        if style:
            lines.append(f"| real style vs style (judge-feature Fréchet) | {style['mean']:.2f} | | | |")
        lines.append("")
    if summary.get("vae_judge"):
        lines += ["## the VAEs read back by the judge", ""]
        for name, record in summary["vae_judge"].items():
            v, val = record["test"], record["val"]
            lines.append(f"- {name}: top-1 {v['top1']:.1f} %, top-5 {v['top5']:.1f} % of {v['images']} test renders "
                         f"(the renders themselves: {v['real_top1']:.1f} %); PSNR {v['psnr']:.2f} dB; "
                         f"validation top-1 {val['top1']:.1f} %")  # fmt: skip
    lines += ["", f"best seed (main arm, on validation): {summary.get('best_seed')}", ""]
    return "\n".join(lines) + "\n"


# ---- the VAE read back by the judge ------------------------------------------------------------


def vae_judge(out: Path, vae: Path, target: Path, smoke: bool) -> int:
    """Encode and decode real renders with the VAE; the judge reads both: the ceiling of a U-Net on it.
    On the validation renders (what ``vae: best`` chooses by) and on the test renders (the report)."""
    import torch
    from diffusers import AutoencoderKL

    from rapiddiff.eval.judge import load_judge

    device = "cuda" if torch.cuda.is_available() else "cpu"
    judge = load_judge(ROOT / "benchmarks/emoji_judge", device=device)
    model = AutoencoderKL.from_pretrained(str(vae)).to(device).eval()
    record: dict[str, Any] = {"vae": str(vae)}
    for split in ("val", "test"):
        strip = target.with_suffix(".png") if split == "test" else None
        record[split] = _judge_reconstructions(
            out / "data" / split, model, judge, 16 if smoke else 800, strip
        )
    target.write_text(json.dumps(record, indent=1), "utf-8")
    print(record)
    return 0


def _judge_reconstructions(
    split: Path, model: Any, judge: Any, limit: int, strip: Path | None
) -> dict[str, Any]:
    import numpy as np
    import torch
    from PIL import Image

    device = next(model.parameters()).device
    rows = [json.loads(line) for line in (split / "metadata.jsonl").open(encoding="utf-8")][:limit]
    hits = real_hits = top5 = 0
    psnr = []
    for start in range(0, len(rows), 64):
        batch = rows[start : start + 64]
        pixels = torch.stack([
            torch.from_numpy(np.array(Image.open(split / r["file_name"]).convert("RGB"))).permute(2, 0, 1)
            for r in batch
        ]).float().div(255).to(device)  # fmt: skip
        with torch.no_grad():
            recon = (
                model.decode(model.encode(pixels * 2 - 1).latent_dist.mode()).sample.add(1).div(2).clamp(0, 1)
            )
        psnr += (-10 * torch.log10(((recon - pixels) ** 2).mean((1, 2, 3)).clamp_min(1e-10))).tolist()
        guesses, _ = judge.read(recon.float().cpu(), k=5)
        real, _ = judge.read(pixels.float().cpu(), k=5)
        for r, g, g_real in zip(batch, guesses, real, strict=True):
            hits += g[0] == r["entity"]
            top5 += r["entity"] in g
            real_hits += g_real[0] == r["entity"]
        if start == 0 and strip is not None:  # a strip of 8 pairs: render above, reconstruction below
            pairs = torch.cat([pixels[:8], recon[:8]], dim=2).permute(0, 2, 3, 1).cpu().numpy()
            Image.fromarray((np.concatenate(list(pairs), axis=1) * 255).astype("uint8")).save(strip)
    n = len(rows)
    return {"images": n, "top1": 100 * hits / n, "top5": 100 * top5 / n, "real_top1": 100 * real_hits / n,
            "psnr": float(np.mean(psnr))}  # fmt: skip


def _parse_sets(pairs: list[str]) -> dict[str, Any]:
    import yaml

    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = yaml.safe_load(value)
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--config", type=Path, default=ROOT / "configs/emoji/chain.yaml")
    p.add_argument(
        "--packages",
        action="append",
        default=[],
        help="emoji-zh's npm packages (folder or tarballs); repeatable",
    )
    p.add_argument("--part", default="all", choices=("all", "prep", "unet", "eval", "summary", "vae-judge"))
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a chain config key, YAML value"
    )
    p.add_argument("--smoke", action="store_true", help="every stage for a few steps (a CPU check)")
    p.add_argument("--pack", type=Path, help="after --part prep: write what the U-Nets need to this .tgz")
    p.add_argument("--unpack", type=Path, help="before --part unet: a --pack archive from an earlier call")
    p.add_argument("--vae", type=Path, help="(--part vae-judge) the VAE folder")
    p.add_argument("--target", type=Path, help="(--part vae-judge) the JSON to write")
    args = p.parse_args()
    if args.part == "vae-judge":
        return vae_judge(args.out, args.vae, args.target, args.smoke)
    try:
        cfg = load_chain_config(args.config, _parse_sets(args.set))
    except ConfigError as err:
        raise SystemExit(str(err)) from err
    packages = args.packages or [p for p in [os.environ.get("RAPIDDIFF_EMOJI_PACKAGES")] if p]
    chain = EmojiChain(args.out, cfg, packages, args.smoke)
    start = time.time()
    if args.unpack:
        unpack(args.unpack, args.out)
    if args.part in ("all", "prep"):
        chain.prep()
        if args.pack:
            pack(chain, args.pack)
    if args.part in ("all", "unet"):
        chain.unet_and_eval()
    if args.part == "eval":
        chain.evaluate()
    summary = summarise(chain)
    if args.part in ("all", "unet", "eval", "summary"):
        chain.assemble(summary)
    print(f"[emoji-chain] {args.part} done in {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

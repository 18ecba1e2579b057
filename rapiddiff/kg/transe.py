"""TransE through pykeen's pipeline → a KnowledgeStore with held-out link-prediction metrics.

The data is a pykeen built-in dataset by name (nations, umls and kinships ship inside the pykeen
wheel and load offline) or the user's triples TSV (+ optional aliases TSV), split by ratio with
pykeen's splitter, which keeps every entity in the training part. Evaluation is pykeen's
filtered rank-based evaluation on the test part (training and validation triples filtered);
early stopping watches the validation part. The store keeps ALL triples of the KG as its
facts, and its vectors are those the model learned on the training part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rapiddiff.kg.store import KnowledgeStore
from rapiddiff.kg.triples import group_triples, read_aliases, read_triples_array
from rapiddiff.utils.config import config_to_dict, load_config
from rapiddiff.utils.device import resolve_device
from rapiddiff.utils.io import atomic_open
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    from rapiddiff.kg.store import KnowledgeStore
    from rapiddiff.kg.triples import Skipped

log = get_logger(__name__)

# pykeen loss names accepted here (pykeen's class resolver keys; see pykeen.losses).
LOSSES = ("marginranking", "softplus", "nssa", "bcewithlogits", "crossentropy")
OPTIMIZERS = ("adam", "adamw", "adagrad", "adadelta", "sgd")
# Datasets whose files are inside the pykeen wheel, so they load without a network.
OFFLINE_DATASETS = ("nations", "umls", "kinships")


@dataclass
class TransEConfig:
    """Everything ``rapiddiff kg train`` needs; one YAML file per run (configs/kg/*.yaml)."""

    out: Path = Path("runs/kg/store")
    """Folder to write the KnowledgeStore to."""
    dataset: str | None = None
    """A pykeen built-in dataset by name (nations, umls, kinships load offline); or use ``triples``."""
    triples: Path | None = None
    """A triples TSV (head<TAB>relation<TAB>tail); split into train/validation/test by ``split``."""
    aliases: Path | None = None
    """Optional aliases TSV (entity<TAB>alias1|alias2) for the store's linker."""
    bad_lines: Literal["skip", "error"] = "skip"
    """A malformed line of ``triples`` or ``aliases`` (bad UTF-8, not 3 / 2 columns, an empty field,
    an alias of an entity the triples lack): skip it (counted and named in the log, in the store's
    config.json and in OUT/skipped_lines.tsv), or error: the first one stops, naming file and line."""
    split: list[float] = field(default_factory=lambda: [0.8, 0.1, 0.1])
    """Train / validation / test ratios for a triples TSV (sum to 1)."""
    embedding_dim: int = 64
    scoring_norm: int = 1
    """p of the Lp distance ||h + r - t|| (1 or 2)."""
    training_loop: Literal["slcwa", "lcwa"] = "slcwa"
    """slcwa: sampled negatives (classic TransE); lcwa: score every tail (pykeen's best on Kinships)."""
    loss: str = "marginranking"
    margin: float | None = None
    """Margin of marginranking/nssa loss (pykeen's default when null)."""
    adversarial_temperature: float | None = None
    """Temperature of the nssa loss (pykeen's default when null)."""
    label_smoothing: float | None = None
    """Label smoothing for lcwa with crossentropy/bcewithlogits."""
    label_smoothing_style: Literal["row", "label"] = "row"
    """How crossentropy spreads ``label_smoothing`` over a row of true tails. row (pykeen >= 1.x):
    L1-normalise the row, then (1-eps)*p + eps/C, so the k true tails share 1-eps. label (pykeen
    <= 1.0, what pykeen's 2020 ablation study trained with): smooth each label on its own
    (1 -> 1-eps, 0 -> eps/(C-1)), then L1-normalise, so the true tails keep k(1-eps) of the raw
    mass -- on Kinships at eps=0.846 that is 0.44 of the row instead of 0.20. Copying an ablation
    config's eps needs ``label``."""
    negatives_per_positive: int = 1
    """Corrupted triples per true one (slcwa only)."""
    create_inverse_triples: bool = False
    """Add (t, r⁻¹, h) for every triple (pykeen's ablation found it helps on Kinships)."""
    optimizer: str = "adam"
    lr: float = 0.01
    weight_decay: float = 0.0
    batch_size: int = 256
    epochs: int = 100
    early_stopping: bool = True
    """Stop when validation ``early_stopping_metric`` has not improved for ``patience`` checks."""
    early_stopping_frequency: int = 10
    """Evaluate on the validation part every this many epochs."""
    early_stopping_patience: int = 2
    early_stopping_delta: float = 0.002
    """Minimum relative improvement that counts."""
    early_stopping_metric: str = "hits_at_10"
    seed: int = 42
    device: str = "auto"
    """auto, cpu, cuda or cuda:N."""
    num_threads: int | None = None
    """torch CPU threads (null: torch's default)."""
    eval_batch_size: int | None = 256
    """Batch size of evaluation (null: pykeen finds one that fits)."""
    eval_max_triples: int | None = None
    """Evaluate on at most this many test triples (a seeded sample; null: all of them). Filtered
    ranking scores every entity for every test triple: for an OpenKG-sized graph (14 M test
    triples × 16 M entities) all of them would take days, 10,000 take seconds. The sample is
    filtered against every known triple, as the full evaluation is. Needs early_stopping: false."""
    progress: bool = True
    """Show pykeen's progress bars."""
    train_on_all: bool = False
    """After measuring on held-out triples, train again on ALL triples for as many epochs as the
    measured run took, and store those vectors: a downstream user (the text encoder) needs every
    fact in the vectors. The saved metrics stay those of the held-out run."""

    def __post_init__(self) -> None:
        self._check_source()
        self._check_training()
        self._check_evaluation()
        self._check_smoothing()

    def _check_source(self) -> None:
        if (self.dataset is None) == (self.triples is None):
            raise ValueError(
                "give exactly one of 'dataset' (a pykeen dataset name) or 'triples' (a TSV file)"
            )
        if self.dataset is not None and self.aliases is not None:
            raise ValueError("'aliases' goes with 'triples'; pykeen datasets have no aliases")
        if len(self.split) != 3 or any(r <= 0 for r in self.split) or abs(sum(self.split) - 1) > 1e-6:
            raise ValueError(
                f"'split' must be three positive ratios summing to 1 (train, validation, test), got {self.split}"
            )

    def _check_training(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss '{self.loss}'; choose one of: {', '.join(LOSSES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer '{self.optimizer}'; choose one of: {', '.join(OPTIMIZERS)}")
        if self.scoring_norm not in (1, 2):
            raise ValueError(f"'scoring_norm' must be 1 or 2, got {self.scoring_norm}")
        for name in (
            "embedding_dim",
            "negatives_per_positive",
            "batch_size",
            "epochs",
            "early_stopping_frequency",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"'{name}' must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"'lr' must be positive, got {self.lr}")
        if self.training_loop == "lcwa" and self.loss in ("marginranking", "nssa"):
            raise ValueError(
                f"loss '{self.loss}' needs sampled negatives; use training_loop: slcwa or loss crossentropy"
            )

    def _check_evaluation(self) -> None:
        if self.eval_max_triples is not None and self.eval_max_triples < 1:
            raise ValueError(f"'eval_max_triples' must be at least 1 or null, got {self.eval_max_triples}")
        if self.eval_max_triples is not None and self.early_stopping:
            raise ValueError(
                "'eval_max_triples' is for graphs too large to evaluate whole, where early stopping's "
                "validation would be as slow: set early_stopping: false (or eval_max_triples: null)"
            )
        if self.early_stopping_patience < 0:
            raise ValueError(f"'early_stopping_patience' must be >= 0, got {self.early_stopping_patience}")

    def _check_smoothing(self) -> None:
        if self.label_smoothing is not None and not 0 <= self.label_smoothing < 1:
            raise ValueError(f"'label_smoothing' must be in [0, 1), got {self.label_smoothing}")
        if self.label_smoothing and self.training_loop != "lcwa":
            raise ValueError("'label_smoothing' needs training_loop: lcwa")
        if self.label_smoothing_style not in ("row", "label"):
            raise ValueError(
                f"'label_smoothing_style' must be 'row' or 'label', got '{self.label_smoothing_style}'"
            )
        if self.label_smoothing_style == "label" and self.loss != "crossentropy":
            raise ValueError(
                "'label_smoothing_style: label' only changes loss crossentropy (bcewithlogits already "
                "smooths each label); set loss: crossentropy or drop the key"
            )


def load_transe_config(path: str | Path, **overrides: Any) -> TransEConfig:
    """A :class:`TransEConfig` from YAML; unknown keys name the valid ones."""

    return load_config(TransEConfig, path, **overrides)


def _load_data(
    cfg: TransEConfig, skipped: Skipped | None = None
) -> tuple[Any, Any, dict[str, list[str]] | None]:
    """(pykeen Dataset with train/validation/test, all triples as a TriplesFactory, aliases);
    malformed lines are skipped into ``skipped`` where it is given, else raise."""
    import torch
    from pykeen.datasets import get_dataset
    from pykeen.datasets.base import EagerDataset
    from pykeen.triples import TriplesFactory

    if cfg.dataset is not None:
        if cfg.dataset.lower() not in OFFLINE_DATASETS:
            log.warning(
                "dataset '%s' is not one that ships with pykeen; pykeen may try to download it", cfg.dataset
            )
        dataset = get_dataset(
            dataset=cfg.dataset, dataset_kwargs={"create_inverse_triples": cfg.create_inverse_triples}
        )
        return dataset, None, None

    # Ids straight from the file (pyarrow + numpy): the same ids as pykeen's from_labeled_triples,
    # without a Python tuple or a numpy string per triple.
    # Sorted as pykeen's from_labeled_triples sorts them (np.unique), so splits match it.
    ids, entity_names, relation_names = read_triples_array(cfg.triples, sort=True, skipped=skipped)
    full = TriplesFactory(
        mapped_triples=torch.from_numpy(ids),
        entity_to_id={name: i for i, name in enumerate(entity_names)},
        relation_to_id={name: i for i, name in enumerate(relation_names)},
        create_inverse_triples=cfg.create_inverse_triples,
    )
    aliases = None
    if cfg.aliases is not None:
        aliases = read_aliases(cfg.aliases, entities=full.entity_to_id, skipped=skipped)
    train_ratio, val_ratio, test_ratio = cfg.split
    training, validation, testing = coverage_split(full, [train_ratio, val_ratio, test_ratio], cfg.seed)
    dataset = EagerDataset(training=training, testing=testing, validation=validation)
    return dataset, full, aliases


def coverage_split(factory: Any, ratios: list[float], seed: int) -> list[Any]:
    """``factory.split(ratios, random_state=seed)`` (pykeen's default coverage splitter), vectorised.

    The same parts, triple for triple (a test compares them): one triple per relation, then per
    head and per tail entity not yet covered, each the first such triple in row order, goes to
    training; the rest is split by the same ``randperm``. pykeen finds that cover with pandas
    group-bys and Python sets of row numbers (a 140 M-row frame copied per step: minutes and
    tens of GB at OpenKG's size); here each first row is one ``scatter_reduce`` over a column.
    """
    import torch
    from pykeen.triples.splitting import get_absolute_split_sizes, normalize_ratios
    from pykeen.utils import ensure_torch_random_state

    mapped = factory.mapped_triples
    n = len(mapped)
    sizes = get_absolute_split_sizes(n_total=n, ratios=normalize_ratios(ratios))
    rows = torch.arange(n)

    def first_rows(column: int, size: int, rows: Any) -> Any:  # first row of each id (n: none)
        return torch.full((size,), n).scatter_reduce_(0, mapped[:, column], rows, reduce="amin")

    seed_mask = torch.zeros(n, dtype=torch.bool)
    first = first_rows(1, factory.num_relations, rows)
    seed_mask[first[first < n]] = True
    for column in (0, 2):
        covered = torch.zeros(factory.num_entities, dtype=torch.bool)
        chosen = mapped[seed_mask]
        covered[chosen[:, 0]] = True
        covered[chosen[:, 2]] = True
        first = first_rows(column, factory.num_entities, rows)
        seed_mask[first[(first < n) & ~covered]] = True
    del rows, first
    train_seed, remaining = mapped[seed_mask], mapped[~seed_mask]
    if len(train_seed) > sizes[0]:
        sizes = _covering_sizes(n, len(train_seed), ratios)
        log.warning(
            "%d triples: a training part of %.0f%% (%d) cannot hold one triple of each of the %d "
            "entities and %d relations (%d needed); split as %d train / %d validation / %d test instead. "
            "A larger KG, or a larger first 'split' ratio, keeps the configured split.",
            n,
            100 * ratios[0] / sum(ratios),
            get_absolute_split_sizes(n_total=n, ratios=normalize_ratios(ratios))[0],
            factory.num_entities,
            factory.num_relations,
            len(train_seed),
            *sizes,
        )
    sizes = [sizes[0] - len(train_seed), *sizes[1:]]
    permutation = torch.randperm(len(remaining), generator=ensure_torch_random_state(seed))
    # index_select: the same rows as pykeen's remaining[part], 3x faster than advanced indexing
    train, *rest = (remaining.index_select(0, part) for part in permutation.split(sizes))
    parts = [torch.cat([train_seed, train]), *rest]
    # as pykeen's split: inverse triples (if any) only for training
    return [
        factory.clone_and_exchange_triples(mapped_triples=t, create_inverse_triples=None if i == 0 else False)
        for i, t in enumerate(parts)
    ]


def _covering_sizes(n: int, needed: int, ratios: list[float]) -> list[int]:
    """Split sizes for a KG too small for its ratios: the ``needed`` covering triples train, the
    rest is held out, validation and test in their configured proportion."""
    held = n - needed
    validation = int(held * ratios[1] / (ratios[1] + ratios[2]))
    return [needed, validation, held - validation]


def _held_out_or_training(dataset: Any) -> tuple[Any, str | None]:
    """``dataset`` with an empty test part replaced by the training triples (and an empty
    validation part by the test part), and a note saying so; a KG whose every triple covers an
    entity or relation has nothing to hold out, yet still trains."""
    from pykeen.datasets.base import EagerDataset

    testing, validation, note = dataset.testing, dataset.validation, None
    if testing.num_triples == 0:
        testing, note = dataset.training, "on the training triples (the KG is too small to hold any out)"
    if validation.num_triples == 0:
        validation = testing
        note = note or "early stopping on the test triples (the KG is too small for a validation part)"
    if note is None:
        return dataset, None
    log.warning("TransE metrics %s", note)
    return EagerDataset(training=dataset.training, testing=testing, validation=validation), note


def _metrics(metric_results: Any) -> dict[str, float]:
    """Filtered link-prediction metrics on the test part (both head and tail prediction).

    Ranks are pykeen's "realistic" ones (ties share the mean rank); Hits@10 is also given with
    optimistic (ties rank first) and pessimistic (ties rank last) ranks, as older papers and
    pykeen 0.x results files reported those too.
    """
    get = metric_results.get_metric
    return {
        "mrr": float(get("both.realistic.inverse_harmonic_mean_rank")),
        "mean_rank": float(get("both.realistic.arithmetic_mean_rank")),
        "hits_at_1": float(get("both.realistic.hits_at_1")),
        "hits_at_3": float(get("both.realistic.hits_at_3")),
        "hits_at_10": float(get("both.realistic.hits_at_10")),
        "hits_at_10_optimistic": float(get("both.optimistic.hits_at_10")),
        "hits_at_10_pessimistic": float(get("both.pessimistic.hits_at_10")),
    }


def make_loss(cfg: TransEConfig) -> Any:
    """The pykeen loss for ``cfg``: its name, or a loss object where pykeen's own differs.

    ``label_smoothing_style: label`` needs a cross-entropy that smooths each label before the row
    is normalised (pykeen <= 1.0); pykeen >= 1.x normalises first and has no switch for it.
    """
    if cfg.loss != "crossentropy" or cfg.label_smoothing_style != "label":
        return cfg.loss
    from pykeen.losses import CrossEntropyLoss

    class PerLabelSmoothingCrossEntropyLoss(CrossEntropyLoss):
        def process_lcwa_scores(  # type: ignore[override]
            self,
            predictions: Any,
            labels: Any,
            label_smoothing: float | None = None,
            num_entities: int | None = None,
            weights: Any = None,
        ) -> Any:
            if label_smoothing:
                num_classes = labels.shape[-1]
                labels = labels * (1.0 - label_smoothing) + (1.0 - labels) * (
                    label_smoothing / (num_classes - 1)
                )
            # pykeen's own method then L1-normalises the row and takes the soft-target cross-entropy
            return super().process_lcwa_scores(
                predictions, labels, label_smoothing=None, num_entities=num_entities, weights=weights
            )

    return PerLabelSmoothingCrossEntropyLoss()


def train_transe(cfg: TransEConfig, *, save: bool = True) -> tuple[KnowledgeStore, dict[str, Any]]:
    """Train TransE as configured; write the store to ``cfg.out`` (unless ``save=False``).

    Returns the store and a dict of metrics (filtered MRR, mean rank, Hits@1/3/10 on the test
    triples) plus training facts (epochs run, seconds).
    """
    import torch

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device = resolve_device(cfg.device)
    loading = time.perf_counter()
    skipped: Skipped | None = [] if cfg.bad_lines == "skip" else None
    dataset, full, aliases = _load_data(cfg, skipped)
    dataset, held_out_note = _held_out_or_training(dataset)
    load_seconds = time.perf_counter() - loading
    log.info(
        "data: %d entities, %d relations; %d train / %d validation / %d test triples",
        dataset.training.num_entities,
        dataset.training.real_num_relations,
        dataset.training.num_triples,
        dataset.validation.num_triples if dataset.validation is not None else 0,
        dataset.testing.num_triples,
    )

    started = time.perf_counter()
    evaluated = _evaluation_sample(cfg, dataset)
    if evaluated is None:
        result = _run_pipeline(cfg, dataset, device, epochs=cfg.epochs, early_stopping=cfg.early_stopping)
        model, losses, fit_seconds, metric_results = (
            result.model,
            result.losses,
            result.train_seconds,
            result.metric_results,
        )
    else:
        model, losses, fit_seconds = _train_loop(cfg, dataset, device, epochs=cfg.epochs)
        evaluating = time.perf_counter()
        metric_results = _filtered_evaluation(cfg, model, dataset, evaluated)
        log.info("evaluated in %.1f s", time.perf_counter() - evaluating)
    seconds = time.perf_counter() - started
    metrics: dict[str, Any] = _metrics(metric_results)
    epochs_run = len(losses)
    metrics.update(
        epochs_run=epochs_run,
        train_seconds=round(seconds, 2),
        epoch_seconds=round(fit_seconds / max(epochs_run, 1), 3),
        final_loss=float(losses[-1]) if losses else None,
        test_triples=int(dataset.testing.num_triples),
        evaluated_triples=int(dataset.testing.num_triples if evaluated is None else len(evaluated)),
        load_seconds=round(load_seconds, 2),
        skipped_lines=len(skipped or []),
    )
    log.info(
        "TransE test (filtered): MRR %.4f  MR %.2f  Hits@1 %.4f  Hits@3 %.4f  Hits@10 %.4f  (%d epochs, %.0f s)",
        metrics["mrr"],
        metrics["mean_rank"],
        metrics["hits_at_1"],
        metrics["hits_at_3"],
        metrics["hits_at_10"],
        epochs_run,
        seconds,
    )

    if cfg.train_on_all:
        all_data = _all_triples_dataset(dataset, full)
        log.info(
            "training again on all %d triples for %d epochs (train_on_all)",
            all_data.training.num_triples,
            epochs_run,
        )
        if evaluated is None:
            model = _run_pipeline(
                cfg, all_data, device, epochs=max(epochs_run, 1), early_stopping=False
            ).model
        else:
            model = _train_loop(cfg, all_data, device, epochs=max(epochs_run, 1))[0]
    store = _to_store(model, dataset, full, aliases)
    store.config.update(
        model="TransE",
        scoring_norm=cfg.scoring_norm,
        metrics={k: metrics[k] for k in ("mrr", "mean_rank", "hits_at_1", "hits_at_3", "hits_at_10")},
        evaluation="filtered rank-based link prediction on the test triples (head and tail), pykeen"
        + (f"; {held_out_note}" if held_out_note else ""),
        training={**metrics, "config": config_to_dict(cfg)},
        vectors_from="all triples (train_on_all)" if cfg.train_on_all else "training split",
        source=cfg.dataset or str(cfg.triples),
        pykeen_version=_pykeen_version(),
    )
    if save:
        saving = time.perf_counter()
        store.save(cfg.out)
        _write_skipped(Path(cfg.out) / SKIPPED_LINES, skipped or [])
        log.info("KnowledgeStore written to %s in %.1f s", cfg.out, time.perf_counter() - saving)
    return store, metrics


SKIPPED_LINES = "skipped_lines.tsv"


def _write_skipped(path: Path, skipped: Skipped) -> None:
    """Every skipped line as ``file:line<TAB>reason`` (none: no file; an earlier run's is removed)."""

    if not skipped:
        path.unlink(missing_ok=True)
        return
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write("where\treason\n")
        f.writelines(f"{where}\t{reason}\n" for where, reason in skipped)
    log.warning("%d malformed line(s) skipped: all are listed in %s", len(skipped), path)


def _evaluation_sample(cfg: TransEConfig, dataset: Any) -> Any:
    """A seeded sample of ``eval_max_triples`` test triples, or None to evaluate on all of them."""
    import torch

    n = dataset.testing.num_triples
    if cfg.eval_max_triples is None or n <= cfg.eval_max_triples:
        return None
    generator = torch.Generator().manual_seed(cfg.seed)
    pick = torch.randperm(n, generator=generator)[: cfg.eval_max_triples].sort().values
    log.info("evaluating on %d of the %d test triples (eval_max_triples)", len(pick), n)
    return dataset.testing.mapped_triples[pick]


def _train_loop(
    cfg: TransEConfig, dataset: Any, device: Any, *, epochs: int
) -> tuple[Any, list[float], float]:
    """TransE trained by pykeen's training loop itself: (model, losses per epoch, seconds).

    The same model, loss, optimizer and negative sampler as :func:`_run_pipeline`, without the
    pipeline's closing evaluation: for a graph of 100 M triples that evaluation hashes every
    filter triple through Python lists (pykeen's ``triple_hash``) and deduplicates them on the
    CPU, which takes longer than the training. :func:`_filtered_evaluation` follows instead.
    """
    from pykeen.losses import loss_resolver
    from pykeen.models import TransE
    from pykeen.optimizers import optimizer_resolver
    from pykeen.training import LCWATrainingLoop, SLCWATrainingLoop
    from pykeen.utils import set_random_seed

    set_random_seed(cfg.seed)
    training = dataset.training
    model = TransE(
        triples_factory=training,
        embedding_dim=cfg.embedding_dim,
        scoring_fct_norm=cfg.scoring_norm,
        loss=loss_resolver.make(make_loss(cfg), _loss_kwargs(cfg)),
        random_seed=cfg.seed,
    ).to(device)
    optimizer = optimizer_resolver.make(
        cfg.optimizer, {"lr": cfg.lr, "weight_decay": cfg.weight_decay}, params=model.get_grad_params()
    )
    if cfg.training_loop == "slcwa":
        loop: Any = SLCWATrainingLoop(
            model=model,
            triples_factory=training,
            optimizer=optimizer,
            negative_sampler="basic",
            negative_sampler_kwargs={"num_negs_per_pos": cfg.negatives_per_positive},
        )
    else:
        loop = LCWATrainingLoop(model=model, triples_factory=training, optimizer=optimizer)
    extra = {"label_smoothing": cfg.label_smoothing} if cfg.label_smoothing else {}
    started = time.perf_counter()
    losses = loop.train(
        triples_factory=training,
        num_epochs=epochs,
        batch_size=cfg.batch_size,
        use_tqdm=cfg.progress,
        **extra,
    )
    seconds = time.perf_counter() - started
    log.info("trained %d epochs in %.1f s (%.1f s an epoch)", epochs, seconds, seconds / max(epochs, 1))
    return model, list(losses or []), seconds


def _filtered_evaluation(cfg: TransEConfig, model: Any, dataset: Any, mapped: Any) -> Any:
    """pykeen's filtered rank-based evaluation of ``mapped`` against every known triple.

    Called instead of the pipeline's own filtered evaluation when the test triples are sampled:
    pykeen's pipeline hashes every filter triple through Python lists (``triple_hash``), which
    for 100 M triples takes longer than the training. The filter triples are made distinct here,
    on the model's device, through one int64 key per triple (a radix sort of 140 M keys), and
    handed to pykeen's evaluator as they are: its own ``prepare_filter_triples`` would take the
    same set with ``unique(dim=0)``, a row-comparing sort whose time and memory at this size are
    unknown (one attempt at 140 M triples reached 78 GB of GPU memory in its first 9 s).
    """
    from unittest import mock

    import pykeen.evaluation.evaluator as pykeen_evaluator
    import torch
    from pykeen.evaluation import RankBasedEvaluator

    parts = [dataset.training, dataset.validation, dataset.testing]
    known = torch.cat([p.mapped_triples for p in parts if p is not None] + [mapped.cpu()]).to(model.device)
    n_entities, n_relations = dataset.training.num_entities, dataset.training.num_relations
    patch: Any = None
    if n_entities * n_entities * n_relations < 2**63 and hasattr(pykeen_evaluator, "prepare_filter_triples"):
        keys = torch.unique((known[:, 0] * n_relations + known[:, 1]) * n_entities + known[:, 2])
        del known
        heads, rest = (
            keys.div(n_relations * n_entities, rounding_mode="floor"),
            keys % (n_relations * n_entities),
        )
        del keys
        known = torch.stack([heads, rest.div(n_entities, rounding_mode="floor"), rest % n_entities], dim=1)
        del heads, rest

        def prepare(*args: Any, **kwargs: Any) -> Any:  # every evaluation triple is in ``known``
            return known

        patch = mock.patch.object(pykeen_evaluator, "prepare_filter_triples", prepare)
    evaluator = RankBasedEvaluator(filtered=True)
    with patch if patch is not None else contextlib.nullcontext():
        return evaluator.evaluate(
            model,
            mapped.to(model.device),
            additional_filter_triples=[known],
            batch_size=cfg.eval_batch_size,
            use_tqdm=cfg.progress,
        )


def _loss_kwargs(cfg: TransEConfig) -> dict[str, Any] | None:
    """The loss's settings that are set (None: the loss's defaults), for pipeline and training loop."""
    kwargs: dict[str, Any] = {}
    if cfg.margin is not None:
        kwargs["margin"] = cfg.margin
    if cfg.adversarial_temperature is not None:
        kwargs["adversarial_temperature"] = cfg.adversarial_temperature
    return kwargs or None


def _run_pipeline(cfg: TransEConfig, dataset: Any, device: Any, *, epochs: int, early_stopping: bool) -> Any:
    from pykeen.pipeline import pipeline

    training_kwargs: dict[str, Any] = {
        "num_epochs": epochs,
        "batch_size": cfg.batch_size,
        "use_tqdm": cfg.progress,
    }
    if cfg.label_smoothing:
        training_kwargs["label_smoothing"] = cfg.label_smoothing
    stopper_kwargs = {
        "frequency": cfg.early_stopping_frequency,
        "patience": cfg.early_stopping_patience,
        "relative_delta": cfg.early_stopping_delta,
        "metric": cfg.early_stopping_metric,
        "evaluation_batch_size": cfg.eval_batch_size,
    }
    return pipeline(
        dataset=dataset,
        model="TransE",
        model_kwargs={"embedding_dim": cfg.embedding_dim, "scoring_fct_norm": cfg.scoring_norm},
        loss=make_loss(cfg),
        loss_kwargs=_loss_kwargs(cfg),
        training_loop=cfg.training_loop,
        negative_sampler="basic" if cfg.training_loop == "slcwa" else None,
        negative_sampler_kwargs={"num_negs_per_pos": cfg.negatives_per_positive}
        if cfg.training_loop == "slcwa"
        else None,
        optimizer=cfg.optimizer,
        optimizer_kwargs={"lr": cfg.lr, "weight_decay": cfg.weight_decay},
        training_kwargs=training_kwargs,
        stopper="early" if early_stopping else None,
        stopper_kwargs=stopper_kwargs if early_stopping else None,
        evaluator="rankbased",
        evaluation_kwargs={"batch_size": cfg.eval_batch_size, "use_tqdm": cfg.progress},
        random_seed=cfg.seed,
        device=device,
        use_tqdm=cfg.progress,
    )


def _all_triples_dataset(dataset: Any, full: Any) -> Any:
    """A dataset whose training part is every triple of the KG (same ids); test/validation kept."""
    import torch
    from pykeen.datasets.base import EagerDataset
    from pykeen.triples import TriplesFactory

    training = dataset.training
    if full is None:
        parts = [dataset.training, dataset.validation, dataset.testing]
        mapped = torch.unique(torch.cat([p.mapped_triples for p in parts if p is not None]), dim=0)
        full = TriplesFactory(
            mapped_triples=mapped,
            entity_to_id=training.entity_to_id,
            relation_to_id=training.relation_to_id,
            create_inverse_triples=training.create_inverse_triples,
        )
    return EagerDataset(training=full, testing=dataset.testing, validation=dataset.validation)


def _to_store(model: Any, dataset: Any, full: Any, aliases: dict[str, list[str]] | None) -> KnowledgeStore:
    import torch

    training = dataset.training
    entity_names = _names(training.entity_to_id)
    relation_names = _names(training.relation_to_id)
    with torch.no_grad():
        entities = model.entity_representations[0](indices=None).detach().float().cpu()
        relations = model.relation_representations[0](indices=None).detach().float().cpu()
    if training.create_inverse_triples:
        relations = relations[0::2]  # pykeen keeps relation r at 2r and its inverse at 2r + 1
    if full is not None:
        triples = full.mapped_triples
    else:  # a built-in dataset: its three parts share one id space
        parts = [dataset.training, dataset.validation, dataset.testing]
        triples = torch.cat([p.mapped_triples for p in parts if p is not None])
    triples = _sorted_unique(triples, len(entity_names), len(relation_names))
    return KnowledgeStore.from_arrays(
        entity_names, relation_names, entities, relations, triples=triples, aliases=aliases
    )


def _sorted_unique(triples: Any, n_entities: int, n_relations: int) -> Any:
    """``torch.unique(triples, dim=0)`` through one int64 key: seconds, not minutes, for 100 M rows.

    Rows already sorted and distinct (the full graph's, read by :func:`_load_data`) cost one
    linear check, not a second sort.
    """
    import numpy as np
    import torch

    array = triples.cpu().numpy().astype(np.int64, copy=False)
    return torch.from_numpy(group_triples(array, n_entities, n_relations))


def _names(label_to_id: dict[str, int]) -> list[str]:
    names = [""] * len(label_to_id)
    for label, i in label_to_id.items():
        names[i] = label
    return names


def _pykeen_version() -> str:
    from importlib.metadata import version

    return version("pykeen")


def config_fields() -> list[str]:
    """Names of the config keys (for --help text)."""
    return [f.name for f in dataclasses.fields(TransEConfig)]

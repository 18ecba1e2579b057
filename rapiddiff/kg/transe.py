"""TransE through pykeen's pipeline → a KnowledgeStore with held-out link-prediction metrics.

The data is a pykeen built-in dataset by name (nations, umls and kinships ship inside the pykeen
wheel and load offline) or the user's triples TSV (+ optional aliases TSV), split by ratio with
pykeen's splitter, which keeps every entity in the training part. Evaluation is pykeen's
filtered rank-based evaluation on the test part (training and validation triples filtered);
early stopping watches the validation part. The store keeps ALL triples of the KG as its
facts, and its vectors are those the model learned on the training part.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    from rapiddiff.kg.store import KnowledgeStore

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
    progress: bool = True
    """Show pykeen's progress bars."""
    train_on_all: bool = False
    """After measuring on held-out triples, train again on ALL triples for as many epochs as the
    measured run took, and store those vectors: a downstream user (the text encoder) needs every
    fact in the vectors. The saved metrics stay those of the held-out run."""

    def __post_init__(self) -> None:
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
        if self.early_stopping_patience < 0:
            raise ValueError(f"'early_stopping_patience' must be >= 0, got {self.early_stopping_patience}")
        if not self.lr > 0:
            raise ValueError(f"'lr' must be positive, got {self.lr}")
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
        if self.training_loop == "lcwa" and self.loss in ("marginranking", "nssa"):
            raise ValueError(
                f"loss '{self.loss}' needs sampled negatives; use training_loop: slcwa or loss crossentropy"
            )


def load_transe_config(path: str | Path, **overrides: Any) -> TransEConfig:
    """A :class:`TransEConfig` from YAML; unknown keys name the valid ones."""
    from rapiddiff.utils.config import load_config

    return load_config(TransEConfig, path, **overrides)


def _load_data(cfg: TransEConfig) -> tuple[Any, Any, dict[str, list[str]] | None]:
    """(pykeen Dataset with train/validation/test, all triples as a TriplesFactory, aliases)."""
    import numpy as np
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

    from rapiddiff.kg.triples import read_aliases, read_triples

    labeled = np.asarray(read_triples(cfg.triples), dtype=str)
    full = TriplesFactory.from_labeled_triples(labeled, create_inverse_triples=cfg.create_inverse_triples)
    aliases = None
    if cfg.aliases is not None:
        aliases = read_aliases(cfg.aliases, entities=full.entity_to_id)
    train_ratio, val_ratio, test_ratio = cfg.split
    training, validation, testing = full.split([train_ratio, val_ratio, test_ratio], random_state=cfg.seed)
    dataset = EagerDataset(training=training, testing=testing, validation=validation)
    return dataset, full, aliases


def _metrics(result: Any) -> dict[str, float]:
    """Filtered link-prediction metrics on the test part (both head and tail prediction).

    Ranks are pykeen's "realistic" ones (ties share the mean rank); Hits@10 is also given with
    optimistic (ties rank first) and pessimistic (ties rank last) ranks, as older papers and
    pykeen 0.x results files reported those too.
    """
    get = result.metric_results.get_metric
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

    from rapiddiff.utils.config import config_to_dict
    from rapiddiff.utils.device import resolve_device

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device = resolve_device(cfg.device)
    dataset, full, aliases = _load_data(cfg)
    log.info(
        "data: %d entities, %d relations; %d train / %d validation / %d test triples",
        dataset.training.num_entities,
        dataset.training.real_num_relations,
        dataset.training.num_triples,
        dataset.validation.num_triples if dataset.validation is not None else 0,
        dataset.testing.num_triples,
    )

    started = time.perf_counter()
    result = _run_pipeline(cfg, dataset, device, epochs=cfg.epochs, early_stopping=cfg.early_stopping)
    seconds = time.perf_counter() - started
    metrics: dict[str, Any] = _metrics(result)
    epochs_run = len(result.losses)
    metrics.update(
        epochs_run=epochs_run,
        train_seconds=round(seconds, 2),
        final_loss=float(result.losses[-1]) if result.losses else None,
        test_triples=int(dataset.testing.num_triples),
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

    model = result.model
    if cfg.train_on_all:
        all_data = _all_triples_dataset(dataset, full)
        log.info(
            "training again on all %d triples for %d epochs (train_on_all)",
            all_data.training.num_triples,
            epochs_run,
        )
        model = _run_pipeline(cfg, all_data, device, epochs=max(epochs_run, 1), early_stopping=False).model
    store = _to_store(model, dataset, full, aliases)
    store.config.update(
        model="TransE",
        scoring_norm=cfg.scoring_norm,
        metrics={k: metrics[k] for k in ("mrr", "mean_rank", "hits_at_1", "hits_at_3", "hits_at_10")},
        evaluation="filtered rank-based link prediction on the test triples (head and tail), pykeen",
        training={**metrics, "config": config_to_dict(cfg)},
        vectors_from="all triples (train_on_all)" if cfg.train_on_all else "training split",
        source=cfg.dataset or str(cfg.triples),
        pykeen_version=_pykeen_version(),
    )
    if save:
        store.save(cfg.out)
        log.info("KnowledgeStore written to %s", cfg.out)
    return store, metrics


def _run_pipeline(cfg: TransEConfig, dataset: Any, device: Any, *, epochs: int, early_stopping: bool) -> Any:
    from pykeen.pipeline import pipeline

    loss_kwargs: dict[str, Any] = {}
    if cfg.margin is not None:
        loss_kwargs["margin"] = cfg.margin
    if cfg.adversarial_temperature is not None:
        loss_kwargs["adversarial_temperature"] = cfg.adversarial_temperature
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
        loss_kwargs=loss_kwargs or None,
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

    from rapiddiff.kg.store import KnowledgeStore

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
    triples = torch.unique(triples, dim=0)
    return KnowledgeStore.from_arrays(
        entity_names, relation_names, entities, relations, triples=triples, aliases=aliases
    )


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

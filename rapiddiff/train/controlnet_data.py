"""The ControlNet stage's data: image–caption items with their conditioning image."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from rapiddiff.train.data import ImageTextData


@dataclass(frozen=True)
class ControlSource:
    """Where each item's conditioning image comes from, and what it shows."""

    type: str = "mask"
    """What the conditioning images show (recorded in the exported ControlNet folder): ``mask`` and
    ``canny`` can be made on the fly; any other name (``depth``, ``pose``, ...) needs ``column``."""
    column: str | None = None
    """A column of the data's metadata.jsonl (or table) with each row's conditioning image, a path
    relative to the folder as ``file_name`` (kshapes/emoji-zh built with ``--masks`` write
    ``mask``); null: made from the training image by the transform named ``type``."""

    def __post_init__(self) -> None:
        if self.column is None:
            from rapiddiff.data.control import control_transform

            control_transform(self.type)  # raises, naming the choices, for a type with no transform


_CONTROL = ControlSource()


class ControlImageTextData(ImageTextData):
    """:class:`~rapiddiff.train.data.ImageTextData` whose items carry ``"control"``, the
    conditioning image ``[3, H, W]`` in [0, 1] (:class:`rapiddiff.data.control.ControlImageTextDataset`).

    Args:
        control: the conditioning images: a data column, or a transform of the image (``mask``,
            ``canny``).
        **kwargs: the arguments of :class:`~rapiddiff.train.data.ImageTextData` (train, val,
            image_size, batch_size, num_workers, seed, dataset_options).
    """

    def __init__(self, *args: Any, control: ControlSource = _CONTROL, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.control = control

    def _open(self, source: str) -> Dataset:
        from rapiddiff.data.control import ControlImageTextDataset

        by = (
            {"control_column": self.control.column}
            if self.control.column
            else {"transform_name": self.control.type}
        )
        return ControlImageTextDataset(source, image_size=self.image_size, **by, **self.options)

    def setup(self, stage: str) -> None:
        if self.train_set is None:
            self.train_set = self._open(self.train_source)
        if self.val_source and self.val_set is None:
            self.val_set = self._open(self.val_source)

    def grid_items(self, n: int) -> tuple[torch.Tensor, list[str]]:
        """The first ``n`` validation items (training items without validation data): their
        conditioning images ``[n, 3, H, W]`` and captions, the rows of the sample grid."""
        if self.train_set is None:
            self.setup("fit")
        dataset: Any = self.val_set if self.val_set is not None else self.train_set
        items = [dataset[i] for i in range(min(n, len(dataset)))]
        return torch.stack([item["control"] for item in items]), [item["text"] for item in items]

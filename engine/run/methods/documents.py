"""Methods whose data are documents packed into rows (supervised tuning, preference pairs): the data hooks of
:class:`~engine.run.methods.base.TrainingMethod` over engine.data.prepare."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.config import DataConfig, RunConfig
from engine.data.files import Example
from engine.data.prepare import PreparedData, prepare_data
from engine.run.fit import dataset_size
from engine.run.methods.base import TrainingMethod
from engine.run.rows import longest_example


class DocumentMethod(TrainingMethod):
    """A method that trains on packed documents."""

    def prepare(
        self, config: DataConfig, tokenizer: Any, seed: int, extra_train: Sequence[Example] = ()
    ) -> PreparedData:
        return prepare_data(config, tokenizer, seed, self.name, extra_train=extra_train)

    def dataset_size(self, config: RunConfig, tokenizer: Any) -> tuple[int, int]:
        return dataset_size(config, tokenizer)

    def longest_document(self, config: RunConfig, tokenizer: Any) -> int:
        return longest_example(config.data, tokenizer)

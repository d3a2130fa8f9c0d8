"""What the doctor checks: the model, data, collator, loss, optimizer recipe and batch size,
read from `check_pipeline`'s arguments or from a Hugging Face Trainer, and validated before
anything runs (a wrong argument is a one-line TypeError or ValueError, not a failed step)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, default_collate

from .checklist import listed
from .labels import IGNORED_LABEL, LABEL_ALIASES
from .optimizers import OptimizerRecipe, rebuild_recipe, sgd_recipe, trainer_recipe
from .samples import ForwardInputs

__all__ = [
    "DEFAULT_BATCH_SIZE", "DEFAULT_SGD_LR", "PipelineSettings", "settings_from_arguments",
    "settings_from_trainer",
]

DEFAULT_BATCH_SIZE = 2
DEFAULT_SGD_LR = 1e-2


@dataclass
class PipelineSettings:
    """The pipeline under check, as the user's training would run it."""

    model: nn.Module  # the user's model; the run trains a copy
    dataset: Any
    collate_fn: Callable
    loss_fn: Callable | None  # None: the model's outputs carry the loss
    optimizer_recipe: OptimizerRecipe
    batch_size: int
    kept_columns: set[str] | None = None  # what a Trainer keeps (it drops the rest); None: all
    pipeline_name: str = "the pipeline"  # how messages name what feeds the collator

    @property
    def collator_only_stacks(self) -> bool:
        """A collator that only stacks or pads: raw text or stray columns in the samples break it.
        Other collate_fns may tokenize or build the inputs, so their batch is judged instead."""
        return self.collate_fn is default_collate or _is_transformers_object(self.collate_fn)

    @property
    def collator_renames_labels(self) -> bool:
        """transformers' collators rename label/label_ids to labels."""
        return _is_transformers_object(self.collate_fn)


def settings_from_arguments(model, data, collate_fn, loss_fn, optimizer, batch_size) -> PipelineSettings:
    """`check_pipeline(model, data, ...)`'s arguments; a DataLoader gives its dataset, collate_fn
    and batch size where the arguments do not."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"check_pipeline needs a torch.nn.Module or a transformers.Trainer, got "
            f"{type(model).__name__}: pass the model you train"
        )
    if data is None:
        raise TypeError(
            "check_pipeline(model, data) needs the training data: a Dataset, a DataLoader or a list of samples"
        )
    for name, value in (("collate_fn", collate_fn), ("loss_fn", loss_fn)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable, got {type(value).__name__}")
    if loss_fn is not None and loss_fn is model:
        raise TypeError("loss_fn is the model itself: pass the loss function, e.g. "
                        "loss_fn=torch.nn.CrossEntropyLoss()")
    if isinstance(loss_fn, type) and issubclass(loss_fn, nn.Module):  # (its call makes a module)
        raise TypeError(f"loss_fn is the class {loss_fn.__name__}: pass an instance, "
                        f"loss_fn={loss_fn.__name__}()")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    dataset = data
    if isinstance(data, DataLoader):
        dataset = data.dataset
        collate_fn = collate_fn or data.collate_fn
        batch_size = batch_size if batch_size is not None else data.batch_size
    settings = PipelineSettings(
        model=model,
        dataset=dataset,
        collate_fn=collate_fn or default_collate,
        loss_fn=loss_fn,
        optimizer_recipe=(
            sgd_recipe(DEFAULT_SGD_LR, "no optimizer was given")
            if optimizer is None
            else rebuild_recipe(model, optimizer, "yours")
        ),
        batch_size=_validated_batch_size(batch_size if batch_size is not None else DEFAULT_BATCH_SIZE),
    )
    _check_dataset_shape(settings.dataset)
    return settings


def settings_from_trainer(trainer) -> PipelineSettings:
    """A Hugging Face Trainer's model, train dataset, data collator, per-device batch size,
    compute_loss_func and optimizer recipe (transformers is not imported: only its attributes)."""
    model = trainer.model
    if trainer.train_dataset is None:
        raise ValueError("the Trainer has no train_dataset: pass train_dataset=... to Trainer(...)")
    kept_columns = None
    if trainer.args.remove_unused_columns:
        # What the Trainer keeps: the forward's arguments and the label columns.
        label_names = getattr(trainer, "label_names", None) or []
        kept_columns = set(ForwardInputs.of(model).names) | set(LABEL_ALIASES) | set(label_names)
    settings = PipelineSettings(
        model=model,
        dataset=trainer.train_dataset,
        collate_fn=trainer.data_collator,
        loss_fn=_trainer_loss_fn(trainer),
        optimizer_recipe=trainer_recipe(trainer),
        batch_size=_validated_batch_size(trainer.args.per_device_train_batch_size),
        kept_columns=kept_columns,
        pipeline_name="the Trainer",
    )
    _check_dataset_shape(settings.dataset)
    return settings


def _trainer_loss_fn(trainer) -> Callable | None:
    """The Trainer's compute_loss_func as a loss_fn(outputs, labels), or None to use the model's loss."""
    compute_loss_func = getattr(trainer, "compute_loss_func", None)
    if compute_loss_func is None:
        return None

    def loss_fn(outputs, labels):
        # The Trainer passes the number of labelled positions, for losses summed over a step.
        counted = None if labels is None else (labels != IGNORED_LABEL).sum()
        return compute_loss_func(outputs, labels, num_items_in_batch=counted)

    return loss_fn


def _is_transformers_object(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return module.split(".")[0] == "transformers"


def _validated_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"batch_size must be a positive int, got {batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    return batch_size


def _check_dataset_shape(dataset: Any) -> None:
    """Reject what cannot be the training data before anything runs."""
    if isinstance(dataset, Mapping):
        raise TypeError(
            f"the data is a dict with keys {listed(dataset)} (a DatasetDict?): pass one split, e.g. data['train']"
        )
    if isinstance(dataset, Iterator):
        raise TypeError(
            "the data is a one-shot iterator, which the check would use up: pass the dataset or list itself"
        )
    if not (hasattr(dataset, "__getitem__") or hasattr(dataset, "__iter__")):
        raise TypeError(f"the data must be a Dataset, a DataLoader or a list of samples, got {type(dataset).__name__}")
    if hasattr(dataset, "__len__") and len(dataset) == 0:
        raise ValueError("the data is empty: pass a dataset or list with at least one sample")

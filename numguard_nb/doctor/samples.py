"""What the doctor reads from the data: the samples, the batch, the forward's signature and
the model's outputs.

The samples are either dicts of keyword inputs (style "keyword", Hugging Face's) or
`(inputs, target)` pairs (style "pair"). Nested values are walked with `numguard_nb._tree`.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import _tree
from .checklist import StepFailed, listed

__all__ = [
    "first_samples", "sample_style", "ForwardInputs", "raise_on_input_problem", "all_keys",
    "holds_text", "numeric_leaves", "nonfinite_fields", "ragged_fields", "batch_on_cpu",
    "type_and_size", "batch_contents", "output_loss", "output_logits",
]


def first_samples(dataset: Any, limit: int) -> list:
    """The first ``limit`` samples: by index when the dataset has a length, else by iterating."""
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return [dataset[index] for index in range(min(len(dataset), limit))]
    samples = list(itertools.islice(iter(dataset), limit))
    if not samples:
        raise StepFailed("the dataset yielded no samples", "check that it is not exhausted or filtered to nothing")
    return samples


def sample_style(samples: list) -> str:
    """'keyword' for dict samples, 'pair' for (inputs, target) samples."""
    styles = set()
    for sample in samples:
        if isinstance(sample, Mapping):
            styles.add("keyword")
        elif isinstance(sample, (tuple, list)) and len(sample) == 2:
            styles.add("pair")
        else:
            raise StepFailed(
                f"a sample is a {type_and_size(sample)}: samples must be dicts of model inputs "
                "or (inputs, target) pairs",
                "make the Dataset's __getitem__ return {'input_ids': ..., 'labels': ...} or (inputs, target)",
            )
    if len(styles) > 1:
        raise StepFailed(
            "some samples are dicts and others (inputs, target) pairs", "return one kind from the Dataset"
        )
    return styles.pop()


# ------------------------------------------------------------ the forward's signature


@dataclass
class ForwardInputs:
    """What ``model.forward`` accepts, read from its signature."""

    model_name: str
    names: list[str]
    required: list[str]
    takes_var_kwargs: bool
    main_input: str | None  # Hugging Face's main_input_name, e.g. "input_ids"

    @classmethod
    def of(cls, model: nn.Module) -> ForwardInputs:
        keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        parameters = list(inspect.signature(model.forward).parameters.values())
        main_input = getattr(model, "main_input_name", None)
        return cls(
            model_name=type(model).__name__,
            names=[p.name for p in parameters if p.kind in keyword_kinds],
            required=[p.name for p in parameters if p.kind in keyword_kinds and p.default is p.empty],
            takes_var_kwargs=any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters),
            main_input=main_input if isinstance(main_input, str) else None,
        )

    def missing_main_input(self, keys: list[str]) -> bool:
        if self.main_input is None or self.main_input not in self.names:
            return False
        return self.main_input not in keys and "inputs_embeds" not in keys


def raise_on_input_problem(forward: ForwardInputs, keys: list[str], aliases: tuple, where: str) -> None:
    """Fail when ``keys`` (of the samples, or of the batch) lack the forward's main or required
    inputs, or name an argument it does not take (``aliases`` are renamed by the collator)."""
    if forward.missing_main_input(keys):
        raise StepFailed(
            f"{where} have no {forward.main_input}, the main input of {forward.model_name}.forward "
            f"(they have {listed(keys)})",
            f"tokenize the data so that each sample has {forward.main_input}",
        )
    missing = [name for name in forward.required if name not in keys]
    if missing:
        raise StepFailed(
            f"{where} lack {listed(missing)}, which {forward.model_name}.forward requires (they have {listed(keys)})",
            "return those keys from the Dataset, or rename the columns to the forward's argument names",
        )
    unknown = [key for key in keys if key not in forward.names and key not in aliases]
    if unknown and not forward.takes_var_kwargs:
        raise StepFailed(
            f"{forward.model_name}.forward takes no argument named {listed(unknown)}",
            f"remove or rename those columns (forward takes {listed(forward.names)})",
        )



# ------------------------------------------------------------ values


def all_keys(samples: list) -> list[str]:
    return list(dict.fromkeys(key for sample in samples for key in sample))


def holds_text(value: Any) -> bool:
    return any(isinstance(leaf, str) for _, leaf in _tree.leaves(value))


def numeric_leaves(value: Any) -> Iterator[torch.Tensor]:
    """The numbers inside a sample, as tensors; text and other objects are skipped.

    A long list of numbers (token ids) comes from the walker whole and becomes one tensor: fast
    where a tensor per number would not be."""
    for _, leaf in _tree.named_leaves(value, ""):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif isinstance(leaf, (bool, int, float, list, tuple)) or hasattr(leaf, "__array__"):
            try:
                yield torch.as_tensor(leaf)
            except (TypeError, ValueError, RuntimeError):
                pass  # text, or numbers mixed with other things


def _is_finite(value: Any) -> bool:
    return all(bool(torch.isfinite(leaf).all()) for leaf in numeric_leaves(value) if leaf.is_floating_point())


def nonfinite_fields(sample: Any) -> list[str]:
    """The fields of a sample (its keys, or 'inputs' and 'target') holding NaN or inf."""
    fields = sample.items() if isinstance(sample, Mapping) else zip(("inputs", "target"), sample)
    return [str(name) for name, value in fields if not _is_finite(value)]


def _length(value: Any) -> int | None:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return shape[0] if len(shape) else None
    return len(value) if isinstance(value, (list, tuple)) else None


def ragged_fields(samples: list, style: str) -> str:
    """Describe the fields whose lengths differ across samples; '' when none do."""
    if style == "keyword":
        fields = {key: [sample.get(key) for sample in samples] for key in all_keys(samples)}
    else:
        fields = {"inputs": [inputs for inputs, _ in samples], "target": [target for _, target in samples]}
    ragged = []
    for field, values in fields.items():
        lengths = {_length(value) for value in values}
        if len(lengths) > 1 and None not in lengths:
            ragged.append(f"{field} has lengths {', '.join(str(n) for n in sorted(lengths))}")
    return "; ".join(ragged)


def batch_on_cpu(batch: Any) -> Any:
    """The collated batch with its tensors on the CPU. A mapping batch (transformers'
    `BatchEncoding` is not a dict) becomes a plain dict, as the steps index it."""
    if isinstance(batch, Mapping):
        batch = dict(batch)
    return _tree.rebuild(batch, lambda tensor, _path: tensor.cpu())


def type_and_size(value: Any) -> str:
    """'tensor (2, 8)', 'list of 3', or the type's name."""
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def batch_contents(batch: Any) -> str:
    """Each field of a batch with its type and size: 'input_ids tensor (2, 8), labels tensor (2,)'."""
    if isinstance(batch, Mapping):
        return ", ".join(f"{key} {type_and_size(value)}" for key, value in batch.items())
    inputs, target = batch
    described = batch_contents(inputs) if isinstance(inputs, Mapping) else type_and_size(inputs)
    return f"inputs {described}; target {type_and_size(target)}"


def output_loss(outputs: Any) -> torch.Tensor | None:
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def output_logits(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(outputs, (tuple, list)):
        return next((item for item in outputs if isinstance(item, torch.Tensor)), None)
    return None

"""Class labels against the model's outputs: a label beyond the classifier's size fails deep
inside the loss (a device-side assert on GPU), so the doctor compares them before the forward
(Hugging Face classifiers, whose forward computes the loss) or before the loss (a loss_fn)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .. import numerics
from .checklist import StepFailed
from .samples import numeric_leaves

__all__ = [
    "IGNORED_LABEL", "LABEL_KEYS", "LABEL_ALIASES", "classifier_size", "class_count", "ignored_label",
    "label_values", "raise_on_label_range", "raise_on_token_range",
]

# What the doctor advises where the data has token ids the model has no row or logit for.
RESIZE = ("the tokenizer has tokens the model has not (a pad or special token added to it): "
          "`model.resize_token_embeddings(len(tokenizer))` after adding them")

# Hugging Face losses skip positions labelled -100.
IGNORED_LABEL = -100
LABEL_KEYS = ("labels", "label", "label_ids")
# Hugging Face collators rename these to "labels" before the model sees them.
LABEL_ALIASES = ("label", "label_ids")


def classifier_size(model: nn.Module) -> int | None:
    """The number of logits of a Hugging Face single-label classification head, or None."""
    config = getattr(model, "config", None)
    num_labels = getattr(config, "num_labels", None)
    if "Classification" not in type(model).__name__ or not isinstance(num_labels, int) or num_labels < 2:
        return None
    if getattr(config, "problem_type", None) in ("regression", "multi_label_classification"):
        return None
    return num_labels


def class_count(logits: torch.Tensor | None, target: Any) -> int | None:
    """How many classes the logits score, when they and the target are laid out for classification."""
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    if not logits.is_floating_point() or target.is_floating_point() or target.dtype == torch.bool:
        return None
    if logits.ndim != target.ndim + 1:
        return None
    if logits.shape[:-1] == target.shape:
        return logits.shape[-1]  # (..., classes): the Hugging Face layout
    if (logits.shape[0],) + logits.shape[2:] == target.shape:
        return logits.shape[1]  # (batch, classes, ...): CrossEntropyLoss's layout
    return None


def ignored_label(loss_fn: Callable | None) -> int:
    """The label the loss skips: its `ignore_index` (CrossEntropyLoss(ignore_index=255), a
    partial of F.cross_entropy), else Hugging Face's -100."""
    keywords = getattr(loss_fn, "keywords", None)  # functools.partial
    given = keywords.get("ignore_index") if isinstance(keywords, dict) else getattr(loss_fn, "ignore_index", None)
    return given if isinstance(given, int) and not isinstance(given, bool) else IGNORED_LABEL


def label_values(samples: list, batch: Any, style: str, ignored: int = IGNORED_LABEL) -> torch.Tensor | None:
    """The integer labels of the scanned samples and the batch, `ignored` left out; None if not integers."""
    if style == "keyword":
        found = [sample[key] for sample in samples for key in LABEL_KEYS if key in sample]
        found += [batch[key] for key in LABEL_KEYS if key in batch]
    else:
        found = [target for _, target in samples] + [batch[1]]
    leaves = [leaf.reshape(-1) for value in found for leaf in numeric_leaves(value)]
    if not leaves or any(leaf.is_floating_point() or leaf.dtype == torch.bool for leaf in leaves):
        return None
    values = torch.cat([leaf.long() for leaf in leaves])
    return values[values != ignored]


def raise_on_token_range(model: nn.Module, samples: list, batch: Any) -> None:
    """A Hugging Face model's token ids against its vocabulary, before the forward: an id past
    its input embedding fails in the lookup (`IndexError`, a device-side assert on GPU), as does
    a language model's label past its logits, in the loss."""
    def table(name: str):
        try:
            return getattr(model, name)()
        except Exception:  # (not a Hugging Face model, or one without that table)
            return None

    embedding = table("get_input_embeddings")
    found = [value for item in [*samples, batch] if isinstance(item, dict)
             for key in ("input_ids", "decoder_input_ids") if key in item
             for value in numeric_leaves(item[key])]
    found = [v.reshape(-1).long() for v in found if not v.is_floating_point() and v.numel()]
    if isinstance(embedding, nn.Embedding) and found:
        highest, rows = int(numerics.read(torch.cat(found).max())), embedding.num_embeddings
        if highest >= rows:
            raise StepFailed(f"input_ids go up to {highest} but the model's input embedding has "
                             f"{rows} rows (ids 0..{rows - 1})", RESIZE)
    head = table("get_output_embeddings")
    if isinstance(head, nn.Linear) and classifier_size(model) is None:
        raise_on_label_range(label_values(samples, batch, "keyword"), head.out_features,
                             lambda needed: RESIZE)


def raise_on_label_range(values: torch.Tensor | None, num_outputs: int, fix: Callable[[int], str],
                         ignored: int = IGNORED_LABEL) -> None:
    """Fail when a label is not a class of ``num_outputs``; ``fix(needed)`` says how to get enough."""
    if values is None or values.numel() == 0:
        return
    highest, lowest = (int(numerics.read(x)) for x in (values.max(), values.min()))
    if highest >= num_outputs:
        raise StepFailed(f"labels go up to {highest} but the model outputs {num_outputs} logits", fix(highest + 1))
    if lowest < 0:
        raise StepFailed(
            f"labels go down to {lowest}: class labels must be in 0..{num_outputs - 1} "
            f"({ignored} marks positions to ignore)",
            "map the labels to 0..n-1 before training",
        )


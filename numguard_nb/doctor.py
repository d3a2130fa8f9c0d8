"""Check, step by step, that a training pipeline works before a long run.

``check_pipeline`` walks the steps a training step goes through -- the samples,
the batch, the forward pass, the loss, the gradients, the optimizer step, and
overfitting one batch -- and stops at the first one that is broken, with a
message that names the fix.  It runs on CPU, on a deep copy of the model, so
the user's weights, optimizer state and random number generator are untouched.

It works on a plain PyTorch model with a dataset, a DataLoader or a list of
samples, or on a ``transformers.Trainer``.  transformers is never imported
here: a Trainer is recognised by its class name and only its attributes and
methods are used.
"""

from __future__ import annotations

import copy
import html
import inspect
import itertools
import math
import traceback as traceback_module
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, default_collate

__all__ = ["check_pipeline", "PipelineReport", "PipelineStep", "STEP_NAMES"]

STEP_NAMES = ("data", "collate", "forward", "loss", "backward", "optimizer", "overfit")

# The data step looks at this many samples (the batch only uses the first few):
# enough to catch NaN rows and labels out of range without reading a large dataset.
SAMPLES_TO_SCAN = 256
OVERFIT_STEPS = 10
DEFAULT_BATCH_SIZE = 2
DEFAULT_SGD_LR = 1e-2
# Hugging Face losses skip positions labelled -100.
IGNORED_LABEL = -100
LABEL_KEYS = ("labels", "label", "label_ids")
# Hugging Face collators rename these to "labels" before the model sees them.
LABEL_ALIASES = ("label", "label_ids")
# How many names a message lists before it says "and N more".
NAMES_SHOWN = 6


# --------------------------------------------------------------------- report


@dataclass
class PipelineStep:
    """One step of the check: ``ok`` is True, False, or None when it did not run."""

    name: str
    ok: bool | None
    message: str
    hint: str = ""
    exception: BaseException | None = None
    traceback: str = ""

    @property
    def status(self) -> str:
        return {True: "passed", False: "failed", None: "not run"}[self.ok]


_TEXT_MARKS = {True: "✓", False: "✗", None: "·"}
_HTML_COLORS = {True: "#1a7f37", False: "#cf222e", None: "#6e7781"}


@dataclass
class PipelineReport:
    """The checklist ``check_pipeline`` returns; renders as text and as HTML."""

    subject: str
    steps: list[PipelineStep]

    @property
    def ok(self) -> bool:
        return all(step.ok is True for step in self.steps)

    @property
    def failed_step(self) -> PipelineStep | None:
        return next((step for step in self.steps if step.ok is False), None)

    def step(self, name: str) -> PipelineStep:
        for step in self.steps:
            if step.name == name:
                return step
        raise KeyError(f"no step named {name!r}; the steps are {', '.join(STEP_NAMES)}")

    def summary(self) -> str:
        failed = self.failed_step
        if failed is None:
            return f"Pipeline check for {self.subject}: all {len(self.steps)} steps passed"
        return f"Pipeline check for {self.subject}: failed at '{failed.name}'"

    def to_text(self) -> str:
        width = max(len(name) for name in STEP_NAMES)
        indent = " " * (width + 5)
        lines = [self.summary()]
        for step in self.steps:
            lines.append(f"  {_TEXT_MARKS[step.ok]} {step.name:<{width}}  {step.message}")
            if step.hint:
                lines.append(f"{indent}fix: {step.hint}")
            if step.traceback:
                lines.append(f"{indent}(traceback: report.step({step.name!r}).traceback)")
        return "\n".join(lines)

    __str__ = to_text
    __repr__ = to_text

    def _repr_html_(self) -> str:
        rows = []
        for step in self.steps:
            color = _HTML_COLORS[step.ok]
            detail = html.escape(step.message)
            if step.hint:
                detail += f"<br><b>fix:</b> {html.escape(step.hint)}"
            if step.traceback:
                detail += (
                    "<details><summary>traceback</summary>"
                    f"<pre style='white-space:pre-wrap'>{html.escape(step.traceback)}</pre></details>"
                )
            rows.append(
                f"<tr><td style='color:{color};font-weight:bold'>{_TEXT_MARKS[step.ok]}</td>"
                f"<td style='text-align:left'><code>{html.escape(step.name)}</code></td>"
                f"<td style='text-align:left'>{detail}</td></tr>"
            )
        return (
            f"<div><p><b>{html.escape(self.summary())}</b></p>"
            f"<table>{''.join(rows)}</table></div>"
        )


class _StepFailed(Exception):
    """Raised inside a step with a diagnosis; ``cause`` is the exception behind it, if any."""

    def __init__(self, message: str, hint: str = "", cause: BaseException | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.cause = cause


# ------------------------------------------------------------------ entry point


def check_pipeline(
    model: Any,
    data: Any = None,
    *,
    collate_fn: Callable | None = None,
    loss_fn: Callable | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    batch_size: int | None = None,
) -> PipelineReport:
    """Run the training pipeline one step at a time and report the first broken step.

    ``check_pipeline(trainer)`` takes the model, train dataset, data collator,
    batch size and optimizer recipe from a ``transformers.Trainer``.

    ``check_pipeline(model, data, ...)``: ``data`` is a Dataset, a DataLoader or
    a list of samples.  A sample is either a dict of keyword inputs for
    ``model(**batch)`` (Hugging Face style, labels included, the model returns
    the loss -- or give ``loss_fn(outputs, labels)``) or an ``(inputs, target)``
    pair, scored as ``loss_fn(model(inputs), target)`` (a dict ``inputs`` is
    passed as keywords, a tuple as positional arguments).  ``collate_fn``
    defaults to the DataLoader's, else torch's ``default_collate``;
    ``batch_size`` to the DataLoader's, else 2.  ``optimizer`` is rebuilt --
    same class and param-group hyperparameters, fresh state -- over the copy's
    parameters; without one, SGD(lr=0.01) is used.

    Costs one extra copy of the model and its optimizer state in CPU memory.
    """
    if _is_trainer(model):
        if data is not None or collate_fn or loss_fn or optimizer or batch_size is not None:
            raise TypeError(
                "check_pipeline(trainer) takes the data, collator, optimizer and batch size "
                "from the Trainer: pass the Trainer alone"
            )
        run = _PipelineRun.from_trainer(model)
    else:
        run = _PipelineRun.from_arguments(model, data, collate_fn, loss_fn, optimizer, batch_size)
    return run.report()


# ------------------------------------------------------------------ the run


@dataclass
class _OptimizerRecipe:
    """How to build, over the copy, the optimizer the user's training would use."""

    build: Callable[[nn.Module], torch.optim.Optimizer]
    description: str
    # Tensors the user's optimizer holds that are not parameters of the model.
    foreign_tensor_count: int = 0


class _PipelineRun:
    """The state threaded through the steps: each check reads what earlier ones left."""

    def __init__(
        self,
        *,
        model: nn.Module,
        dataset: Any,
        collate_fn: Callable,
        collator_takes_raw_columns: bool,
        loss_fn: Callable | None,
        optimizer_recipe: Callable[[nn.Module], _OptimizerRecipe],
        batch_size: int,
        kept_columns: set[str] | None = None,
        pipeline_name: str = "the pipeline",
    ):
        self.original_model = model
        self.dataset = dataset
        self.collate_fn = collate_fn
        # True when the collator only stacks/pads: raw text or stray columns will break it.
        self.collator_takes_raw_columns = collator_takes_raw_columns
        self.loss_fn = loss_fn
        self.optimizer_recipe = optimizer_recipe
        self.batch_size = batch_size
        # Columns a Trainer keeps (it drops the others before collating); None: keeps all.
        self.kept_columns = kept_columns
        self.pipeline_name = pipeline_name
        self.forward_inputs = _ForwardInputs.of(model)

    # ---- construction from the two call forms

    @classmethod
    def from_arguments(cls, model, data, collate_fn, loss_fn, optimizer, batch_size) -> _PipelineRun:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"check_pipeline needs a torch.nn.Module (or a transformers.Trainer), "
                f"got {type(model).__name__}: pass the model you train"
            )
        if data is None:
            raise TypeError("check_pipeline(model, data) needs the training data: a Dataset, a DataLoader or a list of samples")
        for name, value in (("collate_fn", collate_fn), ("loss_fn", loss_fn)):
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable, got {type(value).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        dataset = data
        if isinstance(data, DataLoader):
            dataset = data.dataset
            collate_fn = collate_fn or data.collate_fn
            batch_size = batch_size or data.batch_size
        batch_size = _validated_batch_size(batch_size or DEFAULT_BATCH_SIZE)
        collate_fn = collate_fn or default_collate
        if optimizer is None:
            recipe = _default_sgd_recipe(DEFAULT_SGD_LR, "no optimizer given")
        else:
            recipe = _rebuild_recipe(model, optimizer)
        return cls(
            model=model,
            dataset=dataset,
            collate_fn=collate_fn,
            collator_takes_raw_columns=_collator_takes_raw_columns(collate_fn),
            loss_fn=loss_fn,
            optimizer_recipe=recipe,
            batch_size=batch_size,
        )

    @classmethod
    def from_trainer(cls, trainer) -> _PipelineRun:
        model = trainer.model
        if not isinstance(model, nn.Module):
            raise TypeError(f"trainer.model is {type(model).__name__}, not a torch.nn.Module")
        if trainer.train_dataset is None:
            raise ValueError("the Trainer has no train_dataset: pass train_dataset=... to Trainer(...)")
        args = trainer.args
        kept_columns = None
        if args.remove_unused_columns:
            # The Trainer keeps the forward's arguments and the label columns, as in its
            # _set_signature_columns_if_needed.
            kept_columns = set(_ForwardInputs.of(model).names) | set(LABEL_ALIASES) | set(trainer.label_names)
        return cls(
            model=model,
            dataset=trainer.train_dataset,
            collate_fn=trainer.data_collator,
            collator_takes_raw_columns=_collator_takes_raw_columns(trainer.data_collator),
            loss_fn=_trainer_loss_fn(trainer),
            optimizer_recipe=_trainer_recipe(trainer),
            batch_size=_validated_batch_size(args.per_device_train_batch_size),
            kept_columns=kept_columns,
            pipeline_name="the Trainer",
        )

    # ---- running

    def report(self) -> PipelineReport:
        self.samples = _first_samples(self.dataset, SAMPLES_TO_SCAN)
        checks = [
            ("data", self.check_data),
            ("collate", self.check_collate),
            ("forward", self.check_forward),
            ("loss", self.check_loss),
            ("backward", self.check_backward),
            ("optimizer", self.check_optimizer),
            ("overfit", self.check_overfit),
        ]
        steps: list[PipelineStep] = []
        # fork_rng: dropout and shuffling here must not move the user's random stream.
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.manual_seed(0)
            self.model = copy.deepcopy(self.original_model).cpu().train()
            self.model.zero_grad(set_to_none=True)
            for name, check in checks:
                if steps and steps[-1].ok is not True:
                    steps.append(PipelineStep(name, None, f"not run: '{failed_name}' failed"))
                    continue
                steps.append(_run_step(name, check))
                failed_name = name
        return PipelineReport(type(self.original_model).__name__, steps)

    # ---- the steps; each returns its message or raises _StepFailed

    def check_data(self) -> str:
        samples = self.samples
        if isinstance(self.dataset, Mapping):
            raise _StepFailed(
                f"the data is a dict with keys {_names(self.dataset)} (a DatasetDict?), not a dataset",
                "pass one split, e.g. dataset['train']",
            )
        self.style = _sample_style(samples)
        notes = []
        if self.style == "keyword":
            notes += self._check_sample_columns()
        else:
            self._check_pair_samples()
        for index, sample in enumerate(samples):
            bad = _nonfinite_fields(sample)
            if bad:
                raise _StepFailed(
                    f"sample {index} has NaN/inf in {', '.join(bad)}",
                    "clean or drop such samples before training (e.g. filter rows with missing "
                    "values, or torch.nan_to_num); NaN inputs make the loss NaN",
                )
        scanned = f"{len(samples)} samples" if len(samples) < SAMPLES_TO_SCAN else f"the first {len(samples)} samples"
        if self.style == "keyword":
            message = f"{scanned} checked: keys {_names(_all_keys(samples))}; numbers are finite"
        else:
            message = f"{scanned} checked: (inputs, target) pairs; numbers are finite"
        return "; ".join([message] + notes)

    def _check_sample_columns(self) -> list[str]:
        """Check a keyword sample's keys against the forward; returns notes for the message."""
        keys = _all_keys(self.samples)
        text_keys = [key for key in keys if any(_holds_text(sample.get(key)) for sample in self.samples)]
        dropped = [key for key in keys if self.kept_columns is not None and key not in self.kept_columns]
        reaching = [key for key in keys if key not in dropped]
        if not self.collator_takes_raw_columns:
            # A custom collate_fn may tokenize text or build inputs: judge its batch instead.
            return [f"{_names(text_keys)} hold text, left to the collate_fn"] if text_keys else []
        forward = self.forward_inputs
        if text_keys and forward.missing_main_input(reaching):
            raise _StepFailed(
                f"the samples are raw text: {_names(text_keys)} hold strings, and there is no "
                f"{forward.main_input} for {forward.model_name}.forward",
                f"tokenize the dataset first, e.g. tokenized = dataset.map(lambda batch: "
                f"tokenizer({', '.join(f'batch[{key!r}]' for key in text_keys[:2])}, truncation=True), "
                f"batched=True), and give {self.pipeline_name} the tokenized dataset",
            )
        reaching_text = [key for key in text_keys if key in reaching]
        if reaching_text:
            raise _StepFailed(
                f"{_names(reaching_text)} hold strings, which {self.pipeline_name} passes on to the collator",
                f"remove the text columns once tokenized: dataset.remove_columns({reaching_text!r})",
            )
        aliases = LABEL_ALIASES if _is_transformers_object(self.collate_fn) else ()
        _raise_on_input_problem(forward, reaching, aliases, where="the samples")
        notes = []
        if dropped:
            notes.append(f"{self.pipeline_name} drops {_names(dropped)} (not forward arguments)")
        ignored = [key for key in reaching if key not in forward.names and key not in aliases]
        if ignored:
            notes.append(f"{forward.model_name}.forward ignores {_names(ignored)} (it takes **kwargs)")
        return notes

    def _check_pair_samples(self) -> None:
        if self.loss_fn is None:
            raise _StepFailed(
                "the samples are (inputs, target) pairs, but there is no loss_fn to compare outputs with targets",
                "pass loss_fn=..., e.g. check_pipeline(model, data, loss_fn=torch.nn.CrossEntropyLoss())",
            )
        if self.collator_takes_raw_columns and any(_holds_text(inputs) for inputs, _ in self.samples):
            raise _StepFailed(
                "the inputs are raw text, which cannot be stacked into a tensor",
                "encode them into token ids (a tokenizer in the Dataset's __getitem__), "
                "or pass a collate_fn that tokenizes each batch",
            )

    def check_collate(self) -> str:
        pieces = self.samples[: self.batch_size]
        if self.kept_columns is not None:
            pieces = [{key: value for key, value in sample.items() if key in self.kept_columns} for sample in pieces]
        try:
            batch = self.collate_fn(pieces)
        except Exception as error:
            ragged = _ragged_fields(pieces, self.style)
            if not ragged:
                raise
            raise _StepFailed(
                f"cannot stack the samples into a batch: {ragged}",
                "pad them: use transformers' DataCollatorWithPadding(tokenizer) as the collator, "
                "or padding='max_length' in the tokenizer, or a collate_fn that pads "
                "(torch.nn.utils.rnn.pad_sequence)",
                cause=error,
            )
        self.batch = _to_cpu(batch)
        self._split_batch()
        if self.style == "keyword" and not self.collator_takes_raw_columns:
            _raise_on_input_problem(self.forward_inputs, list(self.inputs), (), where="the batch")
        return f"batch of {len(pieces)}: {_describe(self.batch)}"

    def _split_batch(self) -> None:
        """Set ``inputs`` (what the model gets) and ``target`` (what loss_fn gets, or None)."""
        batch = self.batch
        not_tensors = _non_tensor_fields(batch)
        if not_tensors:
            raise _StepFailed(
                f"the collated batch holds non-tensors: {not_tensors}",
                "the collator should return tensors; torch's default_collate turns lists into lists of "
                "tensors -- return tensors from the dataset, or use a collator such as "
                "transformers' DataCollatorWithPadding(tokenizer)",
            )
        if self.style == "keyword":
            if not isinstance(batch, Mapping):
                raise _StepFailed(f"the collator turned dict samples into a {type(batch).__name__}, not a dict")
            self.inputs = dict(batch)
            self.target = self.inputs.pop("labels", None) if self.loss_fn is not None else None
        else:
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise _StepFailed(
                    f"the collator turned (inputs, target) pairs into a {type(batch).__name__}, "
                    "not an (inputs, targets) pair"
                )
            self.inputs, self.target = batch

    def check_forward(self) -> str:
        if self.style == "keyword" and self.loss_fn is None:
            # Labels go into the forward here, and an out-of-range one fails deep inside it
            # (a device-side assert on GPU): compare labels with the classifier's size first.
            num_labels = _classifier_size(self.original_model)
            if num_labels is not None:
                _raise_on_label_range(
                    _label_values(self.samples, self.batch, self.style),
                    num_labels,
                    lambda needed: f"build the model with num_labels={needed}, e.g. "
                    f"AutoModelForSequenceClassification.from_pretrained(checkpoint, num_labels={needed})",
                )
        self.outputs = self._call_model(self.inputs)
        loss, logits = _output_loss(self.outputs), _output_logits(self.outputs)
        if loss is None and logits is None:
            raise _StepFailed(
                f"the model returned {type(self.outputs).__name__}, with no tensor in it",
                "forward should return the outputs (logits) or a loss",
            )
        parts = []
        if loss is not None and self.loss_fn is None:
            parts.append(f"loss {_format_number(loss)}")
        if logits is not None:
            parts.append(f"logits {tuple(logits.shape)}")
        return f"{type(self.original_model).__name__} returned {' and '.join(parts)}"

    def check_loss(self) -> str:
        loss = self._loss(self.outputs, self.target, check_labels=True)
        if loss.numel() != 1:
            raise _StepFailed(
                f"the loss has shape {tuple(loss.shape)}, not a single number: backward() needs a scalar",
                "reduce it: loss.mean(), or reduction='mean' (not 'none') in the loss function",
            )
        if not loss.requires_grad:
            raise _StepFailed(
                "the loss does not depend on any trainable parameter (requires_grad=False)",
                "compute it from the model's outputs without .detach(), .item(), torch.no_grad() "
                "or re-wrapping in torch.tensor(...)",
            )
        if not torch.isfinite(loss.detach()).all():
            raise _StepFailed(
                f"the loss is {_format_number(loss)}",
                "look for NaN/inf in the outputs (numguard_nb's Guard finds the first module), "
                "log(0) or division by zero in the loss",
            )
        self.loss = loss
        return f"finite scalar: {_format_number(loss)}"

    def check_backward(self) -> str:
        self.loss.backward()
        trainable = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        frozen = [name for name, p in self.model.named_parameters() if not p.requires_grad]
        if not trainable:
            raise _StepFailed(
                "every parameter is frozen (requires_grad=False): training would change nothing",
                "unfreeze the parameters to train: p.requires_grad_(True)",
            )
        without_grad = [name for name, p in trainable if p.grad is None]
        nonfinite = [name for name, p in trainable if p.grad is not None and not torch.isfinite(p.grad).all()]
        if nonfinite:
            raise _StepFailed(
                f"non-finite gradients in {_names(nonfinite)}",
                "the forward is finite but its gradient is not: look for sqrt/log/division near 0, "
                "or run with numguard_nb's Guard(model, backward=True) to find the module",
            )
        if without_grad:
            raise _StepFailed(
                f"{len(without_grad)} trainable parameters got no gradient: {_names(without_grad)}",
                "they are not used in computing the loss: use them in forward, or freeze them "
                "(p.requires_grad_(False)) if they are meant to stay fixed",
            )
        message = f"all {len(trainable)} trainable parameters got finite gradients"
        if frozen:
            message += f"; {len(frozen)} frozen parameters get none, as frozen ones should: {_names(frozen)}"
        return message

    def check_optimizer(self) -> str:
        recipe = self.optimizer_recipe(self.model)
        held = {id(p) for group in _param_groups_or_empty(recipe) for p in group}
        trainable = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        not_held = [name for name, p in trainable if id(p) not in held]
        if len(not_held) == len(trainable):
            other = f" (it holds {recipe.foreign_tensor_count} other tensors)" if recipe.foreign_tensor_count else ""
            raise _StepFailed(
                f"the optimizer holds none of this model's parameters{other}",
                "build it from this model, e.g. torch.optim.AdamW(model.parameters()); in a notebook, "
                "re-running the cell that creates the model leaves the optimizer on the old one",
            )
        if not_held:
            raise _StepFailed(
                f"the optimizer does not hold {len(not_held)} trainable parameters: {_names(not_held)}",
                "create the optimizer after the whole model is built (heads included), "
                "from model.parameters()",
            )
        self.optimizer = recipe.build(self.model)
        before = {name: p.detach().clone() for name, p in trainable}
        self.optimizer.step()
        changed = [name for name, p in trainable if not torch.equal(before[name], p.detach())]
        if not changed:
            raise _StepFailed(
                f"a step of {recipe.description} changed no weight",
                "check the learning rate is not 0 and that the gradients are not all zero",
            )
        message = f"a step of {recipe.description} changed {len(changed)} of {len(trainable)} trainable parameters"
        if recipe.foreign_tensor_count:
            message += f"; it also holds {recipe.foreign_tensor_count} tensors that are not this model's parameters"
        return message

    def check_overfit(self) -> str:
        start = self._evaluation_loss()
        for _ in range(OVERFIT_STEPS):
            self.optimizer.zero_grad(set_to_none=True)
            outputs = self._call_model(self.inputs)
            self._loss(outputs, self.target).backward()
            self.optimizer.step()
        end = self._evaluation_loss()
        if not end < start and end > 1e-6:
            raise _StepFailed(
                f"{OVERFIT_STEPS} steps on one batch took the loss from {_format_number(start)} "
                f"to {_format_number(end)}: the model cannot fit a single batch",
                "check the learning rate (too high makes it diverge, 0 stalls it), that labels match "
                "the inputs, and that the loss is computed from the model's outputs",
            )
        return f"{OVERFIT_STEPS} steps on one batch took the loss from {_format_number(start)} to {_format_number(end)}"

    # ---- shared by the steps

    def _call_model(self, inputs):
        if isinstance(inputs, Mapping):
            return self.model(**inputs)
        if isinstance(inputs, (tuple, list)):
            return self.model(*inputs)
        return self.model(inputs)

    def _loss(self, outputs, target, *, check_labels: bool = False) -> torch.Tensor:
        if self.loss_fn is None:
            loss = _output_loss(outputs)
            if loss is None:
                keys = list(self.inputs) if isinstance(self.inputs, Mapping) else []
                renamed = [key for key in keys if key in LABEL_ALIASES]
                hint = (
                    f"rename {renamed[0]!r} to 'labels' (or use a transformers data collator, which does)"
                    if renamed
                    else "include the labels in the samples (a 'labels' column) or pass loss_fn=..."
                )
                raise _StepFailed(f"the model returned no loss; the batch has {_names(keys)}", hint)
            return loss
        if check_labels:
            logits = _output_logits(outputs)
            num_classes = _class_count(logits, target)
            if num_classes is not None:
                _raise_on_label_range(
                    _label_values(self.samples, self.batch, self.style),
                    num_classes,
                    lambda needed: f"make the model output {needed} values per sample "
                    f"(e.g. out_features={needed} on its last nn.Linear)",
                )
        loss = self.loss_fn(outputs, target)
        if not isinstance(loss, torch.Tensor):
            raise _StepFailed(
                f"loss_fn returned {type(loss).__name__}, not a tensor",
                "return the loss tensor itself, not loss.item()",
            )
        return loss

    def _evaluation_loss(self) -> float:
        # Eval mode and no grad: dropout noise would hide a small decrease.
        self.model.eval()
        with torch.no_grad():
            loss = self._loss(self._call_model(self.inputs), self.target)
        self.model.train()
        return float(loss.mean())


def _run_step(name: str, check: Callable[[], str]) -> PipelineStep:
    try:
        return PipelineStep(name, True, check())
    except _StepFailed as failure:
        cause = failure.cause
        return PipelineStep(name, False, failure.message, failure.hint, cause, _format_traceback(cause))
    except Exception as error:  # an unexpected failure is the finding: keep it, with its traceback
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return PipelineStep(
            name,
            False,
            f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__,
            "see the traceback for where it was raised",
            error,
            _format_traceback(error),
        )


def _format_traceback(error: BaseException | None) -> str:
    if error is None:
        return ""
    return "".join(traceback_module.format_exception(type(error), error, error.__traceback__))


# ------------------------------------------------------------ argument helpers


def _is_trainer(obj: Any) -> bool:
    # By class name, so that transformers need not be imported (subclasses included).
    return any(klass.__name__ == "Trainer" for klass in type(obj).__mro__) and hasattr(obj, "train_dataset")


def _is_transformers_object(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return module.split(".")[0] == "transformers"


def _collator_takes_raw_columns(collate_fn: Callable) -> bool:
    """True for collators that only stack or pad what they get, without tokenizing."""
    return collate_fn is default_collate or _is_transformers_object(collate_fn)


def _validated_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise TypeError(f"batch_size must be a positive int, got {batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    return batch_size


def _first_samples(dataset: Any, limit: int) -> list:
    """The first ``limit`` samples, by index when the dataset has a length, else by iterating."""
    if isinstance(dataset, Mapping):
        return list(dataset.values())[:limit]
    if isinstance(dataset, Iterator):
        raise TypeError("data is a one-shot iterator, which the check would consume: pass the dataset or list itself")
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        samples = [dataset[index] for index in range(min(len(dataset), limit))]
    elif hasattr(dataset, "__iter__"):
        samples = list(itertools.islice(iter(dataset), limit))
    else:
        raise TypeError(f"data must be a Dataset, a DataLoader or a list of samples, got {type(dataset).__name__}")
    if not samples:
        raise ValueError("the data is empty: pass a dataset or list with at least one sample")
    return samples


def _sample_style(samples: list) -> str:
    """'keyword' for dict samples, 'pair' for (inputs, target) samples."""
    styles = set()
    for sample in samples:
        if isinstance(sample, Mapping):
            styles.add("keyword")
        elif isinstance(sample, (tuple, list)) and len(sample) == 2:
            styles.add("pair")
        else:
            raise _StepFailed(
                f"a sample is a {_describe_value(sample)}: samples must be dicts of model inputs "
                "or (inputs, target) pairs",
                "make the Dataset's __getitem__ return {'input_ids': ..., 'labels': ...} or (inputs, target)",
            )
    if len(styles) > 1:
        raise _StepFailed("some samples are dicts and others are (inputs, target) pairs", "return one kind from the Dataset")
    return styles.pop()


# ------------------------------------------------------------ forward inputs


@dataclass
class _ForwardInputs:
    """What ``model.forward`` accepts, read from its signature."""

    model_name: str
    names: list[str]
    required: list[str]
    takes_var_kwargs: bool
    main_input: str | None  # Hugging Face's main_input_name, e.g. "input_ids"

    @classmethod
    def of(cls, model: nn.Module) -> _ForwardInputs:
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


def _raise_on_input_problem(forward: _ForwardInputs, keys: list[str], aliases: tuple, where: str) -> None:
    if forward.missing_main_input(keys):
        raise _StepFailed(
            f"{where} have no {forward.main_input}, the main input of {forward.model_name}.forward "
            f"(they have {_names(keys)})",
            f"tokenize the data so that each sample has {forward.main_input}",
        )
    missing = [name for name in forward.required if name not in keys]
    if missing:
        raise _StepFailed(
            f"{where} lack {_names(missing)}, which {forward.model_name}.forward requires (they have {_names(keys)})",
            "return those keys from the Dataset, or rename the columns to the forward's argument names",
        )
    unknown = [key for key in keys if key not in forward.names and key not in aliases]
    if unknown and not forward.takes_var_kwargs:
        raise _StepFailed(
            f"{forward.model_name}.forward takes no argument named {_names(unknown)}",
            f"remove or rename those columns (forward takes {_names(forward.names)})",
        )


# ------------------------------------------------------------ value helpers


def _names(names) -> str:
    names = list(names)
    shown = ", ".join(str(name) for name in names[:NAMES_SHOWN])
    extra = len(names) - NAMES_SHOWN
    return f"{shown} and {extra} more" if extra > 0 else shown


def _all_keys(samples: list) -> list[str]:
    return list(dict.fromkeys(key for sample in samples for key in sample))


def _holds_text(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_text(item) for item in value)
    if isinstance(value, Mapping):
        return any(_holds_text(item) for item in value.values())
    return False


def _numeric_leaves(value: Any) -> Iterator[torch.Tensor]:
    """The numbers inside a sample, as tensors; text and other objects are skipped."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (bool, int, float)):
        yield torch.tensor(value)
    elif hasattr(value, "__array__") and not isinstance(value, (str, bytes)):
        yield torch.as_tensor(value)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _numeric_leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _numeric_leaves(item)


def _is_finite(value: Any) -> bool:
    return all(
        torch.isfinite(leaf).all() for leaf in _numeric_leaves(value) if leaf.is_floating_point() or leaf.is_complex()
    )


def _nonfinite_fields(sample: Any) -> list[str]:
    if isinstance(sample, Mapping):
        return [repr(key) for key, value in sample.items() if not _is_finite(value)]
    inputs, target = sample
    return [field for field, value in (("inputs", inputs), ("target", target)) if not _is_finite(value)]


def _length(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.ndim else None
    if isinstance(value, (list, tuple)) or hasattr(value, "__array__"):
        return len(value)
    return None


def _ragged_fields(samples: list, style: str) -> str:
    """Describe the fields whose lengths differ across samples; '' when none do."""
    if style == "keyword":
        fields = {key: [sample.get(key) for sample in samples] for key in _all_keys(samples)}
    else:
        fields = {"inputs": [s[0] for s in samples], "target": [s[1] for s in samples]}
    ragged = []
    for field, values in fields.items():
        lengths = {_length(value) for value in values}
        if len(lengths) > 1 and None not in lengths:
            ragged.append(f"{field} has lengths {', '.join(str(n) for n in sorted(lengths))}")
    return "; ".join(ragged)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, Mapping):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(item) for item in value) if isinstance(value, list) else tuple(
            _to_cpu(item) for item in value
        )
    return value


def _non_tensor_fields(batch: Any) -> str:
    if isinstance(batch, Mapping):
        items = batch.items()
    elif isinstance(batch, (tuple, list)):
        items = [(("inputs", "target")[i] if len(batch) == 2 else i, value) for i, value in enumerate(batch)]
    else:
        return "" if isinstance(batch, torch.Tensor) else f"a {type(batch).__name__}"
    found = []
    for field, value in items:
        if isinstance(value, (Mapping, tuple)) and field == "inputs":
            nested = _non_tensor_fields(value)
            if nested:
                found.append(f"inputs: {nested}")
        elif not isinstance(value, torch.Tensor):
            found.append(f"{field} is {_describe_value(value)}")
    return "; ".join(found)


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def _describe(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return ", ".join(f"{key} {_describe_value(value)}" for key, value in batch.items())
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, target = batch
        described = _describe(inputs) if isinstance(inputs, (Mapping, tuple)) else _describe_value(inputs)
        return f"inputs {described}; target {_describe_value(target)}"
    return _describe_value(batch)


def _format_number(value: Any) -> str:
    number = float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)
    return f"{number:.4g}" if math.isfinite(number) else str(number)


def _output_loss(outputs: Any) -> torch.Tensor | None:
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def _output_logits(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(outputs, (tuple, list)):
        return next((item for item in outputs if isinstance(item, torch.Tensor)), None)
    return None


# ------------------------------------------------------------ labels


def _classifier_size(model: nn.Module) -> int | None:
    """The number of logits of a Hugging Face classification head, or None."""
    config = getattr(model, "config", None)
    num_labels = getattr(config, "num_labels", None)
    if "Classification" not in type(model).__name__ or not isinstance(num_labels, int):
        return None
    if num_labels < 2 or getattr(config, "problem_type", None) in ("regression", "multi_label_classification"):
        return None
    return num_labels


def _class_count(logits: torch.Tensor | None, target: Any) -> int | None:
    """How many classes the logits score, when they and the target look like classification."""
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    if not logits.is_floating_point() or target.is_floating_point() or target.dtype == torch.bool:
        return None
    if logits.ndim == target.ndim + 1 and logits.shape[:-1] == target.shape:
        return logits.shape[-1]  # (..., classes), the Hugging Face layout
    if logits.ndim == target.ndim + 1 and (logits.shape[0],) + logits.shape[2:] == target.shape:
        return logits.shape[1]  # (batch, classes, ...), CrossEntropyLoss's layout
    return None


def _label_values(samples: list, batch: Any, style: str) -> torch.Tensor | None:
    """All integer labels in the scanned samples and the batch, -100 excluded; None if not integer."""
    if style == "keyword":
        found = [sample[key] for sample in samples for key in LABEL_KEYS if key in sample]
        found += [batch[key] for key in LABEL_KEYS if isinstance(batch, Mapping) and key in batch]
    else:
        found = [target for _, target in samples] + [batch[1]]
    leaves = [leaf.reshape(-1) for value in found for leaf in _numeric_leaves(value)]
    if not leaves or any(leaf.is_floating_point() or leaf.dtype == torch.bool for leaf in leaves):
        return None
    values = torch.cat([leaf.long() for leaf in leaves])
    return values[values != IGNORED_LABEL]


def _raise_on_label_range(values: torch.Tensor | None, num_outputs: int, fix: Callable[[int], str]) -> None:
    if values is None or values.numel() == 0:
        return
    highest, lowest = int(values.max()), int(values.min())
    if highest >= num_outputs:
        raise _StepFailed(
            f"labels go up to {highest} but the model outputs {num_outputs} logits",
            fix(highest + 1),
        )
    if lowest < 0:
        raise _StepFailed(
            f"labels go down to {lowest}: class labels must be in 0..{num_outputs - 1} "
            f"({IGNORED_LABEL} marks positions to ignore)",
            "map the labels to 0..n-1 before training",
        )


# ------------------------------------------------------------ optimizers


def _param_groups_or_empty(recipe: _OptimizerRecipe) -> list[list[nn.Parameter]]:
    return [group["params"] for group in recipe.param_groups]


def _default_sgd_recipe(lr: float, reason: str) -> Callable[[nn.Module], _OptimizerRecipe]:
    def recipe(model: nn.Module) -> _OptimizerRecipe:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        return _OptimizerRecipe(
            build=lambda _: torch.optim.SGD(groups, lr=lr),
            description=f"SGD(lr={lr:g}) ({reason})",
            param_groups=groups,
        )

    return recipe

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
from ._util import error_line

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
        width = max((len(step.name) for step in self.steps), default=0)
        indent = " " * (width + 6)  # under the message: "  ✓ " + name column + "  "
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
    """Run the training pipeline one step at a time; report each step up to the first broken one.

    ``check_pipeline(trainer)`` takes the model, train dataset, data collator,
    per-device batch size and optimizer recipe from a ``transformers.Trainer``.

    ``check_pipeline(model, data, ...)``: ``data`` is a Dataset, a DataLoader or
    a list of samples.  A sample is either a dict of keyword inputs for
    ``model(**batch)`` (Hugging Face style, labels included, and the model
    returns the loss -- or give ``loss_fn(outputs, labels)``), or an
    ``(inputs, target)`` pair scored as ``loss_fn(model(inputs), target)`` (a
    dict ``inputs`` is passed as keywords, a tuple as positional arguments).
    ``collate_fn`` defaults to the DataLoader's, else torch's ``default_collate``;
    ``batch_size`` to the DataLoader's, else 2.  ``optimizer`` is rebuilt -- same
    class and param-group hyperparameters, fresh state -- over the copy's
    parameters; without one, SGD(lr=0.01) is used.

    Costs one extra copy of the model and of its optimizer state in CPU memory.
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
class _OptimizerPlan:
    """The optimizer built over the copy, as the user's training would build it."""

    optimizer: torch.optim.Optimizer | None  # None when it would hold none of the model's parameters
    description: str
    foreign_tensor_count: int = 0  # tensors the user's optimizer holds that are not the model's


# Builds the plan over the model copy, whose parameters the optimizer must hold.
_OptimizerRecipe = Callable[[nn.Module], _OptimizerPlan]


class _PipelineRun:
    """The state threaded through the steps: each check reads what the earlier ones left."""

    def __init__(
        self,
        *,
        model: nn.Module,
        dataset: Any,
        collate_fn: Callable,
        loss_fn: Callable | None,
        optimizer_recipe: _OptimizerRecipe,
        batch_size: int,
        kept_columns: set[str] | None = None,
        pipeline_name: str = "the pipeline",
    ):
        _check_dataset_shape(dataset)
        self.original_model = model
        self.dataset = dataset
        self.collate_fn = collate_fn
        # A collator that only stacks or pads: raw text or stray columns in the samples break it.
        # Other collate_fns may tokenize or build the inputs, so their batch is judged instead.
        self.collator_only_stacks = collate_fn is default_collate or _is_transformers_object(collate_fn)
        self.loss_fn = loss_fn
        self.optimizer_recipe = optimizer_recipe
        self.batch_size = batch_size
        # Columns a Trainer keeps (it drops the others before collating); None keeps all.
        self.kept_columns = kept_columns
        self.pipeline_name = pipeline_name
        self.forward_inputs = _ForwardInputs.of(model)

    @classmethod
    def from_arguments(cls, model, data, collate_fn, loss_fn, optimizer, batch_size) -> _PipelineRun:
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
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        dataset = data
        if isinstance(data, DataLoader):
            dataset = data.dataset
            collate_fn = collate_fn or data.collate_fn
            batch_size = batch_size if batch_size is not None else data.batch_size
        return cls(
            model=model,
            dataset=dataset,
            collate_fn=collate_fn or default_collate,
            loss_fn=loss_fn,
            optimizer_recipe=(
                _sgd_recipe(DEFAULT_SGD_LR, "no optimizer was given")
                if optimizer is None
                else _rebuild_recipe(model, optimizer, "yours")
            ),
            batch_size=_validated_batch_size(batch_size if batch_size is not None else DEFAULT_BATCH_SIZE),
        )

    @classmethod
    def from_trainer(cls, trainer) -> _PipelineRun:
        model = trainer.model
        if not isinstance(model, nn.Module):
            raise TypeError(f"trainer.model is a {type(model).__name__}, not a torch.nn.Module")
        if trainer.train_dataset is None:
            raise ValueError("the Trainer has no train_dataset: pass train_dataset=... to Trainer(...)")
        kept_columns = None
        if trainer.args.remove_unused_columns:
            # What the Trainer keeps: the forward's arguments and the label columns.
            label_names = getattr(trainer, "label_names", None) or []
            kept_columns = set(_ForwardInputs.of(model).names) | set(LABEL_ALIASES) | set(label_names)
        return cls(
            model=model,
            dataset=trainer.train_dataset,
            collate_fn=trainer.data_collator,
            loss_fn=_trainer_loss_fn(trainer),
            optimizer_recipe=_trainer_recipe(trainer),
            batch_size=_validated_batch_size(trainer.args.per_device_train_batch_size),
            kept_columns=kept_columns,
            pipeline_name="the Trainer",
        )

    # ---- running

    def report(self) -> PipelineReport:
        steps: list[PipelineStep] = []
        failed = None
        # fork_rng: dropout and sampling here must not move the user's random stream.
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.manual_seed(0)
            self.model = _training_copy(self.original_model)
            self.model.zero_grad(set_to_none=True)
            for name in STEP_NAMES:
                if failed is not None:
                    steps.append(PipelineStep(name, None, f"not run: '{failed}' failed"))
                    continue
                step = _run_step(name, getattr(self, f"check_{name}"))
                steps.append(step)
                if not step.ok:
                    failed = name
        return PipelineReport(type(self.original_model).__name__, steps)

    # ---- the steps, check_<name> for each of STEP_NAMES: each returns its message or raises _StepFailed

    def check_data(self) -> str:
        self.samples = _first_samples(self.dataset, SAMPLES_TO_SCAN)
        self.style = _sample_style(self.samples)
        if self.style == "keyword":
            notes = self._check_sample_keys()
        else:
            notes = []
            self._check_pair_samples()
        for index, sample in enumerate(self.samples):
            bad = _nonfinite_fields(sample)
            if bad:
                raise _StepFailed(
                    f"sample {index} has NaN/inf in {', '.join(bad)}",
                    "clean or drop such samples before training (filter rows with missing values, "
                    "or torch.nan_to_num): NaN inputs make the loss NaN",
                )
        count = len(self.samples)
        scanned = f"the first {count} samples" if count == SAMPLES_TO_SCAN else f"{count} samples"
        layout = f"keys {_names(_all_keys(self.samples))}" if self.style == "keyword" else "(inputs, target) pairs"
        return "; ".join([f"{scanned} checked: {layout}, numbers finite"] + notes)

    def _check_sample_keys(self) -> list[str]:
        """Check dict samples' keys against the forward; returns notes for the step's message."""
        keys = _all_keys(self.samples)
        text_keys = [key for key in keys if any(_holds_text(sample.get(key)) for sample in self.samples)]
        if not self.collator_only_stacks:
            return [f"the text in {_names(text_keys)} is left to the collate_fn"] if text_keys else []
        dropped = [key for key in keys if self.kept_columns is not None and key not in self.kept_columns]
        reaching = [key for key in keys if key not in dropped]
        forward = self.forward_inputs
        if text_keys and forward.missing_main_input(reaching):
            columns = ", ".join(f"batch[{key!r}]" for key in text_keys[:2])
            raise _StepFailed(
                f"the samples are raw text: {_names(text_keys)} hold strings, and there is no "
                f"{forward.main_input} for {forward.model_name}.forward",
                f"tokenize the dataset first, e.g. tokenized = dataset.map(lambda batch: "
                f"tokenizer({columns}, truncation=True), batched=True), and give {self.pipeline_name} "
                "the tokenized dataset",
            )
        reaching_text = [key for key in text_keys if key in reaching]
        if reaching_text:
            raise _StepFailed(
                f"{_names(reaching_text)} hold strings, which {self.pipeline_name} passes to the collator",
                f"remove the text columns once tokenized: dataset.remove_columns({reaching_text!r})",
            )
        # transformers' collators rename label/label_ids to labels.
        aliases = LABEL_ALIASES if _is_transformers_object(self.collate_fn) else ()
        _raise_on_input_problem(forward, reaching, aliases, where="the samples")
        notes = []
        if dropped:
            notes.append(f"{self.pipeline_name} drops {_names(dropped)} (not forward arguments)")
        ignored = [key for key in reaching if key not in forward.names and key not in aliases]
        if ignored:
            notes.append(f"{forward.model_name}.forward ignores {_names(ignored)} (through its **kwargs)")
        return notes

    def _check_pair_samples(self) -> None:
        if self.loss_fn is None:
            raise _StepFailed(
                "the samples are (inputs, target) pairs, but there is no loss_fn to score outputs against targets",
                "pass loss_fn=..., e.g. check_pipeline(model, data, loss_fn=torch.nn.CrossEntropyLoss())",
            )
        if self.collator_only_stacks and any(_holds_text(inputs) for inputs, _ in self.samples):
            raise _StepFailed(
                "the inputs are raw text, which cannot be stacked into a tensor",
                "encode them into token ids (a tokenizer in the Dataset's __getitem__), "
                "or pass a collate_fn that tokenizes each batch",
            )

    def check_collate(self) -> str:
        pieces = self.samples[: self.batch_size]
        if self.kept_columns is not None and self.style == "keyword":
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
            ) from error
        self.batch = _to_cpu(batch)
        self._split_batch()
        if self.style == "keyword" and not self.collator_only_stacks:
            _raise_on_input_problem(self.forward_inputs, list(self.batch), (), where="the batch")
        return f"batch of {len(pieces)}: {_describe(self.batch)}"

    def _split_batch(self) -> None:
        """Set ``inputs`` (what the model gets) and ``target`` (what loss_fn gets, or None)."""
        batch = self.batch
        if self.style == "keyword":
            if not isinstance(batch, Mapping):
                raise _StepFailed(f"the collate_fn turned dict samples into a {type(batch).__name__}, not a dict")
            fields = list(batch.items())
            inputs, target = dict(batch), None
            if self.loss_fn is not None:
                # As the Trainer does with compute_loss_func: labels go to the loss, not the model.
                target = inputs.pop("labels", None)
        else:
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise _StepFailed(
                    f"the collate_fn turned (inputs, target) pairs into a {_describe_value(batch)}, "
                    "not an (inputs, targets) pair"
                )
            inputs, target = batch
            if isinstance(inputs, Mapping):
                fields = [(f"inputs[{key!r}]", value) for key, value in inputs.items()]
            elif isinstance(inputs, (tuple, list)):
                fields = [(f"inputs[{index}]", value) for index, value in enumerate(inputs)]
            else:
                fields = [("inputs", inputs)]
            fields.append(("target", target))
        not_tensors = [
            f"{name} is a {_describe_value(value)}" for name, value in fields if not isinstance(value, torch.Tensor)
        ]
        if not_tensors:
            raise _StepFailed(
                f"the batch holds non-tensors: {'; '.join(not_tensors)}",
                "torch's default_collate turns per-sample lists into lists of tensors: return tensors "
                "from the Dataset, or use a collator that builds them, such as transformers' "
                "DataCollatorWithPadding(tokenizer)",
            )
        self.inputs, self.target = inputs, target

    def check_forward(self) -> str:
        num_labels = _classifier_size(self.original_model)
        if self.style == "keyword" and self.loss_fn is None and num_labels is not None:
            # The labels go into the forward, where one out of range fails deep inside the loss
            # (a device-side assert on GPU): compare them with the classifier's size first.
            _raise_on_label_range(
                _label_values(self.samples, self.batch, self.style),
                num_labels,
                lambda needed: f"build the model with num_labels={needed}, e.g. "
                f"AutoModelForSequenceClassification.from_pretrained(checkpoint, num_labels={needed})",
            )
        self.outputs = self._call_model(self.inputs)
        if isinstance(self.outputs, torch.Tensor):
            return f"{self.forward_inputs.model_name} returned a tensor {tuple(self.outputs.shape)}"
        loss, logits = _output_loss(self.outputs), _output_logits(self.outputs)
        if loss is None and logits is None:
            raise _StepFailed(
                f"the model returned a {type(self.outputs).__name__} with no tensor in it",
                "forward should return the outputs (logits), or a loss",
            )
        parts = []
        if loss is not None and self.loss_fn is None:
            parts.append(f"loss {_format_number(loss)}")
        if logits is not None:
            parts.append(f"logits {tuple(logits.shape)}")
        return f"{self.forward_inputs.model_name} returned {' and '.join(parts)}"

    def check_loss(self) -> str:
        if self.loss_fn is not None:
            num_classes = _class_count(_output_logits(self.outputs), self.target)
            if num_classes is not None:
                _raise_on_label_range(
                    _label_values(self.samples, self.batch, self.style),
                    num_classes,
                    lambda needed: f"make the model output {needed} values per sample "
                    f"(e.g. out_features={needed} on its last nn.Linear)",
                )
        loss = self._loss(self.outputs)
        if loss.numel() != 1:
            raise _StepFailed(
                f"the loss has shape {tuple(loss.shape)}, not a single number: backward() needs a scalar",
                "reduce it: loss.mean(), or reduction='mean' (not 'none') in the loss function",
            )
        if not loss.requires_grad:
            raise _StepFailed(
                "the loss does not depend on any trainable parameter (requires_grad=False)",
                "compute it from the model's outputs, without .detach(), .item(), torch.no_grad() "
                "or re-wrapping in torch.tensor(...)",
            )
        if not torch.isfinite(loss.detach()).all():
            raise _StepFailed(
                f"the loss is {_format_number(loss)}",
                "find where NaN/inf first appears (numguard_nb's Guard names the module); "
                "look for log(0) or division by zero in the loss",
            )
        self.loss = loss
        return f"finite scalar {_format_number(loss)}"

    def check_backward(self) -> str:
        self.loss.backward()
        trainable = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        frozen = [name for name, p in self.model.named_parameters() if not p.requires_grad]
        if not trainable:
            raise _StepFailed(
                "every parameter is frozen (requires_grad=False): training would change nothing",
                "unfreeze the parameters to train: p.requires_grad_(True)",
            )
        nonfinite = [name for name, p in trainable if p.grad is not None and not torch.isfinite(p.grad).all()]
        if nonfinite:
            raise _StepFailed(
                f"non-finite gradients in {_names(nonfinite)}",
                "the loss is finite but its gradient is not: look for sqrt/log/division near 0; "
                "numguard_nb's Guard(model, backward=True) names the module",
            )
        without_grad = [name for name, p in trainable if p.grad is None]
        if without_grad:
            raise _StepFailed(
                f"{len(without_grad)} trainable parameters got no gradient: {_names(without_grad)}",
                "they take no part in the loss: use them in forward, or freeze them "
                "(p.requires_grad_(False)) if they are meant to stay fixed",
            )
        message = f"all {len(trainable)} trainable parameters got finite gradients"
        if frozen:
            message += f"; {len(frozen)} frozen parameters rightly got none: {_names(frozen)}"
        return message

    def check_optimizer(self) -> str:
        plan = self.optimizer_recipe(self.model)
        if plan.optimizer is None:
            others = f" (it holds {plan.foreign_tensor_count} other tensors)" if plan.foreign_tensor_count else ""
            raise _StepFailed(
                f"the optimizer holds none of this model's parameters{others}",
                "build it from this model, e.g. torch.optim.AdamW(model.parameters()); in a notebook, "
                "re-running the cell that creates the model leaves the optimizer on the old one",
            )
        held = {id(p) for group in plan.optimizer.param_groups for p in group["params"]}
        trainable = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        not_held = [name for name, p in trainable if id(p) not in held]
        if not_held:
            raise _StepFailed(
                f"the optimizer does not hold {len(not_held)} trainable parameters: {_names(not_held)}",
                "create the optimizer once the whole model is built (heads included), from model.parameters()",
            )
        # The overfit step measures progress from here, before any weight has moved.
        self.untrained_loss = self._evaluation_loss()
        before = {name: p.detach().clone() for name, p in trainable}
        plan.optimizer.step()
        changed = [name for name, p in trainable if not torch.equal(before[name], p.detach())]
        if not changed:
            raise _StepFailed(
                f"one step with {plan.description} changed no weight",
                "check that the learning rate is not 0 and that the gradients are not all zero",
            )
        self.optimizer = plan.optimizer
        message = f"one step changed {len(changed)} of {len(trainable)} trainable parameters"
        message += f", with {plan.description}"
        if plan.foreign_tensor_count:
            message += f"; the optimizer also holds {plan.foreign_tensor_count} tensors that are not the model's"
        return message

    def check_overfit(self) -> str:
        start = self.untrained_loss
        for _ in range(OVERFIT_STEPS):
            self.optimizer.zero_grad(set_to_none=True)
            self._loss(self._call_model(self.inputs)).backward()
            self.optimizer.step()
        end = self._evaluation_loss()
        # The optimizer step took one step on this batch already.
        change = f" ({100 * (end - start) / abs(start):+.2g}%)" if start and math.isfinite(start) else ""
        summary = (
            f"{OVERFIT_STEPS + 1} steps on one batch took the loss from {_format_number(start)} "
            f"to {_format_number(end)}{change}"
        )
        fitted = end < start or abs(end) < 1e-6  # a loss already at 0 cannot go lower
        if not fitted:
            raise _StepFailed(
                f"{summary}: the model cannot fit a single batch",
                "check the learning rate (too high diverges, 0 stalls), that the labels match the inputs, "
                "and that the loss is computed from the model's outputs",
            )
        return summary

    # ---- shared by the steps

    def _call_model(self, inputs):
        if isinstance(inputs, Mapping):
            return self.model(**inputs)
        if isinstance(inputs, (tuple, list)):
            return self.model(*inputs)
        return self.model(inputs)

    def _loss(self, outputs) -> torch.Tensor:
        if self.loss_fn is not None:
            loss = self.loss_fn(outputs, self.target)
            if not isinstance(loss, torch.Tensor):
                raise _StepFailed(
                    f"loss_fn returned a {type(loss).__name__}, not a tensor",
                    "return the loss tensor itself, not loss.item()",
                )
            return loss
        # Without a loss_fn, a bare tensor from the model can only be the loss.
        loss = outputs if isinstance(outputs, torch.Tensor) else _output_loss(outputs)
        if loss is None:
            keys = list(self.inputs)
            aliases = [key for key in keys if key in LABEL_ALIASES]
            raise _StepFailed(
                f"the model returned no loss; the batch has {_names(keys)}",
                f"rename {aliases[0]!r} to 'labels' (transformers' collators do it)"
                if aliases
                else "include the labels in the samples (a 'labels' key), or pass loss_fn=...",
            )
        return loss

    def _evaluation_loss(self) -> float:
        # Eval mode, no grad: dropout noise would hide a small decrease.
        self.model.eval()
        with torch.no_grad():
            loss = self._loss(self._call_model(self.inputs))
        self.model.train()
        return float(loss.float().mean())


def _training_copy(model: nn.Module) -> nn.Module:
    try:
        copied = copy.deepcopy(model)
    except Exception as error:
        reason = error_line(error)
        raise TypeError(f"check_pipeline works on a copy of the model, and deepcopy failed: {reason}") from error
    return copied.cpu().train()


def _run_step(name: str, check: Callable[[], str]) -> PipelineStep:
    try:
        return PipelineStep(name, True, check())
    except _StepFailed as failure:
        cause = failure.cause
        return PipelineStep(name, False, failure.message, failure.hint, cause, _format_traceback(cause))
    except Exception as error:  # an unexpected error is itself the finding: keep it with its traceback
        hint = "the traceback shows where it was raised"
        return PipelineStep(name, False, error_line(error), hint, error, _format_traceback(error))


def _format_traceback(error: BaseException | None) -> str:
    if error is None:
        return ""
    return "".join(traceback_module.format_exception(type(error), error, error.__traceback__))


# ------------------------------------------------------------ arguments and samples


def _is_trainer(obj: Any) -> bool:
    # By class name, so transformers need not be imported; subclasses (Seq2SeqTrainer...) match too.
    return hasattr(obj, "train_dataset") and any(klass.__name__ == "Trainer" for klass in type(obj).__mro__)


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
            f"the data is a dict with keys {_names(dataset)} (a DatasetDict?): pass one split, e.g. data['train']"
        )
    if isinstance(dataset, Iterator):
        raise TypeError(
            "the data is a one-shot iterator, which the check would use up: pass the dataset or list itself"
        )
    if not (hasattr(dataset, "__getitem__") or hasattr(dataset, "__iter__")):
        raise TypeError(f"the data must be a Dataset, a DataLoader or a list of samples, got {type(dataset).__name__}")
    if hasattr(dataset, "__len__") and len(dataset) == 0:
        raise ValueError("the data is empty: pass a dataset or list with at least one sample")


def _first_samples(dataset: Any, limit: int) -> list:
    """The first ``limit`` samples: by index when the dataset has a length, else by iterating."""
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return [dataset[index] for index in range(min(len(dataset), limit))]
    samples = list(itertools.islice(iter(dataset), limit))
    if not samples:
        raise _StepFailed("the dataset yielded no samples", "check that it is not exhausted or filtered to nothing")
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
        raise _StepFailed(
            "some samples are dicts and others (inputs, target) pairs", "return one kind from the Dataset"
        )
    return styles.pop()


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


# ------------------------------------------------------------ values


def _names(names) -> str:
    names = [str(name) for name in names]
    extra = len(names) - NAMES_SHOWN
    shown = ", ".join(names[:NAMES_SHOWN])
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
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _numeric_leaves(item)
    elif isinstance(value, (list, tuple)) or hasattr(value, "__array__"):
        try:  # one tensor for a regular list or array of numbers: fast for token ids
            yield torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            if isinstance(value, (list, tuple)):
                for item in value:
                    yield from _numeric_leaves(item)


def _is_finite(value: Any) -> bool:
    return all(bool(torch.isfinite(leaf).all()) for leaf in _numeric_leaves(value) if leaf.is_floating_point())


def _nonfinite_fields(sample: Any) -> list[str]:
    fields = sample.items() if isinstance(sample, Mapping) else zip(("inputs", "target"), sample)
    return [str(name) for name, value in fields if not _is_finite(value)]


def _length(value: Any) -> int | None:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return shape[0] if len(shape) else None
    return len(value) if isinstance(value, (list, tuple)) else None


def _ragged_fields(samples: list, style: str) -> str:
    """Describe the fields whose lengths differ across samples; '' when none do."""
    if style == "keyword":
        fields = {key: [sample.get(key) for sample in samples] for key in _all_keys(samples)}
    else:
        fields = {"inputs": [inputs for inputs, _ in samples], "target": [target for _, target in samples]}
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
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple takes its fields as arguments
        return type(value)(*(_to_cpu(item) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(item) for item in value)
    return value


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def _describe(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return ", ".join(f"{key} {_describe_value(value)}" for key, value in batch.items())
    inputs, target = batch
    described = _describe(inputs) if isinstance(inputs, Mapping) else _describe_value(inputs)
    return f"inputs {described}; target {_describe_value(target)}"


def _format_number(value: Any) -> str:
    number = float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)
    return f"{number:.4g}"


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
    """The number of logits of a Hugging Face single-label classification head, or None."""
    config = getattr(model, "config", None)
    num_labels = getattr(config, "num_labels", None)
    if "Classification" not in type(model).__name__ or not isinstance(num_labels, int) or num_labels < 2:
        return None
    if getattr(config, "problem_type", None) in ("regression", "multi_label_classification"):
        return None
    return num_labels


def _class_count(logits: torch.Tensor | None, target: Any) -> int | None:
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


def _label_values(samples: list, batch: Any, style: str) -> torch.Tensor | None:
    """The integer labels of the scanned samples and the batch, -100 left out; None if not integers."""
    if style == "keyword":
        found = [sample[key] for sample in samples for key in LABEL_KEYS if key in sample]
        found += [batch[key] for key in LABEL_KEYS if key in batch]
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
        raise _StepFailed(f"labels go up to {highest} but the model outputs {num_outputs} logits", fix(highest + 1))
    if lowest < 0:
        raise _StepFailed(
            f"labels go down to {lowest}: class labels must be in 0..{num_outputs - 1} "
            f"({IGNORED_LABEL} marks positions to ignore)",
            "map the labels to 0..n-1 before training",
        )


# ------------------------------------------------------------ optimizers


def _sgd_recipe(lr: float, reason: str) -> _OptimizerRecipe:
    def recipe(model: nn.Module) -> _OptimizerPlan:
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trainable, lr=lr) if trainable else None
        return _OptimizerPlan(optimizer, f"SGD(lr={lr:g}), used as {reason}")

    return recipe


def _rebuild_recipe(model: nn.Module, optimizer: torch.optim.Optimizer, whose: str) -> _OptimizerRecipe:
    """The same optimizer class and param-group hyperparameters, fresh state, over the copy."""

    def recipe(copied: nn.Module) -> _OptimizerPlan:
        # deepcopy keeps the parameter order, so the i-th parameters correspond.
        counterpart = {id(p): q for p, q in zip(model.parameters(), copied.parameters())}
        groups, foreign = [], 0
        for group in optimizer.param_groups:
            params = [counterpart[id(p)] for p in group["params"] if id(p) in counterpart]
            foreign += len(group["params"]) - len(params)
            if params:
                hyperparameters = {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
                # A scheduler may have decayed lr to 0 by the end of a run: check with the lr it started from.
                hyperparameters["lr"] = hyperparameters.get("initial_lr", hyperparameters.get("lr"))
                groups.append({**hyperparameters, "params": params})
        optimizer_class = type(optimizer)
        if not groups:
            return _OptimizerPlan(None, optimizer_class.__name__, foreign)
        accepted = inspect.signature(optimizer_class.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        # defaults may hold entries the constructor does not take (AdamW's decoupled_weight_decay).
        defaults = {key: value for key, value in optimizer.defaults.items() if takes_any or key in accepted}
        rebuilt = optimizer_class(groups, **defaults)
        scheduled = ", the schedule's initial lr" if "initial_lr" in groups[0] else ""
        lr = _format_number(groups[0]["lr"])
        description = f"{optimizer_class.__name__}(lr={lr}{scheduled}), rebuilt from {whose}"
        return _OptimizerPlan(rebuilt, description, foreign)

    return recipe


def _unwrapped_optimizer(optimizer: Any) -> Any:
    # accelerate wraps the Trainer's optimizer once training has started; the real one is inside.
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _trainer_recipe(trainer) -> _OptimizerRecipe:
    if trainer.optimizer is not None:
        return _rebuild_recipe(trainer.model, _unwrapped_optimizer(trainer.optimizer), "the Trainer's")
    args = trainer.args
    optim_name = getattr(args.optim, "value", args.optim)

    def recipe(copied: nn.Module) -> _OptimizerPlan:
        try:
            optimizer = _trainer_optimizer(trainer, copied)
        except Exception as error:  # e.g. bitsandbytes missing: any optimizer shows the wiring works
            reason = f"the Trainer's {optim_name} cannot be rebuilt here ({error_line(error)})"
            return _sgd_recipe(args.learning_rate, reason)(copied)
        lr = _format_number(optimizer.param_groups[0]["lr"])
        description = f"{type(optimizer).__name__}(lr={lr}), built as the Trainer does (optim={optim_name})"
        return _OptimizerPlan(optimizer, description)

    return recipe


def _trainer_optimizer(trainer, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``Trainer.create_optimizer`` would build over ``model``, without touching the Trainer."""
    if trainer.optimizer_cls_and_kwargs is not None:
        optimizer_class, kwargs = trainer.optimizer_cls_and_kwargs
    else:
        optimizer_class, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
    special = {"params", "model", "optimizer_dict"} & set(kwargs)
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)) or special:
        raise ValueError("it builds its own parameter groups")
    decay = set(trainer.get_decay_parameter_names(model))
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for name, p in trainable if name in decay], "weight_decay": trainer.args.weight_decay},
        {"params": [p for name, p in trainable if name not in decay], "weight_decay": 0.0},
    ]
    return optimizer_class([group for group in groups if group["params"]], **kwargs)


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

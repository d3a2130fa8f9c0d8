"""The doctor's run: `check_pipeline` and the steps it takes on a copy of the model.

Each step, `check_<name>` for each of STEP_NAMES, returns what it found (the step's message)
or raises `StepFailed` with a diagnosis and a fix; what it leaves (the samples, the batch, the
outputs, the loss, the optimizer) is what the next steps read. The run stops at the first
broken step and reports the rest as not run.
"""

from __future__ import annotations

import copy
import inspect
import math
import traceback as traceback_module
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from .._util import error_line, is_hf_trainer
from .checklist import STEP_NAMES, PipelineReport, PipelineStep, StepFailed, format_number, listed
from .labels import (LABEL_ALIASES, class_count, classifier_size, ignored_label, label_values,
                     raise_on_label_range, raise_on_token_range)
from .samples import (
    ForwardInputs, all_keys, batch_contents, batch_on_cpu, first_samples, holds_text,
    nonfinite_fields, output_logits, output_loss, raise_on_input_problem, ragged_fields,
    sample_style, type_and_size,
)
from .settings import PipelineSettings, settings_from_arguments, settings_from_trainer

__all__ = ["check_pipeline", "SAMPLES_TO_SCAN", "OVERFIT_STEPS"]

# The data step looks at this many samples (the batch only uses the first few):
# enough to catch NaN rows and labels out of range without reading a large dataset.
SAMPLES_TO_SCAN = 256
OVERFIT_STEPS = 10


# Both spellings: the doctor's fixes are read in Python and under %numguard_check alike.
GIVE_LOSS_FN = (
    "check_pipeline(model, data, loss_fn=torch.nn.CrossEntropyLoss()), "
    "or `criterion = torch.nn.CrossEntropyLoss()` then `%numguard_check MODEL DATA --loss criterion`"
)


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
    if is_hf_trainer(model):
        if data is not None or collate_fn or loss_fn or optimizer or batch_size is not None:
            raise TypeError(
                "check_pipeline(trainer) takes the data, collator, optimizer and batch size "
                "from the Trainer: pass the Trainer alone"
            )
        settings = settings_from_trainer(model)
    else:
        settings = settings_from_arguments(model, data, collate_fn, loss_fn, optimizer, batch_size)
    return _PipelineRun(settings).report()


class _PipelineRun:
    """The state threaded through the steps: each check reads what the earlier ones left."""

    def __init__(self, settings: PipelineSettings):
        self.settings = settings
        self.forward_inputs = ForwardInputs.of(settings.model)
        # What the steps leave for the later ones (empty until the step has run).
        self.model: nn.Module | None = None  # the training copy, made when the run starts
        self.samples: list = []  # check_data: the first SAMPLES_TO_SCAN samples
        self.style = ""  # check_data: "keyword" (dict samples) or "pair" ((inputs, target) samples)
        self.batch: Any = None  # check_collate: the collated batch, on the CPU
        self.inputs: Any = None  # check_collate: what the model is called with
        self.target: Any = None  # check_collate: what loss_fn scores the outputs against, if any
        self.outputs: Any = None  # check_forward
        self.loss: torch.Tensor | None = None  # check_loss
        self.untrained_loss: float | None = None  # check_optimizer: the loss before any weight moved
        self.optimizer: torch.optim.Optimizer | None = None  # check_optimizer

    # ---- running

    def report(self) -> PipelineReport:
        steps: list[PipelineStep] = []
        failed = None
        # fork_rng: dropout and sampling here must not move the user's random stream.
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.manual_seed(0)
            self.model = _training_copy(self.settings.model)
            self.model.zero_grad(set_to_none=True)
            for name in STEP_NAMES:
                if failed is not None:
                    steps.append(PipelineStep(name, None, f"not run: '{failed}' failed"))
                    continue
                step = _run_step(name, getattr(self, f"check_{name}"))
                steps.append(step)
                if not step.ok:
                    failed = name
        return PipelineReport(type(self.settings.model).__name__, steps)

    # ---- the steps, check_<name> for each of STEP_NAMES: each returns its message or raises StepFailed

    def check_data(self) -> str:
        self.samples = first_samples(self.settings.dataset, SAMPLES_TO_SCAN)
        self.style = sample_style(self.samples)
        if self.style == "keyword":
            notes = self._check_sample_keys()
        else:
            notes = []
            self._check_pair_samples()
        for index, sample in enumerate(self.samples):
            bad = nonfinite_fields(sample)
            if bad:
                raise StepFailed(
                    f"sample {index} has NaN/inf in {', '.join(bad)}",
                    "clean or drop such samples before training (filter rows with missing values, "
                    "or torch.nan_to_num): NaN inputs make the loss NaN",
                )
        count = len(self.samples)
        scanned = f"the first {count} samples" if count == SAMPLES_TO_SCAN else f"{count} samples"
        layout = f"keys {listed(all_keys(self.samples))}" if self.style == "keyword" else "(inputs, target) pairs"
        return "; ".join([f"{scanned} checked: {layout}, numbers finite"] + notes)

    def _check_sample_keys(self) -> list[str]:
        """Check dict samples' keys against the forward; returns notes for the step's message."""
        keys = all_keys(self.samples)
        text_keys = [key for key in keys if any(holds_text(sample.get(key)) for sample in self.samples)]
        if not self.settings.collator_only_stacks:
            return [f"the text in {listed(text_keys)} is left to the collate_fn"] if text_keys else []
        kept = self.settings.kept_columns
        dropped = [key for key in keys if kept is not None and key not in kept]
        reaching = [key for key in keys if key not in dropped]
        forward = self.forward_inputs
        if text_keys and forward.missing_main_input(reaching):
            columns = ", ".join(f"batch[{key!r}]" for key in text_keys[:2])
            raise StepFailed(
                f"the samples are raw text: {listed(text_keys)} hold strings, and there is no "
                f"{forward.main_input} for {forward.model_name}.forward",
                f"tokenize the dataset first, e.g. tokenized = dataset.map(lambda batch: "
                f"tokenizer({columns}, truncation=True), batched=True), and give {self.settings.pipeline_name} "
                "the tokenized dataset",
            )
        reaching_text = [key for key in text_keys if key in reaching]
        if reaching_text:
            raise StepFailed(
                f"{listed(reaching_text)} hold strings, which {self.settings.pipeline_name} passes to the collator",
                f"remove the text columns once tokenized: dataset.remove_columns({reaching_text!r})",
            )
        aliases = LABEL_ALIASES if self.settings.collator_renames_labels else ()
        raise_on_input_problem(forward, reaching, aliases, where="the samples")
        notes = []
        if dropped:
            notes.append(f"{self.settings.pipeline_name} drops {listed(dropped)} (not forward arguments)")
        ignored = [key for key in reaching if key not in forward.names and key not in aliases]
        if ignored:
            notes.append(f"{forward.model_name}.forward ignores {listed(ignored)} (through its **kwargs)")
        return notes

    def _check_pair_samples(self) -> None:
        if self.settings.loss_fn is None:
            raise StepFailed(
                "the samples are (inputs, target) pairs, but there is no loss_fn to score outputs against targets",
                f"give the loss function: {GIVE_LOSS_FN}",
            )
        if self.settings.collator_only_stacks and any(holds_text(inputs) for inputs, _ in self.samples):
            raise StepFailed(
                "the inputs are raw text, which cannot be stacked into a tensor",
                "encode them into token ids (a tokenizer in the Dataset's __getitem__), "
                "or pass a collate_fn that tokenizes each batch",
            )

    def _pieces(self, start: int = 0) -> list:
        """The samples of one batch from `start`, with the columns the pipeline keeps."""
        pieces = self.samples[start: start + self.settings.batch_size]
        kept = self.settings.kept_columns
        if kept is not None and self.style == "keyword":
            pieces = [{key: value for key, value in sample.items() if key in kept} for sample in pieces]
        return pieces

    def check_collate(self) -> str:
        pieces = self._pieces()
        try:
            batch = self.settings.collate_fn(pieces)
        except Exception as error:
            ragged = ragged_fields(pieces, self.style)
            if not ragged:
                raise
            raise StepFailed(
                f"cannot stack the samples into a batch: {ragged}",
                "pad them: use transformers' DataCollatorWithPadding(tokenizer) as the collator, "
                "or padding='max_length' in the tokenizer, or a collate_fn that pads "
                "(torch.nn.utils.rnn.pad_sequence)",
                cause=error,
            ) from error
        self.batch = batch_on_cpu(batch)
        self._split_batch()
        if self.style == "keyword" and not self.settings.collator_only_stacks:
            raise_on_input_problem(self.forward_inputs, list(self.batch), (), where="the batch")
        return f"batch of {len(pieces)}: {batch_contents(self.batch)}"

    def _split_batch(self) -> None:
        """Set ``inputs`` (what the model gets) and ``target`` (what loss_fn gets, or None)."""
        batch = self.batch
        if self.style == "keyword":
            if not isinstance(batch, Mapping):
                raise StepFailed(f"the collate_fn turned dict samples into a {type(batch).__name__}, not a dict")
            fields = list(batch.items())
            inputs, target = dict(batch), None
            if self.settings.loss_fn is not None:
                # As the Trainer does with compute_loss_func: labels go to the loss, not the model.
                target = inputs.pop("labels", None)
        else:
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise StepFailed(
                    f"the collate_fn turned (inputs, target) pairs into a {type_and_size(batch)}, "
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
            f"{name} is a {type_and_size(value)}" for name, value in fields if not isinstance(value, torch.Tensor)
        ]
        if not_tensors:
            raise StepFailed(
                f"the batch holds non-tensors: {'; '.join(not_tensors)}",
                "torch's default_collate turns per-sample lists into lists of tensors: return tensors "
                "from the Dataset, or use a collator that builds them, such as transformers' "
                "DataCollatorWithPadding(tokenizer)",
            )
        self.inputs, self.target = inputs, target

    def check_forward(self) -> str:
        num_labels = classifier_size(self.settings.model)
        if self.style == "keyword":  # (ids past the vocabulary: a device-side assert on GPU)
            raise_on_token_range(self.settings.model, self.samples, self.batch)
        if self.style == "keyword" and self.settings.loss_fn is None and num_labels is not None:
            # The labels go into the forward, where one out of range fails deep inside the loss
            # (a device-side assert on GPU): compare them with the classifier's size first.
            raise_on_label_range(
                label_values(self.samples, self.batch, self.style),
                num_labels,
                lambda needed: f"build the model with num_labels={needed}, e.g. "
                f"AutoModelForSequenceClassification.from_pretrained(checkpoint, num_labels={needed})",
            )
        self.outputs = self._call_model(self.inputs)
        if isinstance(self.outputs, torch.Tensor):
            return f"{self.forward_inputs.model_name} returned a tensor {tuple(self.outputs.shape)}"
        loss, logits = output_loss(self.outputs), output_logits(self.outputs)
        if loss is None and logits is None:
            raise StepFailed(
                f"the model returned a {type(self.outputs).__name__} with no tensor in it",
                "forward should return the outputs (logits), or a loss",
            )
        parts = []
        if loss is not None and self.settings.loss_fn is None:
            parts.append(f"loss {format_number(loss)}")
        if logits is not None:
            parts.append(f"logits {tuple(logits.shape)}")
        return f"{self.forward_inputs.model_name} returned {' and '.join(parts)}"

    def check_loss(self) -> str:
        if self.settings.loss_fn is not None:
            num_classes = class_count(output_logits(self.outputs), self.target)
            if num_classes is not None:
                ignored = ignored_label(self.settings.loss_fn)
                raise_on_label_range(
                    label_values(self.samples, self.batch, self.style, ignored),
                    num_classes,
                    lambda needed: f"make the model output {needed} values per sample "
                    f"(e.g. out_features={needed} on its last nn.Linear)",
                    ignored,
                )
        loss = self._loss(self.outputs)
        if loss.numel() != 1:
            raise StepFailed(
                f"the loss has shape {tuple(loss.shape)}, not a single number: backward() needs a scalar",
                "reduce it: loss.mean(), or reduction='mean' (not 'none') in the loss function",
            )
        if not loss.requires_grad:
            raise StepFailed(
                "the loss does not depend on any trainable parameter (requires_grad=False)",
                "compute it from the model's outputs, without .detach(), .item(), torch.no_grad() "
                "or re-wrapping in torch.tensor(...)",
            )
        if not torch.isfinite(loss.detach()).all():
            raise StepFailed(
                f"the loss is {format_number(loss)}",
                "find where NaN/inf first appears (numguard_nb's Guard names the module); "
                "look for log(0) or division by zero in the loss",
            )
        self.loss = loss
        return f"finite scalar {format_number(loss)}"

    def check_backward(self) -> str:
        self.loss.backward()
        trainable = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        frozen = [name for name, p in self.model.named_parameters() if not p.requires_grad]
        if not trainable:
            raise StepFailed(
                "every parameter is frozen (requires_grad=False): training would change nothing",
                "unfreeze the parameters to train: p.requires_grad_(True)",
            )
        nonfinite = [name for name, p in trainable if p.grad is not None and not torch.isfinite(p.grad).all()]
        if nonfinite:
            raise StepFailed(
                f"non-finite gradients in {listed(nonfinite)}",
                "the loss is finite but its gradient is not: look for sqrt/log/division near 0; "
                "numguard_nb's Guard(model, backward=True) names the module",
            )
        without_grad = self._unused_in_other_steps([(name, p) for name, p in trainable if p.grad is None])
        if without_grad:
            raise StepFailed(
                f"{len(without_grad)} trainable parameters got no gradient: {listed(without_grad)}",
                "they take no part in the loss: use them in forward, or freeze them "
                "(p.requires_grad_(False)) if they are meant to stay fixed",
            )
        message = f"all {len(trainable)} trainable parameters got finite gradients"
        if frozen:
            message += f"; {len(frozen)} frozen parameters rightly got none: {listed(frozen)}"
        return message

    def _unused_in_other_steps(self, unused: list) -> list:
        """The names of the parameters of `unused` (name, parameter) that get no gradient in 8
        more steps either, over the first 4 batches (LayerDrop and stochastic depth skip layers
        at random, a mixture of experts routes a batch to some experts only).
        Their gradients are not kept: the step goes on from this one's."""
        saved = self.batch, self.inputs, self.target
        starts = list(range(0, len(self.samples), self.settings.batch_size))[:4]
        try:
            for start in (starts * 8)[:8]:  # (a layer dropped half the time: kept once in 8, 99.6%)
                if not unused:
                    break
                try:
                    self.batch = batch_on_cpu(self.settings.collate_fn(self._pieces(start)))
                    self._split_batch()
                    grads = torch.autograd.grad(self._loss(self._call_model(self.inputs)),
                                                [p for _, p in unused], allow_unused=True)
                except Exception:  # (a batch this step cannot take: the first one's verdict)
                    break
                unused = [(name, p) for (name, p), grad in zip(unused, grads) if grad is None]
        finally:
            self.batch, self.inputs, self.target = saved
        return [name for name, _ in unused]

    def check_optimizer(self) -> str:
        plan = self.settings.optimizer_recipe(self.model)
        if plan.optimizer is None:
            others = f" (it holds {plan.foreign_tensor_count} other tensors)" if plan.foreign_tensor_count else ""
            raise StepFailed(
                f"the optimizer holds none of this model's parameters{others}",
                "build it from this model, e.g. torch.optim.AdamW(model.parameters()); in a notebook, "
                "re-running the cell that creates the model leaves the optimizer on the old one",
            )
        held = {id(p) for group in plan.optimizer.param_groups for p in group["params"]}
        trainable = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        not_held = [name for name, p in trainable if id(p) not in held]
        if not_held:
            raise StepFailed(
                f"the optimizer does not hold {len(not_held)} trainable parameters: {listed(not_held)}",
                "create the optimizer once the whole model is built (heads included), from model.parameters()",
            )
        # The overfit step measures progress from here, before any weight has moved.
        self.untrained_loss = self._evaluation_loss()
        before = {name: p.detach().clone() for name, p in trainable}
        self._step(plan.optimizer)
        changed = [name for name, p in trainable if not torch.equal(before[name], p.detach())]
        if not changed:
            raise StepFailed(
                f"one step with {plan.description} changed no weight",
                "check that the learning rate is not 0 and that the gradients are not all zero",
            )
        self.optimizer = plan.optimizer
        message = f"one step changed {len(changed)} of {len(trainable)} trainable parameters"
        message += f", with {plan.description}"
        if plan.foreign_tensor_count:
            message += f"; the optimizer also holds {plan.foreign_tensor_count} tensors that are not the model's"
        return message

    def _step(self, optimizer) -> None:
        """`optimizer.step()`, with a closure for one whose step needs it (LBFGS): it computes
        the loss and its gradients again, as a training loop's closure does."""
        closure = inspect.signature(optimizer.step).parameters.get("closure")
        if closure is None or closure.default is not inspect.Parameter.empty:
            optimizer.step()
            return

        def loss_and_gradients():
            optimizer.zero_grad(set_to_none=True)
            loss = self._loss(self._call_model(self.inputs))
            loss.backward()
            return loss

        optimizer.step(loss_and_gradients)

    def check_overfit(self) -> str:
        start = self.untrained_loss
        for _ in range(OVERFIT_STEPS):
            self.optimizer.zero_grad(set_to_none=True)
            self._loss(self._call_model(self.inputs)).backward()
            self._step(self.optimizer)
        end = self._evaluation_loss()
        # The optimizer step took one step on this batch already.
        percent = 100 * (end - start) / abs(start) if start and math.isfinite(start) else None
        change = "" if percent is None or not math.isfinite(percent) else (
            f" ({percent:+.0f}%)" if abs(percent) >= 10 else f" ({percent:+.2g}%)")  # -100%, -0.16%
        summary = (
            f"{OVERFIT_STEPS + 1} steps on one batch took the loss from {format_number(start)} "
            f"to {format_number(end)}{change}"
        )
        fitted = end < start or abs(end) < 1e-6  # a loss already at 0 cannot go lower
        if not fitted:
            raise StepFailed(
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
        if self.settings.loss_fn is not None:
            loss = self.settings.loss_fn(outputs, self.target)
            if not isinstance(loss, torch.Tensor):
                raise StepFailed(
                    f"loss_fn returned a {type(loss).__name__}, not a tensor",
                    "return the loss tensor itself, not loss.item()",
                )
            return loss
        # Without a loss_fn, a bare tensor from the model can only be the loss.
        loss = outputs if isinstance(outputs, torch.Tensor) else output_loss(outputs)
        if loss is None:
            keys = list(self.inputs)
            aliases = [key for key in keys if key in LABEL_ALIASES]
            raise StepFailed(
                f"the model returned no loss; the batch has {listed(keys)}",
                f"rename {aliases[0]!r} to 'labels' (transformers' collators do it)"
                if aliases
                else f"include the labels in the samples (a 'labels' key), or give a loss function: {GIVE_LOSS_FN}",
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
    except StepFailed as failure:
        cause = failure.cause
        return PipelineStep(name, False, failure.message, failure.hint, cause, _format_traceback(cause))
    except Exception as error:  # an unexpected error is itself the finding: keep it with its traceback
        hint = "the traceback shows where it was raised"
        return PipelineStep(name, False, error_line(error), hint, error, _format_traceback(error))


def _format_traceback(error: BaseException | None) -> str:
    if error is None:
        return ""
    return "".join(traceback_module.format_exception(type(error), error, error.__traceback__))


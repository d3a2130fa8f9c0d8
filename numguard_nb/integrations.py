"""Guard a run driven by a Hugging Face ``Trainer`` or by Lightning.

Contract: ``NumguardCallback`` (a ``transformers.TrainerCallback``) and
``NumguardLightningCallback`` (a Lightning ``Callback``) guard the trainer's model for the whole
run, in sentinel mode by default, and leave no hook behind however the run ends (its end, a
detection, ``with callback:`` around ``train()`` for any other error, a later
``on_train_begin``). The run's GradScaler is found and handed to the guard, so the steps it
skips are recorded, not raised. Under torchrun every rank stops at the same step. Importing this
module needs neither transformers nor Lightning (the classes are built on first access).

Limits: the Trainer has no event for a run that raises (hence ``with callback:``); keyword
arguments go to ``Guard``.

    callback = NumguardCallback()
    trainer = Trainer(..., callbacks=[callback])
    with callback:          # detaches the hooks however train() ends
        trainer.train()
    callback.report         # where the first inf/nan came from, or the last frames seen

More: docs/callbacks.md.
"""

from __future__ import annotations

import gc
import warnings
from typing import Callable

import torch
from torch import nn

from ._schema import MODE_SENTINEL
from ._util import compiled_original
from .explain import OPS_ADVICE
from .rerun import run_alone
from .guard import Guard, GuardOptions
from .guard.scaler import SkippedStep, loss_scaler_of
from .report import Report

# The callbacks' sentinel runs one batch in this many with the full hooks: a fault only they see
# (an overflow the model clamps) is named within 100 steps, for about 0.1-1% more time (full mode
# costs 1.1-2x a step on most models; docs/sentinel.md).
FULL_EVERY = 100


class _GuardedRun:
    """What both callbacks share: one Guard per run, detached however the run ends."""

    def __init__(self, mode: str = MODE_SENTINEL, **guard_options):
        if isinstance(mode, torch.nn.Module):  # (the callback finds the model itself)
            raise TypeError(f"{type(self).__name__} takes no model: the trainer's is guarded as "
                            "training begins; pass only options, e.g. "
                            f"{type(self).__name__}(ops=True)")
        if mode == MODE_SENTINEL:  # one full look every FULL_EVERY batches, unless told otherwise
            guard_options.setdefault("full_every", FULL_EVERY)
        # Fail at construction on a misspelt option or a bad value, not when training starts.
        self.options = GuardOptions.from_keywords({"mode": mode, **guard_options})
        self.guard: Guard | None = None
        self._modules_hooked: set = set()  # ids of the model's modules when the guard attached
        self._compiled_later = False  # the Trainer compiles the model after on_train_begin
        self._figures_taken = 0  # history samples whose figures were logged

    @property
    def history(self):
        """The last run's numerics history (`history_every`), or None before a run."""
        return self.guard.history if self.guard is not None else None

    def new_figures(self) -> dict:
        """The history's figures of its latest sample if it is new since the last call, else {}."""
        history = self.history
        if history is None or history.samples_taken == self._figures_taken:
            return {}
        self._figures_taken = history.samples_taken
        return history.scalars()

    @property
    def report(self) -> Report | None:
        """The last run's report: the detection if there was one, else the last frames seen."""
        return self.guard.latest_report() if self.guard is not None else None

    @property
    def skipped_steps(self) -> list[SkippedStep]:
        """The steps the run's GradScaler skipped, their gradients' overflow let through."""
        return list(self.guard.skipped_steps) if self.guard is not None else []

    def start(self, model: nn.Module, scaler=None) -> None:
        """Guard `model`, letting through the overflows `scaler` (the run's GradScaler, found by
        the callback; the one given as an option takes precedence) skips the step for."""
        self.detach()  # a run that crashed outside `with` may have left its hooks
        given = self.options.scaler
        options = self.options.replace(on_detect=self._on_detect,
                                       scaler=given if given is not None else scaler)
        self.guard = Guard(model, **options.as_kwargs()).attach()
        self._figures_taken = 0
        self._modules_hooked = {id(module) for module in model.modules()}

    def start_when_compiled(self) -> None:
        """The model will be compiled before it runs (a Trainer's `torch_compile=True`): guard
        what runs at `start_compiled`."""
        self.detach()
        self._compiled_later = True

    def start_compiled(self, model: nn.Module, scaler=None) -> bool:
        """Guard the torch.compile wrapper made of `model` since `start_when_compiled`; whether
        it started now."""
        if not self._compiled_later:
            return False
        self._compiled_later = False
        self.start(_compiled_wrapper_of(model), scaler)
        return True

    def follow_new_modules(self, model: nn.Module) -> None:
        """Hook the submodules made since the guard attached (a teacher or an EMA copy a
        LightningModule makes in its own on_fit_start, which runs after the callbacks')."""
        now = {id(module) for module in model.modules()}
        if self.guard is not None and self.guard.attached and now != self._modules_hooked:
            self.guard.detach()
            self.guard.attach()
            self._modules_hooked = now

    def detach(self) -> None:
        """Remove the guard's hooks (idempotent); the report stays available."""
        if self.guard is not None:
            self.guard.detach()

    def finish(self, raising: bool = True) -> None:
        """The run ended: detach, and raise what detaching found (the loss code's culprit of
        the last step, a check read then), as a `with Guard(...)` block's exit does."""
        self.detach()
        if self.guard is not None:
            self.guard.raise_found(raising)

    def during(self, stage: str) -> None:
        """Say what the loop runs now besides training ("validation batch 1, after training
        batch 2"; "" for training again): a detection in it says so (its batch number is the
        last training batch's)."""
        if self.guard is not None:
            self.guard.batches.stage = stage

    def _on_detect(self, report: Report):
        # The NonFiniteError about to be raised ends the run: leave no hooks behind.
        self.detach()
        during = f"during {report.stage}: "
        # (taken when its values were made: a check read later says so too; once, should the
        # report come here twice)
        if report.stage and not report.reason.startswith(during):
            report.reason = during + report.reason
        report.hint = report.hint.replace(  # (the engine's words name Guard)
            OPS_ADVICE, f"Pass `{type(self).__name__}(ops=True)` to name the op and the line.")
        user_on_detect = self.options.on_detect
        return user_on_detect(report) if user_on_detect is not None else None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(exc_type is None)


def _resumed_at(guard: Guard | None, batches_run: int) -> None:
    """A Trainer resumed from a checkpoint: its batches go on from those it ran before (each
    forward is a batch: optimizer steps times gradient accumulation)."""
    if guard is not None and batches_run > guard.batches.started:
        guard.batches.started = batches_run


def _compiled_wrapper_of(model: nn.Module) -> nn.Module:
    """What a Trainer run with `torch_compile=True` calls in place of `model`: the torch.compile
    wrapper accelerate made of it (of its DDP wrapper under torchrun), which callbacks are not
    given; `model` itself where there is none. (Hooks on the model alone would run inside the
    compiled code, where they see nothing.) Looked for once a run, among the live objects."""
    found = []
    for wrapper in gc.get_objects():
        # (type(), not isinstance: some objects warn when asked their __class__)
        if issubclass(type(wrapper), _WRAPPERS) and compiled_original(wrapper) is not None \
                and run_alone(wrapper) is model:  # (every wrapper inside it unwrapped)
            found.append(wrapper)
    outermost = [w for w in found if not any(o is not w and _holds(o, w) for o in found)]
    return outermost[0] if len(outermost) == 1 else model


def _holds(outer: nn.Module, inner: nn.Module) -> bool:
    while isinstance(outer, _WRAPPERS) and outer is not inner:
        outer = compiled_original(outer) or outer.module
    return outer is inner


_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel,
             torch._dynamo.eval_frame.OptimizedModule)


def _build_trainer_callback() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as error:
        raise ImportError("NumguardCallback needs transformers: pip install transformers") from error

    class NumguardCallback(_GuardedRun, TrainerCallback):
        """Guard the Trainer's model through training, forward and backward; see the module docstring."""

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if getattr(args, "torch_compile", False):  # compiled after this event
                self.start_when_compiled()
                return
            # accelerate's optimizer carries the Accelerator's GradScaler (fp16 runs)
            self.start(model, loss_scaler_of(optimizer))
            _resumed_at(self.guard, state.global_step * args.gradient_accumulation_steps)

        def on_epoch_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if self.start_compiled(model, loss_scaler_of(optimizer)):
                _resumed_at(self.guard, state.global_step * args.gradient_accumulation_steps)

        def on_step_end(self, args, state, control, **kwargs):
            figures = self.new_figures()
            if figures:
                state.log_history.append({**figures, "step": state.global_step})

        def on_train_end(self, args, state, control, **kwargs):
            self.finish()

    return NumguardCallback


def _build_lightning_callback() -> type:
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError as error:
            raise ImportError("NumguardLightningCallback needs Lightning: pip install lightning") from error

    class NumguardLightningCallback(_GuardedRun, Callback):
        """Guard the LightningModule through ``fit``, forward and backward; see the module docstring."""

        def on_fit_start(self, trainer, pl_module):
            if getattr(pl_module, "_compiler_ctx", None):  # trainer.fit(torch.compile(module))
                warnings.warn(
                    "numguard: not guarding this fit: the LightningModule was compiled "
                    "(trainer.fit(torch.compile(module))), so its training_step runs as compiled "
                    "code, where hooks see nothing and a report would name the wrong module. Fit "
                    "it uncompiled to find the fault (a new instance, or "
                    "lightning.pytorch.utilities.compile.to_uncompiled(module): Lightning keeps "
                    "it compiled after such a fit), or compile a part of it "
                    "(self.net = torch.compile(self.net)): the guard watches such a part's calls",
                    stacklevel=2)
                self.detach()
                return
            self.start(pl_module, loss_scaler_of(trainer))

        def on_train_start(self, trainer, pl_module):
            self.follow_new_modules(pl_module)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # training_step usually calls submodules, not the LightningModule itself: the guard
            # cannot see batches begin, so say when they do.
            if self.guard is not None:
                # numbered as the loop numbers them (a fit resumed from a checkpoint goes on)
                total = getattr(getattr(trainer, "fit_loop", None), "total_batch_idx", None)
                if isinstance(total, int) and total >= self.guard.batches.started:
                    self.guard.batches.started = total
                self.guard.begin_batch()

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            loader = f" of validation loader {dataloader_idx}" if dataloader_idx else ""
            if trainer.sanity_checking:
                self.during(f"the sanity check before training, validation batch {batch_idx}{loader}")
            elif self.guard is not None:
                self.during(f"validation batch {batch_idx}{loader}, after training batch "
                            f"{self.guard.batch_number}")

        def on_validation_end(self, trainer, pl_module):
            self.during("")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            figures = self.new_figures()
            for logger in trainer.loggers if figures else ():
                logger.log_metrics(figures, step=trainer.global_step)

        def on_fit_end(self, trainer, pl_module):
            self.finish()

        def on_exception(self, trainer, pl_module, exception):
            self.detach()

    return NumguardLightningCallback


_BUILDERS: dict[str, Callable[[], type]] = {
    "NumguardCallback": _build_trainer_callback,
    "NumguardLightningCallback": _build_lightning_callback,
}


def __dir__() -> list[str]:
    # No __all__: `import *` would build both classes and fail without their packages.
    return sorted({*globals(), *_BUILDERS})


def __getattr__(name: str) -> type:
    builder = _BUILDERS.get(name)
    if builder is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = builder()
    # Module-level names, so that the classes pickle and show up like ordinary ones.
    cls.__module__, cls.__qualname__ = __name__, name
    globals()[name] = cls
    return cls

"""The guard's promises kept under the training callbacks (issue 25), in the loops people run.

A Hugging Face Trainer (a 2-layer GPT-2 from a config, 30 steps with gradient accumulation,
gradient checkpointing both ways, bf16 autocast on CPU) and a Lightning fit (accumulation too):
- a healthy run ends with the weights and the loss log bit-identical to the same run without
  the callback, in sentinel mode (the default) and in full mode;
- a nan planted at step 12, in forward or in backward, stops the run at that step with the
  culprit named;
- after every way a run ends (normally, a detection in forward or backward, which detaches
  from `on_detect`, the user's `on_detect` returning its own error, an exception, Ctrl-C in
  forward, in backward or between steps), torch's function and dispatch mode stacks and every
  hook (the model's modules, parameters, the optimizer, the global registries) are exactly as
  before, and the model and its guard are collected once dropped, detached or not.

Everything is built here (random weights, token ids made in the test): no
download. One intra-op thread (`one_thread`) keeps the file fast on a shared machine.
"""

from __future__ import annotations

import gc
import signal
import weakref

import pytest
import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from models import NanGradient

from numguard_nb.guard import NonFiniteError
from numguard_nb.integrations import NumguardCallback
from promises import bit_identical, hooks_left, model_state

NAN = float("nan")
STEPS = 30
ACCUMULATION = 2
PLANT_STEP = 12  # the optimizer step whose first micro-batch gets the nan
PLANT_BATCH = PLANT_STEP * ACCUMULATION  # the guard counts micro-batches (forward calls)
EXIT_STEP = 3  # the step the other ways out are taken at (early: a run costs its steps)
CULPRIT = "transformer.h.1.mlp.act"  # where the nan is planted in GPT-2

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: these models are tiny, and on a shared machine two threads spinning
    for each op make every run several times slower (the unguarded and the guarded runs alike)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def own_mode_stacks():
    """Each test starts from the mode stacks it found and leaves them so: a mode a failing test
    left behind would be taken off by the next test's guard, failing that test too."""
    function_modes = torch._C._len_torch_function_stack()
    yield
    while torch._C._len_torch_function_stack() > function_modes:
        torch._C._pop_torch_function_stack()


def mode_stacks():
    return (list(torch.overrides._get_current_function_mode_stack()),
            list(_get_current_dispatch_mode_stack()))


def optimizer_of(optimizer):
    """The torch optimizer under accelerate's or Lightning's wrapper (its hooks are its own)."""
    return getattr(optimizer, "optimizer", optimizer)


def collected(*held: weakref.ref) -> bool:
    """Whether the objects `held` refers to are gone (one collection: each costs a few tenths of a
    second with torch and transformers loaded)."""
    gc.collect()
    return all(ref() is None for ref in held)


# ---- the planted nan ------------------------------------------------------------------------
class _InterruptedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        raise KeyboardInterrupt


class Planted(nn.Module):
    """An activation (tanh-GELU, as GPT-2's) that goes wrong while `armed`: its output turns nan
    ("forward"), its input's gradient turns nan ("backward"), or it raises an error. Armed for a
    whole step, so that a sentinel's re-run of the step goes wrong as the step did."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.armed = False

    def forward(self, x):
        y = nn.functional.gelu(x, approximate="tanh")
        if not self.armed:
            return y
        if self.how == "forward":
            return y * NAN
        if self.how == "backward":
            return NanGradient.apply(y)
        if self.how == "KeyboardInterrupt in forward":
            raise KeyboardInterrupt
        if self.how == "KeyboardInterrupt in backward":
            return _InterruptedBackward.apply(y)
        raise RuntimeError("an error in the user's forward")


# ---- transformers.Trainer -------------------------------------------------------------------
_ARGUMENT_FIELDS = transformers.TrainingArguments.__dataclass_fields__
_CHECKPOINTING = "activation_checkpointing" if "activation_checkpointing" in _ARGUMENT_FIELDS \
    else "gradient_checkpointing"  # the older name, deprecated in transformers 5

TRAINER_CONFIGS = {
    "plain": {},
    "checkpointing reentrant": {_CHECKPOINTING: True,
                                f"{_CHECKPOINTING}_kwargs": {"use_reentrant": True}},
    "checkpointing non-reentrant": {_CHECKPOINTING: True,
                                    f"{_CHECKPOINTING}_kwargs": {"use_reentrant": False}},
    "bf16": {"bf16": True},  # autocast to bfloat16 on the CPU
}


def gpt2(planted: Planted | None = None) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    if planted is not None:
        model.transformer.h[1].mlp.act = planted
    return model


def token_samples(count=64):
    ids = torch.randint(0, 100, (count, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(count)]


class HooksAtStart(transformers.TrainerCallback):
    """The hooks there when training begins (after the Trainer set up checkpointing and the
    optimizer), before the callback after it in the list attaches its guard."""

    hooks = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.hooks = hooks_left(model, optimizers=[optimizer_of(optimizer)])


class ArmAt(transformers.TrainerCallback):
    """Arms `planted` for the optimizer step `step` (both of its micro-batches)."""

    def __init__(self, planted: Planted, step: int):
        self.planted, self.step = planted, step

    def on_step_begin(self, args, state, control, **kwargs):
        self.planted.armed = state.global_step == self.step


def make_trainer(tmp_path, model, callbacks, max_steps=STEPS, **arguments):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), report_to=[], use_cpu=True, save_strategy="no",
        per_device_train_batch_size=2, gradient_accumulation_steps=ACCUMULATION, max_steps=max_steps,
        logging_steps=1, log_level="error", disable_tqdm=True, seed=0, **arguments,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=token_samples(), callbacks=callbacks)


def loss_log(trainer) -> list:
    return [(entry["step"], entry["loss"], entry["grad_norm"], entry["learning_rate"])
            for entry in trainer.state.log_history if "loss" in entry]


_UNGUARDED: dict = {}


def unguarded_trainer_run(tmp_path, config: str):
    """The final weights and the loss log of the run without the callback (once per config)."""
    if config not in _UNGUARDED:
        model = gpt2()
        trainer = make_trainer(tmp_path, model, [], **TRAINER_CONFIGS[config])
        trainer.train()
        _UNGUARDED[config] = (model_state(model), loss_log(trainer))
    return _UNGUARDED[config]


TRAINER_RUNS = [(mode, config) for mode in ("sentinel", "full") for config in TRAINER_CONFIGS]


@pytest.mark.parametrize("mode, config", TRAINER_RUNS, ids=[f"{m}-{c}" for m, c in TRAINER_RUNS])
def test_a_healthy_trainer_run_is_bit_identical_with_the_callback(tmp_path, mode, config):
    expected_state, expected_log = unguarded_trainer_run(tmp_path, config)
    model = gpt2()
    assert not bit_identical(model_state(model), expected_state)  # training changes every weight
    probe, callback = HooksAtStart(), NumguardCallback(mode=mode)
    trainer = make_trainer(tmp_path, model, [probe, callback], **TRAINER_CONFIGS[config])
    stacks = mode_stacks()

    trainer.train()

    checkpointing = any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
    assert checkpointing == config.startswith("checkpointing")
    if config == "bf16":  # autocast on the CPU indeed: other losses than in float32
        assert expected_log != unguarded_trainer_run(tmp_path, "plain")[1]
    assert callback.report.ok, callback.report.summary()
    assert callback.guard.batch_number == STEPS * ACCUMULATION - 1  # every micro-batch seen
    assert bit_identical(model_state(model), expected_state)
    assert loss_log(trainer) == expected_log and len(expected_log) == STEPS
    assert mode_stacks() == stacks
    assert hooks_left(model, optimizers=[optimizer_of(trainer.optimizer)]) == probe.hooks


NAN_RUNS = [(config, where, mode) for config in ("plain", "checkpointing reentrant")
            for where in ("forward", "backward") for mode in ("sentinel", "full")] + [
    ("checkpointing non-reentrant", "backward", "sentinel"),
    ("checkpointing non-reentrant", "backward", "full"),
    ("bf16", "forward", "sentinel"), ("bf16", "backward", "sentinel")]

# Sentinel mode re-runs a step whose gradients broke (sentinel_rerun.rerun_backward). Under
def train_until_detected(trainer, callback, run) -> None:
    trainer.train()  # no `with callback`: the detection itself detaches


@pytest.mark.parametrize("config, where, mode", NAN_RUNS, ids=["-".join(run) for run in NAN_RUNS])
def test_a_nan_planted_in_a_trainer_run_stops_it_at_that_step_naming_the_culprit(
        tmp_path, config, where, mode):
    planted = Planted(where)
    model = gpt2(planted)
    probe, callback = HooksAtStart(), NumguardCallback(mode=mode)
    trainer = make_trainer(tmp_path, model, [ArmAt(planted, PLANT_STEP), probe, callback],
                           **TRAINER_CONFIGS[config])
    stacks = mode_stacks()

    with pytest.raises(NonFiniteError) as raised:
        train_until_detected(trainer, callback, (config, where, mode))

    report = raised.value.report
    assert callback.report is report
    assert report.found_by == ("re-run" if mode == "sentinel" else "")
    frame = report.first_nonfinite
    assert (frame.module_name, frame.phase, frame.batch_number) == (CULPRIT, where, PLANT_BATCH)
    assert trainer.state.global_step == PLANT_STEP
    assert mode_stacks() == stacks
    assert hooks_left(model, optimizers=[optimizer_of(trainer.optimizer)]) == probe.hooks
    held, held_guard = weakref.ref(model), weakref.ref(callback.guard)
    del model, trainer, callback, probe, raised, report, frame
    assert collected(held, held_guard)


class InterruptAt(transformers.TrainerCallback):
    """Ctrl-C between two steps, in the loop's own code (the guard attached, no call open)."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == EXIT_STEP:
            raise KeyboardInterrupt


# exit: (what train() raises, how the planted activation fails, callback options)
TRAINER_EXITS = {
    "KeyboardInterrupt in forward": (KeyboardInterrupt, "KeyboardInterrupt in forward", {}),
    "KeyboardInterrupt in backward": (KeyboardInterrupt, "KeyboardInterrupt in backward", {}),
    "KeyboardInterrupt between steps": (KeyboardInterrupt, None, {}),
    "RuntimeError in forward": (RuntimeError, "RuntimeError", {}),
    "on_detect returns its own error": (LookupError, "forward",
                                        {"on_detect": lambda report: LookupError("mine")}),
}


@pytest.mark.parametrize("mode", ["sentinel", "full"])
@pytest.mark.parametrize("exit", TRAINER_EXITS)
def test_a_trainer_run_ending_in_an_error_inside_the_callbacks_with_leaves_everything_as_before(
        tmp_path, exit, mode):
    raised_type, how, options = TRAINER_EXITS[exit]
    planted = Planted(how or "forward")
    model = gpt2(planted)
    probe, callback = HooksAtStart(), NumguardCallback(mode=mode, **options)
    arm = ArmAt(planted, EXIT_STEP) if how else InterruptAt()
    trainer = make_trainer(tmp_path, model, [arm, probe, callback])
    stacks = mode_stacks()

    with pytest.raises(raised_type):
        with callback:
            trainer.train()

    assert trainer.state.global_step == EXIT_STEP
    assert mode_stacks() == stacks
    assert hooks_left(model, optimizers=[optimizer_of(trainer.optimizer)]) == probe.hooks


@pytest.mark.parametrize("mode", ["sentinel", "full"])
@pytest.mark.parametrize("exit", TRAINER_EXITS)
def test_a_trainer_run_ending_in_an_error_without_detaching_is_collected_once_dropped(tmp_path, exit, mode):
    raised_type, how, options = TRAINER_EXITS[exit]
    gc.collect()
    stacks, global_hooks = mode_stacks(), hooks_left()
    planted = Planted(how or "forward")
    model = gpt2(planted)
    callback = NumguardCallback(mode=mode, **options)
    arm = ArmAt(planted, EXIT_STEP) if how else InterruptAt()
    trainer = make_trainer(tmp_path, model, [arm, callback])

    with pytest.raises(raised_type) as raised:
        trainer.train()  # no `with callback`: the guard stays attached unless a detection ended it

    held, held_guard = weakref.ref(model), weakref.ref(callback.guard)
    del model, trainer, callback, raised, arm, planted
    assert collected(held, held_guard)
    assert hooks_left() == global_hooks
    assert mode_stacks() == stacks  # the mode of a watch dropped while attached left with it


def test_a_callback_used_again_after_a_run_interrupted_without_detaching_starts_clean(tmp_path):
    # A notebook: Ctrl-C in backward leaves the guard attached (the Trainer has no event for it);
    # the next train() with the same callback drops those hooks before attaching its own.
    stacks = mode_stacks()
    planted = Planted("KeyboardInterrupt in backward")
    model = gpt2(planted)
    hooks = hooks_left(model)
    callback = NumguardCallback()
    with pytest.raises(KeyboardInterrupt):
        make_trainer(tmp_path, model, [ArmAt(planted, EXIT_STEP), callback]).train()
    first = callback.guard
    assert first.attached and hooks_left(model) != hooks
    planted.armed = False

    trainer = make_trainer(tmp_path, model, [callback], max_steps=4)
    trainer.train()

    assert not first.attached and callback.guard is not first
    assert callback.report.ok, callback.report.summary()
    assert mode_stacks() == stacks
    assert hooks_left(model, optimizers=[optimizer_of(trainer.optimizer)]) == hooks


# ---- Lightning --------------------------------------------------------------------------------
try:  # the Trainer tests above must not depend on Lightning being installed
    import lightning
except ImportError:
    lightning = None
needs_lightning = pytest.mark.skipif(lightning is None, reason="needs Lightning")

LIGHTNING_CULPRIT = "net.1"

if lightning is not None:
    from numguard_nb.integrations import NumguardLightningCallback

    class LitNet(lightning.LightningModule):
        """A small regression net with dropout; its losses are kept as the loss log."""

        def __init__(self, planted: Planted | None = None):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), planted or nn.GELU(approximate="tanh"),
                                     nn.Dropout(0.1), nn.Linear(32, 8))
            self.losses = []

        def training_step(self, batch, batch_index):
            features, targets = batch
            loss = nn.functional.mse_loss(self.net(features), targets)
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class LightningHooksAtStart(lightning.Callback):
        """The hooks there when fitting starts (the optimizer made), before the guard attaches."""

        hooks = None

        def on_fit_start(self, trainer, pl_module):
            assert trainer.optimizers
            self.hooks = hooks_left(pl_module, optimizers=[optimizer_of(o) for o in trainer.optimizers])

    class LightningArmAt(lightning.Callback):
        """Arms `planted` for the optimizer step `step` (both of its micro-batches)."""

        def __init__(self, planted: Planted, step: int):
            self.planted, self.step = planted, step

        def on_train_batch_start(self, trainer, pl_module, batch, batch_index):
            self.planted.armed = trainer.global_step == self.step


def regression_batches():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(64, 8, generator=generator)
    dataset = torch.utils.data.TensorDataset(features, features.roll(1, dims=1).tanh())
    return torch.utils.data.DataLoader(dataset, batch_size=4)


def lightning_trainer(callbacks):
    return lightning.Trainer(
        max_steps=STEPS, accumulate_grad_batches=ACCUMULATION, accelerator="cpu", devices=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )


def lightning_optimizers(trainer) -> list:
    return [optimizer_of(optimizer) for optimizer in trainer.optimizers]


@pytest.fixture
def sigint_handler():
    """Lightning answers Ctrl-C by ignoring SIGINT from then on (and exiting): put it back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


@needs_lightning
@pytest.mark.parametrize("mode", ["sentinel", "full"])
def test_a_healthy_lightning_fit_is_bit_identical_with_the_callback(mode):
    unguarded = LitNet()
    torch.manual_seed(1)  # the dropout masks
    lightning_trainer([]).fit(unguarded, regression_batches())
    module = LitNet()
    assert not bit_identical(model_state(module), model_state(unguarded))  # training changes them
    probe, callback = LightningHooksAtStart(), NumguardLightningCallback(mode=mode)
    trainer = lightning_trainer([probe, callback])
    stacks = mode_stacks()

    torch.manual_seed(1)
    trainer.fit(module, regression_batches())

    assert trainer.global_step == STEPS
    assert callback.report.ok, callback.report.summary()
    assert callback.guard.batch_number == STEPS * ACCUMULATION - 1  # every micro-batch seen
    assert bit_identical(model_state(module), model_state(unguarded))
    assert bit_identical(module.losses, unguarded.losses) and len(module.losses) == STEPS * ACCUMULATION
    assert mode_stacks() == stacks
    assert hooks_left(module, optimizers=lightning_optimizers(trainer)) == probe.hooks


# exit: (what fit() raises, how the planted activation fails)
LIGHTNING_EXITS = {
    "nan in forward": (NonFiniteError, "forward"),
    "nan in backward": (NonFiniteError, "backward"),
    "RuntimeError in forward": (RuntimeError, "RuntimeError"),
    # Lightning catches Ctrl-C, calls on_exception, and exits
    "KeyboardInterrupt in forward": (SystemExit, "KeyboardInterrupt in forward"),
    "KeyboardInterrupt in backward": (SystemExit, "KeyboardInterrupt in backward"),
}


@needs_lightning
@pytest.mark.parametrize("mode", ["sentinel", "full"])
@pytest.mark.parametrize("exit", LIGHTNING_EXITS)
def test_a_lightning_fit_ending_in_an_error_leaves_everything_as_before(exit, mode, sigint_handler):
    raised_type, how = LIGHTNING_EXITS[exit]
    gc.collect()
    global_hooks = hooks_left()
    planted = Planted(how)
    module = LitNet(planted)
    probe, callback = LightningHooksAtStart(), NumguardLightningCallback(mode=mode)
    trainer = lightning_trainer([LightningArmAt(planted, PLANT_STEP), probe, callback])
    stacks = mode_stacks()

    with pytest.raises(raised_type) as raised:
        trainer.fit(module, regression_batches())  # no `with callback`: on_exception detaches

    assert trainer.global_step == PLANT_STEP
    if raised_type is NonFiniteError:
        report = raised.value.report
        assert callback.report is report
        frame = report.first_nonfinite
        assert (frame.module_name, frame.phase, frame.batch_number) == (LIGHTNING_CULPRIT, how, PLANT_BATCH)
        del report, frame
    assert mode_stacks() == stacks
    assert hooks_left(module, optimizers=lightning_optimizers(trainer)) == probe.hooks
    held, held_guard = weakref.ref(module), weakref.ref(callback.guard)
    del module, trainer, callback, probe, raised, planted
    assert collected(held, held_guard)
    assert hooks_left() == global_hooks

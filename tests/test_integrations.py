"""Tests for numguard_nb.integrations: the Trainer and Lightning callbacks."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from numguard_nb.guard import BatchLimitReached, NonFiniteError
from numguard_nb.integrations import NumguardCallback

# Subprocesses import numguard_nb from this checkout, wherever pytest runs from.
REPOSITORY_ROOT = Path(__file__).resolve().parents[1]
BLOW_UP_BATCH = 2  # 0-indexed: the third forward pass turns inf


class BlowUp(nn.Module):
    """Multiplies by inf on one chosen call, so the culprit module is known."""

    def __init__(self, on_call):
        super().__init__()
        self.on_call = on_call
        self.calls = 0

    def forward(self, hidden):
        self.calls += 1
        return hidden * float("inf") if self.calls == self.on_call + 1 else hidden


class NanWhenArmed(nn.Module):
    """nan out while `armed` (set for one training step: a re-run of that step repeats it)."""

    armed = False

    def forward(self, hidden):
        return hidden * float("nan") if NanWhenArmed.armed else hidden


class Classifier(nn.Module):
    """Hugging Face style: keyword inputs in, a dict with the loss out."""

    def __init__(self, blow_up_batch=None):
        super().__init__()
        self.encoder = nn.Linear(4, 8)
        self.scale = BlowUp(blow_up_batch if blow_up_batch is not None else -1)
        self.head = nn.Linear(8, 2)

    def forward(self, features, labels=None):
        logits = self.head(torch.tanh(self.scale(self.encoder(features))))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def samples(count=32):
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(count, 4, generator=generator)
    return [{"features": features[i], "labels": i % 2} for i in range(count)]


def assert_no_hooks(model):
    for name, module in model.named_modules():
        assert not module._forward_hooks and not module._forward_pre_hooks, f"hooks left on {name or 'root'}"
    for name, parameter in model.named_parameters():
        assert not parameter._backward_hooks, f"gradient hook left on {name}"


def make_trainer(tmp_path, model, callback, max_steps=4):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=max_steps,
        save_strategy="no",
        disable_tqdm=True,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=samples(), callbacks=[callback])


# ------------------------------------------------------------------ transformers.Trainer


def test_trainer_stops_at_the_module_that_produced_inf_and_removes_its_hooks(tmp_path):
    model = Classifier(blow_up_batch=BLOW_UP_BATCH)
    callback = NumguardCallback(mode="full")  # the hooks throughout: a one-off inf is named
    trainer = make_trainer(tmp_path, model, callback)

    with pytest.raises(NonFiniteError) as raised:
        trainer.train()  # no `with`: detection itself detaches

    report = raised.value.report
    assert report.first_nonfinite.module_name == "scale"
    assert report.batch_number == BLOW_UP_BATCH
    assert callback.report is report
    assert trainer.state.global_step == BLOW_UP_BATCH
    assert_no_hooks(model)
    # without ops, the hint says how to have the op named in the callback's own terms
    assert report.hint.endswith("Pass `NumguardCallback(ops=True)` to name the op and the line."), \
        report.hint


def test_trainer_run_that_ends_normally_detaches_and_keeps_the_report(tmp_path):
    model = Classifier()
    callback = NumguardCallback(max_frames=5)
    trainer = make_trainer(tmp_path, model, callback, max_steps=3)

    trainer.train()

    assert callback.report.ok
    assert 0 < len(callback.report.frames) <= 5
    assert not callback.guard.attached
    assert_no_hooks(model)


def test_trainer_hooks_go_with_the_callback_as_context_when_training_raises_otherwise(tmp_path):
    model = Classifier()
    callback = NumguardCallback(abort_after_batch=1)
    trainer = make_trainer(tmp_path, model, callback)

    with pytest.raises(BatchLimitReached):
        with callback:
            trainer.train()

    assert_no_hooks(model)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_resumed_from_a_checkpoint_numbers_batches_as_the_run_goes_on(tmp_path,
                                                                            accumulation):
    class ArmAtStep(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            NanWhenArmed.armed = state.global_step == 4

    def trainer(max_steps, callbacks):
        model = Classifier()
        model.scale = NanWhenArmed()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "trainer"), report_to="none", use_cpu=True,
            per_device_train_batch_size=2, gradient_accumulation_steps=accumulation,
            max_steps=max_steps, save_strategy="steps", save_steps=3, disable_tqdm=True)
        return transformers.Trainer(model=model, args=args, train_dataset=samples(),
                                    callbacks=callbacks)

    trainer(3, [NumguardCallback()]).train()  # saves checkpoint-3
    callback = NumguardCallback()
    try:
        with pytest.raises(NonFiniteError) as raised, callback:
            trainer(6, [ArmAtStep(), callback]).train(
                resume_from_checkpoint=str(tmp_path / "trainer" / "checkpoint-3"))
    finally:
        NanWhenArmed.armed = False
    # step 4's first forward: batch 4 (8 with two forwards a step), as in an unbroken run
    assert raised.value.report.batch_number == 4 * accumulation


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_trainer_that_compiles_the_model_itself_is_guarded_where_it_runs(tmp_path, mode):
    # TrainingArguments(torch_compile=True): the Trainer calls a torch.compile wrapper the
    # callbacks are not given; hooks on the model alone would run inside compiled code
    class ArmAtStep(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            NanWhenArmed.armed = state.global_step == BLOW_UP_BATCH

    model = Classifier()
    model.scale = NanWhenArmed()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), report_to="none", use_cpu=True,
        per_device_train_batch_size=4, max_steps=4, save_strategy="no", disable_tqdm=True,
        torch_compile=True, torch_compile_backend="eager")
    callback = NumguardCallback(mode=mode)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=samples(),
                                   callbacks=[ArmAtStep(), callback])
    try:
        with pytest.raises(NonFiniteError) as raised, callback:
            trainer.train()
    finally:
        NanWhenArmed.armed = False
    report = raised.value.report
    assert (report.first_nonfinite.module_name, report.phase, report.batch_number) == (
        "scale", "forward", BLOW_UP_BATCH)
    assert_no_hooks(model) and assert_no_hooks(trainer.model_wrapped)


def test_a_culprit_found_when_the_run_ends_is_raised_not_dropped():
    # the loss code's nan after the last model call, with no backward to judge it: found at
    # detach, and raised at the run's end as a `with Guard(...)` block's exit raises it
    model = Classifier()
    callback = NumguardCallback(mode="full")
    callback.start(model)
    torch.log(model(torch.randn(4, 4), torch.tensor([0, 1, 0, 1]))["logits"] - 100).mean()
    with pytest.raises(NonFiniteError) as raised:
        callback.on_train_end(None, None, None)
    assert raised.value.report.cause == "outside"
    assert_no_hooks(model)


@pytest.mark.parametrize("callback", ["NumguardCallback", "NumguardLightningCallback"])
def test_callback_rejects_an_unknown_guard_option_naming_the_options(callback):
    import numguard_nb

    make = getattr(numguard_nb, callback)
    with pytest.raises(TypeError, match=r"^unknown option 'max_frame': the options are max_frames, "):
        make(max_frame=3)
    with pytest.raises(TypeError, match=rf"^{callback} takes no model: the trainer's is guarded"):
        make(nn.Linear(2, 2))  # (as Guard is called)


def test_callback_checks_option_values_at_construction():
    with pytest.raises(ValueError, match="backward must be True or False, got 'no'"):
        NumguardCallback(backward="no")
    with pytest.raises(ValueError, match="max_frames must be a positive integer"):
        NumguardCallback(max_frames=0)
    assert NumguardCallback(max_frames=3, trace_batches=[1]).options.trace_batches == frozenset({1})


# ------------------------------------------------------------------ Lightning


def test_lightning_fit_stops_at_the_module_that_produced_inf_and_removes_its_hooks():
    # Imported here: the Trainer tests above must not depend on Lightning being installed.
    import lightning

    from numguard_nb.integrations import NumguardLightningCallback

    class LitClassifier(lightning.LightningModule):
        def __init__(self, blow_up_batch):
            super().__init__()
            self.net = Classifier(blow_up_batch)

        def training_step(self, batch, batch_index):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = LitClassifier(blow_up_batch=BLOW_UP_BATCH)
    callback = NumguardLightningCallback(mode="full")
    trainer = lightning.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    loader = torch.utils.data.DataLoader(samples(), batch_size=4)

    with pytest.raises(NonFiniteError) as raised:
        trainer.fit(module, loader)

    assert raised.value.report.first_nonfinite.module_name == "net.scale"
    assert raised.value.report.batch_number == BLOW_UP_BATCH  # batches counted per training step
    assert callback.report is raised.value.report
    assert_no_hooks(module)


def test_lightning_batches_are_counted_per_training_step_for_abort_after_batch():
    import lightning

    from numguard_nb import BatchLimitReached
    from numguard_nb.integrations import NumguardLightningCallback

    class LitClassifier(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Classifier(blow_up_batch=None)

        def training_step(self, batch, batch_index):
            return self.net(**batch)["loss"]  # the LightningModule itself is never called

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = LitClassifier()
    callback = NumguardLightningCallback(abort_after_batch=1)
    trainer = lightning.Trainer(
        max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )
    with pytest.raises(BatchLimitReached, match="before batch 2"):
        trainer.fit(module, torch.utils.data.DataLoader(samples(), batch_size=4))
    assert callback.guard.batch_number == 1
    assert_no_hooks(module)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_lightning_a_submodule_made_in_the_module_s_own_on_fit_start_is_guarded(mode):
    # Lightning runs the callbacks' on_fit_start (where the guard attaches) before the
    # module's, where a teacher or an EMA copy is often made
    import copy

    import lightning

    from numguard_nb.integrations import NumguardLightningCallback

    class Distill(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Classifier(blow_up_batch=None)

        def on_fit_start(self):
            self.teacher = copy.deepcopy(self.net).requires_grad_(False)
            self.teacher.scale = NanWhenArmed()  # (tanh would clamp an inf)

        def training_step(self, batch, batch_index):
            NanWhenArmed.armed = batch_index == BLOW_UP_BATCH
            with torch.no_grad():
                target = self.teacher(**batch)["logits"]
            return nn.functional.mse_loss(self.net(**batch)["logits"], target)

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.1)

    module = Distill()
    trainer = lightning.Trainer(
        max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[NumguardLightningCallback(mode=mode)],
    )
    try:
        with pytest.raises(NonFiniteError) as raised:
            trainer.fit(module, torch.utils.data.DataLoader(samples(), batch_size=4))
    finally:
        NanWhenArmed.armed = False
    report = raised.value.report
    assert (report.first_nonfinite.module_name, report.phase, report.cause) == (
        "teacher.scale", "forward", "forward")
    assert report.batch_number == BLOW_UP_BATCH
    assert_no_hooks(module)


class NanInEval(nn.Module):
    """nan out in eval mode: a validation or evaluation batch breaks, training does not."""

    def forward(self, hidden):
        return hidden if self.training else hidden * float("nan")


class NanInTraining(nn.Module):
    def forward(self, hidden):
        return hidden * float("nan") if self.training else hidden


def mode_on_its_path(mode: str, request) -> str:
    """"sentinel-gpu-path": the sentinel with its checks read late, as on a GPU (after the loop
    went on: model.train(), the next batch)."""
    if mode == "sentinel-gpu-path":
        request.getfixturevalue("deferred_on_host")
        return "sentinel"
    return mode


@pytest.mark.parametrize("mode", ["full", "sentinel", "sentinel-gpu-path"])
@pytest.mark.parametrize("sanity_check", [True, False])
def test_lightning_a_detection_in_validation_says_so(mode, sanity_check, request):
    # Validation batches are not training batches: the report's batch is the last training one
    import lightning

    from numguard_nb.integrations import NumguardLightningCallback

    class Lit(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Classifier(blow_up_batch=None)
            self.net.scale = NanInEval()

        def training_step(self, batch, batch_index):
            return self.net(**batch)["loss"]

        def validation_step(self, batch, batch_index):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module, callback = Lit(), NumguardLightningCallback(mode=mode_on_its_path(mode, request))

    def lightning_trainer(**options):
        return lightning.Trainer(
            max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **options)

    trainer = lightning_trainer(val_check_interval=3, num_sanity_val_steps=2 if sanity_check else 0)
    loader = torch.utils.data.DataLoader(samples(), batch_size=4)
    with pytest.raises(NonFiniteError) as raised:
        trainer.fit(module, loader, loader)
    report = raised.value.report
    assert report.first_nonfinite.module_name == "net.scale"
    stage = ("the sanity check before training, validation batch 0" if sanity_check
             else "validation batch 0, after training batch 2")
    assert str(raised.value).startswith(f"during {stage}: net.scale (NanInEval) produced")
    assert_no_hooks(module)
    # The notebook's next fit, with the same callback: a training detection says no stage.
    module = Lit()
    module.net.scale = NanInTraining()
    with pytest.raises(NonFiniteError) as raised:
        lightning_trainer(num_sanity_val_steps=0).fit(module, loader)
    assert str(raised.value).startswith("net.scale (NanInTraining) produced"), str(raised.value)


@pytest.mark.parametrize("mode", ["full", "sentinel", "sentinel-gpu-path"])
@pytest.mark.parametrize("sanity_check", [True, False])
def test_lightning_a_nan_in_validation_steps_own_loss_code_says_its_stage(mode, sanity_check, request):
    # The loss code's culprit is held, then judged after validation ended: it was raised as a
    # training batch's ("in batch 1", no stage); once in sentinel mode, with the stage twice.
    import lightning

    from numguard_nb.integrations import NumguardLightningCallback

    class Lit(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Classifier(blow_up_batch=None)

        def training_step(self, batch, batch_index):
            return self.net(**batch)["loss"]

        def validation_step(self, batch, batch_index):
            logits = self.net(**batch)["logits"]
            if batch_index == 1 and self.trainer.sanity_checking == sanity_check:
                logits = logits / torch.zeros(())  # a bug in validation only
            return nn.functional.cross_entropy(logits, batch["labels"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module, callback = Lit(), NumguardLightningCallback(mode=mode_on_its_path(mode, request))
    trainer = lightning.Trainer(
        max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
        val_check_interval=2, num_sanity_val_steps=2 if sanity_check else 0)
    loader = torch.utils.data.DataLoader(samples(), batch_size=4)
    with pytest.raises(NonFiniteError) as raised:
        trainer.fit(module, loader, loader)
    stage = ("the sanity check before training, validation batch 1" if sanity_check
             else "validation batch 1, after training batch 1")
    assert raised.value.report.stage == stage
    assert str(raised.value).startswith(f"during {stage}: code outside the guarded modules")
    assert str(raised.value).count("during ") == 1
    assert_no_hooks(module)


def test_lightning_fit_resumed_from_a_checkpoint_numbers_batches_as_the_run_goes_on(tmp_path):
    import lightning

    from numguard_nb.integrations import NumguardLightningCallback

    class Lit(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Classifier()
            self.net.scale = NanWhenArmed()

        def training_step(self, batch, batch_index):
            NanWhenArmed.armed = self.global_step == 4
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(max_steps, **options):
        trainer = lightning.Trainer(
            max_steps=max_steps, accelerator="cpu", logger=False, default_root_dir=tmp_path,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[NumguardLightningCallback()])
        trainer.fit(Lit(), torch.utils.data.DataLoader(samples(), batch_size=4), **options)

    fit(3)
    checkpoint = next(tmp_path.rglob("*.ckpt"))
    try:
        with pytest.raises(NonFiniteError) as raised:
            fit(6, ckpt_path=str(checkpoint))
    finally:
        NanWhenArmed.armed = False
    assert raised.value.report.batch_number == 4  # as in an unbroken run


@pytest.mark.parametrize("mode", ["full", "sentinel", "sentinel-gpu-path"])
def test_trainer_a_detection_in_evaluation_says_so(tmp_path, mode, request):
    model = Classifier()
    model.scale = NanInEval()
    callback = NumguardCallback(mode=mode_on_its_path(mode, request))
    trainer = make_trainer(tmp_path, model, callback)
    trainer.args.eval_strategy, trainer.args.eval_steps = "steps", 2
    trainer.eval_dataset = samples(8)
    with pytest.raises(NonFiniteError, match=r"^during an evaluation \(the model was in eval mode\): scale "):
        trainer.train()
    # On the GPU path held unread to the end, the evaluation's check is read as training ends,
    # after model.train(): the report still says where its values were made.
    assert trainer.state.global_step == (4 if mode == "sentinel-gpu-path" else 2)
    assert_no_hooks(model)


def test_lightning_fit_of_a_compiled_module_says_it_is_not_guarded_and_names_no_module():
    # trainer.fit(torch.compile(module)) compiles training_step: hooks inside see nothing, and
    # the backward alone would have named the wrong module
    import lightning

    from numguard_nb.integrations import NumguardLightningCallback

    class LitClassifier(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Classifier(blow_up_batch=None)

        def training_step(self, batch, batch_index):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = LitClassifier()
    callback = NumguardLightningCallback()
    trainer = lightning.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    with pytest.warns(UserWarning, match=r"numguard: not guarding this fit: .* Fit it uncompiled"):
        trainer.fit(torch.compile(module, backend="eager"),
                    torch.utils.data.DataLoader(samples(), batch_size=4))
    assert callback.guard is None
    assert_no_hooks(module)


# ------------------------------------------------------------------ optional dependencies


def test_integrations_import_without_transformers_or_lightning():
    program = """
import sys
for name in ("transformers", "lightning", "pytorch_lightning"):
    sys.modules[name] = None
import numguard_nb.integrations as integrations
try:
    integrations.NumguardCallback
except ImportError as error:
    print(error)
try:
    integrations.NumguardLightningCallback
except ImportError as error:
    print(error)
"""
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, cwd=REPOSITORY_ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "NumguardCallback needs transformers: pip install transformers",
        "NumguardLightningCallback needs Lightning: pip install lightning",
    ]

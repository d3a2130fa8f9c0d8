"""Mixed precision with loss scaling: the overflows a GradScaler handles by skipping the step are
let through and recorded; what skipping does not cure, and anything made in forward, is raised.

The runs are float16 autocast on CPU with torch.amp.GradScaler("cpu"), whose first steps really
overflow (checked in plain torch first); then the ways the guard learns of the scaler: the
option, the notebook's namespace, a Trainer's accelerate scaler and Lightning's.
"""

import copy
import pickle
from types import SimpleNamespace

import pytest
import torch
from IPython.core.error import UsageError
import torch.nn.functional as F
from torch import nn

from numguard_nb import Guard, NonFiniteError
from numguard_nb.guard import GuardOptions
from numguard_nb.guard.scaler import SkippedStep, loss_scaler_of, skipped_summary
from numguard_nb.session import GuardedRun, Session, find_models, find_scaler
from promises import hooks_left

WARM_UP_SKIPS = [0, 1, 2, 3]  # the steps plain torch skips in `warm_up` (scale 2**16 .. 2**13)


class Distance(nn.Module):
    """sqrt(sum((a - b)^2)): at a == b the forward is 0, the backward nan at every scale."""

    def forward(self, a, b):
        return ((a - b) ** 2).sum(-1).sqrt()


class Siamese(nn.Module):
    """Distance between an embedding and itself: nan gradients in every step."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.distance = Distance()

    def forward(self, x):
        h = self.embed(x)
        return self.distance(h, h.detach()).sum()


class SqrtOfNegative(nn.Module):
    def forward(self, x):
        return torch.sqrt(-x * x - 1)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def warm_up(model, scaler, steps=30, dtype=torch.float16, accumulate=1, optimizer=None,
            before_step=lambda step: None):
    """A float16 autocast loop with loss scaling; the steps whose scale went down (skipped)."""
    generator = torch.Generator().manual_seed(1)
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=1e-4)
    skipped = []
    for step in range(steps):
        before_step(step)
        for _ in range(accumulate):
            x, y = torch.randn(32, 8, generator=generator), torch.randn(32, 4, generator=generator) * 4
            with torch.autocast("cpu", dtype=dtype):
                loss = F.mse_loss(model(x), y, reduction="sum") / 8
            scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if scaler.get_scale() < before:
            skipped.append(step)
    return skipped


def siamese_steps(model, scaler, steps=40):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        scaler.scale(model(torch.randn(3, 4))).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


def grad_scaler(**keywords):
    return torch.amp.GradScaler("cpu", **keywords)


def watched(scaler) -> bool:
    """Whether the guard's wrap of `update` sits on the scaler instance."""
    return "update" in vars(scaler)


# ---- the warm-up: skipped steps let through and recorded --------------------------------------
def test_plain_torch_skips_the_first_steps_of_the_float16_warm_up():
    scaler = grad_scaler(init_scale=2.0 ** 16)
    assert warm_up(mlp(), scaler) == WARM_UP_SKIPS
    assert scaler.get_scale() == 2.0 ** 12


def test_float16_warm_up_is_let_through_and_its_skipped_steps_recorded():
    model, scaler = mlp(), grad_scaler(init_scale=2.0 ** 16)
    before = hooks_left(model)
    with Guard(model, scaler=scaler) as guard:
        skipped_by_torch = warm_up(model, scaler)
        assert watched(scaler)
    assert skipped_by_torch == WARM_UP_SKIPS  # the guard changed nothing the scaler did
    assert [step.batch for step in guard.skipped_steps] == WARM_UP_SKIPS
    assert [step.scale for step in guard.skipped_steps] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 14, 2.0 ** 13]
    first = guard.skipped_steps[0]
    # the first overflow: the loss's float32 gradient cast back to float16, outside the model
    assert isinstance(first, SkippedStep) and first.module == "<outside>" and "inf" in first.values
    assert first.frame.flagged_rows and first.frame.phase == "backward"
    assert guard.detection is None
    summary = guard.report.summary()
    assert summary.startswith("no inf/nan in the last")  # the skipped steps' frames are left out
    assert "GradScaler skipped 4 steps (batches 0-3, scale 65536 down to 8192)" in summary
    # detached: the scaler's own update is back, and no hook is left
    assert not watched(scaler) and hooks_left(model) == before


def test_the_latest_report_leaves_out_the_backward_frames_of_skipped_steps():
    model, scaler = mlp(), grad_scaler()
    with Guard(model, scaler=scaler) as guard:
        warm_up(model, scaler, steps=2)  # both skipped
    report = guard.report
    assert report.frames and all(frame.phase == "forward" for frame in report.frames)
    assert report.summary().startswith("no inf/nan in the last")
    assert "GradScaler skipped 2 steps (batches 0-1, scale 65536 down to 32768)" in report.summary()


def test_bfloat16_run_never_overflows_and_its_scaler_is_never_touched():
    model, scaler = mlp(), grad_scaler()
    with Guard(model, scaler=scaler) as guard:
        assert warm_up(model, scaler, steps=5, dtype=torch.bfloat16) == []
        assert not watched(scaler)
    assert guard.skipped_steps == [] and "skipped" not in guard.report.summary()


def test_gradient_accumulation_records_one_skipped_step_per_update():
    model, scaler = mlp(), grad_scaler()
    with Guard(model, scaler=scaler) as guard:
        skipped = warm_up(model, scaler, steps=8, accumulate=2)
    assert skipped and [step.batch for step in guard.skipped_steps] == [2 * s for s in skipped]


OPTIMIZERS = {"plain": lambda p: torch.optim.SGD(p, lr=1e-4),
              "foreach": lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True),
              "fused": lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True)}


@pytest.mark.parametrize("ready", ["at the end", "every third step"])
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_on_a_device_the_sentinel_records_the_steps_skipped_before_it_read_their_overflow(
        deferred_on_host, optimizer, accumulate, ready):
    """A GPU's flags are read a step or more late, after the loop's scaler.update(): every
    skipped step is still recorded, with its batch and its scale (its update kept both)."""
    model, scaler = mlp(), grad_scaler()
    with Guard(model, mode="sentinel", scaler=scaler) as guard:
        skipped = warm_up(model, scaler, steps=10, accumulate=accumulate,
                          optimizer=OPTIMIZERS[optimizer](model.parameters()),
                          before_step=lambda step: deferred_on_host.__setitem__(
                              0, ready == "at the end" or step % 3 != 0))
    assert skipped == WARM_UP_SKIPS
    assert [step.batch for step in guard.skipped_steps] == [accumulate * s for s in skipped]
    assert [step.scale for step in guard.skipped_steps] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 14, 2.0 ** 13]
    assert not watched(scaler)


def test_on_a_device_max_skipped_steps_counts_the_steps_read_late(deferred_on_host):
    model, scaler = Siamese(), grad_scaler()
    with pytest.raises(NonFiniteError) as raised:
        with Guard(model, mode="sentinel", scaler=scaler, max_skipped_steps=3) as guard:
            siamese_steps(model, scaler, steps=10)
    assert raised.value.report.batch_number == 3 and len(guard.skipped_steps) == 3
    assert raised.value.report.first_nonfinite.module_name == "distance"
    assert "skipped the 3 steps before (batches 0-2, scale 65536 down to 8192)" in raised.value.report.reason


def test_sync_mode_lets_the_warm_up_through_too():
    model, scaler = mlp(), grad_scaler()
    with Guard(model, scaler=scaler, sync=True) as guard:
        assert warm_up(model, scaler, steps=6) == WARM_UP_SKIPS
    assert [step.batch for step in guard.skipped_steps] == WARM_UP_SKIPS


def test_a_scaler_like_object_without_found_inf_flags_is_read_from_its_scale():
    class Delegating:
        """A GradScaler look-alike: it keeps no found-inf flags of its own."""

        def __init__(self):
            self.inner = grad_scaler()

        def scale(self, loss):
            return self.inner.scale(loss)

        def step(self, optimizer):
            return self.inner.step(optimizer)

        def update(self):
            self.inner.update()

        def get_scale(self):
            return self.inner.get_scale()

        def is_enabled(self):
            return True

    model, scaler = mlp(), Delegating()
    with Guard(model, scaler=scaler) as guard:
        assert warm_up(model, scaler, steps=6) == WARM_UP_SKIPS
    assert [step.batch for step in guard.skipped_steps] == WARM_UP_SKIPS


def test_a_wrapper_already_on_the_scalers_update_is_kept_and_put_back():
    model, scaler = mlp(), grad_scaler()
    calls = []
    own_update = scaler.update

    def counting_update(*args, **kwargs):
        calls.append(1)
        return own_update(*args, **kwargs)

    scaler.update = counting_update
    with Guard(model, scaler=scaler) as guard:
        assert warm_up(model, scaler, steps=6) == WARM_UP_SKIPS
        assert scaler.update is not counting_update
    assert len(calls) == 6 and len(guard.skipped_steps) == 4
    assert scaler.update is counting_update


def test_copies_of_a_watched_scaler_come_out_unwatched():
    model, scaler = mlp(), grad_scaler()
    with Guard(model, scaler=scaler):
        warm_up(model, scaler, steps=1)
        assert watched(scaler)
        copies = [copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))]
    for twin in copies:
        assert twin.update.__func__ is torch.amp.GradScaler.update
        assert twin.update.__self__ is twin
        assert twin.get_scale() == 2.0 ** 15


# ---- what the scaler hides is raised -----------------------------------------------------------
def test_nan_at_every_scale_is_raised_after_max_skipped_steps_naming_the_module():
    model, scaler = Siamese(), grad_scaler()
    with pytest.raises(NonFiniteError) as raised:
        with Guard(model, scaler=scaler) as guard:
            siamese_steps(model, scaler)
    report = raised.value.report
    assert report.batch_number == 16 and report.phase == "backward"
    assert report.first_nonfinite.module_name == "distance"
    assert "GradScaler skipped the 16 steps before (batches 0-15, scale 65536 down to 1)" in report.reason
    assert [step.module for step in guard.skipped_steps] == ["distance"] * 16
    assert guard.skipped_steps[-1].values == "nan" and guard.skipped_steps[-1].scale == 2.0
    assert not watched(scaler)


def test_max_skipped_steps_is_the_rule():
    model, scaler = Siamese(), grad_scaler()
    with pytest.raises(NonFiniteError) as raised:
        with Guard(model, scaler=scaler, max_skipped_steps=3) as guard:
            siamese_steps(model, scaler)
    assert raised.value.report.batch_number == 3 and len(guard.skipped_steps) == 3
    assert "skipped the 3 steps before (batches 0-2, scale 65536 down to 8192)" in raised.value.report.reason


def test_a_scale_of_1_or_a_disabled_scaler_lets_nothing_through():
    for scaler, note in ((grad_scaler(init_scale=1.0), "GradScaler's scale is 1"),
                         (grad_scaler(enabled=False), "")):
        model = Siamese()
        with pytest.raises(NonFiniteError) as raised:
            with Guard(model, scaler=scaler) as guard:
                siamese_steps(model, scaler)
        assert raised.value.report.batch_number == 0 and guard.skipped_steps == []
        assert note in raised.value.report.reason
        assert not watched(scaler)


def test_a_scaler_whose_update_is_never_called_lets_through_no_more_than_the_rule():
    model, scaler = Siamese(), grad_scaler()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as raised:
        with Guard(model, scaler=scaler, max_skipped_steps=4):
            for _ in range(40):  # the loop scales its loss by hand: no scaler of its own seen
                (model(torch.randn(3, 4)) * 2.0 ** 16).backward()
                if all(p.grad is None or bool(p.grad.isfinite().all()) for p in model.parameters()):
                    optimizer.step()  # (skips a step whose gradients overflowed)
                optimizer.zero_grad(set_to_none=True)
    assert raised.value.report.batch_number == 4
    assert "GradScaler.update() has not been called since batch 0" in raised.value.report.reason


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_scaler_seen_scaling_the_loss_is_the_rules_over_one_given_that_the_loop_never_calls(
        mode):
    # A notebook's scaler from an earlier run, handed to the guard (by hand, or found in the
    # namespace by the magics), while the loop makes its own: a warm-up from 2**40 skips more than
    # 16 steps and is no false alarm.
    expected = warm_up(mlp(), grad_scaler(init_scale=2.0 ** 40), steps=24)
    assert len(expected) > 16
    stale = grad_scaler()
    model = mlp()
    with Guard(model, scaler=stale, mode=mode) as guard:
        skipped = warm_up(model, grad_scaler(init_scale=2.0 ** 40), steps=24)
    assert skipped == expected and [step.batch for step in guard.skipped_steps] == expected
    assert not watched(stale)


def test_reset_forgets_the_overflow_of_a_step_interrupted_before_its_update():
    model, scaler = Siamese(), grad_scaler()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Guard(model, scaler=scaler) as guard:
        scaler.scale(model(torch.randn(3, 4))).backward()  # batch 0 overflows; then Ctrl-C
        guard.reset()
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(model(torch.randn(3, 4))).backward()
        scaler.step(optimizer)
        scaler.update()
    assert [step.batch for step in guard.skipped_steps] == [1]


def test_a_step_the_scaler_takes_is_not_recorded_as_skipped():
    # the nan gradient reaches only a parameter the optimizer leaves alone: nothing to skip
    model, scaler = nn.ModuleDict({"head": nn.Linear(4, 1), "siamese": Siamese()}), grad_scaler()
    optimizer = torch.optim.SGD(model["head"].parameters(), lr=1e-3)
    with Guard(model, scaler=scaler) as guard:
        for _ in range(20):
            x = torch.randn(3, 4)
            scaler.scale(model["head"](x).sum() + model["siamese"](x)).backward()
            scaler.step(optimizer)
            scaler.update()
            model.zero_grad(set_to_none=True)
    assert scaler.get_scale() == 2.0 ** 16 and guard.skipped_steps == []


def test_a_forward_nan_is_raised_at_once_whatever_the_scaler():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtOfNegative(), nn.Linear(4, 1))
    scaler = grad_scaler()
    with pytest.raises(NonFiniteError) as raised:
        with Guard(model, scaler=scaler) as guard:
            siamese_steps(model, scaler)
    report = raised.value.report
    assert report.batch_number == 0 and report.phase == "forward"
    assert report.first_nonfinite.module_name == "1" and guard.skipped_steps == []
    assert "GradScaler" not in report.reason


# ---- the option ------------------------------------------------------------------------------
@pytest.mark.parametrize("keywords, error, message", [
    ({"scaler": object()}, TypeError,
     "scaler must be a torch.amp.GradScaler (or an object with get_scale(), is_enabled() and "
     "update()), got object: pass the scaler whose scale(loss) the loop backpropagates"),
    ({"scaler": torch.amp.GradScaler}, TypeError, "got type"),
    ({"max_skipped_steps": -1}, ValueError, "max_skipped_steps must be a number of steps >= 0, got -1"),
    ({"max_skipped_steps": True}, ValueError, "got True"),
    ({"max_skipped_steps": "3"}, ValueError, "got '3'"),
])
def test_option_errors_are_one_line(keywords, error, message):
    with pytest.raises(error) as raised:
        GuardOptions(**keywords)
    assert message in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(error):
        Guard(nn.Linear(2, 2), **keywords)


def test_the_scaler_is_an_option_and_an_attribute():
    scaler = grad_scaler()
    guard = Guard(nn.Linear(2, 2), scaler=scaler, max_skipped_steps=0)
    assert guard.scaler is scaler and guard.options.scaler is scaler and guard.max_skipped_steps == 0
    other = grad_scaler()
    guard.scaler = other
    assert guard.options.scaler is other
    with pytest.raises(TypeError):
        guard.scaler = "scaler"
    assert "max_skipped_steps" in Guard.__doc__


# ---- found by the callbacks ------------------------------------------------------------------
def test_the_scaler_of_a_training_object_is_found_where_each_library_keeps_it():
    scaler = grad_scaler()
    shapes = {
        "accelerate's Accelerator (trainer.accelerator.scaler)": SimpleNamespace(
            accelerator=SimpleNamespace(scaler=scaler)),
        "an older Trainer's trainer.scaler": SimpleNamespace(scaler=scaler, accelerator=None),
        "Lightning's trainer.precision_plugin.scaler": SimpleNamespace(
            precision_plugin=SimpleNamespace(scaler=scaler)),
        "Lightning's trainer.strategy.precision_plugin.scaler": SimpleNamespace(
            strategy=SimpleNamespace(precision_plugin=SimpleNamespace(scaler=scaler))),
        "the scaler itself": scaler,
    }
    for shape, obj in shapes.items():
        assert loss_scaler_of(obj) is scaler, shape
    assert loss_scaler_of(SimpleNamespace(scaler=grad_scaler(enabled=False))) is None
    assert loss_scaler_of(SimpleNamespace(accelerator=SimpleNamespace(scaler=None))) is None
    assert loss_scaler_of(None) is None and loss_scaler_of(torch.optim.SGD(mlp().parameters())) is None


class HalfPrecisionRegressor(nn.Module):
    """Computes in float16 autocast itself (the Trainer on CPU has no fp16): a loss that the
    scale 65536 makes overflow in the first steps."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, features, labels=None):
        with torch.autocast("cpu", dtype=torch.float16):
            logits = self.net(features)
        return {"loss": F.mse_loss(logits.float(), labels, reduction="sum") / 8, "logits": logits}


def regression_samples(count=64):
    generator = torch.Generator().manual_seed(0)
    return [{"features": torch.randn(8, generator=generator),
             "labels": torch.randn(4, generator=generator) * 4} for _ in range(count)]


def test_trainer_callback_lets_the_accelerate_scalers_skipped_steps_through(tmp_path):
    import transformers

    from numguard_nb.integrations import NumguardCallback

    model, callback = HalfPrecisionRegressor(), NumguardCallback()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=8,
        max_steps=8, save_strategy="no", disable_tqdm=True, max_grad_norm=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=regression_samples(),
                                   callbacks=[callback])
    # accelerate makes a GradScaler for fp16 on GPUs only: the one it would make, put in its place
    trainer.accelerator.scaler = scaler = grad_scaler()
    trainer.train()
    assert callback.guard.scaler is scaler
    assert [step.batch for step in callback.skipped_steps] == [0, 1, 2]
    assert "GradScaler skipped 3 steps (batches 0-2" in callback.report.summary()
    assert not watched(scaler) and hooks_left(model) == []


def test_lightning_16_mixed_run_is_let_through_and_its_skipped_steps_recorded():
    import lightning
    from lightning.pytorch.plugins import MixedPrecision

    from numguard_nb.integrations import NumguardLightningCallback

    class LitRegressor(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_index):
            return F.mse_loss(self.net(batch["features"]), batch["labels"], reduction="sum") / 8

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    module, callback = LitRegressor(), NumguardLightningCallback()
    # precision="16-mixed" turns into bf16 on CPU: its plugin, with its CPU GradScaler, given
    plugin = MixedPrecision("16-mixed", "cpu")
    trainer = lightning.Trainer(
        max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
        plugins=[plugin])
    trainer.fit(module, torch.utils.data.DataLoader(regression_samples(), batch_size=8))
    assert callback.guard.scaler is plugin.scaler
    assert [step.batch for step in callback.skipped_steps] == [0, 1, 2]
    assert "GradScaler skipped 3 steps" in callback.report.summary()
    assert not watched(plugin.scaler) and hooks_left(module) == []


def test_a_scaler_given_to_the_callback_takes_precedence():
    from numguard_nb.integrations import NumguardCallback

    given, found = grad_scaler(), grad_scaler()
    callback = NumguardCallback(scaler=given)
    callback.start(mlp(), found)
    assert callback.guard.scaler is given
    callback.detach()
    assert NumguardCallback().skipped_steps == []


# ---- found by the magics ---------------------------------------------------------------------
class FakeTrainer:
    def __init__(self, model, scaler):
        self.model = model
        self.accelerator = SimpleNamespace(scaler=scaler)

    def train(self):
        pass


def test_the_one_enabled_scaler_of_the_namespace_is_found():
    scaler = grad_scaler()
    assert find_scaler({"net": mlp(), "scaler": scaler}) == ("scaler", scaler, "")
    assert find_scaler({"trainer": FakeTrainer(mlp(), scaler)}) == ("trainer", scaler, "")
    # the same scaler twice is one scaler; a disabled one, or one only the shell holds, is none
    assert find_scaler({"a": scaler, "trainer": FakeTrainer(mlp(), scaler)})[1] is scaler
    assert find_scaler({"off": grad_scaler(enabled=False)}) == (None, None, "")
    assert find_scaler({"_s": scaler, "s": scaler}, hidden={"s": scaler}) == (None, None, "")
    name, found, note = find_scaler({"a": scaler, "b": grad_scaler()})
    assert found is None and note.startswith("numguard: several GradScalers (a, b): the one whose scale(loss) runs is used")
    assert find_scaler({"a": scaler, "b": grad_scaler()}, "b")[0] == "b"
    with pytest.raises(LookupError, match="net is a Sequential, not an enabled torch.amp.GradScaler"):
        find_scaler({"net": mlp()}, "net")


def test_status_line_says_what_the_scaler_skipped():
    scaler = grad_scaler()
    ns = {"net": mlp(), "scaler": scaler}
    run = GuardedRun(ns, find_models(ns, ["net"]), GuardOptions(scaler=scaler), scaler_name="scaler")
    session = Session()
    (line,) = session.start(run).lines
    assert line.endswith("until %numguard off; the steps scaler (GradScaler) skips are let through")
    session.before_cell("# a cell")
    warm_up(ns["net"], scaler, steps=6)
    session.after_cell(True, None)
    assert session.status() == (
        "numguard: on, guarding net (Sequential), at batch 5; scaler (GradScaler) skipped 4 steps "
        "(batches 0-3, scale 65536 down to 8192); the first: batch 0 (scale 65536): +inf and -inf "
        "in grad_input of <outside>")
    # a scaler made anew under the same name is followed
    ns["scaler"] = new = grad_scaler()
    assert session.before_cell("# a cell").lines == [
        "numguard: scaler is a new GradScaler: the steps it skips are let through"]
    assert run.guard.scaler is new and not watched(scaler)
    session.stop()


MAGIC_SETUP = """
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
scaler = torch.amp.GradScaler("cpu")
"""


def run_cell(ip, cell):
    from IPython.utils.capture import capture_output

    with capture_output() as captured:
        result = ip.run_cell(cell)
    return result, captured


@pytest.fixture
def ip(shell):
    shell.reset(new_session=False)
    assert shell.run_cell(MAGIC_SETUP).success
    shell.user_ns["warm_up"] = warm_up
    yield shell
    shell.run_cell("%numguard off")


def test_numguard_cell_picks_up_the_namespaces_scaler(ip):
    result, captured = run_cell(ip, "%%numguard\nwarm_up(net, scaler, steps=6)")
    assert result.success and result.result == [0, 1, 2, 3]
    assert "GradScaler skipped 4 steps (batches 0-3, scale 65536 down to 8192)" in captured.stdout
    assert "skipped 4 steps" in ip.user_ns["_numguard"].summary()
    assert not watched(ip.user_ns["scaler"])
    # two scalers: the one the loop scales its loss with is found as it runs
    ip.run_cell('scaler, other = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")')
    result, captured = run_cell(ip, "%%numguard net\nwarm_up(net, scaler, steps=2)")
    assert result.success and result.result == [0, 1]
    assert "several GradScalers (scaler, other): the one whose scale(loss) runs is used" in captured.stdout
    result, _ = run_cell(ip, "%%numguard net --scaler scaler\nwarm_up(net, scaler, steps=2)")
    assert result.success
    result, _ = run_cell(ip, "%%numguard net --scaler net\nwarm_up(net, scaler, steps=2)")
    assert isinstance(result.error_in_exec, UsageError)
    assert str(result.error_in_exec).startswith(
        "%%numguard: --scaler: net is a Sequential, not an enabled torch.amp.GradScaler")


def test_numguard_on_picks_up_the_scaler_and_status_shows_its_skips(ip):
    _, captured = run_cell(ip, "%numguard on net")
    assert captured.stdout.strip().endswith("; the steps scaler (GradScaler) skips are let through")
    result, _ = run_cell(ip, "warm_up(net, scaler, steps=6)")
    assert result.success
    _, captured = run_cell(ip, "%numguard status")
    assert "scaler (GradScaler) skipped 4 steps (batches 0-3" in captured.stdout
    _, captured = run_cell(ip, "%numguard off")
    assert not watched(ip.user_ns["scaler"]) and hooks_left(ip.user_ns["net"]) == []


@pytest.mark.parametrize("namespace", ["a scaler the loop makes", "two scalers"])
def test_status_shows_the_skips_of_the_scaler_seen_scaling_the_loss(ip, namespace):
    ip.run_cell("del scaler")
    if namespace == "two scalers":
        ip.run_cell('scaler, other = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")')
    run_cell(ip, "%numguard on net -q")
    made = "scaler" if namespace == "two scalers" else 'torch.amp.GradScaler("cpu")'
    result, _ = run_cell(ip, f"warm_up(net, {made}, steps=6)")
    assert result.success and result.result == [0, 1, 2, 3]
    _, captured = run_cell(ip, "%numguard status")
    assert "GradScaler skipped 4 steps (batches 0-3, scale 65536 down to 8192)" in captured.stdout


def test_skipped_summary_counts_and_ranges():
    frame = SimpleNamespace(flagged_rows=[SimpleNamespace(role="grad_output")], label="fc")
    steps = [SkippedStep(b, 2.0 ** (16 - i), "fc", "backward", "+inf", frame)
             for i, b in enumerate([0, 1, 2, 7])]
    assert skipped_summary(steps) == ("GradScaler skipped 4 steps (batches 0-2, 7, scale 65536 "
                                      "down to 8192); the first: batch 0 (scale 65536): +inf in "
                                      "grad_output of fc")
    assert skipped_summary(steps[:1]).startswith("GradScaler skipped 1 step (batch 0, scale 65536)")
    assert skipped_summary([]) == ""


# ---- a scaler the loop makes itself ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_scaler_made_by_the_loop_is_found_without_being_named(mode):
    # The usual order: `with Guard(model):` around a loop that creates its own GradScaler.
    expected = warm_up(mlp(), grad_scaler())
    model = mlp()
    with Guard(model, mode=mode) as guard:
        scaler = grad_scaler()
        skipped = warm_up(model, scaler)
    assert skipped == expected == WARM_UP_SKIPS
    assert [step.batch for step in guard.skipped_steps] == WARM_UP_SKIPS
    assert not watched(scaler)


def test_a_warm_up_from_a_large_scale_is_let_through_however_many_steps_it_skips():
    # GradScaler(init_scale=2**40): a healthy warm-up halving the scale 20 times and more.
    expected = warm_up(mlp(), grad_scaler(init_scale=2.0 ** 40), steps=40)
    assert len(expected) > 16
    model = mlp()
    with Guard(model) as guard:
        skipped = warm_up(model, grad_scaler(init_scale=2.0 ** 40), steps=40)
    assert skipped == expected and [step.batch for step in guard.skipped_steps] == expected


def test_nan_at_every_scale_from_a_found_scaler_is_raised_when_its_scale_reaches_1():
    model = Siamese()
    with pytest.raises(NonFiniteError) as raised, Guard(model):
        siamese_steps(model, grad_scaler())
    report = raised.value.report
    assert report.batch_number == 16 and report.first_nonfinite.module_name == "distance"
    assert "GradScaler skipped the 16 steps before (batches 0-15, scale 65536 down to 1)" in report.reason

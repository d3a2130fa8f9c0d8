"""The sentinel's checks on an asynchronous device: computed there, read without waiting, and a
step whose gradients are not finite never writes the weights (issue: GPU-native cost).

On the host these run the deferred path by counting "cpu" among the deferred devices and holding
its values back (`never_ready`) until the code waits for them, as a GPU still busy would; the
`cuda` tests run the same on a GPU, with torch's own sync detector.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from models import SqrtWeight
from promises import sentinel_steps_without_sync
from numguard_nb import Guard, NonFiniteError, numerics, stats
from numguard_nb.numerics import DeferredRead


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Linear(8, 1)

    def forward(self, x):
        return self.second(torch.relu(self.first(x))).mean()


OPTIMIZERS = {
    "fused": lambda params: torch.optim.AdamW(params, lr=0.1, fused=True),
    "foreach": lambda params: torch.optim.AdamW(params, lr=0.1, foreach=True),
    "plain": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False),
}


def _batch(step: int, bad_step: int, device="cpu") -> torch.Tensor:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step)).to(device)
    if step == bad_step:
        x[3, 1] = float("nan")
    return x


def test_a_healthy_step_waits_for_nothing(deferred_on_host):
    model = Net()
    optimizer = OPTIMIZERS["fused"](model.parameters())
    with Guard(model, mode="sentinel"):
        for step in range(5):
            before = numerics.READS.waited
            model(_batch(step, -1)).backward()
            optimizer.step()
            optimizer.zero_grad()
            assert numerics.READS.waited == before, f"step {step} waited for device values"
            deferred_on_host[0] = step % 2 == 0  # ready at some steps, not at others


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_detected_step_leaves_the_weights_unchanged(deferred_on_host, kind):
    torch.manual_seed(0)
    model = Net()
    optimizer = OPTIMIZERS[kind](model.parameters())
    raised_at = None
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            for step in range(5):
                if step == 2:
                    weights = {k: v.clone() for k, v in model.state_dict().items()}
                model(_batch(step, 2)).backward()
                raised_at = "step"
                optimizer.step()
                raised_at = None
                if step == 2:
                    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items()), \
                        "the step whose gradients held nan wrote the weights"
                optimizer.zero_grad()
                deferred_on_host[0] = step < 2  # the device catches up after the failing step
    report = caught.value.report
    assert report.batch_number == 2
    assert "nan" in str(caught.value)
    # A fused optimizer skips on the device flag and the next call reads it; the others read at
    # the step, which raises before writing anything.
    assert raised_at == (None if kind == "fused" else "step")
    # the weights are those the failing step started from
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


GROUPS = {
    "the model's": lambda model, other: [{"params": list(model.parameters())}],
    # a loss's parameter listed first (CLIP's logit scale), an empty group first
    "another parameter first": lambda model, other: [{"params": [other] + list(model.parameters())}],
    "an empty group first": lambda model, other: [{"params": []}, {"params": list(model.parameters())}],
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("groups", sorted(GROUPS))
@pytest.mark.parametrize("closure", [False, True])  # (LBFGS, Lightning's automatic optimization)
def test_a_detected_step_leaves_the_weights_unchanged_however_the_step_is_made(
        deferred_on_host, kind, groups, closure):
    torch.manual_seed(0)
    model = Net()
    optimizer = OPTIMIZERS[kind](GROUPS[groups](model, nn.Parameter(torch.ones(1))))
    weights: dict = {}  # what the latest step began with
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            _steps_until_nan_in_batch_2(model, optimizer, closure, deferred_on_host, weights)
    assert caught.value.report.batch_number == 2 and caught.value.report.cause == "data"
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items()), \
        "the step whose gradients held nan wrote the weights"


def _steps_until_nan_in_batch_2(model, optimizer, closure: bool, deferred_on_host,
                                weights: dict) -> None:
    """Train 5 steps, the data of batch 2 holding nan (the device catching up after it), with
    `weights` kept as each step begins (a detection ends the steps there)."""
    for step in range(5):
        weights.clear()
        weights.update({k: v.clone() for k, v in model.state_dict().items()})

        def forward_backward():
            optimizer.zero_grad()
            loss = model(_batch(step, 2))
            loss.backward()
            return loss

        if closure:
            optimizer.step(forward_backward)
        else:
            forward_backward()
            optimizer.step()
        deferred_on_host[0] = step < 2


def test_an_optimizer_whose_step_is_patched_hides_no_closure_of_its_class(deferred_on_host,
                                                                           monkeypatch):
    """accelerate patches an optimizer's step with one of (*args, **kwargs), and a GradScaler
    calls it with `None`: later optimizers of that class still have their closure checked."""
    from numguard_nb.guard import sentinel_checks
    monkeypatch.setattr(sentinel_checks, "_CLOSURE_FIRST", {})  # as in a fresh kernel
    torch.manual_seed(0)
    model = Net()
    patched = OPTIMIZERS["foreach"](model.parameters())
    own_step = patched.step
    patched.step = lambda *args, **kwargs: own_step(*args, **kwargs)
    optimizer = OPTIMIZERS["foreach"](model.parameters())
    weights: dict = {}
    with pytest.raises(NonFiniteError):
        with Guard(model, mode="sentinel"):
            patched.step(None)  # (no gradients yet: it writes nothing)
            _steps_until_nan_in_batch_2(model, optimizer, True, deferred_on_host, weights)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items()), \
        "the step whose gradients held nan wrote the weights"


def test_two_guards_lending_one_fused_optimizer_their_flags_leave_none_behind(deferred_on_host):
    model = Net()
    optimizer = OPTIMIZERS["fused"](model.parameters())
    with pytest.raises(NonFiniteError):
        with Guard(model.first, mode="sentinel"), Guard(model.second, mode="sentinel"):
            for step in range(4):
                model(_batch(step, 2)).backward()
                optimizer.step()
                assert not hasattr(optimizer, "found_inf")
                optimizer.zero_grad()
                deferred_on_host[0] = step < 2
    assert not hasattr(optimizer, "found_inf")
    model(_batch(5, -1)).backward()  # unguarded now: the step writes the weights
    weights = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert not any(torch.equal(w, p) for w, p in zip(weights, model.parameters()))


@contextlib.contextmanager
def _registered(handle):
    try:
        yield
    finally:
        handle.remove()


def test_a_step_that_raised_before_its_end_leaves_no_flag_for_the_next(deferred_on_host):
    model = Net()
    optimizer = OPTIMIZERS["fused"](model.parameters())

    def interrupted(optimizer, args, kwargs):
        raise KeyboardInterrupt  # (after the guard's pre-hook: one registered later)

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    with Guard(model, mode="sentinel"):
        model(_batch(0, -1)).backward()
        with pytest.raises(KeyboardInterrupt), \
                _registered(register_optimizer_step_pre_hook(interrupted)):
            optimizer.step()
        model(_batch(1, -1)).backward()
        optimizer.step()
        assert not hasattr(optimizer, "found_inf")
        model(_batch(2, -1)).backward()
        with pytest.raises(KeyboardInterrupt), \
                _registered(register_optimizer_step_pre_hook(interrupted)):
            optimizer.step()
    assert not hasattr(optimizer, "found_inf")  # taken back as the guard left


def test_a_detection_read_at_detach_is_raised_on_exit(deferred_on_host):
    model = Net()
    with pytest.raises(NonFiniteError, match="nan"):
        with Guard(model, mode="sentinel"):
            model(_batch(0, 0)).backward()  # no optimizer, no later call: read at the exit
    assert not model.first._forward_hooks and not model._forward_pre_hooks


def test_the_optimizer_gets_no_flag_once_the_guard_is_gone(deferred_on_host):
    model = Net()
    optimizer = OPTIMIZERS["fused"](model.parameters())
    with Guard(model, mode="sentinel"):
        model(_batch(0, -1)).backward()
        optimizer.step()
        assert not hasattr(optimizer, "found_inf")
    model(_batch(1, -1)).backward()
    weights = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    assert not all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))


def test_same_weights_with_and_without_the_deferred_sentinel(deferred_on_host):
    torch.manual_seed(1)
    plain = Net()
    guarded = Net()
    guarded.load_state_dict(plain.state_dict())
    runs = []
    for model, guard in ((plain, None), (guarded, Guard(guarded, mode="sentinel"))):
        optimizer = OPTIMIZERS["fused"](model.parameters())
        if guard is not None:
            guard.attach()
        for step in range(6):
            model(_batch(step, -1)).backward()
            optimizer.step()
            optimizer.zero_grad()
            deferred_on_host[0] = step % 3 != 0
        if guard is not None:
            guard.detach()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_call_captured_into_a_cuda_graph_makes_no_read_and_seals_nothing(deferred_on_host,
                                                                           monkeypatch):
    """Warm-up calls leave checks open; the call captured next must not seal them (a copy and an
    event recorded in a capture belong to the graph, and asking the event fails there): they
    are sealed and read at the first call after the capture."""
    from numguard_nb.guard import hooks

    made = []
    real_init = DeferredRead.__init__
    monkeypatch.setattr(DeferredRead, "__init__",
                        lambda self, vectors: made.append(1) or real_init(self, vectors))
    model = Net()
    deferred_on_host[0] = False  # the device is done with the warm-up's values
    with pytest.raises(NonFiniteError, match="batch 2"):  # (the captured call counts none)
        with Guard(model, mode="sentinel") as guard, torch.no_grad():
            model(_batch(0, -1))
            model(_batch(1, -1))
            sealed = len(made)
            monkeypatch.setattr(hooks, "stream_capturing", lambda: True)
            model(_batch(2, -1))  # captured
            assert len(made) == sealed and guard._sentinel.checks.pending
            monkeypatch.setattr(hooks, "stream_capturing", lambda: False)
            model(_batch(3, 3))  # after the capture, with a nan: sealed and read at the exit
            assert len(made) == sealed + 1
    assert len(made) == sealed + 2


@pytest.mark.cuda
def test_on_cuda_a_healthy_sentinel_step_makes_no_host_synchronisation():
    x = torch.randn(16, 4, device="cuda")

    def loss_of(model):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x)

    sentinel_steps_without_sync(Net().cuda(), loss_of)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_on_cuda_a_detected_step_leaves_the_weights_unchanged(kind):
    torch.manual_seed(0)
    model = Net().cuda()
    optimizer = OPTIMIZERS[kind](model.parameters())
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            for step in range(5):
                if step == 2:
                    weights = {k: v.clone() for k, v in model.state_dict().items()}
                model(_batch(step, 2, "cuda")).backward()
                optimizer.step()
                optimizer.zero_grad()
    assert caught.value.report.batch_number == 2
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


class Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x):
        return self.layer(x)


@pytest.mark.cuda
def test_on_cuda_a_loss_computed_outside_the_model_makes_no_host_synchronisation():
    x, y = torch.randn(16, 4, device="cuda"), torch.randint(0, 3, (16,), device="cuda")

    def loss_of(model):
        logits = model(x)
        # a mask discarded before the loss: a value read later, and found harmless then
        safe = torch.where(logits > -100, logits, torch.full_like(logits, float("-inf")))
        return torch.nn.functional.cross_entropy(safe, y)

    sentinel_steps_without_sync(Logits().cuda(), loss_of)


class AcrossDevices(nn.Module):
    """Its first layer on the GPU, its second on the CPU (a model placed across devices): a
    step's gradient flags are one per device, joined for one read."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 8).cuda()
        self.second = nn.Linear(8, 1)

    def forward(self, x):
        return self.second(torch.relu(self.first(x.cuda())).cpu()).mean()


@pytest.mark.cuda
def test_on_cuda_a_model_across_the_gpu_and_the_cpu_is_checked_and_named():
    torch.manual_seed(0)
    model = AcrossDevices()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            for step in range(4):
                model(_batch(step, -1)).backward()
                optimizer.step()
                optimizer.zero_grad()
                if step == 1:
                    with torch.no_grad():
                        model.second.weight[0, 0] = float("inf")  # the next backward's gradients
    assert caught.value.report.first_nonfinite.module_name == "second"  # (healthy steps first)


@pytest.mark.cuda
def test_on_cuda_a_nan_made_by_the_loss_code_is_named_with_its_op_and_the_weights_kept():
    torch.manual_seed(0)
    model = Logits().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            for step in range(4):
                if step == 2:
                    weights = {k: v.clone() for k, v in model.state_dict().items()}
                x = torch.randn(16, 4, device="cuda")
                shift = 100.0 if step == 2 else 0.0
                loss = torch.log(model(x).exp().sum(1) - shift).mean()  # log of a negative
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    assert caught.value.report.batch_number == 2
    assert "log" in str(caught.value)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


class PlantedBackward(nn.Module):
    """Logits through a module whose backward makes nan for a batch marked by its first value."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.fault = Fault()

    def forward(self, x):
        return self.fault(self.layer(x), x)


class Fault(nn.Module):
    def forward(self, h, x):
        from tests.models import NanGradient

        return NanGradient.apply(h) if bool(x[0, 0] == MARK) else h


MARK = 1000.0


def _marked(step: int, bad_step: int) -> torch.Tensor:
    x = _batch(step, -1)
    if step == bad_step:
        x[0, 0] = MARK
    return x


def test_a_large_gradient_from_the_loss_code_is_not_kept_while_the_step_is_unread(
        deferred_on_host, monkeypatch):
    import gc
    import weakref

    from numguard_nb.guard import sentinel_checks

    monkeypatch.setattr(sentinel_checks, "MAX_KEPT_GRAD_BYTES", 16)  # these logits are larger
    model = PlantedBackward()
    optimizer = OPTIMIZERS["fused"](model.parameters())
    seen = []
    y = torch.tensor([0, 1, 2, 0] * 4)
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            for step in range(4):
                logits = model(_marked(step, 2))
                logits.register_hook(lambda grad: seen.append(weakref.ref(grad)))
                freed = []  # once the backward reached the first layer's weights
                handle = model.layer.weight.register_post_accumulate_grad_hook(
                    lambda p: freed.append(seen[-1]() is None))
                torch.nn.functional.cross_entropy(logits, y).backward()
                handle.remove()
                assert freed == [True], "the logits' gradient outlived its use in backward"
                optimizer.step()
                optimizer.zero_grad()
                del logits
                gc.collect()
                assert seen[-1]() is None, "the logits' gradient outlived its backward"
                deferred_on_host[0] = step < 2
    report = caught.value.report
    assert report.batch_number == 2
    assert report.first_nonfinite.module_name == "fault"
    assert "uniform gradient of the same norm" in report.reason


def test_a_small_gradient_from_the_loss_code_is_kept_for_the_re_run(deferred_on_host):
    model = PlantedBackward()
    optimizer = OPTIMIZERS["fused"](model.parameters())
    y = torch.tensor([0, 1, 2, 0] * 4)
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            for step in range(4):
                torch.nn.functional.cross_entropy(model(_marked(step, 2)), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                deferred_on_host[0] = step < 2
    assert caught.value.report.first_nonfinite.module_name == "fault"
    assert "uniform gradient" not in caught.value.report.reason


class OnceNanGradient(torch.autograd.Function):
    """nan gradients the first time only: a fault a re-run does not repeat."""

    made = 0

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        OnceNanGradient.made += 1
        return grad * float("nan") if OnceNanGradient.made == 1 else grad


class OnceFaulty(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x):
        return OnceNanGradient.apply(self.layer(x)).sum()


def test_a_gradient_fault_the_re_run_does_not_repeat_is_reported_from_the_one_device_flag(
        deferred_on_host):
    OnceNanGradient.made = 0
    model = OnceFaulty()
    optimizer = OPTIMIZERS["fused"](model.parameters())
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            for step in range(3):
                model(_batch(step, -1)).backward()
                optimizer.step()
                optimizer.zero_grad()
                deferred_on_host[0] = False
    report = caught.value.report
    assert report.cause == "transient" and report.batch_number == 0
    assert "one check on the device that does not say which tensor" in report.reason


def test_with_a_grad_scaler_the_skipped_steps_keep_the_names_of_the_overflowing_gradients(
        deferred_on_host):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from diagnosis_cases import CASES_BY_NAME, run_steps

    def skipped(deferred: bool):
        deferred_on_host[0] = False
        if not deferred:
            numerics.DEFERRED_DEVICE_TYPES.discard("cpu")
        run = CASES_BY_NAME["trap_grad_scaler_warmup"].build()
        with Guard(run.models[""], mode="sentinel", scaler=run.scaler) as guard:
            run_steps(run)
        numerics.DEFERRED_DEVICE_TYPES.add("cpu")
        return [(s.batch, [row.role for row in s.frame.flagged_rows]) for s in guard.skipped_steps]

    read_later, read_at_once = skipped(True), skipped(False)
    assert read_later and read_later == read_at_once
    assert all(roles for _, roles in read_later)
    assert any(role.endswith(".weight.grad") for _, roles in read_later for role in roles)


def test_a_healthy_run_read_later_says_no_inf_nan_was_found(deferred_on_host):
    model = Net()
    with Guard(model, mode="sentinel") as guard:
        for step in range(3):
            model(_batch(step, -1)).backward()
    summary = guard.report.summary()
    assert summary.startswith("no inf/nan found (batch 2)") and "0 frames" not in summary, summary


@pytest.mark.parametrize("in_place", [False, True], ids=["0-d rows", "rows in a sink"])
@pytest.mark.parametrize("planted", [None, float("nan"), float("inf"), float("-inf")])
def test_the_flag_of_a_watched_region_is_not_finite_exactly_when_a_row_is_not(deferred_on_host,
                                                                              planted, in_place):
    """The loss code's statistics, read later as one value: under autocast its rows mix
    float32 and bfloat16 (and integers), and the flag takes a few launches per dtype, not one
    per value."""
    from torch.profiler import ProfilerActivity, profile

    tensors = [torch.randn(8, dtype=(torch.float32, torch.bfloat16)[i % 2]) for i in range(60)]
    tensors.append(torch.arange(5))
    if planted is not None:
        tensors[41][3] = planted
    sink = stats.RowSink() if in_place else None
    with torch.no_grad():
        rows = [stats.device_stats(t, sink=sink) for t in tensors]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        flag = numerics.stats_flag(rows, sink)
    assert flag.shape == (1,) and flag.dtype == torch.float32
    assert bool(flag.isfinite()) is (planted is None)
    launches = sum(1 for event in prof.events() if event.name in ("aten::copy_", "aten::_to_copy"))
    assert launches <= 8, launches


def test_a_parameter_set_while_guarded_has_its_gradient_checked_on_the_device_path(deferred_on_host):
    """The gradients' grouping is made once per set of parameters: a new one is grouped too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), SqrtWeight(), nn.Linear(4, 2))
    deferred_on_host[0] = False
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            model(_batch(0, -1)).sum().backward()
            model[1].w = nn.Parameter(torch.zeros(4))  # d sqrt(w) / dw at 0: inf
            model(_batch(1, -1)).sum().backward()
    report = caught.value.report
    assert report.first_nonfinite.module_name == "1" and report.phase == "backward"
    assert [row.role for row in report.frames[-1].rows if row.flagged] == ["w.grad"]


class LazyHead(nn.Module):
    """A head made lazily, first used after some steps: no gradient of it until then."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.LazyLinear(1)

    def forward(self, x, use_head=False):
        h = self.body(x)
        return (self.head(h) if use_head else h).sum()


def test_a_lazy_parameter_not_yet_made_at_a_backward_is_checked_once_it_is(deferred_on_host):
    torch.manual_seed(0)
    model = LazyHead()
    deferred_on_host[0] = False
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            model(_batch(0, -1)).backward()  # the head is not made yet: no error for it
            model.zero_grad()
            model(_batch(1, -1), use_head=True)  # made here
            with torch.no_grad():
                model.head.weight[0, 0] = float("inf")
            model(_batch(2, -1), use_head=True).backward()
    assert caught.value.report.first_nonfinite.module_name == "head"


class Grown(nn.Module):
    """A parameter empty at first, given values in place later (same object)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.extra = nn.Parameter(torch.empty(0))

    def forward(self, x):
        y = self.lin(x)
        return (y * torch.sqrt(self.extra) if self.extra.numel() else y).sum()


def test_a_parameter_given_values_in_place_has_its_gradient_checked(deferred_on_host):
    torch.manual_seed(0)
    model = Grown()
    deferred_on_host[0] = False
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            model(_batch(0, -1)).backward()
            model.zero_grad()
            model.extra.data = torch.zeros(4)  # d sqrt(w) / dw at 0: inf
            model(_batch(1, -1)).backward()
    assert [row.role for row in caught.value.report.frames[-1].rows if row.flagged] == ["extra.grad"]


def test_a_sparse_gradient_holding_inf_is_found_on_the_device_path(deferred_on_host):
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True))
    deferred_on_host[0] = False
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            out = model(torch.tensor([1, 2, 3]))
            out.backward(torch.full_like(out, float("inf")))  # the code outside hands it inf
    assert caught.value.report.phase == "backward"


def test_an_optimizer_step_captured_into_a_cuda_graph_asks_no_event_and_gets_no_flag(
        deferred_on_host, monkeypatch):
    """A whole step captured after warm-up steps: the step still unread must not be looked at
    from inside the capture (an event asked there fails; a flag would be baked into the graph)."""
    from numguard_nb.guard import hooks

    asked = []
    real_ready = DeferredRead.ready
    monkeypatch.setattr(DeferredRead, "ready", lambda self: asked.append(1) or real_ready(self))
    model = Net()
    optimizer = OPTIMIZERS["fused"](model.parameters())
    with Guard(model, mode="sentinel"):
        for step in range(3):
            model(_batch(step, -1)).backward()
            optimizer.step()
        monkeypatch.setattr(hooks, "stream_capturing", lambda: True)
        asked.clear()
        model(_batch(3, -1)).backward()
        optimizer.step()
        assert asked == [] and not hasattr(optimizer, "found_inf")
        monkeypatch.setattr(hooks, "stream_capturing", lambda: False)


class PlusInfColumn(nn.Module):
    """Appends a +inf column that the loss leaves out: allowed with `allow_inf`."""

    def forward(self, x):
        return torch.cat([x, torch.full((x.shape[0], 1), float("inf"))], 1)


@pytest.mark.parametrize("allowed", ["the model", "its inner module"])
def test_an_allowed_inf_in_the_outputs_is_not_run_again_at_every_call(deferred_on_host, monkeypatch,
                                                                       allowed):
    """On a GPU one flag stands for a call's outputs. An inf the rules allow (`allow_inf` naming
    the model) is not re-run at all, as on the host; one a re-run found allowed inside the model
    is re-run once, not at every step. A nan after it is still found and named (re-run once)."""
    from numguard_nb.guard import sentinel

    reruns = []
    real_rerun = sentinel.rerun_forward
    monkeypatch.setattr(sentinel, "rerun_forward", lambda *a: reruns.append(1) or real_rerun(*a))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), PlusInfColumn())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    names = {"the model": "", "its inner module": "1"}
    x = torch.randn(8, 4)
    with pytest.raises(NonFiniteError) as caught:
        with Guard({"": model}, mode="sentinel", allow_inf=[names[allowed]]):
            for step in range(6):
                if step == 5:
                    x = x.clone()
                    x[0, 0] = float("nan")
                torch.nn.functional.mse_loss(model(x)[:, :4], x.nan_to_num()).backward()
                optimizer.step()
                optimizer.zero_grad()
                deferred_on_host[0] = False
    report = caught.value.report
    assert report.batch_number == 5 and report.reason.startswith("the data fed to"), report.reason
    assert len(reruns) == {"the model": 1, "its inner module": 2}[allowed], reruns


@pytest.mark.parametrize("kind", ["foreach", "plain"])
def test_weights_an_optimizer_step_broke_are_blamed_on_it_on_the_device_path_too(deferred_on_host, kind):
    # the call counted as it ran, and again by its later re-run: the step between still counts
    torch.manual_seed(0)
    model = Net()
    optimizer = OPTIMIZERS[kind](model.parameters())
    with pytest.raises(NonFiniteError) as raised, Guard(model, mode="sentinel"):
        for step in range(5):
            if step == 2:
                for group in optimizer.param_groups:
                    group["lr"] = float("inf")
            model(_batch(step, -1)).backward()
            optimizer.step()
            optimizer.zero_grad()
            deferred_on_host[0] = step < 2
    report = raised.value.report
    assert (report.cause, report.weights_origin) == ("weights", "optimizer step")
    assert report.optimizer_step.lr == float("inf") and report.optimizer_step.after_batch == 2


def test_an_error_of_the_loop_s_own_carries_what_the_guard_found_as_it_detached(deferred_on_host):
    # the loop's own nan check raises before the device's values were read
    model = Net()
    optimizer = OPTIMIZERS["fused"](model.parameters())
    with pytest.raises(RuntimeError, match="non-finite") as raised, Guard(model, mode="sentinel") as guard:
        for step in range(4):
            model(_batch(step, 2)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
            optimizer.step()
            optimizer.zero_grad()
    assert not guard.report.ok
    if sys.version_info >= (3, 11):  # (notes are Python 3.11's)
        assert raised.value.__notes__ == [
            f"numguard found, as the guard detached: {guard.report.summary()} (guard.report holds it)"]


class ScaledSGD(torch.optim.Optimizer):
    """A step taking a positional argument that is no closure (a scale, AdaHessian's Hessians)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, scale=1.0):  # a number, or a function of the group
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad * float(scale(group) if callable(scale) else scale), alpha=-group["lr"])


@pytest.mark.parametrize("scale", [0.5, lambda group: 0.5])
def test_a_step_s_positional_argument_that_is_no_closure_is_passed_as_it_is(deferred_on_host, scale):
    torch.manual_seed(0)
    plain, guarded = Net(), Net()
    guarded.load_state_dict(plain.state_dict())
    for model, guard in ((plain, None), (guarded, Guard(guarded, mode="sentinel"))):
        optimizer = ScaledSGD(model.parameters())
        with guard or contextlib.nullcontext():
            for step in range(3):
                model(_batch(step, -1)).backward()
                optimizer.step(scale)
                optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), guarded.parameters()))


class _NanGradient(torch.autograd.Function):  # a custom op whose backward goes wrong
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * complex(float("nan"), 0)


class _Spectral(nn.Module):
    """A Fourier layer (FNO's): a complex weight on the signal's spectrum."""

    def __init__(self, bad_backward: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, dtype=torch.cfloat))
        self.bad_backward = bad_backward
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        spectrum = torch.fft.rfft(x) * self.weight
        if self.bad_backward:
            spectrum = _NanGradient.apply(spectrum)
        return self.out(torch.fft.irfft(spectrum, n=x.shape[-1])).sum()


def test_a_complex_weight_s_gradient_is_checked_and_left_as_it_was(deferred_on_host):
    torch.manual_seed(0)
    plain, model = _Spectral(False), _Spectral(False)
    model.load_state_dict(plain.state_dict())
    x = torch.randn(4, 8)
    plain(x).backward()
    with Guard(model, mode="sentinel"):
        model(x).backward()
    assert torch.equal(model.weight.grad, plain.weight.grad)
    model = _Spectral(True)
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            model(x).backward()
    assert caught.value.report.phase == "backward"
    assert "weight.grad holds nan" in str(caught.value)


@pytest.mark.parametrize("kind", ["sparse", "nested", "float8"])
def test_a_sparse_nested_or_float8_output_holding_nan_is_seen(deferred_on_host, kind):
    class Out(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, x):
            y = self.layer(x) * torch.tensor([float("nan")] + [1.0] * 7)
            if kind == "sparse":
                return y.to_sparse()
            if kind == "float8":
                return y.to(torch.float8_e4m3fn)
            return torch.nested.as_nested_tensor([y[:2], y[2:3]], layout=torch.jagged)

    model = Out()
    with pytest.raises(NonFiniteError) as caught:
        with torch.no_grad(), Guard(model, mode="sentinel"):
            model(torch.randn(4, 8))
    assert caught.value.report.phase == "forward"


# ---- what a fused optimizer skips while the step is unread ----------------------------------------
def _masked_loss(out):
    valid = torch.tensor([True, True, False, True])  # class 2 masked out, never the target
    return -out.masked_fill(~valid, float("-inf")).log_softmax(-1)[:, 0].mean()


HARMLESS = {
    # the loss code's -inf mask: its region's value is not fine, its read finds no culprit
    "a -inf mask in the loss code": (lambda out: _masked_loss(out), {}),
    # a +inf the rules allow in the model's output, dropped by the loss
    "an allowed +inf output": (
        lambda out: torch.where(torch.isinf(out), 0.0, out).square().mean(), {"allow_inf": True}),
}


@pytest.mark.parametrize("case", sorted(HARMLESS))
def test_a_fused_optimizer_steps_through_what_the_read_will_accept(deferred_on_host, case):
    # The step is still unread at optimizer.step() (a GPU still busy): the flag it lends a fused
    # optimizer must count only what surely is a detection, or a healthy run never trains.
    loss_of, options = HARMLESS[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if options:
        with torch.no_grad():
            model[2].bias[1] = float("inf")
    optimizer = OPTIMIZERS["fused"](model.parameters())
    start = model[0].weight.detach().clone()
    with Guard(model, mode="sentinel", **options) as guard:
        for _ in range(3):
            loss_of(model(torch.randn(8, 8))).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert guard.detection is None
    assert optimizer.state[model[0].weight]["step"].item() == 3
    assert not torch.equal(start, model[0].weight), "every step was skipped"


class _Counting(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("how", ["one loss", "a list of losses", "under a mode of the user's"])
def test_healthy_steps_after_a_scalers_skipped_ones_are_taken(deferred_on_host, how):
    # The scaler's warm-up overflows are the scaler's to skip: the steps after them, unread too,
    # are not skipped for them, however the loop hands it its losses.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = OPTIMIZERS["fused"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=2)
    wrote = []
    with Guard(model, mode="sentinel", scaler=scaler) as guard:
        for step in range(8):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = out.float().square().mean()
            if how == "a list of losses":
                torch.autograd.backward(scaler.scale([loss, out.float().abs().mean()]))
            elif how == "under a mode of the user's":
                with _Counting():
                    scaled = scaler.scale(loss)
                scaled.backward()
            else:
                scaler.scale(loss).backward()
            before = model[0].weight.detach().clone()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            wrote.append(not torch.equal(before, model[0].weight))
    skipped = [step.batch for step in guard.skipped_steps]
    assert skipped and wrote == [batch not in skipped for batch in range(8)], (wrote, skipped)
    assert any(wrote)


class LogOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, own_loss=False):
        out = torch.log(torch.relu(self.fc(x)))  # -inf where the ReLU gives 0
        return out.mean() if own_loss else out


@pytest.mark.parametrize("loss_at", ["the model's own loss", "a mean in the loop"])
def test_a_minus_inf_the_model_gives_is_judged_by_the_loss(deferred_on_host, loss_at):
    # A -inf output is a mask only while the loss stays finite: here the loss is -inf (the mean
    # carries it, nothing new is made outside the model), and the gradients are finite (the
    # ReLU's backward zeroes them). On the host the loss judges it at once; read later alike,
    # and the fused step of that batch writes nothing (the re-run starts from its weights).
    torch.manual_seed(0)
    model = LogOut()
    optimizer = OPTIMIZERS["fused"](model.parameters())
    start = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            for _ in range(3):
                x = torch.randn(8, 4)
                loss = model(x, True) if loss_at == "the model's own loss" else model(x).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    report = caught.value.report
    assert report.batch_number == 0 and report.first_nonfinite.op == "aten.log.default"
    assert report.cause == "forward" and "-inf" in report.reason, report.reason
    assert all(torch.equal(start[k], v) for k, v in model.state_dict().items())


def test_a_minus_inf_the_rules_allow_is_never_run_again(deferred_on_host, monkeypatch):
    from numguard_nb.guard.sentinel import Sentinel

    reruns = []
    real = Sentinel._rerun
    monkeypatch.setattr(Sentinel, "_rerun", lambda self, *a, **k: reruns.append(1) or real(self, *a, **k))
    torch.manual_seed(0)
    model = LogOut()
    optimizer = OPTIMIZERS["fused"](model.parameters())
    with Guard(model, mode="sentinel", allow_inf=True) as guard:
        for step in range(4):
            model(torch.randn(8, 4)).mean().backward()  # a -inf loss the rules allow
            optimizer.step()
            optimizer.zero_grad()
            deferred_on_host[0] = step % 2 == 0
    assert guard.detection is None and not reruns


def test_calls_no_loss_judged_go_with_their_step(deferred_on_host):
    # A backward through autograd.grad (a hand-made update): the loss watch sees no .backward(),
    # and the calls, with their inputs, go once the step is done.
    import gc
    import weakref

    torch.manual_seed(0)
    model = LogOut()
    params = list(model.parameters())
    kept = []
    with Guard(model, mode="sentinel"):
        for _ in range(6):
            deferred_on_host[0] = False
            x = torch.randn(8, 4)
            grads = torch.autograd.grad(model(x).clamp_min(-1).square().mean(), params)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p -= 0.01 * g
            kept.append(weakref.ref(x))
            del x, grads
        gc.collect()
        assert sum(ref() is not None for ref in kept) <= 2  # (the last step's, unread)


def test_a_disabled_scaler_does_not_stand_in_for_the_step_it_never_skips(deferred_on_host):
    # GradScaler(enabled=False) passed through: its step is the optimizer's own, so a nan
    # gradient must still make the fused optimizer skip (the re-run starts from those weights).
    class Distance(nn.Module):  # finite forward, nan gradient where fc(x) == 0
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4, bias=False)

        def forward(self, x):
            return torch.sqrt(self.fc(x).pow(2)).mean()

    torch.manual_seed(0)
    model = Distance()
    optimizer = OPTIMIZERS["fused"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel", scaler=scaler):
            for step in range(4):
                if step == 2:
                    weights = {k: v.clone() for k, v in model.state_dict().items()}
                deferred_on_host[0] = True
                x = torch.zeros(16, 4) if step == 2 else _batch(step, -1)
                scaler.scale(model(x)).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                deferred_on_host[0] = False
    assert caught.value.report.batch_number == 2
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_a_minus_inf_mask_the_model_gives_and_the_loss_drops_is_no_error(deferred_on_host):
    torch.manual_seed(0)
    model = LogOut()
    optimizer = OPTIMIZERS["fused"](model.parameters())
    with Guard(model, mode="sentinel") as guard:
        for _ in range(3):
            out = model(torch.randn(8, 4))
            torch.where(torch.isinf(out), 0.0, out).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert guard.detection is None
    assert optimizer.state[model.fc.weight]["step"].item() == 3


def test_a_detach_from_on_detect_reads_no_later_step_over_the_detection(deferred_on_host):
    # The callbacks detach in on_detect. Under accumulation the next micro-batch's gradients
    # carry the nan too: read then, their re-run (finite) replaced the detection with a
    # "transient" one of batch 3.
    class Bad(nn.Module):
        def forward(self, x):
            return x * torch.where(x[:, :1] > 100, float("nan"), 1.0)

    torch.manual_seed(0)
    model = nn.Sequential(Bad(), nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(2, 2, 2, 4)
    x[1, 0, 0, 0] = 1000.0  # step 1, micro-batch 0: batch 2
    guard = Guard(model, mode="sentinel", on_detect=lambda report: guard.detach())
    with pytest.raises(NonFiniteError) as caught:
        with guard:
            for step in range(2):
                for micro in range(2):
                    model(x[step, micro]).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert caught.value.report.batch_number == 2 and caught.value.report.cause == "forward"
    assert guard.report is caught.value.report


def test_an_evaluation_call_read_after_train_is_run_again_in_eval_mode(deferred_on_host):
    # A nan only eval mode makes (a module of the user's): its check, read once the loop has
    # gone back to model.train(), is re-run in the modes the call ran in, not called transient.
    class EvalOnly(nn.Module):
        def forward(self, x):
            return x if self.training else x * float("nan")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), EvalOnly(), nn.Dropout(0.5), nn.Linear(4, 1))
    optimizer = OPTIMIZERS["foreach"](model.parameters())
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            model(torch.randn(8, 4)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
            with torch.no_grad():
                model(torch.randn(8, 4))  # unread: the device is busy
            model.train()
            model(torch.randn(8, 4)).square().mean().backward()
            optimizer.step()
    report = caught.value.report
    assert report.cause == "forward" and report.first_nonfinite.module_name == "1", report.reason
    assert model.training and all(m.training for m in model.modules())  # (set back)


def test_weights_a_step_wrote_non_finite_name_that_step_when_read_later(deferred_on_host):
    # The check of batch 3's forward is read after more forwards ran: the step named is the one
    # before batch 3's forward, not "outside the forward" judged from the latest ones.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            for batch in range(6):
                if batch == 2:
                    optimizer.param_groups[0]["lr"] = float("inf")  # its step: inf weights
                with torch.no_grad() if batch > 2 else contextlib.nullcontext():
                    loss = model(torch.randn(2, 4)).square().mean()  # batch 3 on: evaluation
                if batch <= 2:
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
    report = caught.value.report
    assert report.cause == "weights" and report.batch_number == 3, report.reason
    assert report.weights_origin == "optimizer step", report.reason
    assert "the 3rd SGD step since the guard attached, after batch 2 (lr inf)" in report.reason


def test_weights_a_step_wrote_name_it_for_the_first_of_two_calls_of_a_batch_read_later(
        deferred_on_host):
    # A module called twice in a batch (a GAN's discriminator on real and fake samples): its
    # first call's check read after the second names the step before the first, not "changed
    # outside the forward" judged from the second call's.
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 1)
    optimizer = torch.optim.SGD(b.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as caught:
        with Guard({"a": a, "b": b}, mode="sentinel"):
            for batch in range(4):
                h = a(torch.randn(2, 4)).detach()  # starts the batch
                (b(h).square().mean() + b(h * 2).square().mean()).backward()
                optimizer.param_groups[0]["lr"] = float("inf") if batch == 2 else 1e-2
                optimizer.step()
                optimizer.zero_grad()
    report = caught.value.report
    assert report.batch_number == 3 and report.weights_origin == "optimizer step", report.reason
    assert "the 3rd SGD step since the guard attached, after batch 2 (lr inf)" in report.reason


@pytest.mark.parametrize("mode", ["sentinel", "full"])
def test_a_step_between_two_calls_of_one_batch_is_named_for_the_second(mode):
    # A GAN's discriminator: called, stepped, called again in the same batch; its step wrote
    # inf weights, which its second call is the first to see.
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 1)
    optimizer = torch.optim.SGD(b.parameters(), lr=1e-2)
    with pytest.raises(NonFiniteError) as caught:
        with Guard({"a": a, "b": b}, mode=mode):
            for batch in range(4):
                h = a(torch.randn(2, 4)).detach()  # starts the batch
                b(h).square().mean().backward()
                optimizer.param_groups[0]["lr"] = float("inf") if batch == 2 else 1e-2
                optimizer.step()
                optimizer.zero_grad()
                b(h).square().mean().backward()
    report = caught.value.report
    assert report.batch_number == 2 and report.weights_origin == "optimizer step", report.reason
    assert "the 3rd SGD step since the guard attached, after batch 2 (lr inf)" in report.reason


@pytest.mark.parametrize("made_meanwhile", [False, True])
def test_a_backward_re_run_read_after_eval_keeps_the_training_modes(deferred_on_host,
                                                                     made_meanwhile):
    # Activation checkpointing recomputes in the re-run's backward: in the modes the step ran
    # in (Dropout's), not the evaluation's the loop is in when the check is read. A module made
    # meanwhile (anywhere) does not lose them.
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 4))
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            if not self.training:
                return self.head(self.block(x))
            h = checkpoint(self.block, x, use_reentrant=False)
            return self.head(h + torch.sqrt(h * 0.0))  # training only: a nan gradient

    torch.manual_seed(0)
    model = Net()
    optimizer = OPTIMIZERS["fused"](model.parameters())
    with pytest.raises(NonFiniteError) as caught:
        with Guard(model, mode="sentinel"):
            model(torch.randn(8, 4)).square().mean().backward()
            optimizer.step()  # fused: handed the flag, no read
            optimizer.zero_grad()
            model.eval()
            if made_meanwhile:
                nn.Linear(4, 2)  # (a module registered anywhere)
            deferred_on_host[0] = False
            with torch.no_grad():
                model(torch.randn(8, 4))  # the check is read here
    assert caught.value.report.cause == "backward-inline", caught.value.report.reason
    assert not model.training and not any(m.training for m in model.modules())


def test_the_gradients_checked_on_a_device_are_every_parameter_s_that_holds_numbers():
    from numguard_nb.guard.sentinel_checks import gradients_by_device

    floats = [nn.Parameter(torch.randn(3)) for _ in range(3)]
    for p in floats[:2]:
        p.grad = torch.ones(3)  # (the third has none: a frozen or unused parameter)
    [(params, by_dtype)] = gradients_by_device(floats)
    assert params == floats[:2] and [[g is p.grad for g, p in zip(by_dtype[0], floats)]] == [[True, True]]
    spectral = nn.Parameter(torch.randn(2, dtype=torch.cfloat))  # a complex one alone: as floats
    spectral.grad = torch.ones(2, dtype=torch.cfloat)
    [(params, [[grad]])] = gradients_by_device([spectral])
    assert params == [spectral] and grad.dtype == torch.float32 and grad.shape == (2, 2)
    half = nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    half.grad = torch.ones(3, dtype=torch.bfloat16)
    [(params, by_dtype)] = gradients_by_device([floats[0], half, floats[1]])
    assert params == [floats[0], floats[1], half]  # grouped by dtype, in that order
    assert [[g.dtype for g in grads] for grads in by_dtype] == [[torch.float32] * 2, [torch.bfloat16]]

"""The sentinel checks the buffers a forward writes (an EMA, a codebook), whose inf or nan the
outputs can hide, and its re-run starts from what they held when the call began."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from numguard_nb import Guard, NonFiniteError
from numguard_nb.guard import sentinel_buffers
from promises import bit_identical, model_state, sentinel_steps_without_sync


class ZeroCountEMA(nn.Module):
    """A running mean divided by a count its forward lowers in place: 0 on the third call, where
    the mean turns inf while the output (x * 2) stays finite."""

    def __init__(self, start: float = 3.0):
        super().__init__()
        self.register_buffer("avg", torch.ones(4))
        self.register_buffer("count", torch.tensor(start))

    def forward(self, x):
        with torch.no_grad():
            self.count.sub_(1)
            self.avg.copy_(x.mean(0) / self.count)
        return x * 2


class Codebook(nn.Module):
    """A codebook replaced by its EMA's quotient each call (lucidrains/vector-quantize-pytorch#38):
    a code no input chose has usage 0, and its row turns nan, while the output passes straight
    through."""

    def __init__(self):
        super().__init__()
        self.register_buffer("usage", torch.zeros(3))
        self.register_buffer("total", torch.zeros(3, 4))
        self.register_buffer("embedding", torch.randn(3, 4))

    def forward(self, z):
        with torch.no_grad():
            onehot = F.one_hot(torch.cdist(z, self.embedding).argmin(1), 3).type(z.dtype)
            self.usage.mul_(0.5).add_(onehot.sum(0), alpha=0.5)
            self.total.mul_(0.5).add_(onehot.t() @ z, alpha=0.5)
            self.embedding = self.total / self.usage.unsqueeze(1)
        return z + 0.0 * self.embedding.sum()


class CachedMask(nn.Module):
    """Caches a -inf causal mask as a buffer in its forward (healthy: -inf is a mask's)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.zeros(4, 4), persistent=False)

    def forward(self, x):
        self.mask = torch.full((4, 4), float("-inf")).triu(1)
        return torch.softmax(x @ x.t() / 2 + self.mask, -1) @ x


class WithLoss(nn.Module):  # the loss in the model: no code outside it to watch
    def __init__(self, start: float):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), ZeroCountEMA(start), nn.Linear(4, 4))

    def forward(self, x):
        return self.body(x).square().mean()


def _train(model, steps: int, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):
        x = torch.randn(4, 4, generator=gen).to(device)
        F.mse_loss(model(x), x).backward()
        optimizer.step()
        optimizer.zero_grad()


def _caught(model, steps: int, device: str = "cpu") -> NonFiniteError:
    with pytest.raises(NonFiniteError) as raised:
        with Guard(model, mode="sentinel"):
            _train(model, steps, device=device)
    return raised.value


@pytest.fixture(params=["host", "deferred"])
def path(request):
    """Both of the sentinel's paths: read at once (host), read later (a GPU's, on the host)."""
    if request.param == "deferred":
        request.getfixturevalue("deferred_on_host")
    return request.param


def test_a_buffer_written_non_finite_behind_finite_outputs_is_named_with_its_op(path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), ZeroCountEMA(), nn.Linear(4, 4))
    report = _caught(model, 5).report
    frame = report.first_nonfinite
    assert (frame.module_name, report.phase, frame.op, report.batch_number) == (
        "1", "forward", "aten.div.Tensor", 2)
    assert report.found_by == "re-run" and "avg" in report.reason


def test_a_replaced_codebook_is_named_in_the_batch_that_broke_it(path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Codebook())
    report = _caught(model, 3).report
    assert (report.first_nonfinite.module_name, report.phase, report.first_nonfinite.op,
            report.batch_number) == ("1", "forward", "aten.div.Tensor", 0)


def test_the_re_run_starts_from_a_copy_of_what_a_forward_writes_in_place():
    # Without the copy the re-run would lower the count from 0 to -1: finite, a "transient".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), ZeroCountEMA())
    report = _caught(model, 5).report
    assert report.cause != "transient" and report.first_nonfinite.op == "aten.div.Tensor"


def test_after_a_detection_the_buffers_are_as_the_failing_call_left_them(path):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), ZeroCountEMA(), nn.Linear(4, 4))
    guarded = copy.deepcopy(plain)
    _caught(guarded, 5)
    gen = torch.Generator().manual_seed(0)
    optimizer = torch.optim.SGD(plain.parameters(), lr=1e-2)
    for step in range(3):  # two healthy steps, then the failing call
        x = torch.randn(4, 4, generator=gen)
        loss = F.mse_loss(plain(x), x)
        if step < 2:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, mine), (_, theirs) in zip(guarded.named_buffers(), plain.named_buffers()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True, msg=name)


def test_healthy_buffer_writes_raise_nothing_and_change_nothing(path):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), ZeroCountEMA(start=1e9),
                          CachedMask(), nn.Linear(4, 4))
    guarded = copy.deepcopy(plain)
    with Guard(guarded, mode="sentinel") as guard:
        _train(guarded, 30)
    _train(plain, 30)
    assert guard.report.ok
    assert bit_identical(model_state(guarded), model_state(plain))


def test_a_buffer_registered_after_the_guard_attached_is_watched(path):
    class Lazy(nn.Module):
        def forward(self, x):
            if not hasattr(self, "scale"):  # made on the first call, after the attach
                self.register_buffer("scale", torch.ones(()))
            with torch.no_grad():
                self.scale.mul_(1e30)  # inf on the second call
            return x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Lazy())
    report = _caught(model, 4).report
    assert report.batch_number == 1 and report.first_nonfinite.module_name == "1"


def test_a_healthy_step_that_writes_buffers_waits_for_nothing(deferred_on_host):
    from numguard_nb import numerics

    model = WithLoss(start=1e9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(0)
    with Guard(model, mode="sentinel"):
        for step in range(4):
            before = numerics.READS.waited
            model(torch.randn(4, 4, generator=gen)).backward()
            optimizer.step()
            optimizer.zero_grad()
            assert numerics.READS.waited == before, f"step {step} waited for device values"
            deferred_on_host[0] = step % 2 == 0


@pytest.mark.cuda
def test_on_cuda_buffer_writes_make_no_host_synchronisation_and_a_bad_one_is_named():
    x = torch.randn(4, 4, device="cuda")
    sentinel_steps_without_sync(WithLoss(start=1e9).cuda(), lambda model: model(x))
    torch.manual_seed(0)
    bad = nn.Sequential(nn.Linear(4, 4), ZeroCountEMA(), nn.Linear(4, 4)).cuda()
    report = _caught(bad, 5, device="cuda").report
    assert (report.first_nonfinite.module_name, report.first_nonfinite.op,
            report.batch_number) == ("1", "aten.div.Tensor", 2)


def test_the_first_training_calls_copy_every_small_buffer_then_only_those_written_in_place():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), ZeroCountEMA(start=1e9), Codebook())

    class Entry:
        module, name, buffers = model, "", None

    copied = []
    for learning in [False] * 3 + [True] * (sentinel_buffers.FRESH_CALLS + 1):
        before = sentinel_buffers.Before(Entry, learning)
        model(torch.randn(4, 4))
        before.written()
        copied.append(sorted(Entry.buffers.names[i] for i in before.copies))
    assert copied[:3] == [[]] * 3  # evaluation calls copy nothing, and leave the first ones
    assert copied[3] == ["1.running_mean", "1.running_var", "2.avg", "2.count", "3.embedding",
                         "3.total", "3.usage"]  # the first write is not known until seen
    # BatchNorm's kernel moves no version; the codebook's embedding is replaced, not written
    assert copied[-1] == ["2.avg", "2.count", "3.total", "3.usage"]


class ClassMinimum(nn.Module):
    """Keeps each class's smallest feature seen: +inf for a class no batch had yet (healthy),
    and nan once `poisoned` (a bad write)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("minimum", torch.full((3,), float("inf")))
        self.poisoned = False

    def forward(self, x):
        with torch.no_grad():
            seen = torch.full((3,), float("inf"))
            seen[0] = x[0, 0] * (float("nan") if self.poisoned else 1.0)
            self.minimum.copy_(torch.minimum(self.minimum, seen))
        return x


def test_a_buffer_that_keeps_inf_raises_nothing_and_leaves_the_other_checks_on(path):
    torch.manual_seed(0)
    healthy = nn.Sequential(nn.Linear(4, 4), ClassMinimum())
    with Guard(healthy, mode="sentinel") as guard:
        _train(healthy, 4)
    assert guard.report.ok
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), ClassMinimum(), ZeroCountEMA())
    report = _caught(model, 5).report
    assert (report.first_nonfinite.module_name, report.batch_number) == ("2", 2)
    model = nn.Sequential(nn.Linear(4, 4), ClassMinimum())
    with pytest.raises(NonFiniteError) as raised:
        with Guard(model, mode="sentinel"):
            _train(model, 3)
            model[1].poisoned = True
            _train(model, 1)
    report = raised.value.report
    assert (report.first_nonfinite.module_name, report.batch_number) == ("1", 3)


def test_a_buffer_that_keeps_inf_is_not_run_again_at_every_step(deferred_on_host):
    model = nn.Sequential(nn.Linear(4, 4), ClassMinimum())
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with Guard(model, mode="sentinel"):
        _train(model, 4)
    assert len(calls) == 4  # no re-run


def test_a_re_run_leaves_what_the_callers_graph_saved_of_a_buffer_usable():
    from numguard_nb import rerun

    class Normalise(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.full((4,), 2.0))

        def forward(self, x):
            return x / self.scale  # the division saves the buffer for its backward

    model = Normalise()
    x = torch.randn(3, 4, requires_grad=True)
    loss = model(x).sum()
    with rerun.Kept([model]):
        model.scale.mul_(3)  # what a re-run writes, then put back
    loss.backward()  # the saved buffer's version is as the graph saved it
    assert torch.equal(model.scale, torch.full((4,), 2.0))
    assert torch.equal(x.grad, torch.full((3, 4), 0.5))


def test_a_model_with_lazy_modules_is_watched(path):
    def made():
        torch.manual_seed(0)
        return nn.Sequential(nn.LazyLinear(4), nn.LazyBatchNorm1d(), nn.Linear(4, 4))

    guarded, plain = made(), made()
    with Guard(guarded, mode="sentinel") as guard:
        torch.manual_seed(1)
        _train(guarded, 3)
    torch.manual_seed(1)
    _train(plain, 3)
    assert guard.report.ok
    assert bit_identical(model_state(guarded), model_state(plain))


@pytest.mark.parametrize("made", ["assigned to a None buffer", "registered"])
def test_a_buffer_first_given_a_tensor_by_the_call_that_makes_it_inf_is_named_there(path, made):
    class InverseStd(nn.Module):  # data-dependent initialisation in the first batch
        def __init__(self):
            super().__init__()
            if made != "registered":
                self.register_buffer("inv_std", None)

        def forward(self, x):
            if getattr(self, "inv_std", None) is None:
                with torch.no_grad():
                    self.register_buffer("inv_std", 1 / x.std(0))  # inf for a constant feature
            return x

    model = nn.Sequential(InverseStd(), nn.Linear(4, 4))
    with pytest.raises(NonFiniteError) as raised:
        with Guard(model, mode="sentinel"):
            x = torch.randn(4, 4)
            x[:, 2] = 1.0
            model(x).sum().backward()
    report = raised.value.report
    assert (report.batch_number, report.cause) == (0, "forward") and "inv_std" in report.reason
    assert model[0].inv_std.isinf().any()  # as the call left it


def test_evaluation_calls_before_training_copy_nothing_and_leave_the_op_named(path):
    class TrainEMA(ZeroCountEMA):  # writes only in training; its count reaches 0 at once
        def forward(self, x):
            return super().forward(x) if self.training else x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), TrainEMA(start=1.0))
    with pytest.raises(NonFiniteError) as raised:
        with Guard(model, mode="sentinel"):
            model.eval()
            with torch.no_grad():
                for _ in range(3):  # a sanity check's evaluation steps
                    model(torch.randn(4, 4))
            model.train()
            _train(model, 2)
    report = raised.value.report
    assert (report.first_nonfinite.module_name, report.first_nonfinite.op) == (
        "1", "aten.div.Tensor")


def test_a_model_that_makes_a_module_list_at_each_call_does_not_look_its_buffers_up_again(
        monkeypatch):
    made = []
    real = sentinel_buffers.BufferSlots.__init__
    monkeypatch.setattr(sentinel_buffers.BufferSlots, "__init__",
                        lambda self, *args: made.append(1) or real(self, *args))

    class Sliced(nn.Module):  # as decoders that run `self.layers[:n]`
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x):
            for layer in self.layers[:2]:
                x = layer(x) * self.scale
            return x

    model = Sliced()
    with Guard(model, mode="sentinel"):
        _train(model, 5)
    assert len(made) == 1


def test_calls_without_gradients_copy_no_buffer(monkeypatch):
    copied = []
    real = sentinel_buffers._copies
    monkeypatch.setattr(sentinel_buffers, "_copies",
                        lambda tensors, positions: copied.append(1) or real(tensors, positions))

    class Cache(nn.Module):  # a key/value cache written in place at each decoding step
        def __init__(self):
            super().__init__()
            self.register_buffer("keys", torch.zeros(16, 4))

        def forward(self, x, position: int):
            self.keys[position] = x[0]
            return self.keys[:position + 1].sum(0)

    model = Cache()
    with Guard(model, mode="sentinel"), torch.no_grad():
        for position in range(8):
            model(torch.randn(1, 4), position)
    assert not copied


def test_a_replaced_buffer_is_not_kept_once_its_step_was_checked(path):
    import gc
    import weakref

    class Smoothed(nn.Module):  # an average replaced at each call
        def __init__(self):
            super().__init__()
            self.register_buffer("average", torch.zeros(4))

        def forward(self, x):
            self.average = 0.5 * self.average + 0.5 * x.detach().mean(0)
            return x

    model = nn.Sequential(nn.Linear(4, 4), Smoothed())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    replaced = []
    with Guard(model, mode="sentinel"):
        for _ in range(6):
            replaced.append(weakref.ref(model[1].average))
            model(torch.randn(4, 4, generator=gen)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    gc.collect()
    assert sum(ref() is not None for ref in replaced) <= 1  # (the last step's, read at exit)


class Cat(nn.Module):
    """Appends a +inf column that the loss leaves out (allowed with `allow_inf=["<its name>"]`):
    its outputs are re-run once, and the re-run's values accepted."""

    def forward(self, x):
        return torch.cat([x, torch.full((x.shape[0], 1), float("inf"))], 1)


def test_a_submodule_made_in_the_failing_call_keeps_its_buffers_for_the_re_run(path):
    class Standardise(nn.Module):
        def __init__(self, n: int):
            super().__init__()
            self.register_buffer("mean", torch.zeros(n))
            self.register_buffer("std", torch.ones(n))

        def forward(self, x):
            return (x - self.mean) / self.std

    class Head(nn.Module):  # makes its normalisation on the first call
        def forward(self, x):
            if not hasattr(self, "norm"):
                self.norm = Standardise(x.shape[1])
            return self.norm(x) * 1e39  # +inf in float32

    model = nn.Sequential(nn.Linear(4, 4), Head())
    with pytest.raises(NonFiniteError) as raised:
        with Guard(model, mode="sentinel"):
            model(torch.randn(4, 4)).sum().backward()
    assert raised.value.report.batch_number == 0
    assert sorted(name for name, _ in model.named_buffers()) == ["1.norm.mean", "1.norm.std"]


class Rescale(nn.Module):
    """Scales by a buffer (saved for the backward), then replaces it by its running average."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        y = x * self.scale
        self.scale = 0.9 * self.scale + 0.1 * x.detach().abs().mean(0)
        return y


def test_a_re_run_that_is_accepted_leaves_a_replaced_buffer_the_graph_saved_usable(path):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), Rescale(), nn.Linear(4, 4), Cat())
    guarded = copy.deepcopy(plain)
    _train_allowing_inf(guarded)
    _train_leaving_out_inf(plain)
    assert bit_identical(model_state(guarded), model_state(plain))


def test_a_buffer_written_in_place_then_replaced_is_checked_from_what_it_held(path):
    class VarianceEMA(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("var", torch.ones(4))

        def forward(self, x):
            with torch.no_grad():
                self.var.mul_(0.9).add_(0.1 * x.var(0))  # nan for a batch of one
                self.var = self.var.clamp(min=1e-5)  # then replaced
            return x * 2

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), VarianceEMA(), nn.Linear(4, 4))
    with pytest.raises(NonFiniteError) as raised:
        with Guard(model, mode="sentinel"):
            for step in range(5):
                x = torch.randn(1 if step == 3 else 8, 4)
                F.mse_loss(model(x), x).backward()
    assert raised.value.report.batch_number == 3 and "var" in raised.value.report.reason


def test_a_gradient_fault_is_re_run_from_the_buffers_its_forward_found(path):
    class Warm(nn.Module):  # counts its calls in a buffer: the first one's gradient is nan
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            with torch.no_grad():
                self.calls.add_(1)
            return torch.sqrt(x.abs() * (self.calls - 1))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Warm(), nn.Linear(4, 4))
    with pytest.raises(NonFiniteError) as raised:
        with Guard(model, mode="sentinel"):
            x = torch.randn(8, 4)
            F.mse_loss(model(x), x).backward()
    report = raised.value.report
    assert (report.phase, report.cause, report.first_nonfinite.module_name) == (
        "backward", "backward", "1")
    assert model[1].calls.item() == 1.0


def test_a_sparse_buffer_the_forward_replaces_is_left_alone(path):
    class Graph(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("adjacency", torch.eye(4).to_sparse())

        def forward(self, x):
            self.adjacency = (self.adjacency * 1.0).coalesce()
            return torch.sparse.mm(self.adjacency, x)

    model = nn.Sequential(nn.Linear(4, 4), Graph())
    with Guard(model, mode="sentinel") as guard:
        _train(model, 3)
    assert guard.report.ok


def test_evaluation_calls_of_a_buffer_that_keeps_inf_run_nothing_again(path):
    model = nn.Sequential(nn.Linear(4, 4), ClassMinimum()).eval()
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with Guard(model, mode="sentinel") as guard, torch.no_grad():
        for _ in range(4):
            model(torch.randn(4, 4))
    assert len(calls) == 4 and guard.report.ok


def test_a_re_run_does_not_hide_a_change_to_the_rest_of_a_buffers_storage():
    from numguard_nb import rerun

    class History(nn.Module):  # its buffer is one row of a larger tensor
        def __init__(self):
            super().__init__()
            self.rows = torch.ones(2, 4)
            self.register_buffer("last", self.rows[1])

    model = History()
    x = torch.randn(3, 4, requires_grad=True)
    loss = (x * model.rows[0]).sum()  # saves the other row
    with rerun.Kept([model]):
        model.rows[0].mul_(2)  # what a re-run writes outside the buffer: not put back
        model.last.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_synchronous_guard_reads_a_calls_written_buffers_at_once(deferred_on_host):
    from numguard_nb import numerics

    class Cache(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("keys", torch.zeros(8, 4))
            self.register_buffer("values", torch.zeros(8, 4))
            self.position = 0

        def forward(self, x):
            self.keys[self.position] = x[0]
            self.values[self.position] = x[0]
            self.position += 1
            return x * 2

    model = nn.Sequential(*[Cache() for _ in range(8)]).eval()
    with Guard(model, mode="sentinel", sync=True), torch.no_grad():
        for _ in range(3):
            model(torch.randn(1, 4))
        before = numerics.READS.waited
        model(torch.randn(1, 4))
    assert numerics.READS.waited - before <= 2  # the outputs and the 16 buffers: not 17 reads


def _train_leaving_out_inf(model, steps: int = 3):
    """Steps whose loss leaves out `Cat`'s +inf column (the model's last module)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        F.mse_loss(model(x)[:, :4], x).backward()
        optimizer.step()
        optimizer.zero_grad()


def _train_allowing_inf(model, steps: int = 3):
    """`_train_leaving_out_inf` under a sentinel that allows `Cat`'s +inf."""
    with Guard(model, mode="sentinel", allow_inf=[str(len(model) - 1)]) as guard:
        _train_leaving_out_inf(model, steps)
    return guard


@pytest.mark.parametrize("layout", ["a view", "channels last", "channels last, written"])
def test_a_re_run_leaves_a_buffer_the_graph_saved_as_it_saved_it(path, layout):
    class Scaled(nn.Module):  # the product saves the buffer for the backward
        def __init__(self):
            super().__init__()
            if layout == "a view":  # as rotary caches were registered: emb.cos()[None, :]
                self.register_buffer("scale", torch.arange(4.0).cos()[None, :])
            else:
                self.register_buffer("scale", torch.rand(1, 2, 2, 1).to(
                    memory_format=torch.channels_last))

        def forward(self, x):
            if layout.endswith("written"):  # (the re-run writes it again)
                with torch.no_grad():
                    self.scale.mul_(1.0)
            return (x.reshape(-1, *self.scale.shape[1:]) * self.scale).reshape(x.shape)

    torch.manual_seed(0)
    guard = _train_allowing_inf(nn.Sequential(nn.Linear(4, 4), Scaled(), Cat()))
    assert guard.report.ok


def test_a_buffer_registered_behind_a_python_flag_is_not_taken_from_the_re_run(path):
    class Centre(nn.Module):
        def __init__(self):
            super().__init__()
            self.ready = False

        def forward(self, x):
            if not self.ready:  # made on the first call, the flag kept in Python
                self.register_buffer("mean", x.detach().mean(0))
                self.ready = True
            return x - self.mean

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Centre(), Cat())
    assert _train_allowing_inf(model).report.ok
    assert [name for name, _ in model.named_buffers()] == ["1.mean"]


def test_a_re_run_keeps_the_buffers_set_to_none(path):
    class Slots(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cache", None)

        def forward(self, x):
            self.cache = x.detach().clone()
            return x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Slots(), Cat())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Guard(model, mode="sentinel", allow_inf=["2"]):
        x = torch.randn(8, 4)
        loss = F.mse_loss(model(x)[:, :4], x)
        model[1].cache = None  # the loop empties the cache before the backward
        loss.backward()
        optimizer.step()
    assert model[1].cache is None


def test_a_float64_buffer_beyond_float32s_range_is_no_alarm(path):
    class Growing(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.ones(2, dtype=torch.float64))

        def forward(self, x):
            with torch.no_grad():
                self.scale.mul_(1e20)  # 1e40 by the second call: finite in float64
            return x

    model = nn.Sequential(nn.Linear(4, 4), Growing())
    with Guard(model, mode="sentinel") as guard:
        _train(model, 4)
    assert guard.report.ok and model[1].scale[0].item() == pytest.approx(1e80)


def test_a_large_buffer_that_keeps_inf_is_run_again_once_at_most(path, request):
    if path == "deferred":  # a GPU that has each call's flag by the next call
        request.getfixturevalue("deferred_on_host")[0] = False
    class Best(nn.Module):  # a running minimum per slot, +inf for slots not seen yet
        def __init__(self):
            super().__init__()
            self.register_buffer("best", torch.full((2**19,), float("inf")))  # 2 MiB

        def forward(self, x):
            self.best.scatter_reduce_(0, torch.arange(x.shape[0]), x[:, 0], "amin")
            return x * 2

    model = nn.Sequential(nn.Linear(4, 4), Best()).eval()
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with Guard(model, mode="sentinel") as guard, torch.no_grad():
        for _ in range(6):
            model(torch.randn(8, 4))
    assert guard.report.ok and len(calls) <= 7


def test_a_replaced_buffer_the_output_depends_on_is_set_back_for_the_re_run(path):
    class Countdown(nn.Module):  # divides by a scale it then replaces, one lower: 0 at batch 2
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.tensor(2.0))

        def forward(self, x):
            out = x / self.scale
            with torch.no_grad():
                self.scale = self.scale - 1.0
            return out

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Countdown())
    report = _caught(model, 5).report
    assert (report.cause, report.batch_number, report.first_nonfinite.op) == (
        "forward", 2, "aten.div.Tensor")


def test_a_buffer_a_re_run_resized_through_data_is_put_back(path):
    class History(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("values", torch.zeros(1))

        def forward(self, x):
            self.values.data = torch.cat([self.values, x.detach().mean().reshape(1)])
            return x

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), History(), Cat())
    guarded = copy.deepcopy(plain)
    _train_allowing_inf(guarded)
    _train_leaving_out_inf(plain)
    assert torch.equal(guarded[1].values, plain[1].values)


def test_a_re_run_that_cannot_run_the_call_again_says_so_in_a_report(path):
    class Once(nn.Module):  # registers its buffer behind a Python flag: a re-run cannot make it
        def __init__(self):
            super().__init__()
            self.ready = False

        def forward(self, x):
            if not self.ready:
                self.register_buffer("inverse", 1 / x.detach().std(0))  # inf: a constant column
                self.ready = True
            return x - self.inverse.clamp(max=0)

    model = nn.Sequential(Once(), nn.Linear(4, 4))
    x = torch.randn(4, 4)
    x[:, 1] = 3.0
    with pytest.raises(NonFiniteError) as raised:
        with Guard(model, mode="sentinel"):
            model(x).sum().backward()
    report = raised.value.report
    assert report.cause == "unattributed" and "running the call again" in report.reason
    assert "inverse" in report.reason

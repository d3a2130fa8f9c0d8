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
    for (name, mine), (_, theirs) in zip(guarded.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(mine, theirs), name


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
    model = WithLoss(start=1e9).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    x = torch.randn(4, 4, device="cuda")
    with Guard(model, mode="sentinel"):
        for step in range(4):
            torch.cuda.set_sync_debug_mode("error" if step else "default")
            try:
                model(x).backward()
                optimizer.step()
                optimizer.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    torch.manual_seed(0)
    bad = nn.Sequential(nn.Linear(4, 4), ZeroCountEMA(), nn.Linear(4, 4)).cuda()
    report = _caught(bad, 5, device="cuda").report
    assert (report.first_nonfinite.module_name, report.first_nonfinite.op,
            report.batch_number) == ("1", "aten.div.Tensor", 2)


def test_the_first_calls_copy_every_small_buffer_then_only_those_written_in_place():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), ZeroCountEMA(start=1e9), Codebook())

    class Entry:
        module, buffers = model, None

    slots = sentinel_buffers.entry_buffers(Entry)
    names = {i: name for i, (_, name) in enumerate(slots.pairs)}
    copied = []
    for _ in range(sentinel_buffers.FRESH_CALLS + 1):
        before = sentinel_buffers.Before(slots)
        model(torch.randn(4, 4))
        before.written()
        copied.append(sorted(names[i] for i in (before.copies or {})))
    assert copied[0] == sorted(names.values())  # the first write is not known until seen
    # BatchNorm's kernel moves no version; the codebook's embedding is replaced, not written
    assert copied[-1] == ["avg", "count", "total", "usage"]

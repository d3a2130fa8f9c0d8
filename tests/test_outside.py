"""The watch over the code outside the guarded modules (a loss in a cell or a training loop).

A non-finite value made there is named (module `<outside>`, its ATen op, the user's line, a
notebook cell as `Cell In[n]`), forward and backward; masks and data are not blamed; nothing
is left behind (no hook, no mode on the stack), nothing is changed (bit-identical results),
memory stays flat, each thread has its own watch, module internals never run under it, and
the path that reads a GPU's statistics once per region is the same as the one that checks at
once (run on CPU here with the at-once devices emptied).
"""

from __future__ import annotations

import gc
import linecache
import re
import sys
import threading
import tracemalloc
import types
import weakref

import pytest

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import promises
from numguard_nb import Guard, NonFiniteError
from numguard_nb._schema import BACKWARD, CAUSE_OUTSIDE, FORWARD, OUTSIDE_MODULE
from numguard_nb.guard import outside, outside_checks
from numguard_nb.guard.steps import STEP_NUMBER

INF = float("inf")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def this_line_plus(offset: int) -> str:
    """'tests/test_outside.py:<line>' of the caller's line + offset."""
    import sys

    frame = sys._getframe(1)
    return f"{frame.f_code.co_filename}:{frame.f_lineno + offset}"


def function_stack() -> list:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


@pytest.fixture(params=["at once", "once per region"])
def reading(request, monkeypatch):
    """Both ways of reading the statistics: at once (CPU), once per region (a GPU's way)."""
    if request.param == "once per region":
        monkeypatch.setattr(outside_checks, "IMMEDIATE_DEVICES", frozenset())
    return request.param


# ---- forward: a function of the loss makes the value ------------------------------------------
@pytest.mark.parametrize("value, kind", [(0.0, "neginf"), (-1.0, "nan")])
def test_log_of_zero_or_of_a_negative_value_in_the_loss_is_named_with_its_op_and_line(
        reading, value, kind):
    model = mlp()
    x = torch.randn(3, 4)
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        out = model(x)
        where = this_line_plus(1)
        loss = torch.log(out * 0 + value).mean()
        loss.backward()
    report = caught.value.report
    culprit = report.first_nonfinite
    assert report.cause == CAUSE_OUTSIDE and report.phase == FORWARD
    assert (culprit.module_name, culprit.module_class) == (OUTSIDE_MODULE, "torch.log")
    assert culprit.op == "aten.log.default"
    assert culprit.source == f"{where}: loss = torch.log(out * 0 + value).mean()"
    (row,) = culprit.flagged_rows
    assert row.role == "output" and getattr(row, kind)
    assert "code outside the guarded modules produced a non-finite value" in report.reason
    assert "torch.log(p.clamp_min(1e-7))" in report.hint and "BCEWithLogitsLoss" in report.hint
    # the model's frames lead up to it (and, read once per region, the loss's functions)
    names = [f.module_name for f in report.frames if f.module_name != OUTSIDE_MODULE]
    assert names[-3:] == ["1", "2", ""] and report.frames[-1] is culprit


def test_division_by_a_zero_sum_in_the_loss_names_the_division(reading):
    model = mlp()
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        out = model(torch.randn(3, 4))
        mask = torch.zeros(3, 1)
        (out * mask).sum() / mask.sum()  # a masked mean over no element: 0/0
    culprit = caught.value.report.first_nonfinite
    assert culprit.op == "aten.div.Tensor" and culprit.module_class == "Tensor.div"
    assert culprit.flagged_rows[0].nan
    assert "Keep the denominator away from 0" in caught.value.report.hint


def test_a_function_writing_in_place_is_named_and_what_it_overwrote_counts_as_given(reading):
    model = mlp()
    with Guard(model):
        out = model(torch.randn(3, 4)) * 0
        out[0] = INF  # a value already non-finite ...
        out.mul_(2)  # ... kept by an in-place function: nothing new
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        out = model(torch.randn(3, 4)) * 0
        out.log_()  # log(0), in place
        out.sum().backward()
    culprit = caught.value.report.first_nonfinite
    assert (culprit.module_class, culprit.op) == ("Tensor.log_", "aten.log_.default")
    assert culprit.flagged_rows[0].neginf


def test_a_composite_loss_is_named_by_the_aten_op_inside_it_that_made_the_value():
    model = mlp()
    logits_model = nn.Linear(4, 3)
    with pytest.raises(NonFiniteError) as caught, Guard([model, logits_model]):
        logits = logits_model(torch.randn(2, 4))
        F.cross_entropy(logits, torch.tensor([-100, -100]))  # every label ignored: 0/0
    culprit = caught.value.report.first_nonfinite
    assert culprit.module_class == "torch.nn.functional.cross_entropy"
    assert culprit.op == "aten.nll_loss_forward.default"


def test_a_loss_computed_in_a_notebook_cell_is_named_by_the_cell(monkeypatch):
    model = mlp()

    class Compiler:
        _filename_map = {}

    class Shell:
        compile = Compiler()

    cell = "out = model(x)\nloss = torch.log(out * 0).mean()\n"
    filename = "<ipython-input-5-0123456789ab>"
    Compiler._filename_map[filename] = 5
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
    namespace = {"torch": torch, "model": model, "x": torch.randn(2, 4)}
    # the shell running this process, as a notebook kernel's (IPython 7: no format_code_name)
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=Shell))
    try:
        with pytest.raises(NonFiniteError) as caught, Guard(model):
            exec(compile(cell, filename, "exec"), namespace)
    finally:
        linecache.cache.pop(filename, None)
    culprit = caught.value.report.first_nonfinite
    assert culprit.source == "Cell In[5], line 2: loss = torch.log(out * 0).mean()"
    assert "at Cell In[5], line 2" in caught.value.report.reason
    assert "at `loss = torch.log(out * 0).mean()`" in caught.value.report.hint


# ---- backward: a node the loss created makes the gradient ----------------------------------------
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_sqrt_at_zero_in_the_loss_is_named_in_backward_with_the_line_that_made_it(reading, mode):
    model = mlp()
    x = torch.randn(3, 4)
    with pytest.raises(NonFiniteError) as caught, Guard(model, mode=mode):
        pred = model(x)
        y = pred.detach().clone()
        where = this_line_plus(1)
        loss = (pred - y).pow(2).sum().sqrt()
        assert torch.isfinite(loss)  # 0, but its gradient is not finite
        loss.backward()
    report = caught.value.report
    culprit = report.first_nonfinite
    assert report.cause == CAUSE_OUTSIDE and report.phase == BACKWARD
    assert culprit.module_name == OUTSIDE_MODULE and culprit.module_class == "SqrtBackward0"
    assert culprit.op == "SqrtBackward0: aten.sqrt.default"
    assert culprit.source == f"{where}: loss = (pred - y).pow(2).sum().sqrt()"
    assert [row.role for row in culprit.flagged_rows] == ["grad_input"]
    assert "the autograd node SqrtBackward0, created outside the guarded modules" in report.reason
    assert "is infinite at 0" in report.hint and "torch.sqrt(d2 + 1e-12)" in report.hint
    if reading == "at once":  # stopped before any gradient reached the model
        assert model[0].weight.grad is None


def test_log_at_zero_of_a_probability_is_named_in_forward_before_its_backward():
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(10.0)
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        p = torch.sigmoid(model(torch.full((2, 4), 1.0)).squeeze(-1))  # rounds to 1.0
        target = torch.tensor([1.0, 0.0])
        (-(target * torch.log(p) + (1 - target) * torch.log(1 - p)).mean()).backward()
    culprit = caught.value.report.first_nonfinite
    assert (culprit.phase, culprit.op) == (FORWARD, "aten.log.default")
    assert culprit.source.endswith("torch.log(1 - p)).mean()).backward()")


# ---- what is not blamed ----------------------------------------------------------------------------
def test_masks_built_outside_the_modules_do_not_stop_the_run(reading):
    model = nn.Linear(4, 4)
    with Guard(model):
        scores = model(torch.randn(2, 4))
        causal = torch.ones(2, 4, dtype=torch.bool).tril()
        masked = scores.masked_fill(~causal, float("-inf"))
        additive = torch.full((2, 4), float("-inf")).triu(1)
        where = torch.where(causal, scores, torch.tensor(float("-inf")))
        probs = torch.softmax(masked + additive, dim=-1) + torch.softmax(where, dim=-1)
        loss = -(probs.clamp_min(1e-6).log()).mean() + torch.logsumexp(masked, -1).mean()
        loss.backward()
    assert torch.isfinite(loss)


def test_a_fully_masked_row_makes_nan_and_that_is_named(reading):
    model = nn.Linear(4, 4)
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        scores = model(torch.randn(2, 4))
        mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)  # row 1: nan
        probs.sum().backward()
    culprit = caught.value.report.first_nonfinite
    assert culprit.op == "aten._softmax.default" and culprit.flagged_rows[0].nan


@pytest.mark.parametrize("bad", [float("nan"), INF])
def test_non_finite_data_given_to_the_loss_is_not_blamed_on_the_loss_code(reading, bad):
    model = mlp()
    y = torch.tensor([[1.0], [bad], [0.0]])  # a target that is already non-finite
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        out = model(torch.randn(3, 4))
        scaled = y / y.abs().max()  # inf / inf is nan: new, but made from the data's inf
        loss = F.mse_loss(out, scaled)
        loss.backward()
    assert caught.value.report.cause == "loss-gradient"


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("guarded", ["the model", "its two parts", "G and D"])
def test_code_between_two_guarded_calls_that_feeds_the_second_nan_is_named_not_the_data(
        reading, mode, guarded):
    # A Lightning step calling the model's parts; a GAN's generator feeding its discriminator
    torch.manual_seed(0)
    first, second = nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 1)
    models = {"the model": nn.ModuleDict({"first": first, "second": second}),
              "its two parts": [first, second], "G and D": {"G": first, "D": second}}[guarded]
    with pytest.raises(NonFiniteError) as caught, Guard(models, mode=mode) as guard:
        for step in range(3):
            guard.begin_batch()
            hidden = first(torch.randn(3, 4))
            if step == 2:
                where = this_line_plus(1)
                hidden = hidden / (hidden - hidden)  # 0/0 in the loop, between the two calls
                hidden = hidden * 2  # (carried on)
            second(hidden).mean().backward()
    report = caught.value.report
    assert (report.cause, report.phase, report.batch_number) == (CAUSE_OUTSIDE, FORWARD, 2)
    assert report.first_nonfinite.op == "aten.div.Tensor"
    assert report.first_nonfinite.source == f"{where}: hidden = hidden / (hidden - hidden)  # 0/0 in the loop, between the two calls"


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_bad_data_after_a_discarded_log_of_0_is_still_the_data(reading, mode):
    # the loop's entropy keeps log(0) out of its value: a later nan in the data is the data's
    model = mlp()
    batches = [torch.randn(3, 4) for _ in range(2)]
    batches[1][1, 2] = float("nan")
    with pytest.raises(NonFiniteError) as caught, Guard(model, mode=mode):
        for x in batches:
            p = torch.softmax(torch.cat([model(x), torch.zeros(3, 1)], 1) * 0 - 1e4 * torch.eye(3, 2), 1)
            entropy = -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum()
            assert torch.isfinite(entropy)
    assert caught.value.report.cause == "data" and caught.value.report.batch_number == 1


def test_allow_inf_for_outside_lets_the_code_make_inf():
    model = mlp()
    with Guard(model, allow_inf=[OUTSIDE_MODULE]):
        out = model(torch.randn(3, 4))
        loss = torch.log(out * 0).mean()
    assert loss == -INF


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_healthy_training_loop_with_an_optimizer_does_not_raise_over_50_steps(reading, mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    banned = torch.full((3,), 0.0)
    banned[2] = float("-inf")  # class 2 is never a label: an additive mask
    with Guard(model, mode=mode):
        for _ in range(50):
            logits = model(x) + banned
            loss = F.cross_entropy(logits, y)
            loss += 1e-4 * sum(w.pow(2).sum() for w in model.parameters())
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    assert torch.isfinite(loss)


def test_an_optimizer_step_is_not_watched_its_weights_are_named_at_the_next_call():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=float("inf"), foreach=False)
    x = torch.randn(3, 4)
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x).pow(2).mean().backward()
        model(x)  # the code after this call is watched ...
        optimizer.step()  # ... but not the step, which writes inf into the weights
        model(x)
    assert caught.value.report.cause == "weights"


class _StackSeeingSGD(torch.optim.SGD):
    """An SGD that notes the torch function modes on the stack while it steps: any mode there
    turns off torch.optim's foreach paths."""

    stacks: list = []

    def step(self, closure=None):
        self.stacks.append(function_stack())
        return super().step(closure)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_watch_is_off_the_stack_while_an_optimizer_steps_and_after(mode):
    model = mlp()
    optimizer = _StackSeeingSGD(model.parameters(), lr=0.01)
    optimizer.stacks = []
    with Guard(model, mode=mode):
        for _ in range(3):
            optimizer.zero_grad()
            loss = model(torch.randn(3, 4)).pow(2).mean()
            assert function_stack() == [outside.MODE]  # the loss is watched
            loss.backward()
            optimizer.step()
            assert function_stack() == []  # zero_grad and the next batch's data run without it
    assert optimizer.stacks == [[], [], []]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_compiled_optimizer_step_is_not_compiled_again_and_again_under_the_guard(mode):
    # The guard's step hooks run inside the compiled step: traced, what they read of the guard
    # would change every step and recompile it.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = torch.compile(lambda: optimizer.step(), backend="eager")
    compiled_after = []
    try:
        with Guard(model, mode=mode) as guard:
            for _ in range(20):
                model(torch.randn(3, 4)).pow(2).mean().backward()
                step()
                optimizer.zero_grad()
                compiled_after.append(counters["frames"]["total"])
                assert function_stack() == []  # the hooks ran: the watch left the stack
    finally:
        torch._dynamo.reset()
    assert compiled_after[2] == compiled_after[-1]
    assert guard.steps._steps[-1][STEP_NUMBER] == 20  # every step seen, Adam's own count


def test_a_value_still_to_be_read_is_raised_at_the_next_optimizer_step(monkeypatch):
    monkeypatch.setattr(outside_checks, "IMMEDIATE_DEVICES", frozenset())  # read once per region
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    after_step = []
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        out = model(torch.randn(3, 4))
        torch.log(out * 0)
        optimizer.step()  # no backward came: the step ends what was watched
        after_step.append(True)
    assert caught.value.report.first_nonfinite.op == "aten.log.default" and not after_step
    assert function_stack() == []


# ---- nothing left behind, nothing changed ------------------------------------------------------
class _Interrupt(BaseException):
    pass


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("ending", [None, NonFiniteError, ValueError, KeyboardInterrupt])
def test_nothing_is_left_behind_on_any_exit(ending, mode):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = promises.hooks_left(model, optimizers=[optimizer])
    stack_before = function_stack()
    with pytest.raises(ending) if ending else _no_error():
        with Guard(model, mode=mode):
            out = model(torch.randn(3, 4))
            assert function_stack()[-1] is outside.MODE  # watching the code after the call
            loss = out.pow(2).sum()
            if ending is NonFiniteError:
                loss = loss + torch.log(out * 0).sum()  # -inf: the loss holds it
            elif ending is not None:
                raise ending("stop")
            loss.backward()
            optimizer.step()
    assert promises.hooks_left(model, optimizers=[optimizer]) == before
    assert function_stack() == stack_before == []
    assert not outside.outside_mode_active()


class _no_error:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_outputs_loss_and_gradients_are_bit_identical_with_and_without_the_guard():
    def run(guarded):
        def step():
            model = mlp()
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            context = Guard(model) if guarded else _no_error()
            with context:
                out = model(x)
                loss = (torch.log1p((out - y).pow(2)) / 3).mean() + F.smooth_l1_loss(out, y)
                loss.backward()
            return out, loss, [p.grad for p in model.parameters()]
        return promises.same_run(step)

    assert promises.bit_identical(run(True), run(False))


def test_memory_stays_flat_over_2000_steps(reading):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    traced, handles = {}, {}
    tracemalloc.start()
    try:
        with Guard(model) as guard:
            for step in range(1, 2001):
                loss = torch.sqrt((model(x) - y).pow(2).mean() + 1e-6)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if step in (1000, 2000):
                    gc.collect()
                    traced[step] = tracemalloc.get_traced_memory()[0]
                    handles[step] = len(guard.outside.node_handles)
    finally:
        tracemalloc.stop()
    assert traced[2000] - traced[1000] < 32 * 1024, traced
    assert max(handles.values()) <= 128, handles


# ---- threads, modes, module internals ----------------------------------------------------------
def test_each_thread_has_its_own_watch_and_gets_its_own_error():
    model = mlp()
    results = {}

    def worker(name, value):
        try:
            for _ in range(20):
                out = model(torch.randn(3, 4))
                torch.log(out * 0 + value).mean()
            results[name] = ("ok", outside.outside_mode_active())
        except NonFiniteError as error:
            results[name] = ("error", error.report.first_nonfinite.op)

    with Guard(model):
        out = model(torch.randn(3, 4))  # this thread's loss code is watched from here ...
        threads = [threading.Thread(target=worker, args=("good", 1.0)),
                   threading.Thread(target=worker, args=("bad", 0.0))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        last = threading.Thread(target=lambda: model(torch.randn(3, 4)).sum().backward())
        last.start()  # its backward ends the code watched in that thread only
        last.join()
        with pytest.raises(NonFiniteError):  # ... whatever the other threads did meanwhile
            torch.log(out * 0).sum().backward()
    assert results["good"] == ("ok", True)
    assert results["bad"] == ("error", "aten.log.default")
    assert function_stack() == []


@pytest.mark.parametrize("left_at", ["loss code", "after backward"])
def test_a_thread_left_in_its_loss_code_drops_the_mode_once_another_thread_detaches(left_at):
    # A thread that called the model and went on with its own work (evaluation, a logger) and
    # never reached an optimizer step: after a detach in another thread, its torch functions
    # must neither be checked nor go on through the mode (several times slower).
    model = mlp()
    guard = Guard(model).attach()
    called, detached, seen = threading.Event(), threading.Event(), {}

    def worker():
        out = model(torch.randn(3, 4))
        if left_at == "after backward":
            out.sum().backward()  # the mode stays on the stack until the region ends
        seen["before"] = function_stack()
        called.set()
        detached.wait(30)
        torch.log(out.detach() * 0)  # would be a detection if still checked
        seen["after"] = function_stack()

    thread = threading.Thread(target=worker)
    thread.start()
    called.wait(30)
    guard.detach()
    detached.set()
    thread.join(30)
    assert seen["before"] and seen["after"] == [], seen
    assert function_stack() == []


class _Counting(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_function_mode_of_the_users_keeps_its_place_on_the_stack():
    model = mlp()
    with Guard(model):
        with _Counting() as mine:
            out = model(torch.randn(3, 4))  # the watch is not pushed above the user's mode
            assert function_stack() == [mine]
            torch.log(out * 0)  # not watched: no error
        assert function_stack() == []
        out = model(torch.randn(3, 4))
        with _Counting() as mine:  # entered above the watch: both work
            assert function_stack() == [outside.MODE, mine]
            with pytest.raises(NonFiniteError):
                torch.log(out * 0).sum().backward()
        assert mine.calls > 0 and function_stack() == [outside.MODE]
    assert function_stack() == []


class _Probe(nn.Module):
    """Notes, inside its forward, whether the functions it calls are checked."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.seen: list = []

    def forward(self, x):
        self.seen.append(outside.outside_checking())
        return self.lin(x)


def test_module_internals_and_the_code_after_a_backward_are_not_checked():
    model, unguarded = _Probe(), _Probe()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Guard(model):
        for _ in range(3):
            reference = model(torch.randn(2, 4)).detach()  # the code after it is checked ...
            loss = (model(torch.randn(2, 4)) - reference).pow(2).mean()  # ... not its internals
            assert outside.outside_checking()
            loss.backward()
            unguarded(torch.randn(2, 4))  # a model not guarded, after the backward
            optimizer.step()
            assert not outside.outside_checking()
    assert model.seen == [False] * 6 and unguarded.seen == [False] * 3
    assert not outside.outside_mode_active()


def test_a_compiled_loss_function_is_traced_into_one_unchanged_graph_under_the_watch():
    import torch._dynamo

    model = mlp()
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module.code)
        return graph_module.forward

    @torch.compile(backend=backend)
    def loss_fn(out):
        return torch.log1p(out.pow(2)).mean()

    torch._dynamo.reset()
    with Guard(model):
        loss = loss_fn(model(torch.randn(3, 4)))
        loss.backward()
    assert torch.isfinite(loss)
    (code,) = graphs  # no graph break
    assert "log1p" in code and "mean" in code and "outside" not in code


def test_at_detach_a_value_still_to_be_read_is_raised_on_a_clean_exit(monkeypatch):
    monkeypatch.setattr(outside_checks, "IMMEDIATE_DEVICES", frozenset())
    model = mlp()
    with pytest.raises(NonFiniteError) as caught, Guard(model) as guard:
        torch.log(model(torch.randn(3, 4)) * 0).mean()  # read at the end only
    assert caught.value.report is guard.detection
    assert caught.value.report.first_nonfinite.op == "aten.log.default"
    assert function_stack() == []


# ---- the notebook --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_numguard_cell_names_a_log_of_the_models_output_by_its_cell(shell, mode):
    from IPython.utils.capture import capture_output

    shell.run_cell("import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
                   "model = nn.Sequential(nn.Linear(4, 2), nn.ReLU())\nx = -torch.ones(3, 4)")
    with capture_output():
        flag = " --sentinel" if mode == "sentinel" else ""
        result = shell.run_cell(f"%%numguard{flag} model\nout = model(x)\n"
                                "loss = torch.log(model(x)).mean()\nloss.backward()")
    error = result.error_in_exec
    assert isinstance(error, NonFiniteError)
    culprit = error.report.first_nonfinite
    assert re.fullmatch(r"Cell In\[\d+\], line 3: loss = torch.log\(model\(x\)\).mean\(\)",
                        culprit.source), culprit.source
    assert culprit.op == "aten.log.default" and error.report.cause == CAUSE_OUTSIDE
    assert function_stack() == []


# ---- values the code discards are notes, not errors ---------------------------------------------
def _kl_steps(model, targets, steps=3, contained=True):
    """KL(targets || model) as training loops write it: log(0) = -inf where a target is 0, kept
    out of the loss by `where` (contained) or not (0 * -inf = nan)."""
    for _ in range(steps):
        logp = torch.log_softmax(model(torch.randn(4, 4)), -1)
        terms = targets * (torch.log(targets) - logp)  # line of the log
        loss = (torch.where(targets > 0, terms, 0) if contained else terms).sum(-1).mean()
        loss.backward()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_non_finite_value_the_code_discards_before_the_loss_is_a_note_not_an_error(mode, place):
    torch.manual_seed(0)
    model = mlp()
    targets = torch.tensor([[0.0, 0.5, 0.25, 0.25]] * 4)
    with Guard(model, mode=mode) as guard:
        _kl_steps(model, targets)
    assert guard.detection is None
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    summary = guard.report.summary()
    assert "code outside the guarded modules made -inf in torch.log (aten.log.default)" in summary
    assert "terms = targets * (torch.log(targets) - logp)" in summary and "not an error" in summary
    with pytest.raises(NonFiniteError) as caught, Guard(model, mode=mode):
        _kl_steps(model, targets, contained=False)
    culprit = caught.value.report.first_nonfinite
    assert (culprit.module_name, culprit.op) == ("<outside>", "aten.log.default")
    assert culprit.source.endswith("terms = targets * (torch.log(targets) - logp)  # line of the log")


class MaskedPolicy(nn.Module):
    """An RL policy: the logits of illegal actions are -inf (Categorical handles them)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(6, 5)

    def forward(self, obs, legal):
        return self.net(obs).masked_fill(~legal, float("-inf"))


def observations_and_legal_actions():
    """8 observations and which of MaskedPolicy's 5 actions are legal (action 0 always)."""
    obs, legal = torch.randn(8, 6), torch.rand(8, 5) > 0.3
    legal[:, 0] = True
    return obs, legal


@pytest.fixture(params=["host", "a GPU's way"])
def place(request, monkeypatch):
    """Values read at once (CPU), or as on a GPU: the model's rows and flags, and the loss code's
    regions, read later."""
    if request.param != "host":
        request.getfixturevalue("deferred_on_host")[0] = False  # (ready when looked at)
        monkeypatch.setattr(outside_checks, "IMMEDIATE_DEVICES", frozenset())
    return request.param


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_minus_inf_logits_at_the_models_output_are_judged_by_the_loss(mode, place):
    from torch.distributions import Categorical

    torch.manual_seed(0)
    policy = MaskedPolicy()
    obs, legal = observations_and_legal_actions()
    optimizer = torch.optim.Adam(policy.parameters(), 1e-3)
    with Guard(policy, mode=mode) as guard:
        for _ in range(3):
            dist = Categorical(logits=policy(obs, legal))
            loss = -(dist.log_prob(dist.sample()) * torch.randn(8)).mean() - 0.01 * dist.entropy().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert guard.detection is None
    assert "MaskedPolicy gave the model's output -inf (a mask), and the loss stayed finite" in guard.report.summary()
    with pytest.raises(NonFiniteError) as caught, Guard(policy, mode=mode):
        torch.softmax(policy(obs, legal), -1).log().mean().backward()  # log(0): the loss is -inf
    # the mask's zeros made -inf in the log: the loss code's own producer is named, not the mask
    assert caught.value.report.first_nonfinite.module_class == "Tensor.log"
    with pytest.raises(NonFiniteError) as caught, Guard(policy, mode=mode):
        policy(obs, legal).sum().backward()  # the mask itself in the loss
    assert caught.value.report.first_nonfinite.module_class == "MaskedPolicy"
    with pytest.raises(NonFiniteError) as caught, Guard(policy, mode=mode):
        # label smoothing sums every class's log-probability: the mask's -inf, negated (+inf)
        nn.functional.cross_entropy(policy(obs, legal), torch.zeros(8, dtype=torch.long),
                                    label_smoothing=0.1).backward()
    report = caught.value.report
    assert report.first_nonfinite.module_class == "MaskedPolicy", report.reason
    assert "label_smoothing" in report.hint and "allow_inf" not in report.hint
    with pytest.raises(NonFiniteError) as caught, Guard(policy, mode=mode):
        # a target on a masked class: the negative log-likelihood negates the mask's -inf
        nn.functional.cross_entropy(policy(obs, legal), (~legal).float().argmax(-1)).backward()
    assert caught.value.report.first_nonfinite.module_class == "MaskedPolicy"
    with pytest.raises(NonFiniteError) as caught, Guard(policy, mode=mode):
        # the loss code's own overflow beside the mask: exp's inf is exp's, not the mask's
        torch.exp(policy(obs, legal) / 1e-3).mean().backward()
    assert caught.value.report.first_nonfinite.op == "aten.exp.default"


# ---- held culprits across the loops people write ---------------------------------------------------
def _masked_steps(models, steps=2):
    """Two model calls feed one loss (an actor's two time steps, or an actor and a critic)."""
    from torch.distributions import Categorical

    policy, value = models
    torch.manual_seed(1)
    obs, legal = observations_and_legal_actions()
    for _ in range(steps):
        first = Categorical(logits=policy(obs, legal))
        second = Categorical(logits=policy(obs + 0.1, legal))
        v = value(obs).squeeze(-1)
        loss = -(first.entropy() + second.entropy()).mean() + v.pow(2).mean()
        loss.backward()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("guards", ["one", "two"])
def test_a_mask_held_through_several_model_calls_is_judged_by_their_one_loss(mode, guards):
    policy, value = MaskedPolicy(), nn.Linear(6, 1)
    if guards == "one":
        with Guard([policy, value], mode=mode) as guard:
            _masked_steps((policy, value))
        assert guard.detection is None
    else:
        with Guard(policy, mode=mode) as first, Guard(value, mode=mode) as second:
            _masked_steps((policy, value))
        assert first.detection is None and second.detection is None


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_discarded_log_of_0_in_a_loss_summed_over_two_calls_is_a_note(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())
    x, valid = torch.randn(8, 4), torch.rand(8, 4) > 0.5
    with Guard(model, mode=mode) as guard:
        total = 0
        for _ in range(2):
            p = model(x)
            total = total + (torch.where(valid, torch.log(p.detach() * valid), 0.0) * p).sum()
        total.backward()
        model(x).sum()
        grads = torch.autograd.grad(  # judged at torch.autograd.grad as at .backward()
            (torch.where(valid, torch.log(model(x).detach() * valid), 0.0) * model(x)).sum(),
            list(model.parameters()))
    assert guard.detection is None and all(torch.isfinite(g).all() for g in grads)
    assert "discarded before the loss (finite): not an error" in guard.report.summary()


def test_a_guard_dropped_while_a_mask_is_held_frees_its_model_and_leaves_nothing_held():
    policy = MaskedPolicy()
    held = weakref.ref(policy)
    guard = Guard(policy).attach()
    obs, legal = observations_and_legal_actions()
    with torch.no_grad():
        policy(obs, legal)  # acting: the mask is held, no backward comes
    del policy, guard
    gc.collect()
    assert held() is None and function_stack() == []
    model = nn.Linear(3, 3)
    with Guard(model) as other:  # another guard does not inherit it
        model(torch.randn(2, 3)).sum().backward()
    assert other.detection is None


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_on_detect_detaching_under_a_profiler_leaves_no_mode_and_the_profiler_in_place(mode):
    import sys

    seen = []

    def profiler(frame, event, arg):
        seen.append(event)

    model = mlp()
    guard = Guard(model, mode=mode, on_detect=lambda report: guard.detach())
    guard.attach()
    sys.setprofile(profiler)
    try:
        with pytest.raises(NonFiniteError):
            torch.log(model(torch.randn(3, 4)) * 0).mean().backward()
        stack, profile = function_stack(), sys.getprofile()
    finally:
        sys.setprofile(None)
    assert stack == [] and profile is profiler and seen


def _act(policy, obs, illegal, keep_log: bool):
    """An acting step under no_grad: the illegal action's log-probability, log(0), is dropped by
    a `where` (an entropy), or (`keep_log`) kept in a sum."""
    p = torch.softmax(policy(obs).masked_fill(illegal, float("-inf")), -1)
    logp = torch.log(p)
    if keep_log:
        return logp.sum(-1)
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_with_no_backward_a_value_the_code_drops_is_a_note_and_one_it_keeps_an_error(mode):
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    illegal = torch.tensor([False, True, False, False])
    with Guard(policy, mode=mode) as guard, torch.no_grad():
        for _ in range(3):
            assert torch.isfinite(_act(policy, torch.randn(2, 8), illegal, False)).all()
    assert guard.detection is None
    assert "discarded before the loss (finite): not an error" in guard.report.summary()
    with pytest.raises(NonFiniteError, match=r"in torch\.log \(aten\.log\.default\)"):
        with Guard(policy, mode=mode), torch.no_grad():
            _act(policy, torch.randn(2, 8), illegal, True)
    with pytest.raises(NonFiniteError, match=r"in torch\.log \(aten\.log\.default\)"):
        with Guard(policy, mode=mode), torch.no_grad():  # zeros_like reads its shape: no drop
            kept = _act(policy, torch.randn(2, 8), illegal, True)
            torch.zeros_like(kept)
    with pytest.raises(NonFiniteError, match=r"in torch\.log \(aten\.log\.default\)"):
        with Guard(policy, mode=mode), torch.no_grad():  # dropped in one place, kept in another
            p = torch.softmax(policy(torch.randn(2, 8)).masked_fill(illegal, float("-inf")), -1)
            logp = torch.log(p)
            entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
            torch.cat([entropy[:, None], logp], 1)


class MaskedCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x).masked_fill(torch.tensor([False, False, True]), float("-inf"))


@pytest.mark.parametrize("mode", ["full", "sentinel", "sentinel-gpu-path"])
def test_a_gradient_penalty_before_the_loss_leaves_the_mask_to_the_loss(mode, request):
    # WGAN-GP: autograd.grad of the unmasked scores (finite) first, then a loss the mask reaches
    if mode == "sentinel-gpu-path":  # (its checks read later, as on a GPU)
        request.getfixturevalue("deferred_on_host")[0] = False
        mode = "sentinel"
    torch.manual_seed(0)
    critic = MaskedCritic()
    x = torch.randn(5, 4, requires_grad=True)
    with pytest.raises(NonFiniteError, match=r"^MaskedCritic produced .* the -inf reaches") as caught:
        with Guard(critic, mode=mode):
            out = critic(x)
            grad, = torch.autograd.grad(out[:, :2].sum(), x, create_graph=True)
            real = critic(torch.randn(5, 4))[:, :2]  # the critic again, between penalty and loss
            (out.mean() + real.mean() + (grad.norm(dim=1) - 1).pow(2).mean()).backward()
    assert caught.value.report.batch_number == 0  # the call whose mask reached it, not the later one
    with Guard(critic, mode=mode) as guard:  # a loss that leaves the masked scores out
        out = critic(x)
        grad, = torch.autograd.grad(out[:, :2].sum(), x, create_graph=True)
        (out[:, :2].mean() + (grad.norm(dim=1) - 1).pow(2).mean()).backward()
    assert guard.detection is None


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_loop_of_autograd_grad_updates_names_the_step_whose_loss_broke(mode):
    # no .backward() ever: each step's finite gradients judge what that step held, and a later
    # step's -inf loss is named at its own batch, not at the first step's
    torch.manual_seed(0)
    policy = MaskedPolicy()
    obs, legal = observations_and_legal_actions()
    params = list(policy.parameters())
    with pytest.raises(NonFiniteError) as caught, Guard(policy, mode=mode):
        for step in range(5):
            target = (~legal).float().argmax(-1) if step == 3 else torch.zeros(8, dtype=torch.long)
            loss = nn.functional.cross_entropy(policy(obs, legal), target)
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p -= 0.01 * g
    assert caught.value.report.batch_number == 3, caught.value.report.reason


def _loss_code_warnings(mode, guarded: bool) -> list:
    """(file, line, words) of each torch warning shown while a loop's loss code runs, under the
    "default" action (once per line), with or without the guard."""
    import contextlib
    import warnings

    model = mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        with Guard(model, mode=mode) if guarded else contextlib.nullcontext():
            for _ in range(3):
                out = model(torch.randn(8, 4))
                loss = F.mse_loss(out, torch.randn(8))  # a target of another size: torch warns
                other = F.mse_loss(out, torch.randn(8))  # the same warning, from another line
                _ = out.grad  # a non-leaf's .grad: a warning from torch's C++
                (loss + other).backward()
    return [(w.filename, w.lineno, str(w.message)[:30]) for w in caught
            if not str(w.message).startswith("numguard")]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_torch_warnings_in_the_loss_code_name_the_users_line_as_without_the_guard(mode):
    # The watch calls each torch function for the user: a warning raised inside then named the
    # watch's own line (guard/outside.py) and, shown once per that line, hid the second line's.
    unguarded = _loss_code_warnings(mode, guarded=False)
    assert len(unguarded) == 3 and {file for file, *_ in unguarded} == {__file__}, unguarded
    assert _loss_code_warnings(mode, guarded=True) == unguarded


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_evaluation_loss_made_nan_is_named_though_a_healthy_training_step_follows(mode, reading):
    # Made under no_grad, the evaluation's nan is in no graph: the next training step's finite
    # loss judged it harmless ("discarded") and the nan eval loss went by (a Trainer's eval_loss).
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, Guard(model, mode=mode):
        with torch.no_grad():
            eval_loss = -torch.log(model(torch.randn(4, 4)).sigmoid() - 2).mean()  # kept: nan
        model(torch.randn(4, 4)).pow(2).mean().backward()
        optimizer.step()
    report = caught.value.report
    assert report.first_nonfinite.module_name == OUTSIDE_MODULE
    assert report.first_nonfinite.op == "aten.log.default" and eval_loss.isnan()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_evaluation_value_the_code_drops_is_a_note_though_a_training_step_follows(mode, reading):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with Guard(model, mode=mode) as guard:
        with torch.no_grad():
            p = model(torch.randn(4, 4)).sigmoid()
            entropy = torch.where(p > 0.5, p * torch.log(p - 0.5), torch.zeros_like(p)).sum()
        model(torch.randn(4, 4)).pow(2).mean().backward()
        optimizer.step()
    assert guard.detection is None and entropy.isfinite()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_target_made_under_no_grad_and_masked_by_the_loss_after_a_model_call_is_a_note(mode, reading):
    # Mean teacher / self-distillation: log(0) in a no_grad target, masked by `where` in the loss
    # after the student's call. (Made in no graph, it was judged at that call, before the mask.)
    model = mlp()
    with Guard(model, mode=mode) as guard:
        with torch.no_grad():
            p = torch.cat([model(torch.randn(4, 4)).sigmoid(), torch.zeros(4, 1)], dim=1)
            log_p = torch.log(p)  # -inf where p == 0
        q = torch.cat([model(torch.randn(4, 4)).sigmoid(), torch.full((4, 1), 0.5)], dim=1)
        kl = torch.where(p > 0, p * (log_p - torch.log(q)), torch.zeros_like(p)).sum()
        kl.backward()
    assert guard.detection is None and kl.isfinite()


def test_the_watch_lets_go_of_the_code_it_called_from_when_it_detaches():
    # Each caller standing at a user's line holds that code's globals (a namespace run by exec).
    model = mlp()
    namespace = {"torch": torch, "model": model, "big": torch.zeros(1000)}
    freed = []
    weakref.finalize(namespace["big"], freed.append, True)
    with Guard(model):
        exec("loss = model(torch.randn(2, 4)).sum() + big.sum()\nloss.backward()", namespace)
    del namespace
    gc.collect()
    assert freed == [True]


def test_under_a_sentinel_on_a_gpu_the_loss_codes_rows_are_reused_from_step_to_step(
        deferred_on_host, monkeypatch):
    # Read later, a region's rows (and its nodes' in backward) were never given back when they
    # were fine: each step made new blocks of rows and their views (+5 ms a step on an H200).
    from numguard_nb import row_sink

    monkeypatch.setattr(outside_checks, "IMMEDIATE_DEVICES", frozenset())  # (as a GPU's values)
    made = []
    real_init = row_sink._Block.__init__
    monkeypatch.setattr(row_sink._Block, "__init__",
                        lambda self, *args: made.append(1) or real_init(self, *args))
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    deferred_on_host[0] = False  # the device has finished: checks are read at the next step
    with Guard(model, mode="sentinel") as guard:
        for step in range(12):
            model(torch.randn(4, 4)).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 3:
                made_early = len(made)
    assert guard.detection is None
    assert len(made) == made_early, "new blocks of rows every step"


@pytest.fixture
def sentinel_on_a_gpu(deferred_on_host, monkeypatch):
    """The sentinel's GPU path on the host: regions read later, checks read a step later."""
    monkeypatch.setattr(outside_checks, "IMMEDIATE_DEVICES", frozenset())
    deferred_on_host[0] = False


def test_on_a_gpu_a_no_grad_target_masked_by_the_loss_after_a_model_call_is_no_error(sentinel_on_a_gpu):
    # Read later, the target's region ended at the student's call with no loss: its log(0) was
    # raised a step later (on a healthy distillation loop).
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with Guard(model, mode="sentinel") as guard:
        for _ in range(4):
            with torch.no_grad():
                p = torch.cat([model(torch.randn(4, 4)).sigmoid(), torch.zeros(4, 1)], dim=1)
                log_p = torch.log(p)  # -inf where p == 0
            q = torch.cat([model(torch.randn(4, 4)).sigmoid(), torch.full((4, 1), 0.5)], dim=1)
            torch.where(p > 0, p * (log_p - torch.log(q)), torch.zeros_like(p)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert guard.detection is None


def test_on_a_gpu_an_evaluation_loss_made_nan_is_named_though_training_follows(sentinel_on_a_gpu):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, Guard(model, mode="sentinel"):
        for step in range(4):
            if step == 1:
                with torch.no_grad():
                    losses = [-torch.log(model(torch.randn(4, 4)).sigmoid() - 2).mean()]  # kept
            model(torch.randn(4, 4)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert caught.value.report.first_nonfinite.op == "aten.log.default" and losses[0].isnan()

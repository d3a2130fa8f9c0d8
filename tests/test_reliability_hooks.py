"""The guard's promises, tried the way training code really uses models.

The guard promises to change nothing it watches, to leave no hook behind on any exit path, to
keep nothing alive and never to crash the user's code. Each family below tries one way of
breaking that (copies, long loops, threads, saving and swapping, lazy and scripted parts,
compiling, tracing and exporting, re-entry and Ctrl-C, odd outputs, every exit path), and every
test checks the promises with `promises.py`: the hooks left anywhere are those there before, the
results are bit-identical to a run without the guard, nothing is detected where nothing is
wrong, and what is detected is reported in one line.

Small models are defined here (CPU only, no download).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import io
import pickle
import re
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from numguard_nb import BatchLimitReached, Guard, NonFiniteError
from promises import bit_identical, hooks_left, memory_growth, model_state, same_run
from models import LogNet, NanGradient

NAN = float("nan")


# ---- models -----------------------------------------------------------------------------------
def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


def exp_net() -> nn.Sequential:
    """Overflows to inf in module "1" for inputs around 100."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Exp(), nn.Linear(4, 2))


class SqrtWeight(nn.Module):
    """x * sqrt(w): with w = 0 the output and the input gradient are finite, the weight's
    gradient is inf: only the weight's own gradient hook can see it."""

    def __init__(self, zero: bool = True):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4) if zero else torch.ones(4))

    def forward(self, x):
        return x * torch.sqrt(self.w)


def sqrt_weight_net(zero: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(SqrtWeight(zero), nn.Linear(4, 1))


def x4(rows: int = 3) -> torch.Tensor:
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(1))


@contextlib.contextmanager
def promises_kept(*modules, optimizers=(), tensors=()):
    """After the block (however it ends), every hook is one that was there before it."""
    before = hooks_left(*modules, optimizers=optimizers, tensors=tensors)
    try:
        yield
    finally:
        assert hooks_left(*modules, optimizers=optimizers, tensors=tensors) == before


def leads_with_the_culprit(error: BaseException) -> bool:
    """The message starts with the one-line verdict (then the op, the line and the hint)."""
    return str(error).splitlines()[0] == error.report.summary()


def culprit(error: NonFiniteError):
    frame = error.report.first_nonfinite
    return frame.module_name, frame.module_class, frame.phase


def train_step(model, x):
    out = model(x)
    out.pow(2).mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


# ---- 1. copies made inside the guard come out unwatched -------------------------------------
def _torch_save_round_trip(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


DEEP_COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": _torch_save_round_trip,
    "AveragedModel": torch.optim.swa_utils.AveragedModel,
    "deepcopy of an unguarded wrapper": lambda m: copy.deepcopy(nn.Sequential(m))[0],
}


@pytest.mark.parametrize("how", DEEP_COPIES)
def test_a_copy_made_inside_the_guard_comes_out_unwatched(how):
    make_copy = DEEP_COPIES[how]
    model, twin = exp_net(), exp_net()
    x = x4()
    with promises_kept(model):
        with Guard(model):
            train_step(model, x)
            clone = make_copy(model)
            assert hooks_left(clone) == hooks_left()  # the copy carries no hooks of its own
            clone(x * 1000)  # overflows, but the copy is not watched: nothing raised
            with pytest.raises(NonFiniteError) as caught:
                model(x * 1000)  # the original still is
            assert culprit(caught.value)[0] == "1" and leads_with_the_culprit(caught.value)
    assert hooks_left(clone) == []
    train_step(twin, x)
    reference = make_copy(twin)  # the same copy, made without a guard
    assert sorted(vars(clone)) == sorted(vars(reference))  # nothing of the guard carried over
    assert bit_identical(same_run(lambda: clone(x)), same_run(lambda: reference(x)))
    assert bit_identical(model_state(clone), model_state(reference))


def test_a_shallow_copy_holds_none_of_the_guards_hooks_itself():
    # copy.copy shares the submodules (which stay watched while the guard is on) but not the
    # copy's own hook dicts.
    model, twin = net(), net()
    with promises_kept(model), Guard(model):
        clone = copy.copy(model)
        own = [d for d in ("_forward_pre_hooks", "_forward_hooks") if getattr(clone, d)]
        assert own == []
        assert "__reduce_ex__" not in vars(clone)
    assert hooks_left(clone) == []
    assert sorted(vars(clone)) == sorted(vars(copy.copy(twin)))


def test_an_ema_model_and_a_target_network_copied_in_the_loop_stay_unwatched():
    model = exp_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = x4()
    with promises_kept(model, optimizers=[optimizer]), Guard(model):
        target = copy.deepcopy(model)  # DQN: a frozen copy, refreshed now and then
        ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        for step in range(6):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
            ema.update_parameters(model)
            if step % 3 == 0:
                target.load_state_dict(model.state_dict())
            with torch.no_grad():
                target(x * 1000)  # overflows in the copies: none of the guard's business
                ema(x * 1000)
    assert hooks_left(target) == hooks_left(ema) == []


class UserHooks:
    """A user's own hooks, to be copied as without the guard."""

    def __init__(self):
        self.calls = 0

    def before(self, module, args):
        self.calls += 1

    def after(self, module, args, output):
        self.calls += 1


def test_a_copy_keeps_the_users_own_hooks_in_their_order():
    model, twin = net(), net()
    for m in (model, twin):
        user = UserHooks()
        m[0].register_forward_pre_hook(user.before)
        m[0].register_forward_hook(user.after)
    with Guard(model):
        late = UserHooks()
        model[0].register_forward_hook(late.after)  # a hook added while the guard is on
        clone = copy.deepcopy(model)
    twin[0].register_forward_hook(UserHooks().after)
    reference = copy.deepcopy(twin)

    def hooks_of(module):
        return [(name, hook.__qualname__) for name in ("_forward_pre_hooks", "_forward_hooks")
                for hook in getattr(module[0], name).values()]

    assert hooks_of(clone) == hooks_of(reference) == [
        ("_forward_pre_hooks", "UserHooks.before"), ("_forward_hooks", "UserHooks.after"),
        ("_forward_hooks", "UserHooks.after")]
    assert len(hooks_left(clone)) == 3
    assert hooks_of(model) == hooks_of(twin) and len(hooks_left(model)) == len(hooks_left(twin))


def test_a_parametrized_module_copied_inside_the_guard_comes_out_unwatched():
    # Parametrized modules bring a __deepcopy__ of their own class.
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.orthogonal(nn.Linear(4, 4)), Exp())
    x = x4()
    with promises_kept(model), Guard(model):
        model(x).sum().backward()
        clone = copy.deepcopy(model)
        assert hooks_left(clone) == hooks_left()  # the copy carries no hooks of its own
        clone(x * 1000)
    assert "__deepcopy__" not in vars(model[0]) and "__deepcopy__" not in vars(clone[0])
    assert bit_identical(clone(x), model(x))


# ---- 4. long loops keep memory flat --------------------------------------------------------
def test_a_fresh_input_with_requires_grad_every_step_keeps_memory_flat():
    # Input-gradient penalties, physics-informed nets: every step a new leaf to hook.
    torch.manual_seed(0)
    model = nn.Linear(2, 1)

    def step():
        x = torch.randn(2, 2, requires_grad=True)
        (grad,) = torch.autograd.grad(model(x).sum(), x)
        assert torch.isfinite(grad).all()

    # What is pruned once it doubles comes and goes by some 60 KB: 20,000 steps and 128 KB still
    # catch 7 bytes a step.
    with promises_kept(model), Guard(model) as guard:
        grown = memory_growth(step, 20_000)
        assert len(guard._grad_hooks.leaf_targets) < 100
    assert grown < 128 * 1024, f"{grown} bytes more after 20000 steps"


def test_a_second_model_called_alone_with_fresh_leaves_keeps_memory_flat():
    # Only the first model's calls start batches: the second one's calls never do.
    torch.manual_seed(0)
    first, second = nn.Linear(2, 1), nn.Linear(2, 1)

    def step():
        x = torch.randn(2, 2, requires_grad=True)
        second(x).sum().backward()

    with promises_kept(second), Guard([first, second]):
        grown = memory_growth(step, 20_000)
    assert grown < 128 * 1024, f"{grown} bytes more after 20000 steps"  # (see the test above)


def _garbage_cycles_of(step, steps: int = 3) -> collections.Counter:
    """The project's objects that `steps` calls of `step` left for the garbage collector: in
    reference cycles, which reference counting never frees."""
    enabled, flags = gc.isenabled(), gc.get_debug()
    gc.collect()
    gc.disable()
    try:
        for _ in range(steps):
            step()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        return collections.Counter(type(o).__qualname__ for o in gc.garbage
                                   if type(o).__module__.startswith("numguard_nb"))
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        if enabled:
            gc.enable()


@pytest.mark.parametrize("options", [{}, {"ops": True}, {"sync": True}, {"mode": "sentinel"},
                                     {"mode": "sentinel", "history_every": 2}], ids=str)
def test_a_step_leaves_no_reference_cycle_for_the_garbage_collector(options):
    """What a step records is freed when it is done with. Left in cycles, a few thousand objects
    a step piled up for the collector, whose full collections then paused a training loop for
    0.15-0.2 s every 50 steps (with transformers loaded): 4 ms a step of a 17 ms step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        loss = model(torch.randn(16, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    with promises_kept(model), Guard(model, **options):
        step()
        assert _garbage_cycles_of(step) == collections.Counter()


class ScaledSqrt(nn.Module):
    """sqrt(|x| * scale), `scale` a parameter of the model around it, fed in as an input: the
    gradient for `scale` is nan where x is 0."""

    def forward(self, x, scale):
        return torch.sqrt(x.abs() * scale)


class FedScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = ScaledSqrt()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.block(x, self.scale)


def test_a_parameter_fed_to_a_submodule_in_two_threads_gives_each_thread_its_gradient():
    model = FedScale()
    b_ran_forward, a_is_done = threading.Event(), threading.Event()
    outcome = {}

    def thread_a():  # forward and backward between B's forward and B's backward: all finite
        b_ran_forward.wait(10)
        model(x4() + 3).sum().backward()
        a_is_done.set()

    def thread_b():
        out = model(torch.zeros(3, 4))
        outcome["batch"] = model_guard.report.frames[-1].batch_number
        b_ran_forward.set()
        a_is_done.wait(10)
        try:
            out.sum().backward()
        except NonFiniteError as error:
            outcome["error"] = error

    with promises_kept(model), Guard(model) as model_guard:
        threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    report = outcome["error"].report
    assert report.first_nonfinite.batch_number == outcome["batch"]
    block = [f for f in report.frames if f.phase == "backward" and f.module_name == "block"
             and f.batch_number == outcome["batch"]]  # (the frames before it are A's, finite)
    assert len(block) == 1 and [row.role for row in block[0].rows if row.nonfinite] == ["grad_input[1]"]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_guards_dropped_while_attached_go_with_their_models_and_global_hooks(mode):
    # A notebook cell re-run: a new model and a new guard each time, never detached.
    gc.collect()
    before = hooks_left()
    models = []
    for _ in range(4):
        model = nn.Linear(4, 4)
        models.append(weakref.ref(model))
        guard = Guard(model, mode=mode).attach()
        model(torch.randn(2, 4)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    del model, guard
    model = nn.Linear(4, 4)  # a guarded call of something else: the loss watch moves on
    with Guard(model, mode=mode):
        model(torch.randn(2, 4))
    gc.collect()
    assert [ref() for ref in models] == [None] * 4
    assert hooks_left() == before


@pytest.mark.parametrize("options", [{}, {"capture": True, "ops": True}, {"mode": "sentinel"}],
                         ids=["full", "capture-ops", "sentinel"])
def test_a_guard_dropped_right_after_a_step_frees_its_model_at_once(options):
    # A notebook cell re-run with nothing guarded after it: the model must not wait for a later
    # guarded call to be freed (in a notebook, its GPU memory with it).
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    held = weakref.ref(model)
    guard = Guard(model, **options).attach()
    model(torch.randn(2, 4)).sum().backward()
    del model, guard
    gc.collect()
    assert held() is None


class Queries(nn.Module):
    """DETR-style: learned queries (a leaf) fed to a submodule."""

    def __init__(self, leaf: str):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(3, 4))
        self.image = torch.randn(3, 4, requires_grad=True)  # a leaf the user optimises
        self.leaf = leaf
        self.decoder = nn.Linear(4, 4)

    def forward(self, x):
        return self.decoder(self.queries if self.leaf == "parameter" else self.image) + x


@pytest.mark.parametrize("leaf", ["parameter", "leaf tensor"])
def test_a_leaf_fed_to_a_submodule_in_an_evaluation_loop_without_no_grad_keeps_memory_flat(leaf):
    torch.manual_seed(0)
    model = Queries(leaf)
    x = torch.randn(3, 4)
    with promises_kept(model, tensors=[model.image]), Guard(model, max_frames=10) as guard:
        grown = memory_growth(lambda: model(x), 10_000)  # evaluation, grad on, no backward
        # a training step afterwards still gets the leaf's gradient to the call that took it
        model(x).sum().backward()
        decoder = [f for f in guard.report.frames if f.module_name == "decoder" and f.phase == "backward"]
        assert decoder and any(row.role == "grad_input[0]" for row in decoder[-1].rows)
    assert grown < 64 * 1024, f"{grown} bytes more after 10000 steps"


def test_no_weak_reference_or_extra_hook_stays_on_a_parameter_between_steps():
    model = net()
    with promises_kept(model), Guard(model):
        for _ in range(3):
            train_step(model, x4())
        assert all(weakref.getweakrefcount(p) == 0 for p in model.parameters())
        assert all(len(p._backward_hooks) == 1 for p in model.parameters())


# ---- 5. threads calling one guarded model -------------------------------------------------
def _threaded(worker, count: int):
    """Run `worker(i)` in `count` threads started together; (results, exceptions) by thread."""
    barrier = threading.Barrier(count)
    results, errors = {}, {}

    def run(i):
        barrier.wait()
        try:
            results[i] = worker(i)
        except BaseException as error:  # noqa: BLE001 - any exception is a broken promise
            errors[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def _gradients_of(model, x):
    x = x.clone().requires_grad_(True)
    out = model(x)
    grads = torch.autograd.grad(out.pow(2).sum(), [x, *model.parameters()])
    return out.detach(), grads


def test_threads_calling_one_guarded_model_get_what_they_get_without_it():
    model, twin = net(), net()
    inputs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    expected = [[_gradients_of(twin, x) for _ in range(25)] for x in inputs]
    with promises_kept(model), Guard(model) as guard:
        results, errors = _threaded(lambda i: [_gradients_of(model, inputs[i]) for _ in range(25)], 4)
    assert errors == {}
    assert bit_identical([results[i] for i in range(4)], expected)
    assert guard.detection is None
    assert guard.batches.started == 100  # 100 calls of the model, numbered across the threads


class Sqrt(nn.Module):
    """sqrt(|x|): its input gradient is nan where x is 0."""

    def forward(self, x):
        return torch.sqrt(x.abs())


def test_a_batch_started_in_another_thread_between_forward_and_backward_loses_no_gradient():
    # The input gradient of Sqrt at 0 is nan, and the input is a leaf: what its gradient belongs
    # to must outlive a batch another thread starts before this thread's backward.
    model = nn.Sequential(Sqrt(), nn.Linear(4, 1))
    forward_done, other_batch_done = threading.Event(), threading.Event()
    errors = []

    def bad_thread():
        x = torch.zeros(3, 4, requires_grad=True)
        out = model(x)
        forward_done.set()
        other_batch_done.wait(10)
        try:
            torch.autograd.grad(out.pow(2).sum(), [x, *model.parameters()])
        except NonFiniteError as error:
            errors.append(error)

    with promises_kept(model), Guard(model):
        thread = threading.Thread(target=bad_thread)
        thread.start()
        forward_done.wait(10)
        model(x4() + 3)  # a batch of the main thread, whose backward never comes
        other_batch_done.set()
        thread.join()
    assert len(errors) == 1 and culprit(errors[0]) == ("0", "Sqrt", "backward")


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_nan_made_in_one_thread_is_reported_in_that_thread(phase):
    torch.manual_seed(0)
    model = exp_net() if phase == "forward" else nn.Sequential(Sqrt(), nn.Linear(4, 1))
    bad = 2

    def worker(i):
        x = x4() + 3
        if i == bad:
            x = x * 1000 if phase == "forward" else torch.zeros(3, 4)
        for _ in range(20):
            _gradients_of(model, x)
        return True

    with promises_kept(model), Guard(model):
        results, errors = _threaded(worker, 4)
    assert list(errors) == [bad] and sorted(results) == [0, 1, 3]
    error = errors[bad]
    assert isinstance(error, NonFiniteError) and leads_with_the_culprit(error)
    assert culprit(error) == (("1", "Exp", "forward") if phase == "forward" else ("0", "Sqrt", "backward"))


def test_threads_entering_the_same_guard_keep_its_hooks_until_the_last_leaves():
    model = exp_net()
    guard = Guard(model)
    first_in, first_out = threading.Event(), threading.Event()
    seen = {}

    def first():
        with guard:
            first_in.set()
            first_out.wait(5)

    def second():
        first_in.wait(5)
        with guard:
            first_out.set()
            thread.join()  # the first thread has left: the hooks must still be on
            try:
                model(x4() * 1000)
            except NonFiniteError as error:
                seen["error"] = error
        seen["hooks"] = hooks_left(model)

    with promises_kept(model):
        thread = threading.Thread(target=first)
        other = threading.Thread(target=second)
        thread.start()
        other.start()
        other.join()
    assert culprit(seen["error"])[0] == "1"
    assert seen["hooks"] == []


def test_a_thread_pool_of_evaluations_under_no_grad():
    model, twin = exp_net(), exp_net()
    inputs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(32)]

    def evaluate(m, x):
        with torch.no_grad():
            return m(x)

    expected = [evaluate(twin, x) for x in inputs]
    with promises_kept(model), Guard(model) as guard, ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: evaluate(model, x), inputs))
        with pytest.raises(NonFiniteError):
            pool.submit(evaluate, model, inputs[0] * 1000).result()
    assert bit_identical(got, expected)
    assert guard.detection.first_nonfinite.module_name == "1"


# ---- 6. saving and swapping parameters ----------------------------------------------------
@pytest.fixture
def swapping():
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


def test_torch_save_of_the_model_and_its_state_inside_the_guard():
    model, twin = net(), net()
    x = x4()
    with promises_kept(model), Guard(model):
        train_step(model, x)
        saved, state = io.BytesIO(), io.BytesIO()
        torch.save(model, saved)
        torch.save(model.state_dict(), state)
    train_step(twin, x)
    saved.seek(0)
    state.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert hooks_left(loaded) == []
    assert sorted(vars(loaded)) == sorted(vars(twin))
    assert bit_identical(loaded.state_dict(), twin.state_dict())
    assert bit_identical(torch.load(state), twin.state_dict())


SWAPS = {
    "double": lambda m: m.double(),
    "half, then float": lambda m: m.half().float(),
    "load_state_dict": lambda m: m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}),
}


@pytest.mark.parametrize("how", SWAPS)
def test_parameters_swapped_inside_the_guard_are_still_watched(swapping, how):
    model = sqrt_weight_net()
    weight = model[0].w
    with promises_kept(model), Guard(model) as guard:
        SWAPS[how](model)
        assert model[0].w is weight  # swapped in place, not replaced
        dtype = model[0].w.dtype
        out = model(x4().to(dtype))
        assert torch.isfinite(out).all()  # only the weight's gradient goes bad
        with pytest.raises(NonFiniteError) as caught:
            out.sum().backward()
    error = caught.value
    assert culprit(error) == ("0", "SqrtWeight", "backward") and leads_with_the_culprit(error)
    assert [row.role for row in error.report.first_nonfinite.flagged_rows] == ["w.grad"]
    assert guard.detection is error.report


def test_a_swapped_parameter_with_hooks_of_its_own_is_said_to_be_unwatched(swapping):
    def run(guarded: bool):
        model = sqrt_weight_net(zero=False)
        calls = []
        model[0].w.register_hook(lambda g: calls.append(1))
        with (Guard(model) if guarded else contextlib.nullcontext()):
            model.double()  # torch leaves the user's hook with the old tensor
            model(x4().double()).sum().backward()
        return calls, model_state(model), len(hooks_left(model))

    expected = run(False)
    with pytest.warns(UserWarning, match=r"gradients of 0\.w \(swapped, with hooks of its own\) are not watched"):
        got = run(True)
    assert bit_identical(got, expected)


# ---- 7. lazy and scripted parts -------------------------------------------------------------
class Log(nn.Module):
    def forward(self, x):
        return torch.log(x + 10)  # nan once x < -10


def test_a_lazy_module_is_hooked_once_its_weights_exist():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.LazyLinear(3), nn.Tanh(), nn.Linear(3, 1))

    def run(model):
        return [train_step(model, x4()) for _ in range(2)]

    plain = build()
    expected = same_run(lambda: run(plain))
    model = build()
    with Guard(model, max_frames=50) as guard:
        got = same_run(lambda: run(model))
        rows = {(f.module_name, f.module_class, r.role) for f in guard.report.frames for r in f.rows}
    assert bit_identical(got, expected)
    assert ("0", "Linear", "weight.grad") in rows and ("0", "Linear", "input[0]") in rows
    assert hooks_left(model) == hooks_left(plain)


def test_an_overflow_in_a_lazy_modules_first_call_is_named():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.LazyLinear(3), Exp())

    plain, model = build(), build()
    plain(x4() * 1000)  # torch drops its own lazy hooks once the weights exist
    with pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x4() * 1000)
    assert culprit(caught.value) == ("1", "Exp", "forward")
    assert hooks_left(model) == hooks_left(plain)


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("kind", ["script", "trace"])
def test_a_scripted_submodule_is_an_opaque_leaf_seen_through_its_parent(kind, mode):
    def build():
        torch.manual_seed(0)
        inner = Log()
        inner = torch.jit.script(inner) if kind == "script" else torch.jit.trace(inner, x4())
        return nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 2), nn.Sequential(nn.Tanh()))

    x = x4()
    plain, model = build(), build()
    expected = same_run(lambda: train_step(plain, x))
    with promises_kept(model), Guard(model, mode=mode) as guard:
        assert bit_identical(same_run(lambda: train_step(model, x)), expected)
        assert guard.detection is None
        with pytest.raises(NonFiniteError) as caught:
            model(x * 1000)
    # The nan is made inside the scripted part: the parent's own code, as far as hooks can see.
    assert culprit(caught.value) == ("", "Sequential", "forward") and leads_with_the_culprit(caught.value)


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_weight_of_a_scripted_submodule_is_named_as_its_callers_weight(mode):
    # Not "the parent made nan from finite inputs and weights": its scripted child's weight.
    torch.manual_seed(0)
    blocks = nn.ModuleList([torch.jit.script(nn.Linear(4, 4))])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 4))
            self.blocks = blocks
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            return self.head(torch.relu(self.blocks[0](self.body(x))))

    model = Net()
    with torch.no_grad():
        model.blocks[0].weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError) as caught, Guard(model, mode=mode):
        model(x4()).sum().backward()
    report = caught.value.report
    assert report.cause == "weights" and report.first_nonfinite.module_class == "Net"
    assert "blocks.0.weight holds nan" in report.reason, report.reason


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_a_scripted_model_is_guarded_with_a_warning_and_its_weights_gradients_watched():
    torch.manual_seed(0)
    model = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    with pytest.warns(UserWarning, match="TorchScript module: its calls cannot be watched"):
        guard = Guard(model, max_frames=50).attach()
    try:
        model(x4()).sum().backward()
        roles = {(f.module_name, r.role) for f in guard.report.frames for r in f.rows}
        assert ("", "0.weight.grad") in roles
    finally:
        guard.detach()
    assert hooks_left(model) == []
    with pytest.raises(TypeError, match="the model is a TorchScript module, whose calls the "
                                        "sentinel cannot watch: guard the eager model it was scripted from"):
        Guard(model, mode="sentinel").attach()
    assert hooks_left(model) == []


# ---- 8. compiled models ---------------------------------------------------------------------
@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    yield torch._dynamo
    torch._dynamo.reset()


class Wrapper(nn.Module):
    """A model class of the user's own: torch.compile runs its hooks outside the graph and
    traces the calls of its submodules, hooks included."""

    def __init__(self):
        super().__init__()
        self.body = net()

    def forward(self, x):
        return self.body(x) * 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("what", ["Sequential", "model of its own class", "submodule"])
def test_compiling_a_guarded_model_with_fullgraph_runs_as_without_the_guard(dynamo, backend, what):
    def run(model):
        if what == "submodule":  # compiled inside a call the guard watches
            model.body = torch.compile(model.body, fullgraph=True, backend=backend)
            compiled = model
        else:
            compiled = torch.compile(model, fullgraph=True, backend=backend)
        return [train_step(compiled, x4()) for _ in range(2)]

    build = net if what == "Sequential" else Wrapper
    plain, model = build(), build()
    expected = same_run(lambda: run(plain))
    dynamo.reset()  # compiled anew, hooks and all
    with promises_kept(model), Guard(model) as guard:
        got = same_run(lambda: run(model))
    assert bit_identical(got, expected)
    assert guard.detection is None


def test_a_model_compiled_before_attaching_is_reported_as_the_original_model(dynamo):
    torch.manual_seed(0)
    model = LogNet()
    compiled = torch.compile(model, backend="eager")
    compiled(x4())  # compiled before the guard attaches
    graphs = dynamo.utils.counters["stats"]["unique_graphs"]
    with promises_kept(compiled), Guard(compiled, max_frames=50) as guard:
        compiled(x4()).sum().backward()
        names = {(f.module_name, f.module_class) for f in guard.report.frames}
        with pytest.raises(NonFiniteError) as caught:
            compiled(x4() * 1000)
        error = caught.value
    assert culprit(error) == ("", "LogNet", "forward") and leads_with_the_culprit(error)
    # run again eagerly, as the sentinel does: the op and its line, and where it was first seen
    assert error.report.found_by == "re-run" and error.report.first_nonfinite.op == "aten.log.default"
    assert "first seen in compiled code (torch.compile)" in str(error)
    assert names == {("", "LogNet"), ("first", "Linear"), ("second", "Linear")}
    assert dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # hooks made no recompile


def test_a_compiled_submodule_is_named_by_its_place_in_the_model(dynamo):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogNet())
    model[1] = torch.compile(model[1], backend="eager")
    with promises_kept(model), pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x4() * 1000)
    assert culprit(caught.value)[:2] == ("1", "LogNet")


# ---- 9. tracing and exporting -------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_jit_trace_inside_the_guard_records_the_graph_it_records_without_it():
    plain, model = net(), net()
    expected = torch.jit.trace(plain, x4())
    with promises_kept(model), Guard(model) as guard:
        traced = torch.jit.trace(model, x4())
    unmangled = lambda graph: re.sub(r"___torch_mangle_\d+\.", "", str(graph))  # noqa: E731
    assert unmangled(traced.graph) == unmangled(expected.graph)
    assert bit_identical(traced(x4()), expected(x4()))
    assert guard.detection is None


@pytest.mark.parametrize("strict", [False, True])
def test_export_inside_the_guard_exports_what_it_exports_without_it(dynamo, strict):
    plain, model = exp_net(), exp_net()
    expected = torch.export.export(plain, (x4(),), strict=strict)
    with promises_kept(model), Guard(model) as guard:
        exported = torch.export.export(model, (x4(),), strict=strict)
    assert exported.graph_module.code == expected.graph_module.code
    assert guard.detection is None


def test_fake_tensors_and_flop_counting_inside_the_guard():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    model, twin = exp_net(), exp_net()
    with FlopCounterMode(display=False) as expected:
        twin(x4())
    with promises_kept(model), Guard(model) as guard:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            model(fake.from_tensor(x4()))
        with FlopCounterMode(display=False) as counted:
            model(x4())
        model(x4())  # watched again
    assert counted.get_total_flops() == expected.get_total_flops()
    assert guard.detection is None and guard.report.frames


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_fault_made_under_a_flop_counter_is_caught_and_the_count_unchanged(mode):
    """FLOP counting for MFU logging wraps the forward: its values are real, and watched."""
    from torch.utils.flop_counter import FlopCounterMode

    twin, model = exp_net(), exp_net()
    with FlopCounterMode(display=False) as expected:
        twin(x4())
    with promises_kept(model), Guard(model, mode=mode):
        with FlopCounterMode(display=False) as counted:
            model(x4())
        with pytest.raises(NonFiniteError) as caught:
            with FlopCounterMode(display=False):
                model(x4() * 1000)
    assert counted.get_total_flops() == expected.get_total_flops()
    assert culprit(caught.value) == ("1", "Exp", "forward")


def test_make_fx_inside_the_guard_traces_only_the_model():
    from torch.fx.experimental.proxy_tensor import make_fx

    plain, model = net(), net()
    expected = make_fx(plain)(x4())
    with promises_kept(model), Guard(model):
        traced = make_fx(model)(x4())
    assert traced.code == expected.code


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_call_captured_into_a_cuda_graph_is_left_to_run_as_it_is(monkeypatch, mode):
    """Under CUDA graph capture the guard's statistics would be recorded for replay, and its
    read-back would end the capture with an error: it stays out, and watches the next call."""
    from numguard_nb.guard import hooks

    model = exp_net()
    with promises_kept(model), Guard(model, mode=mode) as guard:
        monkeypatch.setattr(hooks, "stream_capturing", lambda: True)
        model(x4() * 1000)  # an overflow the capture keeps to itself
        assert guard.detection is None
        monkeypatch.setattr(hooks, "stream_capturing", lambda: False)
        with pytest.raises(NonFiniteError):
            model(x4() * 1000)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_on_cuda_a_graph_captured_inside_the_guard_replays_as_without_it(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)).cuda()
    x = torch.randn(3, 4, device="cuda")
    with Guard(model, mode=mode) as guard, torch.no_grad():
        side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
        x.mul_(2)
        graph.replay()
        torch.testing.assert_close(out, model(x))
        assert guard.detection is None


def _functional_call(model, x):
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    out = torch.func.functional_call(model, params, (x,))
    return out, torch.autograd.grad(out.sum(), list(params.values()))


def _full_backward_hooks(model, x):
    calls = []
    handles = [model[0].register_full_backward_hook(lambda m, gi, go: calls.append("hook")),
               model[2].register_full_backward_pre_hook(lambda m, go: calls.append("pre"))]
    out = model(x.clone().requires_grad_())
    out.sum().backward()
    for handle in handles:
        handle.remove()
    return out, [p.grad for p in model.parameters()], calls


TRANSFORMS = {
    "functional_call": _functional_call,
    "func.grad": lambda m, x: torch.func.grad(lambda inp: m(inp).sum())(x),
    "vmap": lambda m, x: torch.vmap(m)(x),
    "jacobian": lambda m, x: torch.autograd.functional.jacobian(m, x),
    "hessian-vector product": lambda m, x: torch.autograd.functional.hvp(
        lambda inp: m(inp).sum(), x, torch.ones_like(x)),
    "full backward hooks": _full_backward_hooks,
}


@pytest.mark.parametrize("how", TRANSFORMS)
def test_function_transforms_and_autograd_helpers_run_as_without_the_guard(how):
    plain, model = net(), net()
    expected = same_run(lambda: TRANSFORMS[how](plain, x4()))
    with promises_kept(model), Guard(model) as guard:
        got = same_run(lambda: TRANSFORMS[how](model, x4()))
    assert bit_identical(got, expected)
    assert guard.detection is None


# ---- 10. re-entry and Ctrl-C --------------------------------------------------------------
def test_reentering_a_guard_keeps_it_attached_until_the_outermost_exit():
    model = exp_net()
    guard = Guard(model)
    with promises_kept(model):
        with guard:
            with guard:
                pass
            assert guard.attached
            with pytest.raises(NonFiniteError) as caught:
                model(x4() * 1000)
            with guard, pytest.raises(RuntimeError):
                raise RuntimeError("inner block fails")
            assert guard.attached
        assert not guard.attached
    assert culprit(caught.value)[0] == "1"


class Interruptible(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), Exp())
        self.head = nn.Linear(4, 2)
        self.interrupt = False

    def forward(self, x):
        h = self.encoder(x)
        if self.interrupt:
            raise KeyboardInterrupt
        return self.head(h)


@pytest.mark.parametrize("call", ["submodule", "its child", "root"])
def test_after_a_caught_ctrl_c_the_next_call_of_any_guarded_module_is_checked(call):
    torch.manual_seed(0)
    model = Interruptible()
    x = x4()
    with promises_kept(model), Guard(model) as guard:
        model.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            model(x)
        model.interrupt = False
        run = {"submodule": model.encoder, "its child": model.encoder[1], "root": model}[call]
        run(x)  # clean: its frames are recorded as a pass of their own
        assert guard.report.frames[-1].module_name == {"submodule": "encoder",
                                                       "its child": "encoder.1", "root": ""}[call]
        with pytest.raises(NonFiniteError) as caught:
            run(x * 1000)
    assert culprit(caught.value)[0] == "encoder.1"


def test_a_ctrl_c_caught_inside_a_forward_keeps_the_outer_calls_open():
    class Retry(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Interruptible()

        def forward(self, x):
            self.inner.interrupt = True
            try:
                self.inner(x)
            except KeyboardInterrupt:
                self.inner.interrupt = False
            return self.inner(x)

    torch.manual_seed(0)
    model = Retry()
    with promises_kept(model), pytest.raises(NonFiniteError) as caught, Guard(model):
        model(x4() * 1000)
    assert culprit(caught.value)[0] == "inner.encoder.1"


# ---- odd outputs ------------------------------------------------------------------------------
Point = collections.namedtuple("Point", "x y")


class Odd(nn.Module):
    """Returns something unusual, chosen by `kind`."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if self.kind == "none":
            return None
        if self.kind == "dict":
            return {"h": h, "text": "ok", "n": 3, "none": None, "ints": h.long()}
        if self.kind == "namedtuple":
            return Point(h, h.sum())
        if self.kind == "generator":
            return (t for t in (h, h * 2))
        if self.kind == "same input":
            return x
        if self.kind == "view":
            return h.view(-1)[:5]
        if self.kind == "in place":
            return x.mul_(1.0)
        if self.kind == "complex":
            return torch.complex(h, h)
        if self.kind == "bool":
            return h > 0
        if self.kind == "empty":
            return h[:0]
        raise AssertionError(self.kind)


ODD = ["none", "dict", "namedtuple", "generator", "same input", "view", "in place", "complex",
       "bool", "empty"]


@pytest.mark.parametrize("kind", ODD)
def test_odd_outputs_pass_through_unchanged_and_nothing_is_detected(kind):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(Odd(kind))

    def run(model):
        out = model(x4().clone())
        return list(out) if kind == "generator" else out

    plain, model = build(), build()
    expected = same_run(lambda: run(plain))
    with promises_kept(model), Guard(model, sync=True) as guard:
        got = same_run(lambda: run(model))
    assert bit_identical(got, expected)
    assert guard.detection is None


# ---- every exit path ------------------------------------------------------------------------
class Fails(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if self.how in EXCEPTIONS:
            raise EXCEPTIONS[self.how]
        if self.how == "overflow":
            return torch.exp(h * 1000)
        if self.how == "nan gradient":
            return torch.sqrt(h - h)
        return h


EXCEPTIONS = {"RuntimeError": RuntimeError("shape mismatch"), "KeyboardInterrupt": KeyboardInterrupt(),
              "SystemExit": SystemExit(3), "StopIteration": StopIteration()}


def _user_hook_raising(module, args, output):
    raise ValueError("a user's hook fails")


def _backward_hook_raising(grad):
    raise ArithmeticError("a user's gradient hook fails")


EXIT_PATHS = {
    "normal": (None, {}),
    "RuntimeError in forward": (RuntimeError, {}),
    "KeyboardInterrupt in forward": (KeyboardInterrupt, {}),
    "SystemExit in forward": (SystemExit, {}),
    "StopIteration in forward": (StopIteration, {}),
    "NonFiniteError in forward": (NonFiniteError, {}),
    "NonFiniteError in forward, sync": (NonFiniteError, {"sync": True}),
    "NonFiniteError in backward": (NonFiniteError, {}),
    "NonFiniteError in backward, sync": (NonFiniteError, {"sync": True}),
    "user forward hook raises": (ValueError, {}),
    "user gradient hook raises": (ArithmeticError, {}),
    "on_detect raises its own": (LookupError, {"on_detect": lambda report: LookupError("mine")}),
    "BatchLimitReached": (BatchLimitReached, {"abort_after_batch": 0}),
    "with capture and ops": (NonFiniteError, {"capture": True, "ops": True}),
}


@pytest.mark.parametrize("path", EXIT_PATHS)
def test_no_hook_is_left_behind_on_any_exit_path(path):
    expected_error, options = EXIT_PATHS[path]
    how = {"RuntimeError in forward": "RuntimeError", "KeyboardInterrupt in forward": "KeyboardInterrupt",
           "SystemExit in forward": "SystemExit", "StopIteration in forward": "StopIteration"}.get(path, "")
    if "NonFiniteError" in path or path == "on_detect raises its own" or path == "with capture and ops":
        how = "nan gradient" if "backward" in path else "overflow"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Fails(how), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = x4()
    if path == "user forward hook raises":
        model[1].register_forward_hook(_user_hook_raising)
    if path == "user gradient hook raises":
        model[2].weight.register_hook(_backward_hook_raising)
    with promises_kept(model, optimizers=[optimizer], tensors=[x]):
        context = pytest.raises(expected_error) if expected_error else contextlib.nullcontext()
        with context as caught, Guard(model, **options) as guard:
            for _ in range(2):
                optimizer.zero_grad()
                model(x).sum().backward()
                optimizer.step()
        assert not guard.attached
    if expected_error is NonFiniteError:
        assert leads_with_the_culprit(caught.value)
    # the guard can be used again, and finds what it should
    with pytest.raises(NonFiniteError) as again, Guard(exp_net()) as guard:
        guard.models[""](x * 1000)
    assert culprit(again.value)[0] == "1"


def test_a_generator_closed_inside_the_guard_leaves_no_hook():
    model = net()
    guards = []

    def batches():
        with Guard(model) as guard:
            guards.append(guard)
            for _ in range(10):
                yield model(x4())

    with promises_kept(model):
        stream = batches()
        next(stream)
        assert guards[0].attached
        stream.close()  # GeneratorExit inside the with block
    assert not guards[0].attached


# ---- the torch mode stacks after on_detect detaches ------------------------------------------
def _mode_stacks():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return (list(torch.overrides._get_current_function_mode_stack()),
            list(_get_current_dispatch_mode_stack()))


class _BackwardNan(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return NanGradient.apply(self.linear(x))


_STEPS = {
    "module backward": lambda model, x: model(x).pow(2).mean().backward(),
    "loss code forward": lambda model, x: torch.log(model(x) * 0).mean().backward(),
    "loss code backward": lambda model, x: (model(x) * 0).sqrt().sum().backward(),
}


@pytest.mark.parametrize("where", list(_STEPS))
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_on_detect_detaching_leaves_the_mode_stacks_as_they_were(where, mode):
    # The training callbacks detach from on_detect; a mode left behind would double the cost of
    # every later torch call and turn off the optimizers' foreach paths.
    torch.manual_seed(0)
    model = _BackwardNan() if where == "module backward" else nn.Linear(4, 4)
    before = _mode_stacks()
    with promises_kept(model):
        guard = Guard(model, mode=mode, on_detect=lambda report: guard.detach())
        guard.attach()
        with pytest.raises(NonFiniteError):
            _STEPS[where](model, torch.randn(2, 4))
        assert _mode_stacks() == before  # at once, before any later call could take it off
        guard.detach()
    assert _mode_stacks() == before


@pytest.fixture
def swap_mode():
    """`load_state_dict` swaps parameters (torch.utils.swap_tensors), as DTensor, FSDP2 and
    float8 training make it: it refuses a parameter with a weak reference or an extra owner."""
    was = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(was)


@pytest.mark.parametrize("options", [{}, {"ops": True}, {"capture": True}, {"mode": "sentinel"}],
                         ids=["full", "ops", "capture", "sentinel"])
def test_load_state_dict_in_swap_mode_works_inside_the_guard_after_a_backward(swap_mode, options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    saved = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters())
    with Guard(model, **options):
        model(torch.randn(2, 4)).pow(2).mean().backward()
        optimizer.step()
        model.load_state_dict(saved)
        model(torch.randn(2, 4)).pow(2).mean().backward()  # and the guard goes on watching
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_load_state_dict_in_swap_mode_works_under_numguard_on(swap_mode):
    from numguard_nb.session import GuardedRun, Session

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    namespace = {"model": model}
    session = Session()
    session.start(GuardedRun(namespace, {"model": model}))
    session.before_cell("model(x).sum().backward()")
    model(torch.randn(2, 4)).sum().backward()
    session.after_cell(True, None)
    session.before_cell("model.load_state_dict(saved)")
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    session.after_cell(True, None)
    session.stop()


# ---- the guard's own registration of gradient hooks ------------------------------------------
class _PassThroughMode(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("tensor", ["non-leaf", "leaf"])
def test_the_guards_gradient_hooks_run_and_go_as_torchs_own_in_their_order(tensor):
    """`register_tensor_hook` (a module output's gradient hook, each call in full mode) keeps
    torch's contract: the hook sees the gradient in registration order among the user's own
    hooks, its handle removes it and no other, and its handle is pruned once the tensor goes."""
    from numguard_nb._util import LiveHandles, register_tensor_hook

    x = torch.ones(3, requires_grad=True)
    y = x if tensor == "leaf" else x * 2
    order = []
    user_before = y.register_hook(lambda g: order.append("user before"))
    ours = register_tensor_hook(y, lambda g: order.append(("ours", g.tolist())))
    y.register_hook(lambda g: order.append("user after"))
    (y * 3).sum().backward()
    assert order == ["user before", ("ours", [3.0, 3.0, 3.0]), "user after"]
    order.clear()
    ours.remove()
    user_before.remove()
    ours.remove()  # (twice: nothing)
    y = x if tensor == "leaf" else x * 2
    (y * 3).sum().backward()
    assert order == ([] if tensor == "non-leaf" else ["user after"])
    handles = LiveHandles(slack=0)
    z = (x * 2).exp()
    handles.add(register_tensor_hook(z, lambda g: None))
    del z
    handles.prune()
    assert len(handles) == 0  # its tensor and graph gone: nothing to remove


def test_the_guards_gradient_hook_on_a_tensor_under_a_torch_function_mode_goes_through_it():
    from numguard_nb._util import register_tensor_hook

    x = torch.ones(2, requires_grad=True)
    y = x * 2
    seen = []
    with _PassThroughMode() as mode:
        register_tensor_hook(y, seen.append)
    assert "register_hook" in mode.seen
    y.sum().backward()
    assert len(seen) == 1
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        register_tensor_hook(torch.ones(2), seen.append)

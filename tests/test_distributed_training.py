"""Training steps under DDP, two gloo processes on CPU, a nan made on rank 1 only: every rank
stops at the same step with a report (none waits on a collective the other never makes), rank 1
names the module that made it, and rank 0 names rank 1 (received through the gradient
all-reduce). A healthy run is bit-identical with and without the guard.

The two rank processes are started once for the module and run one scenario after another,
each in a process group of its own; after each, no torch function mode of the guard's may be
left on a rank's stack (a leak that would change the next run: it did).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

TIMEOUT_S = 20  # the process group's: a rank left waiting on a collective fails there
BAD_STEP = 2


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)  # nan for rank 1's negative values at the bad step


class Back(nn.Module):
    """The identity; nan gradients in backward for a batch marked by its first value."""

    def forward(self, x, marked: bool = False):
        from tests.models import NanGradient

        return NanGradient.apply(x) if marked else x


class ForwardNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.log = Log()
        self.norm = nn.BatchNorm1d(4)  # buffers: DDP broadcasts them at every forward
        self.last = nn.Linear(4, 1)

    def forward(self, x):
        return self.last(self.norm(self.log(self.first(x).abs() + 1 + x[:, :1])))


class BackwardNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.back = Back()
        self.last = nn.Linear(4, 1)

    def forward(self, x):
        return self.last(self.back(self.first(x), marked=bool(x[0, 0] == 1000.0)))


class MaskedNet(nn.Module):
    """Two outputs; the loss uses the first only, so a nan in the second reaches no gradient."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.log = Log()
        self.last = nn.Linear(4, 1)

    def forward(self, x):
        return self.last(self.first(x)), self.log(x[:, :1] + 1)


class ScaledMean(nn.Module):
    """Keeps in a buffer the batch's mean over its smallest first feature + 1e4: inf for rank 1's
    bad batch (-1e4 there), while its outputs stay finite."""

    def __init__(self):
        super().__init__()
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x):
        with torch.no_grad():
            self.avg.copy_(x.mean(0) / (x[:, 0] + 1e4).min())
        return x


class BufferNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.mean = ScaledMean()
        self.last = nn.Linear(4, 1)

    def forward(self, x):
        return self.last(self.first(self.mean(x)))


class RootParameterNet(ForwardNet):
    """A parameter of the root's own (FSDP2: the root's group, reduced at FSDP2's own end of
    backward, after the guard's)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return super().forward(x) * self.scale


class RootParameterBackwardNet(BackwardNet):
    """Its head (`last`) is the root's own under FSDP2, as a transformer's embedding and head
    are: the root's group is reduced at FSDP2's end of backward, after the guard's."""

    root_owns = ("last",)


class MaskOutNet(nn.Module):
    """Logits with a -inf column (an action never legal); the loss reads the legal ones."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 2)

    def forward(self, x):
        logits = self.first(x)
        return torch.cat([logits, torch.full_like(logits[:, :1], float("-inf"))], dim=1)


def _loss(out, setup: str, rank: int, step: int) -> torch.Tensor:
    if setup.endswith("read") and rank == 1 and step == BAD_STEP:
        return out.mean()  # -inf: the mask read, no new value made by the loss code
    if setup.startswith("minus-inf mask"):
        return torch.log_softmax(out, dim=1)[:, :2].pow(2).mean()
    if setup == "loss" and rank == 1 and step == BAD_STEP:
        out = torch.log(out - 1e6)  # nan made in the loss code, rank 1 only
    return (out[0] if setup.startswith("masked") else out).pow(2).mean()


def _batch(rank: int, step: int, setup: str) -> torch.Tensor:
    x = torch.rand(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
    if rank == 1 and step == BAD_STEP and setup in ("forward", "masked", "masked, called twice",
                                                    "buffer", "forward, root parameter",
                                                    "two models"):
        x[:, 0] = -1e4  # log of a negative value in rank 1's forward
    if rank == 1 and step == BAD_STEP and setup in ("backward", "backward, root parameter"):
        x[0, 0] = 1000.0  # rank 1's backward makes nan
    return x


MODES = {"sentinel": {"mode": "sentinel"}, "full": {}, "ops": {"ops": True}, "sync": {"sync": True}}
NETS = {"forward": ForwardNet, "backward": BackwardNet, "masked": MaskedNet,
        "masked, called twice": MaskedNet, "buffer": BufferNet, "loss": ForwardNet,
        "forward, root parameter": RootParameterNet, "minus-inf mask": MaskOutNet,
        "minus-inf mask, read": MaskOutNet,
        "backward, root parameter": RootParameterBackwardNet,
        "two models": ForwardNet}


@contextlib.contextmanager
def _as_on_a_gpu(rank: int):
    """The sentinel's checks read later, as on a GPU: rank 0's device has them at once, rank
    1's never before they are waited for (the earliest and the latest a rank could act)."""
    from numguard_nb import numerics

    devices, ready = set(numerics.DEFERRED_DEVICE_TYPES), numerics.DeferredRead.ready
    numerics.DEFERRED_DEVICE_TYPES.add("cpu")
    if rank == 1:
        numerics.DeferredRead.ready = lambda self: self._values is not None
    try:
        yield
    finally:  # (the rank's process runs the next scenario)
        numerics.DEFERRED_DEVICE_TYPES.clear()
        numerics.DEFERRED_DEVICE_TYPES.update(devices)
        numerics.DeferredRead.ready = ready


def _wrapped(net: nn.Module, wrap: str) -> nn.Module:
    if wrap == "ddp":
        return nn.parallel.DistributedDataParallel(net)
    if wrap == "compiled ddp":
        return torch.compile(nn.parallel.DistributedDataParallel(net), backend="eager")
    from torch.distributed.fsdp import fully_shard

    for name, child in net.named_children():
        if any(True for _ in child.parameters()) and name not in getattr(net, "root_owns", ()):
            fully_shard(child)
    return fully_shard(net)


def _rank_main(rank: int, world: int, port: int, setup: str, results, mode: str = "sentinel",
               wrap: str = "ddp", options: dict = None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
    except BaseException:  # (a port taken meanwhile, say): this rank's outcome
        results.put((rank, ("crashed", traceback.format_exc())))
        return
    from numguard_nb import Guard, NonFiniteError

    started = time.perf_counter()
    # The optimizer skips a step on a device flag, no read (DTensor has no fused SGD: FSDP2's
    # optimizer reads at its step).
    fused = mode == "sentinel on a gpu" and wrap == "ddp"
    on_a_gpu = _as_on_a_gpu(rank) if mode == "sentinel on a gpu" else contextlib.nullcontext()
    mode = "sentinel" if mode == "sentinel on a gpu" else mode
    try:
        on_a_gpu.__enter__()
        torch.manual_seed(0)
        if setup == "healthy":
            results.put((rank, _healthy(rank, setup, wrap)))
            return
        if setup == "no_sync, then clean":
            results.put((rank, _no_sync_then_clean(rank, mode)))
            return
        if setup == "unflagged":
            results.put((rank, _warned_unflagged(wrap, mode)))
            return
        if setup == "accumulated":
            results.put((rank, _accumulated(rank, mode, fused)))
            return
        model = _wrapped(NETS[setup](), wrap)
        guarded = model
        if setup == "two models":  # a generator feeding a critic, one guard over both
            critic = _wrapped(nn.Linear(1, 1), wrap)
            guarded = {"generator": model, "critic": critic}
            model = nn.Sequential(model, critic)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, fused=fused or None)
        outcome = ("clean",)
        try:
            with Guard(guarded, **MODES[mode], **(options or {})):
                for step in range(4):
                    out = model(_batch(rank, step, setup))
                    if setup == "masked, called twice":  # two calls before one backward
                        out = (out[0] + model(_batch(rank, step + 10, setup))[0],)
                    _loss(out, setup, rank, step).backward()
                    optimizer.step()
                    optimizer.zero_grad()
        except NonFiniteError as error:
            report = error.report
            frame = report.first_nonfinite
            outcome = ("detected", report.batch_number, frame.module_name if frame else None,
                       report.cause, report.source_rank, report.rank, str(error).splitlines()[0],
                       _first_source_rank(report))
        results.put((rank, outcome + (time.perf_counter() - started,)))
    except BaseException:
        results.put((rank, ("crashed", traceback.format_exc())))
    finally:
        on_a_gpu.__exit__(None, None, None)
        dist.destroy_process_group()
        torch._dynamo.reset()  # (a compiled scenario's caches)


def _no_sync_then_clean(rank: int, mode: str) -> tuple:
    """Rank 0's forward makes nan in a micro-step under `no_sync`, caught as in a notebook;
    training goes on with clean batches: what each step raised."""
    from numguard_nb import Guard, NonFiniteError

    net = ForwardNet()
    net.norm = nn.Identity()  # (no running statistics to keep the bad batch's nan)
    model = _wrapped(net, "ddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    outcomes = []
    with Guard(model, **MODES[mode]):
        for step in range(4):
            x = _batch(rank, step, "clean")
            if rank == 0 and step == 1:
                x[:, 0] = -1e4
            try:
                with model.no_sync() if step == 1 else contextlib.nullcontext():
                    model(x).pow(2).mean().backward()
                optimizer.step()
                outcomes.append("clean")
            except NonFiniteError as error:
                outcomes.append(error.report.cause)
            finally:
                optimizer.zero_grad()
    return tuple(outcomes)


def _accumulated(rank: int, mode: str, fused: bool) -> tuple:
    """Gradient accumulation: a micro-step under `no_sync`, then a synced one; rank 1's loss is
    -inf (its model's -inf mask read by a mean) in the first micro-step of the bad step. Where
    each rank stopped, and how."""
    from numguard_nb import Guard, NonFiniteError

    model = _wrapped(MaskOutNet(), "ddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, fused=fused or None)
    where = ""
    try:
        with Guard(model, **MODES[mode]):
            for step in range(5):
                for micro in range(2):
                    with model.no_sync() if micro == 0 else contextlib.nullcontext():
                        out = model(_batch(rank, 3 * step + micro, "clean"))
                        bad = rank == 1 and step == BAD_STEP and micro == 0
                        where = f"step {step}, micro-step {micro}"
                        _loss(out, "minus-inf mask" + (", read" if bad else ""), 1, BAD_STEP).backward()
                where = f"step {step}, optimizer"
                optimizer.step()
                optimizer.zero_grad()
    except NonFiniteError as error:
        return ("detected", where, error.report.cause)
    return ("clean",)


def _warned_unflagged(wrap: str, mode: str) -> tuple:
    """The warnings a guard gives as it attaches to a model run on several ranks in a way it
    carries no flags on."""
    import warnings

    from numguard_nb import Guard

    net = ForwardNet()
    if wrap == "ddp, comm hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        model = nn.parallel.DistributedDataParallel(net)
        model.register_comm_hook(None, fp16_compress_hook)
    elif wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(net, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        model = _wrapped(net, wrap)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Guard(model, **MODES[mode]).attach().detach()
    return tuple(str(w.message) for w in caught if "carries no flag" in str(w.message))


def _first_source_rank(report):
    """The DataFrame's source_rank column, first row (None: no rows, as where this rank's own
    shard of the gradients stayed finite)."""
    table = report.to_frame()
    return int(table["source_rank"].iloc[0]) if len(table) and "source_rank" in table else None


def _healthy(rank: int, setup: str, wrap: str) -> tuple:
    """The same steps with and without the guard: the weights after them, compared."""
    from numguard_nb import Guard

    weights, hooks = [], []
    for guarded in (False, True):
        torch.manual_seed(0)
        model = _wrapped(ForwardNet(), wrap)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        guard = Guard(model, mode="sentinel").attach() if guarded else None
        for step in range(4):
            model(_batch(rank, step, setup)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        if guard is not None:
            guard.detach()
        weights.append([p.detach().full_tensor().clone() if hasattr(p, "full_tensor")
                        else p.detach().clone() for p in model.parameters()])
        hooks.append(sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
                         for m in model.modules()))  # (FSDP2 has its own)
    same = all(torch.equal(a, b) for a, b in zip(*weights))
    return ("healthy", same, hooks[1] - hooks[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Outcome:
    def __init__(self):
        self.item = (None, ("no outcome",))

    def put(self, item) -> None:
        self.item = item


def _rank_loop(rank: int, jobs, results) -> None:
    """A rank's process, kept for the module's scenarios: each in a process group of its own
    (starting two processes, each importing torch, took most of a scenario's 4-5 s). With each
    outcome goes how many torch function modes the scenario left on the stack (the guard's
    must leave with it), cleared for the next."""
    while True:
        job = jobs.get()
        if job is None:
            return
        port, setup, mode, wrap, options = job
        outcome = _Outcome()
        _rank_main(rank, 2, port, setup, outcome, mode, wrap, options)
        left = torch._C._len_torch_function_stack()
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
        results.put((rank, outcome.item[1], left))


class _Ranks:
    """Two rank processes (spawned), given one scenario at a time; started again after one
    did not finish in time."""

    def __init__(self):
        self.processes: list = []
        self.jobs: list = []
        self.results = None

    def start(self) -> None:
        context = mp.get_context("spawn")
        self.results = context.Queue()
        self.jobs = [context.SimpleQueue() for _ in range(2)]
        self.processes = [context.Process(target=_rank_loop, args=(rank, self.jobs[rank], self.results),
                                          daemon=True) for rank in range(2)]
        for process in self.processes:
            process.start()

    def run(self, job: tuple, timeout: float = 60) -> tuple:
        """(each rank's outcome, the modes each left on its stack, whether one was still
        running after `timeout`)."""
        if not self.processes or not all(p.is_alive() for p in self.processes):
            self.stop()
            self.start()
        for queue in self.jobs:
            queue.put(job)
        got, left, deadline = {}, {}, time.monotonic() + timeout
        while len(got) < 2:
            try:
                rank, outcome, modes = self.results.get(timeout=1)
            except Exception:  # queue.Empty: a rank still running, or gone
                dead = [rank for rank, p in enumerate(self.processes) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.stop()
                    for rank in dead:
                        got.setdefault(rank, ("died", "its process ended: see its stderr"))
                    return got, left, not dead
                continue
            got[rank], left[rank] = outcome, modes
        return got, left, False

    def stop(self) -> None:
        for queue, process in zip(self.jobs, self.processes):
            if process.is_alive():
                queue.put(None)
                process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self.processes, self.jobs = [], []


_RANKS = _Ranks()


@pytest.fixture(scope="module", autouse=True)
def _ranks_stopped_after_the_module():
    yield
    _RANKS.stop()


def _run(setup: str, mode: str = "sentinel", wrap: str = "ddp", options: dict = None) -> dict:
    got, left, still_running = _RANKS.run((_free_port(), setup, mode, wrap, options))
    assert not still_running, f"a rank was still running after 60 s: {got}"
    assert "died" not in {outcome[0] for outcome in got.values() if outcome}, got
    assert not any(left.values()), f"torch function modes left on the ranks' stacks: {left}"
    return got


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("setup, module", [("forward", "module.log"), ("backward", "module.back")])
def test_a_nan_made_on_rank_1_stops_both_ranks_at_that_step_and_names_rank_1(setup, module, mode):
    got = _run(setup, mode)
    assert sorted(got) == [0, 1], got
    for rank in (0, 1):
        assert got[rank][0] == "detected", got
        assert got[rank][1] == BAD_STEP, got
        assert got[rank][4] == 1 and got[rank][5] == rank, got  # made on rank 1; this rank
        assert got[rank][7] == 1, got  # the DataFrame's source_rank column
        assert got[rank][-1] < TIMEOUT_S, got  # no rank waited for a collective's timeout
    assert got[1][2] == module, got
    assert got[0][3] == "other-rank" and "received from rank 1" in got[0][6], got


@pytest.mark.parametrize("mode", ["sentinel", "sentinel on a gpu", "full"])
def test_a_buffer_written_non_finite_on_rank_1_stops_both_ranks_at_that_step(mode):
    got = _run("buffer", mode)
    assert sorted(got) == [0, 1], got
    for rank in (0, 1):
        assert got[rank][0] == "detected", got
        assert got[rank][-1] < TIMEOUT_S, got  # no rank waited for a collective's timeout
    assert got[1][1] == BAD_STEP and got[1][2] == "module.mean", got
    assert got[0][3] == "other-rank" and "received from rank 1" in got[0][6], got


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
@pytest.mark.parametrize("setup, module", [("masked", "log"), ("backward", "back"),
                                           ("masked, called twice", "log")])
def test_on_a_gpu_the_sentinel_stops_every_rank_at_the_same_point_of_the_program(setup, module,
                                                                                  wrap):
    """The GPU path (checks read later, never waited for): every rank acts on a step's reduced
    flags at the same point (the next step's backward), so none is left in a collective; even a
    nan that only rank 1's outputs hold (its loss masks it, every gradient stays finite)."""
    got = _run(setup, "sentinel on a gpu", wrap=wrap)
    calls = 2 if setup.endswith("twice") else 1  # batches are counted by the model's calls
    assert sorted(got) == [0, 1], got
    for rank in (0, 1):
        assert got[rank][0] == "detected", got
        assert got[rank][1] == BAD_STEP * calls and got[rank][4] == 1, got
        assert got[rank][-1] < TIMEOUT_S, got
    assert got[1][2] == ("module." if wrap == "ddp" else "") + module, got
    assert got[0][3] == "other-rank" and "received from rank 1" in got[0][6], got


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_a_healthy_run_is_bit_identical_with_the_guard_and_leaves_no_hook(wrap):
    got = _run("healthy", wrap=wrap)
    for rank in (0, 1):
        assert got[rank] == ("healthy", True, 0), got


def test_the_example_runs_under_torchrun_and_both_ranks_name_the_same_fault():
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    # unbuffered, as CI runs it: a print's text and its newline are written apart
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(_free_port()), str(root / "tests" / "exit_at_once.py"),
         str(root / "examples" / "ddp_nan_on_rank1.py"), "--backward"],
        capture_output=True, text=True, timeout=120, env=env, cwd=root)
    lines = {line.split(":")[0]: line for line in done.stdout.splitlines()
             if line.startswith("rank ")}
    assert done.returncode == 0, done.stderr[-2000:]
    assert "module.scale (SafeSqrt) produced a non-finite gradient in backward" in lines["rank 1"]
    assert "received from rank 1 through the gradient all-reduce" in lines["rank 0"]
    assert all("batch 3" in line and "made on rank 1" in line for line in lines.values()), lines


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("setup", ["forward", "backward"])
def test_fsdp2_a_nan_made_on_rank_1_stops_both_ranks_and_rank_0_names_rank_1(setup, mode):
    got = _run(setup, mode, wrap="fsdp2")
    assert sorted(got) == [0, 1], got
    for rank in (0, 1):
        assert got[rank][0] == "detected", got
        assert got[rank][1] == BAD_STEP and got[rank][4] == 1, got  # made on rank 1
        assert got[rank][-1] < TIMEOUT_S, got
    assert got[0][3] == "other-rank" and "received from rank 1" in got[0][6], got
    assert "?.grad" not in got[0][6], got  # the parameters named, as FSDP2 holds them now
    # Rank 1 names the module: through its hooks (full mode), or through the step every rank
    # re-ran together (the sentinel: forward, and backward where the gradients held it).
    assert got[1][2] == ("log" if setup == "forward" else "back"), got



@pytest.mark.parametrize("setup, mode, wrap", [
    ("loss", "sentinel", "ddp"), ("loss", "full", "ddp"), ("loss", "full", "fsdp2"),
    ("loss", "sentinel", "fsdp2"),
    ("forward, root parameter", "full", "fsdp2"), ("forward, root parameter", "ops", "fsdp2"),
    ("backward, root parameter", "full", "fsdp2"),
    ("two models", "full", "ddp"), ("forward", "sentinel", "compiled ddp"),
    ("minus-inf mask, read", "sentinel", "ddp"), ("minus-inf mask, read", "full", "ddp"),
    # on a GPU the -inf the model gives is judged by a loss read later: every rank learns it
    ("minus-inf mask, read", "sentinel on a gpu", "ddp")])
def test_every_rank_stops_at_the_step_rank_1_made_a_nan_in(setup, mode, wrap):
    # a nan made in the loss code; FSDP2 with parameters of the root's own (reduced after the
    # guard's end of backward); two models under one guard; a compiled DDP model
    got = _run(setup, mode, wrap=wrap)
    assert sorted(got) == [0, 1], got
    for rank in (0, 1):
        assert got[rank][0] == "detected", got
        assert got[rank][1] == BAD_STEP and got[rank][4] == 1, got  # made on rank 1
        assert got[rank][-1] < TIMEOUT_S, got  # no rank waited for a collective's timeout
    assert got[0][3] == "other-rank" and "received from rank 1" in got[0][6], got
    # (the -inf mask read by the loss: its maker is named)
    assert got[1][3] == {"loss": "outside", "backward, root parameter": "backward"}.get(
        setup, "forward"), got
    assert "[rank 1/2, made on rank 1]" in got[1][6], got  # (the loss code's held one too)


@pytest.mark.parametrize("wrap, mode", [("ddp, comm hook", "full"), ("fsdp1", "sentinel"),
                                        ("ddp", "sentinel")])
def test_a_model_run_on_several_ranks_without_flags_is_said_so_as_the_guard_attaches(wrap, mode):
    """Where the guard cannot stop every rank together (no flag rides on the reduction), each
    rank is told so at once, rather than meet a hang at the first nan."""
    got = _run("unflagged", mode, wrap=wrap)
    for rank in (0, 1):
        if wrap == "ddp":
            assert got[rank] == (), got
        else:
            assert len(got[rank]) == 1, got
            assert got[rank][0].startswith(
                {"ddp, comm hook": "numguard: ForwardNet is wrapped in DDP with a communication hook of yours",
                 "fsdp1": "numguard: ForwardNet is sharded with FSDP (FullyShardedDataParallel)"}[wrap]), got
            assert "the others wait in their next collective" in got[rank][0], got


@pytest.mark.parametrize("mode", ["sentinel", "sentinel on a gpu"])
def test_a_detection_under_no_sync_leaves_no_flag_for_the_next_steps(mode):
    # rank 0 stops alone at its step (no reduction told the others); after it, clean steps
    # stay clean
    got = _run("no_sync, then clean", mode)
    assert got[0] == ("clean", "forward", "clean", "clean"), got
    assert got[1] == ("clean", "clean", "clean", "clean"), got


def test_in_full_mode_a_detection_under_no_sync_rides_on_the_next_reduction():
    # held through the micro-step's backward, rank 0's detection reaches rank 1 with the next
    # step's gradients: both stop there; rank 0's own step of its nan gradients (no_sync, then
    # a step) broke its weights, which the step after names
    got = _run("no_sync, then clean", "full")
    assert got[0] == ("clean", "clean", "forward", "weights"), got
    assert got[1] == ("clean", "clean", "other-rank", "other-rank"), got


@pytest.mark.parametrize("mode", ["sentinel on a gpu", "full"])
def test_under_accumulation_every_rank_stops_at_the_same_point(mode):
    # The bad micro-step is not reduced: its verdict rides on the next synced one, and every
    # rank acts on what came before it there (on a GPU rank 1's device the slowest; in full
    # mode the detection held through the micro-step's backward). (The sentinel reading at
    # once, on the host, stops rank 1 alone: a limit docs/distributed.md states.)
    got = _run("accumulated", mode)
    assert got[0][0] == got[1][0] == "detected", got
    assert got[0][1] == got[1][1], got  # the same point of the program
    assert (got[0][2], got[1][2]) == ("other-rank", "forward"), got


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_a_minus_inf_mask_in_the_output_is_no_error_on_several_ranks_either(wrap):
    got = _run("minus-inf mask", "sentinel", wrap=wrap)
    assert got[0][0] == got[1][0] == "clean", got


@pytest.mark.parametrize("mode", ["sentinel", "full"])
def test_a_traced_batch_runs_on_on_every_rank(mode):
    # rank 1 traces its nan without stopping: rank 0 must not stop alone at what it received
    got = _run("forward", mode, options={"trace_batches": [BAD_STEP]})
    for rank in (0, 1):
        assert got[rank][0] == "detected" and got[rank][1] == BAD_STEP + 1, got
        assert got[rank][3] in ("weights", "other-rank"), got
        assert got[rank][-1] < TIMEOUT_S, got


@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_the_callbacks_under_torchrun_stop_every_rank_at_the_same_step(framework):
    import pathlib
    import re
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(_free_port()), str(root / "tests" / "exit_at_once.py"),
         str(root / "tests" / "ddp_callbacks_run.py"), framework],
        capture_output=True, text=True, timeout=240, env=env, cwd=root)
    found = dict(re.findall(r"^RESULT rank=(\d) (.*)$", done.stdout, re.M))
    if done.returncode != 0 or sorted(found) != ["0", "1"]:
        print(done.stdout, done.stderr, sep="\n")  # in full under "Captured stdout" (pytest)
    assert done.returncode == 0 and sorted(found) == ["0", "1"], (done.stdout, done.stderr[-3000:])
    batches = {re.search(r"batch=(\d+)", line).group(1) for line in found.values()}
    assert len(batches) == 1, found  # the same step on both ranks
    assert "source=1" in found["0"] and "source=1" in found["1"], found
    assert "cause=other-rank" in found["0"] and "received from rank 1" in found["0"], found
    assert "cause=forward" in found["1"], found
    assert re.search(r"Net\)? produced a non-finite value in forward", found["1"]), found
    # the re-run names the op: Lightning's module called with the forward DDP's wrapper
    # redirects to training_step, not its own forward(batch)
    assert "op=aten.log.default" in found["1"], found

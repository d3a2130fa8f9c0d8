"""Running a model's call a second time: one home for what that takes.

Op localisation (`ops.localise`), the sentinel's second look (`guard.sentinel_rerun`) and the CPU
replay (`replay.run`) each run a call again. What they share lives here, once:

- the state the call ran in: `take()` gives a `CallState` (RNG streams, autocast, grad and
  inference mode), taken just before the call; `entered(state, stack, grad)` runs under it again;
- what a re-run changes, put back: `Kept(modules)` (random state, training flags, buffers), and
  `finite_running_statistics` for the statistics the repeated call already updated;
- running alone: `run_alone(module)` is what a re-run calls (eager, inside a parallel wrapper),
  `swapped` / `eager_stance` / `aot_eager` run compiled parts eagerly or captured;
- refusing collectives: `collective_in(module)` says why a re-run on one rank would start a
  collective the other ranks never join (the caller then does not re-run).

Limits: only CPU and CUDA autocast and generators are taken; a call whose inputs were changed in
place after it ran is re-run on the changed values (callers check `Tensor._version`).

Example::

    state = rerun.take()                      # just before the call
    out = model(x)
    with rerun.Kept([model]), contextlib.ExitStack() as stack:
        rerun.entered(state, stack, grad=False)
        again = rerun.run_alone(model)(x)     # the same random draws, the same autocast
"""

from __future__ import annotations

import contextlib
import random
import weakref
from typing import Callable, Iterable, List, Optional, Tuple

import torch
from torch.nn.parameter import UninitializedTensorMixin

from ._util import compiled_original

__all__ = ["CallState", "take", "autocast_dtype", "enter_autocast", "entered", "Kept",
           "finite_running_statistics", "buffers_at_start", "CallerRandomState", "run_alone", "eager", "original_name",
           "compiled_parts", "swapped", "eager_stance", "aot_eager", "involves_compiled",
           "without_parallel_wrapper", "collective_in", "redirected_forward", "forward_as"]

AUTOCAST_DEVICES = ("cpu", "cuda")


class CallState:
    """What a top-level call's randomness and precision depended on, taken just before it.

    Holds the CPU generator state, the CUDA generator states when CUDA is initialised, Python's
    `random` state, the autocast settings in force (a forward run under `torch.autocast` is
    re-run under it, even when the re-run happens later, in backward), whether gradients were
    recorded and whether inference mode was on (a forward re-run then runs under it, instead of
    no_grad).
    """

    __slots__ = ("cpu", "cuda", "python", "autocast", "inference", "grad_enabled")

    def __init__(self, cpu, cuda, python, autocast, inference=False, grad_enabled=True):
        self.cpu = cpu
        self.cuda = cuda  # one state per CUDA device, or None
        self.python = python
        self.autocast = autocast  # ((device_type, dtype), ...) for each enabled device type
        self.inference = inference  # the call ran under torch.inference_mode()
        self.grad_enabled = grad_enabled

    def restore(self) -> None:
        """Set the RNG streams back to this state (autocast is entered separately)."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None and torch.cuda.is_initialized():
            torch.cuda.set_rng_state_all(self.cuda)
        if self.python is not None:
            random.setstate(self.python)

    def __repr__(self) -> str:
        cuda = f", {len(self.cuda)} CUDA generator(s)" if self.cuda is not None else ""
        autocast = f", autocast {self.autocast}" if self.autocast else ""
        return f"<numguard CallState: CPU generator{cuda}{autocast}>"


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype if autocast is enabled for `device_type`, else None (never raises)."""
    try:
        try:
            if torch.is_autocast_enabled(device_type):
                return torch.get_autocast_dtype(device_type)
            return None
        except (TypeError, AttributeError):  # torch < 2.4: no device_type argument
            if device_type == "cpu":
                return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
            return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    except Exception:
        return None


def take() -> CallState:
    """The state now: CPU (and, if initialised, CUDA) RNG states, autocast, grad and inference
    mode; about 25 us."""
    cuda = None
    if torch.cuda.is_initialized():
        try:
            cuda = torch.cuda.get_rng_state_all()
        except Exception:  # e.g. during CUDA graph capture
            cuda = None
    autocast = tuple(
        (device, dtype) for device in AUTOCAST_DEVICES
        for dtype in (autocast_dtype(device),) if dtype is not None
    )
    return CallState(torch.get_rng_state(), cuda, random.getstate(), autocast,
                     torch.is_inference_mode_enabled(), torch.is_grad_enabled())


def enter_autocast(state: Optional[CallState], stack: contextlib.ExitStack) -> None:
    """Enter the autocast settings of `state` (when given) on `stack`."""
    if state is None:
        return
    wanted = dict(state.autocast)
    for device in set(AUTOCAST_DEVICES) | set(wanted):
        dtype = wanted.get(device)
        current = autocast_dtype(device)
        if dtype is not None and current != dtype:
            stack.enter_context(torch.autocast(device_type=device, dtype=dtype))
        elif dtype is None and current is not None:
            stack.enter_context(torch.autocast(device_type=device, enabled=False))


def entered(state: Optional[CallState], stack: contextlib.ExitStack, grad: bool) -> None:
    """Set the RNG streams to `state` and enter its autocast on `stack`, with grad mode `grad`
    (inference mode where the call ran in it and no grad is wanted). `state` None: grad mode only."""
    if state is not None:
        state.restore()
    enter_autocast(state, stack)
    if state is not None and state.inference and not grad:
        stack.enter_context(torch.inference_mode())
    else:
        stack.enter_context(torch.set_grad_enabled(grad))


# ---- what a re-run changes, put back -------------------------------------------------------
class Kept:
    """The random state, the training flags and (with `buffers`) the buffers of `modules` and
    everything inside them, taken now; put back on `restore()` or on leaving the `with` block."""

    def __init__(self, modules: Iterable[torch.nn.Module], buffers: bool = True):
        self.state = take()
        unique = {id(m): m for root in modules for m in root.modules()}
        self.flags = [(m, m.training) for m in unique.values()]
        self.buffers = []
        self.names = []  # (module, the names of its buffers)
        if buffers:
            with torch.no_grad():
                for module in unique.values():
                    # (.keys(): a TorchScript module's buffer dict has no iterator)
                    self.names.append((module, set(module._buffers.keys())))
                    for name, buffer in module._buffers.items():
                        if buffer is None or isinstance(buffer, UninitializedTensorMixin):
                            self.buffers.append((module, name, buffer, None, -1))
                            continue
                        version = buffer._version if _whole_storage(buffer) else -1
                        self.buffers.append((module, name, buffer, buffer.clone(), version))

    def restore(self) -> None:
        """The buffers back (None ones too; those registered since taken out), their values
        written through `.data`, which moves no version counter: the caller's graph may have saved
        a buffer for its backward, which checks that nothing wrote it since. A buffer the re-run
        wrote itself gets its version counter back too, where it is all of its storage (a view's
        other values are not put back, and what saved them must still see the change)."""
        moved = []
        with torch.no_grad():
            for module, names in self.names:
                for name in set(module._buffers.keys()) - names:
                    del module._buffers[name]
            for module, name, buffer, saved, version in self.buffers:
                module._buffers[name] = buffer
                if saved is None:
                    continue
                try:
                    buffer.data.copy_(saved)
                except RuntimeError:
                    if buffer.is_inference():
                        with torch.inference_mode():  # (written only in inference mode)
                            buffer.copy_(saved)
                    else:  # another shape now (set through .data), or expanded: as it was
                        buffer.data = saved
                if version >= 0 and buffer._version != version:
                    moved.append((buffer, version))
        _set_versions(moved)
        for module, flag in self.flags:
            module.training = flag
        self.state.restore()

    def __enter__(self) -> "Kept":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def _whole_storage(t: torch.Tensor) -> bool:
    """Whether `t` is all of its storage (no view of a larger tensor), with a version counter."""
    try:
        return (t.layout == torch.strided and not t.is_inference() and t._base is None
                and t.storage_offset() == 0 and _dense(t)
                and t.untyped_storage().nbytes() == t.numel() * t.element_size())
    except (RuntimeError, NotImplementedError, TypeError):  # a subclass without plain storage
        return False


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill a block of memory once each, in some order of its dimensions
    (a channels-last tensor does; an expanded one does not): its strides, smallest first, are
    those of a contiguous tensor of its sizes in that order."""
    expected = 1
    for dim in sorted(range(t.dim()), key=t.stride):
        if t.size(dim) != 1:
            if t.stride(dim) != expected:
                return False
            expected *= t.size(dim)
    return True


def _set_versions(moved: list) -> None:
    """Set the version counters of [(tensor, version)] back, their values being what they were
    then (torch's own means, where it has them: a write to a saved buffer otherwise fails the
    caller's backward)."""
    setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    if setter is None or not moved:
        return
    try:
        setter(tuple(t for t, _ in moved), tuple(v for _, v in moved))
    except TypeError:  # (older torch: one tensor at a time)
        for t, version in moved:
            setter(t, version)


# A forward's buffers copied at each top-level call under ops=True: each one up to the first
# size, or one seen written by a forward; all together up to the second.
SMALL_BUFFER_BYTES = 2**20
BUFFER_COPY_BYTES = 64 * 2**20


def buffers_at_start(root: torch.nn.Module, written=frozenset()) -> Optional[list]:
    """(module, name, weak reference to the buffer, copy) of the floating buffers of `root` that
    its forward may update (in place, or by assigning a new tensor) and read again (an EMA, a
    codebook), taken as a call starts, so that a re-run of the call can start from what it saw:
    the small ones, and larger ones a forward was seen writing (`written`: (id of the module,
    name) pairs). Normalisation layers' running statistics are left out: in training they shape
    no output. None past `BUFFER_COPY_BYTES`."""
    copies, size = [], 0
    with torch.no_grad():
        for module in root.modules():
            if isinstance(module, torch.nn.modules.batchnorm._NormBase):
                continue
            for name, buffer in module._buffers.items():
                if buffer is None or not buffer.is_floating_point():
                    continue
                nbytes = buffer.numel() * buffer.element_size()
                if nbytes > SMALL_BUFFER_BYTES and (id(module), name) not in written:
                    continue  # (a table the forward only reads, say)
                size += nbytes
                if size > BUFFER_COPY_BYTES:
                    return None
                copies.append((module, name, weakref.ref(buffer), buffer.clone()))
    return copies


def finite_running_statistics(modules: Iterable[torch.nn.Module]) -> None:
    """Set non-finite running statistics of normalisation layers in training (BatchNorm's, an
    InstanceNorm's that tracks them) to finite values (mean 0, variance 1), inside a `Kept`: the
    call a re-run repeats updated them already, from its data, and a nan there would read as
    statistics gone bad before the call. In training they do not shape the outputs."""
    norm = torch.nn.modules.batchnorm._NormBase
    with torch.no_grad():
        for root in modules:
            for module in root.modules():
                if isinstance(module, norm) and module.training and module.running_mean is not None:
                    module.running_mean.nan_to_num_(0.0, 0.0, 0.0)
                    module.running_var.nan_to_num_(1.0, 1.0, 1.0)


class CallerRandomState:
    """The caller's generators, set back after a replay drew from a captured call's states (on a
    CUDA device, taken just before it is first set: the replay itself may initialise CUDA)."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda: Optional[Tuple[int, torch.Tensor]] = None

    def set_for(self, cpu: Optional[torch.Tensor], cuda: Optional[torch.Tensor],
                device: torch.device) -> None:
        """Set the generators to a captured call's states (`cuda`: the replay device's)."""
        if cpu is not None:
            torch.set_rng_state(cpu)
        if device.type == "cuda" and cuda is not None:
            index = device.index if device.index is not None else 0
            if self.cuda is None:
                self.cuda = (index, torch.cuda.get_rng_state(index))
            torch.cuda.set_rng_state(cuda, index)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda[1], self.cuda[0])


# ---- running alone -------------------------------------------------------------------------
def without_parallel_wrapper(module):
    """The module a re-run on this rank alone calls: inside a (Distributed)DataParallel wrapper,
    whose forward would broadcast buffers or scatter inputs (a collective the other ranks never
    join)."""
    from torch import nn

    while isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        module = module.module
    return module


def redirected_forward(module: torch.nn.Module) -> Optional[Callable]:
    """The forward an instance runs under now, where it is its own: Lightning's strategies
    (DDP, FSDP) point a LightningModule's forward at training_step while its wrapper calls it.
    A re-run of the module alone needs it back (`forward_as`)."""
    return module.__dict__.get("forward")


@contextlib.contextmanager
def forward_as(module: torch.nn.Module, forward: Optional[Callable]):
    """Calls of `module` inside run `forward` (None: the module as it is); put back after."""
    if forward is None:
        yield
        return
    before = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if before is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = before


def eager(module: torch.nn.Module) -> torch.nn.Module:
    """The original of a `torch.compile` wrapper (of wrappers), else `module`."""
    original = compiled_original(module)
    return module if original is None else eager(original)


def run_alone(module: torch.nn.Module) -> torch.nn.Module:
    """What a re-run calls for `module`: eager, and inside a (Distributed)DataParallel wrapper,
    whose forward would start collectives on this rank alone (the names stay the wrapper's)."""
    module = without_parallel_wrapper(eager(module))
    return run_alone(module) if compiled_original(module) is not None else module


def original_name(name: str) -> str:
    """A name as in the original model: 'encoder._orig_mod.layer' -> 'encoder.layer'."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def involves_compiled(module: torch.nn.Module) -> bool:
    return any(compiled_original(m) is not None for m in module.modules())


def compiled_parts(root: torch.nn.Module) -> List[tuple]:
    """(parent, key, wrapper) of every compiled wrapper in `root`, itself included (parent None)."""
    parts, stack = [], [(None, "", root)]
    while stack:
        parent, key, module = stack.pop()
        original = compiled_original(module)
        if original is not None:
            parts.append((parent, key, module))
            module = original
        stack.extend((module, k, child) for k, child in module._modules.items() if child is not None)
    return parts


@contextlib.contextmanager
def swapped(parts, replacement: Callable):
    """Each compiled submodule replaced in its parent by `replacement(wrapper)`, then put back."""
    done = []
    try:
        for parent, key, wrapper in parts:
            if parent is not None:
                parent._modules[key] = replacement(wrapper)
                done.append((parent, key, wrapper))
        yield
    finally:
        for parent, key, wrapper in reversed(done):
            parent._modules[key] = wrapper


def eager_stance():
    """Compiled code runs eagerly inside (torch >= 2.6; a no-op before)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def aot_eager(module: torch.nn.Module) -> torch.nn.Module:
    """The original of a compiled wrapper compiled again with backend="aot_eager": Dynamo's graph
    and AOTAutograd's decompositions, run by eager kernels."""
    original = compiled_original(module)
    if original is None:
        return module
    return torch.compile(eager(original), backend="aot_eager")


def collective_in(module) -> Optional[str]:
    """Why running `module` again on this rank alone would start a collective the other ranks
    never join ('' or None: it would not): FSDP's parameter all-gathers, SyncBatchNorm's
    all-reduce in training. Only with more than one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    from torch import nn

    fsdp2 = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
    for name, sub in module.named_modules():
        kind = type(sub).__name__
        if (fsdp2 is not None and isinstance(sub, fsdp2)) or kind == "FullyShardedDataParallel":
            return (f"{name or 'the model'} is sharded with FSDP: a re-run on this rank alone "
                    "would all-gather its parameters, a collective the other ranks never join")
        if isinstance(sub, nn.SyncBatchNorm) and sub.training:
            return (f"{name or 'the model'} is a SyncBatchNorm in training: a re-run on this rank "
                    "alone would all-reduce its statistics, a collective the other ranks never join")
    return None

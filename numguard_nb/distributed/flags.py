"""Which rank made the first non-finite value, learnt at the gradient all-reduce DDP makes anyway.

Contract: `RankFlags.attach(model)` (`attach_any(models)`: the first of a guard's models, or the
DDP wrapper around one) gives the flags of a DDP or FSDP2 (`fully_shard`) model in a world of
several processes: its reduction (`flagged_allreduce`, DDP's communication hook; FSDP2's
reduce-scatter) also carries, per rank, whether its own gradients held inf/nan before the
reduction and whether it holds a problem found in its forward (`hold`); `producers()` reads them
after a backward. No extra collective, no host read in a healthy step. `several_processes()`: a
world of more than one process.

Limits: a communication hook cannot be removed from a DDP model (after detach it does exactly
DDP's own all-reduce); a model with a hook or reduce-scatter of the user's gets no flags (None),
and its reports do not name the producing rank. Nothing here reads a report or a guard: the
guard's side is `guard.rank_reports`.

    >>> flags = RankFlags.attach(ddp_model)       # None: not DDP, one process, or a hook of yours
    >>> made = flags.producers()                   # after a backward: ranks whose own values broke
"""

from __future__ import annotations

import math
import warnings
from typing import List, Optional, Tuple, Union

import torch

from .. import numerics
from .._util import user_stacklevel

__all__ = ["RankFlags", "flagged_allreduce", "several_processes"]

_ATTRIBUTE = "_numguard_rank_flags"  # where a DDP model keeps its RankFlags (one hook per model)


class RankFlags:
    """The communication hook's state for one DDP model: this rank's flags for the step being
    reduced, and every rank's once reduced."""

    def __init__(self, group, rank: int, world: int):
        self.group = group
        self.rank = rank
        self.world = world
        self.active = False  # False: the hook is DDP's own all-reduce, nothing added
        self.users = 0  # guards attached that use these flags (a sentinel and its sampled batches)
        self.local: Optional[torch.Tensor] = None  # this rank's buckets held inf/nan (device)
        # this rank's sentinel holds a forward problem this step: True, or on an asynchronous
        # device its outputs' flag (`numerics.output_flag`), not read
        self.forward_problem: Union[bool, torch.Tensor] = False
        self.reduced: Optional[torch.Tensor] = None  # the last step's flags, summed over ranks
        self.fresh = False  # reduced since `take_fresh` last looked
        self.held: Optional[BaseException] = None  # full mode: a forward detection held (`hold`)
        self.sharded = False  # FSDP2: a re-run must be made by every rank together
        self._known: Optional[Tuple[List[int], List[int]]] = None  # `reduced`, read

    @classmethod
    def attach(cls, model) -> Optional["RankFlags"]:
        """The flags of a DDP model in a world of several processes, its hook registered once;
        None for any other model, or one with a communication hook of the user's."""
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if not dist.is_available() or not dist.is_initialized():
            return None
        flags = getattr(model, _ATTRIBUTE, None)
        if flags is None and isinstance(model, DistributedDataParallel):
            if getattr(model, "_comm_hooks", None):
                return None  # the user's own hook: DDP takes one only
            group = model.process_group
            flags = cls(group, dist.get_rank(group), dist.get_world_size(group))
            if flags.world < 2:
                return None
            model.register_comm_hook(flags, flagged_allreduce)
            setattr(model, _ATTRIBUTE, flags)
        elif flags is None:
            flags = _fsdp2_flags(cls, model)
            if flags is None:
                return None
        if not flags.users:
            flags.active, flags.reduced = True, None
        flags.users += 1
        return flags

    def detach(self, watch=None) -> None:
        """One guard less; with none left, the hook is DDP's own all-reduce again. A forward
        detection still held (no backward came) goes to `watch.unraised`: raised on exit."""
        if self.held is not None and watch is not None and watch.unraised is None:
            watch.unraised = self.held
        self.users = max(self.users - 1, 0)
        if not self.users:
            self.active = self.fresh = self.forward_problem = False
            self.local = self.reduced = self._known = self.held = None

    @classmethod
    def attach_any(cls, models: dict) -> Optional["RankFlags"]:
        """The flags of the first DDP or FSDP2 model among a guard's models (see `attach`), or of
        the DDP wrapper around one (a Trainer's callbacks are handed the model it wraps)."""
        from ..rerun import eager

        # (a torch.compile wrapper of a DDP model: the DDP model inside it)
        found = next(filter(None, (cls.attach(eager(model)) for model in models.values())), None)
        if found is None and several_processes():
            wrappers = list(filter(None, map(_ddp_around, models.values())))
            found = next(filter(None, map(cls.attach, wrappers)), None)
            unflagged = None if found is not None else next(filter(None, map(
                _unflagged_parallel, [eager(model) for model in models.values()] + wrappers)), None)
            if unflagged is not None:
                warnings.warn(
                    f"numguard: {unflagged}, on several ranks: the guard carries no flag "
                    "on its gradients' reduction, so a rank that finds inf/nan stops alone and "
                    "the others wait in their next collective until the process group's timeout "
                    "(DDP without a comm hook of yours, and FSDP2's fully_shard on one mesh "
                    "dimension, stop every rank together)", stacklevel=user_stacklevel())
        return found

    def hold(self, error: BaseException, in_forward: bool = True) -> bool:
        """Hold a detection until this step's backward has been reduced and the callbacks after
        it have run (FSDP2's own end of backward reduces the root's gradients there), so that
        this rank still joins every collective of the step (`settle`). One made before the
        backward (a forward's, the loss code's) rides on the reduction as this rank's forward
        problem: every rank learns of it there; False where no backward will come (no grad).
        A backward's own: its gradients carry it already. The first held stays held."""
        if in_forward and not torch.is_grad_enabled():
            return False
        if self.held is None:
            self.held = error
        if in_forward:
            self.forward_problem = True
        return True

    def take_held(self) -> Optional[BaseException]:
        """The detection held, taken to be raised now, with this rank's flags of its step."""
        held, self.held = self.held, None
        if held is not None:
            self.forget_step()
        return held

    def forget_step(self) -> None:
        """This rank's flags of the step a held problem is raised in (under `no_sync` no
        reduction carried them: they must not ride on the next one)."""
        self.local, self.forward_problem = None, False

    def producers(self) -> Tuple[List[int], List[int]]:
        """(ranks whose own gradients held inf/nan before the reduction, ranks whose sentinel
        held a forward problem), from the last step reduced (a host read of device flags: on a
        GPU call it only once a step is known to have failed)."""
        if self.reduced is None:
            return [], []
        if self._known is None:
            values, world = numerics.read(self.reduced), self.world
            self._known = ([r for r in range(world) if values[r] > 0],
                           [r for r in range(world) if values[world + r] > 0])
        return self._known

    def take_fresh(self) -> Optional[Tuple[List[int], List[int]]]:
        """`producers()` of a reduction made since the last call, else None (a backward under
        `no_sync` reduces nothing: its gradients are this rank's own)."""
        if not self.fresh:
            return None
        self.fresh = False
        self.local, self.forward_problem = None, False  # (FSDP2: each group carried them)
        return self.producers()

    def _flags_now(self, like: torch.Tensor) -> torch.Tensor:
        """This rank's 2 x world flags as they stand: its own gradients so far, its forward."""
        mine = torch.zeros(2 * self.world, dtype=like.dtype, device=like.device)
        if self.local is not None:
            mine[self.rank] = self.local.to(like.dtype)
        if isinstance(self.forward_problem, torch.Tensor):
            mine[self.world + self.rank] = (~(self.forward_problem < math.inf)).to(like.dtype).sum()
        elif self.forward_problem:
            mine[self.world + self.rank] = 1
        return mine

    def note_forward_flag(self, flag: torch.Tensor) -> None:
        """An asynchronous device: a forward's outputs flag, carried by this step's reduction
        without being read (a held forward problem on the host is `forward_problem = True`)."""
        if isinstance(self.forward_problem, torch.Tensor):
            flag = torch.maximum(self.forward_problem, flag)
        if self.forward_problem is not True:
            self.forward_problem = flag

    def take_fresh_verdict(self) -> Optional[torch.Tensor]:
        """A reduction made since the last look, as a float32 vector on its device, not read:
        +inf where a rank's gradients (first `world` places) or forward (the next `world`) held
        inf/nan, else -1 (`numerics.fine` tells); None where nothing was reduced."""
        if not self.fresh or self.reduced is None:
            return None
        self.fresh = False
        self.local, self.forward_problem = None, False
        return torch.where(self.reduced > 0, math.inf, -1.0).float()

    def producers_of(self, verdict: list) -> Tuple[List[int], List[int]]:
        """`producers()` from a verdict's host values (`take_fresh_verdict`)."""
        world = self.world
        return ([r for r in range(world) if not numerics.fine(verdict[r])],
                [r for r in range(world) if not numerics.fine(verdict[world + r])])

    def _reduced(self, flags: torch.Tensor) -> None:
        """Flags summed over the ranks by one reduction of this step (FSDP2: one per group)."""
        if self.fresh and self.reduced is not None:
            flags = torch.maximum(self.reduced, flags)
        self.reduced, self._known, self.fresh = flags.clone(), None, True


def flagged_allreduce(flags: RankFlags, bucket) -> "torch.futures.Future":
    """DDP's all-reduce (divide by the world size, then sum), with `flags` riding on the bucket
    reduced last of each step."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    if not flags.active:
        return _allreduce(flags.group, buffer)
    with torch.no_grad():
        bad = ~torch._foreach_norm([buffer], 2, dtype=torch.float32)[0].isfinite()
        flags.local = bad if flags.local is None else flags.local | bad
        if not bucket.is_last():
            return _allreduce(flags.group, buffer)
        world, size = flags.world, buffer.numel()
        mine = flags._flags_now(buffer)
        flags.local, flags.forward_problem = None, False
        packed = torch.cat([buffer, mine])
        packed[:size].div_(world)  # as DDP's own hook: the division first

    def unpack(future):
        reduced = future.value()[0]
        buffer.copy_(reduced[:size])
        flags._reduced(reduced[size:])
        return buffer

    return dist.all_reduce(packed, group=flags.group, async_op=True).get_future().then(unpack)


def _unflagged_parallel(model) -> Optional[str]:
    """What `model` is where it runs on several ranks in a way the guard carries no flags on
    (a DDP model with the user's comm hook, FSDP1, HSDP, `replicate()`), or None."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return f"{type(model.module).__name__} is wrapped in DDP with a communication hook of yours"
    try:
        from torch.distributed._composable_state import _get_module_state
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # an older torch
        return None
    for module in model.modules():
        if type(module).__module__.startswith("torch.distributed._composable.replicate"):
            return f"{type(model).__name__} runs under replicate()"
        if isinstance(module, FullyShardedDataParallel):
            inner = model.module if isinstance(model, FullyShardedDataParallel) else model
            return f"{type(inner).__name__} is sharded with FSDP (FullyShardedDataParallel)"
        if _get_module_state(module) is not None:
            return (f"{type(model).__name__} runs under fully_shard on a 2-D mesh (HSDP) or with "
                    "a reduce-scatter of yours")
    return None


def several_processes() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _ddp_around(model):
    """The DistributedDataParallel wrapping `model` (as its module, or inside it: Lightning wraps
    the LightningModule in a wrapper of its own first), found among the live objects: a Trainer's
    callbacks are handed the model, not the wrapper. Once per attach, in a distributed run."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    for candidate in gc.get_objects():  # (type(), not isinstance: some objects warn when asked)
        if issubclass(type(candidate), DistributedDataParallel) and any(
                m is model for m in candidate.module.modules()):
            return candidate
    return None


def _allreduce(group, tensor: torch.Tensor):
    import torch.distributed as dist

    tensor.div_(group.size())
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(
        lambda future: future.value()[0])


# DDP checks a hook's return annotation by value (this module's annotations are strings).
flagged_allreduce.__annotations__["return"] = torch.futures.Future[torch.Tensor]


# ---- FSDP2: the flags ride on each group's gradient reduce-scatter -------------------------------
def _fsdp2_flags(cls, model) -> Optional["RankFlags"]:
    """The flags of a model sharded with FSDP2 (`fully_shard`), its reduce-scatters replaced by
    `_flagged_reduce_scatter`'s on every FSDP module; None for another model, one process, or
    one with a reduce-scatter of the user's."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError:  # an older torch
        return None
    shards = [m for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [group for m in shards for group in m._get_fsdp_state()._fsdp_param_groups]
    if not groups or any(type(g._reduce_scatter_comm) is not DefaultReduceScatter for g in groups):
        return None  # not FSDP2, or a reduce-scatter of the user's (or one already flagged)
    group = getattr(groups[0].mesh_info, "shard_process_group", None)
    if group is None:
        return None
    flags = cls(group, group.rank(), group.size())
    if flags.world < 2:
        return None
    flags.sharded = True
    comm = _flagged_reduce_scatter()(flags)
    for g in groups:  # (FSDP's own setter refuses some layouts: set on each group)
        g._reduce_scatter_comm = comm
    setattr(model, _ATTRIBUTE, flags)
    return flags


_REDUCE_SCATTER: list = []


def _flagged_reduce_scatter():
    """FSDP2's default reduce-scatter, with this rank's flags after each rank's shard."""
    if _REDUCE_SCATTER:
        return _REDUCE_SCATTER[0]
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class FlaggedReduceScatter(DefaultReduceScatter):
        def __init__(self, flags: RankFlags):
            self.flags = flags

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            flags = self.flags
            if not flags.active or async_op:
                return super().__call__(output_tensor, input_tensor, group, op, async_op)
            with torch.no_grad():
                bad = ~torch._foreach_norm([input_tensor], 2, dtype=torch.float32)[0].isfinite()
                flags.local = bad if flags.local is None else flags.local | bad
                world, shard = group.size(), output_tensor.numel()
                mine = flags._flags_now(input_tensor)
                padded = torch.cat([input_tensor.view(world, shard),
                                    mine.expand(world, mine.numel())], dim=1).reshape(-1)
                out = output_tensor.new_empty(shard + mine.numel())
                work = dist.reduce_scatter_single(out, padded, group=group, op=op)
                output_tensor.copy_(out[:shard])
                flags._reduced(out[shard:])
            return work

    _REDUCE_SCATTER.append(FlaggedReduceScatter)
    return FlaggedReduceScatter


"""The diagnosis suite's ground truth: where a case's first inf/nan is really made.

Runs a case's training steps (data, forward, loss, backward, optimizer step) with every ATen op
watched by a TorchDispatchMode. An op *produces* a non-finite value when its output holds a nan
none of its inputs held, or an inf while all its inputs were finite; Python numbers count as
inputs, so `masked_fill(mask, float("-inf"))` and `torch.full(..., -inf)` write -inf on purpose
and produce nothing. Each producer is attributed to

- the module whose forward was running (forward pre/post hooks keep the qualified name), or,
  for code outside every module of the case, the part of the step running (the data pipeline,
  the training loop's own code such as a loss, the optimizer step);
- in backward, the module whose forward created the autograd node being run: a
  TorchFunctionMode labels every node a call creates with the module running at that moment,
  and `torch._C._current_autograd_node()` names the node an op runs in.

A step is corrupted when its loss is non-finite or a parameter is non-finite after it. A run
with no corrupted step is healthy, whatever passed through it (-inf masks, loss-scaled gradients
that GradScaler skips); otherwise the culprit is the first producer of the first corrupted step.

Deliberately independent of numguard_nb: nothing here imports it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from diagnosis_cases import (
    BACKWARD, DATA, FORWARD, IN_DATA, IN_LOOP, IN_OPTIMIZER, OPTIMIZER, Case, Truth, run_steps,
)

# Part of a step -> (its phase, where code outside every module runs in it).
_PARTS = {DATA: (FORWARD, IN_DATA), FORWARD: (FORWARD, IN_LOOP), BACKWARD: (BACKWARD, IN_LOOP),
          OPTIMIZER: (OPTIMIZER, IN_OPTIMIZER)}
# Ops whose output is uninitialised memory: whatever bits they return were not computed.
_UNINITIALISED = frozenset(("aten.empty", "aten.empty_like", "aten.empty_strided",
                            "aten.new_empty", "aten.new_empty_strided", "aten.resize_"))


@dataclass
class Producer:
    """One op that made a non-finite value out of finite (or nan-free) inputs."""

    batch: int
    phase: str
    module: str
    op: str
    node: Optional[str]  # the autograd node it ran in (backward only)
    made: str  # "nan" or "inf"

    def as_truth(self) -> Truth:
        return Truth(module=self.module, phase=self.phase, op=self.op, batch=self.batch,
                     node=self.node)


@dataclass
class TraceResult:
    """What the tracer saw in a whole run of a case."""

    healthy: bool
    culprit: Optional[Producer]  # first producer of the first corrupted step; None if healthy
    first_producers: Dict[int, Producer] = field(default_factory=dict)  # batch -> first producer
    nonfinite_seen: bool = False  # some op output held inf/nan (a mask, a scaled gradient, ...)
    losses: List[float] = field(default_factory=list)
    crash: Optional[str] = None  # the exception that ended the run early, if one did

    @property
    def truth(self) -> Optional[Truth]:
        return self.culprit.as_truth() if self.culprit is not None else None


def _scan(values) -> tuple:
    """(holds a nan, holds any non-finite value) over the tensors and floats in `values`."""
    has_nan = has_nonfinite = False
    for leaf in tree_leaves(values):
        if isinstance(leaf, torch.Tensor):
            if not (leaf.is_floating_point() or leaf.is_complex()) or leaf.numel() == 0:
                continue
            if leaf.layout != torch.strided or leaf.device.type == "meta":
                continue
            if not bool(torch.isfinite(leaf).all()):
                has_nonfinite = True
                has_nan = has_nan or bool(torch.isnan(leaf).any())
        elif isinstance(leaf, float) and not math.isfinite(leaf):
            has_nonfinite = True
            has_nan = has_nan or math.isnan(leaf)
        if has_nan:
            break
    return has_nan, has_nonfinite


def _op_name(func) -> str:
    return str(func)  # "aten.mm.default"


class _Tracer:
    """Module scope, node labels and op checks for one run of a case."""

    def __init__(self):
        self.phase = FORWARD
        self.outside = IN_LOOP  # what code outside every module is called in the current part
        self.batch = 0
        self.scope: List[str] = []  # qualified names of the module calls running now
        self.node_module: Dict[object, str] = {}  # autograd node -> module that created it
        self.first_producers: Dict[int, Producer] = {}
        self.nonfinite_seen = False
        self.handles: list = []

    # ---- where an op runs ------------------------------------------------------------------
    def enter(self, part: str, batch: int):
        """`run_steps`' phase hook: note the part of the step and the batch being run."""
        self.phase, self.outside = _PARTS[part]
        self.batch = batch
        return contextlib.nullcontext()

    def attach(self, models: Dict[str, torch.nn.Module]) -> None:
        for prefix, root in models.items():
            for name, module in root.named_modules():
                full = name if not prefix else (f"{prefix}.{name}" if name else prefix)
                self.handles.append(module.register_forward_pre_hook(self._enter(full)))
                self.handles.append(module.register_forward_hook(self._leave, always_call=True))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _enter(self, name: str):
        def hook(module, args):
            self.scope.append(name)
        return hook

    def _leave(self, module, args, output):
        self.scope.pop()

    def current_module(self) -> str:
        return self.scope[-1] if self.scope else self.outside

    def label_nodes(self, output) -> None:
        """Give every autograd node a forward call just created the module running it."""
        module = self.current_module()
        pending = [leaf.grad_fn for leaf in tree_leaves(output)
                   if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None]
        while pending:
            node = pending.pop()
            if node is None or node in self.node_module:
                continue
            self.node_module[node] = module
            pending.extend(next_node for next_node, _ in node.next_functions)

    # ---- what an op makes ------------------------------------------------------------------
    def check(self, func, inputs_nan: bool, inputs_nonfinite: bool, output) -> None:
        out_nan, out_nonfinite = _scan(output)
        if not out_nonfinite:
            return
        self.nonfinite_seen = True
        made_nan = out_nan and not inputs_nan
        made_inf = out_nonfinite and not inputs_nonfinite
        name = _op_name(func)
        if not (made_nan or made_inf) or name.rsplit(".", 1)[0] in _UNINITIALISED:
            return
        if self.batch in self.first_producers:
            return
        node = torch._C._current_autograd_node() if self.phase == BACKWARD else None
        if node is not None:
            module = self.node_module.get(node, self.outside)
        elif self.phase == FORWARD:
            module = self.current_module()
        else:
            module = self.outside
        self.first_producers[self.batch] = Producer(
            batch=self.batch, phase=self.phase, module=module, op=name,
            node=node.name() if node is not None else None, made="nan" if made_nan else "inf")


class _LabelMode(TorchFunctionMode):
    def __init__(self, tracer: _Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        if self.tracer.phase == FORWARD:
            self.tracer.label_nodes(output)
        return output


class _CheckMode(TorchDispatchMode):
    def __init__(self, tracer: _Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Inputs are read before the op runs: an in-place op overwrites them.
        inputs_nan, inputs_nonfinite = _scan((args, kwargs))
        output = func(*args, **kwargs)
        self.tracer.check(func, inputs_nan, inputs_nonfinite, output)
        return output


def _all_finite(models: Dict[str, torch.nn.Module]) -> bool:
    return all(bool(torch.isfinite(p).all())
               for model in models.values() for p in model.parameters())


def trace(case: Case) -> TraceResult:
    """Run `case` from scratch under the tracer and say where its first inf/nan was made."""
    run = case.build()
    tracer = _Tracer()
    corrupted: List[int] = []
    losses: List[float] = []

    def after_step(batch: int, loss: torch.Tensor) -> None:
        value = float(loss.detach().float())
        losses.append(value)
        if not math.isfinite(value) or not _all_finite(run.models):
            corrupted.append(batch)
        tracer.node_module.clear()  # the step's graph is gone

    tracer.attach(run.models)
    crash = None
    try:
        with _LabelMode(tracer), _CheckMode(tracer):
            run_steps(run, phase=tracer.enter, after_step=after_step)
    except Exception as exc:  # the run crashed (BCELoss refuses nan probabilities): corrupted
        crash = f"{type(exc).__name__}: {exc}"
        if not corrupted:
            corrupted.append(tracer.batch)
    finally:
        tracer.detach()
    culprit = tracer.first_producers.get(corrupted[0]) if corrupted else None
    return TraceResult(healthy=not corrupted, culprit=culprit,
                       first_producers=dict(tracer.first_producers),
                       nonfinite_seen=tracer.nonfinite_seen, losses=losses, crash=crash)

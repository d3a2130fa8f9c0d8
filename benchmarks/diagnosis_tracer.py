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

In backward, a value the forward computed and autograd saved (a softmax's output, read again by
its backward) is not an input of the backward op that reads it: the forward judged it already.
An op of backward produces a non-finite value when the gradients and finite values it reads do
not hold one: `_softmax_backward_data` of a finite gradient and a saved row of nan produces nan.
An op that reads saved values and no other floating-point tensor (nan_to_num's backward testing
its saved input) computes one more such value, not a gradient: it produces nothing.

A step is corrupted when its loss is non-finite, a parameter is non-finite or a floating buffer
finite before it is not after it (a codebook or running statistics the forward updates). A run
with no corrupted step is healthy, whatever passed through it (-inf masks, loss-scaled gradients
that GradScaler skips); otherwise the culprit is the first producer of the first corrupted step,
counting only producers after the forward when the step's loss is finite and its buffers stayed
finite: whatever its forward made never reached the loss (a log(0) that `where` drops, a nan
row that nan_to_num zeroes), and the step was corrupted in backward or by the optimizer.

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
    # batch -> first producer in backward or the optimizer step
    first_after_forward: Dict[int, Producer] = field(default_factory=dict)
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


def _where(tensor: torch.Tensor) -> tuple:
    """Where a tensor's values live: the same for the forward's output and autograd's copy of it."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype)


class _Tracer:
    """Module scope, node labels and op checks for one run of a case."""

    def __init__(self):
        self.phase = FORWARD
        self.outside = IN_LOOP  # what code outside every module is called in the current part
        self.batch = 0
        self.scope: List[str] = []  # qualified names of the module calls running now
        self.node_module: Dict[object, str] = {}  # autograd node -> module that created it
        self.first_producers: Dict[int, Producer] = {}
        self.first_after_forward: Dict[int, Producer] = {}
        # Non-finite values the step's forward computed, by where they live; kept alive for the
        # step so that no gradient reuses their memory. Backward reads them as saved values.
        self.forward_values: Dict[tuple, torch.Tensor] = {}
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
    def inputs(self, values) -> tuple:
        """(the leaves of an op's arguments that count as its inputs, whether it reads only values
        the forward computed): in backward, those (saved by autograd) are left out."""
        leaves = tree_leaves(values)
        if self.phase != BACKWARD or not self.forward_values:
            return leaves, False
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)
                   and (leaf.is_floating_point() or leaf.is_complex())]
        saved = [leaf for leaf in tensors if _where(leaf) in self.forward_values]
        if not saved:
            return leaves, False
        kept = [leaf for leaf in leaves if not any(leaf is value for value in saved)]
        return kept, len(saved) == len(tensors)

    def check(self, func, inputs_nan: bool, inputs_nonfinite: bool, output,
              recomputes: bool = False) -> None:
        out_nan, out_nonfinite = _scan(output)
        if not out_nonfinite:
            return
        self.nonfinite_seen = True
        if self.phase == FORWARD or recomputes:
            # a forward value, or one that backward computes from forward values alone (a
            # nan_to_num's backward testing its saved input): not a gradient
            for leaf in tree_leaves(output):
                if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
                    self.forward_values[_where(leaf)] = leaf
            if recomputes:
                return
        made_nan = out_nan and not inputs_nan
        made_inf = out_nonfinite and not inputs_nonfinite
        name = _op_name(func)
        if not (made_nan or made_inf) or name.rsplit(".", 1)[0] in _UNINITIALISED:
            return
        if self.batch in self.first_after_forward or (
                self.phase == FORWARD and self.batch in self.first_producers):
            return
        node = torch._C._current_autograd_node() if self.phase == BACKWARD else None
        if node is not None:
            module = self.node_module.get(node, self.outside)
        elif self.phase == FORWARD:
            module = self.current_module()
        else:
            module = self.outside
        producer = Producer(
            batch=self.batch, phase=self.phase, module=module, op=name,
            node=node.name() if node is not None else None, made="nan" if made_nan else "inf")
        self.first_producers.setdefault(self.batch, producer)
        if self.phase != FORWARD:
            self.first_after_forward[self.batch] = producer


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
        inputs, recomputes = self.tracer.inputs((args, kwargs))
        inputs_nan, inputs_nonfinite = _scan(inputs)
        output = func(*args, **kwargs)
        self.tracer.check(func, inputs_nan, inputs_nonfinite, output, recomputes)
        return output


def _all_finite(models: Dict[str, torch.nn.Module]) -> bool:
    return all(bool(torch.isfinite(p).all())
               for model in models.values() for p in model.parameters())


def _finite_buffers(models: Dict[str, torch.nn.Module]) -> set:
    """The qualified names of the floating buffers that hold only finite values."""
    return {f"{key}.{name}" for key, model in models.items() for name, buffer in model.named_buffers()
            if buffer.is_floating_point() and bool(torch.isfinite(buffer).all())}


def trace(case: Case) -> TraceResult:
    """Run `case` from scratch under the tracer and say where its first inf/nan was made."""
    run = case.build()
    tracer = _Tracer()
    corrupted: List[int] = []
    losses: List[float] = []
    finite_loss = set()  # the steps whose loss was finite (and that left the buffers finite)
    finite_buffers = _finite_buffers(run.models)

    def after_step(batch: int, loss: torch.Tensor) -> None:
        value = float(loss.detach().float())
        losses.append(value)
        finite = _finite_buffers(run.models)
        buffers_bad = bool(finite_buffers - finite)
        finite_buffers.intersection_update(finite)
        if not math.isfinite(value) or not _all_finite(run.models) or buffers_bad:
            corrupted.append(batch)
        if math.isfinite(value) and not buffers_bad:
            finite_loss.add(batch)
        tracer.node_module.clear()  # the step's graph is gone
        tracer.forward_values.clear()

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
    culprit = None
    if corrupted:
        # a finite loss: the forward's non-finite values never reached it (see the module's doc)
        step = corrupted[0]
        culprit = (tracer.first_after_forward if step in finite_loss
                   else tracer.first_producers).get(step)
    return TraceResult(healthy=not corrupted, culprit=culprit,
                       first_producers=dict(tracer.first_producers),
                       first_after_forward=dict(tracer.first_after_forward),
                       nonfinite_seen=tracer.nonfinite_seen, losses=losses, crash=crash)

"""The loss watch: the code that runs outside the guarded modules (the loss computed in a cell or
a training loop) and the autograd nodes it creates, checked while a guard is attached.

Contract: it names the torch function (with its ATen op and the user's line) whose outputs first
hold a kind of non-finite value that its inputs did not, in forward, and the autograd node whose
gradients do, in backward. It never blames a function given values already non-finite, nor a
-inf mask made from a scalar; it changes nothing it watches, and leaves each thread's function
mode stack as it found it.

Limits: module internals, and the code between a backward and the next model call, are not its
to watch (the data's and the weights' rules cover them); it is inert while compiling, tracing,
under dispatch modes, inside backward, in the guard's own re-runs, and above a function mode of
the user's entered after the guard attached.

    >>> with Guard(model):
    ...     loss = torch.log(model(x)).mean()   # a log(0) here is named with its line

How it works: docs/architecture.md, "The loss watch".
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Optional

import torch

from .. import _tree
from .._schema import CAUSE_OUTSIDE, FORWARD, INPUT, OUTPUT, OUTSIDE_MODULE
from .._util import caller_at_user_line, forget_callers, function_name
from ..errors import NonFiniteError
from . import detect, frames
from .function_mode import push as _push, stack_len as _stack_len
from .hooks import inert_context
from .outside_mode import (
    MODE, ThreadState, hold_step_hook, leave_if_ownerless, leave_region, outside_checking,
    outside_mode_active, release_step_hook, thread_state, withdraw,
)
from .outside_ops import (
    Meta, aten_ops, fallback_op, in_optimizer, input_role, likeliest, scalar_kinds, source_of,
    user_where,
)
from .outside_checks import (_LEAN_PASS, BackwardWatch, OutsideCall, _finite, _learn_clean,
                             _made_new, dropped_after, fed_to_the_graph, from_the_mask)
from .passes import ENTRY_INDEX, ENTRY_KIND, ENTRY_SHAPE, PassRecord, graph_task_id
from .rank_reports import hold_until_every_rank_knows

__all__ = ["OutsideWatch", "OutsideCall", "outside_mode_active", "outside_checking"]

# A region recording more ops than this is read back and started afresh (a bound on memory).
MAX_REGION_OPS = 1024

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_next_node_number = torch._C._autograd._get_sequence_nr
_INF_KINDS = detect.INF_KINDS
_MASK = detect.MASK


_inplace_names: dict = {}


def _is_inplace(func) -> bool:
    """Whether `func` writes into its first argument (`log_`, `__iadd__`, `add_`)."""
    known = _inplace_names.get(func)
    if known is None:
        name = getattr(func, "__name__", "")
        known = _inplace_names[func] = (name.endswith("_") and not name.endswith("__")) or (
            name.startswith("__i") and name.endswith("__") and name != "__init__")
    return known


def _contained(loss) -> bool:
    """Whether the tensors a backward starts from are finite (a host read: a culprit is held)."""
    try:
        return all(_finite(t) for t in _tree.tensors(loss) if t.is_floating_point())
    except Exception:  # values that cannot be read: judged as before, by the culprit
        return False


class _HeldCulprit:
    """A first culprit carried to the backward that judges it by its loss (`_judge`): one the
    code after a call made (`watch._raise`), or a -inf mask a model put in its output
    (`detect()`). Its owner (the watch, or the guard) is held weakly: a guard dropped meanwhile
    takes its culprit with it."""

    __slots__ = ("owner", "pass_", "call", "bad", "detect", "dropped_later")

    def __init__(self, owner, pass_, call, bad=None, detect=None):
        self.owner, self.pass_, self.call, self.bad = weakref.ref(owner), pass_, call, bad
        self.detect = detect  # (the owner's method name, its arguments): raises the detection
        # a later region's code dropped non-finite values it was given (a target made under
        # no_grad, masked by the loss after the next model call): the loss judges it, as one
        # in the graph
        self.dropped_later = False

    def alive(self):
        return self.owner()


# ---- the watch ----------------------------------------------------------------------------------
class OutsideWatch(BackwardWatch):
    """One guard's watch over the code outside its modules. The Guard calls `start`/`stop` on
    attach/detach, `enter_model` before a top-level call of a guarded module and `leave_model`
    after it; the mode and the node hooks call the rest."""

    def __init__(self, guard):
        self.guard = guard
        self.attached = False
        super().__init__()
        self.unraised: Optional[BaseException] = None  # found at stop, for `raise_found`
        self.recorder = None  # replay.outside.OutsideRecorder while a capture records (start)
        self.contained: list = []  # notes on values made non-finite and discarded (`settle`)
        # A sentinel's backward re-run: the loss judged the model's -inf masks already (a backward
        # followed), so they are no culprit in it
        self.masks_judged = False
        self.may_hold = True  # False for a sentinel's full guards: the sentinel's watch judges
        self._step_hold = [False]  # this watch holds the step pre-hook (released when dropped too)
        weakref.finalize(self, release_step_hook, self._step_hold)
        weakref.finalize(self, leave_if_ownerless)  # a guard dropped while attached

    # ---- lifecycle (called by the Guard) ---------------------------------------------------------
    def start(self, capture=None) -> None:
        """Watch from now on; with a `replay.Capture`, also record the code for a CPU replay."""
        self.recorder = capture.recorder if capture is not None else None
        self.attached = True
        self.unraised = None
        thread_state.base = _stack_len()
        hold_step_hook(self._step_hold)

    def stop(self) -> None:
        """Remove the mode (in this thread) and the node hooks. A culprit in what was still to be
        read is reported (`on_detect`) and kept for `raise_found`."""
        state = thread_state
        try:
            owner = state.owner
            if owner is self or owner is None:  # (None: a re-run's guard took the thread and left)
                withdraw(state, detaching=True)
            if owner is self and self.attached:
                self.unraised = self.settle(state, raising=False, final=True)
        finally:
            self.attached = False
            release_step_hook(self._step_hold)
            if state.owner is self:
                state.owner, state.pass_ = None, None
            self._unhook_nodes()
            forget_callers()  # (each holds the globals of the code it stood in)

    def raise_found(self, when: bool = True) -> None:
        """Raise what `stop` found (on a `with` block's exit without an exception)."""
        error, self.unraised = self.unraised, None
        if error is not None and when:
            raise error

    def enter_model(self) -> None:
        """A top-level call of a guarded module starts: the code before it is over (see
        `leave_region`)."""
        leave_region()

    def leave_model(self) -> None:
        """A top-level call ended: watch the code after it, for this guard, in this thread (never
        above a function mode the user entered since the guard attached)."""
        if not self.attached or graph_task_id() != -1:
            return
        state = thread_state
        self._own(state)
        state.ops = 0
        if not outside_mode_active():
            if _stack_len() != state.base:
                return
            _push(MODE)
        state.active = True

    def _own(self, state: ThreadState) -> None:
        """This thread's code is this watch's from now on: another's is settled first (its held
        culprit goes on to the loss that judges it)."""
        previous = state.owner
        if previous is not self:
            checking = state.active
            state.active = False
            if previous is not None and checking:
                previous.settle(state)
            state.owner, state.pass_ = self, None

    def watching(self) -> bool:
        guard = self.guard
        return (self.attached and not guard.paused and not guard.tracing
                and not inert_context() and graph_task_id() == -1)

    # ---- forward --------------------------------------------------------------------------------
    def run_backward(self, state: ThreadState, func, args, kwargs):
        """`.backward()`: check what the loss made first, then run the backward unwatched."""
        __tracebackhide__ = True  # noqa: F841
        state.active = False  # the mode passes everything through until it can leave the stack
        loss = args[0] if args else kwargs.get("tensors")
        judged: list = []
        self.settle(state, loss=loss, judged=judged)
        if self.judge_loss is not None and loss is not None and self.watching():
            judged += self.judge_loss(loss) or ()  # (a sentinel on a device: a -inf its models gave)
        return caller_at_user_line()(func, args, kwargs)

    def run_function(self, state: ThreadState, func, args, kwargs):
        """Run one torch function and check its floating-point outputs (a function giving none
        costs a type check)."""
        __tracebackhide__ = True  # noqa: F841
        before = None
        if _is_inplace(func) and args and type(args[0]) in _PLAIN and args[0].is_floating_point():
            if not self.watching():
                return caller_at_user_line()(func, args, kwargs)
            before = self._before_inplace(state, args, kwargs)
        first_node = _next_node_number()  # the nodes it makes are numbered from here
        out = caller_at_user_line()(func, args, kwargs)
        if type(out) in _PLAIN:
            if not out.is_floating_point():
                return out
        elif not isinstance(out, (tuple, list)) or type(out) is torch.Size:
            return out
        if before is None and not self.watching():
            return out
        culprit = self._check(state, func, args, kwargs, out, before, first_node)
        if culprit is not None and state.held is None:
            state.held = _HeldCulprit(self, *culprit)  # an error only if the loss is not finite
        return out

    def _before_inplace(self, state: ThreadState, args, kwargs):
        """What a function writing into its first argument must know before it runs: its input
        slots where that argument is already non-finite, or on a device (read later); () where
        it is on the host and finite (it held nothing the function could have been given)."""
        if self._immediate((args[0],)) and _finite(args[0]):
            return ()
        return self._summarise_inputs(self._region(state), args, kwargs)

    def _check(self, state: ThreadState, func, args, kwargs, out, before, first_node: int):
        """Check one function's outputs; where they are on the host, its culprit or None. A
        finite result (the common case) costs a sum per output and, for a function autograd
        records, a hook per node it made; anything else is recorded in full."""
        try:
            outputs = [t for t in _tree.tensors(out) if t.is_floating_point()]
            if not outputs:
                return None
            immediate = self._immediate(outputs)
            # While a culprit is held, a call given its values that gives out finite ones is
            # recorded: it dropped them (`dropped_after`, with no loss to judge by)
            if immediate and all(_finite(t) for t in outputs) and (state.held is None or all(
                    _finite(t) for t in _tree.tensors((args, kwargs)) if t.is_floating_point())):
                if self._records_graph(outputs):
                    call = OutsideCall(function_name(func), FORWARD, self._batch(), state.ops)
                    call.func, call.where, call.clean = func, user_where(), True
                    self._hook_nodes(call, outputs, first_node)
                state.ops += 1
                return None
        except Exception:  # never break the user's loss over the watch's own trouble
            return None
        pass_ = self._region(state)  # (a region grown too long is checked here: it may raise)
        try:
            return self._record(state, pass_, func, args, kwargs, out, outputs, before,
                                immediate, first_node)
        except Exception:
            return None

    def _records_graph(self, outputs) -> bool:
        return self.guard.watch_backward and torch.is_grad_enabled() and any(
            t.grad_fn is not None for t in outputs)

    def _region(self, state: ThreadState) -> PassRecord:
        """The region's record (a region grown past MAX_REGION_OPS is checked and dropped)."""
        pass_ = state.pass_
        if pass_ is None or len(pass_.calls) >= MAX_REGION_OPS:
            if pass_ is not None:
                self.settle(state)
            pass_ = state.pass_ = _LEAN_PASS()
        return pass_

    def _summarise_inputs(self, pass_: PassRecord, args, kwargs, skip_first: bool = False):
        """(input slots, scalar kinds) of a function's arguments (without its first, written
        in place, with `skip_first`); no slots: no floating-point tensor among them."""
        slots, scalars = [], set()
        for role, value in _tree.named_leaves((args, kwargs), "input"):
            if isinstance(value, torch.Tensor):
                if value.is_floating_point() and not (skip_first and value is args[0]):
                    slots.append(self._slot(pass_, value, input_role(role), INPUT))
            elif type(value) is float:
                scalars |= scalar_kinds(value)
        return slots, frozenset(scalars)

    def _slot(self, pass_: PassRecord, t: torch.Tensor, role: str, category: str) -> tuple:
        entry = pass_.summarise(t, None, False, None)
        return (role, category, entry[ENTRY_KIND], t.dtype, entry[ENTRY_SHAPE], entry[ENTRY_INDEX],
                next(pass_.seq))

    def _record(self, state: ThreadState, pass_: PassRecord, func, args, kwargs, out, outputs,
                before, immediate: bool, first_node: int):
        """Record one function call in full (inputs and outputs summarised); where its values
        are on the host, return its culprit or None."""
        if in_optimizer():
            return None  # a step writing weights: the weights' rules name what it wrote
        if before:
            slots, scalars = before
        else:  # a first argument written in place held only finite values: not summarised
            slots, scalars = self._summarise_inputs(pass_, args, kwargs, before is not None)
            if not slots and before is None:  # made from scalars and shapes: a constant, a mask
                return None
        call = OutsideCall(function_name(func), FORWARD, self._batch(), state.ops)
        state.ops += 1
        call.func, call.received, call.where = func, scalars, user_where()
        call.in_graph = any(t.grad_fn is not None for t in outputs)
        call.stage = frames.stage_now(self.guard)  # (a culprit held is raised later, maybe past it)
        call.slots = list(slots)
        single = len(outputs) == 1 and type(out) in _PLAIN
        for index, t in enumerate(outputs):
            call.slots.append(self._slot(pass_, t, "output" if single else f"output[{index}]",
                                         OUTPUT))
        call.seq = next(pass_.seq)
        pass_.calls.append(call)
        call.checked = immediate
        call.meta = _tree.rebuild((args, kwargs), lambda t, _: Meta(t))
        if immediate:
            pass_.read_back()
            _learn_clean(pass_, call, self._inf_allowed())
        else:
            call.pass_ = pass_
        if call.clean is not False and self._records_graph(outputs):
            self._hook_nodes(call, outputs, first_node)
        bad = _made_new(pass_, call, self._inf_allowed()) if immediate else []
        if not bad:
            return None
        ops, first = aten_ops(func, args, kwargs, on_values=before is None)
        call.op = first or likeliest(ops) or fallback_op(func)
        return pass_, call, bad

    def _inf_allowed(self) -> bool:
        return self.guard.options.inf_allowed(OUTSIDE_MODULE)

    def _batch(self) -> int:
        return self.guard.threads.state.batch_number

    def settle(self, state: ThreadState, raising: bool = True, loss=None, final: bool = False,
               before_the_loss: bool = False, at_model_call: bool = False,
               judged: Optional[list] = None):
        """Read the region's statistics back (one transfer on a GPU) and check what was not
        checked yet: its first culprit is held (`state.held`) and judged where it can do harm,
        by the loss of the backward (`loss`: what it starts from; `_judge`). The next function
        starts a new region. Under a sentinel on a GPU the region gives one value on the device
        instead, read when it is there (`_late_region`). `before_the_loss`: `loss` is
        `torch.autograd.grad`'s outputs (a gradient penalty), whose finite values leave what is
        held to the loss that follows. `at_model_call`: a model's call ends the region; read
        later, it goes on past the call instead, to be read with the loss (a target made under
        no_grad before the call, masked by the loss after it). `judged`: filled with the notes of
        the models' -inf a sentinel's loss judgment, read after the region, holds (`_late_region`)."""
        if at_model_call and not final and self._region_read_later(state.pass_):
            return None
        pass_, state.pass_ = state.pass_, None
        if pass_ is not None and self.attached:
            if not final and self._read_later(pass_, partial(self._late_region, pass_, loss, judged)):
                return self._judge(state, loss, raising, final, before_the_loss)
            culprit = self._first_culprit(pass_, look=state.held is None)
            if culprit is not None:
                state.held = _HeldCulprit(self, pass_, *culprit)
            elif state.held is not None and state.held.pass_ is not pass_ \
                    and dropped_after(pass_, None):
                state.held.dropped_later = True
            if state.held is None or state.held.pass_ is not pass_:
                pass_.release()
        return self._judge(state, loss, raising, final, before_the_loss)

    def _first_culprit(self, pass_: PassRecord, look: bool = True):
        """Read the region back and learn which calls gave finite values; with `look`, its first
        culprit as (call, bad slots), else None."""
        pass_.read_back()
        inf_allowed, found = self._inf_allowed(), None
        for call in pass_.calls:
            if call.checked:
                continue
            _learn_clean(pass_, call, inf_allowed)
            bad = _made_new(pass_, call, inf_allowed) if look and found is None else []
            if bad:
                ops, _ = aten_ops(call.func, *call.meta, on_values=False)
                call.op = likeliest(ops) or fallback_op(call.func)
                found = (call, bad)
        return found

    def _late_region(self, pass_: PassRecord, loss, judged: Optional[list], values) -> None:
        """A region whose value (read after it) was not fine: its first culprit is raised, or
        noted if its loss stayed finite, or, where no loss met it (none, or a value made in no
        graph and given to no code the loss's graph holds), if the code after it dropped it. A
        culprit whose inf is a model's -inf mask negated (`from_the_mask`) is left to the loss's
        judgment of that mask, read next (`judged`): it runs the model's call again and names the
        -inf's maker, as the host's `_judge` does."""
        culprit = self._first_culprit(pass_) if self.attached else None
        if culprit is not None:
            call = culprit[0]
            if loss is not None and (call.in_graph or fed_to_the_graph(pass_, call)):
                harmful = not _contained(loss)
            else:
                harmful = not dropped_after(pass_, call)
            if harmful and judged and any(note.held for note in judged) \
                    and from_the_mask(pass_, *culprit):
                pass_.release()
                return
            if harmful:
                self._raise(pass_, *culprit)
            self._note_contained(pass_, *culprit)
        pass_.release()

    def _judge(self, state: ThreadState, loss, raising: bool, final: bool,
               before_the_loss: bool = False):
        """The held culprits, judged by the loss: a finite one makes them notes (the code
        discarded the value: `where`, a mask); else the first the code after a call made is
        raised (or, without `raising`, returned), before a model's -inf mask. With no backward
        yet they wait for one, until `final` (detach, an optimizer step): the code's culprit is
        raised then, a mask (illegal actions while acting) is a note."""
        held, mask = state.held, state.held_mask
        if (held is None and mask is None) or (loss is None and not final):
            return None
        if before_the_loss and loss is not None and _contained(loss):
            return None  # (a penalty's finite gradients: the loss after it judges them)
        state.held = state.held_mask = None
        state.calls_held = 0
        owners = [item for item in (held, mask) if item is not None and item.alive() is not None]
        if held in owners and not held.call.in_graph and not held.dropped_later \
                and not fed_to_the_graph(held.pass_, held.call):
            # made in no graph (under no_grad: an evaluation's loss), dropped by no later code
            # and given to none the graph holds: a loss never met its values; dropped or kept,
            # as without a backward
            loss = None
        if (loss is not None and _contained(loss)) or (loss is None and (
                held not in owners or dropped_after(held.pass_, held.call))):
            for item in owners:
                self._note_held(item)
            return None
        if mask in owners and held in owners and from_the_mask(held.pass_, held.call, held.bad):
            held.pass_.release()
            owners.remove(held)  # (the loss code's inf is the model's -inf mask, negated)
        try:
            if held in owners:
                if mask is not None:
                    mask.pass_.release()
                return held.alive()._raise(held.pass_, held.call, held.bad, raising=raising)
            if mask in owners:
                name, args = mask.detect
                getattr(mask.alive(), name)(*args)
        except NonFiniteError as error:  # (a sentinel's re-run of the mask's maker raises)
            if raising and hold_until_every_rank_knows(self.guard, error):
                return None  # several ranks: this one still joins the step's reduction
            if raising:
                raise
            return error
        except BaseException as error:
            if raising:
                raise
            return error
        return None

    def raise_held_fed_to_a_model(self, fed: list) -> None:
        """A guarded model is being fed the non-finite tensors `fed` (the data rule is about to
        name the data): where the code outside the modules made them, after a culprit it holds
        (the code between two models, a GAN's; between two submodules a Lightning step calls),
        that culprit is raised now: harm done, the loss need not judge it."""
        state = thread_state
        held = state.held
        owner = held.alive() if held is not None else None
        if owner is None or held.detect is not None:  # (a model's -inf mask goes on to the loss)
            return
        if not any(held.pass_.summarised(t) for t in fed):  # (the data's own, beside a discarded one)
            return
        state.held = None
        state.calls_held = 0
        owner._raise(held.pass_, held.call, held.bad)

    def _note_held(self, item: _HeldCulprit) -> None:
        """A held culprit the loss showed harmless, as a note (`noted`)."""
        if item.detect is None:
            self._note_contained(item.pass_, item.call, item.bad)
        else:
            self.note_mask(item.call.module_name or item.call.module_class)
        item.pass_.release()

    def note_mask(self, where: str) -> None:
        """The -inf model `where` gave its output, which the loss showed harmless (a mask)."""
        self._note(f"{where} gave the model's output -inf (a mask), and the loss stayed finite: "
                   "not an error")

    def _note(self, note: str) -> None:
        if note not in self.contained and len(self.contained) < 8:
            self.contained.append(note)

    def hold(self, pass_: PassRecord, call, owner, detect: tuple) -> bool:
        """Hold a model's forward culprit (`call`, its record in `pass_`) to be judged by the
        loss, as this code's are: `detect` (a method name of `owner`, the guard or the sentinel,
        held weakly, and its arguments) raises its detection if the loss is not finite. Whether
        it was held (no: this watch will not see the code after the call)."""
        if self.masks_judged:
            return True  # (dropped)
        state = thread_state
        if not self.may_hold or not self.watching() or graph_task_id() != -1 \
                or not (outside_mode_active() or _stack_len() == state.base):
            return False  # (a sentinel's full guard; a function mode of the user's above it)
        self._own(state)
        if state.held_mask is None:
            state.held_mask = _HeldCulprit(owner, pass_, call, detect=detect)
        return True

    def _note_contained(self, pass_: PassRecord, call: "OutsideCall", bad) -> None:
        kinds = " and ".join(sorted({row.nonfinite_words for row in frames.build_frame(
            pass_, call, self.guard.options, {id(s) for s in bad}).flagged_rows} - {""}))
        self._note(f"code outside the guarded modules made {kinds or 'inf/nan'} in "
                   f"{call.module_class} ({call.op}) at {source_of(call.where)}, discarded before "
                   "the loss (finite): not an error")

    def noted(self, report):
        """A report of the last frames seen, with the notes on the values discarded (`_judge`)."""
        if self.contained:
            report.reason = "; ".join(note for note in [report.reason] + self.contained if note)
        return report

    # ---- the report ------------------------------------------------------------------------------
    def _raise(self, pass_: PassRecord, call: OutsideCall, bad, raising: bool = True):
        """Build the report of an outside culprit, keep it on the guard and raise it (or, without
        `raising`, report it and return the error to raise)."""
        guard, options = self.guard, self.guard.options
        pass_.measure_abs_min()  # (of the values still alive: a device's rows leave it out)
        culprit = frames.build_frame(pass_, call, options, {id(s) for s in bad})
        culprit.op = call.op
        culprit.source = source_of(call.where)
        report = frames.detection_report(
            pass_, call.phase, call, bad, culprit, CAUSE_OUTSIDE, guard.recent.frames(options),
            options, call.batch_number)
        report.stage = call.stage
        pass_.release()
        error = frames.detection_error(guard, report)
        if raising and hold_until_every_rank_knows(guard, error, call.phase == FORWARD):
            return None  # several ranks: this one still joins the step's reduction
        if raising:
            raise error
        return error


"""The notebook session: which models the names of the notebook stand for, the Guard that watches
them for a `%%numguard` cell or from `%numguard on` to `%numguard off`, what it reported, and
where the reports are kept.

A run follows its names: before each cell (and, in a `%%numguard` cell, before each top-level
statement) it looks them up again and moves the hooks where a model was rebuilt, a submodule or
a parameter replaced, or a parameter frozen or unfrozen. It checks between steps only, never in
the hooks: a model rebuilt inside a loop is followed at the next step.

A GradScaler of the namespace (a variable, or a Trainer's) is handed to the guard as its
`scaler` (`find_scaler`): the steps it skips are let through and recorded, and the status line
says so. The run follows its name too.

No IPython here. `numguard_nb.magics` parses the magics' arguments, hands over the user namespace
(a plain dict) and wires `Session.before_cell` / `Session.after_cell` to IPython's pre_run_cell /
post_run_cell events; it prints and displays what these return (a `ToShow`). The tests drive the
session with a dict namespace.
"""

from __future__ import annotations

import difflib
import itertools
import types
import sys
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from torch import nn

from ._util import dtype_name, message_line, trainer_model
from .errors import CaptureTooLarge, NonFiniteError
from .explain import OPS_ADVICE, hint_for
from .guard import Guard, GuardOptions
from .guard.scaler import is_loss_scaler, loss_scaler_of, skipped_summary
from .report import Report

__all__ = ["REPORT_NAME", "TRACES_NAME", "HISTORY_NAME", "HEADROOM_NAME", "ToShow", "GuardedRun",
           "Session", "lookup", "model_of", "find_models", "find_scaler", "choose_capture"]

REPORT_NAME = "_numguard"  # the last report, in the user namespace
TRACES_NAME = "_numguard_traces"  # {batch: trace report} of the last run that traced
HISTORY_NAME = "_numguard_history"  # the numerics history of the last run that kept one
HEADROOM_NAME = "_numguard_headroom"  # what would not fit in limit_dtype (guard.headroom)


@dataclass
class ToShow:
    """What the notebook shows after a step of the session: lines to print, then reports, then
    other views (the headroom)."""

    lines: List[str] = field(default_factory=list)
    reports: List[Report] = field(default_factory=list)
    views: list = field(default_factory=list)


# ---- the models the names of a namespace stand for -----------------------------------------
def lookup(namespace: Mapping, name: str, hidden: Optional[Mapping] = None):
    """The object `name` (a variable, or an attribute path such as trainer.model) is bound to.
    Raises LookupError, whose message tells the user what to write instead (a near name of
    the user's, never one of `hidden`: the shell's own, such as its `open`)."""
    first, _, rest = name.partition(".")
    parts = rest.split(".") if rest else []
    if not first.isidentifier() or not all(part.isidentifier() for part in parts):
        raise LookupError(f"{name!r} is not a variable name: name an object of the notebook")
    if first not in namespace:
        close = difflib.get_close_matches(first, [k for k in namespace if not k.startswith("_")
                                                  and k not in (hidden or {})], n=1)
        hint = f"; did you mean {close[0]}?" if close else "; define it first (run its cell)"
        raise LookupError(f"no variable named {first!r} in the namespace{hint}")
    obj, path = namespace[first], first
    for part in parts:
        if not hasattr(obj, part):
            raise LookupError(f"{path} ({type(obj).__name__}) has no attribute {part!r}")
        obj, path = getattr(obj, part), f"{path}.{part}"
    return obj


def model_of(obj) -> Optional[nn.Module]:
    """The module an object of the notebook stands for: itself, or a trainer's model."""
    return obj if isinstance(obj, nn.Module) else trainer_model(obj)


def find_models(namespace: Mapping, names: Sequence[str] = (), hidden: Optional[Mapping] = None
                ) -> Dict[str, nn.Module]:
    """name -> model to guard: the models `names` stand for or, without names, every model of
    the namespace (public names; `hidden` holds the shell's own variables). A model found twice,
    or inside another found one, is kept once, under its first name. Raises LookupError."""
    found: Dict[str, nn.Module] = {}
    for name in names:
        obj = lookup(namespace, name, hidden)
        found[name] = model_of(obj)
        if found[name] is None:
            raise LookupError(f"{name} is a {type(obj).__name__}, not a torch.nn.Module or a "
                              "Trainer: name the model to guard")
    if names:
        return _top_level(found)
    hidden = hidden or {}
    for name, obj in list(namespace.items()):
        if name.startswith("_") or (name in hidden and hidden[name] is obj):
            continue
        model = model_of(obj)
        if model is not None:
            found[name] = model
    if not found:
        raise LookupError("no torch.nn.Module (or Trainer) in the namespace: " + (
            model_held_inside(namespace, hidden) or "create the model first, or name it after the magic"))
    return _top_level(found)


def model_held_inside(namespace: Mapping, hidden: Optional[Mapping] = None) -> str:
    """'exp.model holds one: name it: %%numguard exp.model' for a model kept one level inside the
    namespace's dicts, lists and objects, which only names reach; '' where there is none."""
    for name, obj in list(namespace.items()):
        if name.startswith("_") or name in (hidden or {}) or isinstance(obj, (type, types.ModuleType)):
            continue
        if isinstance(obj, dict):  # (the first 64 items: a vocabulary may be large)
            items = [(f"{name}[{key!r}]", value) for key, value in itertools.islice(obj.items(), 64)]
        elif isinstance(obj, (list, tuple)):
            items = [(f"{name}[{index}]", value) for index, value in enumerate(obj[:64])]
        else:
            attributes = getattr(obj, "__dict__", None)
            items = [(f"{name}.{key}", value) for key, value in attributes.items()
                     if not key.startswith("_")] if isinstance(attributes, dict) else []
        for where, value in items:
            if isinstance(value, nn.Module):
                return f"{where} holds one: " + (f"name it: %%numguard {where}" if "[" not in where
                                                 else f"give it a name of its own (net = {where}) and guard that")
    return ""


def _top_level(found: Dict[str, nn.Module]) -> Dict[str, nn.Module]:
    """Drop duplicates and modules that are submodules of another found one (order kept)."""
    unique: Dict[str, nn.Module] = {}
    seen = set()
    for name, module in found.items():
        if id(module) not in seen:
            seen.add(id(module))
            unique[name] = module
    if len(unique) < 2:
        return unique
    inner = set()
    for module in unique.values():
        inner.update(id(sub) for sub in module.modules() if sub is not module)
    return {name: module for name, module in unique.items() if id(module) not in inner}


def find_scaler(namespace: Mapping, name: Optional[str] = None, hidden: Optional[Mapping] = None
                ) -> Tuple[Optional[str], object, str]:
    """(name, scaler, note): the enabled GradScaler a guarded run lets skipped steps through
    with. `name` names it (a GradScaler, or a Trainer that has one); without a name, the one
    enabled GradScaler of the namespace, a variable or a Trainer's (public names; `hidden`
    holds the shell's own variables). (None, None, note) when there is none, or several: the
    note then says which, and how to name one (else ''). Raises LookupError for a `name` that
    stands for no scaler."""
    if name is not None:
        obj = lookup(namespace, name, hidden)
        scaler = loss_scaler_of(obj)
        if scaler is None:
            what = "a disabled scaler" if is_loss_scaler(obj) else f"a {type(obj).__name__}"
            raise LookupError(f"{name} is {what}, not an enabled torch.amp.GradScaler or a Trainer "
                              "with one: name the scaler the loop scales its loss with")
        return name, scaler, ""
    hidden = hidden or {}
    found: Dict[int, Tuple[str, object]] = {}
    for key, obj in list(namespace.items()):
        if key.startswith("_") or (key in hidden and hidden[key] is obj):
            continue
        if is_loss_scaler(obj) or trainer_model(obj) is not None:
            scaler = loss_scaler_of(obj)
            if scaler is not None:
                found.setdefault(id(scaler), (key, scaler))
    if len(found) == 1:
        return (*next(iter(found.values())), "")
    if not found:
        return None, None, ""
    names = ", ".join(key for key, _ in found.values())
    return None, None, (f"numguard: several GradScalers ({names}): the one whose scale(loss) runs is "
                        "used; --scaler NAME names it")


def choose_capture(requested: Optional[bool], models: Dict[str, nn.Module]) -> Tuple[bool, str]:
    """Whether the guard captures inputs for a CPU replay after a CUDA error, and why not where
    the weights' host copy would not fit in memory ('' otherwise). `requested` None: capture
    where a model has a parameter on CUDA, the one place asynchronous errors happen."""
    capture = requested
    if capture is None:
        capture = any(p.is_cuda for model in models.values() for p in model.parameters())
    if not capture:
        return False, ""
    from .replay import snapshot_fits

    return snapshot_fits(models)


def _as_is(error: BaseException, hint: str) -> BaseException:
    return error


# ---- what the hooks go on -------------------------------------------------------------------
def _layout(model: nn.Module) -> list:
    """What a guard hooks in `model`: each module and parameter by name, and whether the
    parameter takes gradients (only those get a gradient hook); (name, module, None) for a
    module, (name, its module, parameter, flag) for a parameter."""
    entries = []
    for name, module in model.named_modules():
        entries.append((name, module, None))
        for pname, param in module.named_parameters(recurse=False):
            entries.append((f"{name}.{pname}", module, param, param.requires_grad))
    return entries


class _HeldLayout:
    """A layout held by weak references to its modules: it keeps no replaced module alive. A
    parameter is held by its module and id (a weak reference to a tensor would make
    `torch.utils.swap_tensors`, and so `load_state_dict` in swap mode, refuse it)."""

    def __init__(self, entries: list):
        self.entries = [(entry[0], weakref.ref(entry[1])) + tuple(
            (id(entry[2]), entry[3]) if len(entry) == 4 else (None, None)) for entry in entries]

    def matches(self, entries: list) -> bool:
        if len(entries) != len(self.entries):
            return False
        for entry, (name, module_ref, param_id, flag) in zip(entries, self.entries):
            if entry[0] != name or entry[1] is not module_ref():
                return False
            if len(entry) == 4 and (id(entry[2]) != param_id or entry[3] != flag):
                return False
            if (len(entry) == 4) != (param_id is not None):
                return False
        return True


# ---- one guard and what it reported ---------------------------------------------------------
class GuardedRun:
    """A Guard over models of the notebook and the reports it made since they were last shown:
    the run of one `%%numguard` cell, or of every cell from `%numguard on` to `%numguard off`.

    Args:
        namespace: the user namespace, where the reports are kept.
        models: name -> model (as `find_models` returns them).
        options: the Guard's options, checked (its callbacks are the run's own).
        output: a further name to keep the last report under.
        quiet: show nothing; only keep the reports.
        shorten: (error, hint) -> the exception to raise on a detection (the magics give it a
            one-line display).
        scaler_name: the name `options.scaler` was found under (`find_scaler`), followed like
            the models' names.
        every_model: the models are every model of the namespace (no names were given): each
            step looks for models made since as well (`hidden`: the shell's own variables), among
            the names `new_models_in` (a `%%numguard` cell's assignments; None: every name).
        ops_advice: how to have the op and the line named, in the words of the magic that made
            the run (for the hints).
    """

    def __init__(self, namespace: dict, models: Dict[str, nn.Module],
                 options: GuardOptions = GuardOptions(), *,
                 output: Optional[str] = None, quiet: bool = False,
                 shorten: Callable[[BaseException, str], BaseException] = _as_is,
                 scaler_name: Optional[str] = None, every_model: bool = False,
                 hidden: Optional[Mapping] = None, ops_advice: str = "",
                 new_models_in: Optional[set] = None):
        self.namespace = namespace
        self.names = tuple(models)  # the names followed from step to step
        self.every_model = every_model
        self._new_models_in = new_models_in
        self.ops_advice = ops_advice
        self._hidden = hidden
        self._made_since: set = set()  # names found since the start, not yet said (every_model)
        self.joined_late: set = set()  # names guarded from a statement after a cell's first
        self._scanned: set = set()  # names every_model found (not given, nor found at the start)
        self.scaler_name = scaler_name
        self.models = dict(models)  # what they stand for now
        self.missing: Dict[str, str] = {}  # name -> why it stands for no model now
        self._layouts = {name: _HeldLayout(_layout(model)) for name, model in models.items()}
        self.output = output
        self.quiet = quiet
        kept_in = REPORT_NAME + (f" and {output}" if output else "")
        self.hint = f"numguard: the frames that led to it are in {kept_in}"
        self._shorten = shorten
        self._detections: List[Report] = []
        self._traced: List[int] = []  # batch numbers whose trace grew since the last collect
        self._headroom_passes = 0  # the headroom's passes when it was last shown
        target = next(iter(models.values())) if len(models) == 1 else dict(models)
        options = options.replace(on_trace=self._on_trace, on_detect=self._on_detect)
        self.guard = Guard(target, **options.as_kwargs())
        # Without names the models come in the namespace's order (a loss module, a teacher or
        # an old model before the one trained): batches are counted by the first one called.
        self.guard.batches.from_first_call = every_model

    def _on_detect(self, report: Report) -> BaseException:
        if len(self.models) == 1 and report.hint and report.hint == hint_for(report):
            (name, model), = self.models.items()  # the hint's code names the user's model
            try:
                report.model_variable = name if lookup(self.namespace, name) is model else f"{name}.model"
            except LookupError:  # (rebound since)
                report.model_variable = name
            report.hint = hint_for(report)
        if self.ops_advice:
            report.hint = report.hint.replace(OPS_ADVICE, self.ops_advice)
        self._detections.append(report)
        return self._shorten(NonFiniteError(report), self.hint)

    def _on_trace(self, report: Report) -> None:
        if report.batch_number not in self._traced:
            self._traced.append(report.batch_number)

    def describe(self) -> str:
        """'net (Sequential), loss_fn (MSELoss)': the models guarded, by name (a trainer's
        name with its model's class), then the names that stand for none now."""
        guarded = ", ".join(f"{name} ({type(model).__name__})" for name, model in self.models.items())
        missing = "; ".join(self.missing.values())
        return f"{guarded or 'nothing'}{f' ({missing})' if missing else ''}"

    def scaling(self) -> str:
        """The status lines' clause on loss scaling: '; the steps scaler (GradScaler) skips are
        let through', then what it skipped; '' without a scaler."""
        # (the one seen scaling the loss first: a loop's own, or one of several in the namespace)
        scaler = self.guard.scaling.scaler_of(self.guard.options)
        if scaler is None:
            return ""
        kind = type(scaler).__name__
        label = kind
        if self.scaler_name is not None and scaler is self.guard.scaler:
            try:
                direct = lookup(self.namespace, self.scaler_name) is scaler
            except LookupError:
                direct = True
            label = f"{self.scaler_name} ({kind})" if direct else f"the {kind} of {self.scaler_name}"
        skipped = skipped_summary(self.guard.skipped_steps, label)
        return f"; {skipped}" if skipped else f"; the steps {label} skips are let through"

    # ---- following the names ----------------------------------------------------------------
    def step(self) -> ToShow:
        """Before a cell, or a statement of a %%numguard cell: follow the names and hook what
        they stand for now."""
        moved = self.follow()
        return ToShow(lines=([] if self.quiet else moved) + self.attach())

    def follow(self) -> List[str]:
        """Look the names up again; where what they stand for changed, unhook (`attach` hooks
        the new state). Lines that say what changed, none where nothing did."""
        models, missing = self._look_up()
        layouts = {name: _layout(model) for name, model in models.items()}
        moved = self._changes(models, missing, layouts)
        self.missing = missing
        if moved:
            self.guard.detach()
            self.models = models
            self._layouts = {name: _HeldLayout(layout) for name, layout in layouts.items()}
            self.guard.retarget(next(iter(models.values())) if len(models) == 1 else dict(models))
        return moved + self._follow_scaler()

    def _follow_scaler(self) -> List[str]:
        """Look the scaler's name up again: a scaler made anew is the one let through from now
        on. A line where it changed."""
        name = self.scaler_name
        if name is None:
            return []
        try:
            scaler = loss_scaler_of(lookup(self.namespace, name))
        except LookupError:
            scaler = None
        if scaler is self.guard.scaler:
            return []
        self.guard.detach()  # options change between attaches: `step` attaches again
        self.guard.scaler = scaler
        if scaler is None:
            return [f"numguard: {name} stands for no GradScaler now: no skipped step is let through"]
        return [f"numguard: {name} is a new {type(scaler).__name__}: the steps it skips are let through"]

    def _look_up(self) -> Tuple[Dict[str, nn.Module], Dict[str, str]]:
        if self.every_model:  # models made since are followed too
            namespace = self.namespace if self._new_models_in is None else {
                name: self.namespace[name] for name in self._new_models_in if name in self.namespace}
            try:
                made = find_models(namespace, (), self._hidden)
            except LookupError:
                made = {}
            new = tuple(name for name in made if name not in self.names)
            self.names += new
            self._made_since.update(new)
            self._scanned.update(new)
            self.joined_late.update(new)
        found: Dict[str, nn.Module] = {}
        missing: Dict[str, str] = {}
        for name in self.names:
            try:
                obj = lookup(self.namespace, name)
            except LookupError as error:
                gone = message_line(error) if "." in name else f"{name} is gone from the namespace"
                missing[name] = f"{gone}: not guarded"
                continue
            model = model_of(obj)
            if model is None:
                missing[name] = (f"{name} is a {type(obj).__name__}, not a torch.nn.Module or a "
                                 "Trainer: not guarded")
            else:
                found[name] = model
        models = _top_level(found)
        for name in found.keys() - models.keys():
            if name in self._scanned:  # found by a scan (`part = net[0]`): not followed
                self.names = tuple(kept for kept in self.names if kept != name)
                for names in (self._scanned, self.joined_late, self._made_since):
                    names.discard(name)
            else:
                missing[name] = f"{name} is inside another guarded model: guarded through it"
        return models, missing

    def _changes(self, models, missing, layouts) -> List[str]:
        lines = []
        name_was = {id(model): name for name, model in self.models.items()}
        for name in self.names:
            if name in missing:
                if name not in self.missing:
                    lines.append(f"numguard: {missing[name]}")
                continue
            kind = type(models[name]).__name__
            if name in self._made_since:
                self._made_since.discard(name)
                earlier = name_was.get(id(models[name]))
                if earlier is not None and earlier != name:  # `old = model; model = build()`
                    lines.append(f"numguard: {name} is the {kind} {earlier} was: still guarding it")
                else:
                    lines.append(f"numguard: {name} is a new {kind}: guarding it")
            elif name not in self.models:
                lines.append(f"numguard: {name} is a {kind} again: guarding it")
            elif models[name] is not self.models[name]:
                lines.append(f"numguard: {name} is a new {kind}: guarding it")
            elif not self._layouts[name].matches(layouts[name]):
                lines.append(f"numguard: {name} has new modules or parameters: guarding them")
        return lines

    def attach(self) -> List[str]:
        """Hook the models (idempotent). Where the weights' host copy stopped fitting in memory,
        guard without the capture, and say so."""
        if not self.models:
            return []
        try:
            self.guard.attach()
        except CaptureTooLarge as error:
            self.guard.capture_enabled = False
            self.guard.attach()
            return [f"numguard: no CPU replay after a CUDA error from now on: {message_line(error)}"]
        return []

    def collect(self) -> List[Report]:
        """The reports made since the last call (the traces that grew, then the detections),
        kept in the namespace."""
        reports = [self.guard.traces[b] for b in self._traced if b in self.guard.traces]
        reports.extend(self._detections)
        self._traced = []
        self._detections = []
        if reports:
            self._keep(reports[-1])
        return reports

    def _keep(self, report: Report) -> None:
        self.namespace[REPORT_NAME] = report
        if self.output:
            self.namespace[self.output] = report
        if self.guard.traces:
            self.namespace[TRACES_NAME] = dict(sorted(self.guard.traces.items()))
        if self.guard.history_every is not None:
            self.namespace[HISTORY_NAME] = self.guard.history

    def show_collected(self) -> ToShow:
        """The reports made since they were last shown (none when quiet: they are only kept)."""
        reports = self.collect()
        return ToShow(reports=[] if self.quiet else reports)

    def show_headroom(self) -> ToShow:
        """With limit_dtype, the headroom (kept in the namespace) when passes ran since it was
        last shown, full or empty: it answers "would this have fit?"."""
        headroom = self.guard.headroom
        if self.guard.limit_dtype is None or headroom.passes == self._headroom_passes:
            return ToShow()
        self._headroom_passes = headroom.passes
        self.namespace[HEADROOM_NAME] = headroom
        return ToShow(views=[] if self.quiet else [headroom])

    def finish_cell(self, failed: bool) -> ToShow:
        """The end of a `%%numguard` cell: its reports or, without any, the latest frames (kept,
        and summed up in a line when the cell did not fail)."""
        reports = self.collect()
        if reports:
            return ToShow(reports=[] if self.quiet else reports)
        latest = self.guard.latest_report()
        self._keep(latest)
        if self.quiet or failed:
            return ToShow()
        if latest.frames:
            return ToShow(lines=[f"numguard: {latest.summary()}"])
        if not self.models:  # (why each name stands for none was said as it happened)
            return ToShow(lines=["numguard: no model was guarded at the end of this cell"])
        was = "was" if len(self.models) == 1 else "were"
        if set(self.models) <= self.joined_late:  # made in the statement that used them, say
            return ToShow(lines=[
                f"numguard: {self.describe()} {was} not called after guarding began (from the "
                "statement after the one that made it): make the model in a statement before the "
                "code that uses it"])
        return ToShow(lines=[f"numguard: {self.describe()} {was} not called in this cell"])


def _headroom_status(guard: Guard) -> str:
    """'; in float16, 2 predicted overflow(s) and 1 underflow(s) in _numguard_headroom' (with
    limit_dtype; '' without)."""
    if guard.limit_dtype is None:
        return ""
    headroom = guard.headroom
    return (f"; in {dtype_name(guard.limit_dtype)}, {headroom.overflows} predicted overflow(s) "
            f"and {headroom.underflows} underflow(s) in {HEADROOM_NAME}")


# ---- %numguard on .. off --------------------------------------------------------------------
class Session:
    """`%numguard on` .. `%numguard off`: one GuardedRun over every cell in between. A
    `%%numguard` cell brings its own guard: the session steps aside for it."""

    def __init__(self):
        self.run: Optional[GuardedRun] = None
        self._stepped_aside = False  # the current cell is a %%numguard cell
        # Armed before any model exists: (make the run, or None while its models are missing;
        # what it waits for, in words).
        self._armed: Optional[Tuple[Callable[[], Optional[GuardedRun]], str]] = None

    @property
    def guarding(self) -> Optional[GuardedRun]:
        """The run that guards the current cell: none where a %%numguard cell brings its own."""
        return None if self._stepped_aside else self.run

    def arm(self, make_run: Callable[[], Optional[GuardedRun]], waiting_for: str) -> ToShow:
        """`%numguard on` before the models exist: before each cell, `make_run()` is tried again
        (None while its models are missing); the first run it makes guards that cell and every
        following one. `waiting_for` says what is awaited ('a model', 'model')."""
        self.stop()
        self._armed = (make_run, waiting_for)
        missing = "model" if waiting_for == "a model" else waiting_for  # ("no a model yet")
        return ToShow(lines=[f"numguard: on; no {missing} yet: guarding starts with the first cell "
                             f"run after {waiting_for} exists (the cell that creates it is not guarded)"])

    def _start_armed(self) -> List[str]:
        """Make the armed run if its models exist now: the line that says so, else []."""
        make_run, _ = self._armed
        run = make_run()
        if run is None:
            return []
        self._armed = None
        self.run = run
        return [] if run.quiet else [f"numguard: guarding {run.describe()} from this cell on, until "
                                     f"%numguard off{run.scaling()}"]

    def start(self, run: GuardedRun, cell: str = "") -> ToShow:
        """Guard every following cell with `run` (in place of the current one, if any), and the
        rest of `cell`, the cell that started it, unless it is a `%%numguard` cell (whose own
        guard runs it)."""
        self.stop()
        self.run = run
        self._stepped_aside = any(line.lstrip().startswith("%%numguard")
                                  for line in cell.splitlines())
        attached = [] if self._stepped_aside else run.step().lines
        if run.quiet:
            return ToShow(lines=attached)
        return ToShow(lines=[f"numguard: on, guarding {run.describe()} from here on, in every cell "
                             f"until %numguard off{run.scaling()}"] + attached)

    def stop(self) -> str:
        """Unhook the models; the line that says what was guarded."""
        return self.stop_and_find()[0]

    def stop_and_find(self) -> tuple:
        """Unhook the models: (the line that says what was guarded, the NonFiniteError that
        detaching found, or None: the code after the last model call, a loss with no backward,
        which fails the `%numguard off` cell as a `with` block's exit does)."""
        run, self.run = self.run, None
        if run is None:
            armed, self._armed = self._armed, None
            return ("numguard: off (no model was guarded)" if armed else "numguard: already off",
                    None)
        run.guard.raise_found(False)  # what a detach before (following a name) left: not this one's
        run.guard.detach()
        found = None
        try:
            run.guard.raise_found()
        except NonFiniteError as error:  # (its report: `show_collected` has it)
            found = error
        if run.guard.history_every is not None:  # %numguard history still shows it
            run.namespace[HISTORY_NAME] = run.guard.history
        return (f"numguard: off (guarded {run.describe()} up to batch {run.guard.batch_number})",
                found)

    def status(self) -> str:
        """What is guarded now (as the last step found it), at which batch, and what was found."""
        run = self.run
        if run is None and self._armed is not None:
            return f"numguard: on, waiting for {self._armed[1]}: none is guarded yet"
        if run is None:
            return "numguard: off (%numguard on [MODEL ...] guards every following cell)"
        guard = run.guard
        traced = f"; tracing batches {sorted(guard.trace_batches)}" if guard.trace_batches else ""
        found = f"; a detection is in {REPORT_NAME}" if guard.detection is not None else ""
        kept = (f"; history of every {guard.history_every} batches ({len(guard.history)} samples)"
                if guard.history_every is not None else "")
        found += _headroom_status(guard)
        return (f"numguard: on, guarding {run.describe()}, at batch {guard.batch_number}{traced}"
                f"{run.scaling()}{kept}{found}")

    def history(self, namespace: Mapping):
        """The numerics history `%numguard history` shows: the session guard's, else the last
        one a run kept in the namespace. LookupError, saying how to keep one, without either."""
        run = self.run
        if run is not None and run.guard.history_every is not None:
            return run.guard.history
        if namespace.get(HISTORY_NAME) is not None:
            return namespace[HISTORY_NAME]
        raise LookupError("no numerics history: %numguard on --history-every N (or %%numguard "
                          "--history-every N) keeps every Nth batch's ranges")

    def before_cell(self, source: str) -> ToShow:
        """Before a cell runs (pre_run_cell): follow the names and hook what they stand for."""
        started = self._start_armed() if self.run is None and self._armed is not None else []
        run = self.run
        if run is None:
            return ToShow()
        if source.lstrip().startswith("%%numguard"):
            self.step_aside()
            return ToShow(lines=started)
        self._stepped_aside = False
        shown = run.step()
        shown.lines[:0] = started
        return shown

    def step_aside(self) -> None:
        """For this cell, a `%%numguard` cell (also one inside another cell magic, `%%time`):
        it brings its own guard, and two guards on one model would double every hook."""
        if self.run is not None:
            self._stepped_aside = True
            self.run.guard.detach()

    def after_cell(self, success: bool, error: Optional[BaseException]) -> ToShow:
        """After a cell (post_run_cell): what the guard reported during it, and what the cell
        changed in the models (guarded from the next cell on)."""
        run = self.run
        if run is None or self._stepped_aside:
            return ToShow()
        if not success:
            run.guard.reset()  # an interrupted pass must not leak into the next cell
        if isinstance(error, NonFiniteError):
            # The traceback through the hooks keeps the activations alive: drop it, also where
            # the shell keeps it for %debug.
            error.with_traceback(None)
            if getattr(sys, "last_value", None) is error:
                sys.last_traceback = None
        shown = run.show_collected()
        shown.views.extend(run.show_headroom().views)
        moved = run.follow()
        if moved and not run.quiet:
            # Only a %%numguard cell is followed statement by statement.
            shown.lines.extend(moved + [
                "numguard: (found at the end of this cell, so guarded from the next one on: a "
                "%%numguard cell follows such changes as they happen)"])
        return shown

"""IPython magics: `%%numguard`, `%numguard on|off|status|compare|history`, `%numguard_dist`,
`%numguard_check`, `%numguard_replay`.

A thin layer: each magic parses its line, looks its objects up in the namespace, runs the engine
(`Guard` through `numguard_nb.session`, the doctor, distcheck, the replay) and shows the result
(`render.widget` for reports). The state of `%numguard on` lives in `session.Session`; this
module wires it to IPython's pre_run_cell / post_run_cell events.

    %load_ext numguard_nb

    %%numguard                      # guard every nn.Module (and Trainer) in the namespace
    loss = model(**batch).loss
    loss.backward()

On a detection the cell fails with a one-line error (the culprit and the batch: the exception
carries `_render_traceback_`, which IPython uses instead of a traceback through the hooks), the
report is displayed above it and kept as `_numguard`.
"""

from __future__ import annotations

import difflib
import builtins
import keyword
import re
import sys
from typing import Dict, List, Optional

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ._util import message_line
from .errors import BatchLimitReached, NonFiniteError, red_name, set_uncaught_display
from .magic_args import (
    CELL, COMPARE, HISTORY, OFF, ON, STATUS, guard_options, parse, parse_bare,
    positive_int, positive_number, with_usage,
)
from .report import Report
from .cell_code import compile_cell, is_top_level_await
from .session import (
    GuardedRun, Session, ToShow, choose_capture, find_models, find_scaler, lookup, model_of,
    model_held_inside,
)

__all__ = ["NumguardMagics", "load", "unload", "short_traceback"]

_COMMANDS = ("on", "off", "status", "compare", "history")

# The shells the extension is loaded in, and their magics (for unload).
_loaded: Dict[int, "NumguardMagics"] = {}


# ---- the short error display ---------------------------------------------------------------
def short_traceback(error: BaseException, hint: str = "") -> List[str]:
    """What IPython shows for a numguard error: the exception's name and its one-line message."""
    name = type(error).__name__
    report = getattr(error, "report", None)
    message = report.summary() if isinstance(report, Report) else str(error)
    lines = [f"{red_name(name)}: {message}"]
    if hint:
        lines.append(hint)
    return lines


def _make_short(error: BaseException, hint: str = "", show_first=None) -> BaseException:
    """Give the exception `_render_traceback_`: IPython then prints those lines, not a traceback,
    after calling `show_first()` (what belongs above the error: under `%numguard on` the report,
    as a `%%numguard` cell shows it before it raises)."""
    def render() -> List[str]:
        if show_first is not None:
            show_first()
        return short_traceback(error, hint)

    if "_render_traceback_" not in getattr(error, "__dict__", {}):
        try:
            error._render_traceback_ = render
        except (AttributeError, TypeError):
            pass
    return error


def _is_device_error(error: BaseException) -> bool:
    """A CUDA error (after which the GPU is unusable), as numguard_nb.replay recognises them."""
    from .replay import is_device_error

    return is_device_error(error)


class _CellOutcome:
    """How a guarded cell ended: the value of its last expression, or the exception it raised."""

    def __init__(self, value=None, error: Optional[BaseException] = None):
        self.value = value
        self.error = error

    def result(self, hint: str):
        """The cell's value, or its exception raised again (numguard's own in one line)."""
        __tracebackhide__ = True  # noqa: F841
        error = self.error
        if error is None:
            return self.value
        if isinstance(error, (NonFiniteError, BatchLimitReached)):
            # The hooks' frames hold activations: drop them, and show one line (see _make_short).
            hint = hint if isinstance(error, NonFiniteError) else ""
            raise _make_short(error, hint).with_traceback(None) from None
        raise error


# How each magic has the op and the line named, for the hints (the engine's say `Guard(..., ops=True)`).
_OPS_ADVICE = {"%%numguard": "Rerun the cell with `%%numguard --ops` to name the op and the line.",
               "%numguard on": "Turn it on with `%numguard on --ops` to name the op and the line."}


def _running_cell(shell) -> str:
    """The source of the cell running now ('' where the shell does not say)."""
    result = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    return str(getattr(getattr(result, "info", None), "raw_cell", "") or "")


def _hidden(shell) -> dict:
    return getattr(shell, "user_ns_hidden", {})  # the shell's own variables


def _waiting_for(namespace, hidden, names, made: Optional[set] = None) -> str:
    """What a run must wait for before it starts, in words ('' where it can start now): 'a
    model' where the namespace holds none and no name is given, else the names not defined yet:
    all of them (`%numguard on`), or, for a `%%numguard` cell (`made`: the names it assigns),
    any of them, where the cell makes each (a name it does not make is a typo or another cell's
    model: refused with the namespace's suggestion when the run starts)."""
    if not names:
        try:
            find_models(namespace, (), hidden)
        except LookupError:
            return "a model"
        return ""
    missing = [name for name in names if name.partition(".")[0] not in namespace]
    if made is None:
        return " and ".join(missing) if len(missing) == len(names) else ""
    return " and ".join(missing) if all(name.partition(".")[0] in made for name in missing) else ""


def _why_nothing_is_guarded(shell, waiting_for: str) -> str:
    inside = model_held_inside(shell.user_ns, _hidden(shell)) if waiting_for == "a model" else ""
    if inside:
        return f"no model stands under a name of its own, and {inside}"
    return (f"the cell made {waiting_for} in its last statement or not at all (a model is guarded "
            "from the statement after the one that makes it)")


def _unreadable(text: str, error: Exception, namespace) -> str:
    """Why `%numguard compare` cannot read `text`: a batch not traced lists those that were."""
    traced = namespace.get("_numguard_traces")
    if isinstance(error, KeyError) and text.startswith("_numguard_traces[") and isinstance(traced, dict):
        return (f"batch {error.args[0]} was not traced; the traced batches are "
                f"{', '.join(map(str, sorted(traced))) or 'none'} (--trace B,B)")
    if isinstance(error, SyntaxError):  # (the parser's own words say nothing here)
        return (f"cannot read {text}: not a name or an expression; give two reports, such as good "
                "bad or _numguard_traces[149] _numguard_traces[150]")
    return f"cannot read {text}: {message_line(error)}"


def _compiled(shell, cell: str) -> tuple:
    try:
        return compile_cell(shell, cell)
    except SyntaxError as error:
        if is_top_level_await(error):
            raise UsageError("%%numguard: a top-level await runs only in a plain cell: guard it "
                             "with %numguard on before the cell and %numguard off after") from None
        raise


# ---- what IPython shows of a cell ----------------------------------------------------------
_CELL_MAGIC_LINE = re.compile(r"%%numguard(\s|$)")


def _syntax_errors_as_in_a_plain_cell(shell):
    """An input transformer (IPython's cleanup stage): a `%%numguard` cell whose code does not
    compile reaches IPython as that code alone, its magic line left blank, so that IPython shows the
    SyntaxError as for any cell (the cell's line and a caret, not a traceback through the magic)
    and the cell fails before it runs."""
    def transform(lines: List[str]) -> List[str]:
        if not lines or not _CELL_MAGIC_LINE.match(lines[0]):
            return lines
        try:  # (compiled too: `return` or `break` outside their place parse, then fail here)
            compile(shell.compile.ast_parse(shell.transform_cell("".join(lines[1:]))), "<cell>", "exec")
        except SyntaxError as error:
            return lines if is_top_level_await(error) else ["\n"] + lines[1:]
        except Exception:  # anything else: the magic meets it and says so
            return lines
        return lines

    transform.has_side_effects = True  # not applied where IPython asks if the input is complete
    return transform


# ---- names the magics are given ------------------------------------------------------------
def _names_waited_for(shell, names: List[str], magic: str) -> List[str]:
    """`%numguard on` waits for names not defined yet: refuse what cannot be a variable; a
    note for each close to a model of the namespace (a typo would wait forever)."""
    namespace, notes = shell.user_ns, []
    for name in names:
        first = name.partition(".")[0]
        if first in namespace:
            continue
        if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name) is None:
            raise UsageError(f"{magic}: {name!r} is not a variable name: name the models to guard")
        models = [key for key, value in namespace.items()
                  if not key.startswith("_") and model_of(value) is not None]
        notes += [f"no variable named {first!r} yet; did you mean {close}?"
                  for close in difflib.get_close_matches(first, models, n=1)]
    return notes


def _refuse_taken_output(shell, args, magic: str) -> None:
    """-o NAME writes a report into the namespace: never over the user's own data or model,
    nor IPython's names."""
    name = args.output
    if name is None:
        return
    if keyword.iskeyword(name) or name in _hidden(shell) or hasattr(builtins, name):
        raise UsageError(f"{magic}: -o {name}: that name is Python's or IPython's own: pick another")
    if name.startswith("_numguard_"):  # _numguard_traces, _numguard_history, ...: written by the magics
        raise UsageError(f"{magic}: -o {name}: names starting _numguard_ are numguard's own: pick another")
    held = shell.user_ns.get(name)
    if name in shell.user_ns and not isinstance(held, Report):
        raise UsageError(f"{magic}: -o {name}: {name} holds a {type(held).__name__} of yours: "
                         "pick a free name (or one holding a report)")


# ---- the magics ----------------------------------------------------------------------------
@magics_class
class NumguardMagics(Magics):
    def __init__(self, shell):
        super().__init__(shell)
        self._session = Session()  # the state of %numguard on
        self.syntax_check = _syntax_errors_as_in_a_plain_cell(shell)  # an input transformer
        self._armed_note = ""  # what an armed %numguard on said last about its models

    # ---- %%numguard / %numguard ----------------------------------------------------------
    @cell_magic("numguard")
    @with_usage(CELL)
    def numguard_cell(self, line="", cell=""):
        """Guard this cell with a numguard Guard: find the first module that produces an inf or a
        nan, forward or backward.

            %%numguard [options] [MODEL ...]

        MODEL names a torch.nn.Module or a Hugging Face Trainer (its .model) in the namespace (dotted
        names such as trainer.model work). Without a name, every nn.Module of the namespace that is not a
        submodule of another one is guarded, and each Trainer stands for its model. Before each
        top-level statement of the cell the guard looks these names up again (and, without names,
        for models made since), so a model the cell makes or rebuilds (or a submodule replaced) is
        guarded from the next statement on.

        A GradScaler in the namespace (a variable, or a Trainer's; --scaler NAME picks one) is
        handed to the guard (the one whose scale(loss) runs, once seen): a gradient overflow in a
        step it skips is recorded, not stopped, until its scale reaches 1; `%numguard status` says
        how many it skipped.

        On a detection the report is displayed (the module tree, collapsible, with the path to the
        culprit open), then the cell fails with a one-line error naming the culprit and the batch; the
        report is kept as `_numguard` (and in -o NAME). With --trace, one report per traced batch is
        displayed and `_numguard_traces` maps each traced batch to its report. Put MODEL names before
        --allow-inf, which takes the globs that follow it.

        To guard every following cell (a loop split across cells), or to compare two reports: the
        line magic, %numguard on|off|status|compare|history (see %numguard?).
        """
        __tracebackhide__ = True  # noqa: F841 (IPython leaves this frame out of tracebacks)
        return self._guard_cell(line, cell)

    @line_magic("numguard")
    @with_usage(ON, COMPARE, HISTORY)
    def numguard(self, line=""):
        """Guard every following cell, until off (a training loop split across cells), with a
        numguard Guard; say what is guarded; compare two reports.

            %numguard on [options] [MODEL ...]    guard every following cell
            %numguard off                         stop guarding
            %numguard status                      what is guarded, at which batch
            %numguard compare A B [--factor F]    first module whose abs max differs > F x (default 10)
            %numguard history [--worst N]         each module's range over the sampled batches
                                                  (after --history-every N)

        MODEL names a torch.nn.Module or a Hugging Face Trainer (its .model) in the namespace (dotted
        names such as trainer.model work). Without a name, every nn.Module of the namespace that is not a
        submodule of another one is guarded, and each Trainer stands for its model. Before each cell the
        guard looks these names up again (and, without names, for models made since), so a model
        made or rebuilt (or a submodule replaced) is guarded from that cell on. Batches count across
        cells.

        On a detection the report is displayed, then the cell fails with a one-line error naming the
        culprit and the batch; the report is kept as `_numguard` (and in -o NAME). `on` takes the
        options below (those of %%numguard); off and status take none. A and B of compare are reports:
        names, or _numguard_traces[batch]. To guard one cell: %%numguard (see %%numguard?).
        """
        __tracebackhide__ = True  # noqa: F841 (IPython leaves this frame out of tracebacks)
        command, rest = (line.split(maxsplit=1) + ["", ""])[:2]
        if not command:
            raise UsageError(
                "%numguard needs on, off, status or compare (or history); to guard one cell use "
                "%%numguard (two %) on the cell's first line"
            )
        if command not in _COMMANDS:
            raise UsageError(
                f"%numguard: unknown command {command!r}: use on, off, status, compare or history "
                "(to guard one cell, write %%numguard on its first line)"
            )
        run_command = {"on": self._on, "off": self._off, "status": self._status,
                       "compare": self._compare, "history": self._history}[command]
        return run_command(rest)

    def _guard_cell(self, line: str, cell: str):
        __tracebackhide__ = True  # noqa: F841
        args = parse(CELL, line)
        _refuse_taken_output(self.shell, args, "%%numguard")
        command = args.names[0] if args.names else None
        if command in _COMMANDS and command not in self.shell.user_ns:
            raise UsageError(f"%%numguard guards the cell below it; for '{command}' use the line "
                             f"magic %numguard {command} (one %)")
        magic = "%%numguard"
        code, assigned = _compiled(self.shell, cell)  # a SyntaxError is raised before any hook
        self._session.step_aside()
        waiting_for = _waiting_for(self.shell.user_ns, _hidden(self.shell), args.names, assigned)
        if waiting_for:  # the cell makes its model: guarded from the statement after
            try:  # bad options are refused now, not when a model appears
                guard_options(args, capture=False)
            except (TypeError, ValueError) as error:
                raise UsageError(f"{magic}: {message_line(error)}") from None
            run = None
        else:
            run = self._start_run(args, magic, made=assigned)
        not_yet = [_why_nothing_is_guarded(self.shell, waiting_for)]
        run, outcome = self._run_cell(run, code,
                                      lambda: self._cell_run_if_ready(args, magic, assigned, not_yet))
        if run is None:
            if not args.quiet:
                print(f"numguard: nothing was guarded: {not_yet[0]}")
            return outcome.result("")
        self._show(run.finish_cell(failed=outcome.error is not None))
        self._show(run.show_headroom())
        self._replay_after_error(run, outcome.error)
        return outcome.result(run.hint)

    def _cell_run_if_ready(self, args, magic: str, assigned: set, not_yet: list) -> Optional[GuardedRun]:
        """The run of a `%%numguard` cell whose models did not exist when it began, once they
        all do and stand for what the run needs (before a statement), else None, with why in
        `not_yet[0]` (a name bound first to something else, a scaler the cell makes later)."""
        made = {name.partition(".")[0] for name in args.names}
        if _waiting_for(self.shell.user_ns, _hidden(self.shell), args.names, made):
            return None
        try:
            run = self._start_run(args, magic, made=assigned)
        except UsageError as error:
            not_yet[0] = message_line(error).partition(": ")[2] or message_line(error)
            return None
        run.joined_late.update(run.names)
        if not args.quiet:
            print(f"numguard: guarding {run.describe()} from here on")
        return run

    def _on(self, rest: str) -> None:
        args = parse(ON, rest)
        magic = "%numguard on"
        _refuse_taken_output(self.shell, args, magic)
        waiting_for = self._not_defined_yet(args.names)
        if waiting_for:
            notes = _names_waited_for(self.shell, args.names, magic)
            inside = "" if args.names else model_held_inside(self.shell.user_ns, _hidden(self.shell))
            notes += [f"no model stands under a name of its own, and {inside}"] if inside else []
            try:  # bad options are refused now, not when a model appears
                guard_options(args, capture=False)
            except (TypeError, ValueError) as error:
                raise UsageError(f"{magic}: {message_line(error)}") from None
            for note in notes:
                print(f"numguard: {note}")
            self._show(self._session.arm(lambda: self._armed_run(args, magic), waiting_for))
        else:
            run = self._start_run(args, magic, show_first=self._show_session_reports)
            self._show(self._session.start(run, _running_cell(self.shell)))
        self._listen(True)

    def _not_defined_yet(self, names: List[str]) -> str:
        """What `%numguard on` must wait for, in words ('' where it can start now)."""
        return _waiting_for(self.shell.user_ns, _hidden(self.shell), names)

    def _armed_run(self, args, magic: str) -> Optional[GuardedRun]:
        """The run of an armed `%numguard on`, or None while its models are still missing."""
        if self._not_defined_yet(args.names):
            return None
        try:
            return self._start_run(args, magic, show_first=self._show_session_reports)
        except UsageError as error:  # e.g. the name stands for no model: said once, and waited on
            note = f"numguard: {message_line(error)}"
            if note != self._armed_note:
                print(note)
            self._armed_note = note
            return None

    def _off(self, rest: str) -> None:
        parse_bare(OFF, rest)
        self._listen(False)
        run = self._session.run
        stopped, found = self._session.stop_and_find()
        if run is not None:  # what detaching found: the code after the last model call
            self._show(run.show_collected())
        print(stopped)
        if found is not None:  # the cell fails, in one line (under -q too)
            _CellOutcome(error=found).result(run.hint)

    def _status(self, rest: str) -> None:
        parse_bare(STATUS, rest)
        print(self._session.status())

    def _compare(self, rest: str):
        args = parse(COMPARE, rest)
        if len(args.reports) != 2:
            raise UsageError(
                "%numguard compare needs two reports: %numguard compare GOOD BAD "
                "(names such as good bad, or _numguard_traces[149] _numguard_traces[150])"
            )
        good, bad = (self._report_named(text) for text in args.reports)
        return good.compare(bad, factor=args.factor)

    def _history(self, rest: str):
        args = parse(HISTORY, rest)
        try:
            history = self._session.history(self.shell.user_ns)
        except LookupError as error:
            raise UsageError(f"%numguard history: {message_line(error)}") from None
        return history.view(worst=args.worst)

    # ---- %numguard_dist ------------------------------------------------------------------
    @magic_arguments()
    @argument("--nproc", type=positive_int, default=2, metavar="N", help="processes (ranks) to start")
    @argument("--backend", choices=("gloo", "nccl"), default=None,
              help="default: nccl when CUDA is available, else gloo")
    @argument("--timeout", type=positive_number, default=60.0, metavar="S",
              help="seconds each rank's check may take (default 60)")
    @argument("--size", type=positive_number, default=None, metavar="MB",
              help="all_reduce/broadcast payload in MiB (default: distcheck's, 64)")
    @line_magic
    def numguard_dist(self, line=""):
        """Check that torch.distributed works here: start N ranks (torchrun on this machine),
        verify all_reduce and broadcast, and show one row per rank (ok, error, bandwidth,
        latency). The table is kept as `_numguard_dist`.
        """
        args = parse(self.numguard_dist.parser, line, "%numguard_dist")
        extra = {"size_mb": args.size} if args.size is not None else {}
        from . import distcheck

        try:
            table = distcheck.run(nproc=args.nproc, backend=args.backend, timeout=args.timeout, **extra)
        except ValueError as error:
            raise UsageError(f"%numguard_dist: {message_line(error)}") from None
        self.shell.user_ns["_numguard_dist"] = table
        summary = getattr(table, "attrs", {}).get("summary")
        if summary:
            print(summary)
        _display(table)

    # ---- %numguard_check -----------------------------------------------------------------
    @magic_arguments()
    @argument("name", metavar="NAME", help="a Trainer, or a model (then DATA is needed)")
    @argument("data", nargs="?", default=None, metavar="DATA",
              help="for a model: its training data (Dataset, DataLoader or list of samples)")
    @argument("--loss", default=None, metavar="NAME",
              help="for (inputs, target) samples: the loss function, loss(outputs, target)")
    @line_magic
    def numguard_check(self, line=""):
        """Check a training pipeline step by step (data, collate, forward, loss, backward,
        optimizer, overfit) on a copy of the model, and show where it breaks. The report is kept
        as `_numguard_check`.
        """
        magic = "%numguard_check"
        args = parse(self.numguard_check.parser, line, magic)
        target = self._look_up(args.name, magic)
        data = () if args.data is None else (self._look_up(args.data, magic),)
        options = {"loss_fn": self._look_up(args.loss, magic)} if args.loss else {}
        from . import doctor

        try:
            report = doctor.check_pipeline(target, *data, **options)
        except (TypeError, ValueError) as error:
            raise UsageError(f"{magic}: {message_line(error)}") from None
        self.shell.user_ns["_numguard_check"] = report
        _display(report)

    # ---- %numguard_replay ----------------------------------------------------------------
    @magic_arguments()
    @argument("path", metavar="PATH", help="a replay bundle (numguard_replay_*.pt)")
    @argument("names", nargs="*", metavar="MODEL",
              help="the model(s) to replay on, built fresh (the weights come from the bundle); "
                   "default: the nn.Modules of the namespace")
    @line_magic
    def numguard_replay(self, line=""):
        """Replay a saved capture bundle on CPU: the inputs, weights and random state of the
        call that failed on the GPU, run again where the error is raised at the real line. The
        result is kept as `_numguard_replay`.
        """
        magic = "%numguard_replay"
        if not line.strip():  # argparse would also ask for the optional MODEL
            raise UsageError(f"{magic} needs the bundle's path: {magic} PATH [MODEL ...]")
        args = parse(self.numguard_replay.parser, line, magic)
        models = self._find_models(args.names, magic)
        target = next(iter(models.values())) if len(models) == 1 else models
        from . import replay

        try:
            call = replay.load_capture(args.path, target)
            result = call.replay()  # (a model that cannot be rebuilt raises ReplayError)
        except (OSError, TypeError, ValueError) as error:  # replay.ReplayError is a ValueError
            named = "" if args.names or len(models) < 2 else f" (or name the model: {magic} PATH MODEL)"
            raise UsageError(f"{magic}: {message_line(error)}{named}") from None
        self.shell.user_ns["_numguard_replay"] = result
        _display(result)

    # ---- looking objects up --------------------------------------------------------------
    def _look_up(self, name: str, magic: str):
        """A variable of the namespace, or an attribute path such as trainer.model."""
        try:
            return lookup(self.shell.user_ns, name, _hidden(self.shell))
        except LookupError as error:
            raise UsageError(f"{magic}: {message_line(error)}") from None

    def _find_models(self, names: List[str], magic: str):
        hidden = _hidden(self.shell)
        try:
            return find_models(self.shell.user_ns, names, hidden)
        except LookupError as error:
            raise UsageError(f"{magic}: {message_line(error)}") from None

    def _find_scaler(self, args, magic: str):
        """(name, GradScaler) the run lets skipped steps through with: --scaler's, else the one
        of the namespace; (None, None) when there is none (or several: said in a line)."""
        hidden = _hidden(self.shell)
        try:
            name, scaler, note = find_scaler(self.shell.user_ns, args.scaler, hidden)
        except LookupError as error:
            raise UsageError(f"{magic}: --scaler: {message_line(error)}") from None
        if note and not args.quiet:
            print(note)
        return name, scaler

    def _start_run(self, args, magic: str, show_first=None, made=None) -> GuardedRun:
        """The guard of the models named in `args` (all of the namespace's without names); its
        errors call `show_first()` before IPython prints them. `made`: the names a `%%numguard`
        cell assigns, where its new models can appear (None: anywhere in the namespace)."""
        models = self._find_models(args.names, magic)
        capture, refused = choose_capture(args.capture, models)
        if refused and args.capture:
            raise UsageError(f"{magic}: --capture refused: {refused}: drop --capture, or free host memory")
        if refused and not args.quiet:
            print(f"numguard: no CPU replay after a CUDA error: {refused}")
        scaler_name, scaler = self._find_scaler(args, magic)
        try:
            return GuardedRun(self.shell.user_ns, models, guard_options(args, capture, scaler),
                              output=args.output, quiet=args.quiet,
                              shorten=lambda error, hint: _make_short(error, hint, show_first),
                              scaler_name=scaler_name, every_model=not args.names,
                              hidden=_hidden(self.shell), ops_advice=_OPS_ADVICE.get(magic, ""),
                              new_models_in=made)
        except (TypeError, ValueError) as error:
            raise UsageError(f"{magic}: {message_line(error)}") from None

    def _report_named(self, text: str) -> Report:
        """A report of the namespace: a name, or name[key] / name.attr, read without side effects."""
        magic = "%numguard compare"
        if re.fullmatch(r"[A-Za-z_]\w*(\.\w+|\[\s*-?\w+\s*\])*", text) is None:
            raise UsageError(f"{magic}: {text!r} is not a variable name")
        self._look_up(re.match(r"[A-Za-z_]\w*", text).group(0), magic)  # a helpful error if missing
        try:
            obj = eval(text, self.shell.user_global_ns, self.shell.user_ns)
        except Exception as error:
            raise UsageError(f"{magic}: {_unreadable(text, error, self.shell.user_ns)}") from None
        if not isinstance(obj, Report):
            raise UsageError(
                f"{magic}: {text} is a {type(obj).__name__}, not a numguard Report "
                "(use -o NAME on %%numguard, or _numguard / _numguard_traces[batch])"
            )
        return obj

    # ---- running a guarded cell ----------------------------------------------------------
    def _run_cell(self, run: Optional[GuardedRun], code: list, start) -> tuple:
        """Run the statements one by one, each on the models their names stand for by then: a
        model the cell makes or rebuilds is guarded from the statement after (never by running a
        statement again). Without a run yet, `start()` makes it once its models exist (else
        None). (The run, or None; how the cell ended.)"""
        __tracebackhide__ = True  # noqa: F841
        shell = self.shell
        value = None
        try:
            try:
                for statement in code:
                    if run is None:
                        run = start()
                    if run is not None:
                        self._show(run.step())
                    value = eval(statement, shell.user_global_ns, shell.user_ns)  # exec code gives None
            except BaseException:
                if run is not None:
                    run.guard.detach()
                    run.guard.raise_found(False)
                raise
            if run is not None:  # what detaching found (the cell's own code after the model's
                run.guard.detach()  # last call) fails the cell, as a `with` block's exit does
                run.guard.raise_found()
        except BaseException as error:
            return run, _CellOutcome(error=error)
        return run, _CellOutcome(value=value)

    def _replay_after_error(self, run: Optional[GuardedRun], error) -> None:
        """A CUDA error in a cell whose run captures: the captured call replayed on CPU."""
        if error is None or run is None or run.guard.capture is None or not _is_device_error(error):
            return
        try:
            from . import replay

            result = replay.replay_after_error(run.guard, error)
        except Exception as replay_error:  # never hide the CUDA error behind a replay failure
            print(f"numguard: could not replay the captured call on CPU: {message_line(replay_error)}",
                  file=sys.stderr)
            return
        self.shell.user_ns["_numguard_replay"] = result
        _display(result)

    # ---- %numguard on: the session's events ----------------------------------------------
    def _listen(self, on: bool) -> None:
        """Register (or remove) the session's handlers of IPython's cell events."""
        for event, handler in (("pre_run_cell", self._before_cell), ("post_run_cell", self._after_cell)):
            try:
                self.shell.events.unregister(event, handler)
            except ValueError:
                pass
            if on:
                self.shell.events.register(event, handler)

    def _before_cell(self, info=None) -> None:
        self._show(self._session.before_cell(getattr(info, "raw_cell", "") or ""))

    def _show_session_reports(self) -> None:
        """The reports of `%numguard on` not shown yet: called as its error is printed, so that
        they come first, as in a `%%numguard` cell (the rest follow after the cell)."""
        if self._session.run is not None:
            self._show(self._session.run.show_collected())

    def _after_cell(self, result=None) -> None:
        success = getattr(result, "success", True)
        error = getattr(result, "error_in_exec", None)
        self._show(self._session.after_cell(success, error))
        self._replay_after_error(self._session.guarding, error)  # as in a %%numguard cell

    def show_uncaught(self, error: NonFiniteError) -> str:
        """A NonFiniteError of the Python API (`with Guard(...)`) that nobody caught: its report,
        shown and kept as a %%numguard cell's is. The line that says where it is kept."""
        from .render.widget import display_report
        from .session import REPORT_NAME

        if not getattr(error, "_numguard_shown", False):  # shown again (%tb): the error alone
            display_report(error.report)
            self.shell.user_ns[REPORT_NAME] = error.report
            error._numguard_shown = True
        return f"numguard: the frames that led to it are in {REPORT_NAME}"

    def close(self) -> str:
        """Turn `%numguard on` off and remove its event handlers (for %unload_ext); the line
        that says what was guarded ('numguard: already off' where nothing was)."""
        self._listen(False)
        return self._session.stop()

    # ---- display -------------------------------------------------------------------------
    def _show(self, shown: ToShow) -> None:
        for line in shown.lines:
            print(line)
        if shown.reports:
            from .render.widget import display_report

            for report in shown.reports:
                display_report(report)
        for view in shown.views:
            _display(view)


def _display(obj) -> None:
    from IPython.display import display

    display(obj)


# ---- extension entry points ----------------------------------------------------------------
def load(ipython) -> None:
    """Register the magics on `ipython` (called by `%load_ext numguard_nb`)."""
    if id(ipython) in _loaded:
        return
    magics = NumguardMagics(ipython)
    ipython.register_magics(magics)
    ipython.input_transformers_cleanup.append(magics.syntax_check)
    set_uncaught_display(magics.show_uncaught)
    _loaded[id(ipython)] = magics


def unload(ipython) -> None:
    """Turn guarding off, remove the event handlers and the magics (`%unload_ext numguard_nb`)."""
    magics = _loaded.pop(id(ipython), None)
    if magics is None:
        return
    said = magics.close()
    if said != "numguard: already off":  # %numguard on was on: its cells are no longer guarded
        print(f"{said}; the extension is unloaded")
    if magics.syntax_check in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(magics.syntax_check)
    set_uncaught_display(next(reversed(_loaded.values())).show_uncaught if _loaded else None)
    manager = ipython.magics_manager
    for kind, table in magics.magics.items():
        for name in table:
            if manager.magics.get(kind, {}).get(name) is not None:
                del manager.magics[kind][name]
    manager.registry.pop(type(magics).__name__, None)

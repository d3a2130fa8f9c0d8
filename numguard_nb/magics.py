"""IPython magics: `%%numguard`, `%numguard on|off|status|compare`, `%numguard_dist`,
`%numguard_check`, `%numguard_replay`.

The layer is thin: argument parsing, namespace lookup and display. The work is the engine's
(`Guard`, `Report`) and the renderers' (`render.widget`, `render.html`).

    %load_ext numguard_nb

    %%numguard                      # guard every nn.Module (and Trainer) in the namespace
    loss = model(**batch).loss
    loss.backward()

On a detection the cell fails with a one-line error (the culprit and the batch: the exception
carries `_render_traceback_`, which IPython uses instead of a traceback through the hooks), the
report is displayed above it and kept as `_numguard`.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
from typing import Dict, List, Optional

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split
from torch import nn

from ._util import message_line
from .guard import BatchLimitReached, Guard, NonFiniteError
from .report import Report

__all__ = ["NumguardMagics", "load", "unload", "short_traceback"]

_LAST = "_numguard"  # the last report, in the user namespace
_TRACES = "_numguard_traces"  # {batch: trace report} of the last guarded cell that traced
_LIMIT_DTYPES = ("float16", "bfloat16")

# The shells the extension is loaded in, and their magics (for unload).
_loaded: Dict[int, "NumguardMagics"] = {}


# ---- argument types ------------------------------------------------------------------------
# argparse shows the message of an ArgumentTypeError raised by a `type=` function.
_ArgError = argparse.ArgumentTypeError

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise _ArgError(f"expected a positive integer, got {text!r}")
    return value


def _batch_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise _ArgError(f"expected a batch number >= 0, got {text!r}")
    return value


def _batch_list(text: str) -> List[int]:
    """'1,3' or '149-150' (or a mix) -> sorted batch numbers."""
    batches = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        match = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
        if match:
            lo, hi = int(match.group(1)), int(match.group(2))
            if hi < lo or hi - lo > 10000:
                raise _ArgError(f"bad batch range {part!r}: write e.g. 149-150")
            batches.update(range(lo, hi + 1))
        elif part.isdigit():
            batches.add(int(part))
        else:
            raise _ArgError(f"expected batch numbers like 1,3 or 149-150, got {text!r}")
    if not batches:
        raise _ArgError(f"expected batch numbers like 1,3 or 149-150, got {text!r}")
    return sorted(batches)


def _identifier(text: str) -> str:
    if not text.isidentifier():
        raise _ArgError(f"{text!r} is not a Python variable name")
    return text


def _number_above(text: str, bound: float, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = bound
    if not value > bound:
        raise _ArgError(f"expected {expected}, got {text!r}")
    return value


def _factor(text: str) -> float:
    return _number_above(text, 1.0, "a factor > 1 such as 10")


def _positive_number(text: str) -> float:
    return _number_above(text, 0.0, "a number > 0")




# ---- the short error display ---------------------------------------------------------------
def short_traceback(error: BaseException, hint: str = "") -> List[str]:
    """What IPython shows for a numguard error: the exception's name and its one-line message."""
    name = type(error).__name__
    report = getattr(error, "report", None)
    message = report.summary() if isinstance(report, Report) else str(error)
    lines = [f"\x1b[0;31m{name}\x1b[0m: {message}"]
    if hint:
        lines.append(hint)
    return lines


def _make_short(error: BaseException, hint: str = "") -> BaseException:
    """Give the exception `_render_traceback_`: IPython then prints those lines, not a traceback."""
    if "_render_traceback_" not in getattr(error, "__dict__", {}):
        try:
            error._render_traceback_ = lambda: short_traceback(error, hint)
        except (AttributeError, TypeError):
            pass
    return error


def _is_device_error(error: BaseException) -> bool:
    """A CUDA error (after which the GPU is unusable), as numguard_nb.replay recognises them."""
    from .replay import is_device_error

    return is_device_error(error)


# ---- what one guard saw, between two displays ----------------------------------------------
class _Watch:
    """A Guard plus what it reported since the last `collect()`: detections and traced batches."""

    def __init__(self, models, options: dict, output: Optional[str], quiet: bool, label: str):
        self.output = output
        self.quiet = quiet
        self.label = label
        self.detections: List[Report] = []
        self.traced: List[int] = []  # batch numbers whose trace grew since the last collect
        names = _LAST + (f" and {output}" if output else "")
        self.hint = f"numguard: the frames that led to it are in {names}"
        self.guard = Guard(models, on_trace=self._on_trace, on_detect=self._on_detect, **options)

    def _on_detect(self, report: Report) -> BaseException:
        self.detections.append(report)
        return _make_short(NonFiniteError(report), self.hint)

    def _on_trace(self, report: Report) -> None:
        if report.batch_number not in self.traced:
            self.traced.append(report.batch_number)

    def collect(self) -> List[Report]:
        """Reports to show since the last call: the traces that grew, then the detections."""
        reports = [self.guard.traces[b] for b in self.traced if b in self.guard.traces]
        reports.extend(self.detections)
        self.traced = []
        self.detections = []
        return reports

    def describe(self) -> str:
        models = self.guard.models
        if list(models) == [""]:
            module = models[""]
            return f"{self.label} ({type(module).__name__})"
        return ", ".join(f"{name} ({type(m).__name__})" for name, m in models.items())


# ---- the magics ----------------------------------------------------------------------------


@magics_class
class NumguardMagics(Magics):
    def __init__(self, shell):
        super().__init__(shell)
        self._session: Optional[_Watch] = None  # the guard of `%numguard on`
        self._session_suspended = False
        self._pre = self._pre_run_cell
        self._post = self._post_run_cell

    # ---- %%numguard / %numguard ----------------------------------------------------------
    @magic_arguments()
    @argument("names", nargs="*", metavar="MODEL",
              help="models (nn.Module or Trainer) to guard; default: all in the namespace. "
                   "In line mode the first word is on, off, status or compare.")
    @argument("--frames", type=_positive_int, default=21, metavar="N",
              help="frames kept in the report, leading up to the culprit (default 21)")
    @argument("--trace", type=_batch_list, default=None, metavar="B,B",
              help="batch numbers to trace (every frame recorded, no stop): 1,3 or 149-150")
    @argument("--abort-after", type=_batch_number, default=None, metavar="N",
              help="stop (BatchLimitReached) when batch N+1 starts")
    @argument("--no-backward", action="store_true", help="watch the forward pass only")
    @argument("--sync", action="store_true",
              help="check in every hook (slower; for when the process would crash first)")
    @argument("--allow-inf", nargs="*", default=None, metavar="GLOB",
              help="let modules produce +-inf on purpose: all of them, or those matching the globs")
    @argument("--ops", action="store_true",
              help="on a detection, name the first ATen op that turned non-finite and its source line")
    @argument("--limit-dtype", choices=_LIMIT_DTYPES, default=None,
              help="count values beyond this dtype's range as overflow/underflow (predicted)")
    @argument("--capture", dest="capture", action="store_const", const=True, default=None,
              help="keep the last inputs to replay a call on CPU after a CUDA error "
                   "(default: on when a guarded model has a parameter on CUDA)")
    @argument("--no-capture", dest="capture", action="store_const", const=False,
              help="do not capture inputs")
    @argument("-q", "--quiet", action="store_true", help="display nothing; only store the report")
    @argument("-o", "--output", type=_identifier, default=None, metavar="NAME",
              help="also store the report in the namespace as NAME")
    @argument("--factor", type=_factor, default=10.0, metavar="F",
              help="compare: the ratio of abs max that counts as a difference (default 10)")
    @line_cell_magic
    def numguard(self, line="", cell=None):
        """Guard a cell (`%%numguard`), or every following cell (`%numguard on`), with a
        numguard Guard: find the first module that produces an inf or a nan, forward or backward.

            %%numguard [options] [MODEL ...]      guard this cell
            %numguard on [options] [MODEL ...]    guard every following cell (a loop split across cells)
            %numguard off                         stop guarding
            %numguard status                      what is guarded
            %numguard compare A B [--factor F]    first module whose abs max differs > F x (default 10)

        MODEL names a torch.nn.Module or a Hugging Face Trainer (its .model) in the namespace (dotted
        names such as trainer.model work). Without a name, every nn.Module of the namespace that is not a
        submodule of another one is guarded, and each Trainer stands for its model.

        On a detection the cell fails with a one-line error naming the culprit and the batch, the report
        (the module tree, collapsible, with the path to the culprit open) is displayed, and kept as
        `_numguard` (and in -o NAME). With --trace, one report per traced batch is displayed and
        `_numguard_traces` maps each traced batch to its report. Put MODEL names before --allow-inf,
        which takes the globs that follow it.
        """
        __tracebackhide__ = True  # noqa: F841 (IPython leaves this frame out of tracebacks)
        args = self._parse(self.numguard, line, "%%numguard" if cell is not None else "%numguard")
        if cell is not None:
            return self._guard_cell(args, cell)
        if not args.names:
            raise UsageError(
                "%numguard needs on, off, status or compare; to guard one cell use %%numguard "
                "(two %) on the cell's first line"
            )
        command, rest = args.names[0], args.names[1:]
        if command == "on":
            return self._on(args, rest)
        if command == "off":
            self._no_names("off", rest)
            return self._off()
        if command == "status":
            self._no_names("status", rest)
            return self._status()
        if command == "compare":
            return self._compare(rest, args.factor)
        raise UsageError(
            f"%numguard: unknown command {command!r}: use on, off, status or compare "
            "(to guard one cell, write %%numguard on its first line)"
        )

    # ---- %numguard_dist ------------------------------------------------------------------
    @magic_arguments()
    @argument("--nproc", type=_positive_int, default=2, metavar="N", help="processes (ranks) to start")
    @argument("--backend", choices=("gloo", "nccl"), default=None,
              help="default: nccl when CUDA is available, else gloo")
    @argument("--timeout", type=_positive_number, default=60.0, metavar="S",
              help="seconds each rank's check may take (default 60)")
    @argument("--size", type=_positive_number, default=None, metavar="MB",
              help="all_reduce/broadcast payload in MiB (default: distcheck's, 64)")
    @line_magic
    def numguard_dist(self, line=""):
        """Check that torch.distributed works here: start N ranks (torchrun on this machine),
        verify all_reduce and broadcast, and show one row per rank (ok, error, bandwidth,
        latency). The table is kept as `_numguard_dist`.
        """
        args = self._parse(self.numguard_dist, line, "%numguard_dist")
        from . import distcheck
        try:
            extra = {"size_mb": args.size} if args.size is not None else {}
            table = distcheck.run(nproc=args.nproc, backend=args.backend, timeout=args.timeout, **extra)
        except ValueError as error:
            raise UsageError(f"%numguard_dist: {message_line(error)}") from None
        self.shell.user_ns["_numguard_dist"] = table
        summary = getattr(table, "attrs", {}).get("summary")
        if summary:
            print(summary)
        self._display(table)

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
        args = self._parse(self.numguard_check, line, "%numguard_check")
        obj = self._lookup(args.name, "%numguard_check")
        data = self._lookup(args.data, "%numguard_check") if args.data is not None else None
        options = {"loss_fn": self._lookup(args.loss, "%numguard_check")} if args.loss else {}
        from . import doctor

        try:
            if data is None and not options:
                report = doctor.check_pipeline(obj)
            else:
                report = doctor.check_pipeline(obj, data, **options)
        except (TypeError, ValueError) as error:
            raise UsageError(f"%numguard_check: {message_line(error)}") from None
        self.shell.user_ns["_numguard_check"] = report
        self._display(report)

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
        if not line.strip():  # argparse would also ask for the optional MODEL
            raise UsageError("%numguard_replay needs the bundle's path: %numguard_replay PATH [MODEL ...]")
        args = self._parse(self.numguard_replay, line, "%numguard_replay")
        models = self._resolve(args.names, "%numguard_replay")
        target = next(iter(models.values())) if len(models) == 1 else models
        from . import replay
        try:
            call = replay.load_capture(args.path, target)
        except (OSError, TypeError, ValueError) as error:  # replay.ReplayError is a ValueError
            raise UsageError(f"%numguard_replay: {message_line(error)}") from None
        result = call.replay()
        self.shell.user_ns["_numguard_replay"] = result
        self._display(result)

    # ---- argument parsing and lookup -----------------------------------------------------
    def _parse(self, func, line: str, magic: str):
        """Parse with the magic's own parser; options and names may come in any order."""
        try:
            args = func.parser.parse_intermixed_args(arg_split(line))
        except UsageError as error:
            raise UsageError(f"{magic}: {message_line(error)}; see {magic}? for the options") from None
        except SystemExit:
            raise UsageError(f"{magic}: cannot parse {line.strip()!r}; see {magic}? for the options") from None
        except ValueError as error:  # unbalanced quotes
            raise UsageError(f"{magic}: {message_line(error)} in {line.strip()!r}") from None
        # IPython splits like a shell but keeps the quotes: 'a b' is one word, written 'a b'.
        for key, value in vars(args).items():
            if isinstance(value, str):
                setattr(args, key, _unquote(value))
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                setattr(args, key, [_unquote(v) for v in value])
        return args

    @staticmethod
    def _no_names(command: str, rest: list) -> None:
        if rest:
            raise UsageError(f"%numguard {command} takes no names (got {' '.join(rest)})")

    def _lookup(self, name: str, magic: str):
        """A variable of the namespace, or an attribute path such as trainer.model."""
        ns = self.shell.user_ns
        first, _, rest = name.partition(".")
        if not first.isidentifier() or (rest and not all(p.isidentifier() for p in rest.split("."))):
            raise UsageError(f"{magic}: {name!r} is not a variable name: name an object of the notebook")
        if first not in ns:
            close = difflib.get_close_matches(first, [k for k in ns if not k.startswith("_")], n=1)
            hint = f"; did you mean {close[0]}?" if close else "; define it first (run its cell)"
            raise UsageError(f"{magic}: no variable named {first!r} in the namespace{hint}")
        obj = ns[first]
        path = first
        for part in rest.split(".") if rest else []:
            if not hasattr(obj, part):
                raise UsageError(f"{magic}: {path} ({type(obj).__name__}) has no attribute {part!r}")
            obj = getattr(obj, part)
            path += "." + part
        return obj

    def _resolve(self, names: list, magic: str) -> Dict[str, nn.Module]:
        """name -> module to guard, from the names given or from the whole namespace."""
        found: Dict[str, nn.Module] = {}
        if names:
            for name in names:
                obj = self._lookup(name, magic)
                module = _as_module(obj)
                if module is None:
                    raise UsageError(
                        f"{magic}: {name} is a {type(obj).__name__}, not a torch.nn.Module or a "
                        "Trainer: name the model to guard"
                    )
                found[name] = module
        else:
            hidden = getattr(self.shell, "user_ns_hidden", {})
            for name, obj in list(self.shell.user_ns.items()):
                if name.startswith("_") or (name in hidden and hidden[name] is obj):
                    continue
                module = _as_module(obj)
                if module is not None:
                    found[name] = module
            if not found:
                raise UsageError(
                    f"{magic}: no torch.nn.Module (or Trainer) in the namespace: create the model "
                    "first, or name it after the magic"
                )
        return _top_level(found)

    def _guard_options(self, args, models: Dict[str, nn.Module], magic: str) -> dict:
        allow_inf = False if args.allow_inf is None else (args.allow_inf or True)
        capture = args.capture
        if capture is None:  # on by default where asynchronous CUDA errors can happen...
            capture = any(p.is_cuda for m in models.values() for p in m.parameters())
        if capture:  # ...and where the weights' host copy fits
            from .replay import snapshot_fits

            fits, why = snapshot_fits(models)
            if not fits and args.capture:
                raise UsageError(f"{magic}: --capture refused: {why}: drop --capture, or free host memory")
            if not fits:
                capture = False
                if not args.quiet:
                    print(f"numguard: no CPU replay after a CUDA error: {why}")
        return dict(
            max_frames=args.frames, trace_batches=args.trace or (),
            abort_after_batch=args.abort_after, backward=not args.no_backward, sync=args.sync,
            allow_inf=allow_inf, limit_dtype=args.limit_dtype, ops=args.ops, capture=capture,
        )

    def _watch(self, args, names: list, magic: str) -> _Watch:
        models = self._resolve(names, magic)
        options = self._guard_options(args, models, magic)
        target = next(iter(models.values())) if len(models) == 1 else models
        try:
            return _Watch(target, options, args.output, args.quiet, ", ".join(models))
        except (TypeError, ValueError) as error:
            raise UsageError(f"{magic}: {message_line(error)}") from None

    # ---- running a guarded cell ----------------------------------------------------------
    def _compile_cell(self, cell: str):
        """(exec code, eval code of the last expression or None), the way %%time compiles."""
        shell = self.shell
        # A blank first line stands for the %%numguard line: tracebacks give the cell's line numbers.
        source = "\n" + shell.transform_cell(cell)
        filename = shell.compile.cache(source, shell.execution_count)
        tree = shell.compile.ast_parse(source, filename=filename)
        tree = shell.transform_ast(tree)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        body = shell.compile(tree, filename, "exec")
        tail = shell.compile(last, filename, "eval") if last is not None else None
        return body, tail

    def _guard_cell(self, args, cell: str):
        __tracebackhide__ = True  # noqa: F841
        if args.names and args.names[0] in ("on", "off", "status", "compare") \
                and args.names[0] not in self.shell.user_ns:
            raise UsageError(
                f"%%numguard guards the cell below it; for '{args.names[0]}' use the line magic "
                f"%numguard {args.names[0]} (one %)"
            )
        watch = self._watch(args, args.names, "%%numguard")
        body, tail = self._compile_cell(cell)  # a SyntaxError is raised before any hook
        shell = self.shell
        try:
            with watch.guard:
                exec(body, shell.user_global_ns, shell.user_ns)
                value = eval(tail, shell.user_global_ns, shell.user_ns) if tail is not None else None
        except (NonFiniteError, BatchLimitReached) as error:
            self._finish_cell(watch, failed=True)
            # The hooks' frames hold activations: drop them, and show one line (see _make_short).
            raise _make_short(error, watch.hint if isinstance(error, NonFiniteError) else "") \
                .with_traceback(None) from None
        except BaseException as error:
            self._finish_cell(watch, failed=True)
            if watch.guard.capture is not None and _is_device_error(error):
                self._replay_after_error(watch.guard, error)
            raise
        self._finish_cell(watch, failed=False)
        return value

    def _finish_cell(self, watch: _Watch, failed: bool) -> None:
        """Display what the guard found, keep the last report in the namespace."""
        if self._show_collected(watch):
            return
        latest = watch.guard.report
        self._store([latest], watch)
        if not watch.quiet and not failed:
            if latest.frames:
                print(f"numguard: {latest.summary()}")
            else:
                print(f"numguard: {watch.describe()} was not called in this cell")

    def _store(self, reports: List[Report], watch: _Watch) -> None:
        ns = self.shell.user_ns
        ns[_LAST] = reports[-1]
        if watch.output:
            ns[watch.output] = reports[-1]
        if watch.guard.traces:
            ns[_TRACES] = dict(sorted(watch.guard.traces.items()))

    def _replay_after_error(self, guard: Guard, error: BaseException) -> None:
        try:
            from . import replay

            result = replay.replay_after_error(guard, error)
        except Exception as replay_error:  # never hide the CUDA error behind a replay failure
            print(f"numguard: could not replay the captured call on CPU: {message_line(replay_error)}",
                  file=sys.stderr)
            return
        self.shell.user_ns["_numguard_replay"] = result
        self._display(result)

    # ---- %numguard on / off / status -----------------------------------------------------
    def _on(self, args, names: list) -> None:
        watch = self._watch(args, names, "%numguard on")
        self._off(quiet=True)
        self._session = watch
        self._session_suspended = False
        self.shell.events.register("pre_run_cell", self._pre)
        self.shell.events.register("post_run_cell", self._post)
        if not args.quiet:
            print(f"numguard: on, guarding {watch.describe()} in every cell until %numguard off")

    def _off(self, quiet: bool = False) -> None:
        watch = self._session
        self._session = None
        for event, callback in (("pre_run_cell", self._pre), ("post_run_cell", self._post)):
            try:
                self.shell.events.unregister(event, callback)
            except ValueError:
                pass
        if watch is None:
            if not quiet:
                print("numguard: already off")
            return
        watch.guard.detach()
        if not quiet:
            print(f"numguard: off (guarded {watch.describe()} up to batch {watch.guard.batch_number})")

    def _status(self) -> None:
        watch = self._session
        if watch is None:
            print("numguard: off (%numguard on [MODEL ...] guards every following cell)")
            return
        guard = watch.guard
        found = "; a detection is in _numguard" if guard.detection is not None else ""
        traced = f"; tracing batches {sorted(guard.trace_batches)}" if guard.trace_batches else ""
        print(f"numguard: on, guarding {watch.describe()}, at batch {guard.batch_number}{traced}{found}")

    def _pre_run_cell(self, info=None) -> None:
        watch = self._session
        if watch is None:
            return
        raw = getattr(info, "raw_cell", "") or ""
        if raw.lstrip().startswith("%%numguard"):
            # That cell brings its own guard: two guards on one model would double every hook.
            watch.guard.detach()
            self._session_suspended = True
            return
        self._session_suspended = False
        from .replay import CaptureTooLarge

        try:
            watch.guard.attach()
        except CaptureTooLarge as error:
            # Memory shrank since %numguard on: guard the cell anyway, without the capture.
            watch.guard.capture_enabled = False
            print(f"numguard: no CPU replay after a CUDA error from now on: {message_line(error)}")
            watch.guard.attach()

    def _post_run_cell(self, result=None) -> None:
        watch = self._session
        if watch is None:
            return
        if self._session_suspended:
            return
        error = getattr(result, "error_in_exec", None)
        success = getattr(result, "success", True)
        if not success:
            watch.guard.reset()  # an interrupted pass must not leak into the next cell
        if isinstance(error, NonFiniteError):
            # The traceback through the hooks keeps the activations alive: drop it.
            error.with_traceback(None)
            if getattr(sys, "last_value", None) is error:
                sys.last_traceback = None
        self._show_collected(watch)

    def _show_collected(self, watch: _Watch) -> bool:
        """Store and display what the guard reported since last time; False if nothing."""
        reports = watch.collect()
        if not reports:
            return False
        self._store(reports, watch)
        if not watch.quiet:
            for report in reports:
                self._display_report(report)
        return True

    # ---- %numguard compare ---------------------------------------------------------------
    def _compare(self, names: list, factor: float):
        if len(names) != 2:
            raise UsageError(
                "%numguard compare needs two reports: %numguard compare GOOD BAD "
                "(names such as good bad, or _numguard_traces[149] _numguard_traces[150])"
            )
        reports = []
        for name in names:
            obj = self._lookup_expression(name)
            if not isinstance(obj, Report):
                raise UsageError(
                    f"%numguard compare: {name} is a {type(obj).__name__}, not a numguard Report "
                    "(use -o NAME on %%numguard, or _numguard / _numguard_traces[batch])"
                )
            reports.append(obj)
        return reports[0].compare(reports[1], factor=factor)

    def _lookup_expression(self, text: str):
        """A name (or name[key] / name.attr) of the namespace, evaluated without side effects."""
        if re.fullmatch(r"[A-Za-z_]\w*(\.\w+|\[\s*-?\w+\s*\])*", text) is None:
            raise UsageError(f"%numguard compare: {text!r} is not a variable name")
        head = re.match(r"[A-Za-z_]\w*", text).group(0)
        if head not in self.shell.user_ns:
            self._lookup(head, "%numguard compare")  # raises the helpful UsageError
        try:
            return eval(text, self.shell.user_global_ns, self.shell.user_ns)
        except Exception as error:
            raise UsageError(f"%numguard compare: cannot read {text}: {message_line(error)}") from None

    # ---- display -------------------------------------------------------------------------
    def _display_report(self, report: Report) -> None:
        from .render.widget import display_report

        display_report(report)

    @staticmethod
    def _display(obj) -> None:
        from IPython.display import display

        display(obj)

    def close(self) -> None:
        """Turn `%numguard on` off and remove its event handlers (for %unload_ext)."""
        self._off(quiet=True)


# ---- namespace helpers ---------------------------------------------------------------------
def _as_module(obj) -> Optional[nn.Module]:
    """The module an object stands for: itself, or a Trainer's `.model` (duck-typed)."""
    if isinstance(obj, nn.Module):
        return obj
    # A Trainer: its class has a train method (looked up on the class: no instance __getattr__
    # of arbitrary namespace objects runs) and the instance a .model that is a module.
    if isinstance(obj, type) or not callable(getattr(type(obj), "train", None)):
        return None
    try:
        model = getattr(obj, "model", None)
    except Exception:
        return None
    return model if isinstance(model, nn.Module) else None


def _top_level(found: Dict[str, nn.Module]) -> Dict[str, nn.Module]:
    """Drop duplicates and modules that are submodules of another found one (order kept)."""
    unique: Dict[str, nn.Module] = {}
    seen = set()
    for name, module in found.items():
        if id(module) in seen:
            continue
        seen.add(id(module))
        unique[name] = module
    if len(unique) < 2:
        return unique
    inner = set()
    for module in unique.values():
        inner.update(id(sub) for sub in module.modules() if sub is not module)
    return {name: module for name, module in unique.items() if id(module) not in inner}


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text



# ---- extension entry points ----------------------------------------------------------------
def load(ipython) -> None:
    """Register the magics on `ipython` (called by `%load_ext numguard_nb`)."""
    if id(ipython) in _loaded:
        return
    magics = NumguardMagics(ipython)
    ipython.register_magics(magics)
    _loaded[id(ipython)] = magics


def unload(ipython) -> None:
    """Turn guarding off, remove the event handlers and the magics (`%unload_ext numguard_nb`)."""
    magics = _loaded.pop(id(ipython), None)
    if magics is None:
        return
    magics.close()
    manager = ipython.magics_manager
    for kind, table in magics.magics.items():
        for name in table:
            if manager.magics.get(kind, {}).get(name) is not None:
                del manager.magics[kind][name]
    manager.registry.pop(type(magics).__name__, None)

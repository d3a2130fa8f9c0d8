"""The magics' arguments: one parser per form of `%numguard` (each with only its own options),
the argument types, one-line usage errors, and the one place that turns options into the
Guard's settings (`guard_options`). The magics' help is written from these parsers.
"""

from __future__ import annotations

import argparse
import itertools
import inspect
import re
from typing import List, Optional

from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicArgumentParser
from IPython.utils.process import arg_split

from ._schema import MODE_FULL, MODE_SENTINEL
from ._util import message_line
from .guard import GuardOptions
from .guard.options import LIMIT_DTYPES as _DTYPE_NAMES

LIMIT_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


# ---- argument types ------------------------------------------------------------------------
# argparse shows the message of an ArgumentTypeError raised by a `type=` function.
_ArgError = argparse.ArgumentTypeError

def limit_dtype(text: str) -> str:
    """A name `limit_dtype` accepts ("fp16", "bf16", "e4m3", ...), as the Guard option takes it."""
    name = text.lower()
    name = name[len("torch."):] if name.startswith("torch.") else name
    if name not in _DTYPE_NAMES:
        raise _ArgError(f"expected one of {', '.join(LIMIT_DTYPES)} (or fp16, bf16, e4m3, "
                        f"e5m2), got {text!r}")
    return name


def positive_int(text: str) -> int:
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


def positive_number(text: str) -> float:
    return _number_above(text, 0.0, "a number > 0")


# ---- the parsers: one per form of %numguard, each with only its own options ---------------
# MagicHelpFormatter writes one % before each prog: "numguard on" shows as %numguard on.
def _guard_parser(prog: str) -> MagicArgumentParser:
    """The options of a guarded run: the cell form and `%numguard on`."""
    parser = MagicArgumentParser(prog=prog)
    parser.add_argument("names", nargs="*", metavar="MODEL",
                        help="models (nn.Module or Trainer) to guard; default: all in the namespace")
    add = parser.add_argument
    add("--frames", type=positive_int, default=21, metavar="N",
        help="frames kept in the report, leading up to the culprit (default 21)")
    add("--trace", type=_batch_list, default=None, metavar="B,B", action="extend",
        help="batch numbers to trace (every frame recorded, no stop): 1,3 or 149-150")
    add("--abort-after", type=_batch_number, default=None, metavar="N",
        help="stop (BatchLimitReached) when batch N+1 starts")
    add("--no-backward", action="store_true", help="watch the forward pass only")
    add("--sync", action="store_true",
        help="check in every hook (slower; for when the process would crash first)")
    add("--allow-inf", nargs="*", default=None, metavar="GLOB",
        help="let modules produce +-inf on purpose: all of them, or those matching the globs")
    add("--ops", action="store_true",
        help="on a detection, name the first ATen op that turned non-finite and its source line")
    add("--sentinel", action="store_true",
        help="check only the models' outputs and the gradients, at almost no cost (compiled models "
             "stay compiled); re-run a failing call with the full hooks")
    add("--limit-dtype", type=limit_dtype, default=None, metavar="DTYPE",
        help="collect the values beyond this dtype's range (predicted overflow/underflow) and "
             "show them after the cell")
    add("--stop-at-limit", action="store_true",
        help="with --limit-dtype: stop at the first predicted overflow instead")
    add("--capture", dest="capture", action="store_const", const=True, default=None,
        help="keep the last inputs to replay a call on CPU after a CUDA error "
             "(default: on when a guarded model has a parameter on CUDA)")
    add("--no-capture", dest="capture", action="store_const", const=False,
        help="do not capture inputs")
    add("--history-every", type=positive_int, default=None, metavar="N",
        help="keep every Nth batch's ranges per module (%%numguard history shows them)")
    add("--scaler", default=None, metavar="NAME",
        help="the GradScaler (or a Trainer with one) whose skipped steps are let through; "
             "default: the one GradScaler of the namespace")
    add("-q", "--quiet", action="store_true", help="display nothing; only store the report")
    add("-o", "--output", type=_identifier, default=None, metavar="NAME",
        help="also store the report in the namespace as NAME")
    return parser


def _bare_parser(prog: str) -> MagicArgumentParser:
    """`%numguard off` and `status`: no options (names are collected to say they are not taken)."""
    parser = MagicArgumentParser(prog=prog)
    parser.add_argument("names", nargs="*", help=argparse.SUPPRESS)
    return parser


def _compare_parser() -> MagicArgumentParser:
    parser = MagicArgumentParser(prog="numguard compare")
    parser.add_argument("reports", nargs="*", metavar="REPORT",
                        help="two reports: GOOD BAD (names, or _numguard_traces[batch])")
    parser.add_argument("--factor", type=_factor, default=10.0, metavar="F",
                        help="the ratio of abs max that counts as a difference (default 10)")
    return parser


def _history_parser() -> MagicArgumentParser:
    parser = MagicArgumentParser(prog="numguard history")
    parser.add_argument("--worst", type=positive_int, default=3, metavar="N",
                        help="modules nearest their dtype's limit to number and follow (default 3)")
    return parser


CELL = _guard_parser("%numguard")
ON = _guard_parser("numguard on")
OFF = _bare_parser("numguard off")
STATUS = _bare_parser("numguard status")
COMPARE = _compare_parser()
HISTORY = _history_parser()


def _magic(parser: MagicArgumentParser) -> str:
    """'%numguard on' for the parser of `%numguard on`."""
    return "%" + parser.prog


def parse(parser: MagicArgumentParser, line: str, magic: Optional[str] = None):
    """Parse with `parser`; options and names may come in any order. Errors are one-line
    UsageErrors that point at the magic's help."""
    magic = magic or _magic(parser)
    help_name = magic.split()[0]
    try:
        words = arg_split(line)
        # A word starting with # starts a comment, as in a shell: `%numguard on  # the loop`
        words = list(itertools.takewhile(lambda word: not word.startswith("#"), words))
        args = parser.parse_intermixed_args(words)
    except UsageError as error:
        raise UsageError(f"{magic}: {message_line(error)}; see {help_name}? for the options") from None
    except SystemExit:
        raise UsageError(f"{magic}: cannot parse {line.strip()!r}; see {help_name}? for the options") from None
    except ValueError as error:  # unbalanced quotes
        raise UsageError(f"{magic}: {message_line(error)} in {line.strip()!r}") from None
    # IPython splits like a shell but keeps the quotes: 'a b' is one word, written 'a b'.
    for key, value in vars(args).items():
        if isinstance(value, str):
            setattr(args, key, _unquote(value))
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            setattr(args, key, [_unquote(v) for v in value])
    return args


def parse_bare(parser: MagicArgumentParser, line: str) -> None:
    args = parse(parser, line)
    if args.names:
        raise UsageError(f"{_magic(parser)} takes no names (got {' '.join(args.names)})")


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def guard_options(args, capture: bool, scaler=None) -> GuardOptions:
    """The Guard's options from the parsed options of a guarded run, checked by the engine: the
    one place that turns options into engine settings."""
    allow_inf = False if args.allow_inf is None else (args.allow_inf or True)
    if args.stop_at_limit and args.limit_dtype is None:  # said with the magic's own flags
        raise ValueError(f"--stop-at-limit needs --limit-dtype ({', '.join(LIMIT_DTYPES)}): the "
                         "narrower format whose first overflow it stops at")
    if args.sentinel and args.limit_dtype is not None:
        raise ValueError("--limit-dtype is measured by the full hooks, which --sentinel does not run: "
                         "drop --sentinel to see what would not fit in that format")
    return GuardOptions(
        max_frames=args.frames, trace_batches=sorted(set(args.trace or ())),
        abort_after_batch=args.abort_after,
        backward=not args.no_backward, sync=args.sync, allow_inf=allow_inf,
        limit_dtype=args.limit_dtype, stop_at_limit=args.stop_at_limit, ops=args.ops,
        capture=capture, history_every=args.history_every, scaler=scaler,
        mode=MODE_SENTINEL if args.sentinel else MODE_FULL,
    )


def with_usage(*parsers: MagicArgumentParser):
    """Append each parser's usage and options to the magic's docstring (what `%numguard?` shows)."""
    def document(func):
        func.__doc__ = "\n\n".join([inspect.cleandoc(func.__doc__)] + [p.format_help() for p in parsers])
        return func
    return document

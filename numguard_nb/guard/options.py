"""The Guard's options, validated once into one immutable object.

`GuardOptions(**keywords)` takes the keyword arguments of `Guard` and checks them, raising a
one-line `ValueError` naming the option (a `TypeError` for a callback that cannot be called, or
for a misspelt option). The Guard builds one in `__init__`; the Trainer and Lightning callbacks
and the magics build one to check what they were given before anything runs, then hand it to
the Guard with `Guard(model, **options.as_kwargs())`.

The options also carry the numbers the detection rules need (`limit_max`, `limit_tiny`,
`inf_allowed`), so that `detect` and `frames` read them from here rather than from the Guard,
and the rules a detection stops on (`stop_rules`: without the limit where predicted values go to
the headroom).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
from typing import Callable, FrozenSet, Iterable, Optional, Tuple, Union

import torch

from .._schema import MODE_FULL, MODE_SENTINEL, MODES
from .scaler import is_loss_scaler

__all__ = ["GuardOptions", "LIMIT_DTYPES", "OPTION_DOCS", "keyword_signature"]

# What each option means; appended to the Guard's docstring, so `help(Guard)` shows it.
OPTION_DOCS = """
    Options (keyword-only; checked by `GuardOptions`):
        max_frames: frames kept in the report, leading up to the culprit.
        trace_batches: batch numbers (0-indexed calls of the first model) whose every frame is
            recorded in `guard.traces[batch]`, without stopping on inf/nan.
        abort_after_batch: raise `BatchLimitReached` when batch `abort_after_batch + 1` starts.
        backward: also watch gradients (module outputs, inputs, parameters).
        sync: read statistics in every hook and raise there (slower; for when the process would
            crash before the pass ends).
        allow_inf: True, or module-name globs, for modules that legitimately produce +-inf.
        limit_dtype: a format narrower than float32 that the run may move to, e.g. torch.float16,
            torch.bfloat16 or torch.float8_e4m3fn: the run goes on, and every value beyond its
            largest finite value (a predicted overflow) and every non-zero value below its
            smallest (a predicted underflow) is collected in `guard.headroom`; real inf/nan
            still stop the run. Measured by the full hooks: with mode="sentinel" it needs
            full_every (its sampled batches are the ones measured).
        stop_at_limit: with limit_dtype (needs it), stop at the first predicted overflow instead,
            with `NonFiniteError` as for a real inf.
        on_trace: called with each traced batch's report after each of its passes.
        on_detect: called with the report before `NonFiniteError` is raised; if it returns an
            exception, that exception is raised instead.
        ops: on a detection, re-run the failing step inside the culprit module to name the first
            ATen op that turned non-finite and the source line that called it.
        capture: keep host copies of the last calls' inputs and a host snapshot of the weights,
            to replay a call on CPU after an asynchronous CUDA error (`guard.capture`).
        full_every: with mode="sentinel", N to run every Nth batch with the full hooks, which
            stop on what the sentinel's checks of outputs and gradients cannot see (an overflow
            the model clamps inside itself, limit_dtype's headroom); None: never. The training
            callbacks use 100 (see docs/sentinel.md for its cost).
        history_every: N to keep every Nth batch's ranges (abs min/max of each module call's
            outputs, gradients and weights) in `guard.history`, to watch a drift toward the
            dtype's limit; None (the default): no history.
        scaler: the torch.amp.GradScaler the loop scales the loss with (default: the one seen
            scaling the loss, `scaler.scale(loss)`): a non-finite gradient made in backward while
            its scale is above 1 is let through (the scaler skips that step) and recorded in
            `guard.skipped_steps`. Forward values are never let through.
        max_skipped_steps: at most this many steps in a row the scaler may skip before the next
            overflowing gradient is raised (None, the default: until its scale reaches 1).
        mode: "full" (hooks on every module call) or "sentinel" (a whole run at almost no cost:
            checks the outputs of the model's calls and the gradients after each backward; on
            the first inf/nan, re-runs that call with the full guard; docs/sentinel.md).
"""

# The names limit_dtype accepts (after dropping a "torch." prefix, in any case); the first name
# of each dtype is its own. The float8 formats are those this torch has.
LIMIT_DTYPES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
# Known, and refused: a limit as wide as the float32 a run computes in would predict nothing.
_WIDE_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}
_FLOAT8_NAMES = {
    "float8_e4m3fn": ("fp8_e4m3fn", "fp8_e4m3", "e4m3"), "float8_e5m2": ("fp8_e5m2", "e5m2"),
    "float8_e4m3fnuz": ("fp8_e4m3fnuz",), "float8_e5m2fnuz": ("fp8_e5m2fnuz",),
}
LIMIT_DTYPES.update({alias: getattr(torch, name) for name, aliases in _FLOAT8_NAMES.items()
                     if hasattr(torch, name) for alias in (name,) + aliases})


@dataclasses.dataclass(frozen=True)
class GuardOptions:
    """Everything a Guard is told besides the models, checked; see `Guard` for what each means.

    Normalised on the way in: `trace_batches` becomes a frozenset, `allow_inf` True, False or a
    tuple of module-name globs, `limit_dtype` a torch dtype (names like "fp16" are accepted).
    `replace(**changes)` gives a checked copy.
    """

    max_frames: int = 21
    trace_batches: FrozenSet[int] = frozenset()
    abort_after_batch: Optional[int] = None
    backward: bool = True
    sync: bool = False
    allow_inf: Union[bool, Tuple[str, ...]] = False
    limit_dtype: Optional[torch.dtype] = None
    stop_at_limit: bool = False
    on_trace: Optional[Callable] = None
    on_detect: Optional[Callable] = None
    ops: bool = False
    capture: bool = False
    history_every: Optional[int] = None
    full_every: Optional[int] = None
    scaler: Optional[object] = None  # a torch.amp.GradScaler, or an object that works like one
    max_skipped_steps: Optional[int] = None
    mode: str = MODE_FULL
    # Derived from limit_dtype: its largest finite value, and its smallest positive (subnormal)
    # value, below which a value flushes to 0. None without limit_dtype.
    limit_max: Optional[float] = dataclasses.field(init=False, default=None)
    limit_tiny: Optional[float] = dataclasses.field(init=False, default=None)
    # What detection stops on: these options, or, where predicted values go to the headroom
    # instead (limit_dtype without stop_at_limit), the same options without the limit.
    stop_rules: "GuardOptions" = dataclasses.field(init=False, default=None, repr=False,
                                                   compare=False)

    def __post_init__(self):
        set_field = object.__setattr__  # frozen: normalised values are written this once
        _check_max_frames(self.max_frames)
        set_field(self, "trace_batches", _parse_trace_batches(self.trace_batches))
        _check_abort_after_batch(self.abort_after_batch)
        for name in ("backward", "sync", "ops", "capture", "stop_at_limit"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        _check_every("history_every", self.history_every)
        _check_every("full_every", self.full_every)
        if self.full_every is not None and self.mode != MODE_SENTINEL:
            raise ValueError("full_every samples full passes in mode=\"sentinel\": full mode hooks "
                             "every pass already; drop full_every, or add mode=\"sentinel\"")
        set_field(self, "allow_inf", _parse_allow_inf(self.allow_inf))
        if self.mode not in MODES:
            raise ValueError(f'mode must be "full" or "sentinel", got {self.mode!r}')
        limit_dtype = _parse_limit_dtype(self.limit_dtype)
        set_field(self, "limit_dtype", limit_dtype)
        if self.stop_at_limit and limit_dtype is None:
            raise ValueError("stop_at_limit needs limit_dtype, the narrower format whose overflow it "
                             "stops at: add limit_dtype=torch.float16 (or bfloat16, float8_e4m3fn), "
                             "or drop stop_at_limit")
        if limit_dtype is not None and self.mode == MODE_SENTINEL and self.full_every is None:
            raise ValueError("limit_dtype is measured by the full hooks, which mode=\"sentinel\" runs "
                             "only in the batches full_every samples: add full_every=N (every Nth "
                             "batch), or drop mode=\"sentinel\"")
        if limit_dtype is not None:
            info = torch.finfo(limit_dtype)
            set_field(self, "limit_max", float(info.max))
            set_field(self, "limit_tiny", float(info.smallest_normal) * float(info.eps))
        set_field(self, "stop_rules", self if limit_dtype is None or self.stop_at_limit
                  else dataclasses.replace(self, limit_dtype=None))
        for name in ("on_trace", "on_detect"):
            callback = getattr(self, name)
            if callback is not None and not callable(callback):
                raise TypeError(f"{name} must be a function taking a Report, got {callback!r}")
        _check_scaler(self.scaler, self.max_skipped_steps)

    def inf_allowed(self, module_name: str) -> bool:
        """Whether `module_name` may produce +-inf (allow_inf True, or a glob matching it)."""
        allow_inf = self.allow_inf
        if allow_inf is True or allow_inf is False:
            return allow_inf
        return any(fnmatch.fnmatchcase(module_name, glob) for glob in allow_inf)

    @classmethod
    def from_keywords(cls, keywords: dict) -> "GuardOptions":
        """Options from `Guard(...)`'s keywords; a misspelt one is a one-line TypeError."""
        unknown = sorted(set(keywords) - set(_option_names()))
        if unknown:
            raise TypeError(f"unknown option {unknown[0]!r}: the options are "
                            f"{', '.join(_option_names())}")
        return cls(**keywords)

    def replace(self, **changes) -> "GuardOptions":
        """A copy with `changes` applied, checked like the original."""
        return dataclasses.replace(self, **changes)

    def as_kwargs(self) -> dict:
        """The keyword arguments of `Guard` that build a guard with these options."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}


def _option_names() -> list:
    return [field.name for field in dataclasses.fields(GuardOptions) if field.init]


def keyword_signature(*leading: str) -> inspect.Signature:
    """`leading` positional parameters, then every option as a keyword with its default: the
    signature `Guard` shows (its `__init__` takes `**options`, checked here)."""
    positional = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in leading]
    return inspect.Signature(positional + [
        inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default)
        for field in dataclasses.fields(GuardOptions) if field.init])


def _check_max_frames(max_frames) -> None:
    if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
        raise ValueError(f"max_frames must be a positive integer, got {max_frames!r}")


def _parse_trace_batches(trace_batches) -> FrozenSet[int]:
    try:
        batches = list(trace_batches)
    except TypeError:
        batches = [None]
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in batches):
        raise ValueError(f"trace_batches must be batch numbers like [1, 3], got {trace_batches!r}")
    if any(b < 0 for b in batches):
        raise ValueError(f"trace_batches are 0-indexed batch numbers, got {sorted(set(batches))}")
    return frozenset(batches)


def _check_abort_after_batch(abort_after_batch) -> None:
    if abort_after_batch is not None and (
        isinstance(abort_after_batch, bool) or not isinstance(abort_after_batch, int)
        or abort_after_batch < 0
    ):
        raise ValueError(
            f"abort_after_batch must be None or a batch number >= 0, got {abort_after_batch!r}"
        )


def _check_every(name: str, every) -> None:
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"{name} must be None or a positive number of batches, got {every!r}")


def _check_scaler(scaler, max_skipped_steps) -> None:
    if scaler is not None and not is_loss_scaler(scaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler (or an object with get_scale(), is_enabled() "
            f"and update()), got {type(scaler).__name__}: pass the scaler whose scale(loss) the "
            "loop backpropagates"
        )
    if max_skipped_steps is not None and (isinstance(max_skipped_steps, bool) or not isinstance(
            max_skipped_steps, int) or max_skipped_steps < 0):
        raise ValueError(
            f"max_skipped_steps must be a number of steps >= 0, got {max_skipped_steps!r}"
        )


def _parse_allow_inf(allow_inf: Union[bool, str, Iterable[str]]) -> Union[bool, Tuple[str, ...]]:
    if allow_inf is True or allow_inf is False:
        return allow_inf
    if isinstance(allow_inf, str):
        return (allow_inf,)
    try:
        globs = tuple(allow_inf)
    except TypeError:
        raise ValueError(
            f"allow_inf must be True/False or module-name globs like ['*.attn*'], got {allow_inf!r}"
        ) from None
    if not all(isinstance(g, str) for g in globs):
        raise ValueError(f"allow_inf globs must be strings, got {allow_inf!r}")
    return globs


def _parse_limit_dtype(limit_dtype) -> Optional[torch.dtype]:
    if limit_dtype is None:
        return None
    if isinstance(limit_dtype, str):
        key = limit_dtype.replace("torch.", "").lower()
        dtype = LIMIT_DTYPES.get(key) or _WIDE_DTYPES.get(key)
        if dtype is None:
            raise ValueError(f"limit_dtype {limit_dtype!r} is not a float dtype numguard knows: use "
                             f"{_accepted_names()}")
        return _narrower_than_float32(dtype, limit_dtype)
    if isinstance(limit_dtype, torch.dtype) and limit_dtype.is_floating_point:
        try:
            torch.finfo(limit_dtype).max
        except (TypeError, RuntimeError):  # a packed format (pairs of float4): no range of its own
            raise ValueError(f"limit_dtype {limit_dtype} has no range of its own: use "
                             f"{_accepted_names()}") from None
        return _narrower_than_float32(limit_dtype, limit_dtype)
    raise ValueError(
        f"limit_dtype must be a floating torch dtype such as torch.float16, got {limit_dtype!r}"
    )


def _narrower_than_float32(dtype: torch.dtype, given) -> torch.dtype:
    """`dtype`, unless it is float32 or wider: a float32 run (or a narrower one) holds no finite
    value beyond such a range, so the limit would predict nothing."""
    if torch.finfo(dtype).bits >= 32:
        raise ValueError(f"limit_dtype is the narrower format a float32 run may move to, whose "
                         f"overflow and underflow the guard predicts: use {_accepted_names()}; "
                         f"got {given!r}")
    return dtype


def _accepted_names() -> str:
    """'float16 (fp16, half), bfloat16 (bf16), ...': each dtype limit_dtype takes, its aliases."""
    names: dict = {}
    for name, dtype in LIMIT_DTYPES.items():
        names.setdefault(dtype, []).append(name)
    return ", ".join(f"{first} ({', '.join(rest)})" if rest else first
                     for first, *rest in names.values())

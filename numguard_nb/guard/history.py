"""The numerics history: every module's range on sampled batches across a long run, kept in
bounded memory, so that a drift toward the dtype's limit shows before it turns into inf.

Contract: with `Guard(model, history_every=N)`, `History.see` keeps, for each batch whose number
is a multiple of N, the abs min and abs max of every module call's values in `KEPT_CATEGORIES`
(outputs, output and parameter gradients, weights, floating buffers), from the passes the guard
records anyway; `History.add_pass` keeps any finished, read-back `PassRecord`. `to_frame()` has
one row per value; `view()` gives a `HistoryView` with each worst module's `Trend` (`fit_trend`).

Limits: inputs, input gradients and non-floating tensors are left out; at most `max_samples`
samples, older ones thinned; `abs_max_change` misses an update that leaves the abs max as it was.

    >>> with Guard(model, history_every=10) as guard:
    ...     train()
    >>> guard.history.view(worst=3)     # the heatmap, and trends of the 3 nearest their limit

How it works: docs/history.md, "How it works".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .._schema import (
    BUFFER, CELL_INF, CELL_MISSING, CELL_NAN, CELL_VALUE, FORWARD, GRAD_INPUT, GRAD_OUTPUT,
    GRAD_PARAM, OUTPUT, PARAM,
)
from .._util import PicklesWithoutLock, dtype_name
from ..stats import UNMEASURED
from ..report import dtype_max
from .passes import SLOT_CATEGORY, SLOT_DTYPE, SLOT_INDEX, SLOT_ROLE, PassRecord

__all__ = [
    "History", "HistoryView", "Trend", "fit_trend", "KEPT_CATEGORIES", "MAX_SAMPLES",
    "TREND_SHARE", "MIN_TREND_SAMPLES", "STEADY_R2",
]

MAX_SAMPLES = 1000
TREND_SHARE = 0.5  # the recent share of a value's finite samples its trend is fitted over
MIN_TREND_SAMPLES = 5  # fewer points make no steady trend, however straight
STEADY_R2 = 0.8  # a fit explaining less of the variance is not steady: no projection then
NOTE_WINDOW = 10  # the last samples a detection's history note compares

# What a sample keeps of a call (see the module docstring for what it leaves out).
KEPT_CATEGORIES = frozenset((OUTPUT, GRAD_OUTPUT, GRAD_PARAM, PARAM, BUFFER))
_WEIGHTS = frozenset((PARAM, BUFFER))
# The text fields of a series, interned; to_frame's categorical columns.
TEXT_FIELDS = ("module_name", "module_class", "phase", "category", "role", "dtype")
_SKIPPED = -1  # the series id of a value the history does not keep (not floating point)
_MAX_LAYOUTS = 64  # distinct layouts remembered for sharing; past that, forgotten
# A detection's note: what the value it follows is, by the culprit's flagged category, and the
# categories tried for it in turn (input gradients are not kept: its gradients instead).
_NOTE_CATEGORIES = {
    OUTPUT: (OUTPUT,), PARAM: (PARAM,), BUFFER: (BUFFER,), GRAD_PARAM: (GRAD_PARAM,),
    GRAD_OUTPUT: (GRAD_OUTPUT,), GRAD_INPUT: (GRAD_PARAM, GRAD_OUTPUT),
}
_POSSESSIVE = {
    OUTPUT: "its output's", PARAM: "its weights'", BUFFER: "its buffers'",
    GRAD_PARAM: "its weight gradients'", GRAD_OUTPUT: "its output gradient's",
}


class _Sample:
    """One sampled batch: its number, its layout (series ids) and (abs min, abs max) per value."""

    __slots__ = ("batch_number", "ids", "values")

    def __init__(self, batch_number: int, ids: np.ndarray, values: np.ndarray):
        self.batch_number = batch_number
        self.ids = ids
        self.values = values


@dataclass(eq=False)
class Trend:
    """How one value (a module's value nearest its limit) moved over the history: the points,
    the fit of log10(abs max) against the batch number, and where it leads."""

    module_name: str
    module_class: str
    role: str  # the value followed: "output", "weight.grad", ...
    phase: str
    dtype: str  # the dtype whose largest value is the limit
    limit: float  # that largest value
    batches: np.ndarray  # the sampled batches holding the value
    abs_max: np.ndarray  # its abs max in each (nan, inf where it was)
    fitted: int = 0  # the recent finite samples fitted (no fit below MIN_TREND_SAMPLES)
    slope: Optional[float] = None  # log10(abs max) per batch
    intercept: Optional[float] = None  # log10(abs max) at batch 0, on the fitted line
    r2: Optional[float] = None
    steady: bool = False  # the fitted samples lie on the line: R² >= STEADY_R2
    limit_batch: Optional[float] = None  # where a steady growth reaches `limit`
    nonfinite_batch: Optional[int] = None  # first sample of a trailing run of nan/inf

    @property
    def doubling_batches(self) -> Optional[float]:
        """Batches in which the fitted abs max doubles (None unless it grows)."""
        if self.slope is None or not self.slope > 0:
            return None
        return math.log10(2.0) / self.slope

    def fitted_log10(self, batch: float) -> Optional[float]:
        if self.slope is None:
            return None
        return self.intercept + self.slope * batch


@dataclass(eq=False)
class HistoryView:
    """What the history's views draw (`render.history`): one row per module (in model order),
    one column per sample, the modules nearest their limit and their trends."""

    batches: np.ndarray  # sampled batch numbers, oldest first
    modules: List[Tuple[str, str]]  # (name, class) per row
    share: np.ndarray  # rows x samples: log10(abs max / dtype max) of the module's worst value
    cells: np.ndarray  # rows x samples: _schema CELL_* codes (share is nan where not CELL_VALUE)
    marked: List[int] = field(default_factory=list)  # rows nearest their limit, nearest first
    trends: List[Trend] = field(default_factory=list)  # of the marked rows, in that order
    every: Optional[int] = None  # the guard's history_every
    samples_taken: int = 0  # samples ever taken (thinning keeps fewer)
    limit_dtype: Optional[str] = None

    @property
    def thinned(self) -> bool:
        return self.samples_taken > len(self.batches)

    def _repr_html_(self) -> str:
        from ..render.history import history_html

        return history_html(self)

    def __repr__(self) -> str:
        from ..render.history import history_text

        return history_text(self)


def fit_trend(batches: np.ndarray, abs_max: np.ndarray, limit: float) -> dict:
    """The fit of log10(abs max) against the batch over the recent half of the finite, non-zero
    values before any trailing nan/inf (all of them, below twice MIN_TREND_SAMPLES): the fields
    of a `Trend` from `fitted` on."""
    finite = np.isfinite(abs_max)
    trailing = len(abs_max)
    while trailing and not finite[trailing - 1]:
        trailing -= 1
    result: dict = {"nonfinite_batch": int(batches[trailing]) if trailing < len(abs_max) else None}
    usable = np.flatnonzero(finite[:trailing] & (abs_max[:trailing] > 0))
    if len(usable) >= 2 * MIN_TREND_SAMPLES:
        usable = usable[-math.ceil(len(usable) * TREND_SHARE):]
    result["fitted"] = len(usable)
    if len(usable) < MIN_TREND_SAMPLES:
        return result
    x = batches[usable].astype(np.float64)
    y = np.log10(abs_max[usable].astype(np.float64))
    x_mean, y_mean = x.mean(), y.mean()
    spread = float(((x - x_mean) ** 2).sum())
    if spread == 0:
        return result
    slope = float(((x - x_mean) * (y - y_mean)).sum() / spread)
    intercept = float(y_mean - slope * x_mean)
    total = float(((y - y_mean) ** 2).sum())
    residual = float(((y - (intercept + slope * x)) ** 2).sum())
    r2 = 1.0 if total <= 1e-24 else 1.0 - residual / total
    steady = r2 >= STEADY_R2
    result.update(slope=slope, intercept=intercept, r2=r2, steady=steady)
    if steady and slope > 0 and math.isfinite(limit):
        result["limit_batch"] = (math.log10(limit) - intercept) / slope
    return result


class History(PicklesWithoutLock):
    """Every module call's ranges on sampled batches, in bounded memory (see the module
    docstring). `guard.history`; renders itself in a notebook (`view()`) and as text."""

    def __init__(self, max_samples: int = MAX_SAMPLES):
        if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 4:
            raise ValueError(f"max_samples must be an integer >= 4, got {max_samples!r}")
        self.max_samples = max_samples
        self.every: Optional[int] = None  # the guard's history_every when it last sampled
        self.limit_dtype: Optional[str] = None  # the guard's limit_dtype, by name
        self.samples: List[_Sample] = []  # oldest first
        self.samples_taken = 0  # samples ever started; thinning drops some, this only grows
        super().__init__()  # its lock: passes of several threads end at once
        # A series is one value of one call: (module name, class, call index, phase, category,
        # role, torch dtype) -> its id, or _SKIPPED.
        self._series: Dict[tuple, int] = {}
        self._series_keys: List[tuple] = []  # id -> key, the dtype by name
        self._series_text: List[tuple] = []  # id -> codes of its TEXT_FIELDS
        self._series_module: List[int] = []  # id -> its module's row (model order)
        self._wide: set = set()  # ids of float64 series
        self._texts: List[Dict[str, int]] = [{} for _ in TEXT_FIELDS]  # per field: value -> code
        self._modules: Dict[Tuple[str, str], int] = {}  # (name, class) -> row
        self._layouts: Dict[bytes, np.ndarray] = {}  # ids arrays, shared between samples

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def batches(self) -> List[int]:
        """The sampled batch numbers held, oldest first."""
        return [sample.batch_number for sample in self.samples]

    # ---- recording ------------------------------------------------------------------------
    @staticmethod
    def samples_batch(batch_number: int, options) -> bool:
        """Whether batch `batch_number` is sampled (`options.history_every`)."""
        every = options.history_every
        return every is not None and batch_number % every == 0

    def see(self, pass_: PassRecord, batch_number: int, options) -> None:
        """A pass of the guard has ended (and been read back): keep it if its batch is sampled
        (`options.history_every`)."""
        if not self.samples_batch(batch_number, options):
            return
        self.every = options.history_every
        self.add_pass(pass_, batch_number, options.limit_dtype)

    def add_pass(self, pass_: PassRecord, batch_number: Optional[int] = None,
                 limit_dtype=None) -> None:
        """Keep a finished pass whose statistics have been read back (`pass_.values`) as part
        of the sample of batch `batch_number` (default: its first call's batch). Passes of one
        batch (forward, backward, a loss module's) make one sample. `limit_dtype`: the guard's
        option, against whose largest value the views measure every value."""
        calls = pass_.calls
        if not calls:
            return
        if batch_number is None:
            batch_number = calls[0].batch_number
        with self._lock:
            self.limit_dtype = dtype_name(limit_dtype) if limit_dtype is not None else None
            modules = self._modules
            if any((call.module_name, call.module_class) not in modules for call in calls):
                for call in _model_order(calls):
                    modules.setdefault((call.module_name, call.module_class), len(modules))
            values, series_of = pass_.values, self._series
            ids, mins, maxs = [], [], []
            for call in calls:
                for slot in call.slots:
                    index = slot[SLOT_INDEX]
                    if index is None or slot[SLOT_CATEGORY] not in KEPT_CATEGORIES:
                        continue
                    row = values[index] if index < len(values) else None
                    if row is None:  # statistics that could not be read back
                        continue
                    key = (call.module_name, call.module_class, call.call_index, call.phase,
                           slot[SLOT_CATEGORY], slot[SLOT_ROLE], slot[SLOT_DTYPE])
                    series = series_of.get(key)
                    if series is None:
                        series = self._add_series(key)
                    if series != _SKIPPED:
                        ids.append(series)
                        mins.append(row[0])
                        maxs.append(row[1])
            if ids:
                self._store(batch_number, ids, mins, maxs)

    def _add_series(self, key: tuple) -> int:
        dtype = key[-1]
        if not dtype.is_floating_point:
            self._series[key] = _SKIPPED
            return _SKIPPED
        series = self._series[key] = len(self._series_keys)
        name, cls, call_index, phase, category, role = key[:-1]
        named = (name, cls, phase, category, role, dtype_name(dtype))
        self._series_keys.append((name, cls, call_index, phase, category, role, named[-1]))
        self._series_text.append(tuple(codes.setdefault(value, len(codes))
                                       for codes, value in zip(self._texts, named)))
        self._series_module.append(self._modules.setdefault((name, cls), len(self._modules)))
        if dtype == torch.float64:
            self._wide.add(series)
        return series

    def _store(self, batch_number: int, ids: list, mins: list, maxs: list) -> None:
        wide = bool(self._wide) and not self._wide.isdisjoint(ids)
        values = np.empty((len(ids), 2), np.float64)
        values[:, 0] = mins
        values[:, 1] = maxs
        # A nan makes both abs min and abs max nan, as in the value's report row (stats.decode).
        values[np.isnan(values).any(axis=1)] = np.nan
        values[values[:, 0] == UNMEASURED, 0] = np.nan  # abs min not measured
        ids_array = np.asarray(ids, np.int32)
        last = self.samples[-1] if self.samples else None
        if last is not None and last.batch_number == batch_number:
            # Another pass of the batch sampled last (its backward, a loss module's forward).
            self.samples.pop()
            ids_array = np.concatenate((last.ids, ids_array))
            values = np.concatenate((last.values.astype(np.float64), values))
            wide = wide or last.values.dtype == np.float64
        else:
            self._make_room()
            self.samples_taken += 1
        self.samples.append(_Sample(batch_number, self._shared_layout(ids_array),
                                    values if wide else values.astype(np.float32)))

    def _make_room(self) -> None:
        """When full, drop every other sample of the older half."""
        if len(self.samples) >= self.max_samples:
            half = len(self.samples) // 2
            self.samples[:half] = self.samples[:half:2]

    def _shared_layout(self, ids: np.ndarray) -> np.ndarray:
        """`ids`, or the equal array an earlier sample holds (one copy for a repeating layout)."""
        key = ids.tobytes()
        known = self._layouts.get(key)
        if known is not None:
            return known
        if len(self._layouts) >= _MAX_LAYOUTS:
            self._layouts.clear()
        self._layouts[key] = ids
        return ids

    # ---- reading --------------------------------------------------------------------------
    def _limits(self) -> np.ndarray:
        """Per series: the largest value of the dtype it is measured against (nan: none)."""
        if self.limit_dtype is not None:
            return np.full(len(self._series_keys), dtype_max(self.limit_dtype) or np.nan)
        by_dtype: Dict[str, float] = {}
        limits = [by_dtype.setdefault(key[-1], dtype_max(key[-1]) or np.nan)
                  for key in self._series_keys]
        return np.asarray(limits, np.float64)

    def _series_values(self, series: List[int]) -> Tuple[np.ndarray, np.ndarray]:
        """(sampled batches holding any of `series`, the largest abs max among them in each;
        nan where one of them is nan)."""
        wanted = np.asarray(series, np.int32)
        batches, values = [], []
        for sample in self.samples:
            hit = np.isin(sample.ids, wanted)
            if hit.any():
                batches.append(sample.batch_number)
                values.append(np.max(sample.values[hit, 1].astype(np.float64)))  # nan wins
        return np.asarray(batches, np.int64), np.asarray(values, np.float64)

    def scalars(self) -> Dict[str, float]:
        """A few figures of the latest sample, for a trainer's logger (empty without one):
        `numguard/batch`, `numguard/max_log10_share` (log10(abs max / dtype max) of the finite
        value nearest its limit), `numguard/worst_abs_max` (its abs max) and
        `numguard/nonfinite_values` (values holding nan or inf)."""
        if not self.samples:
            return {}
        sample = self.samples[-1]
        abs_max = sample.values[:, 1].astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.log10(abs_max / self._limits()[sample.ids])
        figures = {"numguard/batch": float(sample.batch_number),
                   "numguard/nonfinite_values": float((~np.isfinite(abs_max)).sum())}
        finite = np.flatnonzero(np.isfinite(share))
        if len(finite):
            worst = finite[np.argmax(share[finite])]
            figures["numguard/max_log10_share"] = float(share[worst])
            figures["numguard/worst_abs_max"] = float(abs_max[worst])
        return figures

    def columns(self) -> dict:
        """The history as columns, one entry per value of each sample: `batch_number`, the
        TEXT_FIELDS as (codes, categories), `call_index`, `abs_min`, `abs_max` and
        `abs_max_change` (weights: the change of abs max since the previous sample)."""
        samples = list(self.samples)
        count = len(self._series_keys)
        text = np.asarray(self._series_text, np.int32).reshape(count, len(TEXT_FIELDS))
        calls = np.asarray([key[2] for key in self._series_keys], np.int64)
        ids = (np.concatenate([s.ids for s in samples]) if samples else np.zeros(0, np.int32))
        values = (np.concatenate([s.values.astype(np.float64) for s in samples]) if samples
                  else np.zeros((0, 2)))
        columns: dict = {"batch_number": np.repeat(
            np.asarray([s.batch_number for s in samples], np.int64), [len(s.ids) for s in samples])}
        for position, name in enumerate(TEXT_FIELDS):
            columns[name] = (text[ids, position], list(self._texts[position]))
        columns["call_index"] = calls[ids]
        columns["abs_min"] = values[:, 0]
        columns["abs_max"] = values[:, 1]
        columns["abs_max_change"] = self._weight_changes(samples)
        return columns

    def _weight_changes(self, samples: List[_Sample]) -> np.ndarray:
        weight = np.asarray([key[4] in _WEIGHTS for key in self._series_keys], bool)
        previous = np.full(len(weight), np.nan)
        changes = []
        for sample in samples:
            is_weight = weight[sample.ids]
            here = sample.ids[is_weight]
            abs_max = sample.values[is_weight, 1].astype(np.float64)
            change = np.full(len(sample.ids), np.nan)
            with np.errstate(invalid="ignore"):  # inf - inf: nan, as it should read
                change[is_weight] = abs_max - previous[here]
            previous[here] = abs_max
            changes.append(change)
        return np.concatenate(changes) if changes else np.zeros(0)

    def to_frame(self):
        """A long pandas DataFrame: one row per kept value of each sampled batch."""
        from ..render.history import history_frame

        return history_frame(self.columns())

    # ---- the view -------------------------------------------------------------------------
    def view(self, worst: int = 3) -> HistoryView:
        """The heatmap's numbers (module x sample), the `worst` modules nearest their limit and
        their trends."""
        samples = list(self.samples)
        view = HistoryView(batches=np.asarray([s.batch_number for s in samples], np.int64),
                           modules=[], share=np.zeros((0, len(samples))),
                           cells=np.zeros((0, len(samples)), np.int8), every=self.every,
                           samples_taken=self.samples_taken, limit_dtype=self.limit_dtype)
        if not samples:
            return view
        limits = self._limits()
        module_of = np.asarray(self._series_module, np.intp)
        rows = len(self._modules)
        share = np.full((rows, len(samples)), -np.inf)
        seen = np.zeros((rows, len(samples)), bool)
        per_layout: dict = {}  # id of an ids array -> (its rows, its limits)
        with np.errstate(divide="ignore", invalid="ignore"):
            for column, sample in enumerate(samples):
                layout = per_layout.get(id(sample.ids))
                if layout is None:
                    layout = per_layout[id(sample.ids)] = (module_of[sample.ids], limits[sample.ids])
                where, limit = layout
                log_share = np.log10(sample.values[:, 1] / limit)
                np.maximum.at(share[:, column], where, log_share)  # a nan in it stays
                seen[where, column] = True
        cells = np.full(share.shape, CELL_VALUE, np.int8)
        cells[np.isnan(share)] = CELL_NAN
        cells[np.isposinf(share)] = CELL_INF
        cells[~seen] = CELL_MISSING
        share[cells != CELL_VALUE] = np.nan
        kept = np.flatnonzero(seen.any(axis=1))  # modules with nothing kept are left out
        names = sorted(self._modules, key=self._modules.get)
        view.modules = [names[row] for row in kept]
        view.share, view.cells = share[kept], cells[kept]
        view.marked = _nearest_their_limit(view.share, view.cells, worst)
        view.trends = [self._trend(view.modules[row], samples, view.cells[row], limits)
                       for row in view.marked]
        return view

    def _trend(self, module: Tuple[str, str], samples, cells: np.ndarray,
               limits: np.ndarray) -> Trend:
        """The trend of the module's value nearest its limit in its latest sample."""
        latest = samples[int(np.flatnonzero(cells != CELL_MISSING)[-1])]
        row = self._modules[module]
        mine = [i for i, series in enumerate(latest.ids) if self._series_module[series] == row]
        with np.errstate(divide="ignore", invalid="ignore"):
            share = latest.values[mine, 1].astype(np.float64) / limits[latest.ids[mine]]
        share = np.where(np.isnan(share), np.inf, share)  # a nan value is the worst
        series = int(latest.ids[mine[int(np.argmax(share))]])
        key = self._series_keys[series]
        dtype = self.limit_dtype or key[-1]
        limit = float(limits[series])
        batches, abs_max = self._series_values([series])
        return Trend(module_name=key[0], module_class=key[1], role=key[5], phase=key[3],
                     dtype=dtype, limit=limit, batches=batches, abs_max=abs_max,
                     **fit_trend(batches, abs_max, limit))

    def _repr_html_(self) -> str:
        return self.view()._repr_html_()

    def __repr__(self) -> str:
        return repr(self.view())

    # ---- a detection's note ---------------------------------------------------------------
    def note(self, call, bad_slots=()) -> str:
        """One sentence on the recent history of the culprit `call`'s flagged value (by the
        categories of `bad_slots`): how its abs max moved over the last samples. '' where the
        history holds nothing of it."""
        if not self.samples:
            return ""
        flagged = [slot[SLOT_CATEGORY] for slot in bad_slots] or [
            OUTPUT if call.phase == FORWARD else GRAD_OUTPUT]
        wanted = [c for category in flagged for c in _NOTE_CATEGORIES.get(category, ())]
        for category in dict.fromkeys(wanted):
            series = [i for i, key in enumerate(self._series_keys)
                      if key[0] == call.module_name and key[1] == call.module_class
                      and key[4] == category]
            if series:
                return self._note_on(category, *self._series_values(series))
        return ""

    def _note_on(self, category: str, batches: np.ndarray, abs_max: np.ndarray) -> str:
        whose = _POSSESSIVE[category]
        finite = np.flatnonzero(np.isfinite(abs_max))[-NOTE_WINDOW:]
        if len(finite) < 2:
            held = "one finite sample" if len(finite) else "no finite sample"
            return f"the history holds {held} of {whose} abs max: too few to see a trend"
        first, last = finite[0], finite[-1]
        start, end = float(abs_max[first]), float(abs_max[last])
        span = int(batches[last] - batches[first])
        if start > 0 and end >= 1.1 * start:
            moved = f"grew {end / start:.3g}x"
        elif start > 0 and end <= start / 1.1:
            moved = f"shrank {start / end:.3g}x" if end > 0 else "fell to 0"
        elif start == 0 and end > 0:
            moved = "grew from 0"
        else:
            moved = "stayed level"
        return (f"{whose} abs max {moved} over the last {span:,} batches "
                f"({start:.3g} at batch {int(batches[first]):,}, {end:.3g} at batch "
                f"{int(batches[last]):,})")


def _model_order(calls) -> list:
    """The calls of a pass in the order of the model: each call before the calls it made, in
    the order they were made (forward); calls without a parent in the pass by arrival."""
    present = {id(call) for call in calls}
    children: Dict[int, list] = {}
    roots = []
    for call in sorted(calls, key=_seq):
        parent = call.parent
        if parent is None or id(parent) not in present:
            roots.append(call)
        else:
            children.setdefault(id(parent), []).append(call)
    order, stack = [], roots[::-1]
    while stack:
        call = stack.pop()
        order.append(call)
        stack.extend(children.get(id(call), ())[::-1])
    return order


def _seq(call) -> int:
    return call.seq


def _nearest_their_limit(share: np.ndarray, cells: np.ndarray, count: int) -> List[int]:
    """The `count` rows nearest their limit in their latest sample (nan or inf first)."""
    if not len(share) or count <= 0:
        return []
    present = cells != CELL_MISSING
    latest = share.shape[1] - 1 - np.argmax(present[:, ::-1], axis=1)
    rows = np.arange(len(share))
    latest_cells = cells[rows, latest]
    score = np.where(latest_cells == CELL_VALUE, share[rows, latest], np.inf)
    order = sorted(rows, key=lambda row: (-score[row], row))
    return [int(row) for row in order[:count] if score[row] > -np.inf]  # all zeros: never


"""The numerics history's views: a heatmap of every module's nearness to its dtype's limit
across the sampled batches (inline SVG in HTML, characters in text), the trends of the modules
nearest it, and the history as a long DataFrame.

Reads a `guard.history.HistoryView` (and `History.columns()` for the table) without importing
the engine: the numbers, the marked modules and the fitted trends come computed; here they are
only laid out. The colour of a cell is log10(abs max / largest value of the dtype) of the
module's value nearest its limit, on a scale fitted to the finite values shown; nan and inf get
colours of their own, off the scale, and a module not recorded in a sample is left blank.
Above `MAX_COLUMNS` samples, neighbouring samples share a column, which shows the nearest value
among them (nan before inf before any finite value).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import numpy as np

from .._schema import CELL_INF, CELL_MISSING, CELL_NAN, CELL_VALUE
from ._format import esc

__all__ = [
    "history_frame", "history_text", "history_svg", "history_html", "trend_sentence",
    "trend_svg", "FRAME_COLUMNS", "MAX_COLUMNS", "TEXT_COLUMNS", "TEXT_ROWS",
]

FRAME_COLUMNS = [
    "batch_number", "module_name", "module_class", "call_index", "phase", "category", "role",
    "dtype", "abs_min", "abs_max", "abs_max_change",
]
MAX_COLUMNS = 280  # heatmap columns at most (samples are grouped beyond)
TEXT_COLUMNS = 60
TEXT_ROWS = 40  # modules in the text view at most (the nearest their limit, in model order)

# Light yellow (far from the limit) to dark red (at it): YlOrRd, interpolated to LEVELS steps.
_ANCHORS = ("#ffffcc", "#ffeda0", "#fed976", "#feb24c", "#fd8d3c", "#fc4e2a", "#e31a1c",
            "#bd0026", "#800026")
LEVELS = 24
NAN_COLOUR = "#6a3d9a"  # purple: off the scale, and unlike any step of it
INF_COLOUR = "#000000"
MISSING_COLOUR = "#eeeeee"
_SHADES = " .:-=+*#%@"  # the text view's scale, far to near
_NAN_CHAR, _INF_CHAR = "N", "I"

# Heatmap geometry (px).
_LABEL_WIDTH = 210
_MAP_WIDTH = 560
_TOP = 6
_AXIS = 34  # below the map: batch ticks and their caption
_LEGEND = 30
_MAX_MAP_HEIGHT = 640
_LABELLED_ROW = 10  # rows at least this tall get their module's name


def _palette() -> List[str]:
    anchors = [tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in _ANCHORS]
    colours = []
    for level in range(LEVELS):
        position = level / (LEVELS - 1) * (len(anchors) - 1)
        low = min(int(position), len(anchors) - 2)
        t = position - low
        rgb = (round(a + (b - a) * t) for a, b in zip(anchors[low], anchors[low + 1]))
        colours.append("#" + "".join(f"{v:02x}" for v in rgb))
    return colours


PALETTE = _palette()


# ---- the table -------------------------------------------------------------------------------
def history_frame(columns: dict):
    """The DataFrame of `History.columns()`: text fields as categoricals, in FRAME_COLUMNS
    order."""
    import pandas as pd

    data = {}
    for name in FRAME_COLUMNS:
        column = columns[name]
        if isinstance(column, tuple):
            codes, categories = column
            data[name] = pd.Categorical.from_codes(codes, categories=categories)
        else:
            data[name] = column
    return pd.DataFrame(data, columns=FRAME_COLUMNS)


# ---- shared layout ---------------------------------------------------------------------------
def _grouped(view, max_columns: int) -> Tuple[np.ndarray, np.ndarray, List[int]]:
    """(share, cells, first sample of each column) with at most `max_columns` columns: each
    column shows the nearest value among its samples (nan, then inf, then the largest)."""
    samples = view.share.shape[1]
    width = max(1, math.ceil(samples / max_columns))
    if width == 1:
        return view.share, view.cells, list(range(samples))
    columns = math.ceil(samples / width)
    padding = columns * width - samples
    rows = view.share.shape[0]
    share = np.concatenate((view.share, np.full((rows, padding), np.nan)), axis=1)
    cells = np.concatenate((view.cells, np.full((rows, padding), CELL_MISSING, np.int8)), axis=1)
    share = share.reshape(rows, columns, width)
    cells = cells.reshape(rows, columns, width)
    # Rank the states so the max picks nan over inf over a value over nothing recorded.
    rank = np.choose(cells, _STATE_RANK)
    best = rank.max(axis=2)
    grouped_cells = np.asarray(_RANK_STATE)[best].astype(np.int8)
    grouped_share = np.fmax.reduce(np.where(cells == CELL_VALUE, share, np.nan), axis=2)
    grouped_share[grouped_cells != CELL_VALUE] = np.nan
    return grouped_share, grouped_cells, list(range(0, samples, width))


# CELL_* code -> rank, and rank -> code (CELL_VALUE, MISSING, NAN, INF are 0..3).
_STATE_RANK = [1, 0, 3, 2]
_RANK_STATE = [CELL_MISSING, CELL_VALUE, CELL_INF, CELL_NAN]


def _scale(share: np.ndarray) -> Tuple[int, int]:
    """The colour scale's ends (whole decades) over the finite, non-zero shares shown."""
    finite = share[np.isfinite(share)]
    if not len(finite):
        return -1, 0
    low, high = math.floor(float(finite.min())), math.ceil(float(finite.max()))
    return (low, high) if high > low else (high - 1, high)


def _levels(share: np.ndarray, cells: np.ndarray, low: int, high: int) -> np.ndarray:
    """Per cell: a palette step 0..LEVELS-1, or -1 (not recorded), LEVELS (nan), LEVELS+1 (inf).
    A value of zero (log share -inf) is the lowest step."""
    with np.errstate(invalid="ignore"):
        position = (share - low) / (high - low) * (LEVELS - 1)
    steps = np.clip(np.nan_to_num(position, nan=0.0, neginf=0.0, posinf=LEVELS - 1), 0, LEVELS - 1)
    levels = np.rint(steps).astype(np.int32)
    levels[cells == CELL_MISSING] = -1
    levels[cells == CELL_NAN] = LEVELS
    levels[cells == CELL_INF] = LEVELS + 1
    return levels


def _label(module: Tuple[str, str]) -> str:
    name, cls = module
    return f"{name} ({cls})" if name else cls


def _latest(view, row: int) -> Tuple[int, int, float]:
    """(sample, cell, log share) of the row's latest recorded sample."""
    present = np.flatnonzero(view.cells[row] != CELL_MISSING)
    sample = int(present[-1])
    return sample, int(view.cells[row, sample]), float(view.share[row, sample])


def _latest_words(view, row: int) -> str:
    sample, cell, share = _latest(view, row)
    batch = f"batch {int(view.batches[sample]):,}"
    if cell == CELL_NAN:
        return f"nan at {batch}"
    if cell == CELL_INF:
        return f"inf at {batch}"
    if share == -math.inf:
        return f"all zeros at {batch}"
    return f"log10 share {share:.2f} at {batch}"


def _headline(view) -> str:
    if not len(view.batches):
        every = f"every {view.every} batches" if view.every else "Guard(model, history_every=N)"
        return f"numguard history: no sampled batch yet ({every} samples a batch)"
    first, last = int(view.batches[0]), int(view.batches[-1])
    every = f"every {view.every}; " if view.every else ""
    thinned = ", older ones thinned" if view.thinned else ""
    modules = f"{len(view.modules)} module{'s' if len(view.modules) != 1 else ''}"
    return (f"numguard history: {len(view.batches)} sampled batches ({every}batches {first:,} to "
            f"{last:,}{thinned}), {modules}")


_SCALE_WORDS = ("log10(abs max / largest value of the dtype) of each module's value nearest its "
                "limit")


# ---- trends ----------------------------------------------------------------------------------
def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) < 1e9 else f"{value:.3g}"


def _batches(count: float) -> str:
    """A doubling time: "0.4 batches", "1 batch", "12 batches"."""
    if count < 9.95:
        words = f"{count:.1f}".removesuffix(".0")
        return f"{words} batch" if words == "1" else f"{words} batches"
    return f"{_number(count)} batches"


def trend_sentence(trend) -> str:
    """What a trend says: where the value is, and where it is going."""
    finite = np.flatnonzero(np.isfinite(trend.abs_max))
    what = f"{_label((trend.module_name, trend.module_class))} {trend.role}, {trend.phase}"
    parts = []
    if len(finite):
        last = int(finite[-1])
        value = float(trend.abs_max[last])
        share = (f" (10^{math.log10(value / trend.limit):.2f} of {trend.dtype}'s largest value)"
                 if value > 0 else "")
        parts.append(f"abs max {value:.3g} at batch {int(trend.batches[last]):,}{share}")
    if trend.nonfinite_batch is not None:
        run = trend.abs_max[trend.batches >= trend.nonfinite_batch]
        word = "nan" if np.isnan(run).all() else "inf" if np.isinf(run).all() else "nan or inf"
        parts.append(f"{word} since batch {trend.nonfinite_batch:,}")
    parts.append(_fit_words(trend))
    return f"{what}: " + "; ".join(parts)


def _fit_words(trend) -> str:
    if trend.slope is None:
        return f"too few finite samples for a trend ({trend.fitted})"
    fit = f"over the last {trend.fitted} samples, R² {trend.r2:.2f}"
    if not trend.steady:
        return f"not steady ({fit}): no projection"
    doubling = trend.doubling_batches
    if doubling is None or trend.limit_batch is None:
        per = 10 ** (trend.slope * 1000)
        return f"steady ({fit}), not growing (x{per:.3g} per 1,000 batches)"
    every, limit, batch = _batches(doubling), f"{trend.limit:.5g}", _number(trend.limit_batch)
    if trend.nonfinite_batch is not None:
        return (f"before that it doubled every {every} (steady {fit}), on course to "
                f"reach {limit} near batch {batch}")
    last = int(trend.batches[np.flatnonzero(np.isfinite(trend.abs_max))[-1]])
    where = (f"would reach {limit} near batch {batch}" if trend.limit_batch > last
             else f"beyond {limit} since about batch {batch}")
    return f"doubles every {every} (steady {fit}): {where}"


def trend_svg(trend, width: int = 320, height: int = 80) -> str:
    """A small chart of a trend: log10(abs max) by batch, the fitted line (dashed) carried on to
    the limit where the growth is steady, the limit as a red line where it is in view, nan/inf
    as marks on the top edge."""
    finite = np.isfinite(trend.abs_max) & (trend.abs_max > 0)
    batches = trend.batches.astype(np.float64)
    y = np.log10(np.where(finite, trend.abs_max, 1.0))
    x_low, x_high = float(batches.min()), float(batches.max())
    log_limit = math.log10(trend.limit) if math.isfinite(trend.limit) else None
    projected = trend.limit_batch is not None and trend.limit_batch > x_high
    if projected:
        x_high = max(x_high, min(trend.limit_batch, x_high + 4 * max(x_high - x_low, 1.0)))
    values = list(y[finite])
    if log_limit is not None and (projected or (values and log_limit - max(values) < 2)):
        values.append(log_limit)
    y_low, y_high = (min(values), max(values)) if values else (0.0, 1.0)
    if y_high - y_low < 1e-9:
        y_low, y_high = y_low - 0.5, y_high + 0.5
    left, right, top, bottom = 40, 6, 10, 16

    def px(batch: float) -> float:
        return left + (batch - x_low) / max(x_high - x_low, 1e-9) * (width - left - right)

    def py(value: float) -> float:
        return top + (y_high - value) / (y_high - y_low) * (height - top - bottom)

    parts = [f'<svg class="ng-history-trend" xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{height}" viewBox="0 0 {width} {height}" role="img">',
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fafafa" stroke="#ddd"/>',
             f'<text x="{left - 3}" y="{top + 4}" text-anchor="end" font-size="9" fill="#555" '
             f'font-family="sans-serif">{10 ** y_high:.2g}</text>',
             f'<text x="{left - 3}" y="{height - bottom}" text-anchor="end" font-size="9" '
             f'fill="#555" font-family="sans-serif">{10 ** y_low:.2g}</text>',
             f'<text x="{left}" y="{height - 4}" font-size="9" fill="#555" '
             f'font-family="sans-serif">{_number(x_low)}</text>',
             f'<text x="{width - right}" y="{height - 4}" text-anchor="end" font-size="9" '
             f'fill="#555" font-family="sans-serif">batch {_number(x_high)}</text>']
    if log_limit is not None and y_low <= log_limit <= y_high:
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{py(log_limit):.1f}" '
                     f'y2="{py(log_limit):.1f}" stroke="#e31a1c" stroke-width="1">'
                     f'<title>{esc(f"{trend.dtype} largest value {trend.limit:.5g}")}</title></line>')
    if trend.slope is not None and trend.steady:
        fitted = batches[finite][-trend.fitted:]
        start = float(fitted[0]) if len(fitted) else x_low
        end = min(trend.limit_batch, x_high) if projected else x_high
        parts.append(f'<line x1="{px(start):.1f}" x2="{px(end):.1f}" '
                     f'y1="{py(trend.fitted_log10(start)):.1f}" y2="{py(trend.fitted_log10(end)):.1f}" '
                     'stroke="#555" stroke-width="1" stroke-dasharray="4 3"/>')
    points = " ".join(f"{px(b):.1f},{py(v):.1f}" for b, v in zip(batches[finite], y[finite]))
    if points:
        parts.append(f'<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>')
    for batch, value in zip(batches[~np.isfinite(trend.abs_max)], trend.abs_max[~np.isfinite(trend.abs_max)]):
        colour = NAN_COLOUR if np.isnan(value) else INF_COLOUR
        word = "nan" if np.isnan(value) else "inf"
        parts.append(f'<rect x="{px(batch) - 2:.1f}" y="1" width="4" height="6" fill="{colour}">'
                     f'<title>{word} at batch {int(batch):,}</title></rect>')
    parts.append("</svg>")
    return "".join(parts)


# ---- the heatmap -----------------------------------------------------------------------------
def _row_height(rows: int) -> int:
    return max(2, min(14, _MAX_MAP_HEIGHT // max(rows, 1)))


def history_svg(view) -> str:
    """The heatmap: a row per module (model order), a column per sample (or group of samples),
    the marked modules (nearest their limit) numbered on the left, batch ticks and the scale
    below."""
    share, cells, starts = _grouped(view, MAX_COLUMNS)
    rows, columns = share.shape
    row_height = _row_height(rows)
    cell_width = _MAP_WIDTH / max(columns, 1)
    map_height = rows * row_height
    width = _LABEL_WIDTH + _MAP_WIDTH + 20
    height = _TOP + map_height + _AXIS + _LEGEND
    low, high = _scale(share)
    levels = _levels(share, cells, low, high)
    colours = PALETTE + [NAN_COLOUR, INF_COLOUR]
    marked = {row: rank for rank, row in enumerate(view.marked, 1)}
    x0 = _LABEL_WIDTH
    parts = [f'<svg class="ng-history-map" xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
             'font-family="sans-serif" font-size="10">',
             f'<rect x="{x0}" y="{_TOP}" width="{_MAP_WIDTH}" height="{map_height}" '
             f'fill="{MISSING_COLOUR}"/>']
    for row in range(rows):
        y = _TOP + row * row_height
        parts.extend(_row_cells(levels[row], colours, x0, y, cell_width, row_height))
        label = _label(view.modules[row])
        tip = f"{label}: {_latest_words(view, row)}"
        parts.append(f'<rect x="{x0}" y="{y}" width="{_MAP_WIDTH}" height="{row_height}" '
                     f'fill="none" pointer-events="all"><title>{esc(tip)}</title></rect>')
        rank = marked.get(row)
        if row_height >= _LABELLED_ROW or rank is not None:
            parts.append(_row_label(label, rank, y, row_height))
    parts.extend(_axis(view, starts, cell_width, map_height))
    parts.extend(_legend(low, high, _TOP + map_height + _AXIS))
    parts.append("</svg>")
    return "".join(parts)


def _row_cells(levels: np.ndarray, colours: List[str], x0: float, y: float, cell_width: float,
               row_height: int) -> List[str]:
    """One rect per run of cells of one colour (nothing where nothing was recorded)."""
    if not len(levels):
        return []
    starts = np.concatenate(([0], np.flatnonzero(np.diff(levels)) + 1))
    ends = np.append(starts[1:], len(levels))
    rects = []
    for start, end in zip(starts.tolist(), ends.tolist()):
        level = int(levels[start])
        if level < 0:
            continue
        rects.append(f'<rect x="{x0 + start * cell_width:.2f}" y="{y}" '
                     f'width="{(end - start) * cell_width:.2f}" height="{row_height}" '
                     f'fill="{colours[level]}"/>')
    return rects


def _row_label(label: str, rank: Optional[int], y: float, row_height: int) -> str:
    """The module's name right-aligned before its row (cut from the left when long); a marked
    module's in bold red, with its rank in a red disc after the row."""
    text = label if len(label) <= 34 else "…" + label[-33:]
    middle = y + row_height / 2
    if rank is None:
        return (f'<text x="{_LABEL_WIDTH - 4}" y="{middle + 3.5:.1f}" text-anchor="end" '
                f'fill="#333">{esc(text)}</text>')
    disc = _LABEL_WIDTH + _MAP_WIDTH + 10
    return (f'<text x="{_LABEL_WIDTH - 4}" y="{middle + 3.5:.1f}" text-anchor="end" '
            f'font-weight="bold" fill="#bd0026">{esc(text)}</text>'
            f'<circle cx="{disc}" cy="{middle:.1f}" r="6" fill="#bd0026"/>'
            f'<text x="{disc}" y="{middle + 3.5:.1f}" text-anchor="middle" fill="#fff" '
            f'font-size="9">{rank}</text>')


def _axis(view, starts: List[int], cell_width: float, map_height: int) -> List[str]:
    y = _TOP + map_height
    parts = [f'<line x1="{_LABEL_WIDTH}" x2="{_LABEL_WIDTH + _MAP_WIDTH}" y1="{y}" y2="{y}" '
             'stroke="#999"/>']
    if not starts:
        return parts
    ticks = sorted(set(np.linspace(0, len(starts) - 1, min(6, len(starts))).round().astype(int)))
    for column in ticks:
        x = _LABEL_WIDTH + (column + 0.5) * cell_width
        anchor = "start" if column == 0 and len(ticks) > 1 else "end" if column == ticks[-1] and \
            len(ticks) > 1 else "middle"
        batch = int(view.batches[starts[column]])
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + 4}" stroke="#999"/>')
        parts.append(f'<text x="{x:.1f}" y="{y + 14}" text-anchor="{anchor}" fill="#555">'
                     f'{batch:,}</text>')
    caption = "sampled batch" + (" (older samples thinned)" if view.thinned else "")
    parts.append(f'<text x="{_LABEL_WIDTH + _MAP_WIDTH / 2:.1f}" y="{y + 27}" text-anchor="middle" '
                 f'fill="#555">{caption}</text>')
    return parts


def _legend(low: int, high: int, y: int) -> List[str]:
    x = _LABEL_WIDTH
    step = 6
    parts = [f'<text x="{x - 4}" y="{y + 10}" text-anchor="end" fill="#555">'
             f'log10(abs max / dtype max)</text>']
    for level, colour in enumerate(PALETTE):
        parts.append(f'<rect x="{x + level * step}" y="{y + 2}" width="{step}" height="10" '
                     f'fill="{colour}"/>')
    end = x + LEVELS * step
    parts.append(f'<text x="{x}" y="{y + 23}" fill="#555">{low}</text>')
    parts.append(f'<text x="{end}" y="{y + 23}" text-anchor="end" fill="#555">{high}</text>')
    for offset, colour, word in ((16, NAN_COLOUR, "nan"), (62, INF_COLOUR, "inf"),
                                 (108, MISSING_COLOUR, "not recorded")):
        parts.append(f'<rect x="{end + offset}" y="{y + 2}" width="10" height="10" fill="{colour}" '
                     'stroke="#bbb"/>')
        parts.append(f'<text x="{end + offset + 14}" y="{y + 11}" fill="#555">{word}</text>')
    return parts


# ---- HTML and text ---------------------------------------------------------------------------
def history_html(view) -> str:
    """The notebook view: the headline, the heatmap, and the trends of the marked modules."""
    parts = ['<div class="ng-history" style="font-family:sans-serif;font-size:12px">',
             f'<div class="ng-history-head" style="font-weight:bold">{esc(_headline(view))}</div>']
    if not len(view.batches):
        parts.append("</div>")
        return "".join(parts)
    parts.append(f'<div class="ng-history-scale" style="color:#555">{esc(_SCALE_WORDS)}; '
                 'the modules nearest their limit are numbered.</div>')
    parts.append(history_svg(view))
    if view.trends:
        parts.append('<ol class="ng-history-trends" style="padding-left:1.5em">')
        for trend in view.trends:
            parts.append(f'<li><div>{esc(trend_sentence(trend))}</div>{trend_svg(trend)}</li>')
        parts.append("</ol>")
    parts.append("</div>")
    return "".join(parts)


def history_text(view) -> str:
    """The terminal view: the headline, a line of shades per module (the nearest their limit,
    at most TEXT_ROWS, in model order), and the trends of the marked modules."""
    lines = [_headline(view)]
    if not len(view.batches):
        return lines[0]
    share, cells, starts = _grouped(view, TEXT_COLUMNS)
    low, high = _scale(share)
    group = f"one column per {starts[1] - starts[0]} samples; " if len(starts) > 1 and \
        starts[1] - starts[0] > 1 else ""
    lines.append(f"{_SCALE_WORDS}, oldest to newest ({group}'{_SHADES}' from {low} to {high}; "
                 f"{_NAN_CHAR} nan, {_INF_CHAR} inf, blank not recorded):")
    shown = _text_rows(view)
    labels = {row: _label(view.modules[row]) for row in shown}
    width = min(40, max(len(label) for label in labels.values()))
    marked = set(view.marked)
    levels = _levels(share, cells, low, high)
    for row in shown:
        label = labels[row] if len(labels[row]) <= width else "…" + labels[row][-(width - 1):]
        marker = ">" if row in marked else " "
        lines.append(f"{marker} {label:<{width}} |{_shade_line(levels[row])}| "
                     f"{_latest_words(view, row)}")
    if len(shown) < len(view.modules):
        lines.append(f"  ... {len(view.modules) - len(shown)} more modules (the HTML view and "
                     "to_frame() have them all)")
    if view.trends:
        lines.append("nearest their limit:")
        lines.extend(f"  {rank}. {trend_sentence(trend)}" for rank, trend in enumerate(view.trends, 1))
    return "\n".join(lines)


def _text_rows(view) -> List[int]:
    """The rows the text view shows: all, or the TEXT_ROWS nearest their limit (model order)."""
    rows = len(view.modules)
    if rows <= TEXT_ROWS:
        return list(range(rows))
    scores = []
    for row in range(rows):
        _, cell, share = _latest(view, row)
        scores.append(math.inf if cell in (CELL_NAN, CELL_INF) else share)
    nearest = sorted(range(rows), key=lambda row: (-scores[row], row))
    return sorted(set(view.marked) | set(nearest[:TEXT_ROWS - len(view.marked)]))


def _shade_line(levels: np.ndarray) -> str:
    shades = len(_SHADES) - 1
    chars = []
    for level in levels.tolist():
        if level < 0:
            chars.append(" ")
        elif level == LEVELS:
            chars.append(_NAN_CHAR)
        elif level == LEVELS + 1:
            chars.append(_INF_CHAR)
        else:
            chars.append(_SHADES[1 + round(level / (LEVELS - 1) * (shades - 1))])
    return "".join(chars)

"""Static HTML view of a `Report`: the module tree as nested `<details>`, no JavaScript.

This is what GitHub, nbviewer, exported HTML and frontends without the widget manager show,
and what `Report._repr_html_` returns. The widget (`render.widget`) is built from the same
`ModuleNode` tree and the same per-frame tables, so both views say the same thing.

Renderers only read the fields of `Report`, `Frame` and `TensorRow`; every statistic comes from
the engine. The tree is built from the frames' dotted `module_name` (parents are prefixes).

DOM (stable CSS classes, also used by the widget):

    div.ng-report[.ng-kind-<kind>]
      div.ng-header > div.ng-summary, div.ng-hint, div.ng-meta, svg.ng-chart, div.ng-legend
      div.ng-tree
        details.ng-node[.ng-root][.ng-culprit][.ng-culprit-node][open] data-path="..."
          summary.ng-toggle > span.ng-name, span.ng-class, span.ng-badge*, span.ng-info
          div.ng-body
            div.ng-frame.ng-<phase>[.ng-culprit-frame] data-frame="<index in report.frames>"
              div.ng-frame-head
              table.ng-tensors > tr.ng-row[.ng-flagged][.ng-nonfinite] > td.ng-<column>
            details.ng-node ...   (children)
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, Optional, Tuple

from .._schema import FORWARD, VALUE_TENSOR
from .._util import dtype_smallest_normal
from ._format import esc
from .text import note_lines

__all__ = [
    "ModuleNode", "build_tree", "report_html", "frames_html", "frame_html", "header_html", "hint_html",
    "tensor_table_html", "STYLE", "MAX_FRAMES_PER_NODE",
]

# A node shows at most this many of its own frames (a module called in a loop); the rest are
# one `report.to_frame()` away.
MAX_FRAMES_PER_NODE = 50


# Colours: the cell background for how close a value is to its dtype's limits. Inline styles
# travel where a <style> element is stripped (sanitised notebook outputs); classes stay for themes
# and tests.
_HEAT = {  # dark text on light backgrounds: readable in dark themes too
    "ng-bad": "background:#f4b4b4;color:#7a0000;font-weight:bold",
    "ng-h4": "background:#f6c1c1;color:#222",
    "ng-h3": "background:#f9d5ae;color:#222",
    "ng-h2": "background:#fce7ad;color:#222",
    "ng-h1": "background:#fdf4d6;color:#222",
    "ng-u2": "background:#bcd4f6;color:#222",
    "ng-u1": "background:#e0ebfb;color:#222",
}

STYLE = """<style>
.ng-report{font-family:var(--jp-ui-font-family,-apple-system,Segoe UI,Helvetica,Arial,sans-serif);font-size:13px;line-height:1.35}
.ng-report .ng-summary{font-weight:bold;margin:2px 0 4px 0}
.ng-report .ng-summary.ng-bad-summary{color:#a40000}
.ng-report .ng-meta,.ng-report .ng-legend,.ng-report .ng-info,.ng-report .ng-class,.ng-report .ng-frame-head{color:#666}
.ng-report .ng-legend span{padding:0 4px;margin-right:2px}
.ng-report details.ng-node{margin-left:14px}
.ng-report details.ng-root{margin-left:0}
.ng-report summary.ng-toggle{cursor:pointer;white-space:nowrap}
.ng-report .ng-culprit>summary .ng-name{color:#a40000;font-weight:bold}
.ng-report .ng-culprit-node>summary{background:#fde8e8;color:#222}
.ng-report .ng-badge{border-radius:3px;padding:0 4px;font-size:11px;margin-left:4px;background:#eee}
.ng-report .ng-badge-bad{background:#f4b4b4;color:#7a0000}
.ng-report .ng-frame{margin:2px 0 6px 16px}
.ng-report .ng-culprit-frame{border-left:3px solid #c00;padding-left:4px}
.ng-report table.ng-tensors{border-collapse:collapse;font-family:var(--jp-code-font-family,monospace);font-size:12px;margin:0}
.ng-report table.ng-tensors th,.ng-report table.ng-tensors td{padding:1px 8px;text-align:right;border-bottom:1px solid #eee}
.ng-report table.ng-tensors td.ng-role,.ng-report table.ng-tensors th.ng-role{text-align:left}
.ng-report tr.ng-flagged td{font-weight:bold;border-bottom:2px solid #c00}
</style>"""


# ---- the tree ------------------------------------------------------------------------------
class ModuleNode:
    """One module in the hierarchy, with its own frames and its children (by first appearance)."""

    __slots__ = (
        "path", "name", "module_class", "children", "frames", "on_path", "is_culprit",
        "nonfinite", "worst_share", "subtree_frames", "depth",
    )

    def __init__(self, path: str, name: str, depth: int):
        self.path = path
        self.name = name
        self.module_class: Optional[str] = None
        self.children: Dict[str, "ModuleNode"] = {}
        self.frames: list = []  # (index in report.frames, frame)
        self.on_path = False  # on the way from the root to the culprit (or the culprit)
        self.is_culprit = False
        self.nonfinite = False  # some frame in the subtree holds inf/nan
        self.worst_share: Optional[float] = None  # largest range_share in the subtree
        self.subtree_frames = 0
        self.depth = depth

    @property
    def label(self) -> str:
        return self.name or "model"  # (the root: its class is shown beside it)

    def walk(self) -> Iterable["ModuleNode"]:
        yield self
        for child in self.children.values():
            yield from child.walk()

    def __repr__(self) -> str:
        return f"<ModuleNode {self.path or '<root>'} frames={len(self.frames)} children={len(self.children)}>"


def _culprit_index(report) -> Optional[int]:
    culprit = report.first_nonfinite
    if culprit is None:
        return None
    for index, frame in enumerate(report.frames):
        if frame is culprit:
            return index
    # A report rebuilt from copies: match on what identifies a module call.
    key = (culprit.module_name, culprit.phase, culprit.call_index, culprit.batch_number)
    for index in range(len(report.frames) - 1, -1, -1):
        frame = report.frames[index]
        if (frame.module_name, frame.phase, frame.call_index, frame.batch_number) == key:
            return index
    return None


def _frame_marks(frame) -> Tuple[bool, Optional[float]]:
    """(holds a non-finite value, largest shown share) of one frame, from its rows' fields."""
    worst = None
    for row in frame.rows:
        share = shown_share(row)
        if share is not None and (worst is None or share > worst):
            worst = share
    return frame.nonfinite, worst


def build_tree(report) -> Tuple[ModuleNode, Optional[int]]:
    """The module hierarchy of the report's frames, and the index of the culprit frame (or None)."""
    root = ModuleNode("", "", 0)
    nodes: Dict[str, ModuleNode] = {"": root}
    culprit_at = _culprit_index(report)
    for index, frame in enumerate(report.frames):
        name = frame.module_name
        node = nodes.get(name)
        if node is None:
            parent = root
            path = ""
            for part in name.split("."):
                path = f"{path}.{part}" if path else part
                child = nodes.get(path)
                if child is None:
                    child = ModuleNode(path, part, parent.depth + 1)
                    parent.children[part] = child
                    nodes[path] = child
                parent = child
            node = parent
        if node.module_class is None:
            node.module_class = frame.module_class
        node.frames.append((index, frame))
        bad, worst = _frame_marks(frame)
        # Marks climb to every ancestor so a collapsed node still says what is inside it.
        path = name
        while True:
            target = nodes[path]
            target.subtree_frames += 1
            if bad:
                target.nonfinite = True
            if worst is not None and (target.worst_share is None or worst > target.worst_share):
                target.worst_share = worst
            if not path:
                break
            path = path.rpartition(".")[0]
    if culprit_at is not None:
        path = report.frames[culprit_at].module_name
        nodes[path].is_culprit = True
        while True:
            nodes[path].on_path = True
            if not path:
                break
            path = path.rpartition(".")[0]
    if root.module_class is None:
        root.module_class = report.model_class or None  # (its call never ended)
    return root, culprit_at


# ---- formatting ----------------------------------------------------------------------------
def fmt_value(value: Optional[float]) -> str:
    if value is None:
        return ""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.2e}"


def fmt_share(share: Optional[float]) -> str:
    if share is None:
        return ""
    if math.isinf(share):
        return "inf"
    if 0 < share < 1e-4:  # a share too small to matter reads as small, not as 3.51e-37%
        return "<0.01%"
    return f"{share * 100:.3g}%"


def fmt_shape(shape) -> str:
    if shape is None:
        return ""
    if len(shape) == 0:
        return "scalar"
    return "\u00d7".join(str(n) for n in shape)


def shown_share(row) -> Optional[float]:
    """Share of the largest finite value: of limit_dtype's when one is set, else of the own dtype's."""
    return row.limit_share if row.limit_share is not None else row.range_share


def share_class(row) -> str:
    """Heat class of the abs max cell: how close the value is to its dtype's largest value."""
    if row.nonfinite:
        return "ng-bad"
    if row.predicted_overflow:
        return "ng-h4"
    share = shown_share(row)
    if share is None:
        return ""
    if share >= 1:
        return "ng-h4"
    if share >= 0.1:
        return "ng-h3"
    if share >= 0.01:
        return "ng-h2"
    if share >= 0.001:
        return "ng-h1"
    return ""


def underflow_class(row) -> str:
    """Heat class of the abs min cell: flushes to zero (predicted), or subnormal in its dtype."""
    if row.predicted_underflow:
        return "ng-u2"
    tiny = dtype_smallest_normal(row.dtype)
    smallest = row.nonzero_abs_min if row.nonzero_abs_min is not None else row.abs_min
    if tiny is not None and smallest is not None and 0 < smallest < tiny:
        return "ng-u1"
    return ""


_TABLE_HEAD = (
    '<tr><th class="ng-role">tensor</th><th>dtype</th><th>shape</th><th>abs min</th>'
    '<th>abs max</th><th title="abs max as a share of the largest finite value of the dtype (of limit_dtype, when set)">'
    'of dtype max</th><th class="ng-role">problem</th></tr>'
)


def tensor_table_html(rows: list) -> str:
    """The tensors of one frame as a table (role, dtype, shape, abs min, abs max, share)."""
    parts = ['<table class="ng-tensors">', _TABLE_HEAD]
    for row in rows:
        classes = ["ng-row", "ng-" + row.category.replace("_", "-")]
        if row.flagged:
            classes.append("ng-flagged")
        if row.nonfinite:
            classes.append("ng-nonfinite")
        if row.kind == VALUE_TENSOR:
            min_text = fmt_value(row.abs_min) if row.abs_min is not None else "-"  # not measured
            if row.nonzero_abs_min is not None and row.abs_min == 0:
                min_text += f" (\u2260 0: {fmt_value(row.nonzero_abs_min)})"
            under = underflow_class(row)
            if under:
                stats = f'<td class="ng-min {under}" style="{_HEAT[under]}">{min_text}</td>'
            else:
                stats = f'<td class="ng-min">{min_text}</td>'
            heat = share_class(row)
            if heat:
                stats += (f'<td class="ng-max {heat}" style="{_HEAT[heat]}">{fmt_value(row.abs_max)}</td>'
                          f'<td class="ng-share {heat}" style="{_HEAT[heat]}">{esc(fmt_share(shown_share(row)))}</td>')
            else:
                stats += (f'<td class="ng-max">{fmt_value(row.abs_max)}</td>'
                          f'<td class="ng-share">{esc(fmt_share(shown_share(row)))}</td>')
        else:
            stats = f'<td class="ng-min" colspan="3">{esc(row.kind)}</td>'
        parts.append(
            f'<tr class="{" ".join(classes)}"><td class="ng-role">{esc(row.role)}</td>'
            f'<td class="ng-dtype">{esc(row.dtype or "")}</td><td class="ng-shape">{fmt_shape(row.shape)}</td>'
            f'{stats}<td class="ng-role ng-problem">{esc(row.problems)}{_samples_html(row)}</td></tr>'
        )
    parts.append("</table>")
    return "".join(parts)


def _samples_html(row) -> str:
    """' in samples 1, 3 (2 of 32)' after a data row's problem ('' when not known)."""
    if not row.sample_list:
        return ""
    return f' <span class="ng-samples">in samples {esc(row.sample_list)}</span>'


def frame_head_text(frame) -> str:
    words = [frame.phase, f"call {frame.call_index}", f"batch {frame.batch_number}"]
    if frame.raised:
        words.append("raised an exception")
    return " \u00b7 ".join(words)


def frame_html(index: int, frame, culprit: bool) -> str:
    classes = f"ng-frame ng-{esc(frame.phase)}" + (" ng-culprit-frame" if culprit else "")
    here = " \u2014 first non-finite value here" if culprit else ""
    extra = ""
    if frame.op:
        extra += f'<div class="ng-op">{esc(frame.op_words)}: <code>{esc(frame.op)}</code></div>'
    if frame.source:
        extra += f'<div class="ng-source">called from: <code>{esc(frame.source)}</code></div>'
    return (
        f'<div class="{classes}" data-frame="{index}"><div class="ng-frame-head">'
        f"{esc(frame_head_text(frame))}{here}</div>"
        f"{extra}{tensor_table_html(frame.rows)}</div>"
    )


def frames_html(node: ModuleNode, culprit_at: Optional[int]) -> str:
    """A node's own frames (capped at MAX_FRAMES_PER_NODE, keeping the culprit's)."""
    frames = node.frames
    shown = frames
    hidden = 0
    if len(frames) > MAX_FRAMES_PER_NODE:
        shown = frames[:MAX_FRAMES_PER_NODE]
        if culprit_at is not None and not any(i == culprit_at for i, _ in shown):
            shown = shown[:-1] + [f for f in frames if f[0] == culprit_at]
        hidden = len(frames) - len(shown)
    parts = [frame_html(index, frame, index == culprit_at) for index, frame in shown]
    if hidden:
        parts.append(
            f'<div class="ng-more">{hidden} more calls of this module: '
            f"<code>report.to_frame()</code> has them all</div>"
        )
    return "".join(parts)


def node_classes(node: ModuleNode) -> str:
    classes = ["ng-node"]
    if node.depth == 0:
        classes.append("ng-root")
    if node.on_path:
        classes.append("ng-culprit")
    if node.is_culprit:
        classes.append("ng-culprit-node")
    if node.nonfinite:
        classes.append("ng-has-nonfinite")
    return " ".join(classes)


def node_info_html(node: ModuleNode, limit_note: str = "") -> str:
    """What a node header says besides its name: class, badges, frame counts."""
    parts = []
    if node.module_class:
        parts.append(f'<span class="ng-class">{esc(node.module_class)}</span>')
    if node.is_culprit:
        parts.append('<span class="ng-badge ng-badge-bad ng-badge-culprit">first inf/nan</span>')
    elif node.on_path:
        parts.append('<span class="ng-badge ng-badge-bad ng-badge-path">culprit inside</span>')
    elif node.nonfinite:
        parts.append('<span class="ng-badge ng-badge-bad">inf/nan inside</span>')
    # A module that was not called itself (a container) says how close its calls came to the limit.
    shown = node.worst_share is not None and (node.worst_share >= 0.001 or not node.frames)
    if shown and not node.nonfinite:
        parts.append(f'<span class="ng-badge">max {esc(fmt_share(node.worst_share))} of dtype max</span>')
    own = len(node.frames)
    count = own or node.subtree_frames
    info = f"{count} call{'s' if count != 1 else ''}" + ("" if own else " inside")
    backward = sum(1 for _, frame in node.frames if frame.phase != FORWARD)
    if backward:
        info += f" ({backward} backward)"
    if node.children:
        info += f", {len(node.children)} child{'ren' if len(node.children) != 1 else ''}"
    parts.append(f'<span class="ng-info">{info}</span>')
    return " ".join(parts)


def _node_html(node: ModuleNode, culprit_at: Optional[int], out: list) -> None:
    open_attr = " open" if node.on_path or node.depth == 0 else ""
    out.append(
        f'<details class="{node_classes(node)}"{open_attr} data-path="{esc(node.path)}">'
        f'<summary class="ng-toggle"><span class="ng-name">{esc(node.label)}</span> '
        f"{node_info_html(node)}</summary><div class=\"ng-body\">"
    )
    out.append(frames_html(node, culprit_at))
    for child in node.children.values():
        _node_html(child, culprit_at, out)
    out.append("</div></details>")


# ---- the header ----------------------------------------------------------------------------
def culprit_path(report) -> str:
    culprit = report.first_nonfinite
    return culprit.module_name if culprit is not None else ""


def meta_text(report) -> str:
    words = [f"{report.kind}", f"batch {report.batch_number}", f"{len(report.frames)} frames"]
    culprit = report.first_nonfinite
    if culprit is not None:
        words.append(f"{culprit.phase}")
        if report.cause:
            words.append(f"cause: {report.cause}")
    if report.rank is not None:
        words.append(f"rank {report.rank}/{report.world_size}")
    if report.source_rank is not None:
        words.append(f"made on rank {report.source_rank}")
    if report.limit_dtype:
        words.append(f"limits of {report.limit_dtype}")
    return " \u00b7 ".join(words)


def legend_html() -> str:
    items = [
        ("ng-h1", "\u2265 0.1%"), ("ng-h2", "\u2265 1%"), ("ng-h3", "\u2265 10%"),
        ("ng-h4", "\u2265 100% / overflow"), ("ng-bad", "inf/nan"),
    ]
    spans = "".join(f'<span class="{c}" style="{_HEAT[c]}">{t}</span>' for c, t in items)
    under = "".join(
        f'<span class="{c}" style="{_HEAT[c]}">{t}</span>'
        for c, t in (("ng-u1", "subnormal"), ("ng-u2", "flushes to zero"))
    )
    return (f'<div class="ng-legend">abs max, share of the dtype\'s largest value: {spans}'
            f" \u00b7 abs min: {under}</div>")


# Inline, like the heat colours: a sanitised output keeps it where it drops the <style> element.
_HINT_STYLE = ("margin:2px 0 4px 0;padding:2px 6px;border-left:3px solid #d08000;"
               "background:#fff5df;color:#222")


def hint_html(hint: str) -> str:
    """The hint (why, and what to try) under the summary; `code` between backticks."""
    pieces = hint.split("`")
    if len(pieces) % 2 == 0:  # an unpaired backtick: show the text as it is
        pieces = [hint]
    body = "".join(f"<code>{esc(piece)}</code>" if index % 2 else esc(piece)
                   for index, piece in enumerate(pieces))
    return f'<div class="ng-hint" style="{_HINT_STYLE}"><b>hint:</b> {body}</div>'


def header_html(report) -> str:
    from .svg import chart_svg

    culprit = report.first_nonfinite
    summary_class = "ng-summary ng-bad-summary" if culprit is not None else "ng-summary"
    parts = [f'<div class="ng-header"><div class="{summary_class}">{esc(report.summary())}</div>']
    if culprit is not None and report.hint:
        parts.append(hint_html(report.hint))
    if culprit is not None:  # the culprit's recent history, how it was found: as in the text
        parts += [f'<div class="ng-note">{esc(line)}</div>' for line in note_lines(report)]
    parts.append(f'<div class="ng-meta">{esc(meta_text(report))}</div>')
    if culprit is not None:
        parts.append(
            f'<div class="ng-path">culprit: <code>{esc(culprit.label)}</code> '
            f"({esc(culprit.module_class)})</div>"
        )
        if culprit.op:
            parts.append(f'<div class="ng-op">{esc(culprit.op_words)}: '
                         f'<code>{esc(culprit.op)}</code></div>')
        if culprit.source:
            parts.append(f'<div class="ng-source">called from: <code>{esc(culprit.source)}</code></div>')
    parts.append(chart_svg(report))
    parts.append(legend_html())
    parts.append("</div>")
    return "".join(parts)


def report_html(report) -> str:
    """The whole report as static HTML: header, chart and the collapsible module tree."""
    root, culprit_at = build_tree(report)
    out = [f'<div class="ng-report ng-kind-{esc(report.kind)}">', STYLE, header_html(report)]
    out.append('<div class="ng-tree">')
    if report.frames:
        _node_html(root, culprit_at, out)
    else:
        out.append('<div class="ng-empty">no frames recorded</div>')
    out.append("</div></div>")
    return "".join(out)

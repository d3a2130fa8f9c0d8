"""The report's views: static HTML (golden files), the inline SVG chart, the widget tree,
the mimebundle with its HTML fallback, the comparison, and speed on a large trace.

Reports are built by hand so the renderings are deterministic; the golden files are
tests/golden/html_* (tests/conftest.py's `golden` fixture says how to rewrite them).
"""

import math
import re
from html.parser import HTMLParser

import ipywidgets
import pandas as pd
import pytest

from numguard_nb.compare import compare_reports
from numguard_nb.render import html as ng_html
from numguard_nb.render.svg import chart_points, chart_svg
from numguard_nb.render.widget import WIDGET_MIME, ReportView, report_bundle
from numguard_nb.report import (
    BACKWARD, DETECTION, FORWARD, GRAD_INPUT, GRAD_OUTPUT, GRAD_PARAM, INPUT, OUTPUT, PARAM, TRACE,
    Frame, Report, TensorRow,
)

INF = math.inf


def row(role, category, dtype="float16", shape=(2, 4), lo=0.1, hi=1.0, **kw):
    return TensorRow(role=role, category=category, dtype=dtype, shape=shape, abs_min=lo, abs_max=hi, **kw)


def detection_report():
    """An fp16 feed-forward whose `wo` overflows in batch 7, with every kind of row."""
    frames = [
        Frame("encoder.embed", "Embedding", FORWARD, 7, 0, [
            row("weight", PARAM, shape=(128, 64), lo=1e-4, hi=2.5),
            row("input[0]", INPUT, dtype="int64", shape=(2, 16), lo=1, hi=127),
            row("input[<mask>]", INPUT, kind="none", dtype=None, shape=None, lo=None, hi=None),
            row("output", OUTPUT, shape=(2, 16, 64), lo=0.0, hi=2.5),
        ]),
        Frame("encoder.block.0.ff.wi", "Linear", FORWARD, 7, 0, [
            row("weight", PARAM, lo=1e-6, hi=40.0),  # subnormal in float16
            row("input[0]", INPUT, lo=0.0, hi=2.5),
            row("output", OUTPUT, lo=0.0, hi=7000.0),  # 10.7% of 65504
        ]),
        Frame("encoder.block.0.ff.act", "GELU", FORWARD, 7, 0, [
            row("input[0]", INPUT, lo=0.0, hi=7000.0),
            row("output", OUTPUT, lo=0.0, hi=700.0),  # 1.07%
            row("output[scale]", OUTPUT, kind="not a tensor", dtype=None, shape=None, lo=None, hi=None),
        ]),
        Frame("encoder.block.0.ff.wo", "Linear", FORWARD, 7, 0, [
            row("weight", PARAM, lo=1e-3, hi=30.0),
            row("input[0]", INPUT, lo=0.0, hi=700.0),
            row("output", OUTPUT, lo=8.0, hi=INF, posinf=True, neginf=True, flagged=True),
        ], op="aten::addmm", source="model.py:12: return self.wo(h) & <b>"),
    ]
    return Report(
        frames=frames, first_nonfinite=frames[-1], batch_number=7, kind=DETECTION,
        reason="encoder.block.0.ff.wo (Linear) produced a non-finite value in forward (call 0 of "
               "batch 7): output holds +inf and -inf, which its inputs and weights did not hold",
        cause="forward",
    )


def trace_report(batch=3, scale=1.0):
    """An fp32 trace (forward and backward) of a small MLP, with a module called twice."""
    frames = [
        Frame("0", "Linear", FORWARD, batch, 0, [
            row("weight", PARAM, "float32", (8, 4), 0.01, 0.5),
            row("input[0]", INPUT, "float32", (3, 4), 0.02, 1.6 * scale),
            row("output", OUTPUT, "float32", (3, 8), 0.01, 1.1 * scale),
        ]),
        Frame("1", "ReLU", FORWARD, batch, 0, [
            row("input[0]", INPUT, "float32", (3, 8), 0.01, 1.1 * scale),
            row("output", OUTPUT, "float32", (3, 8), 0.0, 0.7 * scale),
        ]),
        Frame("1", "ReLU", FORWARD, batch, 1, [
            row("input[0]", INPUT, "float32", (3, 8), 0.0, 0.7 * scale),
            row("output", OUTPUT, "float32", (3, 8), 0.0, 0.7 * scale),
        ]),
        Frame("", "Sequential", FORWARD, batch, 0, [
            row("input[0]", INPUT, "float32", (3, 4), 0.02, 1.6 * scale),
            row("output", OUTPUT, "float32", (3, 8), 0.0, 0.7 * scale),
        ]),
        Frame("0", "Linear", BACKWARD, batch, 0, [
            row("grad_output", GRAD_OUTPUT, "float32", (3, 8), 0.0, 1.0),
            row("weight.grad", GRAD_PARAM, "float32", (8, 4), 0.0, 3.2 * scale),
            row("grad_input[0]", GRAD_INPUT, "float32", (3, 4), 0.0, 0.9),
        ]),
    ]
    return Report(frames=frames, batch_number=batch, kind=TRACE)


class Tree(HTMLParser):
    """Checks that tags nest properly and records elements with their classes and attributes."""

    VOID = {"br", "img", "input", "meta", "hr", "link"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack = []
        self.elements = []  # (tag, classes, attrs, depth, parent index)
        self.text = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        parent = self.stack[-1][1] if self.stack else None
        self.elements.append((tag, set((attrs.get("class") or "").split()), attrs, len(self.stack), parent))
        if tag not in self.VOID:
            self.stack.append((tag, len(self.elements) - 1))

    def handle_startendtag(self, tag, attrs):
        attrs = dict(attrs)
        parent = self.stack[-1][1] if self.stack else None
        self.elements.append((tag, set((attrs.get("class") or "").split()), attrs, len(self.stack), parent))

    def handle_endtag(self, tag):
        assert self.stack, f"</{tag}> closes nothing"
        open_tag, _ = self.stack.pop()
        assert open_tag == tag, f"</{tag}> closes <{open_tag}>"

    def handle_data(self, data):
        self.text.append(data)

    def with_class(self, css, tag=None):
        return [e for e in self.elements if css in e[1] and (tag is None or e[0] == tag)]


def parse(markup):
    tree = Tree()
    tree.feed(markup)
    tree.close()
    assert not tree.stack, f"unclosed tags: {[t for t, _ in tree.stack]}"
    return tree


# ---- static HTML ---------------------------------------------------------------------------
def test_detection_html_matches_golden_and_is_well_formed(golden):
    report = detection_report()
    markup = ng_html.report_html(report)
    assert report._repr_html_() == markup
    golden("html_detection.html", markup)
    tree = parse(markup)
    # the hierarchy is built from the dotted names: encoder > block > 0 > ff > wi/act/wo, embed
    nodes = {e[2]["data-path"]: e for e in tree.with_class("ng-node", "details")}
    assert set(nodes) == {
        "", "encoder", "encoder.embed", "encoder.block", "encoder.block.0", "encoder.block.0.ff",
        "encoder.block.0.ff.wi", "encoder.block.0.ff.act", "encoder.block.0.ff.wo",
    }
    path = ["", "encoder", "encoder.block", "encoder.block.0", "encoder.block.0.ff", "encoder.block.0.ff.wo"]
    for name, (_, classes, attrs, _, _) in nodes.items():
        on_path = name in path
        assert ("ng-culprit" in classes) == on_path, name
        assert ("open" in attrs) == on_path, name  # the path to the culprit is expanded, the rest not
        assert ("ng-culprit-node" in classes) == (name == "encoder.block.0.ff.wo"), name
    # every frame is in the tree exactly once, inside its module's node
    frames = tree.with_class("ng-frame", "div")
    assert sorted(int(e[2]["data-frame"]) for e in frames) == [0, 1, 2, 3]
    assert [e[2]["data-frame"] for e in tree.with_class("ng-culprit-frame")] == ["3"]
    assert len(tree.with_class("ng-toggle", "summary")) == len(nodes)
    assert len(tree.with_class("ng-tensors", "table")) == 4
    # text is escaped, never markup
    assert "input[<mask>]" in "".join(tree.text)
    assert "<mask>" not in markup and "<b>" not in markup.split("</style>", 1)[1]
    assert "model.py:12: return self.wo(h) & <b>" in "".join(tree.text)


def test_cells_are_coloured_by_closeness_to_the_dtype_limits():
    tree = parse(ng_html.report_html(detection_report()))
    flagged = tree.with_class("ng-flagged", "tr")
    assert len(flagged) == 1 and "ng-nonfinite" in flagged[0][1]
    heat = {css: len(tree.with_class(css, "td")) for css in ("ng-bad", "ng-h3", "ng-h2", "ng-u1")}
    # inf output (2 cells: abs max and share); 7000/65504 (output of wi, input of act: 2 x 2);
    # 700/65504 (act output, wo input: 2 x 2); the float16 weight holding 1e-6 (subnormal)
    assert heat == {"ng-bad": 2, "ng-h3": 4, "ng-h2": 4, "ng-u1": 1}
    for css in heat:
        for element in tree.with_class(css, "td"):
            assert element[2]["style"].startswith("background:"), "inline colour for sanitised outputs"


def test_share_and_underflow_classes_read_the_row_fields():
    assert ng_html.share_class(row("x", OUTPUT, hi=65504.0)) == "ng-h4"
    assert ng_html.share_class(row("x", OUTPUT, hi=6551.0)) == "ng-h3"
    assert ng_html.share_class(row("x", OUTPUT, hi=65.6)) == "ng-h1"
    assert ng_html.share_class(row("x", OUTPUT, hi=6.0)) == ""
    assert ng_html.share_class(row("x", OUTPUT, dtype="float32", hi=1e5, predicted_overflow=True)) == "ng-h4"
    assert ng_html.share_class(row("x", OUTPUT, lo=math.nan, hi=math.nan, nan=True)) == "ng-bad"
    assert ng_html.underflow_class(row("x", OUTPUT, dtype="float32", lo=1e-9, predicted_underflow=True)) == "ng-u2"
    assert ng_html.underflow_class(row("x", OUTPUT, dtype="float32", lo=1e-9)) == ""
    assert ng_html.underflow_class(row("x", OUTPUT, dtype="float16", lo=0.0, nonzero_abs_min=3e-5)) == "ng-u1"


def test_trace_html_matches_golden(golden):
    report = trace_report()
    markup = ng_html.report_html(report)
    golden("html_trace.html", markup)
    tree = parse(markup)
    assert tree.with_class("ng-culprit") == []
    # a module called twice keeps both calls under one node; forward and backward frames both shown
    relu = [e for e in tree.with_class("ng-node", "details") if e[2]["data-path"] == "1"]
    assert len(relu) == 1
    assert "2 calls" in markup and "ng-backward" in markup
    root = [e for e in tree.with_class("ng-root", "details")]
    assert len(root) == 1 and "open" in root[0][2]


def test_text_renderings_match_golden(golden):
    report = detection_report()
    bundle = report_bundle(report, widget=False)
    assert set(bundle) == {"text/plain", "text/html"}
    assert bundle["text/plain"] == report.to_text()
    golden("html_detection_text.txt", bundle["text/plain"])
    comparison = compare_reports(trace_report(3), trace_report(4, scale=50.0))
    golden("html_compare_text.txt", repr(comparison) + "\n")
    golden("html_compare.html", comparison._repr_html_())


def test_empty_report_renders():
    report = Report(frames=[], batch_number=0)
    tree = parse(ng_html.report_html(report))
    assert tree.with_class("ng-empty") and not tree.with_class("ng-node")
    assert chart_svg(report) == ""
    view = ReportView(report)
    assert view.root is None


# ---- the chart -----------------------------------------------------------------------------
def test_chart_plots_log_abs_max_up_to_the_culprit_with_the_dtype_limit():
    report = detection_report()
    points, culprit_at = chart_points(report)
    assert culprit_at == 3
    assert [value for _, value, _ in points] == [2.5, 7000.0, 700.0, None]
    assert [bad for _, _, bad in points] == [False, False, False, True]
    svg = chart_svg(report)
    tree = parse(svg)
    assert tree.elements[0][0] == "svg" and "ng-chart" in tree.elements[0][1]
    assert len(tree.with_class("ng-limit", "line")) == 1
    assert "float16 max 65504" in "".join(tree.text)
    assert len(tree.with_class("ng-point", "circle")) == 3
    assert len(tree.with_class("ng-point-bad", "path")) == 1
    # the limit line sits above every finite point (smaller y is higher)
    limit_y = float(tree.with_class("ng-limit")[0][2]["y1"])
    assert all(float(e[2]["cy"]) > limit_y for e in tree.with_class("ng-point", "circle"))


def test_chart_stops_at_the_culprit_in_a_trace():
    report = trace_report()
    report.first_nonfinite = report.frames[1]
    points, culprit_at = chart_points(report)
    assert culprit_at == 1 and len(points) == 2
    assert 'class="ng-point ng-point-culprit"' in chart_svg(report)


# ---- the widget ----------------------------------------------------------------------------
def _all_widgets():
    registry = getattr(ipywidgets.widgets.widget, "_instances", None)  # ipywidgets 8
    if registry is None:
        registry = ipywidgets.Widget.widgets  # ipywidgets 7
    return registry


def test_widget_tree_expands_the_culprit_path_and_builds_the_rest_lazily():
    report = detection_report()
    view = ReportView(report)
    assert {"ng-report", "ng-widget"} <= set(view.widget._dom_classes)
    header, tree_box = view.widget.children
    assert "ng-header-widget" in header._dom_classes and 'class="ng-chart"' in header.value
    assert "ng-tree" in tree_box._dom_classes
    node = view.root
    for part in ["encoder", "block", "0", "ff", "wo"]:
        assert node.opened and node.built
        assert "ng-culprit" in node.box._dom_classes and "ng-open" in node.box._dom_classes
        node = node.children[part]
    assert node.opened and {"ng-culprit", "ng-culprit-node"} <= set(node.box._dom_classes)
    frames_html = node.body.children[0]
    assert "ng-frames" in frames_html._dom_classes
    assert 'class="ng-tensors"' in frames_html.value and "ng-culprit-frame" in frames_html.value
    # off the path: shown collapsed, body not built until its toggle is clicked
    embed = view.root.children["encoder"].children["embed"]
    assert not embed.built and embed.body is None and embed.box.children == (embed.head,)
    assert "ng-culprit" not in embed.box._dom_classes
    assert "ng-toggle" in embed.toggle._dom_classes and embed.toggle.description == "\u25b8 embed"
    embed.toggle.click()
    assert embed.built and embed.opened and embed.body.layout.display == ""
    assert embed.toggle.description == "\u25be embed"
    assert "input[&lt;mask&gt;]" in embed.body.children[0].value
    embed.toggle.click()
    assert not embed.opened and embed.body.layout.display == "none" and "ng-open" not in embed.box._dom_classes
    rows = view.rows_of("encoder.embed")
    assert list(rows["role"]) == ["weight", "input[0]", "input[<mask>]", "output"]


def test_widget_settings_are_synced_traits():
    # traitlets accepts any attribute, so a trait missing from one ipywidgets major (7.x or 8.x)
    # would be set silently and never reach the frontend: check the synced state instead
    report = detection_report()
    view = ReportView(report)
    node = view.expand_path(report.first_nonfinite.module_name)
    state = node.toggle.get_state()
    assert state["description"].endswith(" wo") and state["tooltip"] == node.node.path
    assert node.toggle.style.get_state()["button_color"]
    assert {"width": "auto", "min_width": "0"}.items() <= node.toggle.layout.get_state().items()
    assert node.body.layout.get_state()["display"] == ""
    node.collapse()
    assert node.body.layout.get_state()["display"] == "none"
    (button,) = [c for c in node.body.children if "ng-df-button" in c._dom_classes]
    assert button.layout.get_state()["align_self"] == "flex-start" and button.get_state()["tooltip"]


def test_bundle_carries_widget_html_fallback_and_text():
    report = detection_report()
    view = ReportView(report)
    bundle = report_bundle(report, view=view)
    assert set(bundle) == {WIDGET_MIME, "text/html", "text/plain"}
    assert bundle[WIDGET_MIME] == {"version_major": 2, "version_minor": 0, "model_id": view.widget.model_id}
    assert bundle["text/html"] == ng_html.report_html(report)
    assert view._repr_mimebundle_()[WIDGET_MIME]["model_id"] == view.widget.model_id


# ---- a large trace -------------------------------------------------------------------------
def big_trace(layers=24, batches=4):
    """What a 24-layer transformer trace looks like: ~3000 frames of forward and backward."""
    leaves = ["attention.self.query", "attention.self.key", "attention.self.value",
              "attention.self.dropout", "attention.self", "attention.output.dense",
              "attention.output.LayerNorm", "attention.output", "attention", "intermediate.dense",
              "intermediate.act", "intermediate", "output.dense", "output.LayerNorm", "output", ""]
    frames = []
    for batch in range(batches):
        for phase in (FORWARD, BACKWARD):
            order = range(layers) if phase == FORWARD else reversed(range(layers))
            for layer in order:
                for leaf in leaves:
                    name = f"bert.encoder.layer.{layer}" + (f".{leaf}" if leaf else "")
                    cats = (INPUT, OUTPUT) if phase == FORWARD else (GRAD_OUTPUT, GRAD_INPUT)
                    frames.append(Frame(name, "Module", phase, batch, 0, [
                        row("weight", PARAM if phase == FORWARD else GRAD_PARAM, "float32", (64, 64), 0.01, 1.0),
                        row(cats[0], cats[0], "float32", (2, 16, 64), 0.0, 3.0 + layer),
                        row(cats[1], cats[1], "float32", (2, 16, 64), 0.0, 4.0 + layer),
                    ]))
    culprit = frames[len(frames) // 2 + 7]
    culprit.rows[2].abs_max = INF
    culprit.rows[2].posinf = True
    culprit.rows[2].flagged = True
    return Report(frames=frames, first_nonfinite=culprit, batch_number=batches - 1, kind=TRACE,
                  reason="a trace", cause="backward")


def test_a_24_layer_trace_builds_only_the_path_to_the_culprit():
    report = big_trace()
    assert len(report.frames) > 3000
    before = len(_all_widgets())
    view = ReportView(report)
    bundle = report_bundle(report, view=view)
    created = len(_all_widgets()) - before
    # only the path to the culprit and the children of its nodes exist as widgets (each with its
    # Layout/Style models); building all ~390 nodes up front would make thousands
    tree_nodes = sum(1 for _ in view.tree.walk())
    views, stack = 0, [view.root]
    while stack:
        node_view = stack.pop()
        views += 1
        stack.extend(node_view.children.values())
    assert tree_nodes > 380 and views < 60, (tree_nodes, views)
    assert created < 600, f"{created} widget models built up front: collapsed nodes must be lazy"
    assert bundle["text/html"].count('class="ng-node') > 24 * 15
    # the culprit (layer 0 attention output, batch 2) is open in the widget
    culprit = report.first_nonfinite
    node = view.root
    for part in culprit.module_name.split("."):
        node = node.children[part]
        assert node.opened
    assert node.node.is_culprit
    assert culprit.module_name == "bert.encoder.layer.0.attention.output"
    assert re.search(r'class="ng-frame ng-forward ng-culprit-frame"', node.body.children[0].value)


def test_node_with_many_calls_is_capped_but_keeps_the_culprit():
    frames = [Frame("loop", "Linear", FORWARD, 0, i, [row("output", OUTPUT, hi=1.0)]) for i in range(80)]
    frames[70].rows[0].abs_max = INF
    frames[70].rows[0].posinf = True
    report = Report(frames=frames, first_nonfinite=frames[70], kind=DETECTION, reason="r")
    root, culprit_at = ng_html.build_tree(report)
    markup = ng_html.frames_html(root.children["loop"], culprit_at)
    assert markup.count('class="ng-frame ') == ng_html.MAX_FRAMES_PER_NODE
    assert 'data-frame="70"' in markup
    assert f"{80 - ng_html.MAX_FRAMES_PER_NODE} more calls" in markup


# ---- comparison ----------------------------------------------------------------------------
def test_compare_names_the_first_module_that_differs_by_the_factor():
    good, bad = trace_report(149), trace_report(150, scale=50.0)
    result = good.compare(bad)
    assert result and result.found
    assert (result.module_name, result.phase, result.call_index, result.role) == ("0", FORWARD, 0, "input[0]")
    assert result.a_value == pytest.approx(1.6) and result.b_value == pytest.approx(80.0)
    assert result.ratio == pytest.approx(50.0)
    assert "batch 149" in repr(result) and "batch 150" in repr(result)
    assert result.frames_compared == 5 and result.only_in_a == 0 and result.only_in_b == 0
    # below the factor: nothing differs, and the result says so
    same = good.compare(trace_report(150, scale=5.0))
    assert not same and same.module_name is None
    assert "no module's abs max differs by more than 10x" in repr(same)
    assert "no module" in same._repr_html_()
    assert good.compare(trace_report(150, scale=5.0), factor=4).module_name == "0"


def test_compare_counts_a_value_turning_non_finite_and_unmatched_frames():
    good = trace_report(1)
    bad = detection_report()
    result = compare_reports(good, bad)
    assert not result and result.only_in_a == 5 and result.only_in_b == 4
    a, b = trace_report(1), trace_report(2)
    b.frames[1].rows[1].abs_max = INF
    b.frames[1].rows[1].posinf = True
    result = compare_reports(a, b)
    assert (result.module_name, result.call_index, result.role, result.ratio) == ("1", 0, "output", INF)
    with pytest.raises(ValueError):
        compare_reports(a, b, factor=1)
    with pytest.raises(TypeError):
        compare_reports(a, "not a report")


def test_a_tiny_share_of_the_dtype_max_reads_as_small_not_as_noise():
    assert ng_html.fmt_share(3.51e-39) == "<0.01%"  # 3.51e-37 %
    assert ng_html.fmt_share(0.0) == "0%"
    assert ng_html.fmt_share(0.107) == "10.7%" and ng_html.fmt_share(1e-4) == "0.01%"
    tiny = Report(frames=[Frame("m", "Linear", FORWARD, 0, 0, [row("output", OUTPUT, dtype="float32", hi=1.2e-36)])])
    assert "e-37%" not in ng_html.report_html(tiny) and "&lt;0.01%" in ng_html.report_html(tiny)


def test_the_table_shows_a_missing_statistic_as_missing_and_a_nan_as_nan():
    table = detection_report().to_frame()
    (index,) = table.index[table.role == "input[<mask>]"]
    assert table.kind[index] == "none"
    assert table.abs_max[index] is pd.NA and table.abs_min[index] is pd.NA
    nan = Report(frames=[Frame("m", "Linear", FORWARD, 0, 0, [row("output", OUTPUT, lo=math.nan, hi=math.nan, nan=True)])])
    value = nan.to_frame().abs_max.iloc[0]
    assert value is not pd.NA and math.isnan(value)
    assert str(table.abs_max.dtype) == "Float64"


def test_compare_with_a_detection_reads_the_frames_of_its_own_batch():
    # a detection keeps the last max_frames frames, earlier batches' too: the module's frame of
    # the failing batch is the one compared, not its first in the list
    import torch
    from torch import nn

    import numguard_nb as ng

    class Grows(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x * 1e30 * 1e30 if self.calls == 4 else x

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Grows(), nn.Linear(3, 1))
    x = torch.randn(2, 3)
    with pytest.raises(ng.NonFiniteError) as caught:
        with ng.Guard(model, trace_batches=[0], backward=False) as guard:
            for _ in range(4):
                model(x)
    bad = caught.value.report
    assert {frame.batch_number for frame in bad.frames} != {3}  # earlier batches' frames too
    result = guard.traces[0].compare(bad)
    assert (result.module_name, result.role, result.b_value) == ("1", "output", INF)
    assert guard.traces[0].frames[result.frame_position].module_name == "1"
    reverse = bad.compare(guard.traces[0])  # the detection first: its batch's frames compared
    assert (reverse.module_name, reverse.a_value, bad.frames[reverse.frame_position].batch_number
            ) == ("1", INF, 3)

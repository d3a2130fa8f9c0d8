"""What a collapsed module of the tree says about what is inside it (static HTML and widget), and
the chart's labels: the culprit's module and the steepest rise, a tooltip on every point.
"""

import math
import re

import pytest

from numguard_nb.render.html import build_tree, node_info_html, report_html
from numguard_nb.render.svg import chart_points, chart_svg, steepest_rise
from numguard_nb.render.widget import ReportView
from numguard_nb.report import DETECTION, FORWARD, INPUT, LATEST, OUTPUT, PARAM, Frame, Report, TensorRow


def row(role, category, lo=0.1, hi=1.0, **kw):
    return TensorRow(role=role, category=category, dtype="float16", shape=(2, 4), abs_min=lo,
                     abs_max=hi, **kw)


def overflow_report():
    """encoder.block.0.ff.wo overflows; encoder.block.0 and its parents are never called."""
    frames = [
        Frame("encoder.embed", "Embedding", FORWARD, 0, 0, [row("output", OUTPUT, hi=2.5)]),
        Frame("encoder.block.0.ff.wi", "Linear", FORWARD, 0, 0, [
            row("weight", PARAM, hi=40.0), row("output", OUTPUT, hi=7000.0)]),  # x2800
        Frame("encoder.block.0.ff.act", "GELU", FORWARD, 0, 0, [row("output", OUTPUT, hi=700.0)]),
        Frame("encoder.block.0.ff.wo", "Linear", FORWARD, 0, 0, [
            row("input[0]", INPUT, hi=700.0),
            row("output", OUTPUT, lo=8.0, hi=math.inf, posinf=True, flagged=True)]),
        Frame("decoder.out", "Linear", FORWARD, 0, 0, [row("output", OUTPUT, hi=3.0)]),
    ]
    return Report(frames=frames, first_nonfinite=frames[3], batch_number=0, kind=DETECTION,
                  reason="encoder.block.0.ff.wo (Linear) produced a non-finite value", cause="forward")


def _nodes(report):
    root, _ = build_tree(report)
    return {node.path: node for node in root.walk()}


def _info(node) -> str:
    return re.sub(r"<[^>]+>", " ", node_info_html(node))


def test_a_module_never_called_says_what_is_inside_it():
    nodes = _nodes(overflow_report())
    for path, calls in (("encoder", 4), ("encoder.block", 3), ("encoder.block.0", 3),
                        ("encoder.block.0.ff", 3)):
        info = _info(nodes[path])
        assert f"{calls} calls inside" in info and "culprit inside" in info, (path, info)
        assert "no frames" not in info and "first inf/nan" not in info
    culprit = _info(nodes["encoder.block.0.ff.wo"])
    assert "first inf/nan" in culprit and "culprit inside" not in culprit and "1 call" in culprit
    # off the path: a container says how close its calls came to the dtype's limit
    decoder = _info(nodes["decoder"])
    assert "1 call inside" in decoder and "max &lt;0.01% of dtype max" in decoder
    assert "culprit inside" not in decoder and "inf/nan" not in decoder
    # a called module keeps its own count and shows the share only from 0.1% on
    assert "max" not in _info(nodes["decoder.out"]) and "1 call" in _info(nodes["decoder.out"])


def test_the_static_tree_and_the_widget_say_the_same():
    report = overflow_report()
    markup = report_html(report)
    assert "no frames" not in markup
    assert markup.count("culprit inside") == 5  # the root and encoder's four levels
    view = ReportView(report)
    encoder = view.root.children["encoder"]
    assert encoder.info.value == node_info_html(_nodes(report)["encoder"])
    assert "4 calls inside" in encoder.info.value and "culprit inside" in encoder.info.value


def test_a_finite_report_names_no_culprit_inside():
    report = overflow_report()
    report = Report(frames=report.frames[:3], batch_number=0, kind=LATEST)
    markup = report_html(report)
    assert "culprit inside" not in markup and "no frames" not in markup
    assert "3 calls inside" in _info(_nodes(report)["encoder"])


def _texts(svg, css):
    return re.findall(rf'<text class="ng-label {css}"[^>]*>([^<]*)</text>', svg)


def test_the_chart_labels_the_culprit_and_the_steepest_rise():
    report = overflow_report()
    points, culprit_at = chart_points(report)
    assert culprit_at == 3
    assert steepest_rise(points) == (1, pytest.approx(2800.0))
    svg = chart_svg(report)
    assert _texts(svg, "ng-label-culprit") == ["encoder.block.0.ff.wo"]
    assert _texts(svg, "ng-label-rise") == ["encoder.block.0.ff.wi \u00d72.8e+03"]
    # every point has its tooltip: module, class, phase, call and value
    marks = re.findall(r'<(circle|path) class="ng-point[^"]*"[^>]*><title>([^<]*)</title>', svg)
    assert [title.split(" (")[0] for _, title in marks] == [f.label for f in report.frames[:4]]
    assert marks[1][1] == "encoder.block.0.ff.wi (Linear) forward call 0: abs max 7e+03"
    # the labels sit inside the chart, clear of the dtype limit's line
    limit_y = float(re.search(r'class="ng-limit"[^>]* y1="([\d.]+)"', svg).group(1))
    for y in re.findall(r'class="ng-label [^"]*" x="[\d.]+" y="([\d.]+)"', svg):
        assert not float(y) - 8 <= limit_y <= float(y) + 3 and 0 < float(y) < 150


def test_nothing_rises_nothing_is_labelled_as_a_rise():
    frames = [Frame(name, "Linear", FORWARD, 0, 0, [row("output", OUTPUT, hi=hi)])
              for name, hi in (("a", 5.0), ("b", 2.0), ("c", 1.0))]
    report = Report(frames=frames, batch_number=0, kind=LATEST)
    points, _ = chart_points(report)
    assert steepest_rise(points) is None
    svg = chart_svg(report)
    assert "ng-label" not in svg


def test_a_forward_detection_s_tree_root_is_the_model_s_class():
    import torch
    from torch import nn
    # the model's own call never ended (the detection stopped it): its class comes with the report
    import numguard_nb as ng
    from numguard_nb.render.html import build_tree

    class MyNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.b(self.a(x) * float("inf"))

    model = MyNet()
    with pytest.raises(ng.NonFiniteError) as caught, ng.Guard(model):
        model(torch.ones(1, 2))
    root, _ = build_tree(caught.value.report)
    assert (root.label, root.module_class) == ("model", "MyNet")

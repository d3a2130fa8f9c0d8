"""The interactive view of a `Report`: the module tree as ipywidgets, built lazily.

Contract: `display_report(report)` shows a `ReportView` (the tree opened down to the culprit; any
other node is built on its first click) in a mimebundle (`report_bundle`) that also carries the
static HTML of the same tree and Hugging Face's text format: a frontend without the widget
manager shows the HTML, a terminal the text. `use_widgets()` says whether a person's frontend
runs the code, `widgets_available()` whether ipywidgets is installed; `WIDGET_MIME` is the
widget's MIME type. The CSS classes of its DOM are stable.

Limits: a notebook executed headless (nbclient, `jupyter nbconvert --execute`, papermill) gets
the static HTML and text only, no widget. Works with ipywidgets 7.x and 8.x.

    >>> view = display_report(guard.report)     # None where no widget is shown
    >>> view.expand_path("encoder.block.3")      # open the tree down to a module

How it works, and the DOM: docs/architecture.md, "The report widget".
"""

from __future__ import annotations

from typing import Dict, Optional

from ._format import esc
from .html import (
    STYLE, ModuleNode, build_tree, frames_html, header_html, node_classes, node_info_html,
    report_html,
)

__all__ = [
    "ReportView", "report_bundle", "display_report", "use_widgets", "widgets_available",
    "WIDGET_MIME",
]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

_PATH_COLOUR = "#fde8e8"
_CULPRIT_COLOUR = "#f4b4b4"
_CLOSED, _OPENED = "\u25b8", "\u25be"


def widgets_available() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def use_widgets() -> bool:
    """Whether to display the widget: ipywidgets is installed and a kernel runs the code for a
    frontend that a person uses.

    The kernel tells them apart by `allow_stdin` of the request it runs: a frontend that answers
    `input()` (JupyterLab and Notebook send allow_stdin by default) has a person at it; a headless
    run (nbclient, so nbconvert --execute and papermill) says it cannot. There the outputs become
    a document (an export, a committed notebook), whose report is the static tree.
    """
    if not widgets_available():
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    kernel = getattr(get_ipython(), "kernel", None)
    # ipykernel sets _allow_stdin from each execute request; a kernel without it: as before.
    return kernel is not None and bool(getattr(kernel, "_allow_stdin", True))


class _NodeView:
    """One module of the tree as widgets; frames and children are built on first expand."""

    def __init__(self, view: "ReportView", node: ModuleNode):
        import ipywidgets as w

        self.view = view
        self.node = node
        self.built = False
        self.opened = False
        self.children: Dict[str, _NodeView] = {}  # filled on first expand
        self.toggle = w.Button(
            description=self._description(), tooltip=node.path or "(the model)",
            layout=w.Layout(width="auto", min_width="0"),
        )
        self.toggle.add_class("ng-toggle")
        if node.is_culprit:
            self.toggle.style.button_color = _CULPRIT_COLOUR
        elif node.on_path:
            self.toggle.style.button_color = _PATH_COLOUR
        self.toggle.on_click(self._clicked)
        self.info = w.HTML(value=node_info_html(node))
        self.info.add_class("ng-node-info")
        self.head = w.HBox([self.toggle, self.info])
        self.head.add_class("ng-node-head")
        self.body = None  # made on first expand: a collapsed node costs four widgets
        self.box = w.VBox([self.head])
        for css in node_classes(node).split():
            self.box.add_class(css)

    def _description(self) -> str:
        return f"{_OPENED if self.opened else _CLOSED} {self.node.label}"

    def _clicked(self, _button=None) -> None:
        if self.opened:
            self.collapse()
        else:
            self.expand()

    def expand(self) -> None:
        if not self.built:
            self._build()
        self.opened = True
        self.body.layout.display = ""
        self.toggle.description = self._description()
        self.box.add_class("ng-open")

    def collapse(self) -> None:
        self.opened = False
        if self.body is not None:
            self.body.layout.display = "none"
        self.toggle.description = self._description()
        self.box.remove_class("ng-open")

    def _build(self) -> None:
        import ipywidgets as w

        self.body = w.VBox([], layout=w.Layout(margin="0 0 0 18px"))
        self.body.add_class("ng-body")
        self.box.children = (self.head, self.body)
        node = self.node
        children = []
        if node.frames:
            frames = w.HTML(value=frames_html(node, self.view.culprit_at))
            frames.add_class("ng-frames")
            children.append(frames)
            button = w.Button(
                description="rows as a DataFrame", layout=w.Layout(width="auto", align_self="flex-start"),
                tooltip="report.to_frame() rows of this module",
            )
            button.add_class("ng-df-button")
            output = w.Output()
            output.add_class("ng-df-output")
            button.on_click(lambda _b, out=output: self._show_rows(out))
            children.extend([button, output])
        for name, child in node.children.items():
            view = _NodeView(self.view, child)
            self.children[name] = view
            children.append(view.box)
        self.body.children = tuple(children)
        self.built = True

    def _show_rows(self, output) -> None:
        from IPython.display import display

        output.clear_output()
        with output:
            display(self.view.rows_of(self.node.path))


class ReportView:
    """The widget tree of one report: `.widget` is the ipywidgets VBox to display.

    `.root` is the root `_NodeView`; `.expand_path(path)` opens the nodes down to a module.
    """

    def __init__(self, report):
        import ipywidgets as w

        self.report = report
        self.tree, self.culprit_at = build_tree(report)
        self._rows = None
        header = w.HTML(value=STYLE + header_html(report))
        header.add_class("ng-header-widget")
        if report.frames:
            self.root: Optional[_NodeView] = _NodeView(self, self.tree)
            tree_children = [self.root.box]
        else:
            self.root = None
            empty = w.HTML(value='<div class="ng-empty">no frames recorded</div>')
            tree_children = [empty]
        self.tree_box = w.VBox(tree_children)
        self.tree_box.add_class("ng-tree")
        self.widget = w.VBox([header, self.tree_box])
        self.widget.add_class("ng-report")
        self.widget.add_class("ng-widget")
        self.widget.add_class(f"ng-kind-{esc(report.kind)}")
        if self.root is not None:
            self.root.expand()
            culprit = report.frames[self.culprit_at] if self.culprit_at is not None else None
            if culprit is not None:
                self.expand_path(culprit.module_name)

    def expand_path(self, path: str) -> "_NodeView":
        """Open every node from the root down to `path`; returns that node's view."""
        view = self.root
        view.expand()
        if not path:
            return view
        for part in path.split("."):
            view = view.children[part]
            view.expand()
        return view

    def rows_of(self, path: str):
        """`report.to_frame()` rows of one module (computed once, on first use)."""
        if self._rows is None:
            self._rows = self.report.to_frame()
        frame = self._rows
        return frame[frame["module_name"] == path]

    def _repr_mimebundle_(self, include=None, exclude=None):
        return report_bundle(self.report, view=self)


def report_bundle(report, widget: Optional[bool] = None, view: Optional[ReportView] = None) -> dict:
    """The mimebundle of a report: widget view (when `widget`), static HTML, and text.

    `widget=None` decides with `use_widgets()`. The HTML and text are always there, so a frontend
    without the widget manager shows the same tree without JavaScript.
    """
    data = {"text/plain": report.to_text(), "text/html": report_html(report)}
    if widget is None:
        widget = view is not None or use_widgets()
    if widget:
        if view is None:
            view = ReportView(report)
        data[WIDGET_MIME] = {"version_major": 2, "version_minor": 0, "model_id": view.widget.model_id}
    return data


def display_report(report, widget: Optional[bool] = None) -> Optional[ReportView]:
    """Display a report in the notebook (widget + HTML fallback + text); returns the view if any."""
    from IPython.display import display

    if widget is None:
        widget = use_widgets()
    view = ReportView(report) if widget else None
    display(report_bundle(report, widget=bool(view), view=view), raw=True)
    return view

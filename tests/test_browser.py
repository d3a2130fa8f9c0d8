"""End to end: the quickstart notebook run in JupyterLab, in headless Chromium.

A JupyterLab server (127.0.0.1, free port, token, temp root dir holding a copy of
notebooks/01_quickstart.ipynb, isolated config/data/settings dirs) starts a fresh kernel; the
page runs all cells from the Run menu, waits for the kernel to be idle, saves the notebook, and
checks what a person would see:

- the report is the ipywidgets tree (not the widget's text or HTML fallback, no widget error),
- the path to the culprit is expanded and highlighted, the culprit's tensor table shows the
  non-finite row,
- clicking a collapsed node expands it and shows its tensor table (and collapses it again),
- without a widget manager (the executed notebook exported by nbconvert's HTMLExporter without
  the widget view), the static `<details>` tree shows the same culprit and a `<summary>` click
  expands a node.

Screenshots, the page's console and JupyterLab's log go to pytest's temp dir (browser0/artifacts
under the run's basetemp, printed at the end of the module; pytest keeps the last three runs),
and to docs/tree.png when NUMGUARD_README_SCREENSHOT is set.
Needs Debian's chromium at /usr/bin/chromium and `pip install jupyterlab playwright nbconvert`:
scripts/install_browser_deps.sh installs them. Without them the test is skipped, except in CI
(CI set and not 0/false), where the test runs that script itself and fails loudly if anything
is still missing (NUMGUARD_INSTALL_BROWSER_DEPS=1 does the same outside CI).

    bash scripts/install_browser_deps.sh && python -m pytest -q -m browser tests/test_browser.py

"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from browser_support import (
    REPO,
    JupyterLabServer,
    element_screenshot,
    launch_browser,
    require_tools,
    run_all_cells,
    save_notebook,
    wait_kernel_idle,
)

pytestmark = pytest.mark.browser

NOTEBOOK = Path(os.environ.get("NUMGUARD_BROWSER_NOTEBOOK", REPO / "notebooks" / "01_quickstart.ipynb"))
README_SHOT = REPO / "docs" / "tree.png"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
OPENED, CLOSED = "\u25be", "\u25b8"

# What a page shows when the widget manager is missing or failed instead of the widget.
WIDGET_FAILURE_TEXTS = ("Loading widget", "Error displaying widget", "model not found",
                        "Failed to load model class", "A Jupyter widget could not be displayed")


def _log(message: str) -> None:
    print(f"[browser {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The server's root and home and Chromium's profile; only artifacts/ is kept afterwards."""
    require_tools(_log)
    path = tmp_path_factory.mktemp("browser")
    try:
        yield path
    finally:
        for child in path.iterdir():
            if child.name != "artifacts":
                shutil.rmtree(child, ignore_errors=True)


@pytest.fixture(scope="module")
def artifacts(workdir):
    """Where the screenshots and logs go, for a person to look at after the run."""
    path = workdir / "artifacts"
    path.mkdir()
    yield path
    _log(f"screenshots and logs: {path}")


@pytest.fixture(scope="module")
def lab(workdir, artifacts):
    assert NOTEBOOK.is_file(), f"{NOTEBOOK} is missing"
    root = workdir / "root"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    server = JupyterLabServer(root, workdir / "home")
    started = time.monotonic()
    try:
        server.start()
        _log(f"JupyterLab up on port {server.port} in {time.monotonic() - started:.1f}s")
        yield server
    finally:
        server.stop()
        if server.log_path.exists():
            shutil.copy(server.log_path, artifacts / "browser-jupyterlab.log")


@pytest.fixture(scope="module")
def browser(workdir):
    from playwright.sync_api import sync_playwright

    playwright = sync_playwright().start()
    context = None
    try:
        context = launch_browser(playwright, workdir / "chromium-profile")
        context.set_default_timeout(30_000)
        yield context
    finally:
        if context is not None:
            context.close()
        playwright.stop()


class Session:
    """The notebook page after Run All, and what was learnt along the way."""

    def __init__(self, page, notebook_json: dict, errors: list, console: list):
        self.page = page
        self.notebook = notebook_json
        self.page_errors = errors
        self.console = console


@pytest.fixture(scope="module")
def session(lab, browser, artifacts):
    from playwright.sync_api import Error as PlaywrightError

    page = browser.new_page()
    errors, console = [], []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
    started = time.monotonic()
    try:
        page.goto(lab.url(f"lab/tree/{NOTEBOOK.name}"))
        page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=90_000)
        wait_kernel_idle(page)
        _log(f"notebook open, kernel idle after {time.monotonic() - started:.1f}s")
        state = run_all_cells(page, log=_log)
        _log(f"ran {state['executed']} code cells; kernel idle after {time.monotonic() - started:.1f}s")
        try:
            page.wait_for_selector(".ng-report.ng-widget .ng-node.ng-root", state="visible", timeout=45_000)
        except PlaywrightError:
            raise AssertionError(f"no report widget rendered after Run All: {_what_shows(page)}") from None
        saved = save_notebook(page, lab.root_dir / NOTEBOOK.name)
        yield Session(page, saved, errors, console)
    finally:
        try:  # the whole notebook: JupyterLab scrolls inside its panel, so grow the viewport
            height = page.evaluate(
                "() => { const n = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer')"
                " || document.querySelector('.jp-NotebookPanel .jp-Notebook');"
                " return n ? n.scrollHeight - n.clientHeight : 0; }"
            )
            if height > 0:
                page.set_viewport_size({"width": page.viewport_size["width"],
                                        "height": min(page.viewport_size["height"] + height + 50, 16000)})
                page.evaluate(
                    "() => document.querySelectorAll('.jp-NotebookPanel .jp-WindowedPanel-outer')"
                    ".forEach(n => { n.scrollTop = 0; })"
                )
                page.wait_for_timeout(500)
            page.screenshot(path=str(artifacts / "browser-notebook.png"))
        except PlaywrightError as exc:  # the page may be gone; the test reports the real failure
            _log(f"no final screenshot: {exc}")
        (artifacts / "browser-console.log").write_text(
            "\n".join(console + [f"pageerror: {e}" for e in errors]) + "\n"
        )
        page.close()


def _what_shows(page) -> str:
    """What the page shows instead of the widget (for a failure message)."""
    return page.evaluate(
        """(failures) => {
          const static_ = document.querySelectorAll('.ng-report:not(.ng-widget)').length;
          const widgets = document.querySelectorAll('.ng-report.ng-widget').length;
          const text = (document.querySelector('.jp-Notebook') || document.body).innerText;
          const seen = failures.filter(t => text.includes(t));
          return `${widgets} widget report(s), ${static_} static HTML report(s)`
            + (static_ ? ' (the widget manager did not render the widget view)' : '')
            + (seen.length ? `; the page shows ${seen.join(', ')}` : '');
        }""",
        list(WIDGET_FAILURE_TEXTS),
    )


# ---- what the executed notebook says the culprit is ------------------------------------------
def _outputs(notebook: dict):
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] == "code":
            for output in cell.get("outputs", []):
                yield index, cell, output


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


_CULPRIT_RE = re.compile(r'<details class="[^"]*\bng-culprit-node\b[^"]*"[^>]*data-path="([^"]*)"')


def _culprit_path(notebook: dict) -> str:
    """The culprit's dotted module path, from the static HTML (`ng-culprit-node`) that the first
    report with a culprit carries beside its widget view in the saved notebook."""
    for _index, _cell, output in _outputs(notebook):
        data = output.get("data", {})
        if WIDGET_MIME in data:
            found = _CULPRIT_RE.search(_text(data.get("text/html")))
            if found:
                return found.group(1)
    raise AssertionError("no report widget with a culprit among the saved notebook's outputs")


# ---- in the page -----------------------------------------------------------------------------
def _first_widget_report(page):
    """The first report widget of the page that names a culprit (the first %%numguard cell's)."""
    return page.locator(".ng-report.ng-widget").filter(has=page.locator(".ng-culprit-node")).first


def _toggle_label(node) -> str:
    text = node.locator(":scope > .ng-node-head .ng-toggle").inner_text().strip()
    return text.lstrip(OPENED + CLOSED).strip()


def _background(locator) -> str:
    return locator.evaluate("e => getComputedStyle(e).backgroundColor")


def test_notebook_runs_and_shows_the_report_widget(session, artifacts):
    page, notebook = session.page, session.notebook
    # every error output belongs to a cell that is meant to raise
    for index, cell, output in _outputs(notebook):
        if output["output_type"] == "error":
            tags = cell.get("metadata", {}).get("tags", [])
            assert "raises-exception" in tags, (
                f"cell {index} raised {output['ename']}: {output['evalue']}"
            )
    assert not session.page_errors, f"uncaught errors in the page: {session.page_errors}"

    report = _first_widget_report(page)
    assert report.is_visible()
    # the widget view, not a fallback: the output area renders the widget mime type, holds no
    # static <details> tree and no plain-text report, and no widget error / placeholder is shown
    output = report.locator("xpath=ancestor::div[contains(@class, 'jp-OutputArea-output')][1]")
    assert output.get_attribute("data-mime-type") in (None, WIDGET_MIME)
    output_classes = output.get_attribute("class").split()
    assert "jp-RenderedHTMLCommon" not in output_classes and "jp-RenderedText" not in output_classes
    assert "jupyter-widgets" in report.get_attribute("class").split()  # made by the widget manager
    assert output.locator("details.ng-node").count() == 0
    assert "Detected inf/nan during batch_number" not in output.inner_text()
    outputs_text = page.locator(".jp-Notebook").inner_text()
    for text in WIDGET_FAILURE_TEXTS:
        assert text not in outputs_text, f"the page shows {text!r}"
    assert report.locator(".ng-header-widget .ng-summary").is_visible()
    # every report the notebook displayed is a rendered widget in the page
    saved_reports = [
        output for _i, _c, output in _outputs(notebook)
        if WIDGET_MIME in output.get("data", {}) and "ng-report" in _text(output["data"].get("text/html"))
    ]
    assert saved_reports, "the saved notebook holds no report widget output"
    assert page.locator(".ng-report.ng-widget").count() == len(saved_reports)
    assert report.locator(".ng-tree > .ng-node.ng-root").count() == 1

    element_screenshot(page, report, artifacts / "browser-tree.png")
    if os.environ.get("NUMGUARD_README_SCREENSHOT"):
        element_screenshot(page, report, README_SHOT)
        _log(f"README screenshot: {README_SHOT}")


def test_path_to_culprit_is_expanded_and_highlighted(session):
    page = session.page
    culprit = _culprit_path(session.notebook)
    report = _first_widget_report(page)
    header = report.locator(".ng-header-widget .ng-path code").first
    assert culprit in header.inner_text()

    node = report.locator(".ng-node.ng-culprit-node")
    assert node.count() == 1, "the widget marks one culprit node"
    assert "ng-open" in node.get_attribute("class")
    toggle = node.locator(":scope > .ng-node-head .ng-toggle")
    assert toggle.is_visible()
    assert toggle.inner_text().strip().startswith(OPENED)
    assert node.locator(":scope > .ng-node-head .ng-badge-culprit").is_visible()

    # every node from the root down to it is open, marked .ng-culprit, and named by the path
    chain = node.evaluate(
        "n => { const out = []; for (let e = n; e && !e.classList.contains('ng-tree'); e = e.parentElement)"
        " if (e.classList.contains('ng-node')) out.unshift(Array.from(e.classList)); return out; }"
    )
    assert "ng-root" in chain[0]
    for classes in chain:
        assert "ng-culprit" in classes and "ng-open" in classes, classes
    labels = report.locator(".ng-node.ng-culprit").evaluate_all(
        "nodes => nodes.map(n => n.querySelector(':scope > .ng-node-head .ng-toggle').innerText.trim())"
    )
    parts = culprit.split(".") if culprit else []
    assert [label.lstrip(OPENED + CLOSED).strip() for label in labels[1:]] == parts
    assert all(label.startswith(OPENED) for label in labels)

    # the culprit's own frames: its tensor table, with the non-finite row
    frames = node.locator(":scope > .ng-body > .ng-frames")
    assert frames.locator(".ng-culprit-frame").first.is_visible()
    table = frames.locator(".ng-culprit-frame table.ng-tensors").first
    assert table.is_visible()
    assert table.locator("tr.ng-row.ng-nonfinite").count() >= 1

    # highlighted: the culprit and its ancestors stand out from the nodes off the path
    off_path = report.locator(".ng-node:not(.ng-culprit) > .ng-node-head .ng-toggle").first
    assert off_path.is_visible()
    plain = _background(off_path)
    assert _background(toggle) != plain
    ancestor = report.locator(".ng-node.ng-culprit:not(.ng-culprit-node) > .ng-node-head .ng-toggle").last
    assert _background(ancestor) != plain
    assert _background(ancestor) != _background(toggle)

    toggle.scroll_into_view_if_needed()
    assert toggle.is_visible()


def test_clicking_a_collapsed_node_expands_it_and_shows_its_tensor_table(session, artifacts):
    page = session.page
    report = _first_widget_report(page)
    # a collapsed node that was called (so it has frames): a sibling on the culprit's way first
    candidates = report.locator(".ng-node.ng-culprit > .ng-body > .ng-node:not(.ng-open)")
    called = candidates.filter(has=page.locator(":scope > .ng-node-head .ng-info", has_text=re.compile(r"\d+ calls?\b")))
    assert called.count() >= 1, "no collapsed module with calls next to the culprit's path"
    # pin it (a locator is re-evaluated: once open it would no longer match `:not(.ng-open)`)
    called.last.evaluate("n => n.setAttribute('data-test-picked', 'collapsed-node')")
    node = report.locator(".ng-node[data-test-picked='collapsed-node']")
    name = _toggle_label(node)
    toggle = node.locator(":scope > .ng-node-head .ng-toggle")
    body = node.locator(":scope > .ng-body")
    toggle.scroll_into_view_if_needed()
    assert toggle.inner_text().strip().startswith(CLOSED)
    assert not body.is_visible()

    toggle.click()
    page.wait_for_function(
        "n => n.classList.contains('ng-open')", arg=node.element_handle(), timeout=15_000
    )
    table = body.locator(":scope > .ng-frames table.ng-tensors").first
    table.wait_for(state="visible", timeout=15_000)
    assert toggle.inner_text().strip().startswith(OPENED)
    assert table.locator("tr.ng-row").count() >= 1
    assert name
    element_screenshot(page, node, artifacts / "browser-tree-expanded.png")

    # its rows as a DataFrame, in the Output widget under it
    button = body.locator(":scope > .ng-df-button")
    if button.count():
        button.click()
        body.locator(":scope > .ng-df-output table").first.wait_for(state="visible", timeout=15_000)

    # and a second click collapses it
    toggle.click()
    page.wait_for_function(
        "n => !n.classList.contains('ng-open')", arg=node.element_handle(), timeout=15_000
    )
    body.wait_for(state="hidden", timeout=15_000)
    assert toggle.inner_text().strip().startswith(CLOSED)
    assert not session.page_errors, f"uncaught errors in the page: {session.page_errors}"


def test_static_html_fallback_without_widgets(session, browser, artifacts):
    """The executed notebook exported by nbconvert, where no widget manager runs: `<details>`."""
    import nbformat
    from nbconvert import HTMLExporter

    culprit = _culprit_path(session.notebook)
    notebook = nbformat.reads(json.dumps(session.notebook), as_version=4)
    notebook.metadata.pop("widgets", None)  # no saved widget state: widgets are unavailable
    exporter = HTMLExporter()
    priority = [m for m in exporter.config.NbConvertBase.display_data_priority if m != WIDGET_MIME]
    exporter = HTMLExporter(config={"NbConvertBase": {"display_data_priority": priority}})
    body, _resources = exporter.from_notebook_node(notebook)
    exported = artifacts / "browser-exported.html"
    exported.write_text(body, encoding="utf-8")

    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(exported.as_uri(), wait_until="load")
        report = page.locator(".ng-report").first
        report.wait_for(state="visible", timeout=15_000)
        assert page.locator(".ng-widget").count() == 0
        assert culprit in report.locator(".ng-header .ng-path code").first.inner_text()

        node = report.locator(f'details.ng-culprit-node[data-path="{culprit}"]')
        assert node.count() == 1
        assert node.get_attribute("open") is not None
        summary_name = node.locator(":scope > summary .ng-name")
        assert summary_name.is_visible()
        assert summary_name.inner_text().strip() == (culprit.rsplit(".", 1)[-1] or summary_name.inner_text().strip())
        assert node.locator(":scope > .ng-body > .ng-frame.ng-culprit-frame table.ng-tensors tr.ng-nonfinite").first.is_visible()
        # highlighted: the culprit's summary stands out from a module off the path
        off_path = report.locator("details.ng-node:not(.ng-culprit) > summary").first
        assert _background(node.locator(":scope > summary")) != _background(off_path)
        # the way down is open
        opened = node.evaluate(
            "n => { const out = []; for (let e = n; e; e = e.parentElement)"
            " if (e.tagName === 'DETAILS') out.push(e.open); return out; }"
        )
        assert all(opened), opened

        # a closed module with calls opens on a click on its <summary>, and closes on another
        closed = report.locator("details.ng-culprit > .ng-body > details.ng-node:not([open])").filter(
            has=page.locator(":scope > summary .ng-info", has_text=re.compile(r"\d+ calls?\b"))
        ).last
        assert closed.count() == 1
        closed.evaluate("n => n.setAttribute('data-test-picked', 'closed-details')")
        closed = report.locator("details[data-test-picked='closed-details']")
        table = closed.locator(":scope > .ng-body > .ng-frame table.ng-tensors").first
        assert not table.is_visible()
        summary = closed.locator(":scope > summary")
        summary.scroll_into_view_if_needed()
        summary.click()
        table.wait_for(state="visible", timeout=5_000)
        assert closed.get_attribute("open") is not None
        assert table.locator("tr.ng-row").count() >= 1
        element_screenshot(page, report, artifacts / "browser-static-html.png")
        summary.click()
        table.wait_for(state="hidden", timeout=5_000)
        assert closed.get_attribute("open") is None
        assert not errors, errors
    finally:
        page.close()

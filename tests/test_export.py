"""What a reader of an exported notebook meets, and what a person running it still gets.

nbconvert's HTML export picks, for each output, the first mime type of its
`display_data_priority` that the output holds, the widget view first, but skips a widget view
whose model's state the notebook does not hold (nbclient saves that state by default); the
widget view then needs the widget manager's script from a CDN. JupyterLab renders the widget view
for a trusted output (its renderer ranks above HTML) and the HTML for an untrusted one.

So the report's mimebundle carries the widget view only where a person's frontend runs the
kernel (`render.widget.use_widgets`: the request allows stdin), and a headless run (nbclient,
`jupyter nbconvert --execute`) keeps the static tree and the text: exported with nbconvert's
defaults and opened without network, the page shows the tree.
"""

from __future__ import annotations

import time

import nbformat
import pytest
from browser_support import launch_browser, require_tools
from notebook_support import (  # noqa: F401 (fixtures)
    WIDGET_MIME, python3_kernel, reports, run_notebook,
)

CULPRIT = "encoder.block.1.layer.1.DenseReluDense.wo"  # notebooks/01_quickstart.ipynb's

# A float16 Linear whose output overflows 65504 on its first call.
SETUP = """
%load_ext numguard_nb
import torch
from torch import nn
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).half()
with torch.no_grad():
    net[0].weight.fill_(1.0)
x = torch.full((3, 4), 3e4).half()
"""
GUARDED_CELL = "%%numguard net\nnet(x).float().sum().backward()"


def _log(message: str) -> None:
    print(f"[export {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- the export ------------------------------------------------------------------------------
@pytest.fixture
def offline_page(tmp_path):
    """A page of headless Chromium with the network off (only file:// loads)."""
    require_tools(_log)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = launch_browser(playwright, tmp_path / "chromium-profile")
        context.set_offline(True)
        try:
            page = context.new_page()
            yield page
        finally:
            context.close()


def test_an_exported_notebook_shows_the_report_tree_offline(run_notebook, offline_page, tmp_path):
    from nbconvert import HTMLExporter

    notebook = run_notebook("01_quickstart.ipynb")  # nbclient, default settings
    executed = tmp_path / "01_quickstart.ipynb"
    nbformat.write(notebook, executed)
    body, _ = HTMLExporter().from_filename(str(executed))  # `jupyter nbconvert --to html`
    exported = tmp_path / "01_quickstart.html"
    exported.write_text(body, encoding="utf-8")

    page = offline_page
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(exported.as_uri(), wait_until="load")
    report = page.locator(".jp-OutputArea-output .ng-report").first
    report.wait_for(state="visible", timeout=15_000)
    assert CULPRIT in report.locator(".ng-header .ng-path code").inner_text()
    # the tree, open down to the culprit, names it
    node = report.locator(f'.ng-tree details.ng-culprit-node[data-path="{CULPRIT}"]')
    assert node.get_attribute("open") is not None
    name = node.locator(":scope > summary .ng-name")
    assert name.is_visible() and name.inner_text().strip() == CULPRIT.rsplit(".", 1)[-1]
    assert node.locator(":scope > .ng-body > .ng-culprit-frame tr.ng-nonfinite").first.is_visible()
    # every report of the notebook is there, none waits for a widget manager
    shown = sum(len(reports(cell)) for cell in notebook.cells if cell.cell_type == "code")
    assert shown == 1 and page.locator(".ng-report").count() == shown
    assert page.locator(".ng-headroom").count() == 1  # the --limit-dtype cell's headroom view
    assert page.locator('script[type="application/vnd.jupyter.widget-view+json"]').count() == 0
    assert not errors, errors


# ---- a live kernel ---------------------------------------------------------------------------
def _displayed(client, code: str, allow_stdin: bool) -> list:
    """The mimebundles the kernel sent (display_data, execute_result) while running `code`."""
    bundles = []

    def collect(msg):
        if msg["msg_type"] in ("display_data", "execute_result"):
            bundles.append(msg["content"]["data"])

    reply = client.execute_interactive(code, allow_stdin=allow_stdin, output_hook=collect, timeout=120)
    assert reply["content"]["status"] in ("ok", "error"), reply["content"]
    return bundles


def test_a_person_s_frontend_gets_the_widget_a_headless_run_the_static_tree(python3_kernel, tmp_path):
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name=python3_kernel, cwd=str(tmp_path))
    try:
        assert _displayed(client, SETUP, allow_stdin=True) == []
        # as JupyterLab, Notebook, VS Code and Colab send it: the frontend answers input()
        for code in (GUARDED_CELL, "_numguard"):
            (bundle,) = _displayed(client, code, allow_stdin=True)
            assert set(bundle) == {WIDGET_MIME, "text/html", "text/plain"}, code
            assert 'class="ng-report' in bundle["text/html"]
        # as nbclient (nbconvert --execute, papermill) sends it
        for code in (GUARDED_CELL, "_numguard"):
            (bundle,) = _displayed(client, code, allow_stdin=False)
            assert set(bundle) == {"text/html", "text/plain"}, code
            assert 'data-path="0"' in bundle["text/html"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)

"""Helpers for tests/test_browser.py and tests/test_export.py: a throw-away JupyterLab server and
headless Chromium.

Nothing here touches the user's Jupyter setup: the server gets its own root dir, config,
data, runtime, settings and workspaces dirs (all under one temp dir), listens on 127.0.0.1 on
a free port with a random token, and is killed (with its kernels) by `JupyterLabServer.stop`.
Chromium is Debian's /usr/bin/chromium driven by the `playwright` package (its own browser
download is not used), with a fresh user-data dir.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

CHROMIUM = os.environ.get("NUMGUARD_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--disable-quic",
]
REPO = Path(__file__).resolve().parents[1]


def missing_tools() -> list[str]:
    """What the browser test needs and cannot find (empty when everything is there)."""
    missing = []
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    for module, package in (
        ("playwright.sync_api", "playwright"),
        ("jupyterlab", "jupyterlab"),
        ("nbconvert", "nbconvert"),
        ("ipywidgets", "ipywidgets"),
        ("ipykernel", "ipykernel"),
        ("jupyterlab_widgets", "jupyterlab_widgets"),  # the widget manager of JupyterLab 4
    ):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"python package {package}")
    return missing


def install_tools(timeout: float = 900.0) -> tuple[int, str]:
    """Run scripts/install_browser_deps.sh for this interpreter; (exit code, output tail)."""
    env = dict(os.environ, PYTHON=sys.executable)
    try:
        done = subprocess.run(
            ["bash", str(REPO / "scripts" / "install_browser_deps.sh")], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            timeout=timeout, check=False,
        )
    except subprocess.TimeoutExpired as exc:
        return 124, (exc.stdout or b"").decode(errors="replace")[-4000:]
    importlib.invalidate_caches()
    return done.returncode, done.stdout.decode(errors="replace")[-4000:]


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def require_tools(log=print) -> None:
    """Skip the calling test without Chromium/JupyterLab/Playwright, except in CI: there (or with
    NUMGUARD_INSTALL_BROWSER_DEPS=1) install them with scripts/install_browser_deps.sh, and
    fail loudly if they are still missing."""
    import pytest

    missing = missing_tools()
    if not missing:
        return
    in_ci = _flag("CI")
    detail = ""
    if in_ci or _flag("NUMGUARD_INSTALL_BROWSER_DEPS"):
        log("missing " + "; ".join(missing) + ": running scripts/install_browser_deps.sh")
        code, output = install_tools()
        missing = missing_tools()
        if not missing:
            return
        detail = f"\nscripts/install_browser_deps.sh exited {code}:\n{output}"
    message = ("the browser test needs " + "; ".join(missing)
               + " -- run scripts/install_browser_deps.sh" + detail)
    if in_ci:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# JupyterLab user settings that keep toasts and pop-ups off the page under test.
_LAB_SETTINGS = {
    # "Would you like to get notified about official Jupyter news?" and update checks
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True,
    },
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none",  # render every cell, not only the ones in view
    },
}


class JupyterLabServer:
    """`jupyter lab` on 127.0.0.1:<free port> serving `root_dir`, isolated under `home`."""

    def __init__(self, root_dir: Path, home: Path, startup_timeout: float = 90.0):
        self.root_dir = Path(root_dir)
        self.home = Path(home)
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = self.home / "jupyterlab.log"
        self._log = None
        self._port_tries = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base_url}/{path.lstrip('/')}{sep}token={self.token}"

    def _env(self) -> dict:
        env = dict(os.environ)
        dirs = {
            "JUPYTER_CONFIG_DIR": "config",
            "JUPYTER_DATA_DIR": "data",
            "JUPYTER_RUNTIME_DIR": "runtime",
            "JUPYTERLAB_SETTINGS_DIR": "lab-settings",
            "JUPYTERLAB_WORKSPACES_DIR": "lab-workspaces",
            "IPYTHONDIR": "ipython",
        }
        for var, name in dirs.items():
            path = self.home / name
            path.mkdir(parents=True, exist_ok=True)
            env[var] = str(path)
        env["JUPYTER_PLATFORM_DIRS"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        # the kernel imports numguard_nb from this checkout even when it is not pip-installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.pop("JUPYTER_PREFER_ENV_PATH", None)
        settings = self.home / "lab-settings"
        for rel, value in _LAB_SETTINGS.items():
            target = settings / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(value))
        return env

    def start(self) -> JupyterLabServer:
        env = self._env()
        cmd = [
            sys.executable, "-m", "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root_dir}",
            "--ServerApp.open_browser=False",
            "--ServerApp.allow_remote_access=False",
            # no "a newer JupyterLab is out" / news fetch: nothing leaves the machine
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--ServerApp.terminals_enabled=False",
            # window.jupyterapp: lets the test read the kernel status instead of guessing from the DOM
            "--LabApp.expose_app_in_browser=True",
            # the extension manager would query PyPI: read-only, no network
            "--LabApp.extension_manager=readonly",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")  # CI and containers run as root
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            cmd, cwd=str(self.root_dir), env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                log = self.log_tail()
                if "already in use" in log and self._port_tries < 3:  # lost the free port: again
                    self._port_tries += 1
                    self._log.close()
                    self.port = free_port()
                    return self.start()
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n{log}")
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=5) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not answer in {self.startup_timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.3)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Shut the server down (its kernels with it), then kill whatever of it is left:
        its process group, and any process it started (kernels run in their own session)."""
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        spawned = _descendants(proc.pid)
        if proc.poll() is None:
            try:
                req = urllib.request.Request(self.url("api/shutdown"), method="POST")
                urllib.request.urlopen(req, timeout=5).close()
            except (urllib.error.URLError, OSError):
                pass  # not answering: killed below
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        spawned |= _descendants(proc.pid)
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.wait(timeout=10)
        for pid, started in spawned:  # only processes this server started, by pid
            _kill_if_same(pid, started)
        if self._log is not None:
            self._log.close()
            self._log = None


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, ..., starttime at [19])."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _descendants(pid: int) -> set[tuple[int, str]]:
    """(pid, start time) of every live descendant of `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[tuple[int, str]]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        fields = _proc_stat(int(entry)) if entry.isdigit() else None
        if fields and len(fields) > 19:
            children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    found: set[tuple[int, str]] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child[0])
    return found


def _kill_if_same(pid: int, started: str) -> None:
    """SIGKILL `pid` only if it is still the process seen before (same start time)."""
    fields = _proc_stat(pid)
    if fields and len(fields) > 19 and fields[19] == started:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# Any http(s) request that does not go to this machine (an exported page's CDN scripts, fonts):
# aborted at once, so nothing leaves the machine and nothing waits on a network that is not there.
_OFF_MACHINE = re.compile(r"^(https?|wss?)://(?!(127\.0\.0\.1|localhost)(:\d+)?/)")


def launch_browser(playwright, user_data_dir: Path, viewport=(1400, 1000)):
    """Headless Debian Chromium with a fresh profile; returns a Playwright BrowserContext."""
    context = playwright.chromium.launch_persistent_context(
        str(user_data_dir),
        executable_path=CHROMIUM,
        headless=True,
        args=CHROMIUM_ARGS,
        viewport={"width": viewport[0], "height": viewport[1]},
        device_scale_factor=1,
    )
    context.route(_OFF_MACHINE, lambda route: route.abort())
    return context


# ---- driving a JupyterLab notebook page ------------------------------------------------------
# The state of the notebook in the main area, read through window.jupyterapp
# (--LabApp.expose_app_in_browser): kernel status, which code cells ran, which are running.
_NOTEBOOK_STATE_JS = """() => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  if (!panel || !panel.content || !panel.sessionContext) return null;
  const session = panel.sessionContext.session;
  const kernel = session && session.kernel;
  const cells = panel.content.widgets;
  let total = 0, executed = 0, running = 0, firstUnexecuted = -1;
  cells.forEach((cell, index) => {
    if (cell.model.type !== 'code' || !cell.model.sharedModel.getSource().trim()) return;
    total += 1;
    const prompt = cell.node.querySelector('.jp-InputArea-prompt');
    if (prompt && prompt.textContent.includes('*')) running += 1;
    if (cell.model.executionCount !== null && cell.model.executionCount !== undefined) executed += 1;
    else if (firstUnexecuted < 0) firstUnexecuted = index;
  });
  return {
    kernel: kernel ? kernel.status : null,
    dirty: panel.context ? panel.context.model.dirty : null,
    total, executed, running, firstUnexecuted,
  };
}"""


def notebook_state(page) -> dict | None:
    return page.evaluate(_NOTEBOOK_STATE_JS)


def wait_kernel_idle(page, timeout: float = 90.0) -> None:
    page.wait_for_function(
        "() => { const p = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
        " const k = p && p.sessionContext && p.sessionContext.session && p.sessionContext.session.kernel;"
        " return !!k && k.status === 'idle'; }",
        timeout=timeout * 1000,
    )


def menu(page, top: str, item: str) -> None:
    """Click a JupyterLab main-menu entry, e.g. menu(page, "Run", "Run All Cells")."""
    page.locator(".lm-MenuBar-itemLabel").get_by_text(top, exact=True).click()
    page.locator(".lm-Menu-content .lm-Menu-itemLabel").get_by_text(item, exact=True).click()


def run_all_cells(page, timeout: float = 300.0, log=print) -> dict:
    """Run > Run All Cells, and wait until every non-empty code cell has run and the kernel is idle.

    A cell that raises stops "Run All" unless it is tagged `raises-exception`; when the kernel
    is idle and cells below are left unrun, the run goes on from the first of them
    (Run > Run Selected Cell and All Below), as a person would.
    """
    state = notebook_state(page)
    if state and state["executed"]:
        # a notebook saved with outputs: clear them, so "ran" means ran in this kernel
        menu(page, "Edit", "Clear Outputs of All Cells")
        deadline = time.monotonic() + 10
        while notebook_state(page)["executed"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert notebook_state(page)["executed"] == 0, "Clear Outputs of All Cells left execution counts"
    menu(page, "Run", "Run All Cells")
    deadline = time.monotonic() + timeout
    settled = 0
    resumed = 0
    state = None
    while time.monotonic() < deadline:
        state = notebook_state(page)
        quiet = state and state["kernel"] == "idle" and state["running"] == 0
        if quiet and state["executed"] == state["total"]:
            settled += 1
            if settled >= 3:  # idle and nothing queued for ~1.5 s: the run is over
                return state
        elif quiet and state["executed"] > 0:
            settled += 1
            if settled >= 4:
                if resumed > state["total"]:
                    raise AssertionError(f"cells keep stopping the run: {state}")
                resumed += 1
                log(f"run stopped before cell {state['firstUnexecuted']}; running it and all below")
                page.evaluate(
                    "(i) => { const p = window.jupyterapp.shell.currentWidget;"
                    " p.content.activeCellIndex = i; p.content.deselectAll(); }",
                    state["firstUnexecuted"],
                )
                menu(page, "Run", "Run Selected Cell and All Below")
                settled = 0
        else:
            settled = 0
        time.sleep(0.5)
    raise AssertionError(f"the notebook did not finish in {timeout:.0f}s: {state}")


def save_notebook(page, path: Path, timeout: float = 30.0) -> dict:
    """File > Save Notebook (Ctrl+S), and wait for the file to hold the outputs; returns its JSON."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + timeout
    tried_menu = False
    while time.monotonic() < deadline:
        state = notebook_state(page)
        if path.exists() and path.stat().st_mtime_ns != before and state and not state["dirty"]:
            try:
                return json.loads(path.read_text())
            except ValueError:  # caught mid-write
                pass
        if not tried_menu and time.monotonic() > deadline - timeout / 2:
            tried_menu = True
            menu(page, "File", "Save Notebook")
        time.sleep(0.3)
    raise AssertionError(f"the notebook was not saved to {path} in {timeout:.0f}s")


def element_screenshot(page, locator, path: Path, margin: int = 6) -> None:
    """Screenshot of one element, whole: the viewport grows to fit it (JupyterLab scrolls inside
    its notebook panel, so a tall element would be cut at the panel's edge), then shrinks back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    size = page.viewport_size
    box = locator.bounding_box()
    needed = int(box["height"]) + 400 if box else size["height"]
    if needed > size["height"]:
        page.set_viewport_size({"width": size["width"], "height": min(needed, 12000)})
        page.wait_for_timeout(400)
    try:
        locator.scroll_into_view_if_needed()
        page.wait_for_timeout(200)
        box = locator.bounding_box()
        if box is None:
            locator.screenshot(path=str(path))
        else:
            page.screenshot(path=str(path), clip={
                "x": max(box["x"] - margin, 0), "y": max(box["y"] - margin, 0),
                "width": box["width"] + 2 * margin, "height": box["height"] + 2 * margin,
            })
    finally:
        if needed > size["height"]:
            page.set_viewport_size(size)

"""Shared test set-up: the golden-file check, and skipping `cuda` tests where there is no GPU.

Golden files (tests/golden/) hold the exact text a view renders: the `golden(name, text)`
fixture compares `text` with tests/golden/<name>, byte for byte (a text view that ends without a
newline is passed with the newline its file ends with). They were written from the code's output
and read by hand; after an intended change of a view, rewrite them with

    NUMGUARD_UPDATE_GOLDEN=1 python -m pytest tests/test_report.py tests/test_render.py

and read the diff (git diff tests/golden) before committing it.
"""

import os
from pathlib import Path

import pytest
import torch

GOLDEN_DIR = Path(__file__).parent / "golden"
UPDATE_GOLDEN = os.environ.get("NUMGUARD_UPDATE_GOLDEN") == "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


def check_golden(name: str, text: str) -> None:
    """`text` is the content of tests/golden/<name> (rewritten first under NUMGUARD_UPDATE_GOLDEN=1)."""
    path = GOLDEN_DIR / name
    if UPDATE_GOLDEN:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(text.encode("utf-8"))
    assert path.exists(), f"{path} is missing: run with NUMGUARD_UPDATE_GOLDEN=1 once"
    expected = path.read_bytes().decode("utf-8")  # bytes: no newline translation on any platform
    assert text == expected, f"{name} differs from its golden file (NUMGUARD_UPDATE_GOLDEN=1 rewrites it)"


@pytest.fixture
def golden():
    """`golden(name, text)`: fail unless `text` is exactly tests/golden/<name>."""
    return check_golden


@pytest.fixture(scope="session")
def ipython():
    """The in-process IPython shell (IPython starts one per process: every test file shares it)."""
    from IPython.terminal.interactiveshell import TerminalInteractiveShell
    from IPython.testing.globalipapp import start_ipython

    start_ipython()  # returns None when a shell was started already
    return TerminalInteractiveShell.instance()


@pytest.fixture(scope="module")
def shell(ipython):
    """The IPython shell with the extension loaded, for one test file."""
    ipython.run_cell("%load_ext numguard_nb")
    yield ipython
    ipython.run_cell("%unload_ext numguard_nb")


@pytest.fixture
def deferred_on_host(monkeypatch):
    """CPU values read as a GPU's are (statistics as device rows, flags and the loss code's
    regions read later); `held[0]` True: the device has not finished them yet."""
    from numguard_nb import numerics, stats
    from numguard_nb.numerics import DeferredRead

    monkeypatch.setattr(numerics, "DEFERRED_DEVICE_TYPES", {"cpu", "cuda"})
    monkeypatch.setattr(stats, "CPU_READS_AT_ONCE", False)
    from numguard_nb.guard import outside_checks
    monkeypatch.setattr(outside_checks, "IMMEDIATE_DEVICES", frozenset())
    held = [True]
    real_ready = DeferredRead.ready
    monkeypatch.setattr(DeferredRead, "ready",
                        lambda self: not held[0] and real_ready(self) or self._values is not None)
    return held

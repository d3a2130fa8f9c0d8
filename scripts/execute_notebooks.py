"""Execute the example notebooks and keep their outputs, so that they read as run (GitHub,
nbviewer, an HTML export) and never go stale.

    python scripts/execute_notebooks.py            # run notebooks/*.ipynb, write them back
    python scripts/execute_notebooks.py 02_tracing.ipynb
    python scripts/execute_notebooks.py --check    # run them, compare with what is committed

Each notebook runs top to bottom in a fresh `python3` kernel importing this checkout, with nbclient
(as `jupyter nbconvert --execute` runs it: a headless run, so every report is its static tree and
its text, no widget), in a temporary working directory (03's replay bundle lands there, not in
notebooks/). What changes from run to run without meaning is not kept: the cells' execution
timing, widget state, the kernel's language_info beyond its name.

`--check` (and tests/test_notebooks.py) compares the meaningful parts of the outputs: the same
outputs in each cell, the same words (culprits, modules, verdicts), the same integers, and floats
within 5%; the visible text of HTML outputs, and which module the tree marks as the culprit.
"""

from __future__ import annotations

import argparse
import html
import math
import os
import re
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
TIMEOUT = 300  # seconds a cell may take
REL_TOL, ABS_TOL = 0.05, 1e-6

# Text that differs from run to run: replaced before comparing.
_VOLATILE = [
    (re.compile(r"[^\s'\"]*numguard_replay_[\w.-]*\.pt"), "<replay bundle>"),
    (re.compile(r"/[^\s'\"]*/ipykernel_\d+/\d+\.py"), "<cell file>"),
    (re.compile(r"<ipython-input-\d+-[0-9a-f]+>"), "<cell file>"),
    (re.compile(r"\b0x[0-9a-f]{6,}\b"), "0x<address>"),
    # Where the checkout and Python live differs between machines: keep the path inside them.
    (re.compile(r"/[^\s'\"]*/(numguard_nb/[^\s'\"]*\.py)"), r"\1"),
    (re.compile(r"/[^\s'\"]*/(site|dist)-packages/"), "<site-packages>/"),
]
# A number that is no part of a name (encoder.block.1 holds none).
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![\w.])")
_CULPRIT_NODE = re.compile(r'<details class="[^"]*\bng-culprit-node\b[^"]*"[^>]*data-path="([^"]*)"')


# ---- running ---------------------------------------------------------------------------------
def execute(path: Path, workdir: Path, kernel: str = "python3") -> nbformat.NotebookNode:
    """The notebook at `path` run top to bottom in a fresh kernel, in `workdir`."""
    notebook = nbformat.read(path, as_version=4)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(REPO) not in paths:  # the kernel imports this checkout
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO)] + paths))
    client = NotebookClient(notebook, kernel_name=kernel, timeout=TIMEOUT, record_timing=False,
                            resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return notebook


def clean(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Leave out what changes from run to run without meaning (in place; returned)."""
    notebook.metadata.pop("widgets", None)
    if "language_info" in notebook.metadata:
        notebook.metadata["language_info"] = {"name": notebook.metadata["language_info"].get("name", "python")}
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
    return notebook


# ---- comparing -------------------------------------------------------------------------------
def _visible(markup: str) -> str:
    """The text an HTML output shows (and its tooltips), without style sheets and markup."""
    markup = re.sub(r"<style\b.*?</style>", " ", markup, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", markup))


def _parts(text: str):
    """(the text with every number replaced by #, its words normalised; the numbers)."""
    for pattern, stand_in in _VOLATILE:
        text = pattern.sub(stand_in, text)
    numbers = _NUMBER.findall(text)
    skeleton = " ".join(_NUMBER.sub("#", text).split())
    return skeleton, numbers


def meaning(output) -> dict:
    """What an output says, by part: its kind, mime types, texts (as `_parts`), the culprit's node."""
    kind = output.output_type
    said = {"kind": kind}
    if kind == "stream":
        said[output.name] = _parts(output.text)
    elif kind == "error":
        said["error"] = _parts(f"{output.ename}: {output.evalue}")
    else:
        data = output.get("data", {})
        said["mime"] = sorted(data)
        if "text/plain" in data:
            said["text/plain"] = _parts(data["text/plain"])
        if "text/html" in data:
            said["text/html"] = _parts(_visible(data["text/html"]))
            said["culprit node"] = _CULPRIT_NODE.findall(data["text/html"])
    return said


def _same_number(a: str, b: str) -> bool:
    if not any(c in a + b for c in ".eE"):
        return a == b  # counts, batches, calls, lines: exactly
    return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=ABS_TOL)


def _differs(where: str, was: dict, now: dict) -> list:
    found = []
    for part in sorted(set(was) | set(now)):
        a, b = was.get(part), now.get(part)
        if isinstance(a, tuple) and isinstance(b, tuple):
            if a[0] != b[0]:
                found.append(f"{where} {part}: the text changed:\n    was: {a[0][:400]}\n    now: {b[0][:400]}")
            elif any(not _same_number(x, y) for x, y in zip(a[1], b[1])):
                pairs = [(x, y) for x, y in zip(a[1], b[1]) if not _same_number(x, y)]
                found.append(f"{where} {part}: numbers changed (was, now): {pairs[:8]}")
        elif a != b:
            found.append(f"{where} {part}: was {a!r}, now {b!r}")
    return found


def differences(committed: nbformat.NotebookNode, fresh: nbformat.NotebookNode) -> list:
    """How the outputs of a fresh run differ from the committed ones, in words (empty: the same)."""
    code = [[c for c in nb.cells if c.cell_type == "code"] for nb in (committed, fresh)]
    if [c.source for c in code[0]] != [c.source for c in code[1]]:
        return ["the code cells differ from the ones run"]
    found = []
    for number, (was, now) in enumerate(zip(*code)):
        where = f"code cell {number} ({was.source.splitlines()[0][:40]!r})" if was.source else f"code cell {number}"
        if was.get("execution_count") != now.get("execution_count"):
            found.append(f"{where}: execution count {was.get('execution_count')} vs {now.get('execution_count')}")
        if len(was.outputs) != len(now.outputs):
            found.append(f"{where}: {len(was.outputs)} outputs committed, {len(now.outputs)} now: "
                         f"{[o.output_type for o in was.outputs]} vs {[o.output_type for o in now.outputs]}")
            continue
        for index, (a, b) in enumerate(zip(was.outputs, now.outputs)):
            found.extend(_differs(f"{where} output {index}", meaning(a), meaning(b)))
    return found


# ---- the command -----------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NOTEBOOK",
                        help="notebooks/ file names (default: all)")
    parser.add_argument("--check", action="store_true",
                        help="compare a fresh run with the committed outputs; write nothing")
    parser.add_argument("--kernel", default="python3", help="kernel spec name (default python3)")
    args = parser.parse_args(argv)
    paths = [NOTEBOOKS / name for name in args.names] or sorted(NOTEBOOKS.glob("*.ipynb"))
    stale = 0
    for path in paths:
        with tempfile.TemporaryDirectory(prefix="numguard-notebook-") as workdir:
            fresh = clean(execute(path, Path(workdir), args.kernel))
        if args.check:
            found = differences(nbformat.read(path, as_version=4), fresh)
            stale += bool(found)
            print(f"{path.name}: " + ("stale:\n  " + "\n  ".join(found) if found else "up to date"))
        else:
            nbformat.write(fresh, path)
            print(f"{path.name}: executed, {path.stat().st_size // 1024} KiB")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

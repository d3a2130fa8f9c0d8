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

`--check` (and tests/test_notebooks.py) compares what the notebooks teach: the same outputs in each
cell, the same words (culprits, modules, ops, hints, verdicts, errors), the same integers, and
floats within 5%; the visible text of HTML outputs, and which module the tree marks as the
culprit. Not what a library says about its own code, which a new release of it changes while the
notebook teaches the same thing (`_INTERNALS`): line numbers in files other than the notebook's
cells, a library's frames in a traceback (only which package they are in is kept: the error they
end in is compared), the carets under a traceback's lines, the names of keyword arguments in a
frame dump (`input[past_key_values]`). The packages are those of constraints.txt (the lock file).
When a notebook is stale, each difference is shown in its context: the words that differ, or the
numbers beyond the tolerance, marked [like this].
"""

from __future__ import annotations

import argparse
import difflib
import html
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

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
    (re.compile(r"/[^\s'\"]*/lib/python\d+\.\d+/"), "<python>/"),
]
# What a library (Python, torch, transformers, numguard_nb itself) says about its own code, which
# a new release or an unrelated edit changes while the notebook teaches the same thing: where its
# code sits (line numbers), its frames in a traceback, how its modules name their forward's
# keyword arguments. Normalised before comparing; what is left is what the notebook teaches.
_CODE = r"(?:<site-packages>|<python>|numguard_nb)/[^\s:'\"]+"
_INTERNALS = [
    # Python 3.11+ underlines the expression of each traceback frame (^^^, ~~~), differently from
    # one Python to the next.
    (re.compile(r"^[ \t]*[\^~]+[ \t\^~]*(?:\n|$)", re.M), ""),
    # A library's frame in a traceback: which package, not its file, line, function or source line.
    (re.compile(r'^([ \t]*)File "(<site-packages>|<python>)/([^/"]+)[^"]*", line \d+, in [^\n]*\n'
                r"(?:[ \t]{3,}\S[^\n]*\n)?", re.M), r'\1File "\2/\3/..."' "\n"),
    # ... and one line for the package however many frames it takes.
    (re.compile(r'^([ \t]*File "[^"\n]*/\.\.\."\n)\1+', re.M), r"\1"),
    # Any other file's frame (numguard_nb's, Python's `<frozen ...>`): without its line number. A
    # cell's frames (IPython's "Cell In[3], line 11", `<cell file>`) keep theirs: that line is the
    # notebook's.
    (re.compile(r'(File "(?!<cell file>)[^"\n]*"), line \d+'), r"\1"),
    # A location `file.py:122` in a library (the `called from:` of a culprit): no line number.
    (re.compile(rf"({_CODE}\.py):\d+"), r"\1"),
    # A keyword argument's row (`input[past_key_values]`): its name is the module's forward's, a
    # library's in these notebooks. Positional ones (`input[0]`) keep their index.
    (re.compile(r"(?<![\w.])input\[[A-Za-z_]\w*\]"), "input[<keyword>]"),
]
# A number that is no part of a name (encoder.block.1 holds none), also one that ends a sentence
# ("weight 10.8.") or a ratio ("1.5x").
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?(?=x\b|[^\w.]|\.(?!\w)|$)")
_CULPRIT_NODE = re.compile(r'<details class="[^"]*\bng-culprit-node\b[^"]*"[^>]*data-path="([^"]*)"')
CONTEXT_WORDS = 8  # words shown either side of a difference
MOST_SHOWN = 4  # differences shown per output part


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


class Said(NamedTuple):
    """What a text says: its words with every number as #, the words as written (normalised), its
    numbers, and the word each number is in."""
    skeleton: tuple
    words: tuple
    numbers: tuple
    at: tuple


def taught(text: str) -> str:
    """The text without what changes from run to run or with a library's internals."""
    for pattern, stand_in in _VOLATILE + _INTERNALS:
        text = pattern.sub(stand_in, text)
    return text


def _parts(text: str) -> Said:
    """What `text` says (`taught`), word by word."""
    words = tuple(taught(text).split())
    skeleton, numbers, at = [], [], []
    for index, word in enumerate(words):
        found = _NUMBER.findall(word)
        numbers.extend(found)
        at.extend([index] * len(found))
        skeleton.append(_NUMBER.sub("#", word) if found else word)
    return Said(tuple(skeleton), words, tuple(numbers), tuple(at))


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


def _window(words: tuple, start: int, stop: int) -> str:
    """words[start:stop] marked [like this] (its middle left out when long), with CONTEXT_WORDS
    words either side."""
    marked = list(words[start:stop])
    if len(marked) > 3 * CONTEXT_WORDS:
        marked[CONTEXT_WORDS:-CONTEXT_WORDS] = [f"...({len(marked) - 2 * CONTEXT_WORDS} words)..."]
    before = words[max(0, start - CONTEXT_WORDS):start]
    after = words[stop:stop + CONTEXT_WORDS]
    return " ".join(["..." if start > CONTEXT_WORDS else "", *before, "[" + " ".join(marked) + "]",
                     *after, "..." if stop + CONTEXT_WORDS < len(words) else ""]).strip()


def _changed_text(was: Said, now: Said) -> str:
    """Where the words differ: each place in both texts, marked, in its context."""
    matcher = difflib.SequenceMatcher(None, was.skeleton, now.skeleton, autojunk=False)
    changes = [op for op in matcher.get_opcodes() if op[0] != "equal"]
    shown = []
    for _, i1, i2, j1, j2 in changes[:MOST_SHOWN]:
        shown.append(f"    at word {i1 + 1} of {len(was.words)}:\n"
                     f"      was: {_window(was.words, i1, i2)}\n"
                     f"      now: {_window(now.words, j1, j2)}")
    more = f"\n    ... and {len(changes) - MOST_SHOWN} more" if len(changes) > MOST_SHOWN else ""
    return f"the text changed in {len(changes)} place(s):\n" + "\n".join(shown) + more


def _changed_numbers(was: Said, now: Said) -> str:
    """The numbers beyond the tolerance, each in its context."""
    changed = [k for k, (x, y) in enumerate(zip(was.numbers, now.numbers)) if not _same_number(x, y)]
    shown = [f"    {was.numbers[k]} -> {now.numbers[k]}: {_window(now.words, now.at[k], now.at[k] + 1)}"
             for k in changed[:MOST_SHOWN]]
    more = f"\n    ... and {len(changed) - MOST_SHOWN} more" if len(changed) > MOST_SHOWN else ""
    return (f"{len(changed)} number(s) changed beyond {REL_TOL:.0%} (was -> now, in the fresh run's "
            f"words):\n" + "\n".join(shown) + more)


def _differs(where: str, was: dict, now: dict) -> list:
    found = []
    for part in sorted(set(was) | set(now)):
        a, b = was.get(part), now.get(part)
        if isinstance(a, Said) and isinstance(b, Said):
            if a.skeleton != b.skeleton:
                found.append(f"{where} {part}: {_changed_text(a, b)}")
            elif not all(_same_number(x, y) for x, y in zip(a.numbers, b.numbers)):
                found.append(f"{where} {part}: {_changed_numbers(a, b)}")
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

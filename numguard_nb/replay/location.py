"""Where an error is: the line that raised it, or the line of the user's code that made the call."""

from __future__ import annotations

import linecache
import os
import traceback
from dataclasses import dataclass
from typing import Optional

from .._util import code_where, is_internal_file, user_frame

# numguard_nb itself: its frames at the top of a replayed traceback are the replay's, not the user's.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

RAISED = "raised"  # a frame of the error
CALL_SITE = "call site"  # the line calling the module (an error raised inside torch's own code)

@dataclass
class Location:
    """A line of Python: where an exception was raised, or the line that made the call."""

    filename: str
    lineno: int
    line: str = ""
    function: str = ""
    kind: str = RAISED  # RAISED or CALL_SITE
    # How it was named where it was recorded ('Cell In[1], line 3'): a bundle loaded in a fresh
    # kernel, which does not know that cell's file, says it so
    named: str = ""

    @property
    def where(self) -> str:
        """'Cell In[5], line 11' in a notebook cell (as IPython says it), else 'path/file.py:11'."""
        return self.named or code_where(self.filename, self.lineno)

    def __str__(self) -> str:
        where = self.where + (f" in {self.function}" if self.function else "")
        return f"{where}: {self.line}" if self.line else where

    @classmethod
    def of(cls, filename, lineno, function="", kind=RAISED, line=None) -> "Location":
        if line is None:
            line = linecache.getline(filename, lineno).strip()
        return cls(filename=filename, lineno=int(lineno), line=line, function=function, kind=kind)


def cell_named(where: str) -> str:
    """`where` as a bundle recorded it, where it names a notebook cell ('Cell In[1], line 3'),
    else '': a fresh kernel cannot name that cell's file, a file path it can."""
    return where if where.startswith("Cell In[") else ""


def with_source_line(location: Optional[Location]) -> Optional[Location]:
    """`location` with its source line read from the file where it was left out (at capture time,
    reading it would cost every step)."""
    if location is not None and not location.line:
        location.line = linecache.getline(location.filename, location.lineno).strip()
    return location


def call_site() -> Optional[Location]:
    """The innermost frame outside torch and numguard_nb: the user's line that made the call
    (its source line is left out, to be read only when shown)."""
    frame = user_frame()
    if frame is None:
        return None
    return Location.of(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name, CALL_SITE, line="")


def error_location(exc: BaseException) -> Optional[Location]:
    """Innermost frame of the traceback in the user's or the model's code (not torch's)."""
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if not is_internal_file(frame.filename):
            found = frame
    if found is None:
        return None
    return Location.of(found.filename, found.lineno, found.name, RAISED, (found.line or "").strip())


def format_traceback(exc: BaseException) -> str:
    """The exception's traceback without numguard's own replay frames at its top."""
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))

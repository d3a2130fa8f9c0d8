"""Run a script as `__main__` (`python tests/exit_at_once.py SCRIPT ARGS...`) and leave with its
exit code at once, without the interpreter's teardown: there the C++ threads of gloo and of DDP's
reducer sometimes abort a process ("terminate called without an active exception", about one run
in 50 here) after the script has done and printed everything."""

from __future__ import annotations

import os
import runpy
import sys
import traceback


def main() -> int:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else int(done.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

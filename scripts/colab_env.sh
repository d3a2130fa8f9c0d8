#!/usr/bin/env bash
# Runs the notebook layer's tests under Colab's pins: IPython 7.34.0 and ipywidgets 7.7.1.
#
# A second, small virtual environment at .venv-colab (gitignored) holds torch (the CPU wheel),
# the two pins and what the selected tests need; the package itself is installed editable in the
# same pip resolve as the pins, so a requirement in pyproject.toml that Colab cannot meet fails
# the install instead of upgrading IPython or ipywidgets behind our back.
# The environment is reused when it is complete and was made for the same pins, Python and
# pyproject.toml (a stamp file, written last); anything else rebuilds it from scratch.
#
# Tests: the magics (an in-process IPython shell), the session, the views (ipywidgets), and the
# tracing notebook executed in a real kernel of this environment (the path where `use_widgets()`
# sees a kernel). Not the browser test (JupyterLab in Chromium), not the notebooks that need
# transformers. Exits non-zero when an install or a test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
VENV="$REPO/.venv-colab"
BASE_PYTHON="${PYTHON:-python}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

# torch is installed on its own, first and pinned: the CPU wheel; an unpinned torch would pull
# GBs of CUDA packages.
TORCH="torch==2.13.0"
PINS=("ipython==7.34.0" "ipywidgets==7.7.1")
TEST_DEPS=("pytest>=7" "pandas>=1.3" "nbclient>=0.7" "nbformat>=5")
TESTS=(
    tests/test_magics.py
    tests/test_session.py
    tests/test_render.py
    tests/test_magics_cells.py
    tests/test_headroom.py
    tests/test_notebooks.py::test_tracing_notebook_compares_the_batch_that_worked_with_the_one_that_failed
    tests/test_export.py::test_a_person_s_frontend_gets_the_widget_a_headless_run_the_static_tree
)

SPEC="$("$BASE_PYTHON" -c 'import sys; print(sys.version)')
$TORCH ${PINS[*]} ${TEST_DEPS[*]}
$REPO
$(sha256sum pyproject.toml)"
STAMP="$VENV/colab-env.complete"

# Kernel specs, IPython profiles: this environment's own, never the user's (a `python3` kernel
# spec there would start the main environment's IPython).
export JUPYTER_DATA_DIR="$VENV/share/jupyter" IPYTHONDIR="$VENV/ipython"
export JUPYTER_PREFER_ENV_PATH=1
# The editable install points the environment at this checkout; a PYTHONPATH would also show pip
# the checkout's numguard_nb.egg-info as an installed package.
unset PYTHONPATH
PY="$VENV/bin/python"

# The machine's pip config names a second local index that lacks most packages: pip warns about
# it once per package, which would bury anything worth reading.
pip_install() {
    "$PY" -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location 'file:.*' is ignored" || true; }
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$SPEC" ]; then
    echo "colab env: reusing $VENV"
else
    echo "colab env: creating $VENV"
    rm -rf "$VENV"
    "$BASE_PYTHON" -m venv "$VENV"
    pip_install "$TORCH"
    pip_install "${PINS[@]}" "${TEST_DEPS[@]}" -e .
    "$PY" -m pip check
    printf '%s' "$SPEC" >"$STAMP"
fi

"$PY" - "$REPO" "${PINS[@]}" <<'EOF'
import os
import sys
from importlib.metadata import version

import IPython, ipywidgets, numguard_nb, torch
from jupyter_client.kernelspec import KernelSpecManager

repo, pins = sys.argv[1], sys.argv[2:]
assert numguard_nb.__file__.startswith(repo + os.sep), f"numguard_nb from {numguard_nb.__file__}"
for pin in pins:
    name, wanted = pin.split("==")
    assert version(name) == wanted, f"{name} {version(name)} installed, {wanted} pinned"
assert not torch.version.cuda, "torch is a CUDA build"
# The notebook test starts the `python3` kernel: it must be this environment's Python
# (jupyter_client runs a spec's bare "python" as its own interpreter).
kernel = KernelSpecManager().get_kernel_spec("python3").argv[0]
assert kernel in ("python", sys.executable), f"the python3 kernel runs {kernel}"
print(f"colab env: Python {sys.version.split()[0]}, IPython {IPython.__version__}, "
      f"ipywidgets {ipywidgets.__version__}, torch {torch.__version__}, numguard_nb from "
      f"{numguard_nb.__file__}")
EOF

# ipywidgets 7 creates its comms through ipykernel's deprecated Comm class: one warning per widget.
"$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" \
    -W "ignore:The \`ipykernel.comm.Comm\` class has been deprecated:DeprecationWarning"

#!/usr/bin/env bash
# Installs what tests/test_browser.py (pytest marker `browser`) needs:
#   - Debian's Chromium at /usr/bin/chromium (Playwright's own browser download does not work here),
#   - JupyterLab, nbconvert and the Playwright driver (the Python package; no browser download).
# Idempotent; safe to run more than once. Needs root (or sudo) for apt-get.
# The Python packages are installed at the versions of the lock file, constraints.txt, as README's
# commands install everything else. torch is never touched: the pip step uses
# --upgrade-strategy only-if-needed, and none of these packages depends on torch.
# PYTHON=... names the environment's interpreter (default: `python`).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi

if [ ! -x /usr/bin/chromium ]; then
    $SUDO apt-get update -qq
    # fonts-liberation: readable text in screenshots (Chromium falls back to it for sans-serif).
    $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null
fi
/usr/bin/chromium --version

PY="${PYTHON:-python}"
"$PY" -m pip install -q --upgrade-strategy only-if-needed -c "$REPO/constraints.txt" \
    "jupyterlab==4.6.6" \
    "nbconvert>=7.16,<8" \
    "playwright==1.65.2"
"$PY" -c "import jupyterlab, playwright, nbconvert; print('jupyterlab', jupyterlab.__version__, '| nbconvert', nbconvert.__version__)"

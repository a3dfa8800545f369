#!/bin/sh
# Build the hivemind baseline's own virtual environment (default bench/.venv-hivemind).
# Usage: bench/hivemind/setup.sh [VENV_DIR]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:-"$here/../.venv-hivemind"}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --upgrade pip
# torch first and alone, so hivemind's own torch requirement is already satisfied by the CPU build
"$venv/bin/pip" install --quiet torch==2.13.0
"$venv/bin/pip" install --quiet -r "$here/requirements.txt"
"$venv/bin/python" -c "import hivemind, torch; print('hivemind', hivemind.__version__, 'torch', torch.__version__)"

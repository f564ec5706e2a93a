#!/usr/bin/env bash
# One-shot set-up for a fresh Debian/Ubuntu machine (root or sudo) or any Linux with Python >= 3.10:
#   * the offline Fashion-MNIST package, when apt is available;
#   * a virtual environment in .venv with ssl_vit installed in editable mode, plus its test extra.
# Re-running it is cheap: it skips what is already done (a stamp records the setup.py it installed).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${SSL_VIT_VENV:-.venv}
PYTHON=${PYTHON:-python3}

if command -v apt-get >/dev/null 2>&1 && ! dpkg -s dataset-fashion-mnist >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
    if [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; then
        echo "[setup] installing the Debian package dataset-fashion-mnist (offline Fashion-MNIST)"
        $SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
            || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null; } \
            || echo "[setup] could not install dataset-fashion-mnist; ssl_vit will use torchvision's download instead"
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

STAMP="$VENV/.ssl_vit-installed"
WANT=$(cat setup.py tools/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi

PIP="$VENV/bin/python -m pip"
# Pin the torch pair on Linux x86_64 + CPython 3.11: these releases are known to work together
# (a torchvision built for another torch fails at import). Elsewhere `pip install -e .` picks them.
PYVER=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ "$(uname -s)" = Linux ] && [ "$(uname -m)" = x86_64 ] && [ "$PYVER" = 3.11 ]; then
    echo "[setup] installing torch==2.14.1 torchvision==0.29.1"
    $PIP install -q "torch==2.14.1" "torchvision==0.29.1"
fi
echo "[setup] installing ssl_vit and its test extra"
$PIP install -q -e ".[test]"
echo "$WANT" > "$STAMP"

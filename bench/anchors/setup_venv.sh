#!/usr/bin/env bash
# The anchors' Python, set up the way a person would: a virtual environment with the current
# PyTorch and JAX from PyPI, used on CPU only (PyPI's Linux torch wheel brings NVIDIA's CUDA
# libraries along, a few GB; they stay unused here). Idempotent; prints the interpreter's path
# last, for `py=$(bench/anchors/setup_venv.sh | tail -1)`.
#   bench/anchors/setup_venv.sh [VENV_DIR]      (default: $ANCHOR_VENV or ~/.cache/replica-anchors)
set -euo pipefail
venv="${1:-${ANCHOR_VENV:-$HOME/.cache/replica-anchors}}"
base="${ANCHOR_BASE_PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "# creating $venv (PyTorch and JAX from PyPI)" >&2
  "$base" -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch, jax, numpy" 2>/dev/null; then
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q torch jax numpy >&2
fi
"$venv/bin/python" -c "import torch, jax; print('# anchors: torch', torch.__version__, '| jax', jax.__version__)" >&2
echo "$venv/bin/python"

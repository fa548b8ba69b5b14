#!/usr/bin/env bash
# Prepare .whl/: the pure-Python wheels scripts/gpu_check.py may need on the GPU machine, whose Python
# 3.12 has torch but no hydra-core, omegaconf or antlr4-python3-runtime and no registry to install from.
#
# The device run itself needs none of them when results/runner_checks/gpu_check/plan.json is current
# (its specs are rebuilt from the plan's dataclasses: no harness module imports Hydra at import time);
# they are the fallback that lets `gpu_check.py` compose the points there when the plan is stale.
# submitit and hydra-submitit-launcher are not carried: gpu_check never imports them.
#
# Versions: constraints.txt's pins. antlr4-python3-runtime is only an sdist on PyPI: its wheel is built
# here (pure Python, py3-none-any). The set is then installed into a scratch --target with
# `pip install --no-index --no-deps` and imported from there as a smoke test.
#
# Usage (repository root or anywhere): bash scripts/gpu_wheels.sh   [PYTHON=path/to/python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
WHL=.whl
PACKAGES=(hydra-core omegaconf antlr4-python3-runtime)

pin() {  # NAME -> NAME==VERSION from constraints.txt (case-insensitive)
    local line
    line=$(grep -i -m1 "^$1==" constraints.txt) || { echo "no pin for $1 in constraints.txt" >&2; exit 1; }
    printf '%s\n' "$line"
}

rm -rf "$WHL"
mkdir -p "$WHL"
for name in hydra-core omegaconf; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
        --abi none --platform any -d "$WHL" "$(pin "$name")"
done
"$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$WHL" "$(pin antlr4-python3-runtime)"

# Pure Python only: anything else would not install on the other machine's interpreter.
for f in "$WHL"/*.whl; do
    case "$f" in
        *-py3-none-any.whl | *-py2.py3-none-any.whl) ;;
        *) echo "not a pure-Python wheel: $f" >&2; exit 1 ;;
    esac
done
[ "$(ls "$WHL"/*.whl | wc -l)" -eq "${#PACKAGES[@]}" ] || { echo "expected ${#PACKAGES[@]} wheels" >&2; exit 1; }

# Smoke test: install as the device command does and import from the target directory.
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHL"/*.whl
PYTHONPATH="$site" "$PY" - "$site" <<'EOF'
import sys
from pathlib import Path

site = Path(sys.argv[1]).resolve()
import antlr4, hydra, omegaconf  # noqa: E401

for module in (hydra, omegaconf, antlr4):
    where = Path(module.__file__).resolve()
    assert site in where.parents, f"{module.__name__} imported from {where}, not the target directory"
print(f"imports from the target directory: hydra {hydra.__version__}, omegaconf {omegaconf.__version__}, antlr4")
EOF
ls -l "$WHL"
du -sh "$WHL"

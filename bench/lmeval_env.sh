#!/usr/bin/env bash
# Creates the separate environment with lm-evaluation-harness that bench/lmeval_check.py drives
# against a `pagedrl serve` process (lm-eval's API clients need no torch; it stays out of .venv).
#   bash bench/lmeval_env.sh [VENV]        # default: /work/.lmeval (or $LMEVAL_VENV)
set -euo pipefail
venv="${1:-${LMEVAL_VENV:-/work/.lmeval}}"
if [ -x "$venv/bin/lm_eval" ]; then
    echo "$venv: lm-eval is already installed"
    exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q "lm-eval[api]==0.4.13"
"$venv/bin/lm_eval" --help > /dev/null && echo "$venv: lm-eval 0.4.13"

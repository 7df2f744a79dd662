#!/usr/bin/env bash
# Creates the separate environment with TRL 1.12.0, whose trl.experimental.ppo.PPOTrainer the PPO
# benchmarks compare against (the project's own environment has a TRL without it).
#   bash bench/trl112_env.sh [VENV]        # default: /work/.trl112 (or $TRL112_VENV)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-${TRL112_VENV:-/work/.trl112}}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import trl, sys; sys.exit(trl.__version__ != '1.12.0')" 2>/dev/null; then
    echo "$venv: TRL 1.12.0 is already installed"
    exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q -c "$here/trl112_constraints.txt" torch trl transformers accelerate datasets
"$venv/bin/python" -c "import trl, transformers, torch; from trl.experimental.ppo import PPOTrainer; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"

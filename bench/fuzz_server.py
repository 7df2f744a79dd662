"""Schemathesis against a real `pagedrl serve`: requests generated from the served `/openapi.json`.

Every schemathesis check runs (no 5xx, responses and error bodies that match the declared schemas
and content types, statuses the schema declares, ...) except `positive_data_acceptance`: the schema
states each field's type and range, but some rules relate fields to each other or to the model and
cannot be said in it (exactly one of `prompt` / `messages` on /tokenize, `best_of` equal to `n`, a
null content only for an assistant turn, token ids within the vocabulary), so a schema-valid body can
still be a correct 400. The server runs a tiny random model (tests/tiny_train.py) built in a
temporary folder. Exits with schemathesis' status (0: nothing found).

    .venv/bin/python bench/fuzz_server.py [--max-examples 60] [--model DIR]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_server import launch_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: a tiny random model")
    p.add_argument("--max-examples", type=int, default=60, help="generated requests per operation and phase")
    args = p.parse_args()
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    if st is None:
        print("schemathesis is not installed (pip install -e '.[test]')", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tiny_train import build_model_dir

            model = str(build_model_dir(Path(tmp) / "tiny"))
        log = Path(tmp) / "server.log"
        proc, url = launch_server([model, "--kv-cache-tokens", "4096", "--enable-auto-tool-choice"], log)
        try:
            rc = subprocess.call([st, "run", f"{url}/openapi.json", "--checks", "all", "--exclude-checks",
                                  "positive_data_acceptance", "--max-examples", str(args.max_examples),
                                  "--workers", "1", "--request-timeout", "60"], cwd=tmp)  # its cache stays out
        finally:
            proc.send_signal(signal.SIGTERM)
            server_rc = proc.wait(timeout=120)
        text = log.read_text()
        if server_rc != 0 or "Traceback" in text:
            print(f"the server exited with {server_rc}:\n{text[-4000:]}", file=sys.stderr)
            return 1
    print(f"command: .venv/bin/python bench/fuzz_server.py {' '.join(sys.argv[1:])}\nschemathesis exit status: {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())

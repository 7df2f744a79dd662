"""Schemathesis against a real `pagedrl serve`: requests generated from the served `/openapi.json`.

Every schemathesis check runs (no 5xx, responses and error bodies that match the declared schemas
and content types, statuses the schema declares, schema-invalid bodies refused) except, unless
`--all-checks`, `positive_data_acceptance` (schema-valid bodies accepted). The schema states the rules
between fields it can (exactly one of `prompt` / `messages` on /tokenize, a null content or tool
calls only on an assistant turn, `tool_choice` only with tools, `max_tokens` 0 only with `echo`,
token ids within the served vocabulary, non-empty grammars and choices) and leaves out the fields
that are refused whatever their value (`suffix`, `logit_bias`, `best_of`, the whitespace patterns).
What JSON Schema cannot state stays a correct 400 for a schema-valid body, and is all that
`--all-checks` finds: a named `tool_choice` must name one of the request's own tools; a grammar,
regex or JSON schema must compile; a prompt must fit the model's context (the tiny random model,
tests/tiny_train.py built in a temporary folder, gets a 2,048-token context to make that rare while
a request without max_tokens stays short). The server runs with `--enable-auto-tool-choice`. Exits
with schemathesis' status (0: nothing found).

    .venv/bin/python bench/fuzz_server.py [--max-examples 60] [--model DIR] [--all-checks]
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
    p.add_argument("--all-checks", action="store_true", help="also positive_data_acceptance (see above)")
    args = p.parse_args()
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    if st is None:
        print("schemathesis is not installed (pip install -e '.[test]')", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tiny_train import build_model_dir

            model = str(build_model_dir(Path(tmp) / "tiny", max_position_embeddings=2048))
        log = Path(tmp) / "server.log"
        proc, url = launch_server([model, "--kv-cache-tokens", "16384", "--enable-auto-tool-choice"], log)
        try:
            excluded = [] if args.all_checks else ["--exclude-checks", "positive_data_acceptance"]
            rc = subprocess.call([st, "run", f"{url}/openapi.json", "--checks", "all", *excluded,
                                  "--max-examples", str(args.max_examples),
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

"""A real `pagedrl serve` process on 127.0.0.1 for the server tests: started on a free port, ready when
/health answers, stopped with SIGTERM, and required to exit with status 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from pagedrl.kernels import ops

STARTUP_TIMEOUT_S = 90.0
SHUTDOWN_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pagedrl_command() -> list[str]:
    """The installed console script next to this interpreter, else the module."""
    script = Path(sys.executable).parent / "pagedrl"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pagedrl.cli"]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    api_key: str | None = None  # its --api-key, which /metrics asks for

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """The /metrics samples without labels' model_name, e.g. {'pagedrl:num_requests_running': 0.0,
        'pagedrl:request_success_total{finished_reason="abort"}': 3.0}."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        text = httpx.get(self.base_url + "/metrics", headers=headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, value = line.rsplit(" ", 1)
            if "{" in name:
                base, labels = name.split("{", 1)
                kept = [kv for kv in labels.rstrip("}").split(",") if not kv.startswith("model_name=")]
                name = base + ("{" + ",".join(kept) + "}" if kept else "")
            out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """The metrics once no request runs or waits (aborts are applied between engine steps)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["pagedrl:num_requests_running"] == 0 and m["pagedrl:num_requests_waiting"] == 0:
                return m
            assert time.monotonic() < deadline, f"engine still busy: {m}"
            time.sleep(0.05)

    def stop(self) -> int:
        """SIGTERM and wait; the exit status (0 = clean)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)


@contextmanager
def running_server(model_dir: Path, log_dir: Path, *args: str) -> Iterator[ServerProcess]:
    # The CPU kernels built (once a session, into its cache) before the server starts, which then
    # loads them: a build inside the server, on a loaded machine, could outlast STARTUP_TIMEOUT_S.
    ops.available()
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [*pagedrl_command(), "serve", str(model_dir), "--port", str(port), "--no-access-log", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    api_key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path, api_key)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"pagedrl serve exited with {proc.returncode}:\n{server.log()}")
            try:
                if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"pagedrl serve did not become healthy:\n{server.log()}")
            time.sleep(0.1)
        yield server
    finally:
        if proc.poll() is None:
            try:
                server.stop()
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, f"pagedrl serve exited with {proc.returncode}:\n{server.log()[-4000:]}"


def assert_serves_the_engines_text(model_dir: Path, log_dir: Path, prompt: str = "the cat sat",
                                   kv_cache_tokens: int = 1024, max_tokens: int = 8) -> str:
    """`pagedrl serve` on `model_dir` answers the OpenAI client's greedy completion of `prompt` with the
    offline engine's text on the same folder, and counts its `max_tokens` tokens; returns the server's log
    (its start-up lines)."""
    import openai

    from pagedrl.engine.llm import LLM
    from pagedrl.engine.sampling_params import SamplingParams
    from pagedrl.model.loader import load_model

    loaded = load_model(str(model_dir), device="cpu")
    offline = LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids,
                              kv_cache_tokens=kv_cache_tokens)
    ref = offline.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].text
    with running_server(model_dir, log_dir, "--kv-cache-tokens", str(kv_cache_tokens)) as server:
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            reply = client.completions.create(model=client.models.list().data[0].id, prompt=prompt,
                                              max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
        assert reply.choices[0].text == ref and reply.usage.completion_tokens == max_tokens
        return server.log()

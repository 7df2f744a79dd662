"""The OpenAI server against the offline engine, on the same requests in one run.

1. offline: `LLM.generate` on all the prompts at once (greedy, `ignore_eos`, so every request makes
   exactly `--max-tokens` tokens);
2. server: a real `pagedrl serve` process with the same engine settings, loaded by `--concurrency`
   streaming clients (`/v1/completions`, `stream=true`), each sending its next request as soon as
   the last one ended.
Both use `max_num_seqs = --concurrency`: the server can never batch more than its clients keep in
flight, and the offline engine is held to the same batch size so that the ratio measures the
server's cost (HTTP, JSON, event loop, thread hand-off), not a difference in batch size.

The offline run happens in a worker thread by default, because the server's engine loop runs in
one: on a CPU with more runnable threads than cores, torch's OpenMP team of the main thread can be
several times slower than that of a worker thread (measured on the shared 2-core machine: 5.3 vs 17.5
tokens/s for one SmolLM2 sequence), and the ratio would then measure that, not the server.
`--offline-main-thread` measures the main-thread figure instead.

Prints requests/s and output tokens/s of both, the server's time to first token and inter-token
latency (p50/p99, as its clients see them) and the ratio server/offline of output tokens/s (goal
>= 0.8), as a Markdown block for bench/RESULTS.md.

    .venv/bin/python bench/bench_server.py [--num-requests 128] [--concurrency 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagedrl.model.precision import choose_precision

TOPICS = ["the sea", "mountains", "a small cat", "the moon", "bread", "trains", "winter", "a library",
          "rivers", "honey bees", "old maps", "the desert", "a violin", "clouds", "gardens", "chess"]


def make_prompts(n: int) -> list[str]:
    return [f"Request {i}: write one sentence about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class RequestRecord:
    start: float
    end: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    tokens: int = 0


# ---------------------------------------------------------------------------- offline
class Offline:
    """`LLM.generate` on the prompts; by default in a worker thread, as the server's engine loop runs."""

    def __init__(self, args: argparse.Namespace, prompts: list[str]) -> None:
        from pagedrl.engine.llm import LLM
        from pagedrl.engine.sampling_params import SamplingParams

        self.args, self.prompts = args, prompts
        self.llm = LLM(args.model, kv_cache_tokens=args.kv_cache_tokens, max_num_seqs=args.concurrency)
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        self.warmup = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def run(self) -> dict[str, float]:
        result: dict[str, float] = {}

        def generate() -> None:
            self.llm.generate(self.prompts[:2], self.warmup, use_tqdm=False)
            t0 = time.perf_counter()
            outputs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
            result["elapsed"] = time.perf_counter() - t0
            result["tokens"] = sum(len(o.outputs[0].token_ids) for o in outputs)

        if self.args.offline_main_thread:
            generate()
        else:
            worker = threading.Thread(target=generate)
            worker.start()
            worker.join()
        return {**result, "req_s": len(self.prompts) / result["elapsed"], "tok_s": result["tokens"] / result["elapsed"]}


# ---------------------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(serve_args: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """`pagedrl serve <serve_args>` on a free port, its output in `log_path`; returns once /health answers."""
    port = free_port()
    script = Path(sys.executable).parent / "pagedrl"
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "pagedrl.cli"]
    cmd += ["serve", *serve_args, "--port", str(port), "--no-access-log", "--log-level", "warning"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start:\n{log_path.read_text()}")
        time.sleep(0.2)


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    serve_args = [*([args.model] if args.model else []), "--max-num-seqs", str(args.concurrency)]
    if args.kv_cache_tokens:
        serve_args += ["--kv-cache-tokens", str(args.kv_cache_tokens)]
    return launch_server(serve_args, log_path)


async def stream_one(client: httpx.AsyncClient, body: dict) -> RequestRecord:
    rec = RequestRecord(start=time.perf_counter())
    last = rec.start
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if chunk.get("choices"):
                if rec.ttft is None:
                    rec.ttft = now - rec.start
                else:
                    rec.itls.append(now - last)
                last = now
            if chunk.get("usage"):
                rec.tokens = chunk["usage"]["completion_tokens"]
    rec.end = time.perf_counter()
    return rec


async def load(url: str, model: str, prompts: list[str], args: argparse.Namespace) -> tuple[list[RequestRecord], float]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)

    def body(prompt: str) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(None)) as client:
        await asyncio.gather(*(stream_one(client, body(p)) for p in prompts[:2]))  # warm-up

        async def client_loop() -> None:
            while not queue.empty():
                records.append(await stream_one(client, body(queue.get_nowait())))

        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))
        return records, time.perf_counter() - t0


def server_round(url: str, model: str, prompts: list[str], args: argparse.Namespace) -> dict[str, float]:
    records, elapsed = asyncio.run(load(url, model, prompts, args))
    tokens = sum(r.tokens for r in records)
    ttfts = [r.ttft for r in records if r.ttft is not None]
    itls = [x for r in records for x in r.itls]
    return {"elapsed": elapsed, "tokens": tokens, "req_s": len(records) / elapsed, "tok_s": tokens / elapsed,
            "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "itl_p50": percentile(itls, 50), "itl_p99": percentile(itls, 99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded smollm2-135m-instruct")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="alternating offline/server rounds; the best of each counts")
    p.add_argument("--kv-cache-tokens", type=int, default=8192,
                   help="both engines' KV cache (enough for every request in flight: no preemption)")
    p.add_argument("--offline-main-thread", action="store_true",
                   help="run LLM.generate in the main thread instead of a worker thread like the server's")
    args = p.parse_args()
    prompts = make_prompts(args.num_requests)
    offline = Offline(args, prompts)
    rounds: list[tuple[dict, dict, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        proc, url = start_server(args, log)
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            for i in range(args.rounds):
                off = offline.run()
                srv = server_round(url, model, prompts, args)
                if srv["tokens"] != off["tokens"]:
                    raise RuntimeError(f"the server made {srv['tokens']} tokens, the offline engine {off['tokens']}")
                rounds.append((off, srv, os.getloadavg()[0]))
                print(f"round {i + 1}: offline {off['tok_s']:.1f} tokens/s, server {srv['tok_s']:.1f} tokens/s, "
                      f"load {rounds[-1][2]:.2f}", file=sys.stderr)
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=120)
        if rc != 0:
            raise RuntimeError(f"the server exited with {rc}:\n{log.read_text()}")
    off = max((r[0] for r in rounds), key=lambda r: r["tok_s"])
    srv = max((r[1] for r in rounds), key=lambda r: r["tok_s"])
    ratio = srv["tok_s"] / off["tok_s"]
    per_round = "; ".join(f"{o['tok_s']:.1f} / {s['tok_s']:.1f} (load {load:.1f})" for o, s, load in rounds)
    where = "main thread" if args.offline_main_thread else "worker thread"
    print(f"""
command: {' '.join(['.venv/bin/python', 'bench/bench_server.py', *sys.argv[1:]])}
workload: {args.num_requests} requests, {args.concurrency} concurrent streaming clients, {args.max_tokens} output tokens each (greedy, ignore_eos), model {args.model or 'smollm2-135m-instruct'} in the default precision ({choose_precision('cpu').describe()}, both sides), KV cache {args.kv_cache_tokens} tokens, max_num_seqs {args.concurrency}; {os.cpu_count()} CPUs
rounds (offline / server output tokens/s, 1-min load average after): {per_round}; best of each below

| | requests/s | output tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |
|---|---|---|---|---|---|---|
| `LLM.generate` (offline, {where}) | {off['req_s']:.3f} | {off['tok_s']:.1f} | | | | |
| `pagedrl serve` ({args.concurrency} clients) | {srv['req_s']:.3f} | {srv['tok_s']:.1f} | {srv['ttft_p50']:.2f} s | {srv['ttft_p99']:.2f} s | {srv['itl_p50'] * 1000:.0f} ms | {srv['itl_p99'] * 1000:.0f} ms |

server / offline output tokens/s: **{ratio:.2f}** (goal >= 0.8)
""")


if __name__ == "__main__":
    main()

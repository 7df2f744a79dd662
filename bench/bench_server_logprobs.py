"""Streaming long answers with log-probs, and a short request next to them, on a real `pagedrl serve`.

1. one stream of `--max-tokens` (1,800) tokens on `/v1/completions`, without log-probs and with
   `logprobs=5`: the ratio with/without (goal <= 1.5). Per-step output work must follow the step's
   new tokens; rebuilding every earlier log-prob entry each step made this quadratic in the length.
2. a short request (`--short-tokens`, not streamed) alone, then again and again while eight such
   log-prob streams run, from their start to their end: the ratio of its median latency next to them
   over alone (goal <= 2), i.e. one client cannot starve others.

Greedy, `ignore_eos`, so every stream makes exactly `--max-tokens` tokens. The default model is a tiny
random one (2 layers, hidden 64, context 2,048, built in a temporary folder) because SmolLM2 on the
2-core CPU would need minutes per 1,800-token stream; with a tiny model a decode step costs ~2 ms, so
the server's per-token Python work (output building, JSON, the event loop) weighs the most, which is
what this benchmark measures. `--model` runs it on any other.

`--engine-only` runs part 2's workload in this process on the engine itself, with no server, no HTTP
and no client process: a short request alone, then one after another while the eight streams (DELTA
outputs with `logprobs=5`, as the server asks for them) decode. What it prints is the floor the
server's ratio stands on, on this machine and model: how much slower a step is with eight long
contexts in it than with one short one.

    .venv/bin/python bench/bench_server_logprobs.py [--model DIR] [--max-tokens 1800] [--streams 8] [--engine-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from bench_server import launch_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

PROMPT = "the cat sat on the mat"


def start_server(model: str, kv_cache_tokens: int, log_path: Path) -> tuple:
    return launch_server([model, "--kv-cache-tokens", str(kv_cache_tokens)], log_path)


async def stream(client: httpx.AsyncClient, max_tokens: int, logprobs: int | None,
                 started: asyncio.Event | None = None) -> tuple[float, int]:
    """Seconds for one whole stream, and the log-prob entries received (checked against the tokens)."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if logprobs is not None:
        body["logprobs"] = logprobs
    t0 = time.perf_counter()
    entries = tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                if started is not None and not started.is_set():
                    started.set()
                if c.get("logprobs"):
                    entries += len(c["logprobs"]["tokens"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if tokens != max_tokens or (logprobs is not None and entries != tokens):
        raise RuntimeError(f"stream made {tokens} tokens and {entries} log-prob entries, expected {max_tokens}")
    return time.perf_counter() - t0, tokens


async def short(client: httpx.AsyncClient, tokens: int) -> float:
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": tokens,
                                                   "temperature": 0.0, "ignore_eos": True})
    if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != tokens:
        raise RuntimeError(f"short request failed: {r.status_code} {r.text[:200]}")
    return time.perf_counter() - t0


def run_streams(url: str, n: int, max_tokens: int, started: Any, done: Any, result: Any) -> None:
    """In its own process: `n` log-prob streams at once; `started` once each sent a chunk, then the
    seconds until all ended into `result`."""

    async def main() -> float:
        events = [asyncio.Event() for _ in range(n)]
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None)) as client:
            t0 = time.perf_counter()
            tasks = [asyncio.ensure_future(stream(client, max_tokens, 5, e)) for e in events]
            await asyncio.gather(*(e.wait() for e in events))
            started.set()
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            done.set()
            await asyncio.gather(*tasks)
            return time.perf_counter() - t0

    try:
        result.put(asyncio.run(main()))
    finally:
        started.set()
        done.set()


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def note(what: str, value: float) -> None:
    """Each figure as soon as it is measured (a slow run still leaves what it got)."""
    print(f"{what}: {value:.3f} s", file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process has used: on a shared machine it varies far less with the
    other jobs' load than wall time does."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def timed_stream(client: httpx.AsyncClient, pid: int, max_tokens: int, logprobs: int | None) -> tuple:
    cpu = cpu_seconds(pid)
    wall, _ = await stream(client, max_tokens, logprobs)
    return wall, cpu_seconds(pid) - cpu


async def measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None)) as client:
        await stream(client, 32, 5)  # warm-up
        plain, with_lp = [], []
        for _ in range(args.repeats):  # interleaved, so a change in the machine's load hits both alike
            plain.append(await timed_stream(client, pid, args.max_tokens, None))
            with_lp.append(await timed_stream(client, pid, args.max_tokens, 5))
        out["plain_s"], out["plain_cpu"] = min(plain)
        out["logprobs_s"], out["logprobs_cpu"] = min(with_lp)
        note("one stream without log-probs", out["plain_s"])
        note("one stream with logprobs=5", out["logprobs_s"])
        alone = [await short(client, args.short_tokens) for _ in range(args.short_repeats)]
        note("short request alone", out.setdefault("short_alone_s", statistics.median(alone)))
        # The long streams' client is another process, as other users' clients are: parsing their chunks
        # must not delay this process's short requests.
        ctx = multiprocessing.get_context("spawn")
        started, done, result = ctx.Event(), ctx.Event(), ctx.Queue()
        streams = ctx.Process(target=run_streams, args=(url, args.streams, args.max_tokens, started, done, result))
        streams.start()
        started.wait()
        beside = []
        while not done.is_set():  # spread over the streams' whole life, late steps included
            beside.append(await short(client, args.short_tokens))
            await asyncio.sleep(args.short_gap)
        out["short_beside_s"] = statistics.median(beside)
        out["short_beside_n"] = len(beside)
        note(f"short request beside {args.streams} streams", out["short_beside_s"])
        streams.join()
        if streams.exitcode != 0:
            raise RuntimeError(f"the streams' client failed with exit code {streams.exitcode}")
        out["streams_s"] = result.get(timeout=10)
        note(f"{args.streams} streams", out["streams_s"])
    return out


def engine_floor(model: str, args: argparse.Namespace) -> dict[str, float]:
    """Part 2 on the engine in this process: the short request's seconds alone and beside the streams."""
    from pagedrl import LLM, SamplingParams
    from pagedrl.engine.sampling_params import RequestOutputKind

    engine = LLM(model, kv_cache_tokens=args.kv_cache_tokens).engine
    delta = RequestOutputKind.DELTA
    short_params = SamplingParams(max_tokens=args.short_tokens, temperature=0.0, ignore_eos=True, output_kind=delta)
    short_ids = engine.encode("hello there")

    def alone() -> float:
        engine.add_request(short_ids, short_params)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t0

    alone_s = statistics.median([alone() for _ in range(args.short_repeats)])
    note("engine only: short request alone", alone_s)
    stream_params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=5,
                                   output_kind=delta)
    for _ in range(args.streams):
        engine.add_request(engine.encode(PROMPT), stream_params)
    beside: list[float] = []
    short_id, started, steps = None, 0.0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        if short_id is None and len(engine.requests) == args.streams:  # the streams are still running
            short_id, started = engine.add_request(short_ids, short_params), time.perf_counter()
        for out in engine.step():
            if out.request_id == short_id and out.finished:
                beside.append(time.perf_counter() - started)
                short_id = None
        steps += 1
    streams_s = time.perf_counter() - t0
    return {"short_alone_s": alone_s, "short_beside_s": statistics.median(beside), "short_beside_n": len(beside),
            "streams_s": streams_s, "step_ms": 1000 * streams_s / steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: a tiny random model with a 2,048-token context")
    p.add_argument("--max-tokens", type=int, default=1800)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--short-tokens", type=int, default=4)
    p.add_argument("--short-repeats", type=int, default=9, help="short requests alone (the median counts)")
    p.add_argument("--short-gap", type=float, default=0.25,
                   help="pause between short requests beside the streams, which go on until a stream ends")
    p.add_argument("--repeats", type=int, default=3, help="runs of each single stream; the fastest counts")
    p.add_argument("--kv-cache-tokens", type=int, default=20480)
    p.add_argument("--engine-only", action="store_true",
                   help="part 2 on the engine in this process (no server): the floor of the server's ratio")
    args = p.parse_args()
    if args.streams < 1 or args.repeats < 1 or args.short_repeats < 1:
        p.error("--streams, --repeats and --short-repeats must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tiny_train import build_model_dir

            model = str(build_model_dir(Path(tmp) / "tiny", max_position_embeddings=2048))
        if args.engine_only:
            r = engine_floor(model, args)
            print(f"""
command: {' '.join(['.venv/bin/python', 'bench/bench_server_logprobs.py', *sys.argv[1:]])}
model {args.model or 'tiny random (2 layers, hidden 64, context 2048)'}, float32, {torch_threads()} torch threads, \
engine only (no server), 1-min load average {os.getloadavg()[0]:.1f} after

| | seconds |
|---|---|
| {args.streams} `logprobs=5` streams of {args.max_tokens} tokens, all done | {r['streams_s']:.2f} ({r['step_ms']:.2f} ms a step) |
| short request ({args.short_tokens} tokens) alone, median | {r['short_alone_s']:.4f} |
| short request beside the {args.streams} streams, median of {int(r['short_beside_n'])} | {r['short_beside_s']:.4f} |

short request beside {args.streams} streams / alone, engine only: **{r['short_beside_s'] / r['short_alone_s']:.2f}**
""")
            return
        log = Path(tmp) / "server.log"
        proc, url = start_server(model, args.kv_cache_tokens, log)
        try:
            r = asyncio.run(measure(url, proc.pid, args))
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=120)
        if rc != 0:
            raise RuntimeError(f"the server exited with {rc}:\n{log.read_text()}")
    lp_ratio = r["logprobs_s"] / r["plain_s"]
    short_ratio = r["short_beside_s"] / r["short_alone_s"]
    print(f"""
command: {' '.join(['.venv/bin/python', 'bench/bench_server_logprobs.py', *sys.argv[1:]])}
model {args.model or 'tiny random (2 layers, hidden 64, context 2048)'}, float32, {os.cpu_count()} CPUs, 1-min load average {os.getloadavg()[0]:.1f} after

| | seconds | server CPU seconds |
|---|---|---|
| one stream, {args.max_tokens} tokens, no log-probs | {r['plain_s']:.2f} | {r['plain_cpu']:.2f} |
| one stream, {args.max_tokens} tokens, `logprobs=5` | {r['logprobs_s']:.2f} | {r['logprobs_cpu']:.2f} |
| {args.streams} such `logprobs=5` streams at once, all done | {r['streams_s']:.2f} | |
| short request ({args.short_tokens} tokens) alone, median | {r['short_alone_s']:.3f} | |
| short request beside the {args.streams} streams, median of {int(r['short_beside_n'])} | {r['short_beside_s']:.3f} | |

with / without log-probs: **{lp_ratio:.2f}** (goal <= 1.5); in server CPU time {r['logprobs_cpu'] / r['plain_cpu']:.2f}
short request beside {args.streams} streams / alone: **{short_ratio:.2f}** (goal <= 2)
""")


if __name__ == "__main__":
    main()

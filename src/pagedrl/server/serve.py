"""`pagedrl serve [MODEL]`: load a model, start the engine thread and serve the OpenAI API with uvicorn.

On SIGTERM (or Ctrl+C) the server drains: it answers every new request 503 (with `Connection:
close`, so clients retry elsewhere) and lets in-flight responses finish for up to
`--shutdown-timeout` seconds; what is still running then is aborted in the engine, so each response
still ends in OpenAI's shape (a stream with an error event and `[DONE]`, a plain request with a JSON
error) instead of being cut. Once nothing has been busy for a moment uvicorn closes the listening
socket and the app's shutdown stops the engine thread. The process then exits with 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from pagedrl.engine.engine_args import EngineArgs, add_engine_arguments, cli_fields, flag
from pagedrl.engine.engine_config import EngineSettingError
from pagedrl.engine.pooling_runner import pooling_wanted
from pagedrl.model.footprint import footprint
from pagedrl.server.app import DEFAULT_MAX_REQUEST_BODY_BYTES
from pagedrl.server.chat_template_flags import (
    add_chat_template_arguments,
    chat_template_problem,
    load_chat_template,
)
from pagedrl.server.inputs import DEFAULT_MAX_N
from pagedrl.server.reasoning_parsers import REASONING_PARSERS, served_reasoning_parser
from pagedrl.server.request_log import add_request_log_arguments
from pagedrl.server.responses_store import DEFAULT_MAX_BYTES as DEFAULT_STORE_BYTES
from pagedrl.server.responses_store import RESPONSES_STORE_ENV, responses_store_from_env
from pagedrl.server.served_models import RUNTIME_UPDATING_ENV, parse_lora_module, runtime_updating_from_env
from pagedrl.server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("pagedrl.server")


def build_parser() -> argparse.ArgumentParser:
    """The engine's flags from `EngineArgs` (one per field, vLLM's names), then the server's own."""
    p = argparse.ArgumentParser(prog="pagedrl serve", description="Serve a model over an OpenAI-compatible API.",
                                allow_abbrev=False)  # `--api k` must not quietly set --api-key
    groups = add_engine_arguments(p)
    server = p.add_argument_group("the server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", default=os.environ.get("PAGEDRL_API_KEY", os.environ.get("VLLM_API_KEY")),
                        help="require 'Authorization: Bearer KEY' on /v1 (default: $PAGEDRL_API_KEY, else "
                             "$VLLM_API_KEY, else none; an empty key is none)")
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model ids clients use, the first in responses' metrics and listed first (default: "
                             "the adapter's PATH if given, else MODEL)")
    server.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="sequences (a request with n samples counts n) that may wait beyond --max-num-seqs; "
                             "more are answered 503")
    server.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES)
    server.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                        help="samples one request may ask for (n); more are answered 400 (default: OpenAI's 128)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish after SIGTERM before they are aborted")
    server.add_argument("--log-level", "--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"),
                        help="the server's and uvicorn's log level (--uvicorn-log-level: vLLM's spelling)")
    server.add_argument("--no-access-log", "--disable-uvicorn-access-log", action="store_true",
                        help="do not log every HTTP request")
    server.add_argument("--root-path", default="", help="the path prefix a proxy serves this server under "
                        "(FastAPI's root_path, vLLM's flag)")
    server.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (and --ssl-certfile)")
    server.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate chain")
    server.add_argument("--no-ui", action="store_true", help="do not serve the chat page at /")
    server.add_argument("--allowed-origins", nargs="+", default=[], type=str, metavar="ORIGIN",
                        help="origins whose web pages may call the API from a browser (CORS), e.g. "
                             "https://app.example.com, '*' for any, or vLLM's JSON list; default: none")
    server.add_argument("--enable-request-id-headers", action="store_true",
                        help="add X-Request-Id to every response: the request's own header, else a fresh id (a "
                             "completion's id is named by the request's X-Request-Id, or its request_id, either way)")
    server.add_argument("--enable-responses-store", action="store_true", default=responses_store_from_env(),
                        help="keep /v1/responses answers in memory, for GET /v1/responses/{id} and "
                             f"previous_response_id (also ${RESPONSES_STORE_ENV}=1, vLLM's); default: none kept")
    server.add_argument("--responses-store-bytes", type=int, default=DEFAULT_STORE_BYTES,
                        help="with --enable-responses-store, the most bytes of responses kept; past it the oldest "
                             f"are forgotten (default: {DEFAULT_STORE_BYTES >> 20} MiB)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='answer tool_choice "auto" (the default when a request has tools), reading the '
                             "model's calls with --tool-call-parser")
    server.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                        help="the format the model writes its tool calls in, by vLLM's names: hermes (the default, "
                             "<tool_call> JSON blocks), llama3_json, pythonic, llama4_pythonic, mistral, deepseek_v3, "
                             "deepseek_v31, kimi_k2, openai (gpt-oss's harmony messages to functions.NAME)")
    server.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="split a thinking model's <think> reasoning from its chat answers into the message's "
                             "reasoning field (vLLM's flag: deepseek_r1 for DeepSeek-R1 and QwQ, deepseek_v3 for "
                             "DeepSeek-V3.1/V3.2 asked to think with chat_template_kwargs thinking: true, kimi_k2 for "
                             "Kimi K2 Thinking, mistral for "
                             "Magistral's [THINK], qwen3 for Qwen3, openai_gptoss for gpt-oss's analysis channel); "
                             "default: none, the reasoning stays in the content (gpt-oss: openai_gptoss, as vLLM "
                             "always reads its harmony answers)")
    server.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="name log-probs' tokens token_id:<id> unless a request says otherwise (vLLM's flag)")
    server.add_argument("--disable-fastapi-docs", action="store_true",
                        help="serve no /docs, /redoc or /openapi.json")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="report usage.prompt_tokens_details.cached_tokens on chat and completion answers")
    server.add_argument("--enable-force-include-usage", action="store_true",
                        help="end every stream with a usage chunk, even without stream_options.include_usage")
    server.add_argument("--enable-server-load-tracking", action="store_true",
                        help="count generating requests in flight, read at GET /load")
    add_request_log_arguments(server)
    add_chat_template_arguments(server)
    lora = groups["lora"]
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help='adapters to serve: name=path, or JSON {"name": ..., "path": ..., "base_model_name": ...}')
    lora.add_argument("--allow-runtime-lora-updating", action="store_true", default=runtime_updating_from_env(),
                      help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (they read any folder this "
                           f"process can; also ${RUNTIME_UPDATING_ENV}=true)")
    return p


# After the aborts at --shutdown-timeout, the responses get this long to write their error endings
# before uvicorn cancels what is left.
ABORT_GRACE_S = 5.0
# While draining, the listening socket closes once no request has been in flight for this long: time
# for connections the kernel already queued to be accepted and answered 503.
QUIET_S = 0.25


def busy(connection: Any) -> bool:
    """Whether a connection is in the middle of a request (its response not yet complete)."""
    cycle = getattr(connection, "cycle", None)
    return cycle is not None and not cycle.response_complete


def draining_server(config: Any, engine: Any, draining: Any, shutdown_timeout: float) -> Any:
    """A uvicorn server that drains before it closes: on SIGTERM it keeps accepting, answers every new
    request 503 (`draining`, the app's DrainGate), lets what is in flight finish (aborting it in the engine once
    `shutdown_timeout` is over, so it still ends in OpenAI's shape), and closes the listening socket
    only when nothing has been busy for `QUIET_S`. A client whose connection the kernel had already
    queued therefore gets a 503 to retry elsewhere, never a bare close."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            loop = asyncio.get_running_loop()
            draining.on = True
            timer = loop.call_later(
                shutdown_timeout, engine.abort_all,
                f"the server is shutting down and the request did not finish within {shutdown_timeout:g} s")
            if engine.num_in_flight:
                logger.info("draining: %d requests in flight get up to %g s to finish; new ones are answered 503 "
                            "(Ctrl+C again to stop at once)", engine.num_in_flight, shutdown_timeout)
            try:
                deadline, quiet_since = loop.time() + shutdown_timeout + ABORT_GRACE_S, None
                while loop.time() < deadline:
                    if self.force_exit:  # a second Ctrl+C: end what is in flight now, in OpenAI's shape
                        engine.abort_all("the server was stopped at once")
                        await asyncio.sleep(QUIET_S)  # the responses write their error endings
                        break
                    if engine.num_in_flight or any(busy(c) for c in self.server_state.connections):
                        quiet_since = None
                    elif quiet_since is None:
                        quiet_since = loop.time()
                    elif loop.time() - quiet_since >= QUIET_S:
                        break
                    await asyncio.sleep(0.01)
                await super().shutdown(sockets)
                shut = getattr(getattr(self, "lifespan", None), "shutdown_event", None)
                if self.force_exit and not (shut is not None and shut.is_set()):
                    await self.lifespan.shutdown()  # uvicorn skipped the app's shutdown: the engine thread stops
            finally:
                timer.cancel()

    return DrainingServer(config)


def build_server(args: argparse.Namespace) -> Any:
    """The uvicorn server for parsed arguments (model loaded, app built, engine thread not yet started)."""
    import uvicorn

    from pagedrl.engine.async_engine import AsyncEngine
    from pagedrl.engine.generation_defaults import generation_defaults
    from pagedrl.engine.llm_engine import LLMEngine
    from pagedrl.model.default import DEFAULT_MODEL
    from pagedrl.model.loader import load_model
    from pagedrl.server.app import build_app
    from pagedrl.server.pooling_app import build_pooling_server

    engine_args = EngineArgs.from_cli_args(args)
    if pooling_wanted(engine_args.model, {"runner": engine_args.runner, "adapter": engine_args.adapter}):
        return build_pooling_server(args, engine_args)
    loaded = load_model(engine_args.model, device=engine_args.device, dtype=engine_args.dtype,
                        adapter=engine_args.adapter, revision=engine_args.revision,
                        quantization=engine_args.quantization,
                        activations=engine_args.activations)
    engine = LLMEngine(loaded.model, loaded.tokenizer, engine_args.engine_config(), eos_token_ids=loaded.eos_token_ids)
    defaults = generation_defaults(engine_args.generation_config, loaded.generation_config,
                                   str(loaded.path / "generation_config.json"), engine_args.override_generation_config)
    if defaults.params:
        logger.info("default sampling parameters for requests that leave them unset: %s (--generation-config vllm "
                    "turns the model's off)", defaults.describe())
    reasoning_parser = served_reasoning_parser(args.reasoning_parser, loaded.model.config.model_type)
    if reasoning_parser != args.reasoning_parser:
        logger.info("gpt-oss answers in harmony messages: read with --reasoning-parser %s", reasoning_parser)
    names = args.served_model_name or [args.adapter or args.model or DEFAULT_MODEL]
    name = names[0]
    async_engine = AsyncEngine(engine, max_waiting_requests=args.max_waiting_requests)
    app = build_app(async_engine, served_model_name=names,
                    model_root=str(loaded.path), api_key=args.api_key or None,
                    max_request_body_bytes=args.max_request_body_bytes, max_n=args.max_n, ui=not args.no_ui,
                    tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                    lora_modules=[parse_lora_module(m) for m in args.lora_modules],
                    allow_runtime_lora_updating=args.allow_runtime_lora_updating, sampling_defaults=defaults.params,
                    max_tokens_cap=defaults.max_tokens_cap, allowed_origins=origins(args.allowed_origins),
                    request_id_headers=args.enable_request_id_headers,
                    responses_store_bytes=args.responses_store_bytes if args.enable_responses_store else None,
                    chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
                    chat_template_content_format=args.chat_template_content_format,
                    response_role=args.response_role, enable_log_requests=args.enable_log_requests,
                    max_log_len=args.max_log_len, enable_log_outputs=args.enable_log_outputs,
                    trust_request_chat_template=args.trust_request_chat_template,
                    fastapi_docs=not args.disable_fastapi_docs,
                    return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                    reasoning_parser=reasoning_parser,
                    enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                    enable_force_include_usage=args.enable_force_include_usage,
                    enable_server_load_tracking=args.enable_server_load_tracking)
    stats = engine.metrics_snapshot()
    if stats.lora is not None:
        logger.info("LoRA: %d slots of rank up to %d on every decoder projection (%.1f MiB)", args.max_loras,
                    args.max_lora_rank, stats.lora.nbytes / 2**20)
    for lora in app.state.served.adapters.values():
        logger.info("LoRA adapter %s from %s (id %d)", lora.lora_name, lora.lora_path, lora.lora_int_id)
    logger.info("serving %s (%s, %s on %s): %s; %s, max_model_len %d; %s",
                name, loaded.path, loaded.precision.describe(), loaded.model.device,
                footprint(loaded.model.config, loaded.model.dtype, engine.kv_dtype).describe(stats.weight_bytes),
                engine.kv_layout(), engine.max_model_len, engine.decode_path())
    if not args.no_ui:
        logger.info("chat page at %s://%s:%d%s/ (--no-ui turns it off)", "https" if args.ssl_certfile else "http",
                    args.host, args.port, args.root_path)
    uv = uvicorn.Config(app, **uvicorn_options(args))
    return draining_server(uv, async_engine, app.state.draining, args.shutdown_timeout)


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """What uvicorn is told of the server's flags."""
    return dict(host=args.host, port=args.port, log_level=args.log_level, access_log=not args.no_access_log,
                timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE_S, root_path=args.root_path,
                ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)


def ssl_problem(args: argparse.Namespace) -> str | None:
    """HTTPS needs a certificate (whose file may hold the key too, as uvicorn reads it) and files that
    exist: said before the model loads."""
    given = [f for f in (args.ssl_keyfile, args.ssl_certfile) if f]
    if args.ssl_keyfile and not args.ssl_certfile:
        return "--ssl-keyfile needs --ssl-certfile (the certificate chain the key belongs to)"
    missing = [f for f in given if not Path(f).is_file()]
    return f"{missing[0]}: no such file (--ssl-keyfile, --ssl-certfile)" if missing else None


def origins(values: list[str]) -> list[str]:
    """`--allowed-origins` as words or as vLLM's JSON list (`'["*"]'`)."""
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            parsed = json.loads(values[0])
        except json.JSONDecodeError as e:
            raise ValueError(f"--allowed-origins: {values[0]} is not a JSON list ({e})") from None
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError(f"--allowed-origins: expected a JSON list of strings, got {values[0]}")
        return parsed
    return values


def origins_problem(args: argparse.Namespace) -> str | None:
    try:
        origins(args.allowed_origins)
    except ValueError as e:
        return str(e)
    return None


def names_problem(args: argparse.Namespace) -> str | None:
    """`--served-model-name` takes every word up to the next flag, MODEL too when MODEL comes after it:
    the default model would then be served under the folder's name. Said, not guessed at."""
    names = args.served_model_name or []
    if args.model is None and any(Path(n).exists() or n.endswith(".gguf") or "/" in n for n in names[1:]):
        return (f"--served-model-name {' '.join(names)}: takes every name up to the next flag, so MODEL was read as "
                "a name; put MODEL first: pagedrl serve MODEL --served-model-name NAME ...")
    return None


def lora_arguments_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the LoRA flags, checked before the model loads (an adapter itself is
    checked once the engine exists: its shapes against the base's)."""
    for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            return f"--{name.replace('_', '-')} must be positive"
    if args.lora_modules and not args.enable_lora:
        return "--lora-modules needs --enable-lora"
    try:
        names = [parse_lora_module(m).name for m in args.lora_modules]
    except ValueError as e:
        return str(e)
    if len(set(names)) != len(names):
        return f"--lora-modules: a name is given twice ({', '.join(names)})"
    return None


def engine_arguments_problem(args: argparse.Namespace) -> str | None:
    """What the engine's own check says of its flags, before the model loads, naming the flags."""
    try:
        EngineArgs.from_cli_args(args).engine_config().validate()
    except ValueError as e:
        return named_as_flags(str(e))
    return None


def named_as_flags(message: str) -> str:
    """An engine message with its field names spelled as the flags that set them (those with an
    underscore: "model" or "seed" may be plain words)."""
    for f in (f for f in cli_fields() if "_" in f.name):
        message = re.sub(rf"(?<![\w-]){f.name}\b", flag(f.name), message)
    return message


def listening_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port, found before the model loads (minutes, for a
    large one) rather than after; uvicorn binds the same way (SO_REUSEADDR), so what passes here
    binds there unless another process takes the port meanwhile."""
    import socket

    try:  # every address the name gives, as asyncio's server binds them all
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                   flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
    except OSError as e:
        return f"cannot listen on {host}:{port}: {e.strerror or e} (--host, --port)"
    return None


def _exit_now(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def serve_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_request_body_bytes", "max_n",
                 "responses_store_bytes"):
        if getattr(args, name) <= 0:
            print(f"pagedrl serve: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    for name in ("max_waiting_requests", "max_log_len"):
        if (getattr(args, name) or 0) < 0:
            print(f"pagedrl serve: --{name.replace('_', '-')} must be non-negative", file=sys.stderr)
            return 2
    problem = (lora_arguments_problem(args) or names_problem(args) or engine_arguments_problem(args)
               or origins_problem(args) or ssl_problem(args) or chat_template_problem(args.chat_template)
               or listening_problem(args.host, args.port))
    if problem:
        print(f"pagedrl serve: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _exit_now)  # while loading: just leave
    try:
        server = build_server(args)
    except ValueError as e:  # a model or adapter that cannot be served (CheckpointError included): named
        message = named_as_flags(str(e)) if isinstance(e, EngineSettingError) else str(e)
        print(f"pagedrl serve: {message}", file=sys.stderr)
        return 2
    # uvicorn handles SIGTERM/SIGINT while serving, then re-raises the signal to the handler that was
    # installed before it; after a graceful shutdown there is nothing left to do, so that one is a no-op.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server.run()
    return 0

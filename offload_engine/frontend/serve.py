"""`offload-engine serve`: its parser (the engine flags of `run`, and its own: address, key, limits), the bind
check, and the uvicorn loop."""
from __future__ import annotations

import argparse
import ipaddress
import socket
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..units import format_bytes
from .common import add_common, add_model_arguments, subcommand
from .engine_flags import add_engine_flags, check_context, check_engine_flags, engine_config, started_as_rank

SERVE_EXAMPLES = """examples:
  offload-engine serve --model ~/models/Qwen3-30B-A3B --ram 48GiB
  offload-engine serve --model DIR --host 0.0.0.0 --port 8080 --api-key "$KEY"
  curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "demo-model", "messages": [{"role": "user", "content": "Hello"}]}'
"""


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    serve = subcommand(sub, "serve", "an OpenAI-compatible HTTP server and a chat page", SERVE_EXAMPLES,
                       usage="offload-engine serve [MODEL | --model DIR] [options]")
    add_model_arguments(serve, "Hugging Face folder or a .gguf file")
    add_engine_flags(serve)
    add_serve_flags(serve)
    serve.add_argument("--show-plan", action="store_true", help="print the placement before serving")
    serve.add_argument("--allow-cast", action="store_true", help="accept tensors whose dtype differs from config.json")
    add_common(serve)
    serve.set_defaults(func=cmd_serve, json=False)
    return serve


def cmd_serve(args: argparse.Namespace) -> int:
    from ..api import Engine

    check_engine_flags(args)
    if started_as_rank():
        raise ConfigError("serve runs in one process: the layers split across ranks (torchrun, --devices) is "
                          "available to `run` only")
    check_serve_flags(args)  # before loading: a refused bind costs no load
    check_context(args.model, args.context)  # args.model: common.choose_model filled it in
    engine = Engine.open(args.model, engine_config(args))
    try:
        if args.show_plan:
            print(engine.placement.describe(), file=sys.stderr)
        return serve(engine, args)
    finally:
        engine.close()



def add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: a free one)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ routes")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow binding a non-loopback address without --api-key")
    p.add_argument("--model-name", help="the model id clients name (default: the checkpoint folder's name)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, metavar="N",
                   help="largest request body accepted, larger ones get 413 (default 4 MiB)")
    p.add_argument("--max-tokens-limit", type=int, default=4096, metavar="N",
                   help="the most tokens one request may generate (default 4096)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests waiting for the engine before further ones get 429 (default 64)")
    p.add_argument("--cache-ram", default="auto", metavar="SIZE|auto",
                   help="host RAM for saved prompt prefixes (KV cache snapshots a later request with the same "
                        "prefix reuses), charged to the --ram budget: 2GiB, 512MiB, 0 (off: only the last "
                        "conversation's cache is reused); auto (default): 1/32 of --ram, at most 1 GiB")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_serve_flags(args: argparse.Namespace) -> None:
    if not is_loopback(args.host) and args.api_key is None and not args.insecure_no_auth:
        raise ConfigError(f"--host {args.host} is not a loopback address: pass --api-key KEY (clients send "
                          "'Authorization: Bearer KEY') or, on a trusted network, --insecure-no-auth")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key must not be empty")
    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--max-tokens-limit", args.max_tokens_limit),
                        ("--max-queue", args.max_queue)):
        if value < 1:
            raise ConfigError(f"{flag} must be an integer >= 1, got {value}")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")


def model_id(engine: Any, args: argparse.Namespace) -> str:
    return args.model_name or Path(str(engine.checkpoint.root)).name


def serve(engine: Any, args: argparse.Namespace) -> int:
    """Serve until Ctrl-C (uvicorn stops, then the interrupt is raised again: exit 130 in the CLI)."""
    import uvicorn

    from ..server.app import ServerSettings, create_app

    settings = ServerSettings(model_id=model_id(engine, args), api_key=args.api_key,
                              max_body_bytes=args.max_body_bytes, max_tokens_limit=args.max_tokens_limit,
                              max_queue=args.max_queue)
    app = create_app(engine, settings)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))  # bound here so that --port 0 can print the port it got
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    placement = engine.placement
    streamed = [k for k in placement.sizes if placement.home(k) == "disk"]
    cache = engine.prompt_cache.limit
    print(f"serving {settings.model_id} at http://{host}:{port}/ (OpenAI API at /v1, context {engine.context} "
          f"tokens, one sequence at a time, prompt cache {format_bytes(cache) if cache else 'off'}) | plan: "
          f"{'streams ' + ', '.join(streamed) if streamed else 'every weight resident'}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning" if args.quiet else "info", timeout_graceful_shutdown=5,
                            access_log=not args.quiet)
    worker = app.state.worker

    class Server(uvicorn.Server):
        """Ctrl-C ends the requests in flight at once: uvicorn would wait for them (up to its graceful timeout,
        then print the tasks it cancelled), and a generation can run for minutes."""

        async def shutdown(self, sockets: Any = None) -> None:
            worker.cancel_all()  # here in the event loop, not in the signal handler: it takes the queue's lock
            await super().shutdown(sockets)

    Server(config).run(sockets=[sock])
    return 0

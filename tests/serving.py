"""A server on a free loopback port, in this process (uvicorn on a thread): the server tests' one way to start it."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

try:
    import httpx2 as httpx  # the openai client's HTTP library where it is httpx's successor
except ImportError:
    import httpx
import pytest
import uvicorn

from offload_engine.server.app import ServerSettings, create_app


@contextmanager
def serving(engine: Any, settings: ServerSettings) -> Iterator[str]:
    """Yields the server's base URL once /health answers; stops the server and joins its thread after."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for _ in range(200):
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def base(engine: Any) -> Iterator[str]:
    """The server over the importing module's `engine` fixture: the demo model's id, bodies up to 1 MiB."""
    with serving(engine, ServerSettings(model_id="demo-model", max_body_bytes=1024 * 1024)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> Any:
    """The official openai client on `base`, no retries."""
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

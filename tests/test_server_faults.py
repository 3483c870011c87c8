"""Server checks that can fail: a client that leaves stops its generation within a few decode steps (counted by the
engine's tokens on /metrics), and a sampled answer follows its temperature and seed. Each check is also run against a
deliberately broken server (one that ignores the disconnect, one that drops the temperature) and must fail there."""
from __future__ import annotations

import json
import re
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

try:
    import httpx2 as httpx  # the openai client's HTTP library where it is httpx's successor
except ImportError:
    import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from offload_engine.api import Engine  # noqa: E402
from offload_engine.server.app import ServerSettings, create_app  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "offload_engine" / "data" / "demo-model"
PROMPT = "def f(x):"
MAX_TOKENS = 1500  # far more than BOUND: a server that runs the request to its end is caught at once
# tokens the engine may produce after the client closed its socket: the step running when the server hears of it,
# and a few more for the event loop's latency on a loaded machine (seen: 1, rarely 2, in 60 tries at load 16 on 2
# cores)
BOUND = 8
DEADLINE_S = 120  # liveness only: a wait that passes it fails the test


@pytest.fixture(scope="module")
def engine():
    e = Engine.open(DEMO)
    yield e
    e.close()


@dataclass
class Served:
    url: str
    app: Any

    def generated(self) -> int:
        """The engine's tokens so far (the counter /metrics shows, read in-process: no round trip during which the
        engine would run on), those of requests cancelled midway included."""
        return self.app.state.metrics.generated_tokens

    def busy(self) -> bool:
        return self.app.state.worker.busy


@contextmanager
def serving(engine: Any, **settings: Any) -> Iterator[Served]:
    """A server on a free loopback port, in this process (uvicorn on a thread)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(engine, ServerSettings(model_id="demo-model", **settings))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", app)
    finally:
        app.state.worker.stop()  # a job the broken server kept running ends here, freeing the shared engine
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive() and not app.state.worker.thread.is_alive()


def metric(url: str, name: str) -> int:
    text = httpx.get(url + "/metrics", timeout=60).text
    return int(re.search(rf"^{name} (\d+)$", text, re.M).group(1))


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, f"still waiting for {what} after {DEADLINE_S} s"
        time.sleep(0.01)


def tokens_after_leaving(server: Served, stream: bool) -> int:
    """Sends a long greedy request on a raw socket, closes the socket once the engine has produced a token for it,
    and returns how many tokens the engine produced after the close: counted until the server is idle again, or
    until the count passes BOUND (a server that ignores the disconnect would go on to MAX_TOKENS)."""
    wait_until(lambda: not server.busy(), "an idle server")
    before = server.generated()
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(head + body)
        wait_until(lambda: server.generated() > before, "the request's first token")
        seen = server.generated()  # read before the close: tokens made in between count as after it (stricter)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        busy = server.busy()
        after = server.generated() - seen  # read after `busy`: once the worker is idle, every token is counted
        if after > BOUND or not busy:
            return after
        assert time.monotonic() < deadline, f"the server is still busy {DEADLINE_S} s after its client left"
        time.sleep(0.01)


def test_generated_tokens_counter_counts_each_token(engine):
    """The counter the disconnect check reads: one per token the engine produced (here a finished request), the
    same on /metrics."""
    with serving(engine) as server:
        before = metric(server.url, "offload_engine_generated_tokens_total")
        r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert metric(server.url, "offload_engine_generated_tokens_total") - before == 5 == server.generated()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_a_client_that_leaves_stops_its_generation(engine, stream):
    """Three disconnects in a row: each stops the engine within BOUND tokens (of MAX_TOKENS asked), and the
    server answers the next request."""
    want = engine.generate(PROMPT, max_new_tokens=BOUND + 2, temperature=0)
    assert want.finish_reason == "length"  # the greedy answer outlasts BOUND: only a stop can end it early
    with serving(engine) as server:
        for _ in range(3):
            assert tokens_after_leaving(server, stream) <= BOUND
        r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_the_disconnect_check_fails_on_a_server_that_ignores_it(engine, stream):
    """The same check against a server whose disconnect handling is switched off: it must see the engine run on."""
    with serving(engine, cancel_on_disconnect=False) as server:
        assert tokens_after_leaving(server, stream) > BOUND


MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=7)


def check_sampling(url: str, engine: Engine) -> None:
    """A seeded sampled answer reproduces, equals the engine's own for those parameters, and is not the greedy one
    (which is what a server that ignored the temperature would answer)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def ask(**kw: Any) -> str:
        r = client.chat.completions.create(model="demo-model", messages=MSGS, max_tokens=16, **kw)
        return r.choices[0].message.content

    greedy, a, b = ask(temperature=0), ask(**SAMPLED), ask(**SAMPLED)
    assert a == b, "the same seed gave two answers"
    assert a != greedy, "a sampled answer equals the greedy one: the temperature did not reach the engine"
    ids = engine.tokenizer.encode_chat(MSGS)
    assert a == engine.generate(ids, max_new_tokens=16, **SAMPLED).text


class TemperatureDropped:
    """A broken server's view of the engine: the request's temperature never reaches it (the engine's default,
    greedy, applies). Everything else is the real engine."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def prepare(self, ids, **sampling: Any):
        sampling.pop("temperature")
        return self._engine.prepare(ids, **sampling)


def test_sampling_follows_temperature_and_seed(engine):
    with serving(engine) as server:
        check_sampling(server.url, engine)


def test_the_sampling_check_fails_when_the_temperature_is_dropped(engine):
    with serving(TemperatureDropped(engine)) as server:
        with pytest.raises(AssertionError, match="temperature did not reach the engine"):
            check_sampling(server.url, engine)

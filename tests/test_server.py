"""`offload-engine serve` through the official openai client and raw HTTP, on the demo model, loopback only."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    import httpx2 as httpx  # the openai client's HTTP library where it is httpx's successor
except ImportError:
    import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from offload_engine.api import Engine  # noqa: E402
from offload_engine.server.app import ServerSettings, create_app  # noqa: E402
from tests.serving import serving  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "offload_engine" / "data" / "demo-model"


@pytest.fixture(scope="module")
def engine():
    e = Engine.open(DEMO)
    yield e
    e.close()


@pytest.fixture(scope="module")
def base(engine):
    """A server on a free loopback port, in this process (uvicorn on a thread)."""
    with serving(engine, ServerSettings(model_id="demo-model", max_body_bytes=1024 * 1024, max_queue=256)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]


def test_models_and_health(client, base):
    assert [m.id for m in client.models.list().data] == ["demo-model"]
    health = httpx.get(base + "/health").json()
    assert health["status"] == "ok" and health["concurrency"] == 1
    text = httpx.get(base + "/metrics").text
    assert "offload_engine_queue_length" in text and "offload_engine_decode_tokens_per_second" in text


def test_chat_greedy_equals_engine_generate(client, engine):
    r = client.chat.completions.create(model="demo-model", messages=MSGS, max_tokens=12, temperature=0)
    ids = engine.tokenizer.encode_chat(MSGS)
    want = engine.generate(ids, max_new_tokens=12, temperature=0)
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == len(ids) + len(want.token_ids)
    assert r.model_extra["offload_engine"]["generated_tokens"] == len(want.token_ids)


def test_chat_stream_matches_non_stream(client):
    plain = client.chat.completions.create(model="demo-model", messages=MSGS, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="demo-model", messages=MSGS, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason


def test_completions_text_and_ids(client, engine):
    want = engine.generate("def fib(n):", max_new_tokens=10, temperature=0)
    r = client.completions.create(model="demo-model", prompt="def fib(n):", max_tokens=10, temperature=0)
    assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids)
    ids = engine.tokenizer.encode("def fib(n):")
    r2 = client.completions.create(model="demo-model", prompt=ids, max_tokens=10, temperature=0)
    assert r2.choices[0].text == want.text
    stream = client.completions.create(model="demo-model", prompt="def fib(n):", max_tokens=10, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.text


def test_stop_strings(client, engine):
    full = client.completions.create(model="demo-model", prompt="def fib(n):", max_tokens=20, temperature=0)
    text = full.choices[0].text
    stop = text.strip()[2:4]
    assert stop
    r = client.completions.create(model="demo-model", prompt="def fib(n):", max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"


# seeded sampling (reproduces, follows the temperature) and client disconnects (stop the engine within a few steps):
# tests/test_server_faults.py, each shown to fail against a server that drops the temperature / ignores the disconnect


def test_n_refused_and_unknown_model(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo-model", messages=MSGS, n=2, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=2)


MALFORMED = [
    (b"{bad json", 400), (b"", 400), (b"[]", 400), (b'"text"', 400), (b"null", 400),
    (b"\xff\xfe{}", 400), (b'{"messages": "hi"}', 400), (b'{"messages": []}', 400),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', 400),
    (b'{"messages": [{"content": "x"}]}', 400), (b'{"messages": [{"role": "user", "content": 5}]}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000000}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_p": 0}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": 3}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "seed": "a"}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 3}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "spec": "warp"}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}', 404),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream_options": 1}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": {"type": "function"}}', 400),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", '
     b'"parameters": {"$ref": "#"}}}], "tool_choice": "required"}', 400),
    (b'{"messages": [{"role": "tool", "content": "x"}]}', 400),
    (b'{"prompt": 5}', 400, "/v1/completions"), (b'{"prompt": [-1, 2]}', 400, "/v1/completions"),
    (b'{"prompt": "x" }' + b" " * (10 * 1024 * 1024), 413, "/v1/completions"),
]


@pytest.mark.parametrize("case", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_bodies_get_4xx_and_server_keeps_serving(base, case):
    body, status, path = (*case, "/v1/chat/completions")[:3]
    r = httpx.post(base + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in error["message"]
    assert httpx.get(base + "/health").status_code == 200


def test_prompt_over_context_names_both_numbers(base, engine):
    r = httpx.post(base + "/v1/completions", json={"prompt": [1] * (engine.context + 5), "max_tokens": 1})
    assert r.status_code == 400
    assert str(engine.context + 5) in r.json()["error"]["message"] and str(engine.context) in r.json()["error"]["message"]


def test_concurrent_clients_do_not_mix(base, engine):
    """200 requests from 8 threads, each a distinct token-id prompt: every answer equals its own greedy run."""
    prompts = [[1 + (i % 50), 2 + (i % 7)] for i in range(200)]
    want = {p: engine.generate(list(p), max_new_tokens=3, temperature=0) for p in set(map(tuple, prompts))}

    def ask(p):
        r = httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 3, "temperature": 0}, timeout=120)
        r.raise_for_status()
        return p, r.json()

    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, prompts))
    assert time.monotonic() - start < 120
    for p, body in results:
        assert body["choices"][0]["text"] == want[tuple(p)].text
        assert body["usage"]["completion_tokens"] == len(want[tuple(p)].token_ids)
        assert body["offload_engine"]["prompt_tokens"] == len(p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_auth_and_ctrl_c_exits_130():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "offload_engine.cli", "serve", "--port", str(port), "--quiet",
                             "--api-key", "sekrit"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert f"http://127.0.0.1:{port}/" in line
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()


def test_cli_serve_refuses_open_bind_without_key():
    proc = subprocess.run([sys.executable, "-m", "offload_engine.cli", "serve", "--host", "0.0.0.0"],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--api-key" in proc.stderr


def test_five_turns_through_the_client_reuse_the_history(client, engine):
    """Each turn prefills only what the engine's cache did not hold (the new turn), answers equal fresh prefills."""
    messages = [{"role": "system", "content": "You are terse."}]
    held = 0
    for turn in range(5):
        messages.append({"role": "user", "content": f"Question {turn}: what is {turn} + 1?"})
        ids = engine.tokenizer.encode_chat(messages)
        r = client.chat.completions.create(model="demo-model", messages=messages, max_tokens=8, temperature=0)
        stats = r.model_extra["offload_engine"]
        assert stats["reused_prompt_tokens"] == held and stats["prefilled_tokens"] == len(ids) - held
        answer = r.choices[0].message.content
        engine.reuse_prefix = False
        try:
            want = engine.generate(ids, max_new_tokens=8, temperature=0)
        finally:
            engine.reuse_prefix = True
        assert answer == want.text and r.usage.completion_tokens == len(want.token_ids)
        # the fresh run above replaced the kept cache: rerun the turn so the next one can extend it
        engine.generate(ids, max_new_tokens=8, temperature=0)
        held = len(ids) + len(want.token_ids) - 1
        messages.append({"role": "assistant", "content": answer})


def test_a_full_queue_answers_429(engine):
    """max_queue 1: with the engine held (a stream iterated here), one request waits on the engine in the worker,
    one waits in the queue, and the third is refused with an error object; all run once the engine is free."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(engine, ServerSettings(model_id="demo-model", max_queue=1)),
                                           log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    body = {"prompt": "def f(x):", "max_tokens": 2}
    held = engine.stream("x", max_new_tokens=4)
    next(held)  # this thread holds the engine now
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 10
            while not httpx.get(url + "/health").json()["busy"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            waiting = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60)
            while httpx.get(url + "/health").json()["queue_length"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            third = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full"
            held.close()  # the engine is free: both waiting requests are answered
            assert running.result().status_code == 200 and waiting.result().status_code == 200
    finally:
        held.close()
        server.should_exit = True
        thread.join(timeout=10)

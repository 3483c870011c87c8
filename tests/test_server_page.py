"""The chat page at / in a real browser: headless Chromium (the OS package) driven over the DevTools protocol on
a pipe (--remote-debugging-pipe: no driver library needed) types a message, presses Enter and reads the streamed
answer and its stats line from the page; a screenshot is written to $OFFLOAD_ENGINE_SCREENSHOT if set."""
from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from offload_engine.api import Engine

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "offload_engine" / "data" / "demo-model"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (install the OS package chromium)")
uvicorn = pytest.importorskip("uvicorn")


class DevTools:
    """The Chrome DevTools protocol over --remote-debugging-pipe: JSON messages, NUL-terminated, on fds 3 and 4."""

    def __init__(self, profile: str):
        self.to_browser_r, self.to_browser_w = os.pipe()
        self.from_browser_r, self.from_browser_w = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--remote-debugging-pipe", "--window-size=1000,700", "about:blank"]
        # the child's fd 3 reads our commands, its fd 4 writes the replies; moved above 100 first so that
        # placing one of them on 3 or 4 never overwrites the other
        read_end, write_end = (fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in (self.to_browser_r, self.from_browser_w))

        place = "import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); os.execv(sys.argv[3], sys.argv[3:])"
        self.proc = subprocess.Popen([sys.executable, "-c", place, str(read_end), str(write_end), CHROMIUM, *flags],
                                     pass_fds=(read_end, write_end), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(read_end)
        os.close(write_end)
        os.close(self.to_browser_r)
        os.close(self.from_browser_w)
        self.reader = os.fdopen(self.from_browser_r, "rb")
        self.next_id, self.buffer = 0, b""

    def call(self, method: str, session: str | None = None, **params):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self.to_browser_w, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self.buffer:
                chunk = os.read(self.reader.fileno(), 1 << 16)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self.buffer += chunk
            raw, self.buffer = self.buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self.to_browser_w)
        self.reader.close()


@pytest.fixture(scope="module")
def page_url():
    from offload_engine.server.app import ServerSettings, create_app

    engine = Engine.open(DEMO)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, ServerSettings(model_id="demo-model")),
                                           log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/?max_tokens=48"
    server.should_exit = True
    thread.join(timeout=10)
    engine.close()


def evaluate(tools: DevTools, session: str, expression: str):
    result = tools.call("Runtime.evaluate", session, expression=expression, returnByValue=True, awaitPromise=True)
    return result["result"].get("value")


def test_chat_page_streams_an_answer_in_headless_chromium(page_url, tmp_path):
    with tempfile.TemporaryDirectory() as profile:
        tools = DevTools(profile)
        try:
            target = tools.call("Target.createTarget", url=page_url)["targetId"]
            session = tools.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            deadline = time.monotonic() + 30
            while evaluate(tools, session, "document.getElementById('model').textContent") != "demo-model":
                assert time.monotonic() < deadline, "the page did not load the model list"
                time.sleep(0.1)
            for turn, text in enumerate(["Hello there", "And a second question?"]):
                evaluate(tools, session, "document.getElementById('input').focus()")
                tools.call("Input.insertText", session, text=text)  # typed, as a user would
                tools.call("Input.dispatchKeyEvent", session, type="keyDown", key="Enter", code="Enter",
                           windowsVirtualKeyCode=13)
                while evaluate(tools, session, f"(document.querySelectorAll('.assistant')[{turn}] || "
                                               "{dataset: {}}).dataset.state") != "done":
                    assert time.monotonic() < deadline + 60, evaluate(tools, session, "document.body.innerHTML")
                    time.sleep(0.1)
            users = evaluate(tools, session, "[...document.querySelectorAll('.user')].map(e => e.textContent)")
            answers = evaluate(tools, session, "[...document.querySelectorAll('.assistant')].map(e => e.textContent)")
            stats = evaluate(tools, session, "[...document.querySelectorAll('.stats')].map(e => e.textContent)")
            assert users == ["Hello there", "And a second question?"]
            assert len(answers) == 2 and all(a.strip() for a in answers)
            assert len(stats) == 2 and all("tok/s" in s and "hit rate" in s and "MB read/token" in s for s in stats)
            assert "prompt tokens reused" in stats[1] and not stats[1].split("|")[-1].strip().startswith("0 ")
            shot = base64.b64decode(tools.call("Page.captureScreenshot", session, format="png", captureBeyondViewport=True)["data"])
            out = Path(os.environ.get("OFFLOAD_ENGINE_SCREENSHOT", tmp_path / "chat-page.png"))
            out.write_bytes(shot)
            assert shot[:8] == b"\x89PNG\r\n\x1a\n"
        finally:
            tools.close()

"""Ctrl-C at any moment of start-up (issue 45): `offload-engine run | serve | quantize | plan --probe`, sent
SIGINT at delays spread from the moment the CLI takes SIGINT over (its first act in main(): then the imports of
torch and the engine, the flags, the model's open) to past the first token (the serving line, the end of the
command), exits with status 130, without a traceback, and leaves no process, file or bound port behind.

Each trial starts the command as a script's background job does (`offload-engine run ... &`: SIGINT ignored):
the CLI takes SIGINT back first of all, which the test reads in /proc/PID/status (SigIgn) and times its delays
from. Before that point no code of the engine's has run (interpreter start-up, ~0.05 s) and an ignored SIGINT
is lost by any program; before the fix the imports of torch ran there too, and a Ctrl-C in their seconds was
lost, printed as a traceback, or swallowed by torch's C++ init (the command then ran to its end).

The exit's latency is printed, not asserted (the goal is 1 s; under load the longest wait is torch's native
libraries loading, one C call that no Python handler can cut short); a lost interrupt fails the trial as the
command ending with 0 or not within BOUND_S.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offload_engine.defaults import default_model_path
from tests.figures import write_line

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("offload-engine")  # the console script of this environment
BOUND_S = 30.0  # generous: a lost interrupt shows as status 0 or as this timeout
RUN = ["run", "--prompt", "def main():", "--max-new-tokens", "1000", "--temperature", "1.5", "--seed", "2",
       "--vram", "20%", "--ram", "40%", "--context", "1024"]
LATENCIES: list[tuple[float, str, float]] = []  # (exit s, command, delay s) of every interrupted trial
STARTED: list[subprocess.Popen] = []  # every trial's process, killed at the module's end if a failure left one


def command(script: bool) -> list[str]:
    return [str(SCRIPT)] if script else [sys.executable, "-m", "offload_engine.cli"]


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    e.pop("OFFLOAD_ENGINE_STALL_TIMEOUT", None)
    return e


def sigint_ignored(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False


class Trial:
    """One command in its own session, started with SIGINT ignored; stdout and stderr go to files."""

    def __init__(self, argv: list[str], work: Path, script: bool = True):
        self.out, self.err = work / "stdout", work / "stderr"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(command(script) + argv, stdout=out, stderr=err, env=env(), cwd=work,
                                         start_new_session=True,
                                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        STARTED.append(self.proc)
        self.name = argv[0]
        deadline = time.monotonic() + 60
        while sigint_ignored(self.proc.pid):  # the CLI's main() has not taken SIGINT yet
            assert self.proc.poll() is None and time.monotonic() < deadline, self.stderr()
            time.sleep(0.002)
        self.taken = time.monotonic()

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def wait_for(self, ready, limit: float = 120) -> float:
        """Seconds from the CLI taking SIGINT until `ready()` holds."""
        deadline = time.monotonic() + limit
        while not ready():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.stderr()[-3000:]
            time.sleep(0.005)
        return time.monotonic() - self.taken

    def interrupt(self, delay: float) -> dict:
        """SIGINT `delay` s after the CLI took SIGINT over; the exit status and how long the exit took."""
        pause = self.taken + delay - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        sent = time.monotonic()
        finished_first = self.proc.poll() is not None
        if not finished_first:
            self.proc.send_signal(signal.SIGINT)
        try:
            rc = self.proc.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            rc = None
        exit_s = time.monotonic() - sent
        if rc is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        left = session_processes(self.proc.pid)
        if left:
            os.killpg(self.proc.pid, signal.SIGKILL)
        return {"rc": rc, "exit_s": exit_s, "left": left, "delay": delay, "finished_first": finished_first,
                "stderr": self.stderr(), "name": self.name}


def session_processes(sid: int) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == sid:
                found.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "))
        except OSError:
            pass
    return found


def check(result: dict, allow_finished: bool = False) -> bool:
    """Asserts an interrupted trial's outcome; False where the command had finished (allow_finished): ended
    before the signal, or was in the interpreter's own teardown, which Python ends with SIGINT's default action
    (status -2 here, 130 in a shell: at once, no traceback)."""
    if allow_finished and (result["finished_first"] or result["rc"] == -signal.SIGINT):
        assert result["rc"] in (0, -signal.SIGINT), result["stderr"][-3000:]
        assert "Traceback" not in result["stderr"] and not result["left"], result["stderr"][-3000:]
        return False
    assert not result["finished_first"], "the command ended before its SIGINT: " + result["stderr"][-2000:]
    assert result["rc"] == 130, (result["rc"], result["delay"], result["stderr"][-3000:])
    assert "Traceback" not in result["stderr"], result["stderr"][-3000:]
    assert "interrupted" in result["stderr"]
    assert not result["left"], f"processes left behind: {result['left']}"
    LATENCIES.append((result["exit_s"], result["name"], result["delay"]))
    return True


def spread(span: float, fractions: tuple[float, ...]) -> list[float]:
    return [span * f for f in fractions]


@pytest.fixture(scope="module", autouse=True)
def report_latencies(request):
    yield
    for proc in STARTED:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if LATENCIES:
        s = sorted(LATENCIES)
        slowest = ", ".join(f"{name} at {delay:.2f}s: {exit_s:.2f}s" for exit_s, name, delay in s[-3:])
        write_line(request, f"startup interrupts: {len(s)} exits at 130; exit latency median {s[len(s) // 2][0]:.2f}s, "
                            f"p90 {s[int(0.9 * (len(s) - 1))][0]:.2f}s, max {s[-1][0]:.2f}s (goal 1 s); "
                            f"slowest: {slowest}")


TAKEN_BEFORE_TORCH = r"""
import signal, sys
seen = []
_signal = signal.signal
def recording(signum, handler):
    if signum == signal.SIGINT and not seen:
        seen.append("torch" in sys.modules)
    return _signal(signum, handler)
signal.signal = recording
from offload_engine.cli import main  # what the console script runs
loaded = "torch" in sys.modules
sys.argv = ["offload-engine", "--help"]
try:
    main()
finally:
    print(loaded, seen, "torch" in sys.modules, file=sys.stderr)
"""


def test_ctrl_c_is_taken_before_torch_is_imported():
    """The console script imports offload_engine.cli before main() can take SIGINT over: that import stays
    small (the package's names load lazily), and main takes SIGINT before its first import of torch."""
    proc = subprocess.run([sys.executable, "-c", TAKEN_BEFORE_TORCH], capture_output=True, text=True, env=env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.split("\n")[-2] == "False [False] True", proc.stderr[-3000:]


@pytest.mark.parametrize("script", [True, False], ids=["console-script", "python-m"])
def test_run_interrupted_over_start_up(tmp_path, script):
    if script and not SCRIPT.exists():
        pytest.skip(f"no console script at {SCRIPT} (pip install -e .)")
    first = Trial(RUN, tmp_path, script)
    to_token = first.wait_for(lambda: first.out.stat().st_size > 0)  # the first token is out
    check(first.interrupt(to_token + 0.05))
    fractions = (0.0, 0.05, 0.2, 0.4, 0.65, 0.9) if script else (0.5,)
    for delay in spread(to_token, fractions):
        result = Trial(RUN, tmp_path, script).interrupt(delay)
        check(result)
    assert not {p.name for p in tmp_path.iterdir()} - {"stdout", "stderr"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return True
    except OSError:
        return False


def test_serve_interrupted_over_start_up_and_mid_stream(tmp_path):
    """Up to the server answering, and with a streamed completion in flight (which would hold uvicorn's
    graceful shutdown until its last token, then print the task it cancelled)."""
    serve = ["serve", "--quiet", "--port"]
    port = free_port()
    busy = Trial(serve + [str(port)], tmp_path)
    to_serving = busy.wait_for(lambda: answers(port))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "def f(x):", "max_tokens": 1000, "stream": True,
                                                        "temperature": 1.0, "seed": 1}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data:")  # a token is out
    result = busy.interrupt(0)
    check(result)
    rest = response.read()  # the stream ended (cut short), the connection closed
    conn.close()
    assert b"[DONE]" in rest or not rest
    assert port_free(port)
    for delay in spread(to_serving, (0.3, 0.8)):
        port = free_port()
        check(Trial(serve + [str(port)], tmp_path).interrupt(delay))
        assert port_free(port)


def test_quantize_interrupted_leaves_no_output(tmp_path):
    out = tmp_path / "int8"  # the demo model: its writing lasts long enough to be hit too
    argv = ["quantize", "--model", str(default_model_path()), "--out", str(out), "--weights", "int8", "--quiet"]
    whole = Trial(argv, tmp_path)
    total = whole.wait_for(lambda: whole.proc.poll() is not None)
    assert whole.proc.returncode == 0 and out.is_dir(), whole.stderr()[-3000:]
    for delay in spread(total, (0.3, 0.65)):
        for p in tmp_path.glob("*int8*"):
            subprocess.run(["rm", "-rf", str(p)], check=True)
        if check(Trial(argv, tmp_path).interrupt(delay), allow_finished=True):
            assert not [p.name for p in tmp_path.glob("*int8*")], "a half-written output folder was left"
        else:
            assert [p.name for p in tmp_path.glob("*int8*")] == ["int8"]  # finished: the output, whole


def test_plan_probe_interrupted_leaves_no_scratch_file(tmp_path):
    model = tmp_path / "model"  # the probe writes its scratch file in the model's folder: a folder of links here
    model.mkdir()
    for f in default_model_path().iterdir():
        (model / f.name).symlink_to(f)
    argv = ["plan", "--model", str(model), "--probe"]
    whole = Trial(argv, tmp_path)
    total = whole.wait_for(lambda: whole.proc.poll() is not None)
    assert whole.proc.returncode == 0, whole.stderr()[-3000:]
    for delay in spread(total, (0.3, 0.65)):
        check(Trial(argv, tmp_path).interrupt(delay), allow_finished=True)
        assert not [p.name for p in model.iterdir() if re.match(r"\.offload-engine-probe", p.name)]

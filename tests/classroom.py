"""The shipped one-machine hub (``classroom/jupyterhub_config.py``) run on loopback for the classroom tests, a
one-exercise lesson to serve through it, and the instructor's commands on a temporary course.

Every port is an ephemeral one on 127.0.0.1 and every wait is bounded in tries and seconds. ``Hub`` records each
process the hub started and each port they listen on, and on exit stops the hub as an administrator would
(SIGTERM), then fails if any of them is still there.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import nbformat
import pytest

from tests.conftest import REPO, course_copy, run_autograde

T = TypeVar("T")
LOOPBACK = "127.0.0.1"
CONFIG = REPO / "classroom" / "jupyterhub_config.py"
LESSON = "hub_check"
POINTS = 2
# A busy 2-core machine needs about a minute to start one student's server (JupyterLab and nbgrader import).
SPAWN_S = 300
STOP_S = 120


def need_hub() -> None:
    """Skip where JupyterHub or a proxy is missing (Windows, or an install without the classroom extra), except
    under CI (``CI`` set, as ``.ci/run`` sets it), where that is an install step gone missing: fail loudly."""
    missing = [m for m in ("jupyterhub", "configurable_http_proxy") if not _importable(m)]
    if missing:
        message = f"not installed: {', '.join(missing)} (python3 bootstrap.py test installs them)"
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the classroom tests; {message}", pytrace=False)
        pytest.skip(message)


def _importable(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def free_port() -> int:
    """A port the kernel hands out on 127.0.0.1 (free now; the hub binds it a moment later)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def wait_for(what: str, probe: Callable[[], T | None], seconds: float, every: float = 0.5) -> T:
    """``probe()``'s first result that is not None, trying at most ``seconds / every`` times; else fail."""
    for _ in range(max(1, int(seconds / every))):
        start = time.monotonic()
        if (result := probe()) is not None:
            return result
        time.sleep(max(0.0, every - (time.monotonic() - start)))
    pytest.fail(f"timed out after {seconds:.0f} s waiting for {what}", pytrace=False)


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((LOOPBACK, port)) == 0


# --- the lesson ----------------------------------------------------------------------------------------------------


def _cell(kind: str, source: str, grade_id: str | None = None, **flags) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source) if kind == "code" else nbformat.v4.new_markdown_cell(source)
    if grade_id:
        meta = {"grade": False, "solution": False, "locked": False, "task": False, **flags}
        cell.metadata["nbgrader"] = {"schema_version": 3, "grade_id": grade_id, **meta}
    return cell


FIRST_CELL_OUTPUT = f"the kernel adds: {sum(range(100))}"  # what the lesson's first code cell prints


def write_lesson(root: Path) -> None:
    """``solutions/hub_check/hub_check.ipynb``: a greeting cell, one answer cell and one graded test cell (public
    and hidden asserts), as the course's lessons are built, small enough that grading takes seconds."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        _cell("markdown", "# Hub check\nWrite `double`."),
        _cell("code", 'print("the kernel adds:", sum(range(100)))', "greeting", locked=True),
        _cell(
            "code",
            "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION",
            "answer",
            solution=True,
        ),
        _cell(
            "code",
            "assert double(3) == 6\n### BEGIN HIDDEN TESTS\nassert double(-4) == -8\n### END HIDDEN TESTS",
            "check_double",
            grade=True,
            locked=True,
            points=POINTS,
        ),
    ]
    folder = root / "solutions" / LESSON
    folder.mkdir(parents=True)
    nbformat.write(nb, folder / f"{LESSON}.ipynb")


def course_with_lesson(root: Path, exchange: Path) -> Path:
    """A temporary course (the repository's ``autograde/``, no real lesson) whose only lesson is ``hub_check``,
    released to its lessons/ and published to ``exchange`` by ``python -m autograde release``."""
    course_copy(root, lessons=())
    write_lesson(root)
    instructor(root, exchange, "release", LESSON)
    return root


def instructor(root: Path, exchange: Path, *args: str, timeout: float = 600) -> str:
    """``python -m autograde *args`` on the course at ``root``, as an instructor who set ``KVLAB_EXCHANGE`` once
    (README.md, "Running a class") and activated no environment; its output, or fail."""
    env = {**os.environ, "KVLAB_EXCHANGE": str(exchange), "PATH": os.defpath}
    result = run_autograde(root, *args, env=env, timeout=timeout)
    return result.stdout + result.stderr


# --- the hub -------------------------------------------------------------------------------------------------------


class Hub:
    """``python -m jupyterhub`` on the shipped config, state and exchange under ``tmp``, ports ephemeral.

    The test adds one thing to the shipped config, through a file that loads it: a service whose token plays the
    administrator's part (create users, start their servers, issue each student a token).
    """

    def __init__(self, tmp: Path, exchange: Path) -> None:
        self.tmp, self.exchange = tmp, exchange
        self.port, self.hub_port, self.api_port = free_port(), free_port(), free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.token = secrets.token_hex(32)
        self.log_path = tmp / "hub.log"
        self.processes: dict[int, tuple[str, float]] = {}  # pid: (command, start time)
        self.ports: set[int] = {self.port, self.hub_port, self.api_port}

    def __enter__(self) -> Hub:
        config = self.tmp / "hub_test_config.py"
        scopes = ["admin:users", "admin:servers", "tokens", "read:users"]
        config.write_text(
            "c = get_config()  # noqa\n"
            f"load_subconfig({str(CONFIG)!r})\n"
            f"c.JupyterHub.services = [{{'name': 'driver', 'api_token': {self.token!r}}}]\n"
            f"c.JupyterHub.load_roles = [{{'name': 'driver', 'services': ['driver'], 'scopes': {scopes!r}}}]\n"
        )
        env = {
            **os.environ,
            "KVLAB_HUB_STATE": str(self.tmp / "state"),
            "KVLAB_EXCHANGE": str(self.exchange),
            "PATH": os.defpath,  # as on a machine where nobody activated the environment
            "PYTHONPATH": str(REPO),
        }
        for name in (
            "KVLAB_HUB_IP",
            "KVLAB_HUB_PORT",
            "KVLAB_HUB_PASSWORD",
            "http_proxy",
            "https_proxy",
            "HTTP_PROXY",
            "HTTPS_PROXY",
        ):
            env.pop(name, None)
        cmd = [
            sys.executable,
            "-m",
            "jupyterhub",
            "-f",
            str(config),
            "--port",
            str(self.port),
            f"--JupyterHub.hub_port={self.hub_port}",
            f"--ConfigurableHTTPProxy.api_url=http://{LOOPBACK}:{self.api_port}",
        ]
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            cmd, cwd=self.tmp, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.processes[self.proc.pid] = ("jupyterhub", _started(self.proc.pid))
        self.http = httpx.Client(
            base_url=self.url, trust_env=False, timeout=60, headers={"Authorization": f"token {self.token}"}
        )
        try:
            wait_for("the hub's API", self._api_up, SPAWN_S)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _api_up(self) -> bool | None:
        if self.proc.poll() is not None:
            pytest.fail(f"the hub exited {self.proc.returncode}:\n{self.log_text()}", pytrace=False)
        try:
            return True if self.http.get("/hub/api/").status_code == 200 else None
        except httpx.TransportError:
            return None

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-6000:]

    def api(self, method: str, path: str, **kw) -> httpx.Response:
        r = self.http.request(method, f"/hub/api/{path}", **kw)
        if r.status_code >= 400:
            pytest.fail(f"{method} /hub/api/{path}: {r.status_code} {r.text}\n{self.log_text()}", pytrace=False)
        return r

    def start_server(self, user: str) -> httpx.Client:
        """Create ``user``, start their server, wait until it is ready; a client holding that user's own token."""
        self.api("POST", f"users/{user}")
        self.api("POST", f"users/{user}/server")

        def ready() -> bool | None:
            if self.proc.poll() is not None:
                pytest.fail(f"the hub exited {self.proc.returncode}:\n{self.log_text()}", pytrace=False)
            server = self.api("GET", f"users/{user}").json()["servers"].get("", {})
            return True if server.get("ready") else None

        wait_for(f"{user}'s server", ready, SPAWN_S, every=2)
        self.record()
        token = self.api("POST", f"users/{user}/tokens", json={"note": "classroom test"}).json()["token"]
        return httpx.Client(
            base_url=f"{self.url}/user/{user}",
            trust_env=False,
            timeout=120,
            headers={"Authorization": f"token {token}"},
        )

    def record(self) -> None:
        """Note every process under the hub and every port they listen on (all of them must be loopback)."""
        import psutil

        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                self.processes[p.pid] = (" ".join(p.cmdline()[:4]), p.create_time())
                for conn in p.net_connections(kind="inet"):
                    if conn.status == psutil.CONN_LISTEN:
                        assert conn.laddr.ip == LOOPBACK, f"{self.processes[p.pid][0]} listens on {conn.laddr}"
                        self.ports.add(conn.laddr.port)
            except psutil.NoSuchProcess:
                pass

    def __exit__(self, *exc) -> None:
        """Stop the hub with SIGTERM (it stops the students' servers and the proxy); then fail on anything left,
        after killing it."""
        import psutil

        if self.proc.poll() is None:
            self.record()
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_S)
        self.http.close()
        left = self._wait_gone(psutil)
        ports = [p for p in sorted(self.ports) if listening(p)]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.log.close()
        if exc[0] is None:
            assert not left and not ports, (
                f"left after the hub stopped: processes {[self.processes[p][0] for p in left]}, ports {ports}"
            )

    def _wait_gone(self, psutil) -> list[int]:
        """The recorded processes still running after up to STOP_S seconds (zombies count as gone)."""
        left: list[int] = []
        for _ in range(int(STOP_S / 0.5)):
            left = [pid for pid, (_, started) in self.processes.items() if _alive(psutil, pid, started)]
            if not left:
                break
            time.sleep(0.5)
        return left


def _started(pid: int) -> float:
    import psutil

    return psutil.Process(pid).create_time()


def _alive(psutil, pid: int, started: float) -> bool:
    """Whether ``pid`` is still the process that started at ``started`` (not a zombie, not a reused pid)."""
    try:
        p = psutil.Process(pid)
        return p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

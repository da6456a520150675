"""``kvlab bench --endpoint`` end to end against the real ``kvlab serve`` (the shipped tiny model) in its own
process, as a user runs the two: completions and chat, with and without ``--input-len``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from .helpers import run_cli

MODEL = "kvlab-tiny-stdlib"

pytestmark = pytest.mark.slow  # a server process to start, and real decoding


@pytest.fixture(scope="module")
def kvlab_serve() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "kvlab.cli", "serve", "--model", MODEL, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert server.poll() is None and time.monotonic() < deadline, "kvlab serve did not start"
        time.sleep(0.2)
    yield url
    server.terminate()
    server.wait(timeout=30)


def test_bench_measures_kvlab_serve_completions_and_chat(kvlab_serve: str, capsys, tmp_path) -> None:
    out = tmp_path / "out.json"
    argv = ("bench", "--endpoint", kvlab_serve + "/v1", "--model", MODEL, "--num-prompts", "3", "--output-len", "6")
    code, stdout, _ = run_cli(capsys, *argv, "--input-len", "40", "--max-concurrency", "2", "--json", str(out))
    assert code == 0 and "counted by the server's usage" in stdout
    result = json.loads(out.read_text())
    assert result["completed"] == 3 and result["output_lens"] == [6, 6, 6]
    # kvlab serve's tokens are bytes: the probe measures one a character, so 40 tokens are sent as 40 (and the
    # server's BOS, where its model has one).
    assert len(set(result["input_lens"])) == 1 and result["input_lens"][0] in (40, 41)
    assert all(len(gaps) == 5 for gaps in result["itls"]) and result["mean_tpot_ms"] > 0

    # Chat, and no --input-len: the default fits the model's 512-token context with the template around it.
    code, stdout, _ = run_cli(capsys, *argv, "--endpoint-type", "chat", "--ignore-eos", "--json", str(out))
    result = json.loads(out.read_text())
    assert code == 0 and result["completed"] == 3 and result["endpoint_type"] == "chat"
    assert all(400 < n <= 512 - 6 for n in result["input_lens"])

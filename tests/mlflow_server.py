"""A real `mlflow server` on a free loopback port (SQLite store, proxied artifacts), for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
# MLflow 3's server also starts a job runner (half a dozen huey consumers polling a queue, a few per cent of a
# core each) for its GenAI jobs; the tracking API the tests use needs none of it, and on 2 cores it costs time.
SERVER_ENV = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


@dataclass(frozen=True)
class MlflowServer:
    uri: str
    process: subprocess.Popen
    log_path: Path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_mlflow_server(root: Path, timeout_s: float = 120, port: int | None = None) -> MlflowServer:
    """`port`: a given port (to restart a stopped server where its clients expect it), else a free one."""
    port = port or _free_port()
    log_path = root / "server.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [
                str(VENV_BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{root / 'mlflow.db'}",
                "--artifacts-destination",
                str(root / "artifacts"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=SERVER_ENV,
        )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                if response.status == 200:
                    return MlflowServer(uri=uri, process=process, log_path=log_path)
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise RuntimeError(f"mlflow server did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)


def stop_mlflow_server(server: MlflowServer) -> None:
    os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()

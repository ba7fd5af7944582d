"""A network cut: sshd in a network namespace, its link taken down for longer than the keepalive timeout.

No TCP reset reaches the orchestrator, only silence: the keepalive limit must close the dead connection,
the follower must reconnect once the link is back, and MLflow must hold exactly what the worker wrote.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import MlflowServer, group_alive, start_orchestrator
from tests.netns import Namespace, netns_unavailable, network_namespace
from tests.sshd import SSHServer, sshd_available, start_sshd, stop_sshd
from tests.test_ssh import SWEEP, assert_exact_histories, ssh_args, wait_for_offset

pytestmark = pytest.mark.slow

KEEPALIVE_S, KEEPALIVE_COUNT = 1, 3  # the connection is declared dead after 3 s of silence
CUT_S = 10


@pytest.fixture
def isolated_sshd(tmp_path: Path) -> Iterator[tuple[Namespace, SSHServer]]:
    reason = netns_unavailable() or sshd_available()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the network-cut test: {reason}")
        pytest.skip(reason)
    with network_namespace() as ns:
        server = start_sshd(tmp_path / "sshd", address=ns.address, prefix=ns.exec_prefix())
        try:
            yield ns, server
        finally:
            stop_sshd(server)


def test_a_network_cut_longer_than_the_keepalive_timeout_is_survived(
    isolated_sshd: tuple[Namespace, SSHServer], mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    ns, server = isolated_sshd
    state = tmp_path / "state"
    timeouts = (
        f"host.keepalive_s={KEEPALIVE_S}",
        f"host.keepalive_count_max={KEEPALIVE_COUNT}",
        "host.connect_timeout_s=3",
        "host.reconnect_budget_s=120",
    )
    args = ssh_args(server, mlflow_server, tmp_path / "remote", state, *SWEEP, *timeouts)
    process = start_orchestrator(args, tmp_path)
    try:
        wait_for_offset(state, 2000, process)
        ns.set_link(up=False)
        time.sleep(CUT_S)
        assert process.poll() is None, "a cut shorter than the reconnect budget must not end the run"
        ns.set_link(up=True)
        stdout, stderr = process.communicate(timeout=300)
    finally:
        ns.set_link(up=True)
        process.kill()
    assert process.returncode == 0, stdout + stderr
    assert "lost localhost_ssh" in stdout and "reconnected" in stdout, stdout
    (run_dir,) = (tmp_path / "remote" / "runs").iterdir()
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    assert client.get_run(run_dir.name).info.status == "FINISHED"
    assert_exact_histories(client, run_dir)
    pgid = int((run_dir / "pid").read_text())
    deadline = time.monotonic() + 15  # its supervisor exits just after writing exit_code; a busy machine lags
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_alive(pgid), "the worker must be gone once its run is finished"

"""Job runs signed by the user who made them, so a resumed sweep reuses only runs of its own.

A tracking server without authentication lets anyone create a run, its params matching a job's value for value,
and its files. Reusing such a run would put its figures in the sweep's table as the sweep's own. So when a job
ends FINISHED the orchestrator tags its run with an HMAC-SHA256, under a key kept in the user's private state
folder (`orchestrator.state_dir/signing.key`, 32 random bytes, 0600, made on first use), over:

- the run's id (a signature copied onto another run does not verify),
- its settings digest (`orchestrator.config_hash`: the worker's settings, the seed, the prompt set's text),
- the SHA-256 of each file its figures are computed from (`generations.jsonl`, `decode_summary.json`), as
  MLflow holds them.

A run is reused (`sweep.resume`, and every `sweep.reused.<job>` a sweep's page reads) only when the signature
verifies against the files as they are now. Another machine, or another user, has another key: its runs are
decoded again, which costs time, never a wrong figure.

A two-phase job's phase 1 (`phase_1.json`) is signed apart, as the orchestrator receives it from the worker
(`phase_1_signature`: the run's id, its settings digest, the file's SHA-256): a job stopped in phase 2 has no
FINISHED run, and a sweep run again goes on from that phase 1 only where its signature verifies.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import tempfile
from pathlib import Path

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from orchestrator.tracking import tags
from remote_worker.safe_files import Folder, UnsafePath, private_folder

KEY_FILE = "signing.key"
KEY_BYTES = 32
SIGNED_FILES = ("generations.jsonl", "decode_summary.json")  # what the sweep's and the paper's tables read


class KeyUnavailable(Exception):
    """The signing key cannot be read or made; the message is one line naming the fix."""


def signing_key(state_dir: Path) -> bytes:
    """The user's key, made on first use (exclusive creation: two commands at once agree on one key)."""
    try:
        private_folder(state_dir)
        folder = Folder(state_dir)
        folder.create(KEY_FILE, secrets.token_bytes(KEY_BYTES))  # no-op where it exists
        info = folder.stat(KEY_FILE)
        key = folder.read(KEY_FILE)
    except (OSError, UnsafePath) as exc:
        raise KeyUnavailable(f"orchestrator.state_dir {state_dir}: the signing key cannot be read ({exc})") from exc
    if info is None or key is None or len(key) != KEY_BYTES or info.st_mode & 0o077:
        raise KeyUnavailable(
            f"{Path(state_dir) / KEY_FILE} is not a private {KEY_BYTES}-byte key; remove it (a new one is made, "
            "and runs signed with the old one are decoded again)"
        )
    return key


def file_digests(client: MlflowClient, run_id: str) -> dict[str, str]:
    """The SHA-256 of each signed file as MLflow holds it now ("" where the run has none)."""
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in SIGNED_FILES:
            try:
                path = Path(client.download_artifacts(run_id, name, tmp))
                found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
            except Exception:  # noqa: BLE001 - an absent file is a signed absence, not an error
                found[name] = ""
    return found


def signature(key: bytes, run_id: str, config_hash: str, digests: dict[str, str]) -> str:
    payload = json.dumps({"run": run_id, "settings": config_hash, "files": digests}, sort_keys=True)
    return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


def phase_1_signature(key: bytes, run_id: str, config_hash: str, data: bytes) -> str:
    payload = json.dumps(
        {"run": run_id, "settings": config_hash, "phase_1": hashlib.sha256(data).hexdigest()}, sort_keys=True
    )
    return hmac.new(key, payload.encode(), hashlib.sha256).hexdigest()


def sign_run(client: MlflowClient, run_id: str, key: bytes) -> None:
    """Tag a job run that FINISHED with its signature (after its files are logged)."""
    run = client.get_run(run_id)
    config_hash = run.data.tags.get(tags.CONFIG_HASH, "")
    client.set_tag(run_id, tags.SIGNATURE, signature(key, run_id, config_hash, file_digests(client, run_id)))


def unsigned_reason(client: MlflowClient, run: Run, key: bytes) -> str | None:
    """Why `run` is not one this user's orchestrator finished (None: its signature verifies)."""
    given = run.data.tags.get(tags.SIGNATURE)
    if not given:
        return "it carries no signature of this user's orchestrator"
    expected = signature(
        key, run.info.run_id, run.data.tags.get(tags.CONFIG_HASH, ""), file_digests(client, run.info.run_id)
    )
    if not hmac.compare_digest(given, expected):
        return "its signature does not verify (made with another key, or its files changed since)"
    return None


def phase_1_problem(run: Run, config_hash: str, data: bytes, key: bytes) -> str | None:
    """Why `data`, the phase 1 MLflow holds for `run`, is not the one this user's orchestrator received for a job
    with these settings (None: its signature verifies)."""
    given = run.data.tags.get(tags.PHASE_1_SIGNATURE)
    if not given:
        return "its phase 1 carries no signature of this user's orchestrator"
    if not hmac.compare_digest(given, phase_1_signature(key, run.info.run_id, config_hash, data)):
        return "its phase 1's signature does not verify (made with another key, or the file changed since)"
    return None

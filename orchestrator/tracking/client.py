"""The tracking store as the lifecycle sees it: opened with a deadline, and its outages told from its errors.

MLflow's HTTP client retries a refused connection for about four minutes before it raises, which would
freeze the follow loop while events pile up. Here each request gets `tracking.timeout_s` and no retries of
its own; the orchestrator does the waiting, because it knows what is waiting (the events, kept locally by
byte offset) and can keep reading the worker meanwhile.
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from orchestrator.config.redaction import redact_text, redact_url
from orchestrator.config.settings import TrackingConfig

# How MLflow words a request that never got an answer, or got a gateway's or an overloaded server's.
_NO_ANSWER = re.compile(r"API request to \S+ failed with (timeout )?exception|failed with error code 5\d\d")


class TrackingUnavailable(RuntimeError):
    """The tracking store did not answer (refused, timed out, 5xx); nothing was lost, try again later."""


def is_outage(error: BaseException) -> bool:
    """Whether `error` says the store is out of reach or failing (no answer, a 5xx such as a database that
    is down or locked), as opposed to a request it refused (4xx: a bug to report, not to wait out).

    Only errors of the HTTP client and of MLflow count: an OSError of the SSH connection (which the sink
    may meet fetching an artifact from the host) is the host's, and the follow loop reconnects for it."""
    if isinstance(error, TrackingUnavailable):
        return True
    if isinstance(error, (requests.ConnectionError, requests.Timeout)):
        return True
    if isinstance(error, requests.HTTPError):
        return error.response is not None and error.response.status_code >= 500
    if isinstance(error, MlflowException):
        return bool(_NO_ANSWER.search(str(error))) or error.get_http_status_code() >= 500
    return False


def short_reason(error: BaseException) -> str:
    """The last clause of a long MLflow/urllib3 message: what a person needs (refused, timed out)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    for marker in ("Failed to establish a new connection: ", "Read timed out", "Caused by "):
        if marker in text:
            text = text[text.index(marker) :]
            break
    text = re.sub(r"<[^>]*>:?\s*", "", text).strip(" ,'\")(")
    return redact_text(text[:160])


@contextmanager
def outages_named() -> Iterator[None]:
    """Turn an MLflow error that means "no answer" into TrackingUnavailable; let every other error through."""
    try:
        yield
    except TrackingUnavailable:
        raise
    except Exception as exc:
        if is_outage(exc):
            raise TrackingUnavailable(short_reason(exc)) from exc
        raise


def configure_requests(tracking: TrackingConfig) -> None:
    """One attempt of at most `timeout_s` per request (MLflow reads these when each request is made)."""
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, round(tracking.timeout_s)))
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # the summary prints the URL


@contextmanager
def _first_use(uri: str) -> Iterator[None]:
    """A local SQLite store is created (its schema migrated) by the first request of the first process that
    opens it: two processes doing so at once (`make run` and `make sweep` on a fresh checkout) race, and the
    loser fails with pages of SQL. So the first request holds a lock beside the database (an OS lock: released
    whoever holds it however it ends); a server store needs none."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    database = Path(uri.removeprefix("sqlite:///"))
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(database.with_name(database.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def open_tracking(tracking: TrackingConfig) -> MlflowClient:
    """A client for the store, checked with one cheap request: an unreachable store is one line, at once."""
    configure_requests(tracking)
    try:
        with outages_named(), _first_use(tracking.uri):
            client = MlflowClient(tracking_uri=tracking.uri)
            client.search_experiments(max_results=1)
    except TrackingUnavailable as exc:
        raise TrackingUnavailable(
            f"tracking.uri {redact_url(tracking.uri)} does not answer within {tracking.timeout_s:g}s ({exc}); "
            "start the server or check tracking.uri"
        ) from None
    return client

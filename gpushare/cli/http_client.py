"""The CLI's HTTP client: finds the daemon (GPUSHARE_HOST, else OLLAMA_HOST), sends the API key, streams
NDJSON (and /api/load's progress as a bar)."""

from __future__ import annotations

import http.client
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Iterator

from gpushare.cli.format import ProgressBar, keep_alive_value
from gpushare.settings.settings import DEFAULT_HOST, parse_host
from gpushare.settings.environment import daemon_host


class DaemonUnreachable(Exception):
    pass


class ApiFailure(Exception):
    pass


# ---------------------------------------------------------------------------- HTTP client

def daemon_url() -> str:
    """Base URL of the daemon from GPUSHARE_HOST (else OLLAMA_HOST); a wildcard bind address is reached on
    loopback."""
    raw = daemon_host() or DEFAULT_HOST
    scheme = "https" if raw.strip().startswith("https://") else "http"
    host, port = parse_host(raw, "GPUSHARE_HOST")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def _open(method: str, path: str, body: dict | None, timeout_s: float | None):
    url = daemon_url() + path
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if os.environ.get("GPUSHARE_API_KEY"):  # the daemon's tenants: which one we are
        headers["Authorization"] = f"Bearer {os.environ['GPUSHARE_API_KEY']}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        return urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            message = json.loads(text)["error"]
        except (ValueError, KeyError, TypeError):
            message = text or e.reason
        raise ApiFailure(message if isinstance(message, str) else json.dumps(message)) from None
    except (urllib.error.URLError, ConnectionError) as e:
        raise DaemonUnreachable(f"could not connect to the gpushare daemon at {daemon_url()} "
                                f"({getattr(e, 'reason', e)}); is `gpushare serve` running?") from None


def call(method: str, path: str, body: dict | None = None, timeout_s: float | None = 600) -> dict:
    with _open(method, path, body, timeout_s) as resp:
        return json.loads(resp.read() or b"{}")


def stream(path: str, body: dict) -> Iterator[dict]:
    """POST and yield NDJSON objects; an error object mid-stream raises ApiFailure."""
    with _open("POST", path, body, None) as resp:
        try:
            for line in resp:
                if line.strip():
                    obj = json.loads(line)
                    if "error" in obj:
                        raise ApiFailure(obj["error"])
                    yield obj
        except (ConnectionError, http.client.HTTPException) as e:
            raise ApiFailure(f"the daemon closed the connection mid-answer ({type(e).__name__})") from None


def load_with_progress(model: str, keep_alive: str | None) -> dict:
    """Load through /api/load, drawing its streamed progress on stderr; returns the last line."""
    body = {"model": model}
    if keep_alive is not None:
        body["keep_alive"] = keep_alive_value(keep_alive)
    bar, final, total = ProgressBar(f"loading {model}"), {}, 0
    try:
        for line in stream("/api/load", body):
            if line.get("status") == "loading" and line.get("total"):
                total = line["total"]
                bar.update(line["completed"], total)
            elif line.get("status") == "queued" and not bar.tty:
                print(f"waiting for memory to load {model}", file=sys.stderr)
            elif line.get("status") == "success" and total:
                bar.update(total, total)  # progress is sampled: the last sample may have come before the end
            final = line
    finally:
        bar.close()
    return final



def pull_with_progress(model: str, insecure: bool) -> None:
    """Pull through /api/pull, drawing a progress bar per layer and the other steps as lines on stderr."""
    bars: dict[str, ProgressBar] = {}
    current = None
    try:
        for line in stream("/api/pull", {"model": model, "insecure": insecure, "stream": True}):
            digest = line.get("digest")
            if digest and line.get("total") is not None:
                if digest != current and current in bars:
                    bars[current].close()  # layers come one after another: each keeps its own line
                current = digest
                bar = bars.setdefault(digest, ProgressBar(line["status"]))
                bar.update(line.get("completed", 0), line["total"])
            elif line.get("status"):
                if current in bars:
                    bars[current].close()
                    current = None
                print(line["status"], file=sys.stderr)
    finally:
        if current in bars:
            bars[current].close()

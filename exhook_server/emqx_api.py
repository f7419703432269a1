"""A small client of EMQX's REST API (`/api/v5`, HTTP basic auth with an API key and secret).

JSON in and out over urllib, one bounded request at a time. Failures come out as three
exceptions: `EmqxUnreachable` (no answer: connection refused, DNS, timeout), `EmqxAuthError`
(401/403: a wrong key or secret, or a key without the scope) and `EmqxHttpError` (any other
HTTP error, with its status and body). The secret never appears in a message or a log line.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from exhook_server.config import Config
from exhook_server.errors import ConfigError, FanoutError

#: Largest answer read from the API: the lists we ask for are small (hooks, rules of a page).
_MAX_BODY_BYTES = 16 << 20


class EmqxApiError(FanoutError):
    """The REST API could not be used."""


class EmqxUnreachable(EmqxApiError):
    """No HTTP answer from emqx_api_url."""


class EmqxAuthError(EmqxApiError):
    """EMQX refused the API key or secret (HTTP 401 or 403)."""


class EmqxHttpError(EmqxApiError):
    """An HTTP error other than 401/403; `status` and `body` say which."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {body[:300]}")
        self.status = status
        self.body = body


def _read_secret(path: str, name: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path}: {exc.strerror}") from None


def credentials(cfg: Config) -> tuple[str, str]:
    """The API key and secret in force: the *_file settings win over the inline ones."""
    key = _read_secret(cfg.emqx_api_key_file, "emqx_api_key_file") if cfg.emqx_api_key_file else cfg.emqx_api_key
    secret = (
        _read_secret(cfg.emqx_api_secret_file, "emqx_api_secret_file")
        if cfg.emqx_api_secret_file
        else cfg.emqx_api_secret
    )
    if not key or not secret:
        raise ConfigError("EMQX API key missing: set emqx_api_key and emqx_api_secret (or their *_file settings)")
    return key, secret


class EmqxApi:
    """`GET|POST|PUT|DELETE <emqx_api_url>/api/v5<path>`; counts the writes it made."""

    def __init__(self, base_url: str, key: str, secret: str, *, timeout_s: float = 10.0) -> None:
        base = base_url.rstrip("/")
        self.base = base if base.endswith("/api/v5") else base + "/api/v5"
        self._auth = "Basic " + base64.b64encode(f"{key}:{secret}".encode()).decode()
        self.timeout_s = timeout_s
        #: (method, path) of every POST, PUT and DELETE sent, in order.
        self.writes: list[tuple[str, str]] = []

    @classmethod
    def from_config(cls, cfg: Config) -> EmqxApi:
        """A client for emqx_api_url with the configured key (ConfigError when either is missing)."""
        if not cfg.emqx_api_url:
            raise ConfigError("emqx_api_url is empty: where is EMQX's REST API (e.g. http://emqx:18083)?")
        key, secret = credentials(cfg)
        return cls(cfg.emqx_api_url, key, secret)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """One request; the decoded JSON answer (None when empty)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", self._auth)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if method != "GET":
            self.writes.append((method, path))
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                text = resp.read(_MAX_BODY_BYTES).decode(errors="replace")
        except urllib.error.HTTPError as exc:
            detail = exc.read(4096).decode(errors="replace")
            if exc.code in (401, 403):
                raise EmqxAuthError(
                    f"EMQX at {self.base} refused the API key (HTTP {exc.code}): {detail[:200]}"
                ) from None
            raise EmqxHttpError(method, path, exc.code, detail) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise EmqxUnreachable(f"EMQX REST API at {self.base} unreachable: {reason}") from None
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except ValueError:
            raise EmqxHttpError(method, path, 200, f"not JSON: {text[:200]}") from None

    def get(self, path: str) -> Any:
        return self.call("GET", path)

    def get_or_none(self, path: str) -> Any:
        """GET, or None when EMQX answers 404."""
        try:
            return self.call("GET", path)
        except EmqxHttpError as exc:
            if exc.status == 404:
                return None
            raise

    def quote(self, name: str) -> str:
        """A path segment."""
        return urllib.parse.quote(name, safe="")

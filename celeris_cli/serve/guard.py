"""What every request passes before a route sees it, and what every answer passes on its way out.

In: a browser page must not reach a loopback server. A page can send a "simple" cross-site request (JSON
as `text/plain`, a form, a multipart upload) and, through DNS rebinding, read the answers under its own
name. So a body must be `application/json` (`multipart/form-data` for an upload), else 415; a `Host`
outside the allow-list (127.0.0.1, localhost, [::1], any port, and what `--host` names) is a 421; an
`Origin` whose host is not in the same list (a page of another site, or `null`) is a 403. Programs such
as the `openai` client send no Origin and a loopback Host, and pass.

Out: every answer is counted in /metrics by route template and status; an error the routes did not turn
into an answer is a 500 in OpenAI's shape, and every 5xx carries `Connection: close` so that a keep-alive
client's next request goes on a fresh connection instead of into a reset one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from .schema import APIError
from .state import ServeState

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
ANY_HOST = "*"  # in ServeState.hosts: --host is a wildcard address, where any name may reach the server
UPLOAD = "/v1/files"


def allowed_hosts(host: str) -> frozenset[str]:
    """The names a request's Host and Origin may carry beside loopback, for `--host HOST`: HOST itself, or
    any name when HOST is a wildcard address (a key is then required, `settings.check_exposure`)."""
    name = host.strip("[]").lower()
    return frozenset({ANY_HOST}) if name in ("0.0.0.0", "::", "") else frozenset({name})


def hostname(value: str) -> str:
    """The name of a Host header's value, port and IPv6 brackets dropped: `[::1]:8000` -> `::1`."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    def __init__(self, app: App, state: ServeState) -> None:
        self.app = app
        self.state = state

    def _allowed(self, name: str) -> bool:
        return name in LOOPBACK or name in self.state.hosts or ANY_HOST in self.state.hosts

    def refusal(self, scope: Scope) -> APIError | None:
        """Why a request may not reach a route, or None."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        host = headers.get("host")
        if host is not None and not self._allowed(hostname(host)):
            return APIError(421, f"Host {host!r} is not a name of this server", code="misdirected_request")
        origin = headers.get("origin")
        if origin is not None and not self._allowed((urlsplit(origin).hostname or "").lower()):
            return APIError(403, f"cross-site requests are refused (Origin {origin!r})", code="cross_origin")
        has_body = headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers
        if scope["method"] in ("POST", "PUT", "PATCH") and has_body:
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            want = "multipart/form-data" if scope["path"] == UPLOAD else "application/json"
            if kind != want:
                return APIError(415, f"Content-Type must be {want}, got {kind or 'none'!r}", code="unsupported_media")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if status >= 500:  # the connection may be in any state: the client starts a fresh one
                    message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
            await send(message)

        refused = self.refusal(scope)
        try:
            if refused is not None:
                await respond(refused, sent)
            else:
                await self.app(scope, receive, sent)
        except Exception:  # noqa: BLE001 - one request's failure is its own 500, never the connection's
            log.exception("internal error on %s", scope["path"])
            if status:  # the answer had started: all that is left is to end the connection
                raise
            await respond(APIError(500, "internal error; see the server's log", "server_error"), sent)
        route = getattr(scope.get("route"), "path", "other")  # the template: ids never become labels
        self.state.metrics.requests.labels(route, str(status)).inc()


async def respond(error: APIError, send: Send) -> None:
    """An error answer in OpenAI's shape, sent by hand (outside the app)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

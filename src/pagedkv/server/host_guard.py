"""Host and Origin checks against browsers (DNS rebinding and cross-site requests).

A server on loopback with no API key trusts whoever can open a socket to it. A web page
in the user's browser can: it can POST to ``http://127.0.0.1:8000`` from its own origin
(the answer is unreadable, the work is done), and after rebinding its own name to
127.0.0.1 it can read answers too, the class of Ollama's CVE-2024-28224. Two header
checks close both, because a browser cannot forge either header:

    Host:   must name an allowed host (rebinding keeps the attacker's name here)
    Origin: if present, must name an allowed host (a cross-site page sends its own)

Allowed: ``localhost``, ``127.0.0.1`` and ``[::1]``, any port, plus ``--allowed-hosts``
(``*`` allows any host and any origin). With API keys configured the checks are off: a
browser cannot attach the key cross-site without a CORS preflight, which is never granted.
"""

from __future__ import annotations

import json
import re

from pagedkv.server.protocol import APIError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

# RFC 9110 section 7.2 / RFC 3986 section 3.2: host [":" port], the host a registered name
# or an IPv4 address, or an IPv6 literal in brackets. No userinfo, path, query or fragment:
# 'evil.com@localhost' and 'localhost#evil.com' are not hosts (a URL parser would say
# 'localhost' for both).
_AUTHORITY = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+))(?::[0-9]{1,5})?")
_ORIGIN = re.compile(r"(?:https?)://(?P<authority>[^/?#@]+)", re.IGNORECASE)


def host_name(authority: str) -> str | None:
    """``'LocalHost:8000'`` -> ``'localhost'``, ``'[::1]:80'`` -> ``'::1'``; None when it is
    not exactly ``host[:port]`` (empty, userinfo, a path or fragment, spaces)."""
    m = _AUTHORITY.fullmatch(authority)
    if m is None:
        return None
    return (m["v6"] or m["name"]).lower()


def origin_host(origin: str) -> str | None:
    """The host of an ``Origin`` header, exactly ``scheme://host[:port]``
    (``'http://localhost:3000'`` -> ``'localhost'``); None for ``null`` (sandboxed frames,
    ``file:``) or anything else."""
    m = _ORIGIN.fullmatch(origin)
    return host_name(m["authority"]) if m else None


class HostGuard:
    """ASGI middleware: 403 (an OpenAI-style JSON error) for an HTTP request whose ``Host``
    is not an allowed host, or whose ``Origin`` names a host that is not. ``on_refuse``
    is called once per refusal (the metrics count it)."""

    def __init__(self, app, allowed_hosts: list[str], on_refuse=lambda: None) -> None:
        self.app, self.on_refuse = app, on_refuse
        self.any_host = "*" in allowed_hosts
        extra = [host_name(h) for h in allowed_hosts if h != "*"]
        self.allowed = frozenset(LOOPBACK_HOSTS) | {h for h in extra if h}

    async def __call__(self, scope, receive, send) -> None:
        error = self.refusal(scope) if scope["type"] == "http" and not self.any_host else None
        if error is None:
            await self.app(scope, receive, send)
            return
        self.on_refuse()
        await _send_json(send, error)

    def refusal(self, scope) -> APIError | None:
        pairs = [(k.decode(), v.decode("latin-1")) for k, v in scope["headers"] if k in (b"host", b"origin")]
        headers = dict(pairs)
        if len(headers) < len(pairs):
            return APIError(400, "the request repeats its Host or Origin header", code="duplicate_header")
        if host_name(headers.get("host", "")) not in self.allowed:
            return APIError(403, "this Host is not allowed: the server accepts loopback names only "
                            "(add more with --allowed-hosts, or set --api-key)", code="host_not_allowed")
        if "origin" in headers and origin_host(headers["origin"]) not in self.allowed:
            return APIError(403, "cross-origin browser requests are refused (the Origin is not an allowed "
                            "host; see --allowed-hosts)", code="origin_not_allowed")
        return None


async def _send_json(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

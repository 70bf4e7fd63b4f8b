"""What every process that listens on a port enforces, ``pagedkv serve`` and ``pagedkv proxy``
alike: one implementation, one set of flags.

- **API keys** (``--api-key``, repeatable, or ``$PAGEDKV_API_KEY``): ``/v1/*`` and the
  tokenizer routes need ``Authorization: Bearer <key>`` (401 otherwise; compared in constant
  time).
- **Host and Origin** (without keys): only loopback names and ``--allowed-hosts`` in ``Host``;
  a foreign ``Origin`` is refused (403): DNS rebinding and cross-site browser requests
  (:mod:`pagedkv.server.host_guard`).
- **Bodies**: POST bodies must be uncompressed ``application/json`` (415; a browser can send
  ``text/plain`` cross-site without a preflight, never JSON), at most ``--max-body-bytes``
  (413, refused from ``Content-Length`` or as soon as the stream passes it, never read whole),
  and a JSON object (400).
- **Connections** (:mod:`pagedkv.server.http_limits`): header and body deadlines, a write
  deadline for clients that stop reading, ``--limit-concurrency`` connections (503 past it).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from dataclasses import dataclass

from starlette.requests import Request

from pagedkv.config.engine import parse_size
from pagedkv.server.host_guard import HostGuard, host_name
from pagedkv.server.http_limits import HTTPLimits
from pagedkv.server.protocol import APIError

DEFAULT_MAX_BODY_BYTES = 2**20
API_KEY_ENV = "PAGEDKV_API_KEY"


@dataclass(frozen=True)
class GuardConfig:
    """The guards of one listener: ``api_keys`` (none: Host/Origin checks instead),
    ``allowed_hosts`` (Host names accepted besides loopback without keys; ``"*"``: any),
    ``max_body_bytes`` (bytes) and the connection ``limits``."""

    api_keys: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    limits: HTTPLimits = HTTPLimits()

    def __post_init__(self) -> None:
        """Raises ValueError for an empty API key, or one with spaces around it (a header's
        key arrives trimmed: it could never match)."""
        for k in self.api_keys:
            if not k.strip():
                raise ValueError("an API key must not be empty")
            if k != k.strip():
                raise ValueError("an API key must not start or end with whitespace (no request could send it)")


class Guards:
    """The request checks of :class:`GuardConfig` (routes call them) and the middleware
    (:meth:`install`)."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self._keys = [k.encode() for k in config.api_keys]

    def api_key(self, request: Request) -> bytes | None:
        """The caller's key (bytes), or None when no keys are configured.

        Raises:
            APIError: 401 for a missing or wrong key.
        """
        if not self._keys:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key_b = key.strip().encode("latin-1")  # the header's bytes (a UTF-8 key arrives as UTF-8 bytes)
        if scheme.lower() == "bearer" and key_b and any(hmac.compare_digest(key_b, k) for k in self._keys):
            return key_b
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        """The body as a JSON object.

        Raises:
            APIError: 415 (not uncompressed JSON), 413 (over ``max_body_bytes``), 400 (not a
                JSON object, or a repeated Content-Type/Content-Encoding header).
        """
        require_json(request.headers)
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks), parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        return body

    def install(self, app, on_refuse=lambda: None) -> None:
        """Add the Host/Origin middleware to ``app`` when no API keys are configured (with
        keys a browser cannot attach one cross-site without a preflight, never granted)."""
        if not self._keys:
            app.add_middleware(HostGuard, allowed_hosts=list(self.config.allowed_hosts), on_refuse=on_refuse)


def require_json(headers) -> None:
    """Raises APIError 415 unless the body is declared ``application/json`` and not encoded
    (400 if either header is repeated: which one counts would be the parser's guess)."""
    for name in ("content-type", "content-encoding"):
        if len(headers.getlist(name)) > 1:
            raise APIError(400, f"the request has more than one {name} header", code="duplicate_header")
    media = headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"the body must be sent with 'Content-Type: application/json', not "
                       f"{media or 'none'!r}", code="unsupported_media_type")
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
                       code="unsupported_media_type")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


# ---- flags -------------------------------------------------------------------------------
def add_guard_args(group, who: str = "the server") -> None:
    """The guards' flags on an ``argparse`` group (``serve`` and ``proxy`` share them)."""
    group.add_argument("--api-key", action="append", default=None,
                       help=f"require 'Authorization: Bearer KEY' on {who}'s /v1/* routes (repeatable; also "
                       f"${API_KEY_ENV})")
    group.add_argument("--allowed-hosts", default="",
                       help="without an API key, Host names accepted besides localhost, 127.0.0.1 and [::1], "
                       "comma-separated ('*' = any); browser requests from other origins get 403")
    group.add_argument("--max-body-bytes", default="1MiB",
                       help="largest request body, e.g. 4MiB (default: %(default)s)")
    group.add_argument("--limit-concurrency", type=int, default=1024,
                       help="most open connections (and requests) at once; past it, new requests get 503; "
                       "0 = no limit (default: %(default)s)")


def guard_config(args) -> GuardConfig:
    """The :class:`GuardConfig` of parsed :func:`add_guard_args` flags.

    Raises:
        ValueError: an empty or space-padded API key, a bad size, a negative
            ``--limit-concurrency`` or a bad ``--allowed-hosts`` entry.
    """
    keys = list(args.api_key or []) + ([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else [])
    if args.limit_concurrency < 0:
        raise ValueError(f"--limit-concurrency must be >= 0, got {args.limit_concurrency}")
    return GuardConfig(tuple(keys), tuple(parse_allowed_hosts(args.allowed_hosts)),
                       parse_size(args.max_body_bytes, "--max-body-bytes"),
                       HTTPLimits(limit_concurrency=args.limit_concurrency or None))


def parse_allowed_hosts(text: str) -> list[str]:
    """``'a.lan, 10.0.0.5,[fe80::1]'`` -> the names. Raises ValueError naming a bad one."""
    names = [h.strip() for h in text.split(",") if h.strip()]
    bad = [h for h in names if h != "*" and host_name(h) is None]
    if bad or (text.strip() and not names):
        raise ValueError(f"--allowed-hosts takes comma-separated host names, got {text!r}")
    return names


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a listener on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

"""What one client may hold of the server, and who may reach it (docs/server.md, "Running it
safely"): plain data and checks, no web framework, so that ``dikkat serve`` checks its arguments
with them before anything loads.

Who may reach it. A browser sends any page's requests to any address, a local one too, so a
server on 127.0.0.1 is reachable by every page its user visits; and by DNS rebinding (a name the
attacker controls, pointed at 127.0.0.1 after the page loads), under a name of the attacker's
choosing, which makes the page's requests same-origin for the browser. The name survives in the
``Host`` header, so a request is answered only when its Host names this server: a loopback name,
the address the request arrived at, or a name the operator allowed (the defence the Fetch
standard's CORS protocol leaves to servers: https://fetch.spec.whatwg.org/#cors-protocol, and
https://en.wikipedia.org/wiki/DNS_rebinding). An ``Origin`` other than those allowed is refused,
so no page's script reads an answer, and bodies must be ``application/json``, which no HTML form
can send ("simple" requests skip the browser's preflight).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

MIB = 2**20
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})  # listening on every interface
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#@\s]+")  # scheme://host[:port], as browsers send


@dataclass(frozen=True)
class Limits:
    """The server's bounds on one connection and one request; past each, a refusal or a closed
    connection, never a wait without end. The defaults suit a server for one machine's clients;
    ``dikkat serve --max-body-mb`` sets the body's."""

    max_body_bytes: int = 16 * MIB  # a request's body; past it 413, read no further
    # seconds for a request's line and headers; then the connection closes
    head_timeout: float = 10.0
    body_timeout: float = 30.0  # seconds for the whole body once the head is in; then 408
    keep_alive: int = 5  # seconds an idle kept-alive connection stays open (uvicorn's default)
    max_connections: int = 64  # connections and requests at once; past it uvicorn answers 503
    max_head_bytes: int = 16 * 1024  # a request's line and headers (h11's default); past it 400

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "keep_alive", "max_connections", "max_head_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")
        for name in ("head_timeout", "body_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(
                    f"Limits.{name} must be a positive number of seconds, got {value!r}"
                )


@dataclass(frozen=True)
class Access:
    """The Host names and the browser origins the server answers, besides the loopback names
    and the address a request arrived at; ``"*"`` in either allows any."""

    hosts: frozenset[str] = field(default_factory=frozenset)
    origins: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, hosts: Iterable[str] = (), origins: Iterable[str] = ()) -> Access:
        """Checked and normalised: host names lower-case without brackets or port, origins
        ``scheme://host[:port]`` lower-case; ``ValueError`` naming a malformed one."""
        return cls(
            frozenset(_host_entry(h) for h in hosts), frozenset(_origin_entry(o) for o in origins)
        )

    def host_allowed(self, header: str | None, local_address: str | None) -> bool:
        """Whether a request's ``Host`` header names this server; ``local_address``: the address
        the request arrived at (an IP address literal in Host is allowed when it is that one,
        which is how a server listening on every interface is reached by address)."""
        if "*" in self.hosts:
            return True
        name = host_name(header)
        if name is None:
            return False
        if name in LOOPBACK_NAMES or name in self.hosts:
            return True
        return local_address is not None and _same_address(name, local_address)

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin.strip().lower().rstrip("/") in self.origins


def host_name(header: str | None) -> str | None:
    """The host of a ``Host`` header value (``[::1]:8000`` → ``::1``), lower-case; None when it
    is missing or malformed."""
    if not header or any(c in header for c in "@/\\?# \t"):
        return None
    if header.startswith("["):
        name, bracket, rest = header[1:].partition("]")
        if not bracket or (rest and not (rest[0] == ":" and rest[1:].isdigit())):
            return None
    else:
        name, colon, port = header.partition(":")
        if colon and not port.isdigit():
            return None
    return name.lower() or None


def _same_address(name: str, address: str) -> bool:
    try:
        return ipaddress.ip_address(name) == ipaddress.ip_address(address)
    except ValueError:  # a name, not an address literal
        return False


def _host_entry(text: str) -> str:
    entry = text.strip().lower()
    if entry == "*":
        return entry
    name = entry[1:-1] if entry.startswith("[") and entry.endswith("]") else entry
    if not name or any(c in name for c in "@/\\?# \t,") or (":" in name and not _is_ip(name)):
        raise ValueError(
            f"allowed host {text!r} must be a host name or an IP address, without a port"
        )
    return name


def _origin_entry(text: str) -> str:
    entry = text.strip().lower().rstrip("/")
    if entry not in ("*", "null") and not _ORIGIN.fullmatch(entry):
        raise ValueError(
            f"allowed origin {text!r} must be scheme://host[:port] (as a browser sends it, e.g. "
            "http://localhost:3000), 'null' or '*'"
        )
    return entry


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def names(text: str) -> list[str]:
    """A comma-separated list (``--allowed-hosts a,b``) as its non-empty items."""
    return [item.strip() for item in text.split(",") if item.strip()]


def check_api_key(key: object) -> str:
    """``key`` if a client can send it in ``Authorization: Bearer KEY`` (printable ASCII, no
    space: an HTTP header carries bytes, and a key with a space would not come back whole);
    ``ValueError`` otherwise."""
    if not isinstance(key, str) or not key:
        raise ValueError("api_key must be a non-empty string or None")
    odd = [i for i, c in enumerate(key) if not (c.isascii() and c.isprintable()) or c.isspace()]
    if odd:  # (the key is a secret: its position is named, not the character)
        raise ValueError(
            "the API key must be printable ASCII without spaces (a client sends it in an HTTP "
            f"header); its character {odd[0] + 1} of {len(key)} is not"
        )
    return key

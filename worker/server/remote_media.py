"""Fetching an image or a video by its http(s) URL (`--allow-remote-media`): where, how long, how much.

The client names the URL and the worker fetches it, from inside the box: without care that is a
request forgery (SSRF) towards the box's own ports, the private network behind it, or a cloud
metadata service (169.254.169.254) that hands out credentials. So each fetch:

- checks the addresses: the host of each hop is resolved once, and every address it resolves to
  must be public. Loopback, private (10/8, 172.16/12, 192.168/16, fc00::/7) and shared (100.64/10)
  addresses are refused unless the worker runs with `--allow-private-media` (a media server on
  the LAN); link-local (169.254/16, fe80::/10, where the metadata services live), the metadata
  addresses themselves, unspecified, multicast and reserved ones always. An IPv6 address that
  carries an IPv4 one (::ffff:a.b.c.d, 6to4, NAT64) is judged by the IPv4 one (`refusal`: pure);
- pins the connection to the address it checked: the socket connects to that address, never to
  a second lookup of the name (DNS rebinding: a name that answers a public address to the check
  and 127.0.0.1 to the connect). The Host header, TLS's server name and the certificate check
  still use the URL's host. The peer the socket reached is checked once more;
- follows redirects itself, at most `MAX_REDIRECTS`, each hop checked as the first (http and
  https only);
- bounds the whole fetch in time, not each socket operation: one deadline covers the name
  lookups, connects, redirects and every read, and a watchdog shuts the socket down when it
  passes, so a server that drips a byte a second cannot hold a worker thread past it;
- bounds the size: a Content-Length over the limit is refused before reading, and reading stops
  one byte past it.

Every refusal is a `FetchError` whose message says why (worker/server/media.py makes it a 400).
Blocking: it runs on the thread that loads the request's media, never on the event loop.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

MAX_REDIRECTS = 5
_CHUNK = 64 * 1024
_METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle ...
    "169.254.170.2",  # AWS ECS task metadata
    "100.100.100.200",  # Alibaba Cloud
    "168.63.129.16",  # Azure's wire server (a public-looking address)
    "fd00:ec2::254",  # AWS over IPv6
))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: private in practice
_RESOLVER = ThreadPoolExecutor(4, thread_name_prefix="media-dns")  # getaddrinfo has no timeout of its own

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolve = Callable[[str, int], list[str]]


class FetchError(Exception):
    """A fetch refused or failed; the message says why (without the worker's internals)."""


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    allow_private: bool = False  # --allow-private-media: loopback, private and shared addresses too
    timeout_s: float = 10.0  # --remote-media-timeout: the whole fetch, redirects included
    max_bytes: int = 20 * 1024 * 1024


def _carried_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def refusal(address: str, allow_private: bool) -> str | None:
    """Why a fetch may not connect to `address` ("loopback", "link-local", ...), None if it may."""
    ip: IP = ipaddress.ip_address(address.split("%", 1)[0])  # a scoped IPv6 address: its zone dropped
    if isinstance(ip, ipaddress.IPv6Address) and (v4 := _carried_v4(ip)) is not None:
        ip = v4
    if ip in _METADATA:
        return "a cloud metadata address"
    if ip.is_unspecified or ip in _THIS_NETWORK:
        return "an unspecified address"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_reserved and not ip.is_loopback:  # 240/4 and the broadcast address (::1 sits in ::/8)
        return "a reserved address"
    if ip.is_loopback:
        kind = "a loopback address"
    elif ip.is_private or ip in _SHARED:
        kind = "a private address"
    elif not ip.is_global:
        return "a reserved address"
    else:
        return None
    return None if allow_private else kind


def _too_long(policy: FetchPolicy) -> FetchError:
    return FetchError(f"took longer than the {policy.timeout_s:g} s this server allows a fetch")


def system_resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _Deadline:
    """The fetch's one deadline, and a watchdog that shuts the current socket down at it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.has_passed = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            self.has_passed = True
            raise FetchError(f"took longer than the {self.seconds:g} s this server allows a fetch")
        return left

    def watch(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            if self.has_passed and sock is not None:
                sock.close()

    def _fire(self) -> None:
        with self._lock:
            self.has_passed = True
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)  # a blocked recv returns at once
                except OSError:
                    pass

    def cancel(self) -> None:
        self._timer.cancel()


def _pinned(scheme: str, host: str, port: int, ip: str, deadline: _Deadline) -> http.client.HTTPConnection:
    """A connection to `ip` that speaks to `host` (Host header, TLS server name and certificate),
    its socket watched by the deadline from the start (a TLS handshake may drip too)."""

    def open_socket() -> socket.socket:
        raw = socket.create_connection((ip, port), deadline.left())
        deadline.watch(raw)
        return raw

    if scheme == "https":
        context = ssl.create_default_context()

        class _Https(http.client.HTTPSConnection):
            def connect(self) -> None:
                self.sock = context.wrap_socket(open_socket(), server_hostname=host)

        return _Https(host, port, context=context)

    class _Http(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = open_socket()

    return _Http(host, port)


def fetch(url: str, policy: FetchPolicy, resolve: Resolve = system_resolve) -> bytes:
    """The body of `url` under `policy` (FetchError: why not). `resolve` (host, port) -> addresses."""
    deadline = _Deadline(policy.timeout_s)
    try:
        for _ in range(MAX_REDIRECTS + 1):
            status, location, body = _hop(url, policy, resolve, deadline)
            if location is None:
                if status != 200:
                    raise FetchError(f"the server answered HTTP {status}")
                return body
            url = urllib.parse.urljoin(url, location)
        raise FetchError(f"more than {MAX_REDIRECTS} redirects")
    except FetchError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as e:
        if deadline.has_passed or isinstance(e, TimeoutError):  # a socket's timeout is the time left
            raise _too_long(policy) from None
        raise FetchError(str(e) or type(e).__name__) from None
    finally:
        deadline.cancel()


def _hop(url: str, policy: FetchPolicy, resolve: Resolve,
         deadline: _Deadline) -> tuple[int, str | None, bytes]:
    """One request: (status, the redirect's Location or None, the body when not a redirect)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"a redirect to {url!r}: only http(s) URLs are fetched")
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = _RESOLVER.submit(resolve, host, port).result(deadline.left())
    except FutureTimeout:
        deadline.has_passed = True
        raise _too_long(policy) from None
    except OSError as e:
        raise FetchError(f"cannot resolve {host!r}: {e}") from None
    if not addresses:
        raise FetchError(f"cannot resolve {host!r}")
    for address in addresses:  # every address the name has: a check of one would leave the others
        if (why := refusal(address, policy.allow_private)) is not None:
            hint = (" (--allow-private-media lets loopback and private addresses through)"
                    if why in ("a loopback address", "a private address") else "")
            raise FetchError(f"{host!r} is {why} ({address}): refused{hint}")
    conn = _pinned(parts.scheme, host, port, addresses[0], deadline)
    try:
        conn.connect()
        peer = str(conn.sock.getpeername()[0])
        if (why := refusal(peer, policy.allow_private)) is not None:  # the address reached, not the one meant
            raise FetchError(f"{host!r} connected to {why} ({peer}): refused")
        path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        conn.sock.settimeout(deadline.left())
        conn.request("GET", path, headers={"User-Agent": "omni-worker", "Accept": "*/*"})
        response = conn.getresponse()
        if response.status in (301, 302, 303, 307, 308):
            location = response.getheader("Location")
            if not location:
                raise FetchError(f"HTTP {response.status} without a Location")
            return response.status, location, b""
        if response.status != 200:
            return response.status, None, b""
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > policy.max_bytes:
            raise FetchError(f"{int(length)} bytes is over the limit of {policy.max_bytes}")
        chunks: list[bytes] = []
        got = 0
        while got <= policy.max_bytes:
            conn.sock.settimeout(deadline.left())
            chunk = response.read1(_CHUNK)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if deadline.has_passed:
            raise _too_long(policy)
        return 200, None, b"".join(chunks)
    finally:
        deadline.watch(None)
        conn.close()

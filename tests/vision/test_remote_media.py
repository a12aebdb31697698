"""Remote media (`--allow-remote-media`, worker/server/remote_media.py) against real HTTP servers
on this box. Regression (issue 47, 7): with the flag on, a request could make the worker fetch
from localhost or a cloud metadata address, redirects were followed unchecked, and the 10 s
timeout was per socket operation (a server dripping a byte at a time held the fetch forever).

A public server cannot be reached here, so where a test needs one hop to pass the address check
it names one loopback address (127.0.0.2) public, by patching the pure rule for that address only.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.util import answer, run_worker
from worker.server import remote_media
from worker.server.remote_media import FetchError, FetchPolicy, fetch, refusal
from worker.testing.tiny_vlm import VlmPaths, data_url, png

IMAGE = png(40, 30, 5)
PUBLIC_STAND_IN = "127.0.0.2"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hosts: list[str]  # the Host header of each request, per server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.hosts.append(self.headers.get("Host", ""))
        if self.path.startswith("/to/"):  # /to/<url>: a redirect there
            self.send_response(302)
            self.send_header("Location", self.path[len("/to/"):])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/drip":  # a byte every 50 ms, forever (until the client goes)
            self.send_response(200)
            self.send_header("Content-Length", str(10**6))
            self.end_headers()
            try:
                while True:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                return
        elif self.path == "/huge":
            self.send_response(200)
            self.send_header("Content-Length", str(10**9))
            self.end_headers()
        else:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(IMAGE)))
            self.end_headers()
            self.wfile.write(IMAGE)


@contextmanager
def server(host: str = "127.0.0.1") -> Iterator[tuple[str, list[str]]]:
    hosts: list[str] = []
    handler = type("Handler", (_Handler,), {"hosts": hosts})
    httpd = http.server.ThreadingHTTPServer((host, 0), handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://{host}:{httpd.server_address[1]}", hosts
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def public_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    real = remote_media.refusal
    monkeypatch.setattr(remote_media, "refusal",
                        lambda a, allow: None if a == PUBLIC_STAND_IN else real(a, allow))


@pytest.mark.parametrize(
    ("address", "default", "with_private"),
    [
        ("8.8.8.8", None, None),
        ("2606:4700::1111", None, None),
        ("127.0.0.1", "a loopback address", None),
        ("::1", "a loopback address", None),
        ("::ffff:127.0.0.1", "a loopback address", None),  # IPv4 mapped into IPv6
        ("2002:7f00:1::1", "a loopback address", None),  # 6to4 of 127.0.0.1
        ("10.1.2.3", "a private address", None),
        ("172.16.0.1", "a private address", None),
        ("192.168.1.1", "a private address", None),
        ("100.64.0.1", "a private address", None),  # carrier-grade NAT
        ("fd12:3456::1", "a private address", None),
        ("169.254.169.254", "a cloud metadata address", "a cloud metadata address"),
        ("64:ff9b::a9fe:a9fe", "a cloud metadata address", "a cloud metadata address"),  # NAT64 of it
        ("fd00:ec2::254", "a cloud metadata address", "a cloud metadata address"),
        ("100.100.100.200", "a cloud metadata address", "a cloud metadata address"),
        ("169.254.1.1", "a link-local address", "a link-local address"),
        ("fe80::1%eth0", "a link-local address", "a link-local address"),
        ("0.0.0.0", "an unspecified address", "an unspecified address"),
        ("::", "an unspecified address", "an unspecified address"),
        ("0.1.2.3", "an unspecified address", "an unspecified address"),
        ("224.0.0.1", "a multicast address", "a multicast address"),
        ("ff02::1", "a multicast address", "a multicast address"),
        ("255.255.255.255", "a reserved address", "a reserved address"),
        ("240.0.0.1", "a reserved address", "a reserved address"),
    ],
)
def test_refusal(address: str, default: str | None, with_private: str | None) -> None:
    assert refusal(address, allow_private=False) == default
    assert refusal(address, allow_private=True) == with_private


def test_loopback_is_refused_by_default_and_fetched_with_private_allowed() -> None:
    with server() as (base, hosts):
        with pytest.raises(FetchError, match=r"'127.0.0.1' is a loopback address .*--allow-private-media"):
            fetch(f"{base}/a.png", FetchPolicy())
        assert hosts == []  # refused before connecting
        assert fetch(f"{base}/a.png", FetchPolicy(allow_private=True)) == IMAGE


def test_every_redirect_hop_is_checked(public_stand_in: None) -> None:
    with server() as (inside, inside_hosts), server(PUBLIC_STAND_IN) as (outside, _):
        assert fetch(f"{outside}/a.png", FetchPolicy()) == IMAGE  # the stand-in passes
        with pytest.raises(FetchError, match=r"'127\.0\.0\.1' is a loopback address"):
            fetch(f"{outside}/to/{inside}/a.png", FetchPolicy())
        assert inside_hosts == []  # never reached
        with pytest.raises(FetchError, match="only http"):
            fetch(f"{outside}/to/file:///etc/passwd", FetchPolicy())
        chain = f"{outside}/to/" * (remote_media.MAX_REDIRECTS + 1) + f"{outside}/a.png"
        with pytest.raises(FetchError, match="redirects"):
            fetch(chain, FetchPolicy())


def test_the_connection_goes_to_the_address_checked(public_stand_in: None) -> None:
    """Resolve once, connect there (DNS rebinding: a name whose second answer is 127.0.0.1 never
    gets that second lookup); a name with any refused address among its answers is refused."""
    with server(PUBLIC_STAND_IN) as (outside, hosts):
        port = outside.rsplit(":", 1)[1]
        answers = iter([[PUBLIC_STAND_IN], ["127.0.0.1"]])
        calls: list[str] = []

        def rebinding(host: str, _port: int) -> list[str]:
            calls.append(host)
            return next(answers)

        assert fetch(f"http://media.test:{port}/a.png", FetchPolicy(), rebinding) == IMAGE
        assert calls == ["media.test"] and hosts == [f"media.test:{port}"]  # the name in Host, one lookup
        with pytest.raises(FetchError, match="loopback"):
            fetch(f"http://media.test:{port}/a.png", FetchPolicy(),
                  lambda h, p: [PUBLIC_STAND_IN, "127.0.0.1"])


def test_the_whole_fetch_is_bounded_in_time_and_size(public_stand_in: None) -> None:
    with server(PUBLIC_STAND_IN) as (outside, _):
        t0 = time.monotonic()
        with pytest.raises(FetchError, match="longer than the 1 s"):
            fetch(f"{outside}/drip", FetchPolicy(timeout_s=1.0))  # each byte well inside any per-read timeout
        assert time.monotonic() - t0 < 5.0
        with pytest.raises(FetchError, match="over the limit"):
            fetch(f"{outside}/huge", FetchPolicy())
        def slow(host: str, port: int) -> list[str]:  # a name server that takes its time
            time.sleep(3)
            return [PUBLIC_STAND_IN]

        t0 = time.monotonic()
        with pytest.raises(FetchError, match=r"longer than the 0\.5 s"):
            fetch(f"http://slow.test:{outside.rsplit(':', 1)[1]}/a.png", FetchPolicy(timeout_s=0.5), slow)
        assert time.monotonic() - t0 < 2.5  # the lookup counts too


def _chat(base: str, url: str) -> httpx.Response:
    content = [{"type": "text", "text": "What is in this image?"},
               {"type": "image_url", "image_url": {"url": url}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    return httpx.post(f"{base}/v1/chat/completions", timeout=60, json=body)


def test_a_worker_refuses_remote_media_on_127_0_0_1_by_default(tiny_vlm: VlmPaths) -> None:
    args = ["--mmproj", str(tiny_vlm.mmproj), "-np", "1", "-c", "1024", "--threads", "1",
            "--allow-remote-media"]
    with server() as (base, hosts):
        with run_worker(tiny_vlm.gguf, *args) as worker:
            r = _chat(worker, f"{base}/a.png")
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "messages" and "image 0" in err["message"] and "loopback" in err["message"]
            assert hosts == []
        with run_worker(tiny_vlm.gguf, *args, "--allow-private-media") as worker:
            r = _chat(worker, f"{base}/a.png")
            assert r.status_code == 200, r.text
            assert answer(r) == answer(_chat(worker, data_url(IMAGE)))

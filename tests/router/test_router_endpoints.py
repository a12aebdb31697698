"""The router routes by `model` every endpoint a `cmd` upstream may serve (audio, images, rerank,
embeddings, llama-server's /completion and /infill), multipart uploads included, and passes
bodies through unchanged: streamed ones (SSE without [DONE], chunked audio) as they come.

One router for the module, two scripted `cmd` upstreams (tests/router/fake_worker.py) that
report the path, body digest and content type they received.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from router.http.form import boundary, form_field
from tests.router.conftest import fake_model
from tests.util import ROOT, free_port, stop_process, wait_healthy

JSON_ROUTES = [
    "/completion",
    "/completions",
    "/infill",
    "/embedding",
    "/embeddings",
    "/v1/embeddings",
    "/rerank",
    "/v1/rerank",
    "/reranking",
    "/v1/reranking",
    "/v1/images/generations",
]
MULTIPART_ROUTES = ["/v1/audio/transcriptions", "/audio/transcriptions", "/v1/audio/translations"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("endpoints")
    preset = tmp / "preset.toml"
    preset.write_text(fake_model("a", extra="load_on_startup = true") + fake_model("b"))
    port = free_port()
    log = tmp / "router.log"
    cmd = [sys.executable, "-m", "router.cli", "--preset", str(preset), "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 30, lambda: log.read_text(errors="replace")[-3000:])
        yield url
    finally:
        stop_process(proc)  # its workers follow it (PDEATHSIG / --parent-pid)


def _multipart(fields: dict[str, str], upload: bytes, sep: str = "XyZ-boundary") -> tuple[bytes, str]:
    """A multipart body with the file part first (the router must look past it for `model`)."""
    parts = [f'--{sep}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
             "Content-Type: audio/wav\r\n\r\n".encode() + upload + b"\r\n"]
    parts += [
        f'--{sep}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    ]
    return b"".join(parts) + f"--{sep}--\r\n".encode(), f"multipart/form-data; boundary={sep}"


@pytest.mark.parametrize("path", JSON_ROUTES)
def test_json_routes_go_to_the_named_model(base: str, path: str) -> None:
    body = json.dumps({"model": "b", "input": "x", "prompt": "y"}).encode()
    r = httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text
    seen = r.json()
    assert (seen["model"], seen["path"]) == ("b", path)
    assert seen["sha256"] == hashlib.sha256(body).hexdigest()


@pytest.mark.parametrize("path", MULTIPART_ROUTES)
def test_multipart_uploads_route_by_the_form_model(base: str, path: str) -> None:
    upload = os.urandom(300_000) + b'name="model"\r\n\r\nnot-this'  # a file that looks like a field
    body, content_type = _multipart({"model": "b", "language": "en"}, upload)
    r = httpx.post(base + path, content=body, headers={"content-type": content_type}, timeout=30)
    assert r.status_code == 200, r.text
    seen = r.json()
    assert (seen["model"], seen["path"], seen["content_type"]) == ("b", path, content_type)
    assert seen["sha256"] == hashlib.sha256(body).hexdigest()


def test_multipart_without_model_is_400(base: str) -> None:
    body, content_type = _multipart({"language": "en"}, b"RIFF")
    r = httpx.post(
        base + "/v1/audio/transcriptions", content=body, headers={"content-type": content_type}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_streams_pass_through_unchanged(base: str) -> None:
    with httpx.stream("POST", f"{base}/completion", json={"model": "a", "prompt": "x", "stream": True},
                      timeout=30) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert [json.loads(e)["stop"] for e in events] == [False, False, False, True] and "[DONE]" not in events
    with httpx.stream("POST", f"{base}/v1/audio/speech", json={"model": "a", "input": "hi"}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
        assert "content-length" not in r.headers  # streamed, not buffered
        audio = r.read()
    assert audio == b"".join(bytes([i]) * 1000 for i in range(3))
    assert json.loads(r.headers["x-seen"])["model"] == "a"


@pytest.mark.parametrize(
    ("content_type", "body", "expected"),
    [
        (
            b'multipart/form-data; boundary="q"',
            b'--q\r\nContent-Disposition: form-data; name="model"\r\n\r\nm1\r\n--q--',
            "m1",
        ),
        (
            b"multipart/form-data; boundary=q",
            b'--q\r\nContent-Disposition: form-data; name="x"\r\n\r\nm1\r\n--q--',
            None,
        ),
        (b"multipart/form-data; boundary=q", b"--q--\r\n", None),
        (
            b"multipart/form-data; boundary=q",
            b'--q\r\nContent-Disposition: form-data; name="model"\r\n\r\nm',
            None,
        ),
    ],
)
def test_form_field(content_type: bytes, body: bytes, expected: str | None) -> None:
    sep = boundary(content_type)
    assert sep == b"q"
    assert form_field(body, sep, "model") == expected


def test_boundary_of_other_types() -> None:
    assert boundary(b"application/json") is None
    assert boundary(b"multipart/form-data") is None



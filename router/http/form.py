"""One field of a multipart/form-data body, found in place (the audio endpoints' `model`).

The proxy forwards the body bytes untouched, so it only needs the routing field: this scans
the part headers with `bytes.find` and copies nothing but that field's value; an uploaded file
is never parsed or copied.
"""

from __future__ import annotations


def boundary(content_type: bytes) -> bytes | None:
    """The boundary of a `multipart/form-data; boundary=...` content type, or None."""
    kind, _, params = content_type.partition(b";")
    if kind.strip().lower() != b"multipart/form-data":
        return None
    for param in params.split(b";"):
        key, _, value = param.strip().partition(b"=")
        if key.lower() == b"boundary" and value:
            return value.strip(b'"')
    return None


def form_field(body: bytes, boundary: bytes, name: str) -> str | None:
    """The text value of form field `name` in a multipart body, or None if it has none."""
    delimiter = b"--" + boundary
    wanted = b'name="' + name.encode() + b'"'
    pos = body.find(delimiter)
    while pos >= 0:
        head_start = pos + len(delimiter)
        if body.startswith(b"--", head_start):
            return None  # the closing delimiter
        head_end = body.find(b"\r\n\r\n", head_start)
        if head_end < 0:
            return None
        next_pos = body.find(b"\r\n" + delimiter, head_end)
        if next_pos < 0:
            return None
        for line in body[head_start:head_end].split(b"\r\n"):
            if line[:20].lower() == b"content-disposition:" and wanted in line:
                return body[head_end + 4 : next_pos].decode("utf-8", errors="replace")
        pos = next_pos + 2
    return None

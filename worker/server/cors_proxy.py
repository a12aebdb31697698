"""llama-server's `/cors-proxy?url=...` (`--ui-mcp-proxy`, experimental there too): the web UI's
MCP client reaches servers that send no CORS headers through it.

Only headers the caller names `X-Llama-Server-Proxy-Header-<name>` go to the target, as
`<name>`: the caller's own Authorization, X-Api-Key and cookies never leave. http(s) only, no
credentials in the URL. Without the flag: 403, as llama-server. Do not enable it where clients
are not trusted: it fetches any URL the server can reach.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx
from starlette.requests import Request
from starlette.responses import Response

from worker.protocol.errors import APIError

PREFIX = "x-llama-server-proxy-header-"
_TIMEOUT_S = 600.0  # llama-server's read/write timeouts
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-encoding", "content-length"}
)


def proxied_headers(headers: list[tuple[str, str]]) -> dict[str, str]:
    """Only the explicitly named ones, their prefix removed."""
    return {k[len(PREFIX):]: v for k, v in headers if k.lower().startswith(PREFIX) and len(k) > len(PREFIX)}


async def cors_proxy(request: Request, *, is_enabled: bool) -> Response:
    if not is_enabled:
        raise APIError(
            "this feature is disabled (start with --ui-mcp-proxy)",
            status_code=403,
            type="not_supported_error",
        )
    url = request.query_params.get("url", "")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise APIError(f"invalid target URL: {url!r} (http or https, with a host)", param="url")
    if parts.password is not None or parts.username is not None:
        raise APIError("authentication in target URL is not supported", param="url")
    body = await request.body() if request.method == "POST" else None
    async with httpx.AsyncClient(timeout=_TIMEOUT_S, follow_redirects=False) as client:
        try:
            res = await client.request(request.method, url, headers=proxied_headers(request.headers.items()),
                                       content=body)
        except httpx.HTTPError as e:
            raise APIError(f"proxy request failed: {e}", status_code=502, type="server_error") from None
    headers = {k: v for k, v in res.headers.items() if k.lower() not in _HOP_BY_HOP}
    return Response(res.content, status_code=res.status_code, headers=headers)

"""`GET /keys/usage` (admin, router.keys.access): per key, requests and tokens by model, what is
running and waiting at its concurrency gate, and its limits."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router.keys.book import KeyBook


class KeyRoutes:
    def __init__(self, book: KeyBook) -> None:
        self._book = book

    def routes(self) -> list[Route]:
        return [Route("/keys/usage", self.usage)]

    async def usage(self, request: Request) -> Response:
        return JSONResponse(self._book.usage_json())

"""HTTP plumbing shared by the routes: bounded body reading, JSON answers, SSE, and disconnect handling."""
from __future__ import annotations

import asyncio
import re
from typing import AsyncIterator, Awaitable, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from aserve.errors import InvalidRequestError
from aserve.server.errors import APIError

T = TypeVar("T")


DRAIN_MAX_BYTES = 64 * 1024 * 1024  # how much of an over-limit body is read and dropped so the client sees its 413
DRAIN_TIMEOUT_S = 10.0  # and for how long at most (the body timeout, when shorter)


async def _drain(request: Request, budget: int, timeout: float | None) -> None:
    """Read and drop the rest of a refused body, so the client reads our 413 instead of a connection reset.

    An HTTP server that answers and closes while the client is still sending makes the kernel reset the
    connection, and the reset destroys the answer in the client's receive buffer. nginx avoids it with a
    lingering close; an ASGI app cannot linger after its response, so it drains first, within `budget`
    bytes and `timeout` seconds (past either, the answer goes out anyway and the client may see a reset).
    """
    async def discard():
        nonlocal budget
        async for chunk in request.stream():
            budget -= len(chunk)
            if budget < 0:
                return
    try:
        await asyncio.wait_for(discard(), timeout)
    except (ClientDisconnect, asyncio.TimeoutError):
        pass


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The whole body, refused with 413 past `limit` bytes and with 408 if it takes over `timeout` seconds
    (a slow client must not hold a connection forever). A refused body is drained first (see `_drain`)."""
    drain_timeout = min(timeout, DRAIN_TIMEOUT_S) if timeout is not None else DRAIN_TIMEOUT_S
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        # With `Expect: 100-continue` the client waits for our go-ahead, so nothing is in flight to drain.
        if request.headers.get("expect", "").lower() != "100-continue" and int(length) <= limit + DRAIN_MAX_BYTES:
            await _drain(request, DRAIN_MAX_BYTES, drain_timeout)
        raise APIError(413, f"the request body has {int(length)} bytes; the limit is {limit}")
    chunks, size = [], 0

    async def read():  # past the limit, the rest is read and dropped (up to DRAIN_MAX_BYTES) for the 413
        nonlocal size, chunks
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                chunks = []
                if size > limit + DRAIN_MAX_BYTES:
                    return
            else:
                chunks.append(chunk)
    try:
        await asyncio.wait_for(read(), timeout)
    except ClientDisconnect:
        raise APIError(499, "the client disconnected before sending the whole body") from None
    except asyncio.TimeoutError:
        if size <= limit:
            raise APIError(408, f"the request body did not arrive within {timeout:g} s") from None
    if size > limit:
        raise APIError(413, f"the request body is over the limit of {limit} bytes")
    return b"".join(chunks)


async def parse(request: Request, struct: type[T], limit: int, timeout: float | None = None) -> T:
    body = await read_body(request, limit, timeout)
    if not body.strip():
        raise APIError(400, "the request body is empty; a JSON object is required")
    try:  # lax, as pydantic (OpenAI's and vLLM's servers) is: 5.0 and "5" are the integer 5; 5.5 is still an error
        return msgspec.json.decode(body, type=struct, strict=False)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"invalid request: {exc}", _field(exc)) from None


def _field(exc: msgspec.ValidationError) -> str | None:
    """The top-level field a validation error is about: msgspec says where only in its message
    (`... - at `$.messages[0].role``), so this is the one place that reads it."""
    where = re.search(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)", str(exc))
    return where.group(1) if where else None


def json_response(obj, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (which aborts its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            raise APIError(499, "the client disconnected")
    return task.result()


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for item in stream:
                await queue.put((i, item))
        except BaseException as exc:  # noqa: BLE001 - hand it to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:  # cancelling a pump closes its stream, which aborts its request
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

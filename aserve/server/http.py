"""HTTP plumbing shared by the routes: bounded body reading, JSON answers, SSE, and disconnect handling."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from aserve.server.errors import APIError

T = TypeVar("T")


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The whole body, refused with 413 past `limit` bytes and with 408 if it takes over `timeout` seconds
    (a slow client must not hold a connection forever)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body has {int(length)} bytes; the limit is {limit}")
    chunks, size = [], 0

    async def read():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes")
            chunks.append(chunk)
    try:
        await asyncio.wait_for(read(), timeout)
    except ClientDisconnect:
        raise APIError(499, "the client disconnected before sending the whole body") from None
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s") from None
    return b"".join(chunks)


async def parse(request: Request, struct: type[T], limit: int, timeout: float | None = None) -> T:
    body = await read_body(request, limit, timeout)
    if not body.strip():
        raise APIError(400, "the request body is empty; a JSON object is required")
    # lax, as pydantic (OpenAI's and vLLM's servers) is: 5.0 and "5" are the integer 5; 5.5 is still an error
    return msgspec.json.decode(body, type=struct, strict=False)


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

"""One HTTP request as a load generator sees it: status, time to first token, gaps between tokens, end to end.

Speaks SSE (/v1/completions, /v1/chat/completions) and raw bodies, over httpx; a request that fails at
the transport level gets a string status ("connect-error", "read-timeout", ...) instead of a number.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("the king is dead long live the king a horse my kingdom for a horse to be or not to be that is the "
         "question all the world is a stage and all the men and women merely players now is the winter of our "
         "discontent made glorious summer by this sun of york friends romans countrymen lend me your ears").split()


def text_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


@dataclass
class Result:
    kind: str  # which part of a scenario sent it ("good", "disconnect-mid-stream", "bad-json", ...)
    status: int | str
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0
    text: str | None = None
    priority: int | None = None
    expected: tuple = ()  # statuses this request should get; empty = any 2xx

    @property
    def ok(self) -> bool:
        if self.expected:
            return self.status in self.expected
        return isinstance(self.status, int) and 200 <= self.status < 300


def transport_status(exc: BaseException) -> str:
    name = type(exc).__name__
    return {"ConnectError": "connect-error", "ReadTimeout": "read-timeout", "RemoteProtocolError": "dropped",
            "ReadError": "read-error", "WriteError": "write-error"}.get(name, name)


async def completion(client: httpx.AsyncClient, body: dict, kind: str = "good", path: str = "/v1/completions",
                     stop_after_chunks: int | None = None, headers: dict | None = None,
                     read_delay: float = 0.0) -> Result:
    """POST a completion; streamed if body says so (then TTFT/ITL are measured per SSE event).
    `stop_after_chunks` closes the connection after that many content events (a vanishing client);
    `read_delay` sleeps after each event (a slow reader)."""
    result = Result(kind, 0, priority=body.get("priority"))
    start = time.perf_counter()
    try:
        if not body.get("stream"):
            response = await client.post(path, json=body, headers=headers)
            result.status = response.status_code
            result.e2e = time.perf_counter() - start
            if response.status_code == 200:
                data = response.json()
                result.output_tokens = (data.get("usage") or {}).get("completion_tokens", 0)
                choice = data["choices"][0]
                result.text = choice.get("text", (choice.get("message") or {}).get("content"))
            return result
        pieces, last = [], None
        async with client.stream("POST", path, json=body, headers=headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:  # the stream ended with an error event
                    result.status = f"stream-error-{event['error'].get('code')}"
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                texts = [c.get("text", (c.get("delta") or {}).get("content")) or "" for c in event["choices"]]
                if not any(texts):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                pieces.append(texts[0])
                if read_delay:
                    await asyncio.sleep(read_delay)
                if stop_after_chunks is not None and len(pieces) >= stop_after_chunks:
                    result.status = "closed-by-client"
                    return result
        result.e2e = time.perf_counter() - start
        result.text = "".join(pieces)
        if not result.output_tokens:
            result.output_tokens = len(pieces)
    except httpx.HTTPError as exc:
        result.status = transport_status(exc)
    return result


async def raw(host: str, port: int, payload: bytes, kind: str, expected: tuple = (), read_timeout: float = 30.0,
              hang_up_after_send: bool = False, pace: tuple[int, float] | None = None) -> Result:
    """Send raw bytes (a whole HTTP request, or a broken one) and read the status line of the answer.
    `pace=(chunk, seconds)` dribbles the bytes out like a slow client."""
    result = Result(kind, 0, expected=expected)
    start = time.perf_counter()
    writer = None
    answer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        if not hang_up_after_send:  # read while writing: a server may answer early (413) and close
            answer = asyncio.ensure_future(reader.readline())
        chunk, delay = pace or (64 * 1024, 0.0)
        try:
            for i in range(0, len(payload), chunk):
                if answer is not None and answer.done():
                    break
                writer.write(payload[i:i + chunk])
                await writer.drain()
                if delay:
                    await asyncio.sleep(delay)
        except OSError:  # the server closed early; its answer may already be in
            pass
        if hang_up_after_send:
            result.status = "closed-by-client"
            return result
        line = await asyncio.wait_for(answer, read_timeout)
        parts = line.split()
        result.status = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else "no-status-line"
        result.e2e = time.perf_counter() - start
    except (OSError, asyncio.TimeoutError) as exc:
        result.status = "read-timeout" if isinstance(exc, asyncio.TimeoutError) else transport_status(exc)
    finally:
        if answer is not None and not answer.done():
            answer.cancel()
        if writer is not None:
            writer.close()
    return result


def http_request(path: str, body: bytes, content_type: str | None = "application/json",
                 content_length: int | None = None, headers: dict | None = None, chunked: bool = False) -> bytes:
    """A raw HTTP/1.1 POST; `chunked` sends the body with Transfer-Encoding: chunked (no length up front)."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
        step = 64 * 1024
        body = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + step]), body[i:i + step])
                        for i in range(0, len(body), step)) + b"0\r\n\r\n"
    else:
        lines.append(f"Content-Length: {len(body) if content_length is None else content_length}")
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

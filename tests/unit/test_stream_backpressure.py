"""Admission's SSE stream against a client that stops reading: a real aiohttp server and a real
socket whose owner never reads; the stream gives up after its write timeout, and its caller's
pieces (in admission, the request's journey through the engines) are closed, which aborts them."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from aiohttp import web

from kvmesh.services.admission.lifecycle import Piece
from kvmesh.services.admission.responses import Answer, stream
from kvmesh.services.admission.slo import Timing


async def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout_and_its_pieces_closed():
    closed, ended = asyncio.Event(), asyncio.Event()

    async def pieces():
        try:
            for i in range(1000):  # 64 MB, far past what the kernel buffers for a client that does not read
                yield Piece(token_ids=[i], text="x" * 65536)
        finally:
            closed.set()

    async def handler(request: web.Request) -> web.StreamResponse:
        answer = Answer(id="cmpl-test", created=0, model="m", prompt_tokens=1, tokenizer=None, logprobs=False)
        async with contextlib.aclosing(pieces()) as journey:
            response = await stream(request, journey, answer, chat=False, include_usage=False, timing=Timing(0.0),
                                    write_timeout_s=0.5)
        ended.set()
        return response

    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    client = socket.socket()
    try:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(runner.addresses[0])
        client.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")  # then never reads
        await asyncio.wait_for(asyncio.gather(closed.wait(), ended.wait()), 30)
    finally:
        client.close()
        await runner.cleanup()

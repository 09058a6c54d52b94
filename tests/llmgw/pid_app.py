"""An ASGI application answering each request with its worker's process id (tests/llmgw/test_listen.py)."""

import os


async def app(scope, receive, send):
    """Answer with this process's id."""
    if scope["type"] != "http":
        return
    body = str(os.getpid()).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})

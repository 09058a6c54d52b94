"""An ASGI application whose worker ignores SIGTERM once started (tests/llmgw/test_listen.py).

It stands for a worker that missed its master's request to stop.
"""

import signal

from tests.llmgw.pid_app import app as answer


async def app(scope, receive, send):
    """Ignore SIGTERM from the lifespan's start on; answer requests with the worker's process id."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    await answer(scope, receive, send)

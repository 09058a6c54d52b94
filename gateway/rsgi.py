"""The gateway's process over granian's RSGI interface: `granian --interface rsgi gateway.rsgi:app`.

The same ASGI application as gateway/asgi.py (the data plane and everything
mounted in front of it), served through gateway/dataplane/rsgi.py.
"""

from gateway.asgi import app as asgi_app
from gateway.dataplane.rsgi import RSGIApp

app = RSGIApp(asgi_app)

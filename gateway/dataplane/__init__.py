"""The gateway's data plane: an ASGI application that routes OpenAI-style requests to ready replicas.

It holds the routing table and the key hashes in memory (gateway/table.py),
reloaded in a worker thread at start, when a push arrives on Redis
(gateway/notify.py), and every LLMGW_GATEWAY_REFRESH seconds; a request
never touches the database. Limits are counted in Redis so that every
gateway process agrees.

Streams are passed through chunk by chunk as they arrive. A client that
disconnects cancels the upstream request at once (its connection is closed).
A connection error or a 5xx before the first byte is retried once on another
replica (a connection error on the same one when no other is left); once a
byte has reached the client nothing is retried. A replica
failing LLMGW_GATEWAY_EJECT_AFTER times in a row is ejected for
LLMGW_GATEWAY_EJECT_FOR seconds.

One module per job: app (the ASGI routes, keys, the request's checks, start
and stop), catalog (the models listed and retrieved), upstream (choosing a
replica, retry, ejection), streaming (the relay and usage read on the way,
engines' errors rewritten), sse (a stream's usage taken out when the client
did not ask for it), background (the table, the engines' figures, usage
batches, in-flight reports), pool (the kept-alive connections to the
replicas), limits (and OpenAI's x-ratelimit headers), metrics, http (shared
ASGI types, request ids and error answers).

Every answer is in OpenAI's shapes, so that its SDKs work unchanged, and
carries x-request-id; what failed inside (addresses, exception text) goes to
the log under that id, never to the client.
"""

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
and stop), upstream (choosing a replica, retry, ejection), streaming (the
relay and usage read on the way), background (the table, the engines'
figures, usage batches, in-flight reports), pool (the kept-alive connections
to the replicas), limits, metrics, http (shared ASGI types and error answers).
"""

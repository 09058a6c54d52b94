"""The llmgw node agent: discovers the node, reports it, and runs the shards it is told to.

Imports no Django: it runs on GPU nodes with the standard library, httpx,
PyYAML, pynvml and the wire schema (agents.wire) only.
"""

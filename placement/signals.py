"""Signals placement sends for whoever follows its replicas (the gateway's routing table).

Sent after the transaction that changed the replicas has committed, so a
listener that reads them back sees the change.
"""

from django.dispatch import Signal

# Keyword argument: replica_ids (list of UUIDs).
replicas_changed = Signal()

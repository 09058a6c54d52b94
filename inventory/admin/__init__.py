"""The operator's cockpit for the inventory: the node list, node pages and actions.

Actions are thin: each calls the function in inventory/operations.py that the
REST API calls too, behind a confirmation page that lists what it affects.
The inventory itself is the agents' report, so nodes are read-only here;
what an operator changes is state, operator labels, and whether a node is
remembered at all.

One module per job: the node list's filters (`filters`), the node admin
(`nodes`) and its actions (`node_actions`), and the read-only admins of the
records the agents and llmgw write (`records`). Importing them registers them.
"""

from inventory.admin import filters, node_actions, nodes, records

__all__ = ["filters", "node_actions", "nodes", "records"]

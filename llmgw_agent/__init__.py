"""The node agent: runs on each GPU node, imports no Django."""

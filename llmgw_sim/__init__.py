"""Development tools over the real agent code: the fleet simulator, virtual nodes over recorded hardware, and the echo engine.

Never shipped to a GPU node (deploy/agent/ installs llmgw_agent and llmgw_wire alone).
"""

"""Development tools over the real agent code: the fleet simulator, virtual nodes and the echo engine.

The virtual nodes read recorded hardware (profiles/). None of this is shipped to
a GPU node: deploy/agent/ installs llmgw_agent and llmgw_wire alone.
"""

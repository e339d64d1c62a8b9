"""For agents: the MCP server (``python -m spmd mcp``, mcp_server.py) and how it reaches the
user's SPMD kernels (kernels.py)."""

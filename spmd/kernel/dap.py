"""Small pieces of the debug protocol (DAP) that the SPMD kernel's debugger writes itself."""

from __future__ import annotations


def reply(request: dict, body: dict | None, message: str = "") -> dict:
    """A DAP response to ``request``: ``body``, or a failure that says ``message``."""
    said = {"type": "response", "request_seq": request.get("seq", 0), "seq": 0,
            "command": request.get("command", ""), "success": not message}
    if message:
        said["message"] = message
        said["body"] = {"error": {"id": 1, "format": message}}
    else:
        said["body"] = body or {}
    return said


def with_arguments(request: dict, **arguments) -> dict:
    """``request`` with some of its arguments replaced."""
    return {**request, "arguments": {**(request.get("arguments") or {}), **arguments}}

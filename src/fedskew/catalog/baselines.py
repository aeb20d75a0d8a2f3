"""(filled in by its issue)"""

from __future__ import annotations

from fedskew.registry import ClientPart, ServerPlugin

CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}

"""The capture gateway behind ``factory serve``: a pass-through proxy for OpenAI, Anthropic and
Gemini traffic (plus the OTLP receiver) that spools every call and commits it to the lake.

Use ``gateway_in_thread(openai_base_url=...)`` to run one in-process on a free port, and
``register_route(Route(...))`` to send a model name to another upstream.
"""

from factory.gateway.app import Gateway
from factory.gateway.config import GatewayConfig
from factory.gateway.routes import (
           Route,
           RoutingTable,
           load_routes,
           register_route,
           unregister_route,
)
from factory.gateway.server import ServerThread, gateway_in_thread, serve

__all__ = ["Gateway", "GatewayConfig", "Route", "RoutingTable", "ServerThread",
           "gateway_in_thread", "load_routes", "register_route", "serve", "unregister_route"]

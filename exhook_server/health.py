"""What the ExHook port's gRPC health service (grpc.health.v1) answers, per service name.

- `""` and the hook services (`emqx.exhook.v2/v3.HookProvider`): batches can be stored now (LMDB: the
  environment is open; PostgreSQL: the database answered within `store_down_grace_s`). Readiness.
- `sdv_fanout.Delivery`: the broker link is up (never with `mqtt_url = ""`). For alerts, not readiness.
- `sdv_fanout.Process`: the process serves. Startup and liveness ask for it: an outage of the
  database or of the broker must not restart the pods.
Every service turns NOT_SERVING when shutdown begins.
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health, health_pb2

from exhook_server import hooks

DELIVERY_SERVICE = "sdv_fanout.Delivery"
PROCESS_SERVICE = "sdv_fanout.Process"
#: The names that say whether batches can be stored now.
STORE_SERVICES = ("", *hooks.SERVICE_NAMES)

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _status(up: bool) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    return _SERVING if up else _NOT_SERVING


class HealthStates:
    """Sets the health service's answers from what the server knows. Event-loop thread only."""

    def __init__(self, servicer: health.aio.HealthServicer) -> None:
        self.servicer = servicer
        self._delivery_up = False
        self._pending: set[asyncio.Task[None]] = set()

    async def started(self) -> None:
        """The server serves, its store open; the broker link as last reported."""
        await self.servicer.set(PROCESS_SERVICE, _SERVING)
        await self.servicer.set(DELIVERY_SERVICE, _status(self._delivery_up))
        await self.store(True)

    async def store(self, up: bool) -> None:
        """The store became reachable (`up`) or unreachable for longer than the grace."""
        for service in STORE_SERVICES:
            await self.servicer.set(service, _status(up))

    def delivery(self, up: bool) -> None:
        """The broker link went up or down (a callback: applied in a task of its own; the state
        set is the latest, whatever order the tasks run in)."""
        self._delivery_up = up
        task = asyncio.get_running_loop().create_task(self._apply_delivery())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _apply_delivery(self) -> None:
        await self.servicer.set(DELIVERY_SERVICE, _status(self._delivery_up))

"""Standard health checking and server reflection are served."""

from __future__ import annotations

import asyncio
import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from service.server import SERVICE_NAME, Server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_health_is_serving(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE_NAME):
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert resp.status == SERVING


async def test_reflection_lists_the_services(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def one():
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    responses = [r async for r in stub.ServerReflectionInfo(one())]
    names = {s.name for s in responses[0].list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    assert SERVICE_NAME == "kvstore.v1.KVStore"


async def test_shutdown_reports_not_serving(server_config, clock):
    server = Server(server_config, clock=clock)
    await server.start()
    async with grpc.aio.insecure_channel(server.address) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        )
        assert (await asyncio.wait_for(watch.read(), 5)).status == SERVING
        stopping = asyncio.create_task(server.stop(0.5))
        assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
        await stopping
    assert not os.listdir(server_config.shm_dir), "pool files are unlinked on stop"

"""The EndpointSlice watcher against the project's Kubernetes API emulator (kmock over HTTP, as the operator
tests use it), through the real kubernetes client: list, then watch; ready addresses only; slices added,
changed and deleted; other Services' slices ignored."""

from __future__ import annotations

import asyncio

import aiohttp
import kmock
import kubernetes
import pytest

from hpi_router.config import DiscoverySettings
from hpi_router.discovery import EndpointSliceSource
from hpi_testing.kube_emulator import VERBS, KubeEmulator, write_kubeconfig

SLICES = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"


def endpoint_slice(name: str, service: str, ready: dict[str, bool | None]) -> dict:
    endpoints = []
    for address, is_ready in ready.items():
        endpoint = {"addresses": [address]}
        if is_ready is not None:
            endpoint["conditions"] = {"ready": is_ready}
        endpoints.append(endpoint)
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": service}},
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}], "endpoints": endpoints}


@pytest.fixture()
async def cluster(tmp_path):
    async with KubeEmulator() as handler, kmock.Server(handler) as server:
        handler.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(
            kind="EndpointSlice", namespaced=True, verbs=VERBS)
        url = str(server.url).rstrip("/")
        api_client = kubernetes.config.new_client_from_config(
            config_file=str(write_kubeconfig(tmp_path / "kubeconfig", url)))
        async with aiohttp.ClientSession(base_url=url) as session:
            yield session, api_client
        api_client.close()


async def test_backends_follow_the_ready_endpoints_of_the_service(cluster) -> None:
    session, api_client = cluster
    await session.post(SLICES, json=endpoint_slice("llm-a", "llm", {"10.0.0.1": True, "10.0.0.2": False}))
    await session.post(SLICES, json=endpoint_slice("other-a", "other", {"10.9.9.9": True}))
    published: list[frozenset[str]] = []
    source = EndpointSliceSource(DiscoverySettings("llm", "default", "http"), api_client=api_client)
    task = asyncio.create_task(source.run(lambda urls: published.append(frozenset(urls))))

    async def seen(expected: set[str]) -> None:
        for _ in range(250):
            if published and published[-1] == expected:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"wanted {expected}, published {published[-3:]}")

    try:
        await seen({"http://10.0.0.1:8000"})  # the list: unready 10.0.0.2 and the other Service left out
        await session.post(SLICES, json=endpoint_slice("llm-b", "llm", {"10.0.1.1": None}))
        await seen({"http://10.0.0.1:8000", "http://10.0.1.1:8000"})  # watched: a second slice
        patch = {"endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": False}},
                               {"addresses": ["10.0.0.2"], "conditions": {"ready": True}}]}
        await session.patch(f"{SLICES}/llm-a", json=patch, headers={"Content-Type": "application/merge-patch+json"})
        await seen({"http://10.0.0.2:8000", "http://10.0.1.1:8000"})  # readiness flipped
        await session.delete(f"{SLICES}/llm-b")
        await seen({"http://10.0.0.2:8000"})
        await session.post(SLICES, json=endpoint_slice("other-b", "other", {"10.9.9.8": True}))
        await asyncio.sleep(0.3)
        assert published[-1] == {"http://10.0.0.2:8000"}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # The watch thread notices the stop at its next event (or the watch's timeout): send one, so that the
        # emulator does not wait on an open watch when it shuts down.
        await session.post(SLICES, json=endpoint_slice("llm-c", "llm", {}))
        await asyncio.sleep(0.2)
        assert published[-1] == {"http://10.0.0.2:8000"}  # nothing published after the stop

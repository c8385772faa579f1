"""The EndpointSlice watcher against the project's Kubernetes API emulator (kmock over HTTP, as the operator
tests use it), through the real kubernetes client: list, then watch; ready addresses only; slices added,
changed and deleted; other Services' slices ignored."""

from __future__ import annotations

import asyncio
import threading

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


class LateStop(threading.Event):
    """A deliberately wrong watch loop: it misses the stop once, and publishes the event it was reading."""

    def __init__(self) -> None:
        super().__init__()
        self.num_missed = 0

    def is_set(self) -> bool:
        if super().is_set() and self.num_missed == 0:
            self.num_missed += 1
            return False
        return super().is_set()


def watch_ignoring_the_selector(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deliberately wrong watch: it asks for every EndpointSlice of the namespace (the list still selects)."""
    list_slices = kubernetes.client.DiscoveryV1Api.list_namespaced_endpoint_slice

    def listing(self, namespace, **kwargs):
        if kwargs.get("watch"):
            kwargs.pop("label_selector", None)
        return list_slices(self, namespace, **kwargs)

    monkeypatch.setattr(kubernetes.client.DiscoveryV1Api, "list_namespaced_endpoint_slice", listing)


async def wait_for(check, what: str) -> None:
    for _ in range(250):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within 5 s: {what}")


@pytest.mark.parametrize("broken, failing", [
    (None, []),
    ("watch-ignores-selector", ["other Services ignored"]),
    ("publishes-after-stop", ["nothing published after the stop"]),
], ids=["source", "broken-watch-ignores-selector", "broken-publishes-after-stop"])
async def test_backends_follow_the_ready_endpoints_of_the_service(cluster, monkeypatch, broken, failing) -> None:
    session, api_client = cluster
    await session.post(SLICES, json=endpoint_slice("llm-a", "llm", {"10.0.0.1": True, "10.0.0.2": False}))
    await session.post(SLICES, json=endpoint_slice("other-a", "other", {"10.9.9.9": True}))
    if broken == "watch-ignores-selector":
        watch_ignoring_the_selector(monkeypatch)
    published: list[frozenset[str]] = []
    source = EndpointSliceSource(DiscoverySettings("llm", "default", "http"), api_client=api_client)
    if broken == "publishes-after-stop":
        source._stop = LateStop()
    threads_before = set(threading.enumerate())
    task = asyncio.create_task(source.run(lambda urls: published.append(frozenset(urls))))

    async def seen(expected: set[str]) -> None:
        await wait_for(lambda: published and published[-1] == expected, f"{expected} published ({published[-3:]})")

    checks: dict[str, bool] = {}
    watcher: threading.Thread | None = None
    try:
        await seen({"http://10.0.0.1:8000"})  # the list: unready 10.0.0.2 and the other Service left out
        [watcher] = [t for t in threading.enumerate() if t not in threads_before and t.name == "endpointslice-watch"]
        await session.post(SLICES, json=endpoint_slice("llm-b", "llm", {"10.0.1.1": None}))
        await seen({"http://10.0.0.1:8000", "http://10.0.1.1:8000"})  # watched: a second slice
        patch = {"endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": False}},
                               {"addresses": ["10.0.0.2"], "conditions": {"ready": True}}]}
        await session.patch(f"{SLICES}/llm-a", json=patch, headers={"Content-Type": "application/merge-patch+json"})
        await seen({"http://10.0.0.2:8000", "http://10.0.1.1:8000"})  # readiness flipped
        await session.delete(f"{SLICES}/llm-b")
        await seen({"http://10.0.0.2:8000"})
        # Another Service's slice, then one of ours: the watch delivers in order, so once ours is published the
        # other one has been passed over (or published, by a watch that sees every Service's slices).
        mark = len(published)
        await session.post(SLICES, json=endpoint_slice("other-b", "other", {"10.9.9.8": True}))
        await session.post(SLICES, json=endpoint_slice("llm-c", "llm", {"10.0.2.1": True}))
        await wait_for(lambda: any("http://10.0.2.1:8000" in urls for urls in published[mark:]), "llm-c published")
        checks["other Services ignored"] = published[mark:] == [{"http://10.0.0.2:8000", "http://10.0.2.1:8000"}]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if watcher is not None:
            checks["nothing published after the stop"] = await quiet_after_stop(session, watcher, published)
    assert [name for name, passed in checks.items() if not passed] == failing, published[-3:]


async def quiet_after_stop(session: aiohttp.ClientSession, watcher: threading.Thread,
                           published: list[frozenset[str]]) -> bool:  # fmt: skip
    """Whether the stopped source's watch thread ends at its next event without publishing it."""
    mark = len(published)
    # The thread notices the stop at its next event (or the watch's timeout): send one (a backend, so that a
    # publish would show), then wait for the thread to end, or (a loop that missed the stop) to publish.
    await session.post(SLICES, json=endpoint_slice("llm-d", "llm", {"10.0.3.1": True}))
    await wait_for(lambda: not watcher.is_alive() or len(published) > mark, "the watch thread ended or published")
    await asyncio.sleep(0)  # a publish the thread handed to this loop before it ended runs now
    quiet = not watcher.is_alive() and len(published) == mark
    if watcher.is_alive():  # it sees the stop at its next event: the emulator must not wait on an open watch
        await session.post(SLICES, json=endpoint_slice("llm-e", "llm", {}))
        await asyncio.to_thread(watcher.join, 5)
    return quiet

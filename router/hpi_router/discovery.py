"""Backends from the EndpointSlices of a (headless) Service: list, then watch, ready addresses only.

The kubernetes client is synchronous, so the list/watch loop runs in a thread and hands each new backend
set to the event loop. A watch that ends (server timeout) resumes from the last resourceVersion; one that
expired (410 Gone) or failed relists after a short back-off. The router's ServiceAccount needs get, list
and watch on `discovery.k8s.io` endpointslices in its namespace, nothing else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Mapping

from hpi_router.config import DiscoverySettings
from hpi_router.sources import Publish

logger = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
WATCH_TIMEOUT_S = 60
RETRY_DELAY_S = 2.0


def ready_urls(endpoint_slice: Mapping, port_name: str | None) -> set[str]:
    """http://ADDRESS:PORT for each ready endpoint of one EndpointSlice (dict as the API returns it)."""
    ports = endpoint_slice.get("ports") or []
    port = next((p.get("port") for p in ports if port_name is None or p.get("name") == port_name), None)
    if port is None:
        return set()
    urls = set()
    for endpoint in endpoint_slice.get("endpoints") or []:
        # The API says an unknown (absent) ready condition should be read as ready; terminating ones never are.
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
            urls.add(f"http://{host}:{port}")
    return urls


class EndpointSliceSource:
    def __init__(self, settings: DiscoverySettings, api_client=None):
        """`api_client`: a kubernetes ApiClient; default: in-cluster config, else the local kubeconfig."""
        self.settings = settings
        self._api_client = api_client
        self._stop = threading.Event()

    def _client(self):
        try:
            import kubernetes
        except ImportError:
            raise RuntimeError("--discover-service needs the kubernetes client: pip install "
                               "'hpi-runtime[kubernetes]'") from None
        if self._api_client is not None:
            return kubernetes.client.DiscoveryV1Api(self._api_client), kubernetes.watch.Watch
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        return kubernetes.client.DiscoveryV1Api(), kubernetes.watch.Watch

    async def run(self, publish: Publish) -> None:
        loop = asyncio.get_running_loop()
        api, watch_class = self._client()

        def publish_threadsafe(urls: set[str]) -> None:
            loop.call_soon_threadsafe(publish, frozenset(urls))

        thread = threading.Thread(target=self._loop, args=(api, watch_class, publish_threadsafe),
                                  name="endpointslice-watch", daemon=True)
        thread.start()
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            self._stop.set()

    def _loop(self, api, watch_class, publish) -> None:
        settings = self.settings
        selector = f"{SERVICE_NAME_LABEL}={settings.service}"
        while not self._stop.is_set():
            try:
                response = api.list_namespaced_endpoint_slice(settings.namespace, label_selector=selector,
                                                              _preload_content=False)
                listed = json.loads(response.data)
                slices = {item["metadata"]["name"]: ready_urls(item, settings.port_name)
                          for item in listed.get("items") or []}
                publish(set().union(*slices.values()))
                version = (listed.get("metadata") or {}).get("resourceVersion")
                while not self._stop.is_set():
                    watch = watch_class()
                    for event in watch.stream(api.list_namespaced_endpoint_slice, settings.namespace,
                                              label_selector=selector, resource_version=version,
                                              timeout_seconds=WATCH_TIMEOUT_S, allow_watch_bookmarks=True):
                        if self._stop.is_set():
                            watch.stop()
                            return
                        obj = event["raw_object"]
                        version = (obj.get("metadata") or {}).get("resourceVersion", version)
                        if event["type"] == "ERROR":
                            raise RuntimeError(f"watch error: {obj.get('message', obj)}")
                        if event["type"] == "BOOKMARK":
                            continue
                        name = obj["metadata"]["name"]
                        if event["type"] == "DELETED":
                            slices.pop(name, None)
                        else:
                            slices[name] = ready_urls(obj, settings.port_name)
                        publish(set().union(*slices.values()))
            except Exception as exc:  # API errors, 410 Gone, connection loss: relist after a pause
                if self._stop.is_set():
                    return
                logger.warning("EndpointSlice watch of %s/%s failed (%s: %s); relisting in %.0f s",
                               settings.namespace, settings.service, type(exc).__name__, exc, RETRY_DELAY_S)
                self._stop.wait(RETRY_DELAY_S)

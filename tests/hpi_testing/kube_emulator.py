"""A Kubernetes API emulator over HTTP for operator tests: kmock's emulator with the server-side behaviour
kopf and the kubernetes client rely on, plus helpers to run a real kopf operator against it.

What stock kmock lacks, and this subclass adds:
- uid, resourceVersion (one global counter), creationTimestamp and generation stamped on every write;
  generation bumps only when something outside metadata/status changes;
- lists carry a resourceVersion; watches honour `?resourceVersion=` and never replay already-seen events;
- PATCH as the API server does it: JSON patch (RFC 6902, a failed `test` is 422), merge patch (RFC 7386),
  strategic merge patch (built-in kinds only: 415 for custom resources), resourceVersion preconditions (409),
  the `status` subresource isolated from the main endpoint where declared; PUT replaces;
- server-side apply (`application/apply-patch+yaml`, `?fieldManager=`, `?force=`): managed fields per manager,
  conflicts as 409, an apply that creates (field_manager.py); every write records its manager's fields;
- a write that changes nothing is not stored: no new resourceVersion, no watch event (as the API server);
- an API that no built-in kind or CRD created here serves is 404 (a CRD's resources are served from its creation
  on); custom resources of a CRD created here get its structural schema on every write: nulls dropped, unknown
  fields pruned, defaults filled, validation failures answered 422 (crd_schema.py); pruned fields are logged
  in `pruned` so tests can fail on a field a real cluster would silently drop;
- label selectors (equality and existence) on lists and watches;
- watch history compaction (`compact()`: a watch resuming from before it gets 410 Gone), BOOKMARK events
  (`bookmark()`, and the initial-events-end bookmark of `sendInitialEvents`), ending every stream
  (`end_watches()`, as a watch timeout or a restart does);
- GET of the scale subresource: an autoscaling/v1 Scale from the CRD's scale paths or a Deployment's;
- built-in kinds as the API server stores them (builtin_kinds.py, k8s_openapi.py): quantities canonical,
  nulls dropped, defaults filled, immutable fields refused (422); strategic merge patches merge lists by their
  patch merge keys (strategic_merge.py); server-side apply merges and owns associative lists item by item;
- CRD validation rules (`x-kubernetes-validations`, CEL) on every write of a custom resource (cel_rules.py);
- DELETE honours finalizers, and a simple foreground-less garbage collector deletes owned objects.
Not emulated: field selectors, admission, and controllers (Deployments never create pods: tests patch their
status).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import json
import threading
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml

from hpi_testing.builtin_kinds import FieldError, apply_defaults, immutable_errors, normalise
from hpi_testing.crd_schema import apply_schema, crd_schemas
from hpi_testing.field_manager import ApplyConflict, apply, manager_name, record_update
from hpi_testing.k8s_openapi import Schema, builtin_schema, validate
from hpi_testing.strategic_merge import StrategicMergeError, strategic_merge

NOW = "2026-01-01T00:00:00Z"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.frozen
class WriteRecord:
    """One write request as the emulator answered it: what tests count to show that a resync wrote nothing."""

    verb: str  # create | patch | apply | update | delete
    resource: str  # "group/version/plural"
    namespace: str | None
    name: str | None
    subresource: str | None
    manager: str
    stored: bool  # False: the request changed nothing (no new resourceVersion) or was refused
    fields: tuple[str, ...] = ()  # the top-level fields of the request's body (a patch's "metadata", "status", ...)


class PatchError(Exception):
    """A JSON patch that cannot apply: the API server answers 422."""


class ApiError(Exception):
    """A request the API server refuses: answered as a v1 Status with this code (and `details`, for 422)."""

    def __init__(self, status: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.details = status, reason, message, details


def invalid(obj: Mapping[str, Any], group: str, errors: list[FieldError]) -> ApiError:
    """The API server's 422 for field errors: `Kind.group "name" is invalid: field: ...`, one cause a field."""
    kind, name = obj.get("kind"), (obj.get("metadata") or {}).get("name")
    qualified = f"{kind}.{group}" if group else str(kind)
    causes = [{"reason": e.reason, "message": str(e).split(": ", 1)[1], "field": e.field} for e in errors]
    message = f'{qualified} "{name}" is invalid: ' + ", ".join(str(e) for e in errors)
    if len(errors) > 1:
        message = f'{qualified} "{name}" is invalid: [' + ", ".join(str(e) for e in errors) + "]"
    details = {"name": name, "group": group, "kind": kind, "causes": causes}
    return ApiError(422, "Invalid", message, details)


def _user_agent(request: Any) -> str:
    return next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"bad JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def json_patch(doc: Any, operations: list[Mapping[str, Any]]) -> Any:
    """RFC 6902 on a copy of `doc`."""
    doc = copy.deepcopy(doc)
    for op in operations:
        parts = _pointer(op["path"])
        try:
            parent = _walk(doc, parts[:-1]) if parts else None
            key = parts[-1] if parts else None
            if op["op"] == "test":
                if _walk(doc, parts) != op.get("value"):
                    raise PatchError(f"test failed at {op['path']}")
            elif op["op"] in ("add", "replace"):
                if not parts:
                    doc = copy.deepcopy(op["value"])
                elif isinstance(parent, list):
                    index = len(parent) if key == "-" else int(key)
                    if op["op"] == "add":
                        parent.insert(index, copy.deepcopy(op["value"]))
                    else:
                        parent[index] = copy.deepcopy(op["value"])
                else:
                    if op["op"] == "replace" and key not in parent:
                        raise PatchError(f"nothing to replace at {op['path']}")
                    parent[key] = copy.deepcopy(op["value"])
            elif op["op"] == "remove":
                if isinstance(parent, list):
                    del parent[int(key)]
                else:
                    del parent[key]
            else:
                raise PatchError(f"unsupported op {op['op']!r}")
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise PatchError(f"{op['op']} {op['path']}: {e!r}") from e
    return doc


def merge_patch(doc: Any, patch: Any) -> Any:
    """RFC 7386: maps merge recursively, null deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(doc) if isinstance(doc, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def selector_matches(selector: str | None, labels: Mapping[str, str]) -> bool:
    """Equality (k=v, k==v, k!=v) and existence (k, !k) label selectors."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def _essence(obj: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


# (resource, namespaced, kind, subresources): everything the operator or kopf touches, incl. v1/namespaces
# (kopf waits for it forever otherwise).
RESOURCES: tuple[tuple[str, bool, str, tuple[str, ...]], ...] = (
    ("v1/namespaces", False, "Namespace", ("status",)),
    ("v1/nodes", False, "Node", ("status",)),
    ("v1/events", True, "Event", ()),
    ("events.k8s.io/v1/events", True, "Event", ()),
    ("v1/services", True, "Service", ("status",)),
    ("v1/pods", True, "Pod", ("status",)),
    ("v1/secrets", True, "Secret", ()),
    ("v1/configmaps", True, "ConfigMap", ()),
    ("v1/serviceaccounts", True, "ServiceAccount", ()),
    ("rbac.authorization.k8s.io/v1/roles", True, "Role", ()),
    ("rbac.authorization.k8s.io/v1/rolebindings", True, "RoleBinding", ()),
    ("inference.networking.k8s.io/v1/inferencepools", True, "InferencePool", ("status",)),
    ("networking.k8s.io/v1/networkpolicies", True, "NetworkPolicy", ()),
    ("v1/persistentvolumeclaims", True, "PersistentVolumeClaim", ("status",)),
    ("batch/v1/jobs", True, "Job", ("status",)),
    ("apps/v1/deployments", True, "Deployment", ("status", "scale")),
    ("policy/v1/poddisruptionbudgets", True, "PodDisruptionBudget", ("status",)),
    ("autoscaling/v2/horizontalpodautoscalers", True, "HorizontalPodAutoscaler", ("status",)),
    ("keda.sh/v1alpha1/scaledobjects", True, "ScaledObject", ("status",)),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", False, "CustomResourceDefinition", ("status",)),
    ("serving.hpi.dev/v1alpha1/inferencedeployments", True, "InferenceDeployment", ("status", "scale")),
)
VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator with the API server semantics listed in the module docstring."""

    _revisions: Iterator[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    _last_revision: int = attrs.field(default=0, init=False)
    # "group/version/plural" -> openAPIV3Schema, from the CustomResourceDefinitions created here.
    schemas: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)
    # (field manager, "group/version/plural", name, ".path") of every field a write had pruned.
    pruned: list[tuple[str, str, str, str]] = attrs.field(factory=list, init=False)
    # Every write request (POST, PATCH, PUT, DELETE) in arrival order, stored or not.
    writes: list[WriteRecord] = attrs.field(factory=list, init=False)
    # "group/version/plural" -> (specReplicasPath, statusReplicasPath, labelSelectorPath) of CRDs' scale subresource.
    scale_paths: dict[str, tuple[str, str, str | None]] = attrs.field(factory=dict, init=False)
    # Watch history older than this revision is compacted away (etcd compaction): a watch from before it gets 410.
    compacted_revision: int = attrs.field(default=0, init=False)
    expired_watches: int = attrs.field(default=0, init=False)  # watches answered 410 Gone

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for name, namespaced, kind, subresources in RESOURCES:
            self.resources[name] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, verbs=VERBS, subresources=set(subresources)
            )

    # -- bookkeeping ------------------------------------------------------------------------------------------

    def _next_revision(self) -> str:
        self._last_revision = next(self._revisions)
        return str(self._last_revision)

    def _resource_name(self, resource: Any) -> str:
        """"group/version/plural" (as in RESOURCES) of a request's resource."""
        group, version, plural = (getattr(resource, attr, None) for attr in ("group", "version", "plural"))
        return "/".join(part for part in (group, version, plural) if part) if plural else str(resource)

    def _subresources(self, resource: Any) -> set[str]:
        for known in self.resources:
            if known == resource:
                return set(self.resources[known].subresources)
        return set()

    def _kind(self, resource: Any) -> str | None:
        for known in self.resources:
            if known == resource:
                return self.resources[known].kind
        return None

    async def _publish(self, resource: Any, type_: str, obj: Mapping[str, Any]) -> None:
        await self._buses[resource].put({"type": type_, "object": copy.deepcopy(dict(obj))})

    def _schema(self, resource: Any) -> tuple[str, dict[str, Any]] | None:
        for name, schema in self.schemas.items():
            if resource == name:
                return name, schema
        return None

    def _typed_schema(self, request: kmock.Request, obj: Mapping[str, Any]) -> Schema | None:
        """The schema that drives list merging: a built-in kind's published one, or the CRD's structural one."""
        found = self._schema(request.resource)
        if found is not None:
            return Schema(found[1])
        return builtin_schema(str(obj.get("apiVersion") or ""), str(obj.get("kind") or ""))

    def _builtin(self, obj: dict[str, Any], old: dict[str, Any] | None, manager: str = "") -> dict[str, Any]:
        """Decode, default and validate a built-in object (builtin_kinds.py, the published schema): unknown fields
        are dropped (the API server's default field validation) and logged in `pruned`; a type, enum or required
        failure or a changed immutable field is a 422."""
        api_version, kind = str(obj.get("apiVersion") or ""), str(obj.get("kind") or "")
        schema = builtin_schema(api_version, kind)
        if schema is None:
            return obj
        group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
        try:
            obj = apply_defaults(normalise(obj, schema))
        except FieldError as e:
            raise invalid(obj, group, [e]) from e
        errors = immutable_errors(old, obj) if old is not None else []
        if errors:
            raise invalid(obj, group, errors)
        checked = validate(obj)
        name = str((obj.get("metadata") or {}).get("name"))
        if checked.errors:
            qualified = f"{kind}.{group}" if group else kind
            raise ApiError(422, "Invalid", f'{qualified} "{name}" is invalid: {"; ".join(checked.errors)}')
        for path in checked.unknown:
            _drop(obj, path)
            self.pruned.append((manager, f"{api_version}/{kind}", name, "." + ".".join(path)))
        return obj

    def _structural(
        self, request: kmock.Request, obj: dict[str, Any], manager: str, old: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Prune, default and validate a custom resource against its CRD's schema and rules (422 when invalid)."""
        found = self._schema(request.resource)
        if found is None:
            return obj
        name, schema = found
        result = apply_schema(obj, schema, old)
        if result.errors:
            what = f'{obj.get("kind")}.{name.split("/", 1)[0]} "{(obj.get("metadata") or {}).get("name")}"'
            raise ApiError(422, "Invalid", f"{what} is invalid: {'; '.join(result.errors)}")
        self.pruned.extend((manager, name, str((obj.get("metadata") or {}).get("name")), p) for p in result.pruned)
        return result.obj

    def _live(self, key: tuple[Any, str | None, str]) -> dict[str, Any] | None:
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    @staticmethod
    def _error(
        status: int, reason: str, message: str, details: dict[str, Any] | None = None
    ) -> aiohttp.web.StreamResponse:
        body = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "code": status, "reason": reason, "message": message}  # fmt: skip
        if details:
            body["details"] = details
        return aiohttp.web.json_response(body, status=status)

    # -- writes -----------------------------------------------------------------------------------------------

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
        try:
            plural = getattr(request.resource, "plural", None)
            if plural and self._kind(request.resource) is None:
                # An API no built-in kind or installed CRD serves (LWS, KEDA not installed): the API server's 404.
                return self._error(404, "NotFound", "the server could not find the requested resource")
            if request.resource is not None and method == "GET" and request.subresource == "scale":
                return await self._fetch_scale(request)
            if request.resource is not None and method == "GET" and request.subresource is None:
                # Served here rather than through kmock's reactions, which match each request against every
                # request served before it: a long test would slow down quadratically.
                if request.action == kmock.action.FETCH and request.name is not None:
                    return await self._fetch(request)
                if request.action == kmock.action.LIST and self._kind(request.resource):
                    return aiohttp.web.json_response(await self._serve_list(request))
            if request.resource is not None:
                write = self._write_handler(request, method)
                if write is not None:
                    return await self._logged(request, method, write)
        except ApiError as e:
            return self._error(e.status, e.reason, e.message, e.details)
        return await super()._handle(request)

    def _write_handler(self, request: kmock.Request, method: str) -> Any:
        if request.action == kmock.action.CREATE:
            return self._create
        if request.name is None:
            return None
        return {"PATCH": self._patch, "PUT": self._replace, "DELETE": self._delete}.get(method)

    async def _logged(self, request: kmock.Request, method: str, handler: Any) -> aiohttp.web.StreamResponse:
        """Answer a write with `handler` and record it in `writes` (stored: a new resourceVersion came of it)."""
        before = self._last_revision
        try:
            response = await handler(request)
        finally:
            content_type = request.headers.get("Content-Type", "")
            verb = {"POST": "create", "PUT": "update", "DELETE": "delete"}.get(method) or (
                "apply" if "apply-patch" in content_type else "patch")
            manager = manager_name(request.params, _user_agent(request))
            self.writes.append(WriteRecord(verb=verb, resource=self._resource_name(request.resource),
                                           namespace=request.namespace,
                                           name=request.name, subresource=request.subresource, manager=manager,
                                           stored=self._last_revision != before,
                                           fields=tuple(sorted(request.data)) if isinstance(request.data, dict)
                                           else ()))  # fmt: skip
        return response

    async def _fetch_scale(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """GET .../scale: an autoscaling/v1 Scale read from the object by the kind's replica and selector paths
        (apps/v1 Deployments: spec.replicas, status.replicas, the spec.selector's matchLabels; a custom resource:
        its CRD's subresources.scale)."""
        async with self._lock:
            obj = self._live((request.resource, request.namespace, request.name))
        if obj is None:
            return self._error(404, "NotFound", f"{request.name} not found")
        paths = self.scale_paths.get(self._resource_name(request.resource))
        if paths is None and obj.get("kind") == "Deployment":
            labels = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
            selector: str | None = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            spec_replicas, status_replicas = _at(obj, ".spec.replicas"), _at(obj, ".status.replicas")
        elif paths is not None:
            spec_replicas, status_replicas = _at(obj, paths[0]), _at(obj, paths[1])
            selector = _at(obj, paths[2]) if paths[2] else None
        else:
            return self._error(404, "NotFound", f"the server could not find the scale of {obj.get('kind')}")
        meta = obj["metadata"]
        scale = {"kind": "Scale", "apiVersion": "autoscaling/v1",
                 "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                              if k in meta},
                 "spec": {"replicas": spec_replicas or 0},
                 "status": {"replicas": status_replicas or 0,
                            **({"selector": selector} if selector else {})}}  # fmt: skip
        return aiohttp.web.json_response(scale)

    async def _fetch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        async with self._lock:
            obj = self._live((request.resource, request.namespace, request.name))
        if obj is None:
            return self._error(404, "NotFound", f"{request.name} not found")
        return aiohttp.web.json_response(obj)

    async def _create(
        self, request: kmock.Request, applied: dict[str, Any] | None = None
    ) -> aiohttp.web.StreamResponse:
        """POST, or an apply that finds nothing (`applied`: the object with the applier's managed fields)."""
        manager = manager_name(request.params, _user_agent(request))
        obj = copy.deepcopy(applied if applied is not None else request.data or {})
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        namespace = request.namespace or meta.get("namespace")
        if namespace:
            meta["namespace"] = namespace
        key = (request.resource, namespace, meta.get("name"))
        async with self._lock:
            if self._live(key) is not None:
                return self._error(409, "AlreadyExists", f"{meta.get('name')} already exists")
            kind = self._kind(request.resource)
            if kind and "kind" not in obj:
                obj["kind"] = kind
            obj["metadata"]["uid"] = str(uuid.uuid4())  # before defaulting: a Job's selector is made of it
            obj = self._builtin(self._structural(request, obj, manager), None, manager)
            if applied is None:
                obj = record_update(None, obj, manager, self._typed_schema(request, obj))
            meta = obj["metadata"]
            meta.update(creationTimestamp=_now(), generation=1, resourceVersion=self._next_revision())
            if request.resource == "apiextensions.k8s.io/v1/customresourcedefinitions":
                self.schemas.update(crd_schemas(obj))
                self.scale_paths.update(crd_scale_paths(obj))
                self.resources.update(crd_resources(obj))  # served from now on, as the API server does
            if key in self.objects:
                self.objects[key].create(obj)
            else:
                self.objects[key] = obj
            await self._publish(request.resource, "ADDED", obj)
        return aiohttp.web.json_response(obj, status=201)

    async def _store(
        self, request: kmock.Request, old: dict[str, Any], new: dict[str, Any], applied: bool = False
    ) -> dict[str, Any]:
        """Write `new` over `old` as the API server would (caller holds the lock); `applied`: `new` came from a
        server-side apply and carries its managed fields already. A write that changes nothing is not stored."""
        manager = manager_name(request.params, _user_agent(request))
        subresource = request.subresource
        if subresource == "status":
            new = {**old, "status": new.get("status")}
        elif subresource == "scale":
            replicas = (new.get("spec") or {}).get("replicas", (old.get("spec") or {}).get("replicas"))
            new = merge_patch(old, {"spec": {"replicas": replicas}})
        elif "status" in self._subresources(request.resource):
            new = {**new, "status": old.get("status")}
        if new.get("status") is None:
            new.pop("status", None)
        meta = new.setdefault("metadata", {})
        for immutable in ("uid", "creationTimestamp", "name", "namespace", "generation", "deletionTimestamp"):
            if immutable in old["metadata"]:
                meta[immutable] = old["metadata"][immutable]
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        new = self._builtin(self._structural(request, new, manager, old), old, manager)
        if not applied:
            new = record_update(old, new, manager, self._typed_schema(request, new))
        meta = new["metadata"]
        if new == old:
            return old
        if _essence(new) != _essence(old):
            meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        meta["resourceVersion"] = self._next_revision()
        key = (request.resource, request.namespace, request.name)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self.objects[key].create(new)
            self.objects[key].delete()
            await self._publish(request.resource, "DELETED", new)
            await self._collect_garbage(meta["uid"])
        else:
            self.objects[key].create(new)
            await self._publish(request.resource, "MODIFIED", new)
        return new

    async def _patch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        content_type = request.headers.get("Content-Type", "application/merge-patch+json")
        key = (request.resource, request.namespace, request.name)
        if "apply-patch" in content_type:
            return await self._apply(request)
        async with self._lock:
            old = self._live(key)
            if old is None:
                return self._error(404, "NotFound", f"{request.name} not found")
            try:
                if "json-patch" in content_type:
                    new = json_patch(old, request.data or [])
                elif "strategic-merge-patch" in content_type:
                    schema = builtin_schema(str(old.get("apiVersion")), str(old.get("kind")))
                    if schema is None:
                        return self._error(415, "UnsupportedMediaType", "the body of the request was in an unknown "
                                           "format - accepted media types include: application/json-patch+json, "
                                           "application/merge-patch+json, application/apply-patch+yaml")  # fmt: skip
                    new = strategic_merge(old, request.data or {}, schema)
                else:
                    wanted_rv = ((request.data or {}).get("metadata") or {}).get("resourceVersion")
                    if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
                        return self._error(409, "Conflict", "the object has been modified")
                    new = merge_patch(old, request.data or {})
            except (PatchError, StrategicMergeError) as e:
                return self._error(422, "Invalid", str(e))
            stored = await self._store(request, old, new)
        return aiohttp.web.json_response(stored)

    async def _apply(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """Server-side apply: merge the configuration as its field manager, create when nothing is there."""
        manager = request.params.get("fieldManager")
        if not manager:
            return self._error(400, "BadRequest", "fieldManager is required for apply requests")
        config = copy.deepcopy(request.data or {})
        if not isinstance(config, dict) or not config.get("apiVersion") or not config.get("kind"):
            return self._error(400, "BadRequest", "an apply configuration needs apiVersion and kind")
        if (config.get("metadata") or {}).get("name") != request.name:
            return self._error(400, "BadRequest", "the name in the configuration does not match the URL")
        key = (request.resource, request.namespace, request.name)
        force = request.params.get("force") == "true"
        async with self._lock:
            old = self._live(key)
        schema = self._typed_schema(request, config)
        try:
            # The configuration is decoded first, as the API server types it: its quantities are canonical.
            new = apply(old, normalise(config, schema), manager, force, schema)
        except FieldError as e:
            return self._error(422, "Invalid", str(e))
        except ApplyConflict as e:
            return self._error(409, "Conflict", str(e))
        if old is None:
            return await self._create(request, applied=new)
        async with self._lock:
            if self._live(key) != old:
                return self._error(409, "Conflict", "the object has been modified")
            stored = await self._store(request, old, new, applied=True)
        return aiohttp.web.json_response(stored)

    async def _replace(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            old = self._live(key)
            if old is None:
                return self._error(404, "NotFound", f"{request.name} not found")
            new = copy.deepcopy(request.data or {})
            wanted_rv = (new.get("metadata") or {}).get("resourceVersion")
            if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
                return self._error(409, "Conflict", "the object has been modified")
            stored = await self._store(request, old, new)
        return aiohttp.web.json_response(stored)

    async def _delete(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            old = self._live(key)
            if old is None:
                return self._error(404, "NotFound", f"{request.name} not found")
            if old["metadata"].get("finalizers"):
                if not old["metadata"].get("deletionTimestamp"):
                    old["metadata"]["deletionTimestamp"] = _now()
                    old["metadata"]["resourceVersion"] = self._next_revision()
                    self.objects[key].create(old)
                    await self._publish(request.resource, "MODIFIED", old)
                return aiohttp.web.json_response(old, status=202)
            old["metadata"]["resourceVersion"] = self._next_revision()
            self.objects[key].delete()
            await self._publish(request.resource, "DELETED", old)
            await self._collect_garbage(old["metadata"]["uid"])
        return aiohttp.web.json_response(old)

    async def _collect_garbage(self, owner_uid: str) -> None:
        """Delete (in background fashion) every object owned by `owner_uid`; caller holds the lock."""
        for (resource, namespace, name), obj in list(self.objects.items()):
            if obj.deleted:
                continue
            refs = (obj.raw.get("metadata") or {}).get("ownerReferences") or []
            if any(ref.get("uid") == owner_uid for ref in refs):
                child = copy.deepcopy(obj.raw)
                child["metadata"]["resourceVersion"] = self._next_revision()
                self.objects[resource, namespace, name].delete()
                await self._publish(resource, "DELETED", child)
                await self._collect_garbage(child["metadata"]["uid"])

    # -- reads ------------------------------------------------------------------------------------------------

    def _matching(self, request: kmock.Request) -> list[dict[str, Any]]:
        selector = request.params.get("labelSelector")
        found = []
        for (resource, namespace, name), obj in self.objects.items():
            if resource != request.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            if request.name is not None and name != request.name:
                continue
            raw = obj.raw
            if selector_matches(selector, (raw.get("metadata") or {}).get("labels") or {}):
                found.append(copy.deepcopy(raw))
        return found

    async def _serve_list(self, request: kmock.Request) -> Any:
        if not self._kind(request.resource):
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            items = self._matching(request)
            revision = str(self._last_revision)
        kind = self._kind(request.resource)
        return {"apiVersion": "v1", "kind": f"{kind}List", "metadata": {"resourceVersion": revision}, "items": items}

    def compact(self) -> int:
        """Compact the watch history up to now (as etcd does every few minutes): a watch that resumes from an
        older resourceVersion gets 410 Gone. Returns the compacted revision."""
        self.compacted_revision = self._last_revision
        return self.compacted_revision

    async def bookmark(self) -> None:
        """Send a BOOKMARK (the current resourceVersion, no object) to every watch that allows them, as the API
        server does about once a minute."""
        async with self._lock:
            for resource in list(self._buses):
                kind = self._kind(resource)
                group_version = self._resource_name(resource).rsplit("/", 1)[0]
                meta = {"resourceVersion": str(self._last_revision)}
                event = {"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": group_version, "metadata": meta}}
                await self._buses[resource].put(event)

    async def end_watches(self) -> None:
        """End every open watch stream, as the API server does at each watch's timeout or when it restarts:
        clients reconnect from the last resourceVersion they saw."""
        async with self._lock:
            for resource in list(self._buses):
                await self._buses[resource].put({"type": "END", "object": {}})

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        yield b""  # send the headers now: the stream is open even if nothing happens
        since = int(request.params.get("resourceVersion") or 0)
        selector = request.params.get("labelSelector")
        bookmarks = request.params.get("allowWatchBookmarks") == "true"
        if 0 < since < self.compacted_revision:
            # The API server's answer to a resourceVersion older than its history: an ERROR event, then the end.
            self.expired_watches += 1
            yield {"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Expired",
                "code": 410, "message": f"too old resource version: {since} ({self.compacted_revision})"}}  # fmt: skip
            return
        async with self._lock:  # the snapshot and the bus mark are taken atomically: no gap, no overlap
            mark = await self._buses[request.resource].mark()
            snapshot = self._matching(request)
            revision = self._last_revision
        for obj in snapshot:
            if int(obj["metadata"]["resourceVersion"]) > since:
                yield {"type": "ADDED", "object": obj}
        if bookmarks and request.params.get("sendInitialEvents") == "true":
            yield {"type": "BOOKMARK", "object": {"kind": self._kind(request.resource), "metadata": {
                "resourceVersion": str(revision), "annotations": {"k8s.io/initial-events-end": "true"}}}}  # fmt: skip
        async for event in mark:
            obj = event["object"]
            meta = obj.get("metadata") or {}
            if event["type"] == "END":
                return
            if event["type"] == "BOOKMARK":
                if bookmarks:
                    yield event
                continue
            if int(meta.get("resourceVersion", 0)) <= since:
                continue
            if request.namespace is not None and meta.get("namespace") != request.namespace:
                continue
            if request.name is not None and meta.get("name") != request.name:
                continue
            if selector_matches(selector, meta.get("labels") or {}):
                yield event


def _drop(obj: Any, path: tuple[str, ...]) -> None:
    for key in path[:-1]:
        obj = obj[int(key)] if isinstance(obj, list) else obj.get(key)
    if isinstance(obj, dict):
        obj.pop(path[-1], None)


def _at(obj: Mapping[str, Any], json_path: str) -> Any:
    """The value at a CRD's simple JSON path (".spec.replicas")."""
    value: Any = obj
    for key in json_path.lstrip(".").split("."):
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def crd_scale_paths(crd: Mapping[str, Any]) -> dict[str, tuple[str, str, str | None]]:
    spec = crd.get("spec") or {}
    found = {}
    for version in spec.get("versions") or []:
        scale = (version.get("subresources") or {}).get("scale")
        if scale:
            found[f"{spec['group']}/{version['name']}/{spec['names']['plural']}"] = (
                scale["specReplicasPath"], scale["statusReplicasPath"], scale.get("labelSelectorPath"))
    return found


def crd_resources(crd: Mapping[str, Any]) -> dict[str, kmock.ResourceInfo]:
    """The resources a CustomResourceDefinition makes the API server serve ("group/version/plural" -> info)."""
    spec = crd.get("spec") or {}
    return {
        f"{spec['group']}/{version['name']}/{spec['names']['plural']}": kmock.ResourceInfo(
            kind=spec["names"]["kind"], namespaced=spec.get("scope", "Namespaced") == "Namespaced", verbs=VERBS,
            subresources=set(version.get("subresources") or {}))  # fmt: skip
        for version in spec.get("versions") or []
        if version.get("served", True)
    }


def install_crd(emulator: KubeEmulator, crd: Mapping[str, Any]) -> None:
    """Put a CustomResourceDefinition in place before serving, as `kubectl apply -f crds/` would."""
    obj = copy.deepcopy(dict(crd))
    obj["metadata"] = {**obj.get("metadata", {}), "uid": str(uuid.uuid4()), "resourceVersion": "0", "generation": 1}
    emulator.objects["apiextensions.k8s.io/v1/customresourcedefinitions", None, obj["metadata"]["name"]] = obj
    emulator.schemas.update(crd_schemas(obj))
    emulator.scale_paths.update(crd_scale_paths(obj))
    emulator.resources.update(crd_resources(obj))


# -- running things against it -------------------------------------------------------------------------------


def write_kubeconfig(path: Path, server: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "kmock", "user": {"token": "kmock"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}],
        "current-context": "kmock",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def operator_thread(registry: Any, memo: Any = None, timeout_s: float = 20.0) -> Iterator[None]:
    """Run a real kopf operator in its own thread and event loop (stopping kopf cancels its loop's tasks)."""
    import kopf

    stop_flag, ready_flag = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def main() -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(
                kopf.operator(
                    registry=registry,
                    standalone=True,
                    clusterwide=True,
                    stop_flag=stop_flag,
                    ready_flag=ready_flag,
                    memo=memo if memo is not None else kopf.Memo(),
                )
            )
        except BaseException as e:  # surfaced to the test below
            errors.append(e)
        finally:
            loop.close()

    thread = threading.Thread(target=main, name="kopf-operator", daemon=True)
    thread.start()
    if not ready_flag.wait(timeout_s):
        stop_flag.set()
        raise RuntimeError(f"the operator did not get ready: {errors!r}")
    try:
        yield
    finally:
        stop_flag.set()
        thread.join(timeout_s)
        if errors:
            raise RuntimeError("the operator failed") from errors[0]


async def eventually(check: Any, timeout_s: float = 60.0, interval_s: float = 0.1) -> Any:
    """Await `check()` (sync, run in a thread so the emulator's loop keeps serving) until it returns truthy
    without an AssertionError; returns its value."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            value = await asyncio.to_thread(check)
            if value:
                return value
            failure: BaseException | None = AssertionError(f"{check!r} stayed falsy ({value!r})")
        except AssertionError as e:
            failure = e
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {failure}") from failure
        await asyncio.sleep(interval_s)


# -- objects for tests ---------------------------------------------------------------------------------------


def make_node(
    name: str,
    *,
    gpu: tuple[str, int, int] | None = None,  # (product, memory MiB, count)
    bf16: bool = False,
    memory: str = "64Gi",
    cpu: str = "16",
    ready: bool = True,
    unschedulable: bool = False,
    taints: list[dict[str, str]] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A v1 Node as GPU Feature Discovery and Node Feature Discovery would label it."""
    node_labels = {"kubernetes.io/hostname": name, "kubernetes.io/arch": "amd64", "kubernetes.io/os": "linux"}
    allocatable = {"cpu": cpu, "memory": memory, "pods": "110"}
    if gpu:
        product, memory_mib, count = gpu
        node_labels.update({
            "nvidia.com/gpu.product": product,
            "nvidia.com/gpu.memory": str(memory_mib),
            "nvidia.com/gpu.count": str(count),
            "nvidia.com/gpu.present": "true",
        })  # fmt: skip
        allocatable["nvidia.com/gpu"] = str(count)
    if bf16:
        node_labels["feature.node.kubernetes.io/cpu-cpuid.AVX512BF16"] = "true"
        node_labels["feature.node.kubernetes.io/cpu-cpuid.AMXBF16"] = "true"
    node_labels.update(labels or {})
    spec: dict[str, Any] = {}
    if unschedulable:
        spec["unschedulable"] = True
    if taints:
        spec["taints"] = taints
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": node_labels},
        "spec": spec,
        "status": {
            "allocatable": allocatable,
            "capacity": dict(allocatable),
            "conditions": [{"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady"}],
        },
    }


def runtime_pod(name: str, port: int, labels: dict[str, str], namespace: str = "default") -> dict[str, Any]:
    """A runtime pod as the Deployment controller and kubelet would leave it: Running, Ready, with a loopback IP
    and its metrics on `port` (the container port named http), e.g. a hpi_testing.server.serve_metrics one."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"containers": [{"name": "runtime", "image": "x", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip


def finished_job_pod(job: Mapping[str, Any], message: str, ok: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pod of `job` as the Job controller creates it and the kubelet leaves it once its one container ended with
    `message` as its termination message: (the pod to create, its status to patch)."""
    name, template = job["metadata"]["name"], job["spec"]["template"]
    container = template["spec"]["containers"][0]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"{name}-{job['metadata']['uid'][:5]}", "namespace": job["metadata"]["namespace"],
                        "labels": {**template["metadata"]["labels"], "batch.kubernetes.io/job-name": name}},
           "spec": {"containers": template["spec"]["containers"], "restartPolicy": "Never"}}  # fmt: skip
    terminated = {"exitCode": 0 if ok else 1, "reason": "Completed" if ok else "Error", "message": message,
                  "startedAt": _now(), "finishedAt": _now()}  # fmt: skip
    container_status = {"name": container["name"], "image": container["image"], "imageID": "", "ready": False,
                        "restartCount": 0, "state": {"terminated": terminated}}  # fmt: skip
    status = {"phase": "Succeeded" if ok else "Failed", "containerStatuses": [container_status]}
    return pod, {"status": status}


def finished_job_status(ok: bool, message: str = "") -> dict[str, Any]:
    """A Job's status once it completed, or failed (`message`: why) after its pod retries."""
    cond = {"type": "Complete" if ok else "Failed", "status": "True", "reason": "" if ok else "DeadlineExceeded",
            "message": message, "lastTransitionTime": _now()}  # fmt: skip
    return {"status": {"conditions": [cond], "succeeded" if ok else "failed": 1}}


H100 = ("NVIDIA-H100-80GB-HBM3", 81559, 8)
H200 = ("NVIDIA-H200", 143771, 8)
A100_40 = ("NVIDIA-A100-SXM4-40GB", 40960, 8)
A100_80 = ("NVIDIA-A100-SXM4-80GB", 81920, 8)
A10 = ("NVIDIA-A10", 23028, 1)
L4 = ("NVIDIA-L4", 23034, 1)
T4 = ("Tesla-T4", 15360, 1)


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)

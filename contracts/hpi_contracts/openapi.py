"""The OpenAPI 3.1 document a server publishes at `GET /openapi.json`, built from its list of operations and
the request bodies declared in openai_requests.py (the declarations its parser reads), never written by hand.
The runtime and the router each list their own operations; a test per server checks the list against the
routes its aiohttp app actually has."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpi_contracts.openai_requests import RequestBody

OPENAPI_PATH = "/openapi.json"
ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


@dataclass(frozen=True)
class Operation:
    """One endpoint: `method` in lower case, its JSON body (if it takes one), its query parameters (name -> JSON
    schema), and what a 200 answer's content type is (`streams`: text/event-stream too, when `stream` is true)."""

    method: str
    path: str
    summary: str
    body: RequestBody | None = None
    query: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    content_type: str = "application/json"
    streams: bool = False

    def document(self) -> dict[str, Any]:
        ok_content = {self.content_type: {}}
        if self.streams:
            ok_content["text/event-stream"] = {}
        operation: dict[str, Any] = {
            "summary": self.summary,
            "operationId": f"{self.method}_{self.path.strip('/').replace('/', '_') or 'root'}",
            "responses": {
                "200": {"description": "OK", "content": ok_content},
                "default": {"description": "An error in OpenAI's shape",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            },
        }
        if self.body is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{self.body.name}"}}}}
        if self.query:
            operation["parameters"] = [{"name": name, "in": "query", "required": False, "schema": dict(schema)}
                                       for name, schema in self.query.items()]
        return operation


def openapi_document(title: str, version: str, operations: tuple[Operation, ...]) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    schemas: dict[str, Any] = {"Error": ERROR_SCHEMA}
    for operation in operations:
        paths.setdefault(operation.path, {})[operation.method] = operation.document()
        if operation.body is not None:
            schemas[operation.body.name] = operation.body.schema()
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        # A key is needed only where the server is configured with one (an empty requirement: optional).
        "security": [{}, {"bearer": []}],
    }

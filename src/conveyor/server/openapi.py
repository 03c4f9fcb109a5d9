"""The OpenAPI schema says what the server answers: a 400 with the OpenAI error body for an
invalid request (errors.py turns pydantic's 422 into it), never FastAPI's default 422."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_ERROR_SCHEMA = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"type": "integer"},
            },
        }
    },
}
_BAD_REQUEST = {
    "description": "Invalid request (OpenAI error body)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}


def document_errors_as_400(app: FastAPI) -> None:
    """Make `app.openapi()` list a 400 with the error body wherever FastAPI lists a 422."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = _BAD_REQUEST
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        components["ErrorResponse"] = _ERROR_SCHEMA
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

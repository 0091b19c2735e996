"""The events API in the OpenAPI document: object types as a discriminated union.

Validation at run time stays one model (`EventIn`, its payload checked against the type's
model after parsing: events/payloads.py); only the document is written per type, so a
client or a fuzzer learns each type's payload from `/openapi.json` instead of from 400s.
"""

from __future__ import annotations

import copy
from typing import Any

from queuekeeper.events.payloads import PAYLOAD_MODELS

REF = "#/components/schemas/{model}"


def variant_name(object_type: str) -> str:
    """`order` -> `OrderEvent`, `service_account` -> `ServiceAccountEvent`."""
    return "".join(part.capitalize() for part in object_type.split("_")) + "Event"


def document_payloads(schema: dict[str, Any]) -> None:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    event = components.get("EventIn")
    if event is None or "oneOf" in event:
        return
    mapping: dict[str, str] = {}
    for object_type, model in PAYLOAD_MODELS.items():
        payload = model.model_json_schema(ref_template=REF)
        components.update(payload.pop("$defs", {}))
        name = model.__name__
        if model.__doc__ is None and name == "Payload":
            payload["description"] = "Any JSON object: no field is required for this type yet."
        components.setdefault(name, payload)
        variant = copy.deepcopy(event)
        variant["title"] = variant_name(object_type)
        variant["description"] = f"An event of object type `{object_type}`."
        variant["properties"]["object_type"] = {"type": "string", "enum": [object_type]}
        variant["properties"]["payload"] = {
            "$ref": REF.format(model=name),
            "description": f"Checked against `{name}`; fields beyond it are kept and delivered.",
        }
        variant.pop("examples", None)
        components[variant["title"]] = variant
        mapping[object_type] = REF.format(model=variant["title"])
    components["EventIn"] = {
        "title": "EventIn",
        "description": "One event; its `object_type` decides the payload's schema (one "
        "variant per type). Fields of a payload beyond its schema are kept and delivered.",
        "oneOf": [{"$ref": ref} for ref in mapping.values()],
        "discriminator": {"propertyName": "object_type", "mapping": mapping},
        "examples": event.get("examples", []),
    }

"""Deterministic minimal values that validate against a JSON schema (tool arguments, structured output)."""

from __future__ import annotations

import random
from typing import Any

from gateway.sim.tokens import words

# Deep or cyclic $ref chains end here with the simplest value of the type asked for, rather than
# recursing forever on a schema such as a linked list.
_MAX_DEPTH = 12

_FORMATS = {
    "date-time": "2025-01-01T00:00:00Z", "date": "2025-01-01", "time": "00:00:00Z",
    "email": "sim@example.com", "uri": "https://example.com/sim", "url": "https://example.com/sim",
    "hostname": "example.com", "ipv4": "192.0.2.1", "ipv6": "2001:db8::1",
    "uuid": "00000000-0000-4000-8000-000000000000", "duration": "PT1S",
}


def instance(schema: Any, rng: random.Random) -> Any:
    """A value valid for `schema`: required properties only, smallest arrays, bounded numbers."""
    return _Gen(schema if isinstance(schema, dict) else {}, rng).value(schema, 0)


class _Gen:
    def __init__(self, root: dict[str, Any], rng: random.Random) -> None:
        self.root = root
        self.rng = rng

    def value(self, schema: Any, depth: int) -> Any:
        if schema is True or not isinstance(schema, dict):
            return "sim"
        schema = self._resolve(schema, depth)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return schema["enum"][self.rng.randrange(len(schema["enum"]))]
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and options:
                # The first branch that is not null: the one a constrained decoder takes first.
                pick = next((o for o in options if not (isinstance(o, dict) and o.get("type") == "null")),
                            options[0])
                return self.value({**_without(schema, key), **self._resolve(pick, depth)}, depth + 1)
        if isinstance(schema.get("allOf"), list):
            merged = _without(schema, "allOf")
            for part in schema["allOf"]:
                merged = _merge(merged, self._resolve(part, depth))
            return self.value(merged, depth + 1)
        kind = _type_of(schema)
        if depth > _MAX_DEPTH:
            return {"object": {}, "array": [], "string": "", "integer": 0, "number": 0,
                    "boolean": False, "null": None}[kind]
        return getattr(self, "_" + kind)(schema, depth)

    def _resolve(self, schema: Any, depth: int) -> dict[str, Any]:
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#") or depth > _MAX_DEPTH:
            return schema if isinstance(schema, dict) else {}
        node: Any = self.root
        for part in ref.lstrip("#").strip("/").split("/"):
            if not part:
                continue
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        target = self._resolve(node, depth + 1) if isinstance(node, dict) else {}
        return {**_without(schema, "$ref"), **target}

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        props = schema.get("properties")
        if not isinstance(props, dict):
            props = {}
        required = [r for r in schema.get("required", []) if isinstance(r, str)]
        out: dict[str, Any] = {}
        for name in required:
            out[name] = self.value(props.get(name, {}), depth + 1)
        return out

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        low = _int(schema.get("minItems"), 0)
        high = _int(schema.get("maxItems"), max(low, 1))
        count = min(max(low, 1), high)
        prefix = schema.get("prefixItems")
        if not isinstance(prefix, list):
            prefix = []
        items = schema.get("items", {})
        out = [self.value(prefix[i] if i < len(prefix) else items, depth + 1) for i in range(count)]
        if schema.get("uniqueItems") and all(isinstance(v, (int, float, str)) for v in out):
            out = list(dict.fromkeys(out)) or out[:1]
        return out

    def _string(self, schema: dict[str, Any], depth: int) -> str:
        text = _FORMATS.get(str(schema.get("format")), "") or words(self.rng, 2)
        low = _int(schema.get("minLength"), 0)
        high = _int(schema.get("maxLength"), max(len(text), low))
        if len(text) < low:
            text = (text + " " + words(self.rng, low))[:low].ljust(low, "x")
        return text[:high]

    def _integer(self, schema: dict[str, Any], depth: int) -> int:
        low, high = _bounds(schema, integer=True)
        value = self.rng.randint(low, high)
        step = schema.get("multipleOf")
        if isinstance(step, int) and not isinstance(step, bool) and step > 0:
            value = -(-low // step) * step  # the smallest multiple in range
        return value

    def _number(self, schema: dict[str, Any], depth: int) -> float:
        low, high = _bounds(schema, integer=False)
        return round(low + (high - low) * self.rng.random(), 2) if high > low else low

    def _boolean(self, schema: dict[str, Any], depth: int) -> bool:
        return self.rng.random() < 0.5

    def _null(self, schema: dict[str, Any], depth: int) -> None:
        return None


def _type_of(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if kind in ("object", "array", "string", "integer", "number", "boolean", "null"):
        return str(kind)
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        return "number"
    return "string"


def _bounds(schema: dict[str, Any], integer: bool) -> tuple[Any, Any]:
    low = schema.get("minimum")
    high = schema.get("maximum")
    ex_low, ex_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    step = 1 if integer else 0.01
    if isinstance(ex_low, (int, float)) and not isinstance(ex_low, bool):
        low = ex_low + step if low is None else max(low, ex_low + step)
    if isinstance(ex_high, (int, float)) and not isinstance(ex_high, bool):
        high = ex_high - step if high is None else min(high, ex_high - step)
    low = 1 if not isinstance(low, (int, float)) or isinstance(low, bool) else low
    high = max(low, 100) if not isinstance(high, (int, float)) or isinstance(high, bool) else high
    if integer:
        low, high = int(-(-low // 1)), int(high // 1)
    return low, max(low, high)


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _without(schema: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k != key}


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {**a, **b}
    if isinstance(a.get("properties"), dict) and isinstance(b.get("properties"), dict):
        out["properties"] = {**a["properties"], **b["properties"]}
    if isinstance(a.get("required"), list) and isinstance(b.get("required"), list):
        out["required"] = list(dict.fromkeys(a["required"] + b["required"]))
    return out

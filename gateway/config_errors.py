"""Configuration errors as an operator reads them: every one at once, list entries by their id, near matches named."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError


def near(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to `word` when one is close (a typo, another case), else None."""
    pool = [c for c in candidates if c != word]
    same_case = [c for c in pool if c.lower() == word.lower()]
    if same_case:
        return same_case[0]
    found = difflib.get_close_matches(word, pool, n=1, cutoff=0.75)
    return found[0] if found else None


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """" (did you mean `x`?)" for a near match, else ""."""
    match = near(word, candidates)
    return f" (did you mean `{match}`?)" if match is not None else ""


def where(loc: Sequence[int | str], data: Any) -> str:
    """A field's path with each list entry named by its id (or name): `backends[vllm-0].url`, not `backends.1.url`;
    an entry without one by its place, counted from 1 as the file reads: `backends[#2]`."""
    out = ""
    node = data
    for p in loc:
        if isinstance(p, int):
            item = node[p] if isinstance(node, list) and 0 <= p < len(node) else None
            label = next((item[k] for k in ("id", "name") if isinstance(item, dict) and isinstance(item.get(k), str)
                          and item[k]), None)
            out += f"[{label}]" if label is not None else f"[#{p + 1}]"
            node = item
        else:
            out += f".{p}" if out else p
            node = node.get(p) if isinstance(node, dict) else None
    return out or "(top level)"


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field holds (through Optional, tuple[X, ...] and dict[str, X]), and whether a dict key comes first
    in a path into it."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            model, keyed = _model_of(arg)
            if model is not None:
                return model, keyed
        return None, False
    if origin is tuple:
        return _model_of(typing.get_args(annotation)[0])
    if origin is dict:
        model, _ = _model_of(typing.get_args(annotation)[1])
        return model, model is not None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    return None, False


def fields_at(root: type[BaseModel], loc: Sequence[int | str]) -> list[str] | None:
    """The keys the model at `loc` takes (for an unknown key's near match), None when it is no model's."""
    model: type[BaseModel] | None = root
    skip_key = False
    for p in loc:
        if model is None:
            return None
        if isinstance(p, int):
            continue
        if skip_key:  # the key of a dict of models (a model's name under routing.models)
            skip_key = False
            continue
        info = model.model_fields.get(p)
        if info is None:
            return None
        model, skip_key = _model_of(info.annotation)
    return list(model.model_fields) if model is not None and not skip_key else None


def error_lines(err: ValidationError, data: Any, root: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[str]:
    """One line per error pydantic found (it checks every field, so these are all of them), in the file's words."""
    lines = []
    errors = err.errors()
    failed_within = {e["loc"][:-1] for e in errors if len(e["loc"]) > 1}
    for e in errors:
        if e["type"] == "too_short" and any(f[:len(e["loc"])] == e["loc"] for f in failed_within):
            continue  # a list left empty by its entries' own errors, which are listed
        loc = (*prefix, *e["loc"])
        path = where(loc, data)
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            key = str(loc[-1]) if loc else ""
            known = fields_at(root, loc[:-1])
            msg = "unknown key" + (did_you_mean(key, known) if known else "")
        elif e["type"] == "value_error":
            msg = str(e.get("ctx", {}).get("error", msg))  # our own words, without pydantic's "Value error, "
        if not e["loc"] and not prefix:
            lines += [f"  {m}" for m in msg.splitlines()]  # checks across sections name their own fields
        else:
            lines.append(f"  {path}: {msg}")
    return lines

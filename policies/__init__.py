"""Routing policies, one per file; REGISTRY maps the config's policy name to (class, its Params)."""

from typing import Any, Callable

from pydantic import BaseModel

from gateway.contracts import Policy
from policies import least_loaded, prefix_affinity, round_robin, shape, shape_params

# name -> (the policy's class, made from its validated Params; the Params model)
REGISTRY: dict[str, tuple[Callable[[Any], Policy], type[BaseModel]]] = {
    "round_robin": (round_robin.RoundRobin, round_robin.Params),
    "least_loaded": (least_loaded.LeastLoaded, least_loaded.Params),
    "prefix_affinity": (prefix_affinity.PrefixAffinity, prefix_affinity.Params),
    "shape": (shape.Shape, shape_params.Params),
}


def policy_names() -> tuple[str, ...]:
    """The policy names a configuration may use (for a near match when it names another)."""
    return tuple(REGISTRY)

"""Routing policies, one per file; REGISTRY maps the config's policy name to (class, its Params)."""

from policies import least_loaded, prefix_affinity, round_robin, shape

REGISTRY = {
    "round_robin": (round_robin.RoundRobin, round_robin.Params),
    "least_loaded": (least_loaded.LeastLoaded, least_loaded.Params),
    "prefix_affinity": (prefix_affinity.PrefixAffinity, prefix_affinity.Params),
    "shape": (shape.Shape, shape.Params),
}

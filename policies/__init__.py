"""Routing policies, one per file; REGISTRY maps the config's policy name to (class, its Params)."""

from policies import least_loaded, round_robin

REGISTRY = {
    "round_robin": (round_robin.RoundRobin, round_robin.Params),
    "least_loaded": (least_loaded.LeastLoaded, least_loaded.Params),
}

"""One request's routing: its state, shape, context fit, admission, failover, relay and affinity."""

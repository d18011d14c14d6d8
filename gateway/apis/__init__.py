"""The public APIs the gateway serves, one module each: what a body must hold, its prompt, its events, its errors."""

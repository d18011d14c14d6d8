"""End-to-end tests against real inference engines (opt-in, built and cached on first use)."""

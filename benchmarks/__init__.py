"""Reproducible benchmarks (run from the repository's root: `python3 -m benchmarks.NAME`); README.md maps them."""

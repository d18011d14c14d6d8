"""shapegate: one OpenAI-compatible endpoint in front of a portfolio of inference engines."""

from pathlib import Path as _Path


def _refuse_stale_compiled() -> None:
    """A module compiled by deploy/compile.py is imported in place of its source: once the source has changed,
    the gateway would run the old code without a word. It refuses to start instead."""
    root = _Path(__file__).resolve().parents[1]
    for package in ("gateway", "backends", "policies"):
        for so in (root / package).rglob("*.cpython-*.so"):
            source = so.with_name(so.name.split(".", 1)[0] + ".py")
            if source.exists() and source.stat().st_mtime > so.stat().st_mtime:
                raise ImportError(f"{source.relative_to(root)} is newer than its compiled module {so.name}: run "
                                  f"`python3 deploy/compile.py` again, or `python3 deploy/compile.py --clean` "
                                  f"to run from the sources")


_refuse_stale_compiled()

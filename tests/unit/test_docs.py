"""The docs stay true to the tree: a short README, every module in docs/architecture.md, links and paths that exist."""

from __future__ import annotations

import hashlib
import re
import tomllib
from pathlib import Path

from gateway.config import KEY_PLACEHOLDER, parse_config
from gateway.runtime import build_policy

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PAGES = (README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")))
PACKAGES = ("gateway", "backends", "policies")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# A path of the repository inside a code span: a top-level folder, then anything but spaces and wildcards.
REPO_PATH = re.compile(r"(?<![\w./~<-])((?:gateway|backends|policies|tests|benchmarks|deploy|docs)/[\w./-]*)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def modules() -> list[str]:
    """Every module of the three packages but the packages' own __init__.py (the engine simulator and the
    dashboard included: they are listed module by module like the rest)."""
    return sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but - and _ dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    found: set[str] = set()
    for line in text.splitlines():
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            name, n = base, 0
            while name in found:  # a repeated heading gets -1, -2, ...
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail to docs/"


def test_every_module_is_in_the_architecture_page():
    text = ARCHITECTURE.read_text()
    missing = [m for m in modules() if f"`{m}`" not in text]
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def test_relative_links_point_to_files_and_headings_that_exist():
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_paths_named_in_the_docs_exist():
    # CONTRIBUTING.md names the files its examples would create; the README and docs/ name only real ones.
    missing = []
    for page in (README, *sorted((ROOT / "docs").glob("*.md"))):
        for span in CODE_SPAN.findall(page.read_text()):
            for path in REPO_PATH.findall(span):
                if not (ROOT / path.rstrip(".")).exists():
                    missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_readme_and_ci_run_the_same_tests():
    readme, ci = README.read_text(), (ROOT / ".ci" / "run").read_text()
    for command in ("python3 -m pytest tests -q", "python3 deploy/compile.py --copy", "SHAPEGATE_COMPILED=1"):
        assert command in readme and command in ci, command


def test_the_readme_configuration_loads():
    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1
    text = blocks[0].replace(KEY_PLACEHOLDER, hashlib.sha256(b"a-key-of-ones-own").hexdigest())
    cfg = parse_config(tomllib.loads(text), build_policy)
    assert {b.engine for b in cfg.backends} == {"vllm", "sglang", "llamacpp"}


def test_the_layers_drawn_are_the_layers_enforced():
    from tests.unit.test_layering import LAYERS

    section = ARCHITECTURE.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    drawn = [line.split() for line in FENCE.findall(section)[0].splitlines()[1:-1]]
    enforced = [[u.replace(".", "/") + ("/" if (ROOT / u.replace(".", "/")).is_dir() else ".py")
                 for u in units if u != "gateway"] for units in reversed(LAYERS)]
    assert drawn == [units for units in enforced if units], "docs/architecture.md's layers differ from LAYERS"

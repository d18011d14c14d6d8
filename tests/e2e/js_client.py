"""The official openai JavaScript/TypeScript SDK for the e2e tests: a pinned version installed once with npm into
the e2e cache, and a script of tests/e2e/js run with Node.js against the gateway."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

from tests.e2e.cache import cache_root

OPENAI_JS = "7.60.0"  # the SDK's version on the npm registry when these tests were written
JS_DIR = Path(__file__).parent / "js"


def ensure_openai_js() -> Path:
    """The directory holding node_modules/openai at the pinned version (npm install on first use)."""
    where = cache_root() / f"npm-openai-{OPENAI_JS}"
    if (where / "node_modules" / "openai" / "package.json").exists():
        return where
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise RuntimeError("Node.js and npm are needed for the JavaScript SDK tests (apt-get install nodejs npm)")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(where), f"openai@{OPENAI_JS}"],
                          capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"npm install openai@{OPENAI_JS} failed: {done.stderr[-2000:]}")
    return where


async def run_script(name: str, *args: str, timeout: float = 600.0) -> dict:
    """Run tests/e2e/js/NAME with Node.js (copied under the SDK's install, where its `import "openai"` resolves);
    the one line of JSON it prints."""
    modules = await asyncio.to_thread(ensure_openai_js)
    work = modules / "scripts"
    work.mkdir(exist_ok=True)
    script = work / name
    script.write_text((JS_DIR / name).read_text())  # beside node_modules: `import "openai"` resolves there
    proc = await asyncio.create_subprocess_exec(shutil.which("node") or "node", str(script), *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    if proc.returncode != 0:
        raise AssertionError(f"node {name} exited {proc.returncode}: {err.decode()[-3000:]}")
    return json.loads(out.decode().strip().splitlines()[-1])

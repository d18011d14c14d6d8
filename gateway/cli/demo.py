"""`shapegate demo`: a simulated vLLM/SGLang/llama.cpp portfolio with the gateway in front, in one process."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile

from gateway.app import build_app, serve
from gateway.config import parse_config
from gateway.keys.principal import hash_key, new_key
from gateway.runtime import build_policy
from gateway.sim.runner import SimOptions, start_sim

MODEL = "qwen3-30b"
SECOND_MODEL = "qwen3-8b"
# The workstation portfolio: published single-card numbers (see gateway/sim/profiles/r9700.toml).
PORTFOLIO = (
    ("vllm-0", "vllm", "r9700-vllm", MODEL, (SECOND_MODEL,)),
    ("sglang-0", "sglang", "r9700-sglang", MODEL, ()),
    ("llama-0", "llamacpp", "r9700-llamacpp-vulkan", "Qwen3-30B-A3B-Q4_K_XL.gguf", ()),
)


def demo_config(urls: dict[str, str], key_digest: str, host: str, port: int, ab: bool = False) -> dict:
    backends = []
    for bid, engine, _profile, native, extra in PORTFOLIO:
        models = {MODEL: native, **{m: m for m in extra}}
        entry = {"id": bid, "engine": engine, "url": urls[bid], "models": models}
        if engine == "llamacpp":
            entry["interactive"] = True
        backends.append(entry)
    cfg = {
        "server": {"host": host, "port": port, "access_log": False},
        "auth": {"keys": [{"id": "demo", "sha256": key_digest, "admin": True}]},
        "routing": {"policy": "shape"},
        "dashboard": {"secure_cookie": False},
        "backends": backends,
    }
    if ab:  # vLLM against SGLang for the model all three serve, each end user (a header) on one of them
        cfg["experiments"] = [{"name": "vllm-vs-sglang", "model": MODEL, "subject": "header:x-end-user",
                               "arms": [{"name": "vllm", "backends": ["vllm-0"]},
                                        {"name": "sglang", "backends": ["sglang-0"]}]}]
    return cfg


def key_files(key: str) -> tuple[str, str, str]:
    """A private directory (0700) with the demo's key (`api-key`) and its Authorization header (`auth-header`), each
    0600: the commands the demo prints read the key from there, so that it is never on a command line (which
    `ps` shows every local user). Returns (directory, key file, header file)."""
    directory = tempfile.mkdtemp(prefix="shapegate-demo-")
    paths = []
    for name, text in (("api-key", key + "\n"), ("auth-header", f"Authorization: Bearer {key}\n")):
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        paths.append(path)
    return directory, paths[0], paths[1]


def banner(url: str, key: str, key_file: str, header_file: str, ab: bool = False) -> str:
    experiment = f"""
A/B experiment vllm-vs-sglang on {MODEL}: each x-end-user header value sticks to one arm.
  verdicts: shapegate ab --url {url}   (the key from SHAPEGATE_ADMIN_KEY; also {url}/admin/experiments)
""" if ab else ""
    return f"""
shapegate demo is running: {url}
  engines : vllm-0 (vLLM-like), sglang-0 (SGLang-like), llama-0 (llama.cpp Vulkan-like), simulated
  models  : {MODEL} (all three), {SECOND_MODEL} (vllm-0 only)
  API key : {key}   (admin: paste it at {url}/dashboard to sign in)
  kept in : {key_file} (and as a header in {header_file}; both gone when the demo stops)

The commands below read the key from that file or the environment, never from their command line (which ps shows):
  export SHAPEGATE_ADMIN_KEY="$(cat {key_file})" OPENAI_API_KEY="$(cat {key_file})"

curl:
  curl -s {url}/v1/chat/completions -H @{header_file} \\
    -H "Content-Type: application/json" \\
    -d '{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

Python (the key from OPENAI_API_KEY):
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1")
  r = client.chat.completions.create(model="{MODEL}", max_tokens=32,
                                     messages=[{{"role": "user", "content": "Hello!"}}])
  print(r.choices[0].message.content, r.model)

Run-time keys: shapegate keys create --url {url} --id someone   (the admin key from SHAPEGATE_ADMIN_KEY)
{experiment}
Press Ctrl-C to stop.
"""


class CannotListen(Exception):
    """The gateway's address is taken or refused (`error`): nothing of the demo keeps running."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


async def run_demo(host: str, port: int, ready: asyncio.Event | None = None,
                   stop: asyncio.Event | None = None, ab: bool = False) -> None:
    """The portfolio and the gateway until `stop` (or SIGINT/SIGTERM); CannotListen when host:port is unusable."""
    sims = {}
    front = None
    directory = None
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        for bid, engine, profile, native, extra in PORTFOLIO:
            sims[bid] = await start_sim(SimOptions(engine=engine, model=native, profile=profile,
                                                   served_model_names=extra))
        key = new_key()
        cfg = parse_config(demo_config({b: s.url for b, s in sims.items()}, hash_key(key), host, port, ab),
                           build_policy)
        try:
            front = await serve(build_app(cfg), host, port)
        except OSError as e:
            raise CannotListen(e) from None
        directory, key_file, header_file = key_files(key)
        print(banner(f"http://{host}:{front.port}", key, key_file, header_file, ab), flush=True)  # --port 0: its own
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if front is not None:
            await front.close(timeout=5.0)
        for s in sims.values():
            await s.close()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        if front is not None:  # (a demo that never started says only why)
            print("shapegate demo stopped.", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Run the demo until Ctrl-C; CannotListen (the command says why, in one line) if its port is unusable."""
    import uvloop

    uvloop.run(run_demo(args.host, args.port, ab=args.ab))
    return 0

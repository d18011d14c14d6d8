"""`shapegate keys create|list|revoke`: a running gateway's run-time API keys, through its /admin/keys routes."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import urllib.parse
from typing import Any

from gateway.cli.ab import DEFAULT_URL, KEY_ENV, URL_ENV
from gateway.cli.admin_http import AdminError, AdminRefused, admin_call
from gateway.config_queue import PRIORITIES

LIMIT_NAMES = ("rpm", "tpm", "tokens_per_day", "tokens_per_month")
NOT_SHOWN_AGAIN = "Give the key to its client: the gateway keeps only its sha256 and cannot show it again."


class Failed(Exception):
    """Why the command did not do its work, as one line; `status` is the exit status."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    """One request to the gateway's admin routes; Failed with the gateway's own reason when refused."""
    if not args.admin_key:
        raise Failed(f"no admin key: set {KEY_ENV} (or pass --admin-key)", 2)
    try:
        return admin_call(args.url, args.admin_key, args.timeout, method, path, body)
    except AdminError as e:
        raise Failed(str(e), e.status) from None
    except AdminRefused as e:
        raise Failed(str(e)) from None


def config_block(key_id: str, digest: str, admin: bool, limits: dict[str, int] | None = None) -> str:
    """The [[auth.keys]] entry of a key, ready to paste into the configuration: its limits when given, else left
    commented."""
    head = f"[[auth.keys]]\nid = {json.dumps(key_id)}\nsha256 = \"{digest}\"\nadmin = {str(admin).lower()}\n"
    if limits:
        return head + "limits = { " + ", ".join(f"{k} = {v}" for k, v in limits.items()) + " }"
    return head + ("# limits = { rpm = 600, tpm = 200000, tokens_per_day = 5000000 }   # its own limits; unset: "
                   "the [limits] defaults; {} exempts it")


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def _limits(limits: dict | None) -> str:
    if not limits:
        return "defaults"
    parts = [f"{k}={limits[k]}" for k in LIMIT_NAMES if limits.get(k) is not None]
    for model, m in sorted((limits.get("models") or {}).items()):
        parts += [f"{model}:{k}={m[k]}" for k in LIMIT_NAMES if m.get(k) is not None]
    return " ".join(parts) or "none"


def _quotas(quotas: list | None) -> str:
    """What each token quota used this day or month: day 1200/100000, m:month 5/10 (m: a model's own)."""
    parts = [f"{q['model'] + ':' if q.get('model') else ''}{q['period']} {q['used']}/{q['limit']}"
             for q in quotas or [] if isinstance(q, dict)]
    return " ".join(parts) or "-"


def create(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"admin": args.admin}
    if args.id:
        body["id"] = args.id
    limits = dict(args.limits) if args.limits is not None else {}
    for name in LIMIT_NAMES:
        if getattr(args, name) is not None:
            limits[name] = getattr(args, name)
    if limits or args.limits is not None:
        body["limits"] = limits
    if args.priority is not None:
        body["priority"] = args.priority
    if args.priority_header:
        body["priority_header"] = True
    made = call(args, "POST", "/admin/keys", body)
    if args.json:
        print(json.dumps(made, indent=2))
    else:
        print(f"id:      {made['id']}\nkey:     {made['key']}\nadmin:   {str(made['admin']).lower()}\n"
              f"limits:  {_limits(made.get('limits'))}\npriority: {made.get('priority') or 'by class'}"
              f"{' (x-shapegate-priority allowed)' if made.get('priority_header') else ''}")
    print(NOT_SHOWN_AGAIN, file=sys.stderr)
    return 0


def listing(args: argparse.Namespace) -> int:
    got = call(args, "GET", "/admin/keys")
    if args.json:
        print(json.dumps(got, indent=2))
        return 0
    rows = [[k["id"], k["source"], "yes" if k["admin"] else "no", _limits(k.get("limits")), _quotas(k.get("quotas")),
             _when(k.get("created")), _when(k.get("last_used"))] for k in got.get("data", [])]
    header = ["id", "source", "admin", "limits", "quotas used", "created (UTC)", "last used (UTC)"]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"run-time keys kept in: {got.get('store', '?')}", file=sys.stderr)
    return 0


def revoke(args: argparse.Namespace) -> int:
    done = call(args, "DELETE", "/admin/keys/" + urllib.parse.quote(args.id, safe=""))
    print(json.dumps(done, indent=2) if args.json else f"revoked {args.id}")
    return 0


def _seconds(text: str) -> float:
    t = float(text)
    if not (t > 0 and math.isfinite(t)):
        raise argparse.ArgumentTypeError("must be a number of seconds more than 0")
    return t


def _limits_json(text: str) -> dict:
    try:
        v = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"rpm\": 60, \"models\": "
                                         "{\"m\": {\"tpm\": 10000}}}'") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


def add_parsers(actions: Any) -> None:
    """create, list and revoke under `shapegate keys`."""
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", default=os.environ.get(URL_ENV) or DEFAULT_URL,
                       help=f"the gateway's base address (default: the {URL_ENV} environment variable, else "
                            f"{DEFAULT_URL})")
        # A key on a command line is visible to every user of the machine (ps) and stays in shell history.
        p.add_argument("--admin-key", default=os.environ.get(KEY_ENV),
                       help=f"an admin API key (default: the {KEY_ENV} environment variable, which ps does not show)")
        p.add_argument("--timeout", type=_seconds, default=10.0, help="seconds to wait for the gateway (default 10)")
        p.add_argument("--json", action="store_true", help="print the gateway's JSON as it came")

    c = actions.add_parser("create", help="make a key on a running gateway (POST /admin/keys); shown once",
                           description="Make an API key on a running gateway. The key is printed once; the "
                                       "gateway keeps only its digest.")
    common(c)
    c.add_argument("--id", help="the key's id (default: generated); 1-64 characters of A-Z a-z 0-9 _ . : -")
    c.add_argument("--admin", action="store_true", help="an admin key (admin routes, /stats, the dashboard)")
    c.add_argument("--rpm", type=int, help="requests per minute for this key")
    c.add_argument("--tpm", type=int, help="tokens per minute for this key")
    c.add_argument("--tokens-per-day", type=int, help="tokens this key may use per UTC day (a quota)")
    c.add_argument("--tokens-per-month", type=int, help="tokens this key may use per UTC month (a quota)")
    c.add_argument("--limits", type=_limits_json, help="the key's limits as JSON: rpm, tpm, tokens_per_day, "
                   "tokens_per_month, models "
                   "({model: {rpm, tpm}}); --rpm and --tpm override its own")
    c.add_argument("--priority", choices=PRIORITIES, help="where its requests wait in the gateway's queue "
                   "(default: by each request's class)")
    c.add_argument("--priority-header", action="store_true",
                   help="its requests may set their own priority with the x-shapegate-priority header")
    c.set_defaults(keys_run=create)
    ls = actions.add_parser("list", help="list a running gateway's keys (never the keys themselves)")
    common(ls)
    ls.set_defaults(keys_run=listing)
    rv = actions.add_parser("revoke", help="revoke a run-time key on a running gateway")
    common(rv)
    rv.add_argument("id", help="the key's id")
    rv.set_defaults(keys_run=revoke)


def run(args: argparse.Namespace) -> int:
    try:
        return args.keys_run(args)
    except Failed as e:
        print(f"shapegate: {e}", file=sys.stderr)
        return e.status

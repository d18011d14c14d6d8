"""`shapegate usage`: who used what on a running gateway, from its usage ledger (GET /admin/usage)."""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import urllib.parse
from typing import Any

from gateway.cli.ab import DEFAULT_URL, KEY_ENV, URL_ENV
from gateway.cli.keys import Failed, _seconds, call
from gateway.stats.ledger import COUNTS
from gateway.stats.ledger_report import GROUPS, parse_time

# The columns of the table (the CSV has every count): the key's own usage; shadow copies are the operator's.
SHOWN = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "refused")


def _time(text: str) -> str:
    """A --since/--until value, checked here and sent as seconds since the epoch (a span is from now, here)."""
    try:
        return f"{parse_time(text):.0f}"
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _by(text: str) -> str:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or any(p not in GROUPS for p in parts) or len(set(parts)) != len(parts):
        raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(GROUPS)}, each once")
    return ",".join(parts)


def query_of(args: argparse.Namespace) -> str:
    q: dict[str, str] = {"from": args.since, "by": args.by}
    if args.until is not None:
        q["to"] = args.until
    for name in ("key", "model", "api", "backend"):
        if getattr(args, name) is not None:
            q[name] = getattr(args, name)
    return urllib.parse.urlencode(q)


def columns(report: dict) -> list[str]:
    return [*report.get("by", []), *(["cost"] if "cost" in report.get("totals", {}) else [])]


def print_table(report: dict) -> None:
    by = report.get("by", [])
    head = [*by, *SHOWN, *(["cost"] if "cost" in report.get("totals", {}) else [])]
    rows = [[str(r.get(c, "")) if c in by else _cell(r.get(c), c) for c in head] for r in report.get("rows", [])]
    total = ["total", *[""] * (len(by) - 1), *[_cell(report["totals"].get(c), c) for c in head[len(by):]]]
    widths = [max(len(x[i]) for x in (head, *rows, total)) for i in range(len(head))]
    for r in (head, *rows, total):
        print("  ".join(c.rjust(w) if i >= len(by) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
              .rstrip())
    where = "every replica on its Redis store" if report.get("store") == "redis" else "that gateway process only"
    print(f"{_utc(report.get('from'))} to {_utc(report.get('to'))} (UTC), {where}; kept "
          f"{report.get('retention_days')} days" + (f"; {report['truncated']} rows more, summed in the total"
                                                    if report.get("truncated") else ""), file=sys.stderr)


def _cell(v: Any, name: str) -> str:
    if v is None:
        return "-"
    return f"{v:,.4f}" if name == "cost" else f"{v:,}"


def _utc(t: Any) -> str:
    import time
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(t)) if isinstance(t, (int, float)) else "?"


def print_csv(report: dict) -> None:
    head = [*report.get("by", []), *COUNTS, *(["cost"] if "cost" in report.get("totals", {}) else [])]
    w = csv.writer(sys.stdout, lineterminator="\n")
    w.writerow(head)
    for r in report.get("rows", []):
        w.writerow([r.get(c, "") for c in head])


def run(args: argparse.Namespace) -> int:
    try:
        report = call(args, "GET", "/admin/usage?" + query_of(args))
    except Failed as e:
        print(f"shapegate: {e}", file=sys.stderr)
        return e.status
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.csv:
        print_csv(report)
    else:
        print_table(report)
    return 0


def add_parser(sub: Any) -> None:
    u = sub.add_parser("usage", help="who used what: a running gateway's usage ledger by key, model, API, backend "
                                     "or time (GET /admin/usage)",
                       description="Requests, tokens, errors and refusals per key (or model, API, backend, hour, "
                                   "day) over a time range, from a running gateway's usage ledger. Times are "
                                   "UTC: an ISO 8601 date or time, seconds since the epoch, or a span back from "
                                   "now (90m, 24h, 7d).")
    u.add_argument("--url", default=os.environ.get(URL_ENV) or DEFAULT_URL,
                   help=f"the gateway's base address (default: the {URL_ENV} environment variable, else {DEFAULT_URL})")
    u.add_argument("--admin-key", default=os.environ.get(KEY_ENV),
                   help=f"an admin API key (default: the {KEY_ENV} environment variable, which ps does not show)")
    u.add_argument("--timeout", type=_seconds, default=10.0, help="seconds to wait for the gateway (default 10)")
    out = u.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the gateway's JSON as it came: `keys` has each key "
                     "id's totals (requests, prompt_tokens, completion_tokens, ...), `rows` the grouping")
    out.add_argument("--csv", action="store_true", help="print the rows as CSV, every count a column")
    u.add_argument("--since", type=_time, default=_time("7d"), help="start of the range (default: 7d, the last "
                   "7 days)")
    u.add_argument("--until", type=_time, help="end of the range (default: now)")
    u.add_argument("--by", type=_by, default="key", help=f"group by some of {', '.join(GROUPS)}, comma-separated "
                   "(default: key)")
    u.add_argument("--key", help="only this key id")
    u.add_argument("--model", help="only this model")
    u.add_argument("--api", help="only this API (route name: chat, completions, responses, messages, ...)")
    u.add_argument("--backend", help="only this backend id")
    u.set_defaults(func=run)

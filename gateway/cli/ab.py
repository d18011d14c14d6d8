"""`shapegate ab`: a running gateway's A/B experiments, their arms and verdicts, from GET /admin/experiments."""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import sys
import urllib.error
import urllib.request
from typing import Any

KEY_ENV = "SHAPEGATE_ADMIN_KEY"
HELP = "show a running gateway's A/B experiments and their verdicts"
DESCRIPTION = ("Ask a running gateway (GET /admin/experiments, an admin key) for its A/B experiments and print, per "
               "experiment, its arms and every comparison between them with its verdict. Exit 2 when the "
               "gateway cannot be asked or refuses the key.")
FOOTNOTE = ("  ratio: the second arm's mean over the first's, with its 95 % bootstrap CI; "
            "noise: the A/A noise floor a difference must exceed")


class Refused(Exception):
    """Why the report could not be had, as one line for the user."""


def _seconds(text: str) -> float:
    t = float(text)
    if not (t > 0 and math.isfinite(t)):
        raise argparse.ArgumentTypeError("must be a number of seconds more than 0")
    return t


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="the gateway's base address, e.g. http://127.0.0.1:8080")
    # A key on a command line is visible to every user of the machine (ps) and stays in shell history.
    p.add_argument("--key", default=os.environ.get(KEY_ENV),
                   help=f"an admin API key (default: the {KEY_ENV} environment variable, which ps does not show)")
    p.add_argument("--experiment", metavar="NAME", help="only this experiment")
    p.add_argument("--json", action="store_true", help="print the gateway's JSON as it came")
    p.add_argument("--timeout", type=_seconds, default=10.0, help="seconds to wait for the gateway (default 10)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The `ab` command on the `shapegate` parser's subcommands."""
    p = subparsers.add_parser("ab", help=HELP, description=DESCRIPTION)
    _arguments(p)
    p.set_defaults(func=run)
    return p


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # urllib would send the Authorization header on to wherever a redirect points, another host included.
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def _error_message(body: bytes) -> str:
    """The gateway's own reason from an OpenAI-shaped error body, on one line; "" if there is none."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ""
    return " ".join(str(message).split())[:200]


def fetch(url: str, key: str, timeout: float) -> dict:
    """The experiments report of the gateway at `url`; Refused with the reason when there is none."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise Refused(f"--url must start with http:// or https:// (got {url!r})")
    endpoint = base + "/admin/experiments"
    request = urllib.request.Request(endpoint, headers={"Authorization": f"Bearer {key}",
                                                        "Accept": "application/json"})
    try:
        with _OPENER.open(request, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        with e:
            status, reason = e.code, _error_message(e.read())
        if status in (401, 403):
            raise Refused(f"{base} refused the key (HTTP {status}){': ' + reason if reason else ''}") from None
        if 300 <= status < 400:
            where = e.headers.get("Location", "?")
            raise Refused(f"{endpoint} redirects to {where}: give that address as --url (the key was not sent on)") \
                from None
        if status == 404:
            raise Refused(f"{endpoint} not found (HTTP 404): is {base} a shapegate gateway?") from None
        raise Refused(f"{endpoint} answered HTTP {status}{': ' + reason if reason else ''}") from None
    except TimeoutError:
        raise Refused(f"no answer from {base} within {timeout:g} s") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise Refused(f"no answer from {base} within {timeout:g} s") from None
        why = e.reason.strerror if isinstance(e.reason, OSError) and e.reason.strerror else e.reason
        raise Refused(f"cannot connect to {base}: {why}") from None
    except (OSError, http.client.HTTPException) as e:  # e.g. the connection closed before an answer
        raise Refused(f"{base} did not answer: {type(e).__name__}: {e}") from None
    try:
        report = json.loads(body)
    except ValueError:
        raise Refused(f"{endpoint} did not answer JSON") from None
    if not isinstance(report, dict) or not isinstance(report.get("data"), list):
        raise Refused(f"{endpoint} did not answer a list of experiments")
    return report


def _fig(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.3g}%"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """Aligned columns, indented by two spaces; numbers (the `right` columns) to the right."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    return [("  " + "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
            .rstrip() for r in (header, *rows)]


def _verdict(c: dict) -> str:
    a, b = c["arms"]
    return {"a_better": f"{a} better", "b_better": f"{b} better", "no_difference": "no difference",
            "insufficient_data": "more data needed"}.get(c["verdict"], str(c["verdict"]))


def format_experiment(x: dict) -> list[str]:
    # Here, not at the top: gateway.experiments.verdict loads numpy, which `shapegate` should not load for every command.
    from gateway.experiments.verdict import NAMES

    copies = f" (copies of {_pct(x['fraction'])} of requests)" if x["mode"] == "shadow" else ""
    state = "running" if x["enabled"] else "stopped"
    lines = [(f"experiment {x['name']}: model {x['model']}, {x['mode']}{copies}, subject {x['subject']}, "
              f"{state} (version {x['version']})")]
    rows = []
    for a in x["arms"]:
        every = a["classes"].get("all", {})  # absent until the arm's first request
        share = "serves" if a["share"] is None else _pct(a["share"])  # a shadow's primary: the usual serving
        rows.append([a["name"], share, str(every.get("requests", 0)), str(every.get("errors", 0)),
                     ", ".join(a["backends"] or ["(the model's usual backends)"])])
    lines += _table(["arm", "share", "requests", "errors", "backends"], rows, {1, 2, 3})
    shadows = [a for a in x["arms"] if a.get("shadow")]
    if shadows:
        rows = []
        for a in shadows:
            s, ag = a["shadow"], a["shadow"]["agreement"]
            tokens = ag["common_prefix_tokens"]["p50"]
            rows.append([a["name"], *(str(s.get(k, 0)) for k in (  # a count is absent while it is 0
                "sent", "ok", "engine_error", "skipped_busy", "skipped_unhealthy", "in_flight")),
                f"{ag['exact']}/{ag['compared']} ({_pct(ag['exact_rate'])})",
                _pct(ag["common_prefix_share"]["p50"]) + (f" ({tokens:g} tokens)" if tokens is not None else "")])
        lines.append("")
        lines += _table(["shadow copies", "sent", "ok", "engine errors", "skipped busy", "skipped unhealthy",
                         "in flight", "identical output", "common prefix p50"], rows, {1, 2, 3, 4, 5, 6})
    lines.append("")
    if not x["comparisons"]:
        lines.append("  no requests yet: nothing to compare")
        return lines
    rows = []
    for c in x["comparisons"]:
        ci = f" [{_fig(c['ci_low'])}, {_fig(c['ci_high'])}]" if c["ci_low"] is not None else ""
        n = " ".join(f"{arm}={c['n'][arm]}" for arm in c["arms"])
        rows.append([c["class"], NAMES.get(c["metric"], c["metric"]), n, _fig(c["ratio"]) + ci,
                     _pct(c["noise_floor"]), _verdict(c), c["summary"]])
    lines += _table(["class", "metric", "n", "ratio [95% CI]", "noise", "verdict", "summary"], rows, {4})
    lines.append(FOOTNOTE)
    return lines


def format_report(report: dict, url: str) -> str:
    if not report["data"]:
        return f"no experiments on {url.rstrip('/')}"
    return "\n\n".join("\n".join(format_experiment(x)) for x in report["data"])


def run(args: argparse.Namespace) -> int:
    key = args.key or ""
    try:
        if not key:
            raise Refused(f"an admin key is needed: --key KEY or the {KEY_ENV} environment variable")
        report = fetch(args.url, key, args.timeout)
        if args.experiment is not None:
            chosen = [x for x in report["data"] if x["name"] == args.experiment]
            if not chosen:
                names = ", ".join(x["name"] for x in report["data"]) or "none"
                raise Refused(f"no experiment named {args.experiment!r} on {args.url.rstrip('/')} "
                              f"(experiments: {names})")
            report = {**report, "data": chosen}
    except Refused as e:
        # Whatever a server or a typo echoes back, the key itself is never printed.
        print(f"shapegate: {str(e).replace(key, '***') if key else e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2, ensure_ascii=False) if args.json else format_report(report, args.url))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`shapegate ab` on its own: python -c 'import sys; from gateway.cli.ab import main; sys.exit(main())'."""
    p = argparse.ArgumentParser(prog="shapegate ab", description=DESCRIPTION)
    _arguments(p)
    return run(p.parse_args(argv))

"""`shapegate ab`: a running gateway's A/B experiments and verdicts (GET), and set / stop / start one (PUT)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import urllib.parse
from typing import Any

from gateway.cli.admin_http import AdminError, AdminRefused, admin_call

KEY_ENV = "SHAPEGATE_ADMIN_KEY"
URL_ENV = "SHAPEGATE_URL"  # the gateway every admin command (ab, keys) asks unless --url says otherwise
DEFAULT_URL = "http://127.0.0.1:8080"
HELP = "show a running gateway's A/B experiments and their verdicts; set, stop or start one"
DESCRIPTION = ("Ask a running gateway (GET /admin/experiments, an admin key) for its A/B experiments and print, per "
               "experiment, its arms and every comparison between them with its verdicts (mean, p50, p99). "
               "`set NAME --weights a=1,b=3` changes an experiment's weights (a ramp), `stop NAME` stops it (its "
               "model routed as if there were none), `start NAME` starts it again and lifts the error guard's "
               "stops; all three through PUT /admin/experiments/NAME, adopted by every worker and replica within "
               "a second. Exit 2 when the gateway cannot be asked or refuses the key, 1 when it refuses the change.")
FOOTNOTE = ("  ratio: the second arm's mean over the first's (p50, p99: its quantiles'), with its 95 % bootstrap CI; "
            "noise: the A/A noise floor a difference must exceed")
MARGIN_NOTE = "; a difference under the {margin} margin is none"


class Refused(Exception):
    """Why the gateway could not be asked or did not do it, as one line for the user; `status`: the exit status."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def _seconds(text: str) -> float:
    t = float(text)
    if not (t > 0 and math.isfinite(t)):
        raise argparse.ArgumentTypeError("must be a number of seconds more than 0")
    return t


def _weights(text: str) -> dict[str, float]:
    """`a=1,b=3` as {"a": 1.0, "b": 3.0}; the gateway checks the arms and the values."""
    weights: dict[str, float] = {}
    for part in text.split(","):
        name, eq, value = part.partition("=")
        try:
            w = float(value)
        except ValueError:
            w = math.nan
        if not eq or not name.strip() or not math.isfinite(w) or name.strip() in weights:
            raise argparse.ArgumentTypeError(f"expected ARM=WEIGHT pairs separated by commas, e.g. a=1,b=3 "
                                             f"(got {text!r})")
        weights[name.strip()] = w
    return weights


def _connection(p: argparse.ArgumentParser, after: bool) -> None:
    """--url, --admin-key, --json and --timeout. An action's parser (`after`) takes them too, so that they may follow
    its name; unset there they keep what came before it (SUPPRESS: no default to overwrite that with)."""
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if after else value

    p.add_argument("--url", default=default(os.environ.get(URL_ENV) or DEFAULT_URL),
                   help=f"the gateway's base address (default: the {URL_ENV} environment variable, else {DEFAULT_URL})")
    # A key on a command line is visible to every user of the machine (ps) and stays in shell history.
    p.add_argument("--admin-key", dest="key", default=default(os.environ.get(KEY_ENV)),
                   help=f"an admin API key (default: the {KEY_ENV} environment variable, which ps does not show)")
    # --key: this command's former spelling, still taken (hidden); --admin-key is every admin command's.
    p.add_argument("--key", dest="key", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", default=default(False), help="print the gateway's JSON as it came")
    p.add_argument("--timeout", type=_seconds, default=default(10.0),
                   help="seconds to wait for the gateway (default 10)")


def _arguments(p: argparse.ArgumentParser) -> None:
    _connection(p, after=False)
    p.add_argument("--experiment", metavar="NAME", help="only this experiment")
    actions = p.add_subparsers(dest="action", metavar="ACTION", help="change an experiment (omit to show them all)")
    s = actions.add_parser("set", help="set an experiment's arm weights (a ramp), or a shadow's fraction",
                           description="Set the weights of some or all of an experiment's arms (each arm's share "
                                       "is its weight over the total), or a shadow experiment's fraction. Any "
                                       "change lifts the error guard's stops.")
    s.add_argument("name", help="the experiment")
    s.add_argument("--weights", type=_weights, metavar="ARM=W,...", help="e.g. a=1,b=3 (a 25 %% / 75 %% split)")
    s.add_argument("--fraction", type=float, help="a shadow experiment's share of requests copied, (0, 1]")
    for name, what in (("stop", "stop an experiment: its model is routed as if there were none"),
                       ("start", "start an experiment again (and lift the error guard's stops)")):
        a = actions.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".")
        a.add_argument("name", help="the experiment")
        _connection(a, after=True)
    _connection(s, after=True)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The `ab` command on the `shapegate` parser's subcommands."""
    p = subparsers.add_parser("ab", help=HELP, description=DESCRIPTION)
    _arguments(p)
    p.set_defaults(func=run)
    return p


def _call(url: str, key: str, timeout: float, path: str, change: dict | None = None) -> Any:
    """GET `path` of the gateway at `url` (PUT `change` there, if given): its JSON answer, or Refused with the
    reason (status 1 when the gateway refused the change itself, 2 when it could not be asked)."""
    try:
        return admin_call(url, key, timeout, "GET" if change is None else "PUT", path, change)
    except AdminError as e:
        raise Refused(str(e), e.status) from None
    except AdminRefused as e:
        if change is not None and e.status in (400, 404) and e.reason:
            raise Refused(f"{e.base} made no change (HTTP {e.status}): {e.reason}", status=1) from None
        if e.status == 404:
            raise Refused(f"{e.endpoint} not found (HTTP 404): is {e.base} a shapegate gateway?") from None
        raise Refused(f"{e.endpoint} answered {e}") from None


def fetch(url: str, key: str, timeout: float) -> dict:
    """The experiments report of the gateway at `url`; Refused with the reason when there is none."""
    report = _call(url, key, timeout, "/admin/experiments")
    if not isinstance(report, dict) or not isinstance(report.get("data"), list):
        raise Refused(f"{url.rstrip('/')}/admin/experiments did not answer a list of experiments")
    return report


def change(url: str, key: str, timeout: float, name: str, what: dict) -> dict:
    """PUT `what` to experiment `name` of the gateway at `url`: the experiment's state after it."""
    done = _call(url, key, timeout, "/admin/experiments/" + urllib.parse.quote(name, safe=""), what)
    if not isinstance(done, dict) or not isinstance(done.get("weights"), dict):
        raise Refused(f"{url.rstrip('/')} did not answer with the experiment's state")
    return done


def format_change(done: dict) -> str:
    """One line: the experiment's state after a change."""
    weights = done["weights"]
    total = sum(weights.values()) or 1.0
    arms = ", ".join(f"{arm} {w:g} ({_pct(w / total)})" for arm, w in weights.items())
    fraction = f", copies of {_pct(done['fraction'])} of requests" if done.get("fraction") is not None else ""
    state = "running" if done["enabled"] else "stopped (its model routed as if there were no experiment)"
    return f"experiment {done['name']}: {state}; weights {arms}{fraction} (version {done['version']})"


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
    lines += _guarded(x)
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
        n = " ".join(f"{arm}={c['n'][arm]}" for arm in c["arms"])
        rows.append([c["class"], NAMES.get(c["metric"], c["metric"]), n, *_figures(c)])
        # The quantiles' verdicts under the mean's, on the same samples: no class and no n of their own.
        rows += [["", f"  {q['stat']}", "", *_figures(q)] for q in (c.get("quantiles") or {}).values()]
    lines += _table(["class", "metric", "n", "ratio [95% CI]", "noise", "verdict", "summary"], rows, {4})
    margin = x.get("practical_margin")  # absent from a gateway older than the margin
    lines.append(FOOTNOTE + (MARGIN_NOTE.format(margin=_pct(margin)) if margin is not None else ""))
    return lines


def _figures(c: dict) -> list[str]:
    ci = f" [{_fig(c['ci_low'])}, {_fig(c['ci_high'])}]" if c["ci_low"] is not None else ""
    return [_fig(c["ratio"]) + ci, _pct(c["noise_floor"]), _verdict(c), c["summary"]]


def _guarded(x: dict) -> list[str]:
    """A line for each arm the error guard stopped: why, since when, and how to resume it."""
    lines = []
    for a in x["arms"]:
        g = a.get("guard")
        if g:
            where = f" (on {g['processes']} of {x['processes']} processes)" if x.get("processes", 1) > 1 else ""
            since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(g["at"]))
            lines.append(f"  arm {a['name']} stopped by the error guard{where} since {since}: {g['reason']}; "
                         f"`shapegate ab start {x['name']}` resumes it")
    return lines


def format_report(report: dict, url: str) -> str:
    if not report["data"]:
        return f"no experiments on {url.rstrip('/')}"
    return "\n\n".join("\n".join(format_experiment(x)) for x in report["data"])


def run(args: argparse.Namespace) -> int:
    key = args.key or ""
    try:
        if not args.url:
            raise Refused("the gateway's address is needed: --url URL, e.g. --url http://127.0.0.1:8080")
        if not key:
            raise Refused(f"an admin key is needed: --admin-key KEY or the {KEY_ENV} environment variable")
        out = _changed(args, key) if getattr(args, "action", None) else _shown(args, key)
    except Refused as e:
        # Whatever a server or a typo echoes back, the key itself is never printed.
        print(f"shapegate: {str(e).replace(key, '***') if key else e}", file=sys.stderr)
        return e.status
    print(out)
    return 0


def _shown(args: argparse.Namespace, key: str) -> str:
    report = fetch(args.url, key, args.timeout)
    if args.experiment is not None:
        chosen = [x for x in report["data"] if x["name"] == args.experiment]
        if not chosen:
            names = ", ".join(x["name"] for x in report["data"]) or "none"
            raise Refused(f"no experiment named {args.experiment!r} on {args.url.rstrip('/')} "
                          f"(experiments: {names})")
        report = {**report, "data": chosen}
    return json.dumps(report, indent=2, ensure_ascii=False) if args.json else format_report(report, args.url)


def _changed(args: argparse.Namespace, key: str) -> str:
    """set, stop or start: the PUT, then the experiment's state after it."""
    if args.action == "set":
        what: dict[str, Any] = {k: v for k, v in (("weights", args.weights), ("fraction", args.fraction))
                                if v is not None}
        if not what:
            raise Refused("nothing to set: give --weights ARM=W,... (or a shadow's --fraction)")
    else:
        what = {"enabled": args.action == "start"}
    done = change(args.url, key, args.timeout, args.name, what)
    replicas = done.get("replicas") if isinstance(done.get("replicas"), dict) else {}
    if done.get("shared") is False and (replicas.get("refused") or replicas.get("pending")):
        for proc, why in sorted((replicas.get("refused") or {}).items()):
            print(f"shapegate: replica {proc} refused the change: {why}", file=sys.stderr)
        for proc in replicas.get("pending") or []:
            print(f"shapegate: replica {proc} has not said it applied the change", file=sys.stderr)
    elif done.get("shared") is False:  # None: a single process, nobody to tell
        print("shapegate: the change applies on the process that answered, but Redis did not take it: other "
              "replicas keep the old state until a change reaches it", file=sys.stderr)
    return json.dumps(done, indent=2, ensure_ascii=False) if args.json else format_change(done)


def main(argv: list[str] | None = None) -> int:
    """`shapegate ab` on its own: python -c 'import sys; from gateway.cli.ab import main; sys.exit(main())'."""
    p = argparse.ArgumentParser(prog="shapegate ab", description=DESCRIPTION)
    _arguments(p)
    return run(p.parse_args(argv))

"""The trace report: one self-contained HTML file (inline CSS and SVG, no script, no network)
from `sessions.analyse`'s answer, so it opens from disk, mails as one attachment, and shows
the same numbers as the terminal summary and `--json`."""

from __future__ import annotations

import datetime as _dt
from html import escape
from typing import Any

from mtplxd import POWERED_BY, __version__
from mtplxctl.trace import charts

CSS = """
body{font:14px/1.45 -apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,sans-serif;margin:0;
 color:#1d232a;background:#f6f7f9}
main{max-width:920px;margin:0 auto;padding:24px 16px 48px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px}
.sub{color:#5b6570;margin-bottom:16px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:10px}
.card{background:#fff;border:1px solid #e2e5e9;border-radius:8px;padding:10px 12px}
.card b{display:block;font-size:20px}.card span{color:#5b6570;font-size:12px}
.chart{width:100%;height:auto;background:#fff;border:1px solid #e2e5e9;border-radius:8px}
.chart text{font-size:11px;fill:#5b6570}.chart .label{font-size:12px;fill:#1d232a}
.chart .grid{stroke:#eceef1}
.legend span{display:inline-block;margin-right:14px;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px}
table{border-collapse:collapse;width:100%;background:#fff;font-size:12px}
th,td{border-bottom:1px solid #eceef1;padding:4px 6px;text-align:right;vertical-align:top}
th{background:#fafbfc;position:sticky;top:0}td.l,th.l{text-align:left}
.flag{display:inline-block;background:#fdecea;color:#a12b2b;border-radius:4px;padding:0 5px;
 margin:1px 2px 1px 0;font-size:11px}
ul.flags li{margin:4px 0}.ok{color:#2d7a4f}footer{color:#8a939c;font-size:12px;margin-top:32px}
"""


def render_html(analysis: dict[str, Any]) -> str:
    """The whole report page."""
    session, totals, turns = analysis["session"], analysis["totals"], analysis["turns"]
    started = _when(session["started"])
    parts = [
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>mtplx trace {escape(session['id'])}</title>",
        "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">",
        f"<style>{CSS}</style></head><body><main>",
        f"<h1>Session {escape(session['id'])}</h1>",
        f"<div class=\"sub\">{escape(session['agent'] or 'unknown client')} · model "
        f"{escape(session['model'] or '?')} · {started} · {session['turns']} requests"
        + (f" · session id {escape(session['session_id'])}" if session["session_id"] else "")
        + "</div>",
        _cards(totals, turns),
        "<h2>Where the time went</h2>",
        _legend(("queue", "prefill", "decode", "refused")),
        charts.timeline(turns),
        "<h2>Cache reuse per turn</h2>",
        _legend(("reused", "prefill")),
        charts.stacked_bars([str(t["turn"]) for t in turns], [
            ("reused from cache", charts.COLORS["reused"], [t["reused_tokens"] for t in turns]),
            ("prefilled", charts.COLORS["prefill"], [t["prefill_tokens"] or 0 for t in turns]),
        ], "prompt tokens", "cache reuse per turn"),
        "<h2>Decode speed over time</h2>",
        charts.line_chart(_segments(analysis, "tok_s"), "seconds since the session began",
                          "tokens/s", "decode tokens per second"),
        "<h2>Accepted length over time</h2>",
        charts.line_chart(_segments(analysis, "accepted_length"), "seconds since the session began",
                          "tokens per cycle", "accepted length", colour=charts.COLORS["line2"]),
        "<h2>Draft and verify time per cycle</h2>",
        _split_chart(turns),
        f"<h2>Flags ({len(analysis['flags'])})</h2>",
        _flags(analysis),
        "<h2>Turns</h2>",
        _turn_table(turns),
        f"<footer>mtplxctl trace {__version__} · stall threshold {analysis['stall_seconds']:g}s · "
        f"{escape(POWERED_BY)}</footer>",
        "</main></body></html>",
    ]
    return "\n".join(parts)


def _when(epoch: float | None) -> str:
    if not epoch:
        return "?"
    return _dt.datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")


def _segments(analysis: dict[str, Any], key: str) -> list[list[tuple[float, float]]]:
    by_turn: dict[int, list[tuple[float, float]]] = {}
    for sample in analysis["samples"]:
        if sample.get(key) is not None:
            by_turn.setdefault(sample["turn"], []).append((sample["t"], sample[key]))
    return list(by_turn.values())


def _split_chart(turns: list[dict[str, Any]]) -> str:
    """Draft ms over verify ms per cycle, a bar per turn (AR turns have no draft: no bar)."""
    if all(t["draft_ms"] is None for t in turns):
        return ("<p class=\"sub\">No turn of this session drafted (AR decoding, or no decode "
                "sample), so there is no draft/verify split to show.</p>")
    legend = _legend(("draft", "verify"))
    note = ("<div class=\"sub\">From a few timed cycles (a sync after the drafts and after "
            "the verify): each turn's first, then about one a second; a sample, not every "
            "cycle.</div>")
    return legend + note + charts.stacked_bars([str(t["turn"]) for t in turns], [
        ("draft ms", charts.COLORS["draft"], [t["draft_ms"] or 0 for t in turns]),
        ("verify ms", charts.COLORS["verify"], [t["verify_ms"] or 0 for t in turns]),
    ], "ms per cycle", "draft and verify time per cycle")


def _cards(totals: dict[str, Any], turns: list[dict[str, Any]]) -> str:
    reuse = totals["cache_reuse"]
    cards = [
        (f"{reuse * 100:.0f}%" if reuse is not None else "–", "prompt tokens from the cache"),
        (f"{totals['prefill_tokens']:,}", "prompt tokens prefilled"),
        (f"{totals['prefill_s']:.1f}s", "in prefill"),
        (f"{totals['decode_s']:.1f}s", "in decode"),
        (f"{totals['queue_s']:.1f}s", "waiting in the queue"),
        (f"{totals['decode_tok_s'] or 0:.1f}", "decode tokens/s"),
        (f"{totals['completion_tokens']:,}", "tokens generated"),
        (str(sum(1 for t in turns if t["flags"])), "turns flagged"),
    ]
    return "<div class=\"cards\">" + "".join(
        f"<div class=\"card\"><b>{escape(v)}</b><span>{escape(k)}</span></div>" for v, k in cards) + "</div>"


def _legend(names: tuple[str, ...]) -> str:
    return "<div class=\"legend\">" + "".join(
        f"<span><i style=\"background:{charts.COLORS[n]}\"></i>{n}</span>" for n in names) + "</div>"


def _flags(analysis: dict[str, Any]) -> str:
    if not analysis["flags"]:
        return "<p class=\"ok\">Nothing flagged: no cold re-prefill of a long prompt, no stall, " \
               "no context near the limit, no refusal for memory (507) or a full queue (429), " \
               "no loop stopped, no client that left early.</p>"
    return "<ul class=\"flags\">" + "".join(
        f"<li>turn {f['turn']}: <span class=\"flag\">{escape(f['kind'])}</span> {escape(f['text'])}</li>"
        for f in analysis["flags"]) + "</ul>"


def _turn_table(turns: list[dict[str, Any]]) -> str:
    head = ("<table><tr><th>#</th><th>at s</th><th class=l>status</th><th>prompt</th><th>reused</th>"
            "<th>from</th><th>queue s</th><th>prefill s</th><th>TTFT s</th><th>out</th><th>tok/s</th>"
            "<th>acc</th><th>draft ms</th><th>verify ms</th><th class=l>cache</th></tr>")
    rows = []
    for t in turns:
        flags = "".join(f"<span class=\"flag\">{escape(f['kind'])}</span>" for f in t["flags"])
        rows.append(
            f"<tr><td>{t['turn']}</td><td>{t['at']:.1f}</td>"
            f"<td class=l>{t['status']} {escape(t['outcome'] or '')}</td>"
            f"<td>{t['prompt_tokens']:,}</td><td>{t['reused_tokens']:,}</td>"
            f"<td>{escape(t['restored_from'] or '')}</td><td>{t['queue_s']:.2f}</td>"
            f"<td>{t['prefill_s']:.2f}</td><td>{_num(t['ttft_s'], 2)}</td>"
            f"<td>{t['completion_tokens'] if t['completion_tokens'] is not None else ''}</td>"
            f"<td>{_num(t['tok_s'], 1)}</td><td>{_num(t['accepted_length'], 2)}</td>"
            f"<td>{_num(t['draft_ms'], 2)}</td><td>{_num(t['verify_ms'], 2)}</td>"
            f"<td class=l>{escape(t['cache'])} {flags}</td></tr>")
    return head + "".join(rows) + "</table>"


def _num(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"

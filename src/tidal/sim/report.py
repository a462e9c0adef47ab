"""One self-contained HTML page per simulation run (``tidal simulate --report``).

The page holds the summary table, the plots as inline PNG images (GPUs
allocated over time, the JCT CDF, the deadline ratio per policy and a Gantt
chart of the first jobs' GPU allocations) and the exact command, so it can be
mailed or archived without its directory.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any, Callable

from tidal.sim.engine import SimResult
from tidal.sim.metrics import _matplotlib, plot_jct_cdf, plot_utilization

GANTT_JOBS = 40

_STYLE = """body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#1b2430}
h1{font-size:1.5em} h2{font-size:1.15em;margin-top:1.6em} code,pre{background:#f2f4f7;padding:.2em .4em}
table{border-collapse:collapse} th,td{padding:.3em .7em;border-bottom:1px solid #dde2e8;text-align:right}
th:first-child,td:first-child{text-align:left} img{max-width:100%;display:block;margin:.5em 0}"""

_COLUMNS = [("policy", "policy", None), ("finished", "done", None), ("dropped", "dropped", None),
            ("avg_jct", "avg JCT h", 3600), ("p95_jct", "p95 JCT h", 3600), ("avg_pending", "avg wait h", 3600),
            ("makespan", "makespan h", 3600), ("utilization", "util %", 0.01),
            ("deadline_ratio", "deadline %", 0.01), ("rescales", "rescales", None)]


def _png(draw: Callable[[Path], None], tmp: Path) -> str | None:
    """Run a plotting function that writes a file; its bytes as base64 (None: nothing drawn)."""
    draw(tmp)
    if not tmp.exists():
        return None
    data = base64.b64encode(tmp.read_bytes()).decode()
    tmp.unlink()
    return data


def _fig_png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    _matplotlib().close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def plot_deadline_ratio(results: list[SimResult], summaries: list[dict[str, Any]]) -> str | None:
    """Bars: the share of deadline jobs each policy finished in time."""
    vals = [(s["policy"], s.get("deadline_ratio")) for s in summaries]
    vals = [(p, v) for p, v in vals if v is not None]
    if not vals:
        return None
    plt = _matplotlib()
    fig, ax = plt.subplots(figsize=(max(4.0, 0.8 * len(vals) + 2), 3.2))
    ax.bar([p for p, _ in vals], [100 * v for _, v in vals], color="#3b7dd8")
    for i, (_, v) in enumerate(vals):
        ax.text(i, 100 * v + 1, f"{100 * v:.1f}", ha="center", fontsize="small")
    ax.set_ylim(0, 110)
    ax.set_ylabel("deadlines met (%)")
    ax.set_title("Deadline ratio per policy")
    ax.tick_params(axis="x", labelrotation=30)
    return _fig_png(fig)


def plot_gantt(result: SimResult, first: int = GANTT_JOBS) -> str | None:
    """The first jobs by submission: grey while waiting, then one bar piece
    per GPU allocation, its shade and label the GPU count."""
    jobs = sorted(result.jobs, key=lambda j: (j.spec.submit_time, j.spec.job_id))[:first]
    if not any(j.alloc for j in jobs):
        return None  # an executor that records no allocations (the artifact's Gandiva)
    plt = _matplotlib()
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.22 * len(jobs)))
    t0, most = result.start, max([n for j in jobs for _, n in j.alloc] + [1])
    cmap = plt.get_cmap("viridis")
    for y, j in enumerate(jobs):
        end = j.end_time if j.end_time is not None else result.end
        first_run = j.alloc[0][0] if j.alloc else end
        ax.barh(y, (first_run - j.spec.submit_time) / 3600, left=(j.spec.submit_time - t0) / 3600,
                color="#d5d9df", height=0.7)
        for (t, n), (t_next, _) in zip(j.alloc, [*j.alloc[1:], (end, 0)]):
            if n and t_next > t:
                ax.barh(y, (t_next - t) / 3600, left=(t - t0) / 3600, height=0.7, color=cmap(0.15 + 0.8 * n / most))
    ax.set_yticks(range(len(jobs)), [j.spec.job_id[:14] for j in jobs], fontsize="x-small")
    ax.invert_yaxis()
    ax.set_xlabel("hours since first submission")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, most))
    fig.colorbar(sm, ax=ax, label="GPUs", fraction=0.03)
    ax.set_title(f"GPU allocation of the first {len(jobs)} jobs — {result.policy} (grey: waiting)")
    return _fig_png(fig)


def _table(summaries: list[dict[str, Any]]) -> str:
    head = "".join(f"<th>{html.escape(t)}</th>" for _, t, _ in _COLUMNS)
    rows = []
    for s in summaries:
        cells = []
        for key, _, scale in _COLUMNS:
            v = s.get(key)
            text = "–" if v is None else (f"{v / scale:.2f}" if scale else str(v))
            cells.append(f"<td>{html.escape(text)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def write_report(results: list[SimResult], summaries: list[dict[str, Any]], path: Path, *,
                 title: str, command: str) -> Path:
    """Write the run's page to ``path`` (a new file, written whole)."""
    imgs: list[tuple[str, str | None]] = [
        ("GPUs allocated over time", _png(lambda p: plot_utilization(results, p), path.with_suffix(".util.png"))),
        ("Job completion time CDF", _png(lambda p: plot_jct_cdf(results, p), path.with_suffix(".jct.png"))),
        ("Deadline ratio per policy", plot_deadline_ratio(results, summaries)),
    ]
    imgs += [(f"GPU allocation, {r.policy}", plot_gantt(r)) for r in results]
    figures = "".join(f"<h2>{html.escape(cap)}</h2><img alt=\"{html.escape(cap)}\" "
                      f"src=\"data:image/png;base64,{data}\">" for cap, data in imgs if data)
    page = (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>Command: <code id=\"command\">{html.escape(command)}</code></p>"
            f"<h2>Summary</h2>{_table(summaries)}{figures}"
            "<p>Definitions of every column: docs/simulator.md.</p></body></html>")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path

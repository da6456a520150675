"""``kvlab report``'s page: ``write_report`` renders ``build_report``'s data as ``index.html`` (images embedded as
data: URIs), ``report.md`` and the PNG plots beside them; ``summary_lines`` is what the command prints."""

from __future__ import annotations

import base64
import html
import json
import re
from itertools import groupby
from pathlib import Path

from kvlab.report.build import LESSONS
from kvlab.roofline import gb_text

PLOTS = {
    "tpot": "tpot_vs_context.png",
    "mitigations": "mitigations.png",
    "memory": "memory.png",
    "measure": "measured.png",
}


def _ms(x: float) -> str:
    return f"{x:,.2f} ms"


def summary_lines(report: dict) -> list[str]:
    """The report's findings as sentences: the command prints them, and report.md and index.html start with them."""
    i, p = report["inputs"], report["prediction"]
    lo, hi = p["tpot_ms_range"]
    where = f"{i['gpu']} ({i['bandwidth_gbps']:,.0f} GB/s)" if i["gpu"] else f"{i['bandwidth_gbps']:,.0f} GB/s"
    lines = [
        f"{i['model']} on {where}, context {i['context']:,} x batch {i['batch']}: TPOT {_ms(p['tpot_ms'])} at full "
        f"bandwidth, {lo:,.2f}-{hi:,.2f} ms as published systems reach "
        f"(weights alone {_ms(p['tpot_ms_weights_only'])})",
        f"a step reads {gb_text(p['weight_bytes_read'])} of weights and {gb_text(p['kv_bytes'])} of KV "
        f"({p['kv_bytes_per_token']:,} B per token in {p['kv_dtype']})",
    ]
    m = report["memory"]
    if m is not None and m["free_for_kv_bytes"] <= 0:
        lines.append(
            f"memory ({m['memory_bytes'] / 1e9:g} GB, {m['memory_source']}): the weights alone need "
            f"{gb_text(m['weight_bytes'])}, so no KV fits; {m['devices_needed']} such devices hold weights + KV pooled "
            "(pass --memory-gb with their total)"
        )
    elif m is not None:
        fits = "fits" if m["fits"] else "does NOT fit"
        lines.append(
            f"memory ({m['memory_bytes'] / 1e9:g} GB, {m['memory_source']}): weights {gb_text(m['weight_bytes'])} + KV "
            f"{gb_text(p['kv_bytes'])} {fits}; at most batch {m['max_batch_at_context']:,} at {i['context']:,} tokens, "
            f"or {m['max_context_at_batch']:,} tokens at batch {i['batch']}"
            + (
                ""
                if m["fits"]
                else f"; {m['devices_needed']} such devices hold it pooled (pass --memory-gb with their total)"
            )
        )
    for c in report["crossover"]:
        where = f"{c['context']:,.0f} tokens" if c["within_max"] else "beyond the model's max context"
        lines.append(f"KV equals weights at batch {c['batch']}: {where}")
    for r in report["mitigations"]:
        lines.append(f"{r['name']} (lesson {r['lesson']}): {_ms(r['tpot_ms'])}, {r['speedup']:.2f}x")
    s = report["measured"]
    if s is not None:
        f = s["fit"]
        lines.append(
            f"this machine ({s['model']} on {s['device']}): the KV term reached {f['kv_bandwidth_fraction']:.0%} of "
            f"the read bandwidth measured, the weight term {f['weight_bandwidth_fraction']:.0%} (R^2 {f['r2']:.3f})"
        )
    return lines


def _plot_tpot(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    i, m = report["inputs"], report["memory"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for curve in report["curves"]:
        ctx, tpot = curve["context"], curve["tpot_ms"]
        fits = [m is None or need <= m["memory_bytes"] for need in curve["memory_needed_bytes"]]
        line = ax.plot(ctx, [t if ok else None for t, ok in zip(tpot, fits, strict=True)], lw=2)[0]
        line.set_label(f"batch {curve['batch']}")
        # what does not fit in memory stays on the plot, dotted, so the trend reads through
        ax.plot(ctx, [None if ok else t for t, ok in zip(tpot, fits, strict=True)], ":", color=line.get_color())
        if curve["batch"] == i["batch"]:
            lo, hi = zip(*curve["tpot_ms_range"], strict=True)
            ax.fill_between(ctx, lo, hi, color=line.get_color(), alpha=0.15, label="what published systems reach")
    p = report["prediction"]
    ax.plot([i["context"]], [p["tpot_ms"]], "ko", label=f"yours: {i['context']:,} x {i['batch']}")
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("TPOT (ms)")
    note = "; dotted: over memory" if m is not None else ""
    ax.set_title(f"{i['model']}: bandwidth-bound TPOT against context{note}", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_mitigations(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    p = report["prediction"]
    names = ["as configured", *(r["name"] for r in report["mitigations"])]
    tpots = [p["tpot_ms"], *(r["tpot_ms"] for r in report["mitigations"])]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.2))
    ax.barh(names[::-1], tpots[::-1], color=["tab:blue"] * (len(names) - 1) + ["tab:gray"])
    ax.axvline(p["tpot_ms_weights_only"], color="k", ls="--", lw=1, label="weights alone")
    i = report["inputs"]
    ax.set_xlabel(f"TPOT (ms) at {i['context']:,} tokens x batch {i['batch']}")
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_memory(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    m, i = report["memory"], report["inputs"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(m["curve"]["context"], [max(b, 0.5) for b in m["curve"]["max_batch"]], label="largest batch that fits")
    ax.plot([i["context"]], [i["batch"]], "ko", label=f"yours: {i['context']:,} x {i['batch']}")
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("sequences")
    ax.set_title(f"KV beside {gb_text(m['weight_bytes'])} of weights in {m['memory_bytes'] / 1e9:g} GB")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _sections(report: dict, images: dict[str, str]) -> list[tuple[str, str, str | None]]:
    """(title, markdown body, image key or None) for each part of the page."""
    i, p, b = report["inputs"], report["prediction"], report["breakdown"]
    out = [("Summary", "\n".join(f"- {line}" for line in summary_lines(report)), None)]
    rows = [
        ["weights (all parameters)", gb_text(b["weight_bytes"])],
        ["weights read per step", f"{gb_text(b['weight_bytes_read'])} ({b['active_params'] / 1e9:,.2f}B parameters)"],
        ["KV per token", f"{b['kv_bytes_per_token']:,} B in {b['kv_dtype']}"],
        [f"KV read, {i['context']:,} tokens x {i['batch']}", gb_text(b["kv_bytes"])],
        ["bytes per step", gb_text(b["bytes_per_step"])],
    ]
    body = _md_table(["what", "bytes"], rows) + "\n\n" + "\n".join(f"- {n}" for n in b["notes"])
    out.append(("Bytes per step", body, None))
    lo, hi = p["tpot_ms_range"]
    out.append(
        (
            "TPOT against context",
            f"Bandwidth bound at {i['bandwidth_gbps']:,.0f} GB/s ({i['bandwidth_source']}); at your point "
            f"{_ms(p['tpot_ms'])}, and {lo:,.2f}-{hi:,.2f} ms where {p['tpot_ms_range_basis']}. Batching shares the "
            f"weight bytes, not the KV bytes (lesson 04, `{LESSONS['04']}`).",
            "tpot",
        )
    )
    m = report["memory"]
    if m is None:
        out.append(("Memory", "Not judged: give `--gpu` or `--memory-gb`.", None))
    elif m["free_for_kv_bytes"] <= 0:
        out.append(
            (
                "Memory",
                f"The weights alone ({gb_text(m['weight_bytes'])}) exceed {m['memory_bytes'] / 1e9:g} GB "
                f"({m['memory_source']}): {m['devices_needed']} such devices hold weights + KV at your context and "
                "batch. Rerun with `--memory-gb` set to their total to see the batch and context that fit.",
                None,
            )
        )
    else:
        out.append(
            (
                "Memory",
                f"{gb_text(m['free_for_kv_bytes'])} left for KV beside the weights; "
                f"{gb_text(m['kv_bytes_per_sequence'])} per "
                f"sequence at {i['context']:,} tokens: at most batch {m['max_batch_at_context']:,}, or "
                f"{m['max_context_at_batch']:,} tokens at batch {i['batch']}. {m['caveat']}.",
                "memory",
            )
        )
    cross = [
        [
            str(c["batch"]),
            gb_text(c["weight_bytes_read"]),
            f"{c['context']:,.0f}" if c["within_max"] else f"beyond max context ({i['max_seq_len']:,})",
        ]
        for c in report["crossover"]
    ]
    out.append(("Where KV equals weights", _md_table(["batch", "weights read", "context (tokens)"], cross), None))
    mit = [["as configured", "", _ms(p["tpot_ms"]), "1.00x", gb_text(p["memory_needed_bytes"]), ""]]
    mit += [
        [
            r["name"],
            r["lesson"],
            _ms(r["tpot_ms"]),
            f"{r['speedup']:.2f}x",
            gb_text(r["memory_needed_bytes"]),
            f"`{' '.join(r['predict_flags'])}`",
        ]
        for r in report["mitigations"]
    ]
    header = ["mitigation", "lesson", "TPOT", "speedup", "weights + KV", "`kvlab predict` flags added"]
    notes = "\n".join(
        f"- {r['name']} (lesson {r['lesson']}, `{r['lesson_path']}`). Assumed: {r['assumption']}. "
        f"Quality: {r['quality']}. Source: {r['citation']}."
        for r in report["mitigations"]
    )
    out.append(
        (
            f"Mitigations at {i['context']:,} tokens x batch {i['batch']}",
            _md_table(header, mit) + "\n\nWhat each assumes and what it costs in quality:\n\n" + notes,
            "mitigations",
        )
    )
    s = report["measured"]
    if s is not None:
        f = s["fit"]
        out.append(
            (
                "Measured on this machine",
                f"{s['model']} on {s['device']}: read bandwidth {s['bandwidth']['read_gbps']:.1f} GB/s; fit "
                f"{f['slope_us_per_token']:.3f} us/token (predicted {f['predicted_slope_us_per_token']:.3f}), "
                f"intercept {f['intercept_ms']:.2f} ms (predicted {f['predicted_intercept_ms']:.2f}), R^2 "
                f"{f['r2']:.4f}. The KV term reached {f['kv_bandwidth_fraction']:.0%} of the read bandwidth and "
                f"the weight term {f['weight_bandwidth_fraction']:.0%}: the same kind of figure as the published "
                "systems' share of nominal bandwidth above.",
                "measure",
            )
        )
    return [(t, body, key if key in images else None) for t, body, key in out]


def write_report(report: dict, out: str | Path, sweep=None, images: bool = True) -> list[Path]:
    """Write ``report.json`` under ``out``, and with ``images`` the PNG plots, ``report.md`` and a self-contained
    ``index.html`` (its images are data: URIs). Returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "report.json"]
    written[0].write_text(json.dumps(report, indent=2) + "\n")
    if not images:
        return written
    import matplotlib

    matplotlib.use("Agg")  # no display needed: the plots go to files
    import matplotlib.pyplot as plt

    pngs = {"tpot": out / PLOTS["tpot"], "mitigations": out / PLOTS["mitigations"]}
    _plot_tpot(report, pngs["tpot"])
    _plot_mitigations(report, pngs["mitigations"])
    if report["memory"] is not None and report["memory"]["free_for_kv_bytes"] > 0:
        pngs["memory"] = out / PLOTS["memory"]
        _plot_memory(report, pngs["memory"])
    if sweep is not None:
        pngs["measure"] = out / PLOTS["measure"]
        plt.close(sweep.plot(pngs["measure"]).figure)
    written += pngs.values()
    sections = _sections(report, pngs)
    title = f"kvlab report: {report['inputs']['model']}"
    md = [f"# {title}", ""]
    for heading, body, key in sections:
        md += [f"## {heading}", "", body, ""]
        if key:
            md += [f"![{heading}]({pngs[key].name})", ""]
    (out / "report.md").write_text("\n".join(md))
    (out / "index.html").write_text(_html(title, sections, pngs))
    return [*written, out / "report.md", out / "index.html"]


def _inline(markdown: str) -> str:
    """The little markdown the sections use (code spans), escaped, as HTML."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(markdown))


def _kind(line: str) -> str:
    return "table" if line.startswith("|") else "list" if line.startswith("- ") else "text" if line else "blank"


def _html_body(body: str) -> str:
    """The sections' markdown (tables, bullet lists, paragraphs) as HTML, block by block."""
    parts = []
    for kind, group in groupby(body.splitlines(), key=_kind):
        lines = list(group)
        if kind == "table":
            head, *rows = ([c.strip() for c in line.strip("|").split(" | ")] for line in lines if "---" not in line)
            trs = ["".join(f"<th>{_inline(c)}</th>" for c in head)]
            trs += ["".join(f"<td>{_inline(c)}</td>" for c in row) for row in rows]
            parts.append("<table>" + "".join(f"<tr>{tr}</tr>" for tr in trs) + "</table>")
        elif kind == "list":
            parts.append("<ul>" + "".join(f"<li>{_inline(line[2:])}</li>" for line in lines) + "</ul>")
        elif kind == "text":
            parts.append(f"<p>{_inline(' '.join(lines))}</p>")
    return "\n".join(parts)


def _html(title: str, sections: list[tuple[str, str, str | None]], pngs: dict[str, Path]) -> str:
    style = (
        "body{font-family:system-ui,sans-serif;max-width:70rem;margin:2rem auto;padding:0 1rem;line-height:1.4}"
        "table{border-collapse:collapse;margin:0.5rem 0}td,th{border:1px solid #ccc;padding:0.3rem 0.5rem;"
        "vertical-align:top;font-size:0.9rem}th{background:#f3f3f3}img{max-width:100%}code{font-size:0.85rem}"
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<link rel="icon" href="data:,">',  # no favicon request: the page needs nothing beside itself
        f"<title>{html.escape(title)}</title><style>{style}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    for heading, body, key in sections:
        parts += [f"<h2>{html.escape(heading)}</h2>", _html_body(body)]
        if key:
            data = base64.b64encode(pngs[key].read_bytes()).decode()
            parts.append(f'<img src="data:image/png;base64,{data}" alt="{html.escape(heading)}">')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"

"""Markdown tables of docs/benchmarks.md from the JSON written by ``scripts/benchmark.py --json``.

    python scripts/bench_report.py out.json > tables.md

One ``###`` table (or a few) per section present in the JSON, after a header block with the
environment it records. Every cell comparing pcops with a peer is ``pcops ms / peer ms (R x)``,
R = peer / pcops with 2 decimals (> 1: pcops faster); a peer without a time (not installed,
out of memory) shows ``-`` and its note. Rows or sections this script does not know are shown
in a generic table rather than dropped. Standard library only.
"""

from __future__ import annotations

import argparse
import json

ENV = ("device", "cpu", "cores", "torch_threads", "versions", "compile_backend", "search_notes")
# the rows each section's tables need; other rows go to a generic table under the section
REQUIRED = {
    "results": ("model", "variant"),
    "search": ("bench", "ms"),
    "small": ("bench", "points", "neighbour", "ms"),
    "geometry_ops": ("model", "variant", "cloud"),
    "sampling": ("op", "variant", "cloud"),
    "point_networks": ("config", "eager", "compiled"),
    "sparse": ("bench", "ms"),
    "transformer": ("op", "ms"),
    "mesh": ("bench",),
    "transport": ("bench", "ms"),
}
# train-step targets of the tutorial's models (docs/benchmarks.md): (model, pcops, reference) -> peer / pcops at least
TARGETS = {
    ("radius_projector", "pcops_eager", "torch_eager"): 100, ("radius_projector", "pcops_eager", "torch_compiled"): 20,
    ("knn_projector", "pcops_eager", "torch_eager"): 100, ("knn_projector", "pcops_eager", "scipy_torch"): 1,
    ("knn_projector", "pcops_compiled", "pcops_eager"): 1, ("radius_projector", "pcops_compiled", "pcops_eager"): 1,
}


def num(v) -> str:
    """A figure as the docs print it: thousands separators, one decimal (two digits below 1)."""
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:,.1f}" if v == 0 or abs(v) >= 1 else f"{v:.2g}"


def cell(ours, peer) -> str:
    """The one comparison cell: ``pcops / peer (peer/pcops x)``; no ratio when either time is missing."""
    if not ours or peer is None:
        return f"{num(ours)} / {num(peer)}"
    return f"{num(ours)} / {num(peer)} ({peer / ours:.2f}x)"


def table(title: str, headers: list, rows: list, notes=()) -> str:
    """A markdown table under a one-line ``###`` title, with notes as bullets below it."""
    esc = lambda c: str(c).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = [f"### {title}", "", "| " + " | ".join(map(esc, headers)) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(map(esc, row)) + " |" for row in rows]
    lines += [""] + [f"* {note}" for note in notes] if notes else []
    return "\n".join(lines) + "\n"


def unique(items) -> list:
    return list(dict.fromkeys(items))


def grouped(rows: list, field: str) -> list:
    """Rows with the same ``field`` together, in the order of first appearance (stable otherwise)."""
    order = unique(r[field] for r in rows)
    return sorted(rows, key=lambda r: order.index(r[field]))


def generic(title: str, rows: list, notes=()) -> str:
    """Rows of any shape: one column per key, dicts as ``key value`` pairs."""
    rows = [r if isinstance(r, dict) else {"value": r} for r in rows]
    keys = unique(k for r in rows for k in r)
    show = lambda v: "; ".join(f"{k} {num(x)}" for k, x in v.items()) if isinstance(v, dict) else num(v)  # noqa: E731
    return table(title, keys, [[show(r.get(k)) for k in keys] for r in rows], notes)


# ----------------------------------------------------------------------------------------------
# Sections


def models(rows: list, report: dict) -> str:
    headers = ["model / op", "variant", "n_ref", "n_query", "forward ms", "train step ms", "peak MB", "note"]
    fields = ("model", "variant", "n_ref", "n_query", "forward_ms", "train_step_ms", "peak_mem_mb", "note")
    groups = {
        "the tutorial's models": [r for r in rows if r["model"].endswith("_projector")],
        "the bare ops": [r for r in rows if not r["model"].endswith("_projector") and r.get("note") != "sweep"],
        "sweep": [r for r in rows if not r["model"].endswith("_projector") and r.get("note") == "sweep"],
    }
    out = [table(f"Models (results): {name}", headers, [[num(r.get(f)) for f in fields] for r in group])
           for name, group in groups.items() if group]
    by = {(r["model"], r.get("n_ref"), r.get("n_query"), r["variant"]): r for r in rows}
    body = []
    for model, n_ref, n_query in unique((r["model"], r.get("n_ref"), r.get("n_query")) for r in rows):
        for ours in ("pcops_eager", "pcops_compiled"):
            for ref in ("torch_eager", "torch_compiled", "scipy_torch", "pcops_eager"):
                a, b = by.get((model, n_ref, n_query, ours)), by.get((model, n_ref, n_query, ref))
                if ref == ours or a is None or b is None:
                    continue
                target = TARGETS.get((model, ours, ref))
                ta, tb = a.get("train_step_ms"), b.get("train_step_ms")
                met = "-" if target is None or not ta or tb is None else ("yes" if tb / ta >= target else "no")
                body.append([model, num(n_ref), num(n_query), ours, ref, cell(a.get("forward_ms"), b.get("forward_ms")),
                             cell(ta, tb), "-" if target is None else f"train step >= {target}x", met])
    if body:
        out.append(table("Models (results): against the targets, pcops ms / reference ms (reference / pcops)",
                         ["model / op", "n_ref", "n_query", "pcops", "reference", "forward", "train step", "target", "met"], body))
    return "\n".join(out)


def partner(name: str, ms: dict):
    """The pcops timing a peer timing compares with: ``pcops`` where the row has it (``pcops_loop`` ->
    ``pcops``), else the ``pcops_*`` key whose suffix ends the peer's name (``cell_list_train`` ->
    ``pcops_train``); None for pcops' own timings."""
    if name == "pcops" or (name.startswith("pcops") and "pcops" not in ms):
        return None
    if "pcops" in ms:
        return "pcops"
    found = [k for k in ms if k != name and k.startswith("pcops_") and name.endswith(k[len("pcops"):])]
    return max(found, key=len) if found else None


def ms_tables(section: str, rows: list, group, notes=()) -> str:
    """Rows with an ``ms`` dict of pcops and its peers: a table per group, a column per peer (a
    row's ``vs`` dict, where it has one, names the pcops timing each peer compares with, and
    only those peers get a column)."""
    out = []
    groups = unique(group(r) for r in rows)
    mate = lambda p, r: r["vs"].get(p) if "vs" in r else partner(p, r["ms"])  # noqa: E731
    for i, name in enumerate(groups):
        grp = [r for r in rows if group(r) == name]
        lead = unique(k for r in grp for k in r if k not in ("ms", "ratio", "bench", "vs"))
        pairs = {}
        for r in grp:
            for p in r["ms"]:
                if mate(p, r) and p not in pairs:
                    pairs[p] = mate(p, r)
        body = [[num(r.get(k)) for k in lead] + [cell(r["ms"].get(mate(p, r) or ""), r["ms"][p]) if p in r["ms"] else "-"
                                                  for p in pairs] for r in grp]
        headers = lead + [f"{ours} / {p} ms" for p, ours in pairs.items()]
        out.append(table(f"{section}: {name}", headers, body, notes if i == len(groups) - 1 else ()))
    return "\n".join(out)


def cloud_table(title: str, rows: list, ours: str, field: str, keys: tuple, lead: list) -> str:
    """pcops against each peer, one column per cloud shape: rows matched on ``keys`` and the cloud,
    ``lead`` = [(header, row -> text)] shown from pcops' row. Peer rows without a time and without a
    note (Open3D has no train step) are left out."""
    clouds = unique(r["cloud"] for r in rows)
    key = lambda r: tuple(r.get(k) for k in keys)  # noqa: E731
    mine = {(key(r), r["cloud"]): r for r in rows if r["variant"] == ours}
    body = {}
    for r in rows:
        if r["variant"] == ours or (r.get(field) is None and not r.get("note")):
            continue
        note = r.get("note") or ""
        note = note.split(", ", 1)[1] if note.startswith("S=") and ", " in note else ("" if note.startswith("S=") else note)
        label = f"{r['variant']} ({note})" if note else r["variant"]
        first = mine.get((key(r), r["cloud"]), r)
        line = body.setdefault((key(r), label), [fn(first) for _, fn in lead] + [label] + ["-"] * len(clouds))
        line[len(lead) + 1 + clouds.index(r["cloud"])] = cell(first.get(field) if first is not r else None, r.get(field))
    return table(title, [h for h, _ in lead] + ["peer"] + clouds, list(body.values()))


def sampling(rows: list, report: dict) -> str:
    fps = grouped([r for r in rows if r["op"] == "farthest_point_sample"], "variant")  # a peer's rows together, by n and S
    s_label = lambda r: (r.get("note") or "").split(",")[0][2:] if (r.get("note") or "").startswith("S=") else num(r.get("s"))  # noqa: E731
    out = [cloud_table("Sampling: farthest_point_sample by n and S, pcops ms / peer ms (peer / pcops)", fps, "pcops", "ms",
                       ("op", "n", "s"), [("n", lambda r: num(r["n"])), ("S", s_label)])] if fps else []
    rest = grouped([r for r in rows if r["op"] != "farthest_point_sample"], "op")
    if rest:
        out.append(cloud_table("Sampling: grouping ops and batches by cloud, pcops ms / peer ms (peer / pcops)", rest, "pcops", "ms",
                               ("op", "n", "s"), [("op", lambda r: r["op"]), ("n", lambda r: num(r.get("n")))]))
    return "\n".join(out)


def geometry(rows: list, report: dict) -> str:
    lead = [("op", lambda r: r["model"]), ("n_ref", lambda r: num(r.get("n_ref"))), ("n_query", lambda r: num(r.get("n_query")))]
    return "\n".join(cloud_table(f"Geometry ops: {name}, pcops ms / peer ms (peer / pcops)", rows, "pcops_eager", field,
                                 ("model", "n_ref", "n_query"), lead)
                     for name, field in (("forward", "forward_ms"), ("train step", "train_step_ms")))


def networks(rows: list, report: dict) -> str:
    headers = ["config", "points", "batch", "eager samples/s", "compiled samples/s", "compiled / eager", "warm-up incl. compile (s)",
               "pcops share of an eager step", "largest pcops op"]
    body = [[r["config"], num(r.get("points")), num(r.get("batch")), num(r["eager"]), num(r["compiled"]),
             f"{r['compiled'] / r['eager']:.2f}" if r["eager"] else "-", num(r.get("compile_s")),
             "-" if r.get("share") is None else f"{100 * r['share']:.0f}%", f"`{r['top']}`" if r.get("top", "-") != "-" else "-"]
            for r in rows]
    return table("Point networks: training throughput (samples/s)", headers, body)


def meshes(rows: list, report: dict) -> str:
    """bench_mesh.py: timed rows by bench, the agreement with each peer, and the notes."""
    timed = [r for r in rows if isinstance(r.get("ms"), dict)]
    shown = lambda r: {**{k: v for k, v in r.items() if k != "ms"}, "pcops ms (build included)": r["ms"].get("pcops"),  # noqa: E731
                       "pcops_prebuilt ms": r["ms"].get("pcops_prebuilt"), "ms": r["ms"]}
    timed = [shown(r) if "pcops_prebuilt" in r["ms"] else r for r in timed]
    agree = [r for r in rows if r["bench"] == "mesh_agreement"]
    notes = [r["note"] for r in rows if r["bench"] == "mesh_note"]
    out = [ms_tables("Meshes", timed, lambda r: r["bench"])] if timed else []
    if agree:
        fields = ("mesh", "faces", "queries", "peer", "max_abs_diff", "max_closest_gap", "sign_disagree", "checked", "pcops_right", "near_half")
        show = lambda r, k: "-" if r.get(k) is None else (f"{100 * r[k]:.2g}%" if k == "sign_disagree" else  # noqa: E731
                                                          f"{r[k]:.1e}" if isinstance(r[k], float) else num(r[k]))
        out.append(table("Meshes: agreement with pcops (unsigned distance; sign, checked against the exact winding number)",
                         list(fields), [[show(r, k) for k in fields] for r in agree], notes))
    elif notes:
        out.append("\n".join(f"* {n}" for n in notes) + "\n")
    return "\n".join(out)


SECTIONS = {
    "results": models,
    "search": lambda rows, report: ms_tables("CPU search", rows, lambda r: r["bench"], report.get("search_notes") or ()),
    "small": lambda rows, report: ms_tables("Small clouds", rows, lambda r: r["bench"]),
    "geometry_ops": geometry,
    "sampling": sampling,
    "point_networks": networks,
    "sparse": lambda rows, report: ms_tables("Sparse", rows, lambda r: r["bench"]),
    "transformer": lambda rows, report: ms_tables("Transformer", rows, lambda r: r["op"].split(":")[0]),
    "mesh": meshes,
    "transport": lambda rows, report: ms_tables("Transport", rows, lambda r: r["bench"]),
}


def header(report: dict) -> str:
    versions = dict(report.get("versions") or {})
    first = {k: versions.pop(k) for k in ("torch", "warp", "python") if k in versions}
    lines = ["## Benchmark run", ""]
    if report.get("cpu") or report.get("cores"):
        lines.append(f"* CPU: {report.get('cpu') or '-'}" + (f" ({report['cores']} cores)" if report.get("cores") else ""))
    lines += [f"* {name}: {num(report[key])}" for key, name in (("device", "device"), ("torch_threads", "torch threads"),
                                                                ("compile_backend", "compile backend")) if key in report]
    if first or versions:
        lines.append("* versions: " + ", ".join(f"{k} {v}" for k, v in {**first, **versions}.items()))
    lines += [f"* {k}: {json.dumps(v)}" for k, v in report.items() if k not in ENV and not isinstance(v, list)]
    lines.append("* a cell comparing pcops with a peer: pcops ms / peer ms (peer / pcops; > 1: pcops faster)")
    return "\n".join(lines) + "\n"


def render(report: dict) -> str:
    """The header block, then each section of the JSON in its order (unknown ones as generic tables)."""
    parts = [header(report)]
    for key, value in report.items():
        if key in ENV or not isinstance(value, list):
            continue
        if key not in SECTIONS:
            parts.append(generic(f"{key} (not known to bench_report.py)", value))
            continue
        known, other = [], []
        for r in value:
            (known if isinstance(r, dict) and all(r.get(f) is not None for f in REQUIRED[key]) else other).append(r)
        try:
            if known:
                parts.append(SECTIONS[key](known, report))
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as err:
            parts.append(generic(f"{key} (rows as written: {type(err).__name__}: {err})", value))
            continue
        if other:
            parts.append(generic(f"{key}: rows of another shape", other))
    return "\n".join(parts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="the file written by scripts/benchmark.py --json")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        print(render(json.load(f)), end="")


if __name__ == "__main__":
    main()

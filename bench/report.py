#!/usr/bin/env python3
"""Report generator for bench/compare.sh (Python 3 standard library only).

    bench_report.py capacity FILE.json...
        The median `rps` of sluice-load JSON files, as an integer (the latency rig's base rate).
    bench_report.py report --raw DIR --results FILE --charts DIR
        Reads DIR/meta.json, DIR/runs.jsonl, DIR/idle.jsonl and each run's sluice-load JSON;
        writes the markdown block between `<!-- bench.sh:begin -->` and `<!-- bench.sh:end -->`
        in FILE (replacing the old block, or appending one; FILE is created when missing) and
        the SVG charts in DIR.

Every latency curve is drawn from the full HDR histograms sluice-load writes (`hdr_v2_base64`),
decoded here; rounds of one proxy are merged by adding their counts.
"""

import base64
import json
import math
import os
import statistics
import struct
import sys
from xml.sax.saxutils import escape

BEGIN = "<!-- bench.sh:begin -->"
END = "<!-- bench.sh:end -->"

# One colour per target, the same in every chart.
COLOURS = {
    "direct": "#7f7f7f",
    "nginx": "#2ca02c",
    "haproxy": "#1f77b4",
    "monolake": "#9467bd",
    "sluice": "#d62728",
    "sluice-ai": "#ff7f0e",
}


# ---------------------------------------------------------------------------------------------
# HdrHistogram V2 (uncompressed) decoding
# ---------------------------------------------------------------------------------------------

class Hist:
    """A decoded HdrHistogram: counts by bucket index, values in the recorded unit (µs)."""

    V2_COOKIE = 0x1C849313

    def __init__(self, sig, low, counts):
        self.sig = sig
        self.low = low
        self.counts = counts  # {index: count}
        sub_bucket_count_magnitude = max(1, math.ceil(math.log2(2 * 10 ** sig)))
        self.half_mag = sub_bucket_count_magnitude - 1
        self.half = 1 << self.half_mag
        self.unit_mag = int(math.floor(math.log2(low)))

    @classmethod
    def decode(cls, b64):
        raw = base64.b64decode(b64)
        cookie, length, _offset, sig, low, _high, _ratio = struct.unpack(">IIIIqqd", raw[:40])
        if cookie != cls.V2_COOKIE:
            raise ValueError(f"not an uncompressed V2 histogram (cookie {cookie:#x})")
        payload = raw[40:40 + length]
        counts, index, i = {}, 0, 0
        while i < len(payload):
            # ZigZag LEB128, at most 9 bytes (the 9th carries 8 bits).
            value, shift = 0, 0
            for k in range(9):
                byte = payload[i]
                i += 1
                if k == 8:
                    value |= byte << 56
                    break
                value |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    break
            n = (value >> 1) ^ -(value & 1)
            if n < 0:
                index += -n  # a run of empty buckets
            else:
                if n:
                    counts[index] = counts.get(index, 0) + n
                index += 1
        return cls(sig, max(1, low), counts)

    def _bucket(self, index):
        bucket = (index >> self.half_mag) - 1
        sub = (index & (self.half - 1)) + self.half
        if bucket < 0:
            sub -= self.half
            bucket = 0
        return bucket, sub

    def highest_equivalent(self, index):
        bucket, sub = self._bucket(index)
        lowest = sub << (bucket + self.unit_mag)
        return lowest + (1 << (bucket + self.unit_mag)) - 1

    def total(self):
        return sum(self.counts.values())

    def merge(self, other):
        if (other.sig, other.low) != (self.sig, self.low):
            raise ValueError("histograms with different layouts")
        for k, v in other.counts.items():
            self.counts[k] = self.counts.get(k, 0) + v

    def quantile(self, q):
        total = self.total()
        if not total:
            return 0
        want = max(1, math.ceil(q * total))
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            if seen >= want:
                return self.highest_equivalent(index)
        return self.highest_equivalent(max(self.counts))

    def curve(self):
        """(quantile reached, value) per non-empty bucket, in order."""
        total = self.total()
        out, seen = [], 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            out.append((seen / total, self.highest_equivalent(index)))
        return out


def hist_of(run_json, name):
    h = run_json.get(name) or {}
    b64 = h.get("hdr_v2_base64")
    if not b64 or not h.get("count"):
        return None
    hist = Hist.decode(b64)
    # Self-check: the decoded histogram must give the percentiles sluice-load printed.
    for key, q in (("p50_ms", 0.5), ("p99_ms", 0.99)):
        mine = hist.quantile(q) / 1000.0
        theirs = h[key]
        if abs(mine - theirs) > max(0.002, theirs * 0.002):
            raise ValueError(f"HDR decode mismatch for {name}.{key}: {mine} vs {theirs}")
    return hist


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------

# Above this share of busy time the latency rig's client core (load generator + mock-llm) is
# queueing requests itself.
CLIENT_BUSY_LIMIT = 0.9
# Issue #15's bar for a latency rig whose tails mean something: the client core under this
# share of busy time at every level up to 90% of nginx's capacity.
CLIENT_BUSY_TARGET = 0.7


def mock_core_apart(meta):
    """Whether mock-llm had a core of its own in the latency rig (CORE_C), not the client's."""
    return meta.get("core_c", meta["core_b"]) != meta["core_b"]


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def busy(c):
    # user nice system idle iowait irq softirq steal
    return c[0] + c[1] + c[2] + c[5] + c[6]


class Run:
    def __init__(self, rec, raw_dir, meta):
        self.rec = rec
        self.id = rec["id"]
        self.scenario = rec["scenario"]
        self.rig = rec["rig"]
        self.round = rec["round"]
        self.proxy = rec["proxy"]
        self.level = rec["level"]
        self.conc = rec["conc"]
        with open(os.path.join(raw_dir, self.id + ".json")) as f:
            self.j = json.load(f)
        pre, post = rec["pre"], rec["post"]
        clk = meta["clk_tck"]
        # From the end of the snapshot before the run to the start of the one after it.
        self.wall = post["t"] - pre.get("t_end", pre["t"])
        self.mock_requests = post["mock_requests"] - pre["mock_requests"]
        target_ticks = post["target"] - pre["target"]
        self.cpu_us = (target_ticks / clk * 1e6 / self.mock_requests) if self.mock_requests > 0 else None
        self.redis_us = None
        if self.proxy == "sluice-ai" and post.get("redis"):
            rt = post["redis"] - pre["redis"]
            self.redis_us = rt / clk * 1e6 / self.mock_requests if self.mock_requests > 0 else None
        self.rss_mib = post["rss_kib"] / 1024.0
        self.rps = self.j["rps"]
        self.ok = self.j["ok"]
        self.errors = self.j["errors_total"]
        lat = self.j["latency"]
        self.p50, self.p99, self.p999 = lat["p50_ms"], lat["p99_ms"], lat["p999_ms"]
        self.mean_ms = lat["mean_ms"]
        # Per-core busy fractions over the run.
        a, b = str(meta["core_a"]), str(meta["core_b"])
        def frac(core, ticks=None):
            c0, c1 = pre["cpus"].get(core), post["cpus"].get(core)
            if not c0 or not c1:
                return None
            total = sum(c1[:8]) - sum(c0[:8])
            if total <= 0:
                return None
            val = busy(c1) - busy(c0) if ticks is None else ticks(c0, c1)
            return max(0.0, val / total)
        self.core_a_busy = frac(a)
        self.core_b_busy = frac(b)
        limit = meta["idle_max_pct"] / 100.0
        self.disturbed = None
        if self.rig == "cost":
            if self.core_b_busy is not None and self.core_b_busy > limit:
                self.disturbed = f"core {b} (should be idle) {self.pct(self.core_b_busy)} busy"
        else:
            own = target_ticks if self.proxy != "direct" else 0
            other = frac(a, lambda c0, c1: (c1[0] + c1[1] + c1[2]) - (c0[0] + c0[1] + c0[2]) - own)
            if other is not None and other > limit:
                self.disturbed = f"core {a} ran {self.pct(other)} of other work"

    @staticmethod
    def pct(x):
        return f"{x * 100:.0f}%"


def load_runs(raw_dir, meta):
    runs = []
    path = os.path.join(raw_dir, "runs.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    runs.append(Run(json.loads(line), raw_dir, meta))
    return runs


def load_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------

def f_int(v):
    return "–" if v is None else f"{v:,.0f}"


def f_ms(v):
    if v is None:
        return "–"
    if v < 1:
        return f"{v:.3f}"
    if v < 100:
        return f"{v:.2f}"
    return f"{v:,.0f}"


def f_num(v, digits=2):
    return "–" if v is None else f"{v:.{digits}f}"


def f_range(xs, fmt):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    return f"{fmt(min(xs))}–{fmt(max(xs))}"


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def disturbed_cell(runs):
    n = sum(1 for r in runs if r.disturbed)
    return f"{n}/{len(runs)}"


def by_round(runs):
    return {r.round: r for r in runs}


def ratios(runs, base_runs, attr):
    base = by_round(base_runs)
    out = []
    for r in runs:
        b = base.get(r.round)
        x, y = getattr(r, attr), getattr(b, attr) if b else None
        if x is not None and y:
            out.append(x / y)
    return out


# ---------------------------------------------------------------------------------------------
# SVG
# ---------------------------------------------------------------------------------------------

W, H = 760, 440
ML, MR, MT, MB = 70, 170, 40, 56


def svg_doc(title, body):
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
        f'font-family="sans-serif" font-size="12">\n'
        f'<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>\n'
        f'<text x="{W / 2:.0f}" y="22" text-anchor="middle" font-size="14" font-weight="bold">'
        f"{escape(title)}</text>\n{body}</svg>\n"
    )


def nice_log_ticks(lo, hi):
    ticks = []
    e = math.floor(math.log10(lo))
    while 10 ** e <= hi * 1.0001:
        for m in (1, 2, 5):
            v = m * 10 ** e
            if lo * 0.9999 <= v <= hi * 1.0001:
                ticks.append(v)
        e += 1
    return ticks


def nice_linear_ticks(hi, n=5):
    if hi <= 0:
        return [0]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    ticks = [0.0]
    while ticks[-1] < hi * 0.9999:  # the last tick at or above the highest value
        ticks.append(ticks[-1] + step)
    return ticks


def fmt_tick(v):
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 1:
        return f"{v:g}"
    return f"{v:g}"


def legend(names, extra=None):
    out = []
    for i, name in enumerate(names):
        y = MT + 10 + i * 20
        label = name + (extra.get(name, "") if extra else "")
        out.append(
            f'<line x1="{W - MR + 16}" y1="{y}" x2="{W - MR + 40}" y2="{y}" '
            f'stroke="{COLOURS.get(name, "#000")}" stroke-width="3"/>'
            f'<text x="{W - MR + 46}" y="{y + 4}">{escape(label)}</text>'
        )
    return "\n".join(out) + "\n"


def percentile_chart(title, curves, unit_label="latency (ms, log scale)"):
    """curves: {proxy: [(quantile, value_ms)]}; x = nines, y = log latency."""
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return None
    max_nines = 1.0
    for pts in curves.values():
        n = len(pts)
        # The curve is meaningful up to the quantile of the last sample.
        last_q = pts[-2][0] if n > 1 else 0.9
        if last_q < 1:
            max_nines = max(max_nines, -math.log10(1 - last_q))
    max_nines = min(5.0, math.ceil(max_nines))
    ys = [v for pts in curves.values() for _, v in pts if v > 0]
    lo, hi = min(ys), max(ys)
    lo = 10 ** math.floor(math.log10(lo))
    hi = 10 ** math.ceil(math.log10(hi)) if hi > lo else lo * 10
    pw, ph = W - ML - MR, H - MT - MB

    def x(nines):
        return ML + pw * min(nines, max_nines) / max_nines

    def y(v):
        v = max(v, lo)
        return MT + ph - ph * (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    body = [f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>']
    for t in nice_log_ticks(lo, hi):
        body.append(
            f'<line x1="{ML}" y1="{y(t):.1f}" x2="{ML + pw}" y2="{y(t):.1f}" stroke="#ddd"/>'
            f'<text x="{ML - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{fmt_tick(t)}</text>'
        )
    labels = ["0%", "90%", "99%", "99.9%", "99.99%", "99.999%"]
    for k in range(int(max_nines) + 1):
        body.append(
            f'<line x1="{x(k):.1f}" y1="{MT}" x2="{x(k):.1f}" y2="{MT + ph}" stroke="#ddd"/>'
            f'<text x="{x(k):.1f}" y="{MT + ph + 18}" text-anchor="middle">{labels[k]}</text>'
        )
    body.append(
        f'<text x="{ML + pw / 2:.0f}" y="{H - 12}" text-anchor="middle">percentile</text>'
        f'<text transform="translate(16 {MT + ph / 2:.0f}) rotate(-90)" text-anchor="middle">'
        f"{escape(unit_label)}</text>"
    )
    cap = 1 - 10 ** (-max_nines)
    for name, pts in curves.items():
        coords, prev_q = [], 0.0
        for q, v in pts:
            q0, q1 = min(prev_q, cap), min(q, cap)
            n0 = -math.log10(1 - q0)
            n1 = -math.log10(1 - q1)
            coords.append(f"{x(n0):.1f},{y(v):.1f}")
            coords.append(f"{x(n1):.1f},{y(v):.1f}")
            prev_q = q
            if q >= cap:
                break
        body.append(
            f'<polyline fill="none" stroke="{COLOURS.get(name, "#000")}" stroke-width="2" '
            f'points="{" ".join(coords)}"/>'
        )
    body.append(legend(list(curves)))
    return svg_doc(title, "\n".join(body) + "\n")


def line_chart(title, series, x_label, y_label):
    """series: {proxy: [(x, y_ms)]}; linear x, log y."""
    series = {k: sorted(v) for k, v in series.items() if v}
    if not series:
        return None
    xs = [p[0] for pts in series.values() for p in pts]
    ys = [p[1] for pts in series.values() for p in pts if p[1] > 0]
    if not ys:
        return None
    lo = 10 ** math.floor(math.log10(min(ys)))
    hi = 10 ** math.ceil(math.log10(max(ys)))
    if hi <= lo:
        hi = lo * 10
    x_ticks = nice_linear_ticks(max(xs))
    x_hi = x_ticks[-1] if x_ticks[-1] > 0 else 1
    pw, ph = W - ML - MR, H - MT - MB

    def x(v):
        return ML + pw * v / x_hi

    def y(v):
        v = max(v, lo)
        return MT + ph - ph * (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    body = [f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>']
    for t in nice_log_ticks(lo, hi):
        body.append(
            f'<line x1="{ML}" y1="{y(t):.1f}" x2="{ML + pw}" y2="{y(t):.1f}" stroke="#ddd"/>'
            f'<text x="{ML - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{fmt_tick(t)}</text>'
        )
    for t in x_ticks:
        body.append(
            f'<line x1="{x(t):.1f}" y1="{MT}" x2="{x(t):.1f}" y2="{MT + ph}" stroke="#ddd"/>'
            f'<text x="{x(t):.1f}" y="{MT + ph + 18}" text-anchor="middle">{fmt_tick(t)}</text>'
        )
    body.append(
        f'<text x="{ML + pw / 2:.0f}" y="{H - 12}" text-anchor="middle">{escape(x_label)}</text>'
        f'<text transform="translate(16 {MT + ph / 2:.0f}) rotate(-90)" text-anchor="middle">'
        f"{escape(y_label)}</text>"
    )
    for name, pts in series.items():
        colour = COLOURS.get(name, "#000")
        coords = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in pts)
        body.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{coords}"/>')
        for a, b in pts:
            body.append(f'<circle cx="{x(a):.1f}" cy="{y(b):.1f}" r="3" fill="{colour}"/>')
    body.append(legend(list(series)))
    return svg_doc(title, "\n".join(body) + "\n")


def frontier_chart(title, frontier, thresholds):
    """frontier: {proxy: {threshold_ms: rate or None}}: grouped bars."""
    if not frontier:
        return None
    names = list(frontier)
    top = max([v for d in frontier.values() for v in d.values() if v] or [1])
    y_ticks = nice_linear_ticks(top)
    y_hi = y_ticks[-1] if y_ticks[-1] > 0 else 1
    pw, ph = W - ML - MR, H - MT - MB
    group = pw / len(names)
    bar = group * 0.8 / len(thresholds)
    shades = ["#c6dbef", "#6baed6", "#08519c"]

    def y(v):
        return MT + ph - ph * v / y_hi

    body = [f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>']
    for t in y_ticks:
        body.append(
            f'<line x1="{ML}" y1="{y(t):.1f}" x2="{ML + pw}" y2="{y(t):.1f}" stroke="#ddd"/>'
            f'<text x="{ML - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{fmt_tick(t)}</text>'
        )
    for i, name in enumerate(names):
        gx = ML + i * group + group * 0.1
        for k, thr in enumerate(thresholds):
            v = frontier[name].get(thr)
            bx = gx + k * bar
            if v:
                body.append(
                    f'<path d="M{bx:.1f},{y(0):.1f} V{y(v):.1f} H{bx + bar - 2:.1f} V{y(0):.1f} Z" '
                    f'fill="{shades[k % 3]}" stroke="#333" stroke-width="0.5"/>'
                )
            else:
                body.append(
                    f'<text x="{bx + bar / 2:.1f}" y="{y(0) - 4:.1f}" text-anchor="middle" '
                    f'font-size="10">none</text>'
                )
        body.append(
            f'<text x="{ML + i * group + group / 2:.1f}" y="{MT + ph + 18}" text-anchor="middle" '
            f'fill="{COLOURS.get(name, "#000")}" font-weight="bold">{escape(name)}</text>'
        )
    body.append(
        f'<text transform="translate(16 {MT + ph / 2:.0f}) rotate(-90)" text-anchor="middle">'
        f"highest offered req/s with p99 under the limit</text>"
    )
    for k, thr in enumerate(thresholds):
        yy = MT + 10 + k * 20
        body.append(
            f'<rect x="{W - MR + 16}" y="{yy - 8}" width="24" height="12" fill="{shades[k % 3]}" '
            f'stroke="#333" stroke-width="0.5"/><text x="{W - MR + 46}" y="{yy + 2}">p99 &lt; {thr:g} ms</text>'
        )
    return svg_doc(title, "\n".join(body) + "\n")


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

def merged_hist(runs, name):
    total = None
    for r in runs:
        h = hist_of(r.j, name)
        if h is None:
            continue
        if total is None:
            total = h
        else:
            total.merge(h)
    return total


def curve_ms(h):
    return [(q, v / 1000.0) for q, v in h.curve()] if h else []


class Report:
    def __init__(self, raw, charts):
        self.raw = raw
        self.charts = charts
        with open(os.path.join(raw, "meta.json")) as f:
            self.meta = json.load(f)
        self.runs = load_runs(raw, self.meta)
        self.idle = load_jsonl(os.path.join(raw, "idle.jsonl"))
        self.order = [p for p in self.meta["proxies"]]
        self.chart_files = []
        self.targets = []

    def select(self, **kw):
        return [r for r in self.runs if all(getattr(r, k) == v for k, v in kw.items())]

    def write_chart(self, name, svg, caption):
        if not svg:
            return
        os.makedirs(self.charts, exist_ok=True)
        with open(os.path.join(self.charts, name), "w") as f:
            f.write(svg)
        self.chart_files.append((name, caption))

    # -- cost rig ---------------------------------------------------------------------------

    def cost_section(self, scenario, title):
        runs = self.select(scenario=scenario, rig="cost")
        if not runs:
            return None
        nginx = [r for r in runs if r.proxy == "nginx"]
        rows, curves = [], {}
        for p in self.order:
            rs = [r for r in runs if r.proxy == p]
            if not rs:
                continue
            rr = ratios(rs, nginx, "rps")
            cr = ratios(rs, nginx, "cpu_us") if p != "direct" else []
            rows.append([
                p,
                f_int(median([r.rps for r in rs])),
                f_range([r.rps for r in rs], f_int),
                f_num(median(rr)),
                f_range(rr, f_num),
                f_num(median([r.cpu_us for r in rs])),
                f_num(median(cr)) if cr else "–",
                f_ms(median([r.p50 for r in rs])),
                f_ms(median([r.p99 for r in rs])),
                f_ms(median([r.p999 for r in rs])),
                f"{max(r.rss_mib for r in rs):.1f}",
                sum(r.errors for r in rs),
                disturbed_cell(rs),
            ])
            curves[p] = curve_ms(merged_hist(rs, "latency"))
            if scenario == "small" and p in ("sluice", "sluice-ai") and nginx:
                self.cost_targets(p, rr, cr)
        if scenario == "large":
            self.large_target(runs)
        m = self.meta
        bytes_ = m["small_bytes"] if scenario == "small" else m["large_bytes"]
        chart = f"cost-{scenario}-latency.svg"
        self.write_chart(
            chart,
            percentile_chart(f"{title}: closed-loop latency by percentile (cost rig)", curves),
            f"{title}, cost rig (closed loop, {m['conns']} connections, everything on core "
            f"{m['core_a']}): latency by percentile, all rounds merged",
        )
        text = [
            f"### Cost rig: {title}",
            "",
            f"Closed loop, {m['conns']} keep-alive connections, {bytes_:,}-byte chat POSTs, "
            f"{m['duration']} s per run after {m['warmup']} s warm-up, {m['rounds']} interleaved "
            f"round(s). sluice-load, mock-llm and the proxy all on core {m['core_a']}. Ratios are "
            "per round against nginx's run of the same round (median, then min–max). CPU µs/req "
            "is the proxy's utime+stime over the run divided by the requests mock-llm served in "
            "it (for `direct`: mock-llm's own CPU). Latency: medians over rounds of each run's "
            "percentile (closed loop, so it includes queueing behind the other connections).",
            "",
            table(
                ["proxy", "req/s", "min–max", "ratio to nginx", "ratio min–max", "CPU µs/req",
                 "CPU ratio to nginx", "p50 ms", "p99 ms", "p99.9 ms", "RSS MiB", "errors",
                 "disturbed"],
                rows,
            ),
        ]
        ai = [r for r in runs if r.proxy == "sluice-ai" and r.redis_us is not None]
        if ai:
            text += ["", f"sluice-ai: redis-server (same core) used a further "
                     f"{f_num(median([r.redis_us for r in ai]))} µs of CPU per request (median)."]
        if scenario == "large":
            text += ["", "mock-llm echoes the request body in its answer, so the responses "
                     "are as large as the prompts."]
        return "\n".join(text)

    def cost_targets(self, p, rr, cr):
        """Issue #15's cost-rig targets (1 KB): by the median of the interleaved rounds."""
        want_rps, want_cpu = (1.25, 0.75) if p == "sluice" else (1.1, 0.9)
        what = "Sluice plain proxy" if p == "sluice" else "Sluice with the AI pipeline"
        v = median(rr)
        self.targets.append((f"{what} ≥ {want_rps:g}× nginx req/s (cost rig, 1 KB)", v,
                             v is not None and v >= want_rps, f_range(rr, f_num), None))
        v = median(cr)
        self.targets.append((f"{what} ≤ {want_cpu:g}× nginx CPU µs/request (cost rig, 1 KB)",
                             v, v is not None and v <= want_cpu, f_range(cr, f_num), None))

    def large_target(self, runs):
        """Issue #15 item 5: 64 KB prompts at or below monolake's CPU per request."""
        sluice = [r for r in runs if r.proxy == "sluice"]
        monolake = [r for r in runs if r.proxy == "monolake"]
        if not sluice or not monolake:
            return
        mr = ratios(sluice, monolake, "cpu_us")
        v = median(mr)
        self.targets.append(("Sluice plain proxy ≤ 1.0× monolake's CPU µs/request (cost rig, "
                             "64 KB prompts; the ratio is to monolake)", v,
                             v is not None and v <= 1.0, f_range(mr, f_num), None))

    # -- latency rig ------------------------------------------------------------------------

    def latency_section(self, scenario, title):
        runs = self.select(scenario=scenario, rig="latency")
        caps = self.select(scenario=scenario, rig="capacity")
        if not runs:
            return None
        m = self.meta
        cap = m.get("capacity", {}).get(scenario)
        cap_busy = median([r.core_a_busy for r in caps])
        levels = sorted({r.level for r in runs})
        text = [
            f"### Latency rig: {title}, open loop",
            "",
            f"The proxy alone on core {m['core_a']}; "
            + (f"sluice-load and mock-llm on core {m['core_b']}"
               if not mock_core_apart(m)
               else f"sluice-load on core {m['core_b']}, mock-llm on core {m['core_c']}")
            + f". nginx's capacity in this layout (closed loop, {m['conns']} "
            f"connections, median of {len(caps)} run(s)): **{f_int(cap)} req/s**"
            + (f", with nginx's core {cap_busy * 100:.0f}% busy" if cap_busy is not None else "")
            + (" (below ~95%: the client side, not nginx, set the capacity)"
               if cap_busy is not None and cap_busy < 0.95 else "")
            + f". Then open loop (latency from each request's intended send time, so stalls are "
            f"not hidden) at {', '.join(f'{l}%' for l in levels)} of it, {m['lat_conns']} "
            f"connections, {m['lat_duration']} s per run, rounds interleaving the proxies. "
            "Percentiles are medians over rounds; the p99.9 ratio is per round against nginx. "
            "*Served* counts every request mock-llm answered over the run's whole wall time "
            "(warm-up included), so a proxy that can't keep up serves less than offered. "
            f"*Client core busy*: core {m['core_b']}, where sluice-load"
            + (", mock-llm (and, for sluice-ai, redis-server) run"
               if not mock_core_apart(m)
               else f" runs (mock-llm and redis-server on core {m['core_c']})")
            + "; above "
            f"{CLIENT_BUSY_LIMIT * 100:.0f}% requests queue on the client side before any proxy "
            "sees them, and the tail says more about that core than about the proxy.",
            "",
        ]
        rows = []
        series = {}
        frontier = {}
        client_busy = []
        thresholds = [1.0, 5.0, 10.0]
        for level in levels:
            lr = [r for r in runs if r.level == level]
            nginx = [r for r in lr if r.proxy == "nginx"]
            for p in self.order:
                rs = [r for r in lr if r.proxy == p]
                if not rs:
                    continue
                pr = ratios(rs, nginx, "p999")
                offered = rs[0].j.get("rate")
                # Served per second of the whole run: an overloaded proxy stretches the run
                # past its schedule (sluice-load's own req/s divides by the scheduled window).
                served = [r.mock_requests / r.wall if r.wall > 0 else None for r in rs]
                rows.append([
                    f"{level}%", p, f_int(offered), f_int(median(served)),
                    f_ms(median([r.p50 for r in rs])), f_ms(median([r.p99 for r in rs])),
                    f_ms(median([r.p999 for r in rs])), f_num(median(pr)), f_range(pr, f_num),
                    f_num(median([r.cpu_us for r in rs])),
                    f_num(median([r.core_a_busy * 100 if r.core_a_busy is not None else None
                                  for r in rs]), 0),
                    f_num(median([r.core_b_busy * 100 if r.core_b_busy is not None else None
                                  for r in rs]), 0),
                    sum(r.errors for r in rs), disturbed_cell(rs),
                ])
                p99 = median([r.p99 for r in rs])
                series.setdefault(p, []).append((offered or 0, p99))
                for thr in thresholds:
                    fr = frontier.setdefault(p, {})
                    if p99 is not None and p99 < thr and offered:
                        fr[thr] = max(fr.get(thr) or 0, offered)
                    else:
                        fr.setdefault(thr, None)
                if level == 75 and p == "sluice" and nginx:
                    v = median(pr)
                    # A client core near saturation queues requests before any proxy sees
                    # them: then the tail measures the load generator's core, not the proxy.
                    client = median([r.core_b_busy for r in rs + nginx
                                     if r.core_b_busy is not None])
                    caveat = None
                    if client is not None and client > CLIENT_BUSY_TARGET:
                        caveat = (f"the client core was {client * 100:.0f}% busy in these runs "
                                  f"(the issue asks < {CLIENT_BUSY_TARGET * 100:.0f}%), so their "
                                  "tails are partly the load generator's queueing: not "
                                  "conclusive")
                    self.targets.append((
                        "Sluice p99.9 ≤ nginx's at 75% of nginx's capacity (latency rig)", v,
                        v is not None and v <= 1.0, f_range(pr, f_num), caveat))
            # The proxies' runs only: `direct` has no proxy in the path.
            busy = median([r.core_b_busy for r in lr
                           if r.core_b_busy is not None and r.proxy != "direct"])
            if busy is not None and level <= 90:
                client_busy.append((level, busy))
            curves = {p: curve_ms(merged_hist([r for r in lr if r.proxy == p], "latency"))
                      for p in self.order}
            self.write_chart(
                f"latency-{scenario}-{level}.svg",
                percentile_chart(f"{title}: open loop at {level}% of nginx's capacity", curves),
                f"{title}, latency rig, open loop at {level}% of nginx's capacity "
                f"({f_int(lr[0].j.get('rate'))} req/s): latency by percentile, rounds merged",
            )
        if client_busy:
            level, worst = max(client_busy, key=lambda lb: lb[1])
            self.targets.append((
                f"Latency rig: client core < {CLIENT_BUSY_TARGET * 100:.0f}% busy up to 90% of "
                f"nginx's capacity (the median over the proxies' runs at the busiest level, "
                f"{level}%, as a fraction)", worst,
                worst < CLIENT_BUSY_TARGET,
                f_range([b for _, b in client_busy], f_num), None))
        text.append(table(
            ["load", "proxy", "offered req/s", "served req/s", "p50 ms", "p99 ms", "p99.9 ms",
             "p99.9 ratio to nginx", "ratio min–max", "CPU µs/req", "proxy core busy %",
             "client core busy %", "errors", "disturbed"], rows))
        text += ["", "**Throughput frontier** (from these runs): the highest offered rate whose "
                 "median p99 stayed under the limit; `–` when no tested rate did.", ""]
        frows = [[p] + [f_int(frontier[p].get(t)) for t in thresholds]
                 for p in self.order if p in frontier]
        text.append(table(["proxy"] + [f"p99 < {t:g} ms" for t in thresholds], frows))
        self.write_chart(
            f"frontier-{scenario}.svg",
            frontier_chart(f"{title}: throughput frontier (latency rig)", frontier, thresholds),
            f"{title}: highest offered req/s with p99 under 1 / 5 / 10 ms, per proxy",
        )
        self.write_chart(
            f"p99-vs-load-{scenario}.svg",
            line_chart(f"{title}: p99 latency against offered load", series,
                       "offered req/s", "p99 latency (ms, log scale)"),
            f"{title}: median p99 at each offered rate, per proxy",
        )
        return "\n".join(text)

    # -- SSE ---------------------------------------------------------------------------------

    def sse_section(self):
        runs = self.select(scenario="sse")
        if not runs:
            return None
        m = self.meta
        concs = sorted({r.conc for r in runs})
        text = [
            f"### SSE streams: {m['sse_tokens']} events {m['sse_gap_ms']} ms apart",
            "",
            f"Latency layout (proxy on core {m['core_a']}, "
            + (f"client and mock-llm on core {m['core_b']}"
               if not mock_core_apart(m)
               else f"client on core {m['core_b']}, mock-llm on core {m['core_c']}")
            + "). Each of N connections streams one completion after another "
            "(open loop, scheduled so about N streams are in flight and staggered rather than "
            f"in lockstep), {m['sse_duration']} s per run. TTFT is the time to the first "
            "content event; *added* TTFT is the proxy's p50 (p99) minus direct's in the same "
            "round, median over rounds — shown only where direct itself kept up (about N streams "
            "in flight, and its TTFT p99 within one inter-event gap): an overloaded direct path "
            "queues streams, and the difference would mean nothing. The gap is between reads "
            "that delivered content events "
            f"(ideal: {m['sse_gap_ms']} ms). Coalesced: content events that arrived in the same "
            "read as another (a buffering proxy coalesces).",
            "",
        ]
        rows = []
        for c in concs:
            cr = [r for r in runs if r.conc == c]
            direct = by_round([r for r in cr if r.proxy == "direct"])
            curves = {}
            for p in self.order:
                rs = [r for r in cr if r.proxy == p]
                if not rs:
                    continue
                fe50 = [r.j.get("first_event", {}).get("p50_ms") for r in rs]
                fe99 = [r.j.get("first_event", {}).get("p99_ms") for r in rs]
                add50, add99 = [], []
                for r in rs:
                    d = direct.get(r.round)
                    # Only against a direct run that kept up (about N streams in flight, and
                    # every first event within one gap): an overloaded direct path queues
                    # streams, and "added" TTFT would go negative.
                    kept_up = (d is not None and d.rps * d.mean_ms / 1000.0 <= 1.05 * c
                               and d.j["first_event"]["p99_ms"] <= m["sse_gap_ms"])
                    if kept_up and p != "direct":
                        add50.append(r.j["first_event"]["p50_ms"] - d.j["first_event"]["p50_ms"])
                        add99.append(r.j["first_event"]["p99_ms"] - d.j["first_event"]["p99_ms"])
                ev = sum(r.j.get("content_events", 0) for r in rs)
                co = sum(r.j.get("coalesced_events", 0) for r in rs)
                in_flight = median([r.rps * r.mean_ms / 1000.0 for r in rs])
                gap = [r.j.get("event_gap", {}) for r in rs]
                rows.append([
                    c, p, f_num(median([r.rps for r in rs]), 1), f_num(in_flight, 0),
                    f_ms(median(fe50)), f_ms(median(fe99)),
                    f_ms(median(add50)) if add50 else "–",
                    f_ms(median(add99)) if add99 else "–",
                    f_ms(median([g.get("p50_ms") for g in gap])),
                    f_ms(median([g.get("p99_ms") for g in gap])),
                    f_ms(median([g.get("p999_ms") for g in gap])),
                    f"{100.0 * co / ev:.1f}" if ev else "–",
                    f_num(median([r.cpu_us for r in rs]), 0),
                    f"{max(r.rss_mib for r in rs):.1f}",
                    sum(r.errors for r in rs), disturbed_cell(rs),
                ])
                curves[p] = curve_ms(merged_hist(rs, "event_gap"))
            self.write_chart(
                f"sse-gap-c{c}.svg",
                percentile_chart(f"SSE, {c} concurrent stream(s): gap between content events",
                                 curves, "inter-event gap (ms, log scale)"),
                f"SSE at {c} concurrent stream(s): inter-event gap by percentile, rounds merged",
            )
        text.append(table(
            ["streams", "proxy", "streams/s", "in flight", "TTFT p50 ms", "TTFT p99 ms",
             "added TTFT p50 ms", "added TTFT p99 ms", "gap p50 ms", "gap p99 ms", "gap p99.9 ms", "coalesced %",
             "CPU µs/stream", "RSS MiB", "errors", "disturbed"], rows))
        return "\n".join(text)

    # -- idle --------------------------------------------------------------------------------

    def idle_section(self):
        if not self.idle:
            return None
        m = self.meta
        rows = []
        for rec in self.idle:
            before, during = rec["rss_before_kib"] / 1024.0, rec["rss_during_kib"] / 1024.0
            held = rec.get("still_open") or 0
            per = (during - before) * 1024.0 / held if held else None
            rows.append([rec["proxy"], f"{rec.get('ready') or 0:,}", f"{held:,}",
                         f"{before:.1f}", f"{during:.1f}", f_num(per, 2)])
        notes = [f"- {rec['proxy']}: {rec['note']}." for rec in self.idle if rec.get("note")]
        return "\n".join([
            f"### {m['idle_conns']:,} idle keep-alive connections",
            "",
            f"`sluice-probe idle` (on core {m['core_b']}) opens the connections, sends one "
            f"`GET /v1/models` on each, reads the answer and holds them idle for "
            f"{m['idle_hold']} s; the proxy's VmRSS is read before and while they are held. "
            "Measured once, after the other scenarios ran on the same processes.",
            "",
            table(["proxy", "opened", "still open at the end", "RSS before MiB",
                   "RSS with the connections MiB", "KiB per connection"], rows),
        ] + ([""] + notes if notes else []))

    # -- whole -------------------------------------------------------------------------------

    def render(self):
        m = self.meta
        sections = []
        for s in (self.cost_section("small", f"small chat request ({m['small_bytes']:,} B)"),
                  self.cost_section("large", f"large prompt ({m['large_bytes']:,} B)"),
                  self.latency_section("small", f"small chat request ({m['small_bytes']:,} B)"),
                  self.latency_section("large", f"large prompt ({m['large_bytes']:,} B)"),
                  self.sse_section(),
                  self.idle_section()):
            if s:
                sections.append(s)
        v = m["versions"]
        notes = m.get("notes", {})
        peers = []
        for p in m["all_proxies"]:
            ver = {"nginx": v.get("nginx"), "haproxy": v.get("haproxy"),
                   "monolake": v.get("monolake"), "sluice": v.get("sluice"),
                   "sluice-ai": v.get("sluice"), "direct": "mock-llm"}.get(p)
            if p in notes:
                peers.append(f"- **{p}**: {notes[p]}")
            elif p in self.order:
                peers.append(f"- **{p}**: {ver or 'ran'} — {m['setups'].get(p, '')}")
        head = [
            BEGIN,
            "## Side-by-side comparison (`bench/compare.sh`)",
            "",
            "Written by `bench/compare.sh`; everything between the `bench.sh` markers is replaced "
            "on each run.",
            "",
            f"**Command:** `{m['command']}`" + (" — **quick smoke run: tiny durations, one round; "
                                                  "the numbers prove the kit works, nothing "
                                                  "more.**" if m["quick"] else ""),
            "",
            f"**Machine:** {m['cpu_model']}, {m['cpus']} CPU(s) online, {m['mem_gib']:.0f} GiB; "
            f"kernel {m['kernel']}; cores used: {m['core_a']} (proxy) and {m['core_b']}"
            + (f", and {m['core_c']} (mock-llm in the latency rig)"
               if mock_core_apart(m) else "")
            + ". "
            f"**Date:** {m['date']}. **Sluice:** `{v.get('sluice')}` ({m['build']} build, "
            f"{v.get('rustc')}). **Versions:** {v.get('nginx')}, {v.get('haproxy')}, "
            f"{v.get('monolake') or 'monolake not run'}, {v.get('redis')}.",
            "",
            "**Peers** (one worker each, upstream keep-alive, no access log, no response "
            "buffering, all proxying to the same mock-llm):",
            "",
            "\n".join(peers),
            "",
            f"A run is flagged *disturbed* when a core that should have been idle was more than "
            f"{m['idle_max_pct']}% busy (cost rig: core {m['core_b']}; latency rig: work on core "
            f"{m['core_a']} other than the proxy's own CPU time), from /proc/stat deltas.",
        ]
        if m["build"] != "release":
            head += ["", f"**These binaries are a {m['build']} build: not comparable with "
                         "release figures.**"]
        out = head + [""]
        if self.targets:
            out += ["### Issue #15's targets", ""]
            rows = []
            # (name, median ratio, met, min–max, caveat or None)
            for name, v, ok, rng, caveat in self.targets:
                verdict = "met" if ok else "**not met**"
                if caveat:
                    verdict += f" ({caveat})"
                rows.append([name, f_num(v), rng, verdict])
            out += [table(["target", "measured (median ratio)", "min–max", ""], rows), ""]
        for s in sections:
            out += [s, ""]
        if self.chart_files:
            out += ["### Charts", ""]
            for name, caption in self.chart_files:
                out += [f"- {caption}: [`{name}`]({m['charts_rel']}/{name})"]
            out += ["", f"![latency by percentile]({m['charts_rel']}/{self.headline_chart()})", ""]
        disturbed = [r for r in self.runs if r.disturbed]
        if disturbed:
            out += [f"### Disturbed runs ({len(disturbed)} of {len(self.runs)})", ""]
            out += [f"- `{r.id}`: {r.disturbed}" for r in disturbed[:40]]
            if len(disturbed) > 40:
                out.append(f"- … and {len(disturbed) - 40} more (see {m['raw_rel']}/runs.jsonl)")
            out.append("")
        out += [f"Raw data in `{m['raw_rel']}/`: one sluice-load JSON (with full HDR histograms) "
                "per run, `runs.jsonl` (the /proc snapshots around each run), and `setup/` (every "
                "config the kit wrote, and each server's output).", END]
        return "\n".join(out) + "\n"

    def headline_chart(self):
        names = [n for n, _ in self.chart_files]
        for pref in ("latency-small-75.svg", "frontier-small.svg", "cost-small-latency.svg"):
            if pref in names:
                return pref
        return names[0]


def replace_block(path, block):
    old = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    if BEGIN in old and END in old:
        a = old.index(BEGIN)
        b = old.index(END) + len(END)
        new = old[:a] + block.rstrip("\n") + old[b:]
    elif old:
        new = old.rstrip("\n") + "\n\n" + block
    else:
        new = "# Benchmark results\n\n" + block
    with open(path, "w") as f:
        f.write(new)


def main(argv):
    if len(argv) >= 2 and argv[1] == "capacity":
        rates = []
        for p in argv[2:]:
            with open(p) as f:
                rates.append(json.load(f)["rps"])
        if not rates:
            sys.exit("capacity: no runs")
        print(int(statistics.median(rates)))
        return
    if len(argv) >= 2 and argv[1] == "report":
        args = dict(zip(argv[2::2], argv[3::2]))
        try:
            raw, results, charts = args["--raw"], args["--results"], args["--charts"]
        except KeyError:
            sys.exit(__doc__)
        rep = Report(raw, charts)
        block = rep.render()
        replace_block(results, block)
        print(f"wrote {results} and {len(rep.chart_files)} chart(s) in {charts}")
        return
    sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)

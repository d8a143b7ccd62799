"""The measure diagnostic's two plots, rendered to PNG bytes (so their citations are digests of what is written):

- durations.png: each launch's kernel time over the window (every launch as a dot up to 20,000 launches; past that
  the median, p10-p90 and min-max of 1,000 time slices), the ledger row's time when one was compared, and below
  it the share of each time slice the GPU spent idle between launches: host dispatch slower than the kernel shows
  there as idle time, which a graph removes.
- telemetry.png: power (with the power limit), SM and memory clocks, temperature, and when each clock-event
  reason held.

matplotlib (and numpy, which it needs) is imported here only; an ImportError tells the caller to skip the plots.
"""

from __future__ import annotations

import io

__all__ = ["render"]

SCATTER_MAX = 20_000
SLICES = 1000
BUSY_SLICES = 200


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def render(window, summary: dict) -> dict[str, bytes]:
    """{"durations.png": bytes, "telemetry.png": bytes}; raises ImportError without matplotlib."""
    plt = _pyplot()
    import numpy as np

    return {"durations.png": _durations(plt, np, window, summary),
            "telemetry.png": _telemetry(plt, np, window, summary)}


def _title(summary: dict) -> str:
    spec = ", ".join(f"{k}={v}" for k, v in (summary.get("spec") or {}).items())
    mode = summary.get("mode") or {}
    how = f"L2 {mode.get('l2', '?')}, {'graph' if mode.get('graph') else 'eager'}"
    return f"{summary.get('table')}/{summary.get('backend')} on {summary.get('gpu_name')}: {spec}\n{how}"


def _png(plt, fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _slices(np, t, v, n_slices: int, span: float):
    """Per time slice: centre, and the min, p10, median, p90, max of the values starting in it (NaN when empty)."""
    edges = np.linspace(0.0, span, n_slices + 1)
    which = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, n_slices - 1)
    order = np.argsort(which, kind="stable")
    which, v = which[order], v[order]
    bounds = np.searchsorted(which, np.arange(n_slices + 1))
    out = np.full((5, n_slices), np.nan)
    for i in range(n_slices):
        part = v[bounds[i]:bounds[i + 1]]
        if part.size:
            out[:, i] = np.percentile(part, [0, 10, 50, 90, 100])
    return (edges[:-1] + edges[1:]) / 2, out


def _durations(plt, np, window, summary: dict) -> bytes:
    la = window.launches
    t = np.frombuffer(la.start, dtype=np.int64) / 1e9
    d = np.frombuffer(la.duration, dtype=np.int64) / 1e3
    idle = np.frombuffer(la.idle_before, dtype=np.int64) / 1e9
    span = max(window.span_s, float(t[-1]) if t.size else 0.0, 1e-9)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5), dpi=110,
                                      gridspec_kw={"height_ratios": [3, 1.2]})
    if t.size <= SCATTER_MAX:
        top.plot(t, d, ".", ms=2, alpha=0.5, color="tab:blue", label=f"each launch ({t.size})")
        if t.size >= 50:
            x, q = _slices(np, t, d, min(100, t.size // 10), span)
            top.plot(x, q[2], color="tab:red", lw=1.2, label="median of each slice")
    else:
        x, q = _slices(np, t, d, SLICES, span)
        top.fill_between(x, q[0], q[4], color="tab:blue", alpha=0.12, lw=0, label="min-max")
        top.fill_between(x, q[1], q[3], color="tab:blue", alpha=0.35, lw=0, label="p10-p90")
        top.plot(x, q[2], color="tab:red", lw=1, label=f"median ({t.size} launches, {SLICES} slices)")
    stats = summary.get("launch_us") or {}
    if d.size:
        lo, hi = np.percentile(d, [0.1, 99.9])
        pad = max((hi - lo) * 0.1, hi * 0.01)
        top.set_ylim(max(0.0, lo - pad), hi + pad)
    row = summary.get("ledger") or {}
    if row.get("compared") and row.get("time_ms") is not None:
        top.axhline(row["time_ms"] * 1e3, color="k", ls="--", lw=1, label=f"ledger row {row.get('citation')}")
    top.set_ylabel("kernel time per launch (µs)")
    drift = summary.get("drift") or {}
    if stats.get("median") is not None:
        pct = drift.get("pct")
        top.set_title(_title(summary) + f"\nmedian {stats['median']:.3f} µs, p10-p90 {stats['p10']:.3f}-"
                      f"{stats['p90']:.3f} µs" + (f", drift {pct:+.2f} % (last vs first 10 %)" if pct is not None
                                                   else ""), fontsize=9)
    top.legend(fontsize=7, loc="upper right")
    top.grid(alpha=0.3)

    # GPU idle share per slice, from the idle time before each launch
    edges = np.linspace(0.0, span, BUSY_SLICES + 1)
    which = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, BUSY_SLICES - 1)
    idle_per = np.bincount(which, weights=idle, minlength=BUSY_SLICES)
    width = span / BUSY_SLICES
    centres = (edges[:-1] + edges[1:]) / 2
    bottom.fill_between(centres, 0, np.clip(100 * idle_per / width, 0, 100), step="mid", color="tab:gray",
                        alpha=0.6, label="GPU idle between launches")
    bottom.set_ylim(0, 100)
    bottom.set_ylabel("idle (% of time)")
    bottom.set_xlabel("window time (s)")
    gpu = summary.get("gpu") or {}
    if gpu.get("busy_pct") is not None:
        bottom.set_title(f"GPU busy {gpu['busy_pct']:.1f} % of the window, timed kernels {gpu['timed_pct']:.1f} %",
                         fontsize=8)
    bottom.legend(fontsize=7, loc="upper right")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    return _png(plt, fig)


def _series(np, samples, name: str):
    pts = [(s.t, getattr(s, name)) for s in samples if getattr(s, name) is not None]
    if not pts:
        return np.array([]), np.array([])
    a = np.array(pts, dtype=float)
    return a[:, 0], a[:, 1]


def _unread(ax, samples, errors: dict, *names: str) -> None:
    """Where NVML gave readings but none of `names` (a field this GPU or driver does not report), says so on the
    panel, with NVML's reason: its empty axes read as a clock or power of zero."""
    missing = [n for n in names if samples and all(getattr(s, n) is None for s in samples)]
    if missing:
        why = "; ".join(f"{n}: {errors[n]}" for n in missing if errors.get(n))
        ax.text(0.5, 0.5, f"NVML gave no {', '.join(missing)} reading" + (f"\n{why}" if why else ""), ha="center",
                va="center", transform=ax.transAxes, fontsize=8, bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})


def _telemetry(plt, np, window, summary: dict) -> bytes:
    samples = sorted(window.samples, key=lambda s: s.t)
    errors = window.telemetry_errors or {}
    span = max(window.span_s, 1e-9)
    fig, (p_ax, c_ax, r_ax) = plt.subplots(3, 1, sharex=True, figsize=(10, 8), dpi=110,
                                           gridspec_kw={"height_ratios": [2, 2, 1.4]})
    if not samples:
        p_ax.text(0.5, 0.5, "telemetry was off or NVML gave no reading", ha="center", va="center",
                  transform=p_ax.transAxes)
    t, w = _series(np, samples, "power_w")
    p_ax.plot(t, w, color="tab:red", lw=1, label="power (W)")
    limit = (summary.get("device") or {}).get("power_limit_w")
    if limit:
        p_ax.axhline(limit, color="k", ls="--", lw=1, label=f"power limit {limit:.0f} W")
    p_ax.set_ylabel("power (W)")
    _unread(p_ax, samples, errors, "power_w")
    energy = summary.get("energy") or {}
    title = _title(summary)
    if energy.get("j_per_launch") is not None:
        title += f"\n{energy['j_per_launch'] * 1e3:.4g} mJ per launch, {energy['power_w']:.0f} W mean (energy counter)"
    p_ax.set_title(title, fontsize=9)
    p_ax.legend(fontsize=7, loc="lower right")
    p_ax.grid(alpha=0.3)

    t, sm = _series(np, samples, "sm_mhz")
    c_ax.plot(t, sm, color="tab:blue", lw=1, label="SM clock (MHz)")
    c_ax.set_ylabel("SM clock (MHz)")
    mem_ax = c_ax.twinx()
    t, mem = _series(np, samples, "mem_mhz")
    mem_ax.plot(t, mem, color="tab:green", lw=1, label="memory clock (MHz)")
    mem_ax.set_ylabel("memory clock (MHz)")
    _unread(c_ax, samples, errors, "sm_mhz", "mem_mhz")
    lines = c_ax.get_lines() + mem_ax.get_lines()
    c_ax.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="lower right")
    c_ax.grid(alpha=0.3)

    t, temp = _series(np, samples, "temp_c")
    r_ax.plot(t, temp, color="k", lw=1, label="temperature (°C)")
    r_ax.set_ylabel("temperature (°C)")
    _unread(r_ax, samples, errors, "temp_c")
    strip = r_ax.twinx()
    held = _held_reasons(samples, span)
    for row, (label, spans) in enumerate(sorted(held.items())):
        strip.broken_barh(spans, (row + 0.1, 0.8), color=f"C{(row + 2) % 10}", alpha=0.6, lw=0)
    strip.set_yticks([row + 0.5 for row in range(len(held))], sorted(held), fontsize=7)
    strip.set_ylim(0, max(1, len(held)))
    r_ax.set_xlabel("window time (s)")
    r_ax.set_xlim(min(0.0, samples[0].t) if samples else 0.0, span)
    r_ax.legend(fontsize=7, loc="lower left")
    r_ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(plt, fig)


def _held_reasons(samples, span: float) -> dict[str, list[tuple[float, float]]]:
    """{reason label: [(start, width), ...]}: each reading's reasons held until the next reading ("unread" where
    NVML refused them, as the summary's throttle time counts it)."""
    from ._diagnostic_telemetry import reason_labels

    out: dict[str, list[tuple[float, float]]] = {}
    for i, s in enumerate(samples):
        end = samples[i + 1].t if i + 1 < len(samples) else span
        if end <= s.t:
            continue
        for label in reason_labels(s.reasons):
            spans = out.setdefault(label, [])
            if spans and abs(spans[-1][0] + spans[-1][1] - s.t) < 1e-9:  # continues the last span: one bar
                spans[-1] = (spans[-1][0], end - spans[-1][0])
            else:
                spans.append((s.t, end - s.t))
    return out

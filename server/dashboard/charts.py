"""Server-side SVG line charts: no JavaScript chart library, no CDN, readable without scripts."""

from __future__ import annotations

from html import escape


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], y_label: str, width: int = 560, height: int = 240,
               y_max: float | None = None, reference: float | None = None) -> str:
    points = [p for s in series.values() for p in s]
    if not points:
        return f'<figure class="chart"><figcaption>{escape(title)}</figcaption><p class="muted">no data yet</p></figure>'
    pad_l, pad_r, pad_t, pad_b = 48, 16, 12, 32
    xs = [x for x, _ in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    top = y_max if y_max is not None else max(max(y for _, y in points), reference or 0) * 1.1 or 1.0
    sx = lambda x: pad_l + (x - x0) / (x1 - x0) * (width - pad_l - pad_r)  # noqa: E731
    sy = lambda y: height - pad_b - (y / top) * (height - pad_t - pad_b)  # noqa: E731
    colors = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4d7c0f", "#be185d"]
    parts = [f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}" data-chart="{escape(title)}">',
             f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width - pad_r}" y2="{height - pad_b}" stroke="#999"/>',
             f'<line x1="{pad_l}" y1="{pad_t}" x2="{pad_l}" y2="{height - pad_b}" stroke="#999"/>']
    for frac in (0.0, 0.5, 1.0):
        y = top * frac
        parts.append(f'<text x="{pad_l - 6}" y="{sy(y) + 4:.1f}" text-anchor="end" font-size="11">{y:.2f}</text>')
    for x in sorted(set(xs)):
        parts.append(f'<text x="{sx(x):.1f}" y="{height - pad_b + 16}" text-anchor="middle" font-size="11">{x:g}</text>')
    if reference is not None:
        parts.append(f'<line x1="{pad_l}" y1="{sy(reference):.1f}" x2="{width - pad_r}" y2="{sy(reference):.1f}" stroke="#f59e0b" '
                     f'stroke-dasharray="4 3"/><text x="{width - pad_r}" y="{sy(reference) - 4:.1f}" text-anchor="end" font-size="11">limit</text>')
    for i, (name, pts) in enumerate(sorted(series.items())):
        color = colors[i % len(colors)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(pts))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{path}"/>')
        for x, y in pts:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}" data-series="{escape(name)}" data-x="{x:g}" '
                         f'data-y="{y:.4f}"><title>{escape(name)} round {x:g}: {y:.4f}</title></circle>')
    parts.append("</svg>")
    legend = "".join(f'<span style="color:{colors[i % len(colors)]}">● {escape(n)}</span> ' for i, n in enumerate(sorted(series)))
    return f'<figure class="chart"><figcaption>{escape(title)} <small>({escape(y_label)})</small></figcaption>{"".join(parts)}<div>{legend}</div></figure>'

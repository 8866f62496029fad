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
    sx = lambda x: pad_l + (x - x0) / (x1 - x0) * (width - pad_l - pad_r)
    sy = lambda y: height - pad_b - (y / top) * (height - pad_t - pad_b)
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


def heatmap(title: str, matrix: list[list[int]], classes: list[str], cell: int = 44) -> str:
    """A confusion matrix as an SVG heatmap: rows are the true class, columns the predicted one; each row shaded by its share."""
    if not matrix:
        return f'<figure class="chart"><figcaption>{escape(title)}</figcaption><p class="muted">no evaluation yet</p></figure>'
    k = len(classes)
    pad_l, pad_t = 96, 64
    width, height = pad_l + k * cell + 8, pad_t + k * cell + 8
    parts = [f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}" data-chart="{escape(title)}" class="heatmap">']
    for j, name in enumerate(classes):
        x = pad_l + j * cell + cell / 2
        parts.append(f'<text x="{x:.1f}" y="{pad_t - 8}" text-anchor="start" font-size="11" transform="rotate(-40 {x:.1f} {pad_t - 8})">'
                     f'{escape(name)}</text>')
    for i, name in enumerate(classes):
        row = matrix[i]
        total = sum(row) or 1
        parts.append(f'<text x="{pad_l - 6}" y="{pad_t + i * cell + cell / 2 + 4:.1f}" text-anchor="end" font-size="11">{escape(name)}</text>')
        for j, count in enumerate(row):
            share = count / total
            fill = f"rgba(37,99,235,{0.08 + 0.9 * share:.3f})" if i == j else f"rgba(220,38,38,{0.06 + 0.9 * share:.3f})" if count else "#f8fafc"
            parts.append(f'<rect x="{pad_l + j * cell}" y="{pad_t + i * cell}" width="{cell - 2}" height="{cell - 2}" fill="{fill}" '
                         f'data-true="{escape(name)}" data-predicted="{escape(classes[j])}" data-count="{count}">'
                         f'<title>{escape(name)} predicted as {escape(classes[j])}: {count}</title></rect>')
            parts.append(f'<text x="{pad_l + j * cell + (cell - 2) / 2:.1f}" y="{pad_t + i * cell + cell / 2 + 3:.1f}" text-anchor="middle" '
                         f'font-size="11">{count}</text>')
    parts.append("</svg>")
    return (f'<figure class="chart"><figcaption>{escape(title)} <small>(rows: true class, columns: predicted)</small></figcaption>'
            f'{"".join(parts)}</figure>')

"""The timeline as one self-contained HTML file: the page, its CSS and JS, and the data.

Nothing is fetched when the page opens (no network, no server; it works from
file://). The data rides in two `<script>` blocks that the browser does not run:

- `yb-data`: the lanes and rows as JSON, read at once to draw the first frame;
- `yb-decisions`: every request's decision text (and the what-if's), gzip-compressed
  and base64-encoded. It is the bulk of a big report (about 1.5 KB of text per
  request before compression), and only a click needs it, so the page inflates it
  with the browser's own `DecompressionStream` after the first frame.
"""

from __future__ import annotations

import base64
import gzip
import html
from importlib import resources
from pathlib import Path

import msgspec

from yb_tools.timeline.model import Timeline

_ASSETS = resources.files("yb_tools.timeline")


def _asset(name: str) -> str:
    return _ASSETS.joinpath(name).read_text(encoding="utf-8")


def _script_safe(data: bytes) -> str:
    # JSON has `<` only inside strings, where `\u003c` means the same: no `</script>`
    # or `<!--` can end or confuse the block.
    return data.decode("utf-8").replace("<", "\\u003c")


def render_page(timeline: Timeline) -> str:
    """The report's HTML text."""
    data = msgspec.json.encode(
        msgspec.structs.replace(timeline, decisions=[], what_if_decisions=[])
    )
    texts = msgspec.json.encode([timeline.decisions, timeline.what_if_decisions])
    # mtime=0: the same log gives the same file, byte for byte.
    packed = base64.b64encode(gzip.compress(texts, compresslevel=6, mtime=0)).decode("ascii")
    page = _asset("page.html")
    for key, value in (
        ("{{TITLE}}", html.escape(timeline.meta.title)),
        ("{{CSS}}", _asset("timeline.css")),
        ("{{DATA}}", _script_safe(data)),
        ("{{DECISIONS}}", packed),
        ("{{JS}}", _asset("timeline.js")),
    ):
        page = page.replace(key, value, 1)
    return page


def write_page(timeline: Timeline, path: str | Path) -> Path:
    """Write the report to `path` (its folder is created); the path written."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_page(timeline), encoding="utf-8")
    return out

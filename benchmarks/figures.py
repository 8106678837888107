"""How a benchmark hands over its figures: a two-column table on stdout, and the flat
JSON object that benchmarks/record.py reads (`--json PATH`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def emit(figures: Mapping[str, Any], json_path: Path | None, *, decimals: int = 2) -> None:
    """Print every figure, floats with `decimals` places, and write them all to
    `json_path` when given."""
    width = max(len(k) for k in figures)
    for key, value in figures.items():
        shown = f"{value:,.{decimals}f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown:>16}")
    if json_path:
        json_path.write_text(json.dumps(figures, indent=2) + "\n")

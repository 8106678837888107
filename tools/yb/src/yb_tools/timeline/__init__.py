"""The scheduling timeline: one self-contained HTML report of a window of the log.

`yb replay --report` and `yb sim --report` both call `write_report`; `model` extracts
what the lanes show from the log, `page` renders the file (its CSS and JS are the
`timeline.*` files beside it).
"""

from yb_tools.timeline.report import write_report

__all__ = ["write_report"]

"""Pictures: loss curves, attention heat maps. Uses matplotlib's file backend (no screen).

:func:`write_html` writes the interactive attention report, one self-contained HTML file
(docs/report.md).
"""

from dikkat.viz.report import write_html

__all__ = ["write_html"]

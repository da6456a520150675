"""``kvlab report``: the figures for one team's model on one GPU (``build``), and the page they make (``render``).
Torch-free unless the report measures this machine's own sweep."""

from kvlab.report.build import DEFAULT_CONTEXT, build_report, quality_table, write_quality_table
from kvlab.report.render import summary_lines, write_report

__all__ = ["DEFAULT_CONTEXT", "build_report", "quality_table", "summary_lines", "write_quality_table", "write_report"]

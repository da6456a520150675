"""kvlab.report.build."""

"""kvlab.measure."""

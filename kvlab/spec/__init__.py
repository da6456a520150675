"""kvlab.spec."""

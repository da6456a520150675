"""kvlab.machine."""

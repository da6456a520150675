"""kvlab.serving."""

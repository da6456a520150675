"""kvlab.engine.engine."""

"""kvlab.model.decoder."""

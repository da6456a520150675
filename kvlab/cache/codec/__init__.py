"""kvlab.cache.codec."""

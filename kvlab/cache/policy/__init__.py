"""kvlab.cache.policy."""

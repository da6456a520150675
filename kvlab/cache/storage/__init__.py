"""kvlab.cache.storage."""

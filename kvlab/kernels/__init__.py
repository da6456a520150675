"""kvlab.kernels.reference."""

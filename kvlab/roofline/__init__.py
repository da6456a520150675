"""kvlab.roofline.bytes."""

"""Data shipped inside the package: the reference presets and their sources, the published decode and speculative
measurements, the quality table, and the small checkpoints with their training records and held-out text."""

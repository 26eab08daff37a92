"""Kernel I/O: cgroupfs files, /proc, pure parsers. Knows nothing of tasks or turns."""

"""Backend `tensorcore`: sparse convolution on tensor cores over kept units (format.py, kernel.py)."""

"""Backend `im2col`: see `backend.py`."""

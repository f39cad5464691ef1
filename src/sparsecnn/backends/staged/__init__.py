"""Backend `staged`: see `backend.py`."""

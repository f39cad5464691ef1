"""Real data available offline: scikit-learn's handwritten digits, shaped for our small models."""
from sparsecnn.data.digits import DigitsSplit, Batches, load_digits_split

__all__ = ["Batches", "DigitsSplit", "load_digits_split"]

"""Real data available offline: scikit-learn's handwritten digits, shaped for our small models; image
folders and CIFAR-10 on disk in torchvision's formats."""
from sparsecnn.data.digits import DigitsSplit, Batches, load_digits_split
from sparsecnn.data.folders import ImageFolder, image_folder_splits, load_cifar10

__all__ = ["Batches", "DigitsSplit", "ImageFolder", "image_folder_splits", "load_cifar10", "load_digits_split"]

"""torch.fx passes that simplify an inference graph before tuning: `prepare_for_inference`."""
from sparsecnn.passes.fuse import FuseReport, fold_batchnorm, prepare_for_inference

__all__ = ["FuseReport", "fold_batchnorm", "prepare_for_inference"]

"""Compiled artefacts: a tuned model saved as a directory that loads without re-tuning.

`compile_model(model, checkpoint, input_shape, dtype, backends, out_dir)` tunes a pruned model for
one input shape and writes OUT/: `manifest.json` (format version, environment fingerprint, model
name, input shape, precision policy, per-layer decisions with their timings, the fuse report, every
file's sha256), `weights.safetensors` or `weights.pt` (masked weights, masks, biases, the other
parameters, and the packed sparse formats: repacking OptPrune blocks or ELL/CSR costs seconds per
model, so they are stored) and `codegen/` (the kernels of `codegen` layers). `load(OUT)` rebuilds
it on the same kind of device without timing anything, never unpickling; elsewhere it re-tunes and
warns why. Writes are atomic (temporary directory, then rename).
"""
from sparsecnn.artifact.compiling import compile_model, load_checkpoint
from sparsecnn.artifact.errors import ArtifactError
from sparsecnn.artifact.loading import load
from sparsecnn.artifact.manifest import FORMAT, VERSION

__all__ = ["ArtifactError", "FORMAT", "VERSION", "compile_model", "load", "load_checkpoint"]

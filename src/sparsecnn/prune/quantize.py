"""UnSparse-Opt quantisation (paper 003, Sec. 4): linear fixed point, fp16, k-means codebook.

Every scheme quantises the weights of all Conv1d/Conv2d/Linear layers of a deep copy of the model
(biases stay float32, as an accumulator would hold them) and returns that copy with a
`QuantizationReport`. Zero weights stay exactly zero, so a pruned model keeps its masks. Activation
rounding is done by forward hooks on the copy (picklable objects, so the copy can be saved); the
copy stays float32 and runs on any device, its values lying on the quantised grid.

- Fixed point (eq. 19-21): q = step * round(x / step), step = 2^-frac_bits, with
  int_bits = ceil(log2(max |x|)) and frac_bits = total_bits - int_bits - 1 (one sign bit), values
  saturated to the signed range. Weights take int_bits from their own max |w|; each layer's input
  takes the int_bits that minimise the squared error (saturation + rounding) estimated from a
  histogram of that input over calibration data (the paper's histogram analysis of saturation).
- fp16: weights, biases, layer inputs and outputs rounded through half; products accumulate in
  float32, as on tensor cores.
- k-means codebook (Algorithm 3): the non-zero weights of each layer are clustered into
  `centroids` values (1-D Lloyd iterations from linearly spaced centroids); the centroids are then
  stored in `centroid_bits` = 8 (fixed point, eq. 20-21) or 16 (fp16). Zeros are not clustered:
  a sparse format stores them by position, so the codebook indexes only non-zero weights.

`QUANTIZERS` maps a scheme name to fn(model, calibration_x) -> (quantised copy, report), with
calibration_x a float tensor of inputs shaped like the model's (N, C, H, W) (used by fixed point).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from sparsecnn.prune.magnitude import prunable_layers

_HISTOGRAM_BINS = 2048
# How far below ceil(log2(max |a|)) the activation int_bits search goes (2^-8 of the max).
_SATURATION_SEARCH = 8


@dataclasses.dataclass(frozen=True)
class FixedPointFormat:
    """Signed fixed point with `total_bits` (one of them the sign) and `int_bits` integer bits
    (negative when every value is below 1/2): step 2^-(total_bits - int_bits - 1)."""

    total_bits: int
    int_bits: int

    def __post_init__(self):
        _check_bits("total_bits", self.total_bits)

    @property
    def frac_bits(self) -> int:
        return self.total_bits - self.int_bits - 1

    @property
    def step(self) -> float:
        return 2.0 ** -self.frac_bits

    @property
    def low(self) -> float:
        return -(2 ** (self.total_bits - 1)) * self.step

    @property
    def high(self) -> float:
        return (2 ** (self.total_bits - 1) - 1) * self.step

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """`x` rounded to the grid (half to even) and saturated to [low, high]; same dtype."""
        levels = 2 ** (self.total_bits - 1)
        return torch.clamp(torch.round(x / self.step), -levels, levels - 1) * self.step

    def describe(self) -> str:
        return f"Q{self.int_bits}.{self.frac_bits}"


def fixed_point_format(max_abs: float, total_bits: int) -> FixedPointFormat:
    """Eq. 20-21: int_bits = ceil(log2(max_abs)) (0 when max_abs is 0)."""
    _check_bits("total_bits", total_bits)
    if not max_abs >= 0:
        raise ValueError(f"max_abs must be >= 0, got {max_abs!r}")
    return FixedPointFormat(total_bits, math.ceil(math.log2(max_abs)) if max_abs > 0 else 0)


@dataclasses.dataclass(frozen=True)
class LayerQuantization:
    """One layer's result: `weight_bits` per stored weight (codebook index bits for k-means),
    `distinct_values` non-zero weight values, `max_abs_error` = max |w_q - w|, and `detail`
    (formats, e.g. "weights Q-2.9, inputs Q2.5")."""

    name: str
    weight_bits: int
    distinct_values: int
    max_abs_error: float
    detail: str


@dataclasses.dataclass(frozen=True)
class QuantizationReport:
    scheme: str
    layers: Tuple[LayerQuantization, ...]

    def format(self) -> str:
        """A plain-text table, one row per layer."""
        lines = [f"{self.scheme}: layer, bits, distinct non-zero values, max |error|, formats"]
        lines += [f"  {layer.name:<12} {layer.weight_bits:>3} {layer.distinct_values:>8} "
                  f"{layer.max_abs_error:10.3g}  {layer.detail}" for layer in self.layers]
        return "\n".join(lines)


class RoundInput:
    """Forward pre-hook: the module's first input rounded to a fixed-point format."""

    def __init__(self, fmt: FixedPointFormat):
        self.fmt = fmt

    def __call__(self, module: nn.Module, inputs: Tuple[torch.Tensor, ...]):
        return (self.fmt.quantize(inputs[0]),) + tuple(inputs[1:])


class RoundInputToHalf:
    """Forward pre-hook: the module's first input rounded through float16."""

    def __call__(self, module: nn.Module, inputs: Tuple[torch.Tensor, ...]):
        return (_through_half(inputs[0]),) + tuple(inputs[1:])


class RoundOutputToHalf:
    """Forward hook: the module's output rounded through float16."""

    def __call__(self, module: nn.Module, inputs: Tuple[torch.Tensor, ...], output: torch.Tensor):
        return _through_half(output)


def quantize_fixed_point(model: nn.Module, calibration_x: torch.Tensor, bits: int = 8,
                         activation_bits: int | None = None) -> Tuple[nn.Module, QuantizationReport]:
    """Copy of `model` with `bits`-bit fixed-point weights and `activation_bits`-bit (default: `bits`)
    fixed-point layer inputs, their saturation chosen on `calibration_x` (inputs of the model,
    on its device)."""
    _check_bits("bits", bits)
    activation_bits = bits if activation_bits is None else activation_bits
    _check_bits("activation_bits", activation_bits)
    quantized = copy.deepcopy(model)
    input_formats = calibrate_input_formats(quantized, calibration_x, activation_bits)
    rows = []
    for name, module in _quantized_layers(quantized):
        original = module.weight.detach().clone()
        fmt = fixed_point_format(original.abs().max().item(), bits)
        with torch.no_grad():
            module.weight.copy_(fmt.quantize(original))
        module.register_forward_pre_hook(RoundInput(input_formats[name]))
        rows.append(_row(name, bits, original, module.weight,
                         f"weights {fmt.describe()}, inputs {input_formats[name].describe()}"))
    return quantized, QuantizationReport(f"fixed point {bits}/{activation_bits} bits", tuple(rows))


def quantize_fp16(model: nn.Module) -> Tuple[nn.Module, QuantizationReport]:
    """Copy of `model` whose layer weights, biases, inputs and outputs are rounded through float16."""
    quantized = copy.deepcopy(model)
    rows = []
    for name, module in _quantized_layers(quantized):
        original = module.weight.detach().clone()
        with torch.no_grad():
            module.weight.copy_(_through_half(original))
            if module.bias is not None:
                module.bias.copy_(_through_half(module.bias))
        module.register_forward_pre_hook(RoundInputToHalf())
        module.register_forward_hook(RoundOutputToHalf())
        rows.append(_row(name, 16, original, module.weight, "fp16 weights, inputs and outputs"))
    return quantized, QuantizationReport("fp16", tuple(rows))


def quantize_kmeans(model: nn.Module, centroids: int = 16, centroid_bits: int = 8,
                    iterations: int = 50) -> Tuple[nn.Module, QuantizationReport]:
    """Copy of `model` whose non-zero weights of each layer are replaced by the nearest of
    `centroids` k-means centroids, each stored in `centroid_bits` (8: fixed point, 16: fp16)."""
    if not isinstance(centroids, int) or centroids < 2:
        raise ValueError(f"centroids must be an int >= 2, got {centroids!r}")
    if centroid_bits not in (8, 16):
        raise ValueError(f"centroid_bits must be 8 (fixed point) or 16 (fp16), got {centroid_bits!r}")
    index_bits = math.ceil(math.log2(centroids))
    quantized = copy.deepcopy(model)
    rows = []
    for name, module in _quantized_layers(quantized):
        original = module.weight.detach().clone()
        nonzero = original != 0
        codebook, assignment = kmeans_1d(original[nonzero].float(), centroids, iterations)
        codebook, detail = _store_centroids(codebook, centroid_bits)
        with torch.no_grad():
            module.weight[nonzero] = codebook[assignment].to(module.weight.dtype)
        rows.append(_row(name, index_bits, original, module.weight, detail))
    scheme = f"k-means {centroids} centroids, {centroid_bits}-bit centroids"
    return quantized, QuantizationReport(scheme, tuple(rows))


def kmeans_1d(values: torch.Tensor, clusters: int, iterations: int = 50) -> Tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means on 1-D float `values` (n,): returns (centroids (clusters,) ascending,
    assignment (n,) int64 index of each value's nearest centroid). Centroids start linearly spaced
    between min and max (the initialisation Deep Compression found best for weights); an empty
    cluster moves to the value farthest from its centroid, one per iteration."""
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D, got shape {tuple(values.shape)}")
    if clusters < 1:
        raise ValueError(f"clusters must be >= 1, got {clusters}")
    if values.numel() == 0:
        return torch.zeros(clusters, dtype=values.dtype, device=values.device), values.new_zeros(0, dtype=torch.int64)
    centroids = torch.linspace(values.min().item(), values.max().item(), clusters,
                               dtype=values.dtype, device=values.device)
    assignment = _nearest(values, centroids)
    for _ in range(iterations):
        counts = torch.bincount(assignment, minlength=clusters).to(values.dtype)
        sums = torch.zeros_like(centroids).index_add_(0, assignment, values)
        centroids = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)
        distance = (values - centroids[assignment]).abs()
        if (counts == 0).any() and distance.max() > 0:
            centroids[(counts == 0).nonzero()[0, 0]] = values[distance.argmax()]
        centroids = centroids.sort().values
        updated = _nearest(values, centroids)
        if torch.equal(updated, assignment):
            break
        assignment = updated
    return centroids, assignment


def calibrate_input_formats(model: nn.Module, calibration_x: torch.Tensor, bits: int) -> Dict[str, FixedPointFormat]:
    """{layer name: fixed-point format of its input} over the conv/linear layers of `model`, each
    minimising the histogram-estimated squared error of rounding plus saturation on `calibration_x`."""
    _check_bits("bits", bits)
    if calibration_x.numel() == 0:
        raise ValueError("calibration_x must hold at least one sample")
    maxima = _input_statistics(model, calibration_x, lambda x, name: x.abs().max().item())
    histograms = _input_statistics(model, calibration_x, lambda x, name: torch.histc(
        x.abs()[x != 0].float().cpu(), _HISTOGRAM_BINS, 0.0, maxima[name] or 1.0))
    return {name: _best_format(histograms[name], maxima[name], bits) for name in maxima}


def _input_statistics(model: nn.Module, calibration_x: torch.Tensor, statistic) -> Dict[str, object]:
    """{layer name: statistic(first input of the layer, name)} from one forward pass (eval, no grad)."""
    results: Dict[str, object] = {}
    handles = []
    for name, module in _quantized_layers(model):
        def record(module, inputs, name=name):
            results[name] = statistic(inputs[0].detach(), name)
        handles.append(module.register_forward_pre_hook(record))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(calibration_x)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return results


def _best_format(histogram: torch.Tensor, max_abs: float, bits: int) -> FixedPointFormat:
    """The int_bits (at or below eq. 20's) with the least estimated squared error over `histogram`
    of non-zero |values| in [0, max_abs]: (x - high)^2 above the range, else min(x^2, step^2 / 12)."""
    widest = fixed_point_format(max_abs, bits)
    centers = (torch.arange(histogram.numel(), dtype=torch.float64) + 0.5) * (max_abs / histogram.numel())
    counts = histogram.double()

    def error(fmt: FixedPointFormat) -> float:
        inside = torch.minimum(centers ** 2, torch.full_like(centers, fmt.step ** 2 / 12))
        per_value = torch.where(centers > fmt.high, (centers - fmt.high) ** 2, inside)
        return float((counts * per_value).sum())

    candidates = [FixedPointFormat(bits, widest.int_bits - shift) for shift in range(_SATURATION_SEARCH + 1)]
    return min(candidates, key=error)


def _store_centroids(centroids: torch.Tensor, centroid_bits: int) -> Tuple[torch.Tensor, str]:
    if centroid_bits == 16:
        return _through_half(centroids), "fp16 centroids"
    fmt = fixed_point_format(centroids.abs().max().item(), centroid_bits)
    return fmt.quantize(centroids), f"{fmt.describe()} centroids"


def _nearest(values: torch.Tensor, sorted_centroids: torch.Tensor) -> torch.Tensor:
    boundaries = (sorted_centroids[1:] + sorted_centroids[:-1]) / 2
    return torch.bucketize(values, boundaries)


def _quantized_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return prunable_layers(model, include_linear=True)


def _row(name: str, bits: int, original: torch.Tensor, quantized: torch.Tensor, detail: str) -> LayerQuantization:
    quantized = quantized.detach()
    distinct = int(torch.unique(quantized[quantized != 0]).numel())
    error = float((quantized - original).abs().max()) if original.numel() else 0.0
    return LayerQuantization(name, bits, distinct, error, detail)


def _through_half(x: torch.Tensor) -> torch.Tensor:
    return x.half().to(x.dtype)


def _check_bits(name: str, bits: int) -> None:
    if not isinstance(bits, int) or not 2 <= bits <= 32:
        raise ValueError(f"{name} must be an int in [2, 32], got {bits!r}")


Quantizer = Callable[[nn.Module, torch.Tensor], Tuple[nn.Module, QuantizationReport]]

# Scheme name -> fn(model, calibration_x) -> (quantised copy, report); iterate it for a table.
QUANTIZERS: Dict[str, Quantizer] = {
    "fixed8": lambda model, calibration_x: quantize_fixed_point(model, calibration_x, bits=8),
    "fixed6": lambda model, calibration_x: quantize_fixed_point(model, calibration_x, bits=6),
    "fp16": lambda model, calibration_x: quantize_fp16(model),
    "kmeans16-int8": lambda model, calibration_x: quantize_kmeans(model, 16, centroid_bits=8),
    "kmeans16-fp16": lambda model, calibration_x: quantize_kmeans(model, 16, centroid_bits=16),
}

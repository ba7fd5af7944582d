"""The model's RMSNorms as one `F.rms_norm` call each: a single fused kernel on a GPU, seven operations
of the model's own forward on the host (cast, square, mean, add, rsqrt, scale, weight).

Two forms exist among the supported models, and they round differently in bfloat16: Qwen3.5/3.6 and
Qwen3-Next scale by (1 + weight) in float32 before casting back; Qwen3 casts back, then scales by its
weight in the model's dtype. Both compute the statistics in float32, whatever the model's dtype. Which
form a module has is read once by comparing both with the module's own output; a norm that is neither
keeps its own forward.

A float64 model is the exception: it is the worker's reference, so it computes in float64 throughout and
no step rounds to float32 (the modules' own forwards do, which made two float64 computations of the same
logits differ by a float32 rounding now and then, depending on the CPU). It differs from the model's own
float64 forward by those roundings, about 1e-7 relative, and from itself by float64 roundings only.
"""

from __future__ import annotations

from copy import deepcopy

import torch
import torch.nn.functional as F
from torch import nn


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, with no call at all when it already is (on the host every call costs microseconds)."""
    return x if x.dtype == dtype else x.to(dtype)


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms compute in float32, or in float64 for a float64 model (see the module's doc)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class FastRMSNorm:
    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        weight = module.weight.detach()
        self.shape = (weight.shape[-1],)
        self.scale_in_float = (1.0 + weight.to(statistics_dtype(weight.dtype))).contiguous()  # the (1 + weight) form
        self.scale_after_cast = weight  # the plain form
        self.form = self._identify(module)

    def _identify(self, module: nn.Module) -> str:
        """On a host copy with random weights, so it costs nothing on the device and works on `meta` too."""
        generator = torch.Generator().manual_seed(0)
        copy = deepcopy(module).to_empty(device="cpu")
        dtype = copy.weight.dtype
        with torch.no_grad():
            copy.weight.copy_(torch.randn(self.shape, generator=generator) * 0.1)
            probe = torch.randn(3, *self.shape, generator=generator).to(dtype)
            expected = copy(probe).float()
            errors = {}
            for form in ("1+w", "w"):
                actual = self._apply(probe, form, 1.0 + copy.weight.to(statistics_dtype(dtype)), copy.weight)
                errors[form] = (actual.float() - expected).abs().max().item()
        form, error = min(errors.items(), key=lambda item: item[1])
        tolerance = 1e-2 * expected.abs().max().item() if dtype in (torch.bfloat16, torch.float16) else 1e-5
        return form if error <= tolerance else "module"

    def _apply(
        self, x: torch.Tensor, form: str, scale_in_float: torch.Tensor, scale_after_cast: torch.Tensor
    ) -> torch.Tensor:
        if form == "1+w":  # scale_in_float: (1 + weight) in the statistics' dtype
            return cast(F.rms_norm(cast(x, statistics_dtype(x.dtype)), self.shape, scale_in_float, self.eps), x.dtype)
        if x.dtype in (torch.float32, torch.float64):  # no cast back: the weight goes inside the one call
            return F.rms_norm(x, self.shape, scale_after_cast, self.eps)
        return F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype) * scale_after_cast

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "module":
            return self.module(x)
        return self._apply(x, self.form, self.scale_in_float, self.scale_after_cast)


class FastGatedRMSNorm:
    """The GDN output norm, RMSNorm(x)·weight·silu(z) (Qwen3.5/3.6, Qwen3-Next): one `F.rms_norm` and two
    operations in float32 and float64 (see the module's doc); in other dtypes the module's own casts, in its
    order. Checked once against the module's output on a host copy with random weights; a module that
    differs keeps its own forward."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        self.weight = module.weight.detach()
        self.shape = (self.weight.shape[-1],)
        self.same = self._check(module)

    def _check(self, module: nn.Module) -> bool:
        generator = torch.Generator().manual_seed(0)
        copy = deepcopy(module).to_empty(device="cpu")
        with torch.no_grad():
            copy.weight.copy_(1.0 + torch.randn(self.shape, generator=generator) * 0.1)
            x, z = (torch.randn(3, *self.shape, generator=generator).to(copy.weight.dtype) for _ in range(2))
            expected = copy(x, z).float()
            actual = self._apply(x, z, copy.weight).float()
        tolerance = 1e-2 if copy.weight.dtype in (torch.bfloat16, torch.float16) else 1e-5
        return bool((actual - expected).abs().max() <= tolerance * expected.abs().max())

    def _apply(self, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):  # float64: no step through float32 (module doc)
            return F.rms_norm(x, self.shape, weight, self.eps) * F.silu(z)
        normed = weight * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
        return (normed * F.silu(z.float())).to(x.dtype)

    def __call__(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z: [rows, d_v]."""
        if not self.same:
            return self.module(x, z)
        return self._apply(x, z, self.weight)

"""SyncBatchNorm that also works for CPU processes over gloo.

torch's `SyncBatchNorm` refuses CPU tensors ("expected input tensor to be on GPU or XPU"), so a
CPU run with --sync-bn would fail at its first forward.  Here each process all-reduces
[sum, sum of squares, count] per channel (a few hundred floats per layer) through the autograd-
aware `torch.distributed.nn.functional.all_reduce`, so gradients flow through the global
statistics exactly as in torch's CUDA kernel.  On CUDA we keep torch's own module (via timm's
converter, which also handles timm's fused BatchNormAct2d).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce

try:
    from timm.layers import BatchNormAct2d
except ImportError:  # pragma: no cover - older timm
    BatchNormAct2d = ()


class _GlooSyncMixin:
    """Replaces a BatchNorm's forward with one whose batch statistics span every process."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1):
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        local_count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), local_count])
        stats = all_reduce(stats)  # autograd-aware: backward all-reduces the gradients too
        channels = x.shape[1]
        total, total_sq, count = stats[:channels], stats[channels:2 * channels], stats[-1]
        mean = total / count
        var = (total_sq / count - mean * mean).clamp_min(0)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else \
                    1.0 / float(self.num_batches_tracked)
                unbiased = var * (count / (count - 1).clamp_min(1))
                self.running_mean.mul_(1 - momentum).add_(mean.detach() * momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.detach() * momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if BatchNormAct2d and isinstance(self, BatchNormAct2d):
            out = self.act(self.drop(out))
        return out


_sync_classes: dict[type, type] = {}


def _sync_class(cls: type) -> type:
    if cls not in _sync_classes:
        _sync_classes[cls] = type(f"GlooSync{cls.__name__}", (_GlooSyncMixin, cls), {})
    return _sync_classes[cls]


def convert_gloo_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Swap every BatchNorm's class for its synchronized twin in place (same parameters and
    state-dict keys, so checkpoints and exported weights are unchanged)."""
    for child in module.modules():
        if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(child, _GlooSyncMixin):
            child.__class__ = _sync_class(type(child))
    return module


def convert_sync_batchnorm(module: nn.Module, cuda: bool) -> nn.Module:
    if cuda:
        from timm.layers import convert_sync_batchnorm as timm_convert
        return timm_convert(module)
    return convert_gloo_sync_batchnorm(module)


def num_batchnorm_layers(module: nn.Module) -> int:
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())

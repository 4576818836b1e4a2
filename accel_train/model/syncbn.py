"""SyncBatchNorm that also works for CPU processes over gloo.

torch's `SyncBatchNorm` refuses CPU tensors ("expected input tensor to be on GPU or XPU"), so a
CPU run with --sync-bn would fail at its first forward.  Here each process computes its batch's
per-channel mean and variance (two-pass, in float32 even under bf16 autocast), and one all-reduce
of [count x mean, count x (var + mean^2), count] per layer (a few hundred numbers, in float64 so
that combining them loses nothing) gives the statistics of the whole global batch: the same
numbers one process would compute on the concatenated batch.  The all-reduce is the autograd-aware
`torch.distributed.nn.functional.all_reduce`, whose backward all-reduces the gradients too, so
gradients flow through the global statistics exactly as in torch's CUDA kernel.  Running
statistics follow nn.BatchNorm: unbiased variance over the global count, momentum or cumulative
average.  On CUDA we keep torch's own module (via timm's converter, which also handles timm's
fused BatchNormAct2d).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.nn.functional import all_reduce

from accel_train.base.ranks import more_than_one_rank

# torch deprecates this public all-reduce for one in a private module (_functional_collectives);
# it still works, and its FutureWarning, once a rank at the first step, spoke of our code to
# users who can do nothing about it.  Only that message, for the process (a filter set around
# each call would cost every BatchNorm layer at every step, and break a compiled graph).
warnings.filterwarnings("ignore", "torch.distributed.nn.functional.all_reduce is deprecated",
                        FutureWarning)

try:
    from timm.layers import BatchNormAct2d
except ImportError:  # pragma: no cover - older timm
    BatchNormAct2d = ()


def global_batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, biased variance, count) per channel over the batches of every process."""
    dims = [0] + list(range(2, x.dim()))
    local_var, local_mean = torch.var_mean(x, dim=dims, correction=0)
    count = torch.full((1,), x.numel() / x.shape[1], dtype=torch.float64, device=x.device)
    mean64, var64 = local_mean.double(), local_var.double()
    # Sums, not means: ranks may hold batches of different sizes.
    stats = torch.cat([mean64 * count, (var64 + mean64 * mean64) * count, count])
    stats = all_reduce(stats)  # autograd-aware: backward all-reduces the gradients too
    channels = x.shape[1]
    total_count = stats[-1]
    mean = stats[:channels] / total_count
    var = (stats[channels:2 * channels] / total_count - mean * mean).clamp_min(0)
    return mean, var, total_count


class _GlooSyncMixin:
    """Replaces a BatchNorm's forward with one whose batch statistics span every process."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and more_than_one_rank()):
            return super().forward(x)
        if x.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels, got input of shape "
                             f"{tuple(x.shape)}")
        compute_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        xc = x.to(compute_dtype)
        mean64, var64, count = global_batch_stats(xc)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else \
                    1.0 / float(self.num_batches_tracked)
                unbiased = var64 * (count / (count - 1).clamp_min(1))
                self.running_mean.mul_(1 - momentum).add_(
                    mean64.to(self.running_mean.dtype), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(
                    unbiased.to(self.running_var.dtype), alpha=momentum)
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        mean, var = mean64.to(compute_dtype).view(shape), var64.to(compute_dtype).view(shape)
        out = (xc - mean) * torch.rsqrt(var + self.eps)
        if self.affine:
            out = out * self.weight.to(compute_dtype).view(shape) + \
                self.bias.to(compute_dtype).view(shape)
        out = out.to(x.dtype)
        if BatchNormAct2d and isinstance(self, BatchNormAct2d):
            out = self.act(self.drop(out))  # timm's fused norm + activation: same order as timm
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
        if isinstance(child, nn.modules.batchnorm._BatchNorm) \
                and not isinstance(child, _GlooSyncMixin):
            child.__class__ = _sync_class(type(child))
    return module


def convert_sync_batchnorm(module: nn.Module, cuda: bool) -> nn.Module:
    if cuda:
        from timm.layers import convert_sync_batchnorm as timm_convert
        return timm_convert(module)
    return convert_gloo_sync_batchnorm(module)


def num_batchnorm_layers(module: nn.Module) -> int:
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())

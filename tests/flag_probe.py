"""Watchers on torch, from outside the package, for tests/test_flags.py: the memory format and
dtype at every training Conv2d, torch.compile calls, the DDP wrapper's settings, the DataLoaders'
worker settings, and the share of zeros that reach each training Linear (what dropout leaves).

`install()` patches torch's public entry points (and adds a global forward hook for the
convolutions) and returns the records it fills; `uninstall()` puts torch back (an in-process run;
a probed subprocess simply exits).
"""

from __future__ import annotations

import torch

_ORIGINALS: dict = {}


def install(conv: bool = True) -> dict:
    records: dict = {"conv": [], "compile": [], "ddp": [], "loaders": [], "linear_zeros": []}
    compile_fn = torch.compile
    ddp_init = torch.nn.parallel.DistributedDataParallel.__init__
    loader_init = torch.utils.data.DataLoader.__init__
    linear_forward = torch.nn.Linear.forward
    _ORIGINALS.update(compile=compile_fn, ddp=ddp_init, loader=loader_init,
                      linear=linear_forward)

    def _conv_seen(module, args, out):
        # torch's global hook sees every module's call: the convolutions' are the ones wanted
        if not isinstance(module, torch.nn.Conv2d):
            return
        input, weight = args[0], module.weight
        # training steps: train mode with gradients (the start's train-mode check of the
        # network runs without: build.check_train_forward; a multi-process start's search
        # for unused parameters, build.unused_parameters, runs with them, on two images, and
        # the conv records are read of one-process runs only)
        if module.training and torch.is_grad_enabled() and len(records["conv"]) < 200:
            records["conv"].append({
                "batch": int(input.shape[0]), "hw": list(input.shape[-2:]),
                # (a tensor with size-1 dims can be both contiguous and channels_last)
                "input_channels_last": input.is_contiguous(memory_format=torch.channels_last),
                "input_contiguous": input.is_contiguous(),
                "weight_channels_last": weight.is_contiguous(memory_format=torch.channels_last),
                "weight_contiguous": weight.is_contiguous(),
                "out_dtype": str(out.dtype)})

    def _compile(model=None, *args, **kwargs):
        records["compile"].append({"module": isinstance(model, torch.nn.Module),
                                   "backend": str(kwargs.get("backend"))})
        return compile_fn(model, *args, **kwargs)

    def _ddp_init(self, *args, **kwargs):
        ddp_init(self, *args, **kwargs)
        records["ddp"].append({
            "kwargs": {k: v for k, v in kwargs.items() if isinstance(v, (int, float, bool, str))},
            "bucket_bytes_cap": self.bucket_bytes_cap,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "static_graph": self.static_graph})

    def _loader_init(self, *args, **kwargs):
        loader_init(self, *args, **kwargs)
        records["loaders"].append({
            "dataset": type(self.dataset).__name__, "num_workers": self.num_workers,
            "prefetch_factor": self.prefetch_factor,
            "persistent_workers": self.persistent_workers})

    def _linear_forward(self, input):
        # the classifier's input in training: the share of exact zeros (what dropout leaves)
        if self.training and torch.is_grad_enabled() and input.shape[0] > 1 and \
                len(records["linear_zeros"]) < 50:
            records["linear_zeros"].append(float((input == 0).float().mean()))
        return linear_forward(self, input)

    if conv:
        if "conv_hook" in _ORIGINALS:  # installed twice: one watcher
            _ORIGINALS.pop("conv_hook").remove()
        _ORIGINALS["conv_hook"] = torch.nn.modules.module.register_module_forward_hook(_conv_seen)
    torch.compile = _compile
    torch.nn.parallel.DistributedDataParallel.__init__ = _ddp_init
    torch.utils.data.DataLoader.__init__ = _loader_init
    torch.nn.Linear.forward = _linear_forward
    return records


def uninstall() -> None:
    if "conv_hook" in _ORIGINALS:
        _ORIGINALS.pop("conv_hook").remove()
    torch.compile = _ORIGINALS["compile"]
    torch.nn.parallel.DistributedDataParallel.__init__ = _ORIGINALS["ddp"]
    torch.utils.data.DataLoader.__init__ = _ORIGINALS["loader"]
    torch.nn.Linear.forward = _ORIGINALS["linear"]

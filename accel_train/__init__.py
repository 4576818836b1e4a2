"""accel_train: one image-classification training loop from one CPU to many machines.

`accel_train.fit(model, train_dataset, eval_dataset=None, **options)` is the Python API
(api.py); `python -m accel_train` and `accel-train` the command line (cli.py).

`import accel_train` makes its small networks (cifar_convnet_*, small_nets.py) known to timm's
registry, so that timm.create_model and transformers' timm wrapper build them from an exported
config.json.  Importing torch and timm costs seconds, which the command line must not pay before
it parses its arguments: so the registration happens when timm itself is imported (at once when
it already is), through a one-shot import hook.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

__version__ = "0.1.0"
__all__ = ["fit"]


def __getattr__(name: str):
    """`accel_train.fit`, imported when first asked for: `import accel_train` (and with it the
    command line's `--help`) stays free of torch's import time."""
    if name == "fit":
        from accel_train.api import fit
        return fit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _RegisterWhenTimmLoads(importlib.abc.MetaPathFinder):
    """Finds timm through the other finders and wraps its loader, so that
    accel_train.model.small_nets is imported right after timm has finished loading; then leaves
    sys.meta_path.  (A spec asked for without loading it, as availability checks do, registers
    nothing.)"""

    def find_spec(self, name, path=None, target=None):
        if name != "timm":
            return None
        others = (finder for finder in sys.meta_path
                  if finder is not self and hasattr(finder, "find_spec"))
        spec = next((found for found in (f.find_spec(name, path, target) for f in others)
                     if found is not None), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def load_then_register(module):
            load(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            importlib.import_module(f"{__name__}.model.small_nets")

        spec.loader.exec_module = load_then_register
        return spec


if "timm" in sys.modules:
    importlib.import_module(f"{__name__}.model.small_nets")
elif not any(isinstance(finder, _RegisterWhenTimmLoads) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenTimmLoads())

"""Models: timm models by name and the small networks registered in timm's registry, the
saved-model format in one module (saved.py), SyncBatchNorm, EMA, whitening of a first layer,
export.  Receives mean and std as numbers; imports base and config only, never data."""

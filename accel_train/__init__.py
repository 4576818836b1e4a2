"""accel_train: one image-classification training loop from one CPU to many machines."""

__version__ = "0.1.0"

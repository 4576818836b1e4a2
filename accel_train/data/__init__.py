"""Data: sources (Hugging Face datasets, parquet, image folders, the embedded synthetic set,
shards in streaming/), decoding, transforms and augmentation, bad images, and the one
train-loader interface (loading.py).  Imports base and config only; knows nothing of models."""

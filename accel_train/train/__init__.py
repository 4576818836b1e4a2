"""The training parts: optimizer and schedule, the time budget, precision and speed choice,
evaluation, divergence checks, and the start step that builds the network from the data
(network.py).  Imports base, config, data and model."""

"""The base every other package stands on: errors and their one-line form, readers of every file
the product reads, seeded randomness, rank helpers that work before the Accelerator exists, and
the check of weight files.  Imports nothing else of accel_train."""

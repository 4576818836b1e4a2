"""The run: launch and process group, collectives and stall watch, the run lock, the start plan
(resume), checkpoints, the run folder and its records, tracking and plots.  Imports base, config,
model and the data package's types; never the trainer or the entry points."""

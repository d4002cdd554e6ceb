"""The plumbing below train.py: option fields and checks, process settings, the run directory, checkpoints,
distributed training and routing statistics. Nothing here imports train.py or the workbench above it."""

"""The workbench around the core (delta_gpt.py, train.py): options, checkpoints, the run directory,
distributed training, process settings, and the tools (report, compare and studies, bench, plan, gpu-check)."""

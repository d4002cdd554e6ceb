"""The tools above train.py, each calling train() or reading its runs: compare and studies, report, bench,
plan and gpu-check. The plumbing train.py needs lives below it, in plumbing/."""

"""Exercises a student writes: one file per exercise, each function a stub to fill
(docs/exercises.md, "Write the router yourself"). `python -m pytest exercises` checks them
(exercises/conftest.py runs exercises/check.py's checks); `python -m exercises.train_mine` trains
with your router."""

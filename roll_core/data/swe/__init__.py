"""SWE-style tasks: generated repositories with planted bugs, user tasks, grading (docs/swe.md)."""

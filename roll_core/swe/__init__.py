"""SWE-style tasks: generated repositories with planted bugs, user tasks, grading (docs/swe.md).

Outside :mod:`roll_core.data` on purpose: nothing here needs torch, so ``roll data swe`` and
the sandboxes' callers start in a fraction of a second. Imports only :mod:`roll_core.sandbox`
and :mod:`roll_core.errors`.
"""

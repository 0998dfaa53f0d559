"""Pure policy: block accounting, prefix trees, residency, scheduling, speculation rules.

Nothing in this package imports torch (a test checks): it works on ints, lists and small
dataclasses, so it can be tested in microseconds without a model.
"""

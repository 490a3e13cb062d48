"""Is an output right, and if not, why: the tolerance model and verdict (compare), the misreadings that
explain a wrong output (diagnose, explains), where in the problem the error lives (localize), and the
reference's own self-check.

May import: core, problems. (tests/test_imports.py holds this rule.)
"""

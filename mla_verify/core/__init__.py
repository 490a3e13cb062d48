"""The small facts and helpers every room uses: errors, MLA dimensions, bit-level equality, one-line
tracebacks, device-memory budgets, the machine's platform and versions, and what every command line shares
(exit codes, one-line usage errors, the catch-all runner).

May import: nothing else in mla_verify. (tests/test_imports.py holds this rule.)
"""

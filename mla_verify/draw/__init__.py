"""What to try: Hypothesis strategies over an envelope (each says how it shrinks), the profiles (premerge,
fuzz, dev) and the example database. Knows problems, never a kernel.

May import: core, problems. (tests/test_imports.py holds this rule.)
"""

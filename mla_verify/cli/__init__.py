"""The ``mla-verify`` command line (docs/contracts.md, Contract 2): check, replay, doctor, bench, ...

May import: core, problems, backends, judge, draw, kinds, kernels, run, records, bench, fib.
(tests/test_imports.py holds this rule.)
"""

"""Benchmarks, not tests: latency, bandwidth and roofline of each backend, dense or sparse (``mla-verify bench``,
``python -m mla_verify.bench``), its timers and its plot.

May import: core, problems, backends, kinds, run, records. (tests/test_imports.py holds this rule.)
"""

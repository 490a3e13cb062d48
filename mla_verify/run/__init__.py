"""Running cases: one case on one backend (harness: poison, snapshot, call, compare, metamorphic checks),
the search that draws, judges and shrinks (engine, simplify), cases judged in worker processes (isolate), the
search in a copy of the process, taken over when it dies (supervise), time and memory bounds (watchdog), xdist
workers' devices, progress lines and stage times.

May import: core, problems, backends, judge, draw, kinds, fib. (tests/test_imports.py holds this rule.)
"""

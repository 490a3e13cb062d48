"""``python -m mla_verify.bench ...``: ``mla-verify bench`` on a host where the console script is not installed."""
from .measure import bench_main

raise SystemExit(bench_main())

"""``python -m mla_verify.cli ...``: ``mla-verify`` on a host where the console script is not installed."""
from .main import main

raise SystemExit(main())

"""``python -m mla_verify.shadow SCRIPT [ARGS...]``: run a script under the session MLA_VERIFY_SHADOW_* asks for."""
from .session import main

raise SystemExit(main())

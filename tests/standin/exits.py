"""A stand-in service module that exits at once with STANDIN_EXIT (default 0)."""

import os

raise SystemExit(int(os.environ.get("STANDIN_EXIT", "0")))

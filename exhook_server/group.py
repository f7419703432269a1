"""What the server processes of one group share with their parent: the ready file and one byte
that says EMQX confirmed the hook list.

Made before the fork (an anonymous shared mapping), so `procs` (the parent) and `server` (each
child) both import it without importing each other.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path
from typing import Any

#: 1 once EMQX loaded any process of the group or their hook list was confirmed (`hookset`).
HOOK_SET_CONFIRMED = mmap.mmap(-1, 1)


def write_ready_file(path: str, info: dict[str, Any]) -> None:
    """Atomically publish `info` as JSON: whoever polls the file sees all of it or nothing."""
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)

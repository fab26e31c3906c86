"""Writing a model folder so that no reader ever sees half of one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomically(folder: Path, fill: Callable[[Path], None]) -> Path:
    """``fill`` a temporary folder beside ``folder``, then rename it into place: a reader (a
    pod starting, another test process) sees the old folder or the whole new one, never half
    of one, and a failed write leaves nothing behind."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    tmp.chmod(0o755)
    try:
        fill(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder

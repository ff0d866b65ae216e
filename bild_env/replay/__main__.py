"""``python -m bild_env.replay [folder]``: what the replay cache (or ``folder``) holds, as JSON."""

import json
import sys
from pathlib import Path

from bild_env.replay.store import disk_report

print(json.dumps(disk_report(Path(sys.argv[1]) if len(sys.argv) > 1 else None), indent=2))

"""A stand-in `nvidia-smi` for tests on a box without a GPU: the GPUs and compute processes in the
JSON file named by $OMNI_FAKE_GPUS, answered to `--query-gpu=FIELDS` and `--query-compute-apps=FIELDS`
as `--format=csv,noheader,nounits` (the only form the router asks for). Copied into a temp dir put
first on PATH, with this interpreter as its `#!`.

    {"gpus": [{"index": 0, "uuid": "GPU-a", "name": "Fake A", "memory.total": 24576, "memory.used": 0}],
     "apps": [{"pid": 123, "gpu_uuid": "GPU-a", "used_memory": 512}]}
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def install(folder: Path, state: dict[str, Any]) -> dict[str, str]:
    """Put this script as `nvidia-smi` in FOLDER/bin and `state` in FOLDER/gpus.json; the
    environment (PATH first, OMNI_FAKE_GPUS) a router needs to see them."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\n" + Path(__file__).read_text())
    smi.chmod(0o755)
    (folder / "gpus.json").write_text(json.dumps(state))
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "OMNI_FAKE_GPUS": str(folder / "gpus.json")}


def main(argv: list[str]) -> int:
    with open(os.environ["OMNI_FAKE_GPUS"]) as f:
        state = json.load(f)
    for arg in argv:
        for flag, table in (("--query-gpu=", "gpus"), ("--query-compute-apps=", "apps")):
            if arg.startswith(flag):
                fields = arg[len(flag):].split(",")
                for row in state.get(table, []):
                    print(", ".join(str(row[f]) for f in fields))
                return 0
    if "-L" in argv:
        for g in state.get("gpus", []):
            print(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})")
        return 0
    print("fake nvidia-smi: only --query-gpu=, --query-compute-apps= and -L", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

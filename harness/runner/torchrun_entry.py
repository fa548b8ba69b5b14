"""One rank launched by ``torchrun`` instead of the fork supervisor: the baseline of
``scripts/bench_launcher.py``. Usage (torchrun sets RANK, WORLD_SIZE, MASTER_PORT):

    torchrun --standalone --nproc_per_node=W -m harness.runner.torchrun_entry SPEC_JSON OUT_DIR TIMEOUT_S
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from harness.runner.worker import run_rank
from harness.spec import from_dict


def main() -> None:
    spec_json, out_dir, timeout_s = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    spec = from_dict(json.loads(Path(spec_json).read_text()))
    run_rank(
        int(os.environ["RANK"]),
        spec,
        port=int(os.environ["MASTER_PORT"]),
        out_dir=out_dir,
        timeout_s=timeout_s,
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        # torchrun's node-local placement: which GPU this rank takes, and how many ranks share the node
        local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
        local_world=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
    )


if __name__ == "__main__":
    main()

"""`ds3 dev --ingesters N` on a data dir last run with more ingesters: the ones left out.

Their data dirs (DATA_DIR/iK, K > N) hold streams that the new description places on the
others. Not starting them made those streams answer 404, as if they had never existed (a
client could then create them again beside the old copy). So dev starts them too, outside the
description (it names them as the previous one's members, so the new owners pull from them at
once) and waits until each records, beside the cluster file, that it has handed everything over
and retired (ingester/moves.py, shared/cluster.py). Then it stops it and moves its data dir aside, to DATA_DIR/retired/iK-gG:
nothing is deleted, and the next run does not start it again.

The supervisor calls `check()` on its tick; tests drive it the same way."""

from __future__ import annotations

import logging
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from shared.cluster import file_retired_at

log = logging.getLogger("ds3.dev")

CHECK_EVERY: Final = 0.5  # seconds between looks at each retiring ingester's record
_ID: Final = re.compile(r"i([1-9][0-9]*)")


def left_out(data_dir: Path, ingesters: int) -> list[str]:
    """The ids of ingesters a last run started (their data dirs are there) that this run's
    `ingesters` leave out, in order."""
    found = []
    for child in data_dir.iterdir() if data_dir.is_dir() else ():
        m = _ID.fullmatch(child.name)
        if m and child.is_dir() and int(m.group(1)) > ingesters:
            found.append(int(m.group(1)))
    return [f"i{k}" for k in sorted(found)]


@dataclass
class Retiring:
    id: str
    data_dir: Path
    proc: subprocess.Popen[bytes]
    _checked_at: float = 0.0

    def check(self, cluster_file: Path, generation: int, retired_root: Path) -> bool:
        """True once this ingester has retired at `generation`, been stopped and its data dir
        moved aside."""
        now = time.monotonic()
        if now - self._checked_at < CHECK_EVERY:
            return False
        self._checked_at = now
        if file_retired_at(cluster_file, self.id) != generation:
            return False
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        target = retired_root / f"{self.id}-g{generation}"
        retired_root.mkdir(parents=True, exist_ok=True)
        self.data_dir.rename(target)
        log.info("ingester %s has handed every stream it held to the others: stopped, and its data dir moved "
                 "to %s (it holds no stream; delete it when you like)", self.id, target)
        return True

"""Process-wide settings of a serving process (ingester, reader worker): the event loop, the
open-files limit and the garbage collector."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal

log = logging.getLogger("ds3")

# The collector's thresholds once a server has started (CPython's default: 700, 10, 10).
# A live fan-out allocates thousands of short-lived objects per message (a parked long-poll's
# future and callbacks, its answer), which at 700 pass the young collections while they wait
# and fill the oldest generation: with the defaults a reader worker serving 1,000 long-polls
# at 20 msg/s ran 16-19 full collections in 10 s, of 45-75 ms each, every one a pause for all
# of its clients (scripts/bench fanout). Reference counting frees nearly all of them; the
# collector only has cycles to find, so it can run far less often.
GC_THRESHOLDS = (20_000, 20, 50)


def install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def raise_fd_limit() -> None:
    """Every connection is a file descriptor (10,000 live subscribers need about 10,050): take
    the hard limit, since the usual soft limit of 1,024 would refuse connections far earlier."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            want = hard if hard != resource.RLIM_INFINITY else max(soft, 1_048_576)
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            log.info("open files limit raised from %d to %d (connections each take one)", soft, want)
    except (ImportError, ValueError, OSError) as e:  # pragma: no cover - not on Linux/macOS, or refused
        log.warning("could not raise the open files limit: %s", e)


def settle_gc() -> int:
    """Once the server is up: move everything alive now (modules, the app, its clients) out of
    the collector's sight for good, so a full collection looks only at what serving creates,
    and collect less often (GC_THRESHOLDS). Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    return gc.get_freeze_count()


# Set by `ds3 dev` for its ingesters and reader: the pid of the dev process. Found by QA: a
# SIGKILLed `ds3 dev` (which cannot pass SIGTERM on) left them serving, holding the port and the
# data dir's lock, so the next `ds3 dev` could not start.
DEV_PARENT_ENV = "DS3_DEV_PARENT"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """Under `ds3 dev` (DEV_PARENT_ENV): get SIGTERM (a drain) when the dev process dies, and
    stop at once if it has already. The variable is taken out of the environment: this
    process's own children (a reader's workers) watch this process, not dev."""
    parent = os.environ.pop(DEV_PARENT_ENV, None)
    if parent is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing watches the parent
        log.debug("prctl(PR_SET_PDEATHSIG) is not available")
        return
    if str(os.getppid()) != parent:  # (it died before the prctl)
        os.kill(os.getpid(), signal.SIGTERM)

"""warmup: compiling the codecs' numba kernels before a delta needs them.

Codecs with kernels (`ctx`, `rans`, and the scan of the change model they share) compile them
per element width on first use, or load them from numba's on-disk cache: ~13-25 s of one CPU on
a machine whose cache is empty (a new pod), ~0.1 s once cached. A process that must not pay
that inside a latency it measures warms them up first, in the foreground (`warm_up`) or in a
low-priority thread while it waits for its first delta (`BackgroundWarmUp`). Each codec says
what it compiles (`Codec.warm_up`); the registry says which codecs there are.

Not here: the kernels (`changes.py`, `ctx.py`, `rans.py`), the registry (`__init__.py`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator

from weightsync.cpus import lower_this_thread_priority
from weightsync.format.codecs import CODEC_NAMES, codec

log = logging.getLogger(__name__)


def warm_up(dtype_names: Iterable[str], codec_ids: Iterable[int] | None = None) -> None:
    """Compiles (or loads from numba's cache) the kernels of `codec_ids` (default: every codec)
    for the element widths of `dtype_names`."""
    names = list(dtype_names)
    for codec_id in sorted(CODEC_NAMES if codec_ids is None else codec_ids):
        codec(codec_id).warm_up(names)


class BackgroundWarmUp:
    """`warm_up` in a low-priority daemon thread, for a long-lived process (a publisher, an agent)
    to compile the kernels while it waits for its first delta: on a machine whose numba cache is
    empty (a new pod), that delta would otherwise compile them itself (~13 s of one CPU on the
    2-core machine; loading them once cached takes ~0.1 s). A delta that needs a kernel meanwhile
    waits for numba's compile lock; on a saturated machine that wait can exceed compiling the
    kernel itself, as the warm-up also compiles kernels this process may not need (docs/agents.md).
    A failure is logged, not raised: the first delta compiles what this could not.

    It compiles one codec and element width at a time, so that `close()` (which the owner calls
    before its process exits: a compile that the exit cuts short can crash it) waits for the one
    under way, not for the rest: at low priority on a busy machine the whole set can take minutes,
    and a short-lived process need not pay for kernels it will never use. `codec_ids` (default:
    every codec) leaves out the codecs the process will not use (a publisher writing for readers
    older than `ctx` needs none)."""

    CLOSE_TIMEOUT_S = 300.0

    def __init__(self, dtype_names: Iterable[str], *, thread_name: str, codec_ids: Iterable[int] | None = None) -> None:
        self.dtype_names = sorted(set(dtype_names))
        self.codec_ids = sorted(CODEC_NAMES if codec_ids is None else set(codec_ids))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lower_this_thread_priority()
        for name in self.dtype_names:
            for codec_id in self.codec_ids:
                if self._stop.is_set():
                    return
                try:
                    codec(codec_id).warm_up([name])
                except Exception:  # noqa: BLE001 -- only a head start (see above)
                    log.warning("warming up the %s kernels for %s failed", CODEC_NAMES[codec_id], name, exc_info=True)

    def wait(self, timeout: float | None = None) -> bool:
        """True once every kernel is compiled (or the warm-up was stopped)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Compiles nothing after the kernel under way."""
        self._stop.set()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stops, and waits for the compile under way."""
        self.stop()
        if not self.wait(timeout):
            log.warning("the codec warm-up (%s) is still compiling after %.0f s", self._thread.name, timeout)


@contextlib.contextmanager
def on_first_kernel_compile(announce: Callable[[], None]) -> Iterator[None]:
    """Calls `announce` once, when a codec kernel starts compiling inside this block (not when it
    loads from numba's cache): a one-shot command says why it pauses, and only when it does."""
    import numba.core.event as numba_events

    said = threading.Event()

    class Listener(numba_events.Listener):
        def on_start(self, event) -> None:
            dispatcher = event.data.get("dispatcher") if isinstance(event.data, dict) else None
            module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
            if module.startswith("weightsync.") and not said.is_set():
                said.set()
                announce()

        def on_end(self, event) -> None:
            pass

    listener = Listener()
    numba_events.register("numba:compile", listener)
    try:
        yield
    finally:
        numba_events.unregister("numba:compile", listener)

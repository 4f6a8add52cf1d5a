"""The cyclic garbage collector and a serving process's start-up heap (pure Python).

After start-up a process holds several hundred thousand objects that live until it exits:
the imported modules of torch, transformers and the project, the model, the compiled graphs,
the tokenizer. CPython's oldest-generation collection walks every one of them, and it runs
whenever the objects promoted since the last one exceed a quarter of that generation. The
engine loop promotes a few thousand per step (the step's records are alive when a young
collection happens mid-step), so at 1,024 running sequences this was a 0.15-0.3 s stop of the
engine every few dozen steps, scanning objects that can never be garbage. Freezing the
start-up heap moves those objects to the permanent generation, which collections skip; what
the loop allocates later is collected as before. vLLM's engine core does the same.

The youngest generation is also collected less often. CPython collects it every 700 new
container objects, and a decode step at 1,024 sequences allocates several thousand (each
delta's records), so young collections ran mid-step several times a step, each promoting the
step's records that were still alive: about 1 ms per step went to the collector, with 12 ms
stops when an older generation followed. With 20,000 a young collection comes once every few
steps, by which time reference counting has freed almost all of those records.
"""
from __future__ import annotations

import gc
from typing import Optional, Tuple

# New container objects between two collections of the youngest generation (CPython: 700).
YOUNG_COLLECTION_THRESHOLD = 20_000
# The collector's thresholds before the first freeze, put back by ``unfreeze_heap``.
_thresholds_before: Optional[Tuple[int, int, int]] = None


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then exempt everything still alive from later
    collections. Call once the process is ready to serve (weights loaded, graphs compiled).

    An earlier freeze in this process (an engine started and dropped before, as in tests or
    back-to-back benchmarks) is undone first, so that its garbage goes in this collection
    instead of staying frozen for the process's life. The youngest generation's threshold is
    raised to at least ``YOUNG_COLLECTION_THRESHOLD``."""
    global _thresholds_before
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    if _thresholds_before is None:
        _thresholds_before = gc.get_threshold()
    young, *older = _thresholds_before
    gc.set_threshold(max(young, YOUNG_COLLECTION_THRESHOLD), *older)


def unfreeze_heap() -> None:
    """Return the frozen objects to the collector and put its thresholds back (an engine shut
    down; the process goes on)."""
    global _thresholds_before
    gc.unfreeze()
    if _thresholds_before is not None:
        gc.set_threshold(*_thresholds_before)
        _thresholds_before = None

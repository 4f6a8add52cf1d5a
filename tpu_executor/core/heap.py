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
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then exempt everything still alive from later
    collections. Call once the process is ready to serve (weights loaded, graphs compiled).

    An earlier freeze in this process (an engine started and dropped before, as in tests or
    back-to-back benchmarks) is undone first, so that its garbage goes in this collection
    instead of staying frozen for the process's life."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def unfreeze_heap() -> None:
    """Return the frozen objects to the collector (an engine shut down; the process goes on)."""
    gc.unfreeze()

"""The server's LoRA adapters: each served under a name the request's ``model`` field gives
(vLLM's ``--lora-modules name=path``), and loaded or unloaded at run time through
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` when the server allows it."""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Tuple

from tpu_executor.core.lora import LoRARequest
from tpu_executor.engine.protocols import EngineClient


class ServedAdapters:
    """Adapters by served name. Each gets an id of its own (never reused, so an unloaded
    adapter's slot and host copy simply age out of the engine's caches)."""

    def __init__(self, engine: EngineClient, base_name: str, modules: Sequence[Tuple[str, str]] = ()):
        self.engine, self.base_name = engine, base_name
        self._by_name: Dict[str, LoRARequest] = {}
        self._next_id = 1
        self._lock = threading.Lock()
        for name, path in modules:
            self.add(name, path)

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at ``path`` as ``name``; ValueError when the name is taken or the
        adapter does not fit the model (the engine's checks name why)."""
        with self._lock:
            if name == self.base_name or name in self._by_name:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            lora = LoRARequest(name, self._next_id, path)
            self._next_id += 1
        self.engine.validate_lora(lora)
        with self._lock:
            self._by_name[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest:
        """Stop serving ``name`` (requests already running with it finish); KeyError if unknown."""
        with self._lock:
            lora = self._by_name.pop(name)
        self.engine.forget_lora(lora)
        return lora

    def get(self, name: str) -> Optional[LoRARequest]:
        with self._lock:
            return self._by_name.get(name)

    def all(self) -> List[LoRARequest]:
        with self._lock:
            return list(self._by_name.values())

"""The server's LoRA adapters: each served under a name the request's ``model`` field gives
(vLLM's ``--lora-modules name=path``), and loaded or unloaded at run time through
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` when the server allows it.

The operator's adapters (``lora_modules``) are read from wherever they are. A client's runtime
load reads only inside the adapter root (``lora_adapter_root``, symlinks resolved), and what it
is told never holds a server path: a path outside the root gets one answer whether or not
anything is there, and a problem with an adapter inside it names the path as the client gave it.
"""
from __future__ import annotations

import os
import threading
from typing import Dict, List, Optional, Sequence, Set, Tuple

from tpu_executor.core.lora import CONFIG_FILE, WEIGHTS_FILE, LoRARequest
from tpu_executor.engine.protocols import EngineClient


class AdapterError(ValueError):
    """An adapter that cannot be served; ``param`` is the request field at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


class AdapterRoot:
    """The directory runtime loads read adapters from: an adapter lies in it when its path's
    spelling (``..`` folded, before any file is looked at) and its real path (symlinks resolved)
    do, and so do the real paths of the files an adapter is read from."""

    def __init__(self, root: str):
        self.spelled = os.path.abspath(root)
        self.real = os.path.realpath(root)

    def resolve(self, lora_path: str) -> Optional[str]:
        """The real path of a client's ``lora_path`` (a relative one is taken inside the root)
        when it lies in the root, else None."""
        if "\0" in lora_path:
            return None
        joined = os.path.normpath(os.path.join(self.real, lora_path))  # an absolute lora_path stays itself
        if not (_inside(joined, self.real) or _inside(joined, self.spelled)):
            return None
        return self._real_adapter(joined)

    def holds(self, path: str) -> bool:
        """Whether the adapter at ``path`` (as this host resolves it) lies in the root."""
        return "\0" not in path and self._real_adapter(path) is not None

    def _real_adapter(self, path: str) -> Optional[str]:
        """The real path of adapter directory ``path`` if it and its files lie in the root (a
        file may be a symlink to another tenant's weights)."""
        real = self._real_inside(path)
        if real is None or any(self._real_inside(os.path.join(real, f)) is None for f in (CONFIG_FILE, WEIGHTS_FILE)):
            return None
        return real

    def _real_inside(self, path: str) -> Optional[str]:
        try:
            real = os.path.realpath(path)
        except (OSError, ValueError):
            return None
        return real if _inside(real, self.real) else None


def cannot_load(lora_name: str, lora_path: str) -> AdapterError:
    """The one answer to a path outside the root, whatever is (or is not) there."""
    return AdapterError(f"The lora adapter '{lora_name}' cannot be loaded from lora_path {lora_path!r}: runtime "
                        "loads read adapters only inside the server's adapter root (--lora-adapter-root)",
                        "lora_path")


class ServedAdapters:
    """Adapters by served name. Each gets an id of its own (never reused, so an unloaded
    adapter's slot and host copy simply age out of the engine's caches). ``root``: the adapter
    root of runtime loads (None: ``load`` refuses every path)."""

    def __init__(self, engine: EngineClient, base_name: str, modules: Sequence[Tuple[str, str]] = (),
                 root: Optional[str] = None):
        self.engine, self.base_name = engine, base_name
        self.root = AdapterRoot(root) if root is not None else None
        self._by_name: Dict[str, LoRARequest] = {}
        self._loading: Set[str] = set()
        self._next_id = 1
        self._lock = threading.Lock()
        for name, path in modules:
            self.add(name, path)

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at ``path`` (the operator's: read wherever it is) as ``name``;
        ``AdapterError`` when the name is taken or being loaded, ValueError when the adapter does
        not fit the model (the engine's checks name why)."""
        lora = self._reserve(name, path)
        try:
            self.engine.validate_lora(lora)
        except BaseException:
            with self._lock:
                self._loading.discard(name)
            raise
        with self._lock:
            self._loading.discard(name)
            self._by_name[name] = lora
        return lora

    def load(self, name: str, lora_path: str) -> LoRARequest:
        """A client's runtime load of ``lora_path`` as ``name``: refused outside the root, and
        every error names the path as the client gave it, never the server's."""
        real = self.root.resolve(lora_path) if self.root is not None else None
        if real is None:
            raise cannot_load(name, lora_path)
        try:
            return self.add(name, real)
        except AdapterError:
            raise
        except ValueError as err:
            raise AdapterError(self._as_given(str(err), real, lora_path), "lora_path") from None

    def _as_given(self, message: str, real: str, lora_path: str) -> str:
        """``message`` with the server's paths replaced: the adapter's by the client's spelling,
        and the root's, should another path under it show, by ``<adapter root>``."""
        quoted, bare = "\0quoted\0", "\0bare\0"
        message = message.replace(repr(real), quoted).replace(real, bare)
        for root in (self.root.real, self.root.spelled):
            message = message.replace(root, "<adapter root>")
        return message.replace(quoted, repr(lora_path)).replace(bare, lora_path)

    def _reserve(self, name: str, path: str) -> LoRARequest:
        """A new adapter id for ``name``, which is held as loading until ``add`` settles it: a
        second load of one name fails at once instead of racing the first."""
        if not name:
            raise AdapterError("lora_name must not be empty", "lora_name")
        with self._lock:
            if name == self.base_name or name in self._by_name or name in self._loading:
                raise AdapterError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            lora = LoRARequest(name, self._next_id, path)
            self._next_id += 1
            self._loading.add(name)
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

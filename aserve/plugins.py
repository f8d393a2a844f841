"""Plugins by name: scheduling policies and tool-call parsers are found the same way, as an installed
entry point's name, 'module:Class' or 'path/to/file.py:Class', with errors that name what was asked."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PluginKind:
    group: str  # the entry-point group, e.g. "aserve.policies"
    name: str  # in messages: "policy", "tool-call parser"
    plural: str  # "policies", "tool-call parsers"
    install_hint: str  # what to run when none is installed
    error: type[Exception]  # raised for anything that does not load

    def installed(self) -> dict[str, importlib.metadata.EntryPoint]:
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=self.group)}

    def load(self, spec: str):
        """The object `spec` names (not checked for its type: the caller knows what it wants)."""
        try:
            if ":" in spec:
                return self._from_path(spec)
            installed = self.installed()
            if spec not in installed:
                names = ", ".join(sorted(installed)) or f"none ({self.install_hint})"
                raise self.error(f"unknown {self.name} {spec!r}; installed {self.plural}: {names}")
            return installed[spec].load()
        except self.error:
            raise
        except Exception as exc:  # a broken plugin: name it and its cause, not a traceback soup
            raise self.error(f"{self.name} {spec!r} failed to load: {type(exc).__name__}: {exc}") from exc

    def _from_path(self, spec: str):
        target, _, attr = spec.rpartition(":")
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise self.error(f"{self.name} file {target!r} does not exist")
            prefix = "aserve_user_" + self.name.replace("-", "_").replace(" ", "_")
            module_spec = importlib.util.spec_from_file_location(f"{prefix}_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        try:
            return getattr(module, attr)
        except AttributeError:
            raise self.error(f"{self.name} {spec!r}: {target} has no attribute {attr!r}") from None

"""Settings, at the bottom of the package: `EngineConfig` (engine.py) and the machinery that
makes each of its fields a flag, a YAML key and a documented default (settings.py).

Plain Python that imports only the shared modules below it; every other package reads its
settings from here. Choices that are registries of a higher layer (scheduling policies,
attention backends) are named by module and read when a value is checked (`lazy_choices`).
"""

from __future__ import annotations

from conveyor.config.engine import EngineConfig

__all__ = ["EngineConfig"]

"""The gravitational-wave app: BBH detection, CNN against matched filtering."""
from .app import GWApp
from .config import GWConfig

__all__ = ["GWApp", "GWConfig"]

"""The chem app: an ANI-style neural network potential trained on DFT."""
from .app import ChemApp
from .calculator import Calculator
from .config import ChemConfig

__all__ = ["ChemApp", "Calculator", "ChemConfig"]

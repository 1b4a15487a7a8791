"""converge: simulate -> store -> train -> serve -> validate -> benchmark, for neural surrogates."""
__version__ = "0.1.0"

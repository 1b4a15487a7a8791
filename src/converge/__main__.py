"""``python -m converge`` (and ``torchrun -m converge``) runs the command line."""
from .cli import main

main()

"""The name `fadrm serve` was registered under before it moved to `api.serve_command`: an install
made before the move (its entry point metadata still says `api.cli:COMMAND`) keeps finding the
command until it is installed again (`pip install -e .`)."""
from api.serve_command import COMMAND

__all__ = ["COMMAND"]

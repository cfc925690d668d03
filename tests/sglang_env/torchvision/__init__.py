"""Import-only stand-in for torchvision (see tests/sglang_env/README.md)."""

__version__ = "0.0.0+hiradix.standin"

from torchvision import io, transforms  # noqa: F401

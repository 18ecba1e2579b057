"""rapiddiff: Chinese knowledge-enhanced text-to-image generation.

Stages (each a subpackage, imported lazily so ``import rapiddiff`` stays cheap):
``kg`` → ``data``, ``models`` → ``train``, ``infer`` → ``eval``; ``cli`` knows them all.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rapiddiff")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]

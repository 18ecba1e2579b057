"""Forward wrappers on some of a U-Net's modules, installed for one sampling run at a time: the
mechanism the opt-in approximations (:mod:`rapiddiff.models.deep_cache`,
:mod:`rapiddiff.models.token_merge`) share.

A subclass builds its wrappers once (``self._wrapped``: module, wrapper pairs) and installs them
with :meth:`UNetHooks.installed` for one run; afterwards each module's own ``forward`` is back,
so the exact path never runs through a wrapper (and ``torch.compile`` sees one stable function
object per module).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from torch import nn

H = TypeVar("H", bound="UNetHooks")

# controller class → {U-Net → its controller}; weak, so a dropped U-Net takes its controller along
_CONTROLLERS: dict[type, weakref.WeakKeyDictionary[Any, Any]] = {}


class UNetHooks:
    """One U-Net's wrappers and the run they are installed for; get it with :meth:`of`."""

    def __init__(self) -> None:
        self._wrapped: list[tuple[nn.Module, Callable[..., Any]]] = []
        self._installed = False
        self._calls = 0  # U-Net calls in this run, for stepped()

    @classmethod
    def of(cls: type[H], unet: nn.Module) -> H:
        """The controller of ``unet`` (made on first use; the wrappers are built once)."""
        controllers = _CONTROLLERS.setdefault(cls, weakref.WeakKeyDictionary())
        controller = controllers.get(unet)
        if controller is None:
            controller = controllers[unet] = cls(unet)  # type: ignore[call-arg]
        return controller

    @contextlib.contextmanager
    def installed(self, busy: str) -> Iterator[None]:
        """The wrappers in place for one run (``busy``: the error if a run is already on)."""
        if self._installed:
            raise RuntimeError(busy)
        for module, wrapper in self._wrapped:
            module.forward = wrapper
        self._installed, self._calls = True, 0
        try:
            yield
        finally:
            for module, _ in self._wrapped:
                del module.forward  # back to the class's forward: the exact path is untouched
            self._installed = False

    def counted(
        self, fn: Callable[..., Any], evaluations: int, begin: Callable[[int], None]
    ) -> Callable[..., Any]:
        """``fn`` (a U-Net call) that first calls ``begin(i)``, i counting its calls since the run
        began, modulo ``evaluations``: for a loop that makes exactly ``evaluations`` calls per run,
        in order (the GPU-resident loop; a graph capture warms up, then records, and its replays
        call no Python)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            begin(self._calls % evaluations)
            self._calls += 1
            return fn(*args, **kwargs)

        return call


__all__ = ["UNetHooks"]

"""rapiddiff.utils.imports: a module imported with its parent packages' __init__ deferred, on a
package written here (so the test does not depend on a library's layout)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from rapiddiff.utils.imports import import_module


@pytest.fixture
def package(tmp_path, monkeypatch):
    """demo_pkg/ with a zoo/ subpackage whose __init__ imports a heavy module and logs that it ran,
    and lazyzoo/ whose __init__ replaces itself in sys.modules (as diffusers/transformers do)."""
    root = tmp_path / "demo_pkg"
    (root / "zoo").mkdir(parents=True)
    (root / "lazyzoo").mkdir()
    (root / "__init__.py").write_text("RAN = []\n")
    (root / "zoo" / "__init__.py").write_text(
        "from demo_pkg import RAN\nRAN.append('zoo')\nfrom .heavy import HEAVY\nfrom .leaf import LEAF\n"
    )
    (root / "zoo" / "heavy.py").write_text("HEAVY = 'heavy'\n")
    (root / "zoo" / "leaf.py").write_text("from ..other import OTHER\nLEAF = 'leaf' + OTHER\n")
    (root / "other.py").write_text("OTHER = '!'\n")
    (root / "lazyzoo" / "__init__.py").write_text(
        textwrap.dedent(
            """
            import sys, types
            from demo_pkg import RAN
            RAN.append('lazyzoo')
            class _Lazy(types.ModuleType):
                def __getattr__(self, name):
                    if name == 'ANSWER':
                        return 42
                    raise AttributeError(name)
            lazy = _Lazy(__name__)
            lazy.__path__ = __path__
            sys.modules[__name__] = lazy
            """
        )
    )
    (root / "lazyzoo" / "leaf.py").write_text("LEAF = 'lazy leaf'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m == "demo_pkg" or m.startswith("demo_pkg.")]:
        del sys.modules[name]


def test_leaf_without_the_package_init_then_the_package_on_use(package):
    leaf = import_module("demo_pkg.zoo.leaf", defer=["demo_pkg.zoo"])
    import demo_pkg

    assert leaf.LEAF == "leaf!"
    assert demo_pkg.RAN == []
    assert "demo_pkg.zoo.heavy" not in sys.modules
    # first use of a name the package's __init__ defines: it runs, once, in the same module
    from demo_pkg.zoo import HEAVY

    assert HEAVY == "heavy"
    assert demo_pkg.RAN == ["zoo"]
    assert sys.modules["demo_pkg.zoo"].LEAF == "leaf!"
    assert sys.modules["demo_pkg.zoo"] is demo_pkg.zoo
    with pytest.raises(AttributeError):
        demo_pkg.zoo.NOTHING  # noqa: B018
    assert demo_pkg.RAN == ["zoo"]


def test_a_package_that_replaces_itself(package):
    leaf = import_module("demo_pkg.lazyzoo.leaf", defer=["demo_pkg.lazyzoo"])
    import demo_pkg

    assert leaf.LEAF == "lazy leaf"
    assert demo_pkg.RAN == []
    stub = demo_pkg.lazyzoo
    assert stub.ANSWER == 42  # runs the __init__, which puts its own module in sys.modules
    assert demo_pkg.RAN == ["lazyzoo"]
    assert demo_pkg.lazyzoo is sys.modules["demo_pkg.lazyzoo"] is not stub
    assert stub.ANSWER == 42  # the stub others may hold answers through the new module


def test_already_imported_or_missing_packages_are_left_alone(package):
    import demo_pkg.zoo

    assert demo_pkg.RAN == ["zoo"]
    assert import_module("demo_pkg.zoo.leaf", defer=["demo_pkg.zoo"]).LEAF == "leaf!"
    assert import_module("demo_pkg.other", defer=["demo_pkg.nowhere"]).OTHER == "!"
    assert "demo_pkg.nowhere" not in sys.modules


def test_missing_bytecode_names_a_package_without_pyc_until_it_is_compiled(package, monkeypatch):
    import compileall

    from rapiddiff.utils.imports import bytecode_advice, missing_bytecode

    monkeypatch.setattr(sys, "pycache_prefix", None)  # look in __pycache__ beside the source
    assert missing_bytecode(["demo_pkg", "no_such_package_here"]) == ["demo_pkg"]
    advice = bytecode_advice(["demo_pkg"])
    assert "demo_pkg" in advice and f"compileall -q -j 0 {package.parent}" in advice
    assert compileall.compile_dir(str(package), quiet=1)
    assert missing_bytecode(["demo_pkg"]) == [] and bytecode_advice([]) is None

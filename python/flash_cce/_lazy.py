"""Package attributes that import their module on first use (PEP 562), so that
importing a package, or a submodule through it, does not import MLX."""

import importlib


def attributes(package, api):
    """`__getattr__` and `__dir__` for `package` (its `__name__`) whose
    attribute `name` is `name` of its submodule `api[name]`."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name):
        if name not in api:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{api[name]}", package), name)
        namespace[name] = value  # found directly from now on
        return value

    def __dir__():
        return sorted(set(namespace) | set(api))

    return __getattr__, __dir__

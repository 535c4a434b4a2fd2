"""The package's layout: the head at the top of flash_cce, the stack in
flash_cce.stack and the application in flash_cce.train, with no import cycles
between modules (imports inside functions included) and no layer importing one
above it (head <- stack <- train)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "python" / "flash_cce"
PACKAGES = ("flash_cce", "flash_cce.stack", "flash_cce.train")
LAYER = {"head": 0, "stack": 1, "train": 2}


def _module(path):
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports():
    """{module: the flash_cce modules it imports anywhere in its body}."""
    edges = {}
    for path in ROOT.rglob("*.py"):
        name = _module(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                found |= {f"{target}.{a.name}" for a in node.names} if not node.module else {target}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flash_cce"):
                found.add(node.module)
        edges[name] = found - set(PACKAGES)  # a package's own __init__ imports only lazily
    return edges


def _layer(module):
    parts = module.split(".")
    return LAYER.get(parts[1], 0) if len(parts) > 1 else 0


def test_no_import_cycles():
    edges = _imports()
    cycles = []

    def visit(module, path):
        for target in edges.get(module, ()):
            if target in path:
                cycles.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target, path + [target])
        done.add(module)

    done = set()
    for module in sorted(edges):
        visit(module, [module])
    assert not cycles, cycles[0]


def test_no_layer_imports_one_above_it():
    for module, targets in _imports().items():
        for target in targets:
            assert _layer(target) <= _layer(module), f"{module} imports {target}"


def test_the_checks_see_imports_inside_functions():
    """Imports inside functions count: the ones a cycle through them would use."""
    edges = _imports()
    assert "flash_cce.train.preflight" in edges["flash_cce.train.reference"]  # imported inside a function

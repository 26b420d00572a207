"""The product's modules form no import circle (imports inside functions count: they tie the modules as well)."""

import ast

from conftest import ROOT


def product_modules():
    """{module name: path}: the commands at the top level (dlojz*.py) and every module of the dlojz_lib package."""
    modules = {path.stem: path for path in ROOT.glob("dlojz*.py")}
    for path in (ROOT / "dlojz_lib").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def product_imports():
    """{module: the product modules it imports}, for every command and every module of the package."""
    modules = product_modules()
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module)  # from a module import names, or from a package import its modules:
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = sorted(imported & set(modules) - {name})
    return graph


def find_circle(graph):
    """One import circle as a list of modules (first == last), or None."""
    state = {}  # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for target in graph[module]:
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                circle = visit(target, path + [target])
                if circle:
                    return circle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            circle = visit(module, [module])
            if circle:
                return circle
    return None


def test_no_import_circle():
    graph = product_imports()
    assert {"dlojz", "dlojz_lib.config", "dlojz_lib.data.datasets", "dlojz_lib.checks"} <= set(graph)
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle)


def test_the_circle_finder_finds_a_circle():
    assert find_circle({"a": ["b"], "b": ["c"], "c": ["a"], "d": []}) == ["a", "b", "c", "a"]
    assert find_circle({"a": ["b"], "b": [], "c": ["a", "b"]}) is None


def test_the_command_line_modules_import_no_torch():
    """dlojz.py checks its command line before torch's seconds of import: what that check imports must not."""
    import subprocess
    import sys

    code = (
        "import sys, dlojz_lib.flags, dlojz_lib.recipe, dlojz_lib.config, dlojz_lib.checks, dlojz_lib.launch\n"
        "dlojz_lib.flags.get_args_parser().parse_args(['--lr', '0.1'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'torchvision')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout

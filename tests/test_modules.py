"""The shape of the house: no import circle (imports inside functions count: they tie the modules as well), no
import from a layer below, modules and functions within bounds, and docs/architecture.md a true map."""

import ast
import re

import pytest
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
    assert {"dlojz", "dlojz_lib.settings.config", "dlojz_lib.data.datasets", "dlojz_lib.checks"} <= set(graph)
    circle = find_circle(graph)
    assert circle is None, " -> ".join(circle)


# torch's private names dlojz reads (dlojz_lib/torch_internals.py), besides any `torch...._name`
TORCH_PRIVATE = {"_stage", "_stages", "_n_microbatches", "_iterator", "_shutdown_workers", "_get_default_store"}
TORCH_PRIVATE |= {"_flatten"}  # DeviceMesh's
# nn.Module's registries
TORCH_PRIVATE |= {
    "_modules",
    "_parameters",
    "_buffers",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_non_persistent_buffers_set",
}


def torch_private_uses(path):
    """The lines of `path` that reach a private name of torch: an import from a private module of torch, an
    attribute `_name` of a chain that starts at `torch`, or one of TORCH_PRIVATE."""

    def chain_root(node):
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any(n.split(".")[0] == "torch" and any(p.startswith("_") for p in n.split(".")) for n in names):
                found.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if node.attr in TORCH_PRIVATE or chain_root(node) == "torch":
                found.append(node.lineno)
    return found


def test_torch_s_private_names_are_read_in_one_place():
    """What a torch upgrade may break lives in dlojz_lib/torch_internals.py: no other product module reaches a
    private name of torch (the finder sees one planted in a module)."""
    internals = ROOT / "dlojz_lib" / "torch_internals.py"
    elsewhere = {
        str(path.relative_to(ROOT)): lines
        for path in product_modules().values()
        if path != internals and (lines := torch_private_uses(path))
    }
    assert not elsewhere, elsewhere
    assert torch_private_uses(internals)  # it does read them


def test_the_private_name_finder_finds_each_kind(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import torch\nfrom torch._inductor import config\nx = torch._utils._flatten_dense_tensors([])\n"
        "n = schedule._n_microbatches\ny = module.__class__\n"
    )
    assert sorted(torch_private_uses(planted)) == [2, 3, 3, 4]


def room_of(module):
    """The room a module stands in: a sub-package of dlojz_lib (data, optim, parallelism...) is one room, as the
    map draws it; any other module is a room of its own."""
    parts = module.split(".")
    package = ROOT.joinpath(*parts[:2])
    return ".".join(parts[:2]) if len(parts) > 2 and package.is_dir() else module


def test_no_import_runs_back_up_a_floor():
    """With each sub-package one room, the rooms' imports (those inside functions too) make no circle: every room
    stands above all it imports, and no import runs back up a floor. No module is exempt."""
    rooms = {}
    for module, targets in product_imports().items():
        rooms.setdefault(room_of(module), set()).update(room_of(t) for t in targets if room_of(t) != room_of(module))
    circle = find_circle({room: sorted(targets) for room, targets in rooms.items()})
    assert circle is None, " -> ".join(circle)
    assert room_of("dlojz_lib.optim.training") == room_of("dlojz_lib.optim") == "dlojz_lib.optim"
    assert room_of("dlojz_lib.log") == "dlojz_lib.log"


def test_the_circle_finder_finds_a_circle():
    assert find_circle({"a": ["b"], "b": ["c"], "c": ["a"], "d": []}) == ["a", "b", "c", "a"]
    assert find_circle({"a": ["b"], "b": [], "c": ["a", "b"]}) is None


def test_the_command_line_modules_import_no_torch():
    """dlojz.py checks its command line before torch's seconds of import: what that check imports must not."""
    import subprocess
    import sys

    code = (
        "import sys, dlojz_lib.settings.flags, dlojz_lib.settings.recipe, dlojz_lib.settings.config, dlojz_lib.checks, dlojz_lib.settings.launch\n"
        "import dlojz_export\n"  # its --format choices, the export table's rows
        "dlojz_lib.settings.flags.get_args_parser().parse_args(['--lr', '0.1'])\n"
        "dlojz_export.get_parser().parse_args(['CKPT', '-o', 'out', '--format', 'onnx'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'torchvision')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


@pytest.mark.parametrize("package", ["model", "parallelism", "settings", "observers"])
def test_a_package_s_init_names_each_of_its_modules_and_imports_nothing(package):
    """dlojz_lib/parallelism/__init__.py, dlojz_lib/settings/__init__.py and dlojz_lib/observers/__init__.py are
    their folders' doors: each docstring names every module in the folder, and imports none of them (a reader of one
    pays for no other; settings' flags stay torch-free)."""
    init = ROOT / "dlojz_lib" / package / "__init__.py"
    tree = ast.parse(init.read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    modules = {path.stem for path in init.parent.glob("*.py")} - {"__init__"}
    doc = ast.get_docstring(tree)
    assert modules and all(f"`{name}`" in doc for name in modules), (sorted(modules), doc)


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def listed_floors(text):
    """{room: floor} from docs/architecture.md's floor table (rows `| N: name | `room`, `room` |`)."""
    section = text.split("## The floors", 1)[1].split("\n## ", 1)[0]
    floors = {}
    for number, rooms in re.findall(r"^\| (\d+)[^|]*\| (.+) \|$", section, re.M):
        for room in re.findall(r"`([\w.]+)`", rooms):
            assert room not in floors, f"{room} listed twice"
            floors[room] = int(number)
    return floors


def imports_up_or_sideways(graph, floors):
    """'module (floor) imports target (floor)' for each import that does not run down a floor."""
    return [
        f"{module} (floor {floors[room_of(module)]}) imports {target} (floor {floors[room_of(target)]})"
        for module, targets in graph.items()
        for target in targets
        if room_of(target) != room_of(module) and floors[room_of(target)] >= floors[room_of(module)]
    ]


def test_every_import_runs_down_the_floors():
    """docs/architecture.md lists every room on one floor, and every import (inside functions too) goes from a room
    to a room on a floor below it. No module is exempt."""
    graph = product_imports()
    floors = listed_floors(ARCHITECTURE.read_text())
    rooms = {room_of(module) for module in graph}
    assert rooms - set(floors) == set(), f"rooms missing from the floor table: {sorted(rooms - set(floors))}"
    assert set(floors) - rooms == set(), f"the floor table names no such room: {sorted(set(floors) - rooms)}"
    assert not imports_up_or_sideways(graph, floors)


def test_the_floor_rule_finds_an_import_that_runs_up():
    floors = listed_floors(ARCHITECTURE.read_text())
    graph = {"dlojz_lib.data.datasets": ["dlojz_lib.settings.flags"], "dlojz_lib.checks": [], "dlojz": ["dlojz_lib"]}
    assert imports_up_or_sideways(graph, floors) == [
        "dlojz_lib.data.datasets (floor 5) imports dlojz_lib.settings.flags (floor 8)"
    ]
    assert imports_up_or_sideways({"dlojz_lib.dist": ["dlojz_lib.lab.sweep"]}, floors)  # the same floor: sideways
    assert floors["dlojz"] > floors["dlojz_lib.run_record"] > floors["dlojz_lib.checks"] == 0


MAX_MODULE_LINES = 650
MAX_FUNCTION_LINES = 80
FLAG_TABLE = ("dlojz_lib/settings/flags.py", "get_args_parser")  # only a table: one add_argument after the other


def sizes(path):
    """(the module's lines outside the flag table, {function: its lines}) of a product file."""
    tree = ast.parse(path.read_text())
    functions = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    lines = path.read_text().count("\n")
    if path.relative_to(ROOT).as_posix() == FLAG_TABLE[0]:
        lines -= functions.pop(FLAG_TABLE[1])
    return lines, functions


def test_modules_and_functions_stay_within_bounds():
    """No product module over 650 lines, no function over 80 (a docstring counts: what a reader scrolls through)."""
    over = []
    for name, path in sorted(product_modules().items()):
        lines, functions = sizes(path)
        if lines > MAX_MODULE_LINES:
            over.append(f"{path.relative_to(ROOT)}: {lines} lines")
        if name == "dlojz":
            functions.pop("main")  # the course's main(): its own bound, below
        over += [f"{path.relative_to(ROOT)}: {f}() {n} lines" for f, n in functions.items() if n > MAX_FUNCTION_LINES]
    assert not over, over


def functions_taking_the_whole_config():
    """'path: function' for each product function with a `cfg` parameter (the whole Config)."""
    found = []
    for path in product_modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if "cfg" in [argument.arg for argument in arguments]:
                    found.append(f"{path.relative_to(ROOT)}: {node.name}")
    return sorted(found)


MAX_WHOLE_CONFIG_TAKERS = 27  # (59 before the builders took their sections, 29 before the layout's record, 28 before the loop took its values)


def test_builders_take_their_settings_not_the_whole_config():
    """A function takes the settings it reads (a --help group's section: `cfg.section("logging")`, or the values),
    not the whole Config: at most MAX_WHOLE_CONFIG_TAKERS of them do (the run's sections that read many groups)."""
    takers = functions_taking_the_whole_config()
    assert len(takers) <= MAX_WHOLE_CONFIG_TAKERS, takers
    assert "dlojz_lib/model/build.py: build_model" in takers  # the finder finds them


MAX_COMPLEXITY = 15  # mccabe's, as ruff counts it (pyproject.toml's max-complexity): the layout's and settings' rooms
SIMPLE_ROOMS = ("dlojz_lib/parallelism", "dlojz_lib/settings")


def over_complexity(paths, bound=MAX_COMPLEXITY) -> list:
    """ruff's C901 findings (`path:line: function`) over `bound` in `paths`."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "ruff", "check", "--select", "C901", "--output-format", "concise", "--quiet"]
    command += ["--config", f"lint.mccabe.max-complexity={bound}", "--exit-zero", *paths]
    found = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    return [line for line in found.splitlines() if "C901" in line]


def test_the_layout_and_the_settings_have_no_function_over_mccabe_s_bound():
    """No function of dlojz_lib/parallelism/ and dlojz_lib/settings/ over complexity 15 (the resolver and the
    layout's rules one check a topic); the count sees a function over a lower bound."""
    assert not over_complexity(SIMPLE_ROOMS), over_complexity(SIMPLE_ROOMS)
    assert any("resolve_config" in line for line in over_complexity(["dlojz_lib/settings/config.py"], bound=5))


def test_the_model_s_build_and_layout_stay_small():
    """Build the model, then lay it out: each a page (60 lines at most), the pipeline's builder a few parameters
    (a PipelineCut holds what the --pp flags say), the chronometer's class one that the course reads (250 lines)."""
    found = {}
    for path, names in (
        ("dlojz_lib/model/build.py", ("build_model",)),
        ("dlojz_lib/parallelism/layout.py", ("lay_out",)),
        ("dlojz_lib/parallelism/pipeline.py", ("build_pipeline",)),
        ("dlojz_lib/observers/chrono.py", ("Chronometer",)),
    ):
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
                found[node.name] = node
    lines = {name: node.end_lineno - node.lineno + 1 for name, node in found.items()}
    assert lines["build_model"] <= 60 and lines["lay_out"] <= 60 and lines["Chronometer"] <= 250, lines
    pipeline = found["build_pipeline"].args
    assert len(pipeline.posonlyargs + pipeline.args + pipeline.kwonlyargs) <= 6


def test_the_course_main_stays_on_a_few_screens():
    """dlojz.py's main() reads top to bottom in the course's order: at most 100 lines, each section one call."""
    _, functions = sizes(ROOT / "dlojz.py")
    assert functions["main"] <= 100, functions["main"]


def package_files():
    """The package's modules (and the C decoder) by their paths from the root: what the maps must name."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "dlojz_lib").rglob("*") if p.suffix in (".py", ".c")}


def test_the_module_map_names_every_module_and_only_modules():
    """docs/architecture.md is the one map: every module of dlojz_lib/ (and the C decoder) is named there by its
    path, and every dlojz_lib path named there exists."""
    text = ARCHITECTURE.read_text()
    named = set(re.findall(r"`(dlojz_lib/[\w/]+(?:\.py|\.c)?)/?`", text))
    files = package_files()
    assert files - named == set(), f"not in docs/architecture.md: {sorted(files - named)}"
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"
    for pointer in (ROOT / "README.md", ROOT / "dlojz_lib" / "__init__.py"):
        assert "docs/architecture.md" in pointer.read_text(), f"{pointer.name} does not point to the map"


TESTING = ROOT / "docs" / "testing.md"
TEST_ROW = re.compile(r"^\| `(dlojz_lib/[\w/]+\.(?:py|c))` \| (.*) \|$", re.M)


def names_module(module, text):
    """Whether a test file's text names a module of the package: by its path (`dlojz_lib/data/jpeg.py`), its dotted
    name (`dlojz_lib.data.jpeg`) or an import of it (`from dlojz_lib.data import jpeg`); a package by its folder."""
    if module.endswith("__init__.py"):
        package = module[: -len("/__init__.py")]
        patterns = [re.escape(package + "/"), rf"\b{re.escape(package.replace('/', '.'))}\b(?![.\w])"]
    else:
        patterns = [re.escape(module)]
        if module.endswith(".py"):
            parent, name = module[:-3].replace("/", ".").rsplit(".", 1)
            patterns += [rf"\b{re.escape(parent)}\.{name}\b", rf"from {re.escape(parent)} import [^\n]*\b{name}\b"]
    return any(re.search(pattern, text) for pattern in patterns)


def map_errors(text):
    """What is wrong with docs/testing.md's map from the package's modules to their tests: a module without a row,
    a test file that does not exist, or one that does not name the module it is listed for."""
    rows = {module: re.findall(r"`(tests/[\w/]+\.py)`", tests) for module, tests in TEST_ROW.findall(text)}
    files = package_files()
    errors = [f"{module}: no row" for module in sorted(files - set(rows))]
    errors += [f"{module}: no module of that name" for module in sorted(set(rows) - files)]
    for module, tests in sorted(rows.items()):
        if not tests:
            errors.append(f"{module}: no test file named")
        for test in tests:
            if not (ROOT / test).is_file():
                errors.append(f"{module}: {test} does not exist")
            elif not names_module(module, (ROOT / test).read_text()):
                errors.append(f"{module}: {test} does not name it")
    return errors


def test_the_test_map_gives_every_module_test_files_that_name_it():
    """docs/testing.md maps each module of dlojz_lib/ to the test files that test it, each naming it (a newcomer
    finds a module's tests by its row, and a row cannot point at a file that has stopped testing it)."""
    errors = map_errors(TESTING.read_text())
    assert not errors, "docs/testing.md's map from modules to tests:\n" + "\n".join(errors)


def test_the_test_map_check_sees_a_missing_row_and_a_wrong_file():
    text = TESTING.read_text()
    without = TEST_ROW.sub(lambda row: "" if row.group(1) == "dlojz_lib/observers/chrono.py" else row.group(0), text)
    assert "dlojz_lib/observers/chrono.py: no row" in map_errors(without)
    wrong = text.replace(
        "| `dlojz_lib/parallelism/fsdp.py` | `", "| `dlojz_lib/parallelism/fsdp.py` | `tests/test_docs.py`, `", 1
    )
    assert "dlojz_lib/parallelism/fsdp.py: tests/test_docs.py does not name it" in map_errors(wrong)
    gone = text.replace(
        "| `dlojz_lib/parallelism/fsdp.py` | `",
        "| `dlojz_lib/parallelism/fsdp.py` | `tests/parallelism/test_gone.py`, `",
        1,
    )
    assert "dlojz_lib/parallelism/fsdp.py: tests/parallelism/test_gone.py does not exist" in map_errors(gone)

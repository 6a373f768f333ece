"""The package's layers import downward only, with no import cycle; no function is over 100
lines; the outline ``grpo_fast/train.py`` stays short. Static: the modules are parsed, not
imported (every ``import`` statement counts, in a function body too, except under
``if TYPE_CHECKING:``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The floors, lowest first: a module may import its own floor and the floors below it. A module
# takes the floor of the longest prefix that names it.
FLOORS: dict[str, int] = {
    "grpo_fast.errors": 0,
    "grpo_fast.dist": 0,
    "grpo_fast.domains": 0,
    "grpo_fast.threads": 0,  # threads and OpenMP wait (standard library; before torch loads)
    "grpo_fast": 1,  # the package itself re-exports the algorithm (grpo_fast/__init__.py)
    "grpo_fast.algo": 1,  # the algorithm and its eager reference
    "grpo_fast.sandbox": 1,  # worker processes, the code sandbox, the pool (standard library)
    "csrc_triton": 2,  # Triton kernels
    "grpo_fast.ops": 2,  # the fused ops
    "grpo_fast.env": 2,  # tool environments (python, calculator): what a turn asks, what comes back
    "grpo_fast.rollout": 3,  # rollout backends (they take the config as a plain object)
    "grpo_fast.task": 3,  # data, prompts, rewards, the tiny task
    "grpo_fast.obs.health": 3,
    "grpo_fast.obs.memory": 3,
    "grpo_fast.config": 4,  # the config: its sections assembled, loaded, checked
    "grpo_fast.config_sections": 4,  # the config's section tables: domains from the floors below
    "grpo_fast.config_parse": 4,  # YAML files and key=value overrides into config trees
    "grpo_fast.presets": 4,  # the presets: values over the config's defaults
    "grpo_fast.config_checks": 4,  # the config's checks (relations between keys, the machine)
    "grpo_fast.config_checks_rollout": 4,  # the rollout's: backends, placement, pipeline, fleet, tools
    "grpo_fast.task.loader": 5,  # load_task reads the config
    "grpo_fast.obs": 5,  # metrics, report, sweep
    "grpo_fast.policy": 5,  # model loading, PolicyLoss, microbatches, checkpoints
    "grpo_fast.tools": 6,  # planner, evaluation, doctor, dry run
    "grpo_fast.loop": 7,  # the training loop's phases
    "grpo_fast.train": 8,  # the outline
    "grpo_fast.testing": 8,
    "grpo_fast.plan": 8,  # python -m entry modules
    "grpo_fast.evaluate": 8,
    "grpo_fast.doctor": 8,
    "grpo_fast.report": 8,
    "grpo_fast.sweep": 8,
    "grpo_fast.cli": 9,  # the top floor
}


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("grpo_fast", "csrc_triton"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _floor(module: str) -> int:
    best = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[best]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    return skip


def imports_of(module: str) -> set[str]:
    """The project modules ``module`` imports (a name imported from a package resolves to its
    submodule when there is one)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).strip(".")
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_the_floor_table_names_every_module():
    for module in MODULES:
        assert any(module == p or module.startswith(p + ".") for p in FLOORS), module


def test_imports_go_downward_only():
    upward = [
        f"{m} (floor {_floor(m)}) imports {t} (floor {_floor(t)})"
        for m, targets in GRAPH.items()
        for t in sorted(targets)
        if _floor(t) > _floor(m)
    ]
    assert upward == []


def test_nothing_imports_the_cli():
    assert [m for m, targets in GRAPH.items() if "grpo_fast.cli" in targets] == []


PARALLELISM = {"grpo_fast.policy.fsdp", "grpo_fast.policy.sequence_parallel", "grpo_fast.policy.ulysses"}


def test_the_loop_asks_parallelism_of_one_module():
    """The loop and the outline reach DDP, FSDP and sequence parallelism through
    ``grpo_fast.policy.parallel`` alone, applied once at setup (planted: ``from grpo_fast.policy
    import fsdp`` in loop/optimization.py, as at ed0dfd1 → listed)."""
    loop = [m for m in GRAPH if m.startswith("grpo_fast.loop") or m == "grpo_fast.train"]
    assert [f"{m} imports {t}" for m in loop for t in sorted(GRAPH[m] & PARALLELISM)] == []
    assert "grpo_fast.policy.parallel" in GRAPH["grpo_fast.loop.optimization"]


def test_only_dist_knows_the_ddp_wrapper():
    """The module under a DDP wrapper is ``grpo_fast.dist.unwrap``'s one ``getattr(x, "module", x)``
    (``policy.parallel.unwrap`` is it): no other module of the package reads the wrapper's
    ``.module`` (at ed0dfd1: 17 places; planted: one put back in policy/lora.py → listed)."""
    found = [
        f"{m}:{node.lineno}"
        for m, path in MODULES.items()
        if m != "grpo_fast.dist"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value == "module"
    ]
    assert found == []


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles():
    assert _cycle(GRAPH) is None, " -> ".join(_cycle(GRAPH))


def test_the_cycle_finder_finds_a_planted_cycle():
    """Planted: a → b → c → a (and a DAG beside it) is found; the real graph plus one upward edge
    from the planner to the loop closes a cycle through loop/setup."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    planted = {m: set(t) for m, t in GRAPH.items()}
    planted["grpo_fast.tools.plan"].add("grpo_fast.loop.setup")
    assert _cycle(planted) is not None


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("grpo_fast")))
def test_no_function_is_over_100_lines(module):
    tree = ast.parse(MODULES[module].read_text())
    long = [
        f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > 100
    ]
    assert long == []


def test_the_outline_is_short():
    assert len((ROOT / "grpo_fast" / "train.py").read_text().splitlines()) <= 700


def test_the_readme_layout_lists_the_floors_from_the_bottom():
    """README's Layout names the package's parts in their floor order (a part listed later never
    sits on a lower floor), and every floor of ``FLOORS`` but the entry modules is in it."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout") : text.index("\nOutside the package:")]
    listed = []
    for line in section.splitlines():
        if line.startswith("- "):
            for path in (p.strip("`") for p in line[2:].split(" — ")[0].split(", ")):
                name = path.removesuffix(".py").removesuffix("/").replace("/", ".")
                listed.append(name if name.startswith(("grpo_fast", "csrc_triton")) else f"grpo_fast.{name}")
    floors = [_floor(name) for name in listed]
    assert floors == sorted(floors), list(zip(listed, floors))
    assert {_floor(name) for name in listed} >= {f for f in FLOORS.values() if f != 8}

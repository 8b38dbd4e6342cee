"""The package's import graph: no cycles, the Mosaic kernels do not import the Triton ones, and
each job sits in its module (tiles in the backend packages, the autotune cache apart).

Read statically from the sources (every `import` and `from ... import`, at module level or inside
a function), so that a cycle hidden behind a function-level import fails too, and no module is
imported (the Flax layers would need Flax).
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pallas_flash"


def module_files() -> dict[str, pathlib.Path]:
    """{dotted module name: file} for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported_modules(path: pathlib.Path, name: str, modules) -> set[str]:
    """The package's modules that the file at `path` (module `name`) imports anywhere."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + is_package]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod.
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(path, name, modules) for name, path in modules.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module that importing `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state = {}  # 1: on the current path, 2: done
    path = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_is_read():
    graph = import_graph()
    assert "pallas_flash.mosaic.tiles" in graph["pallas_flash.mosaic.backward"]
    assert "pallas_flash.mosaic.schedule" in graph["pallas_flash.mosaic.forward"]
    assert "pallas_flash._numerics" in graph["pallas_flash.mosaic.forward"]
    assert "pallas_flash.api" in graph["pallas_flash"]


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_reachable_follows_imports_through_others():
    graph = {"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}
    assert reachable(graph, "a") == {"b", "c"}
    assert reachable(graph, "c") == set()


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_mosaic_kernels_do_not_import_triton():
    """The Mosaic package imports nothing of the Triton kernels' (pallas_flash.triton), directly
    or through others: it takes the numerics they share from pallas_flash._numerics, and its one
    Triton-lowered piece (the fixed-point scales) its loads and params from
    pallas_flash._pallas_triton, which imports nothing of the package."""
    graph = import_graph()
    assert not {n for n in graph["pallas_flash._pallas_triton"] if n.startswith("pallas_flash")}
    for name in graph:
        if name.startswith("pallas_flash.mosaic"):
            triton = sorted(
                m for m in reachable(graph, name) if m.startswith("pallas_flash.triton")
            )
            assert not triton, f"{name} imports {triton}"


def test_the_dispatch_sits_above_the_backends():
    """One choice of kernels: `dispatch` reads the backends; the backends, the Call and the
    Device record read nothing that chooses."""
    graph = import_graph()
    assert {"pallas_flash.mosaic", "pallas_flash.triton", "pallas_flash._passes"} <= graph[
        "pallas_flash.dispatch"
    ]
    for user in ("pallas_flash.api", "pallas_flash.decode", "pallas_flash.tune"):
        assert "pallas_flash.dispatch" in graph[user], user
    # Ragged attention chooses its backend through decode's options (`decode._Options`).
    assert "pallas_flash.decode" in graph["pallas_flash.ragged"]
    choosers = {
        "pallas_flash.api",
        "pallas_flash.dispatch",
        "pallas_flash._vjp",
        "pallas_flash._passes",
        "pallas_flash.tune",
        "pallas_flash.decode",
        "pallas_flash.ragged",
    }
    for name, imported in graph.items():
        if name.startswith(("pallas_flash.mosaic", "pallas_flash.triton")):
            assert not imported & choosers, f"{name} imports {sorted(imported & choosers)}"
    assert graph["pallas_flash.device"] == set()
    assert graph["pallas_flash.call"] == {"pallas_flash.masks"}


def test_a_pass_goes_down_one_way():
    """`_vjp` (flash attention) and `decode` (the decode kernel) hand each pass to `_partition`,
    which runs it per shard through `_passes`, which calls the backends' wrappers: `_passes`
    imports none of the modules above it (nor the API or the dispatch), `_partition` imports no
    pass and no kernel, and `decode` calls no kernel wrapper itself, so no call returns into its
    caller's module."""
    graph = import_graph()
    for caller in ("pallas_flash._vjp", "pallas_flash.decode"):
        assert {"pallas_flash._partition", "pallas_flash._passes"} <= graph[caller], caller
    above = {"pallas_flash._vjp", "pallas_flash._partition", "pallas_flash.dispatch"}
    above |= {"pallas_flash.api", "pallas_flash.decode", "pallas_flash.ragged"}
    assert not reachable(graph, "pallas_flash._passes") & above
    assert {"pallas_flash.mosaic", "pallas_flash.triton"} <= graph["pallas_flash._passes"]
    assert "pallas_flash.triton.decode" in graph["pallas_flash._passes"]
    assert "pallas_flash.triton.decode" not in graph["pallas_flash.decode"]
    kernels = {n for n in graph if n.startswith(("pallas_flash.mosaic", "pallas_flash.triton"))}
    assert not reachable(graph, "pallas_flash._partition") & (kernels | above)
    # What each caller hands `_partition.partitioned` to run per shard is a pass of `_passes`.
    handed = {}
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            func = getattr(node, "func", None)
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "partitioned"
                and isinstance(func.value, ast.Name)
                and func.value.id == "_partition"
            ):
                handed.setdefault(name, set()).add(ast.unparse(node.args[0]))
    assert handed == {
        "pallas_flash._vjp": {"_passes.forward", "_passes.backward"},
        "pallas_flash.decode": {"_passes.decode"},
    }


def test_tiles_and_the_autotune_cache_live_apart():
    """The Triton tiles and heuristics live in the Triton package, the autotune cache in
    `tune_cache`; neither asks the device anything (the Device record carries it)."""
    graph = import_graph()
    assert "pallas_flash.config" not in graph, (
        "pallas_flash/config.py is back: Triton tiles belong in triton/tiles.py, the autotune "
        "cache in tune_cache.py, device facts in device.py"
    )
    assert graph["pallas_flash.triton.tiles"] == set(), "the tile tables are data and heuristics"
    assert "pallas_flash.device" not in graph["pallas_flash.tune_cache"]
    assert "pallas_flash.tune_cache" in graph["pallas_flash.dispatch"]


def test_kernels_do_not_read_the_autotune_cache():
    """The dispatch looks the cache up and hands the tiles on; no module of a backend package
    (kernels or the protocol) imports the cache, directly or through others."""
    graph = import_graph()
    for name in graph:
        if name.startswith(("pallas_flash.mosaic", "pallas_flash.triton")):
            assert "pallas_flash.tune_cache" not in reachable(graph, name), name


def test_mosaic_tiles_and_schedule_sit_below_the_kernels():
    """The Mosaic package's tiles and budgets import nothing of the package (the backward's,
    only the forward's and the fixed point's range); the schedule plans from the tiles only; the
    kernels (the forward, the backward's wrapper and its dK/dV, dQ and fused dQ) import them,
    the launch and their shared pieces, never the other way."""
    graph = import_graph()
    assert not {n for n in graph["pallas_flash.mosaic.tiles"] if n.startswith("pallas_flash")}
    # The backward's tiles read the forward's and the fixed point's range, nothing else.
    assert graph["pallas_flash.mosaic.backward_tiles"] <= {
        "pallas_flash.mosaic.tiles",
        "pallas_flash.mosaic.fixed_point",
    }
    kernels = {
        f"pallas_flash.mosaic.{name}" for name in ("forward", "backward", "dkv", "dq", "fused_dq")
    }
    for name in (
        "pallas_flash.mosaic.schedule",
        "pallas_flash.mosaic.launch",
        "pallas_flash.mosaic._kernel_common",
        "pallas_flash.mosaic.backward_tiles",
    ):
        assert not graph[name] & kernels, (name, graph[name])

"""One definition of who sees whom, and a cache that is its own (docs/design.md sections 2 and 5): every ForwardPlan
is made in r2lm/plan.py, from a Layout's predicate; no code outside r2lm/cache.py assigns a KVCache's fields. Each
check reads the sources with ast, and is shown to fail on a source that breaks it."""

import ast

from tests.helpers import REPO

SOURCES = [path for folder in ("r2lm", "eval", "train", "tests") for path in sorted((REPO / folder).rglob("*.py"))]


def plan_constructions(source: str) -> list[int]:
    """Lines of `source` that call ForwardPlan(...) (by name or as an attribute of a module)."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call) and
            (getattr(node.func, "id", None) == "ForwardPlan" or getattr(node.func, "attr", None) == "ForwardPlan")]


def cache_fields() -> set[str]:
    """What a KVCache holds: every attribute its methods assign on self, and its properties."""
    cls = next(node for node in ast.parse((REPO / "r2lm" / "cache.py").read_text()).body
               if isinstance(node, ast.ClassDef) and node.name == "KVCache")
    fields = {node.name for node in cls.body if isinstance(node, ast.FunctionDef) and
              any(getattr(d, "id", None) == "property" for d in node.decorator_list)}
    for node in ast.walk(cls):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
                fields.add(target.attr)
    return fields


def _targets(node) -> list[ast.expr]:
    """The expressions an assignment statement stores to (tuple targets unpacked, subscripts down to their base)."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, ast.AugAssign | ast.AnnAssign) else []
    out = []
    for target in targets:
        for part in target.elts if isinstance(target, ast.Tuple | ast.List) else [target]:
            while isinstance(part, ast.Subscript | ast.Starred):
                part = part.value
            out.append(part)
    return out


def cache_field_stores(source: str, fields: set[str]) -> list[str]:
    """Assignments in `source` to an attribute of a KVCache: any attribute stored on a receiver that is a cache (named
    so: `cache`, `self.cache`, `row_cache`, a DraftContext's `kv`, or a name bound to KVCache(...) / new_cache(...)),
    and a private field of `fields` stored on anything but `self`."""
    tree = ast.parse(source)
    made = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and (getattr(node.value.func, "id", None) or getattr(node.value.func, "attr", None)) in ("KVCache", "new_cache")
            for target in _targets(node) if isinstance(target, ast.Name)}
    stores = []
    for node in ast.walk(tree):
        for target in _targets(node):
            if not isinstance(target, ast.Attribute):
                continue
            name = getattr(target.value, "id", None) or getattr(target.value, "attr", "")
            private = target.attr in fields and target.attr.startswith("_") and name != "self"
            if private or "cache" in name.lower() or name == "kv" or name in made:
                stores.append(f"{node.lineno}: {ast.unparse(target)}")
    return stores


def test_every_forward_plan_is_made_in_plan_py():
    made = {str(path.relative_to(REPO)): lines for path in SOURCES
            if path != REPO / "r2lm" / "plan.py" and (lines := plan_constructions(path.read_text()))}
    assert made == {}


def test_the_plan_check_finds_a_plan_made_elsewhere():
    assert plan_constructions("plan = ForwardPlan(cos=cos, sin=sin, mask=None)\n") == [1]
    assert plan_constructions("import r2lm.plan\n\nplan = r2lm.plan.ForwardPlan(cos, sin, None)\n") == [3]
    assert plan_constructions("plan = plan_of(config, rotary, layout)\n\ndef f(p: ForwardPlan): ...\n") == []


def test_no_code_outside_the_cache_assigns_its_fields():
    fields = cache_fields()
    assert {"length", "next_position", "valid", "_length", "_stale_end"} <= fields  # the reader sees them
    stores = {str(path.relative_to(REPO)): found for path in SOURCES if path != REPO / "r2lm" / "cache.py" and
              (found := cache_field_stores(path.read_text(), fields))}
    assert stores == {}


def test_the_cache_check_finds_every_kind_of_store():
    fields = cache_fields()
    broken = """
cache.length = 3
self.cache.stale_end = 4
reader.cache.length, reader.cache.next_position = 1, position
context.kv.valid[:, 0] = True
anything._length += 1
batch = KVCache(config, 2, 8, dtype, device)
batch.length = 2
"""
    assert cache_field_stores(broken, fields) == [
        "2: cache.length", "3: self.cache.stale_end", "4: reader.cache.length", "4: reader.cache.next_position",
        "5: context.kv.valid", "6: anything._length", "8: batch.length"]
    fine = ("self.length = None\nself._length = 0\ncache.advance(2)\ncache.rewind(4)\nshape.valid = mask\n"
            "reader.cache = cache\nself.caches[rows] = cache\nself._stale = 1\n")
    assert cache_field_stores(fine, fields) == []

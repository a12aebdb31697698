"""The field walk (issue 26): every field of every request model has an effect a named test
shows, or is on the accepted-and-inert list with a reason, and docs/compatibility.md says
which, row by row. A field added without its row fails here; so does a stale row, an inert
or refused reason that differs from the code's, or a named test that does not exist or never
mentions the field.

The models are found by walking `StrictModel`'s subclasses in the modules that define request
models; an AST scan of router/ and worker/ makes sure no other pydantic model takes a body.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import types
import typing
from functools import cache
from pathlib import Path

import pytest
from pydantic import BaseModel

from worker.protocol.strict import INERT, MEDIA, NEUTRAL, REFUSED, SPECULATIVE, StrictModel

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "compatibility.md"
REQUEST_MODULES = ("worker.protocol.wire", "worker.protocol.profile_log", "worker.server.embeddings",
                   "router.responses.wire", "router.anthropic.wire", "router.http.admin",
                   "worker.server.slot_actions", "worker.protocol.speech", "router.speech.wire",
                   "router.ollama.wire", "router.hub.routes")
# pydantic models that are not request bodies (or only wrap StrictModel items)
NOT_REQUEST_MODELS = {"StrictModel", "OpenAIBaseModel", "_Items"}
# honoured, and no test can show it on the models the suite has (say why in the doc's row)
UNTESTED = {"TokenizeRequest.add_special"}

FIELD_ROW = re.compile(r"^\| `(\w+\.\w+)` \| (honoured|inert) \| (.+) \|$")
REFUSED_ROW = re.compile(r"^\| `(\w+)` \| refused \| (.+) \|$")
NEUTRAL_ROW = re.compile(r"^\| `(\w+)` \| `([^`]+)` \|$")
TEST_REF = re.compile(r"^`(tests/[\w/]+\.py)::(test_\w+)`$")


def _subclasses(cls: type) -> typing.Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


@cache
def walked_fields() -> dict[str, tuple[str, typing.Any]]:
    """`Model.field` (the model that declares it) -> (its name on the wire, its annotation)."""
    for m in REQUEST_MODULES:
        importlib.import_module(m)
    out: dict[str, tuple[str, typing.Any]] = {}
    for model in _subclasses(StrictModel):
        for name, info in model.model_fields.items():
            owner = next(k for k in model.__mro__ if name in inspect.get_annotations(k))
            out[f"{owner.__name__}.{name}"] = (info.alias or name, info.annotation)
    return out


@cache
def doc_rows() -> dict[str, tuple[str, str]]:
    rows: dict[str, tuple[str, str]] = {}
    for line in DOC.read_text().splitlines():
        if m := FIELD_ROW.match(line):
            assert m.group(1) not in rows, f"two rows for {m.group(1)}"
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


@cache
def _test_names(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_request_field_has_a_row_and_every_row_a_field() -> None:
    fields, rows = set(walked_fields()), set(doc_rows())
    assert len(fields) > 200  # the walk found the models
    assert not fields - rows, f"fields with no row in docs/compatibility.md: {sorted(fields - rows)}"
    assert not rows - fields, f"rows for fields the code does not have: {sorted(rows - fields)}"


def test_inert_rows_are_the_codes_inert_list_with_its_reasons() -> None:
    inert = {k: reason for k, (status, reason) in doc_rows().items() if status == "inert"}
    assert inert == INERT
    assert set(INERT) <= set(walked_fields())


@pytest.mark.parametrize("key", sorted(k for k, (status, _) in doc_rows().items() if status == "honoured"))
def test_each_honoured_field_names_a_test_that_exists_and_uses_it(key: str) -> None:
    proof = doc_rows()[key][1]
    name, annotation = walked_fields()[key]
    if proof.startswith("kind:"):  # a discriminator: its value selects the model
        is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)] if is_union else [annotation]
        assert name == "type" and all(typing.get_origin(a) is typing.Literal for a in kinds), key
        return
    if proof.startswith("untested:"):
        assert key in UNTESTED, f"{key}: say which test shows its effect"
        return
    m = TEST_REF.match(proof)
    assert m, f"{key}: the proof must be `tests/...py::test_name`, got {proof!r}"
    path, test = m.groups()
    assert (ROOT / path).is_file() and test in _test_names(path), f"{key}: {path}::{test} does not exist"
    uses = re.search(rf"[\"']{name}[\"']|\b{name}=", (ROOT / path).read_text())
    assert uses, f"{path} never sends {name!r}"


def test_refused_rows_are_the_codes_refused_list() -> None:
    rows = {m.group(1): m.group(2) for line in DOC.read_text().splitlines() if (m := REFUSED_ROW.match(line))}
    assert rows == REFUSED
    assert set(SPECULATIVE) | set(MEDIA) <= set(REFUSED)
    names = {name for name, _ in walked_fields().values()}
    # a field not implemented yet is no model's field (declaring it means someone implemented
    # it: delete its line from strict.SPECULATIVE / strict.MEDIA and from the doc)
    assert not (set(SPECULATIVE) | set(MEDIA)) & names


def test_off_value_rows_are_the_codes_neutral_list() -> None:
    rows = {m.group(1): json.loads(m.group(2)) for line in DOC.read_text().splitlines()
            if (m := NEUTRAL_ROW.match(line))}
    assert rows == NEUTRAL


def test_route_proofs_exist() -> None:
    refs = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", DOC.read_text())
    for path, test in refs:
        assert (ROOT / path).is_file() and test in _test_names(path), f"{path}::{test}"


def test_no_other_pydantic_model_takes_a_request_body() -> None:
    """The one rule has one place: a pydantic model in router/ or worker/ derives from
    StrictModel (directly or through a model that does), or is on NOT_REQUEST_MODELS."""
    strict = {c.__name__ for c in _subclasses(StrictModel)} | {"StrictModel"}
    walked_fields()
    loose = []
    for path in [*(ROOT / "router").rglob("*.py"), *(ROOT / "worker").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name in strict | NOT_REQUEST_MODELS:
                continue
            if any(isinstance(b, ast.Name) and b.id in ("BaseModel", "OpenAIBaseModel") for b in node.bases):
                loose.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not loose, loose
    assert issubclass(StrictModel, BaseModel) and StrictModel.model_config.get("extra") == "forbid"

"""The API reference (docs/api.md, built by ``make test`` with ``mkdocs build --strict``)
documents every public name: each one, and each public method and property of the public
classes, says what it is for in a docstring, which mkdocstrings renders."""

from __future__ import annotations

import enum
import inspect
import pathlib
import re

import cbgen

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def undocumented(name: str, obj: object) -> list[str]:
    own = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__  # not inherited
    missing = [] if (own or "").strip() else [name]
    if not inspect.isclass(obj) or issubclass(obj, enum.Enum):
        return missing
    for attr, member in vars(obj).items():
        if attr.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property) or inspect.isfunction(member):
            if not (member.__doc__ or "").strip():
                missing.append(f"{name}.{attr}")
    return missing


def test_every_public_name_and_member_has_a_docstring():
    missing = [m for name in cbgen.__all__ for m in undocumented(name, getattr(cbgen, name))]
    assert missing == []


def test_the_check_sees_a_method_without_a_docstring():
    class Documented:
        """Has a docstring."""

        def method(self) -> None:
            pass

        @property
        def value(self) -> int:
            """Documented."""
            return 1

    assert undocumented("Documented", Documented) == ["Documented.method"]


def test_the_api_page_lists_every_public_name():
    listed = set(re.findall(r"^::: cbgen\.(\w+)$", (DOCS / "api.md").read_text(), re.M))
    assert listed == set(cbgen.__all__)

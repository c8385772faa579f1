"""What an image's install pulls in: the transitive requirements of some distributions, read from the installed
packages' metadata (so tests can check that the operator and router images never need torch)."""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def dependency_closure(names: Iterable[str]) -> set[str]:
    """Canonical names of `names` and everything they require, without extras; a requirement that is not
    installed here (an optional dependency of some package) ends its branch."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen

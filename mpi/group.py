"""``MPI.Group``: an ordered set of processes, kept as their COMM_WORLD ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vpool.mpi import errors
from vpool.mpi.constants import IDENT, PROC_NULL, SIMILAR, UNDEFINED, UNEQUAL


class Group:
    __slots__ = ("_me", "_members")

    def __init__(self, group: Group | None = None) -> None:
        if group is not None:
            self._members: tuple[int, ...] | None = group._members
            self._me = group._me
        else:
            self._members = None
            self._me = -1

    @classmethod
    def _of(cls, members: Sequence[int], me: int) -> Group:
        g = cls.__new__(cls)
        g._members = tuple(members)
        g._me = me  # this process's world rank
        return g

    def _m(self) -> tuple[int, ...]:
        if self._members is None:
            raise errors.MPIException(errors.ERR_GROUP)
        return self._members

    def Get_size(self) -> int:
        return len(self._m())

    def Get_rank(self) -> int:
        members = self._m()
        return members.index(self._me) if self._me in members else UNDEFINED

    size = property(Get_size)
    rank = property(Get_rank)

    def Translate_ranks(
        self, ranks: Sequence[int] | None = None, group: Group | None = None
    ) -> list[int]:
        members = self._m()
        if ranks is None:
            ranks = range(len(members))
        if group is None:
            return [r for r in ranks]
        other = group._m()
        out = []
        for r in ranks:
            if r == PROC_NULL:
                out.append(PROC_NULL)
                continue
            w = members[r]
            out.append(other.index(w) if w in other else UNDEFINED)
        return out

    def Compare(self, group: Group) -> int:
        a, b = self._m(), group._m()
        if a == b:
            return IDENT
        if set(a) == set(b):
            return SIMILAR
        return UNEQUAL

    def Incl(self, ranks: Sequence[int]) -> Group:
        members = self._m()
        return Group._of([members[r] for r in ranks], self._me)

    def Excl(self, ranks: Sequence[int]) -> Group:
        members = self._m()
        drop = set(ranks)
        return Group._of([w for i, w in enumerate(members) if i not in drop], self._me)

    def Range_incl(self, ranks: Sequence[tuple[int, int, int]]) -> Group:
        picked: list[int] = []
        for first, last, stride in ranks:
            picked.extend(range(first, last + (1 if stride > 0 else -1), stride))
        return self.Incl(picked)

    def Range_excl(self, ranks: Sequence[tuple[int, int, int]]) -> Group:
        picked: list[int] = []
        for first, last, stride in ranks:
            picked.extend(range(first, last + (1 if stride > 0 else -1), stride))
        return self.Excl(picked)

    @classmethod
    def Union(cls, group1: Group, group2: Group) -> Group:
        a, b = group1._m(), group2._m()
        return Group._of([*a, *(w for w in b if w not in a)], group1._me)

    @classmethod
    def Intersection(cls, group1: Group, group2: Group) -> Group:
        b = set(group2._m())
        return Group._of([w for w in group1._m() if w in b], group1._me)

    @classmethod
    def Difference(cls, group1: Group, group2: Group) -> Group:
        b = set(group2._m())
        return Group._of([w for w in group1._m() if w not in b], group1._me)

    def Dup(self) -> Group:
        return Group(self)

    def Free(self) -> None:
        self._members = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Group):
            return NotImplemented
        return self._members == other._members

    def __hash__(self) -> int:
        return hash(self._members)

    def __bool__(self) -> bool:
        return self._members is not None

    def __repr__(self) -> str:
        return f"<mpi4py.MPI.Group {self._members}>"

    def __reduce__(self) -> Any:
        # Only the predefined groups travel (as mpi4py): by name, or as a copy of one.
        for name in ("GROUP_NULL", "GROUP_EMPTY"):
            const = globals()[name]
            if self is const:
                return name
            if self._members == const._members:
                return (Group, (const,))
        raise ValueError("cannot serialize 'mpi4py.MPI.Group' instance")


GROUP_NULL = Group()
GROUP_EMPTY = Group._of((), -1)

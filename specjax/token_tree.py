"""Speculative token trees (vLLM's ``speculative_token_tree``), as static structure.

A node is a tuple of child ranks from the root (``(0,)`` the root's best child, ``(0, 1)``
the second best child of ``(0,)``); nodes are sorted breadth-first by ``(len, tuple)`` and
every level must be the top-``c_l`` children of every node above it. Node ``j`` is column
``j`` of a tree proposer's drafts. A frozen, hashable object: static under ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import functools

from specjax.config import parse_token_tree


@dataclasses.dataclass(frozen=True)
class TokenTree:
    """The static structure of a speculative token tree; ``choices``: the nodes, sorted
    breadth-first by ``(len, tuple)``."""

    choices: tuple[tuple[int, ...], ...]

    @classmethod
    def from_choices(cls, choices) -> "TokenTree":
        """From a ``speculative_token_tree`` string or list (checked and sorted by
        ``config.parse_token_tree``; ValueError on a malformed tree)."""
        return cls(parse_token_tree(choices))

    @classmethod
    def chain(cls, k: int) -> "TokenTree":
        """The chain ``[(0,), (0, 0), ...]`` of ``k`` nodes."""
        return cls(tuple((0,) * i for i in range(1, k + 1)))

    @property
    def num_nodes(self) -> int:
        return len(self.choices)

    @property
    def depth(self) -> int:
        return len(self.choices[-1])

    @property
    def is_chain(self) -> bool:
        return all(len(c) == i + 1 and not any(c) for i, c in enumerate(self.choices))

    @functools.cached_property
    def parents(self) -> tuple[int, ...]:
        """Index of each node's parent; -1 for the root's children (level 1)."""
        index = {c: i for i, c in enumerate(self.choices)}
        return tuple(index[c[:-1]] if len(c) > 1 else -1 for c in self.choices)

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        """Level of each node, 1-based (the root's children are level 1)."""
        return tuple(len(c) for c in self.choices)

    @functools.cached_property
    def level_sizes(self) -> tuple[int, ...]:
        """Number of nodes of each level 1..depth."""
        sizes = [0] * self.depth
        for c in self.choices:
            sizes[len(c) - 1] += 1
        return tuple(sizes)

    @functools.cached_property
    def cu_level_sizes(self) -> tuple[int, ...]:
        """Cumulative ``level_sizes`` (vLLM's ``cu_drafts_per_level``)."""
        out, total = [], 0
        for s in self.level_sizes:
            total += s
            out.append(total)
        return tuple(out)

    @functools.cached_property
    def children_per_level(self) -> tuple[int, ...]:
        """Children drafted per node of the level above (vLLM's ``child_drafts_per_level``):
        level 1 has ``level_sizes[0]`` children of the root."""
        s = self.level_sizes
        return (s[0],) + tuple(s[i] // s[i - 1] for i in range(1, len(s)))

    def ancestor_mask(self, *, with_root: bool = False) -> tuple[tuple[bool, ...], ...]:
        """``mask[i][j]``: node ``j`` is node ``i`` or one of its ancestors (tree attention);
        ``N x N``, or with ``with_root`` ``(N+1) x (N+1)`` with the root at index 0."""
        n = self.num_nodes
        off = 1 if with_root else 0
        rows = [[False] * (n + off) for _ in range(n + off)]
        if with_root:
            for i in range(n + 1):
                rows[i][0] = True
        for i in range(n):
            j = i
            while j >= 0:
                rows[i + off][j + off] = True
                j = self.parents[j]
        return tuple(tuple(r) for r in rows)

    def path_to(self, node: int) -> tuple[int, ...]:
        """Node indices from level 1 down to ``node`` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return tuple(reversed(path))

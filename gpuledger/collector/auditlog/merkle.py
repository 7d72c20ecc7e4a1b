"""RFC 9162 (Certificate Transparency 2.0) Merkle tree hashing, proofs and their verification, section 2.1.

Pure functions over 32-byte SHA-256 hashes. Leaves are numbered from 0 as in the RFC (the audit log numbers its
entries from 1: entry ``seq`` is leaf ``seq - 1``). Proof *generation* takes ``subtree(start, end)``, a callable
returning MTH(D[start:end]) for a range the RFC's recursion asks for; those ranges always split into complete
subtrees aligned on their size, which the log stores (``log.AuditLog``), so a proof costs O(log^2 n) lookups
instead of rehashing leaves. Verification follows the RFC's algorithms in 2.1.3.2 and 2.1.4.2 step by step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

EMPTY_ROOT = hashlib.sha256(b"").digest()  # MTH({}) (RFC 9162 2.1.1)


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def split(n: int) -> int:
    """k, the largest power of two smaller than n (n > 1)."""
    return 1 << ((n - 1).bit_length() - 1)


def root_of(leaves: Sequence[bytes]) -> bytes:
    """MTH over leaf hashes, bottom up (the reference the stored nodes are checked against)."""
    if not leaves:
        return EMPTY_ROOT
    level = list(leaves)
    while len(level) > 1:  # an unpaired last node moves up a level unchanged: the RFC's split at k
        nxt = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


Subtree = Callable[[int, int], bytes]


def inclusion_proof(index: int, size: int, subtree: Subtree) -> list[bytes]:
    """PATH(index, D[size]) (RFC 9162 2.1.3.1)."""
    if not 0 <= index < size:
        raise ValueError(f"leaf {index} is not in a tree of {size}")
    out: list[bytes] = []
    start, end = 0, size
    while end - start > 1:
        k = split(end - start)
        if index - start < k:
            out.append(subtree(start + k, end))
            end = start + k
        else:
            out.append(subtree(start, start + k))
            start += k
    out.reverse()  # the RFC lists the leaf's sibling first
    return out


def consistency_proof(first: int, second: int, subtree: Subtree) -> list[bytes]:
    """PROOF(first, D[second]) (RFC 9162 2.1.4.1); empty when the sizes are equal."""
    if not 0 < first <= second:
        raise ValueError(f"no consistency proof from size {first} to size {second}")
    out: list[bytes] = []
    start, end, m, whole = 0, second, first, True
    while m != end - start:
        k = split(end - start)
        if m <= k:
            out.append(subtree(start + k, end))
            end = start + k
        else:
            out.append(subtree(start, start + k))
            start, m, whole = start + k, m - k, False
    if not whole:
        out.append(subtree(start, end))
    out.reverse()
    return out


def root_from_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes]) -> bytes | None:
    """The root an inclusion proof implies (RFC 9162 2.1.3.2), or None when the proof has the wrong shape."""
    if not 0 <= index < size:
        return None
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            return None
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn:
                fn, sn = fn >> 1, sn >> 1
        else:
            r = node_hash(r, p)
        fn, sn = fn >> 1, sn >> 1
    return r if sn == 0 else None


def verify_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes], root: bytes) -> bool:
    return root_from_inclusion(index, size, leaf, proof) == root


def verify_consistency(first: int, second: int, first_root: bytes, second_root: bytes, proof: Sequence[bytes]) -> bool:
    """RFC 9162 2.1.4.2; equal sizes need an empty proof and equal roots."""
    if not 0 < first <= second:
        return False
    if first == second:
        return not proof and first_root == second_root
    path = list(proof)
    if not path:
        return False
    if first & (first - 1) == 0:
        path.insert(0, first_root)
    fn, sn = first - 1, second - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr, sr = node_hash(c, fr), node_hash(c, sr)
            while not fn & 1 and fn:
                fn, sn = fn >> 1, sn >> 1
        else:
            sr = node_hash(sr, c)
        fn, sn = fn >> 1, sn >> 1
    return fr == first_root and sr == second_root and sn == 0

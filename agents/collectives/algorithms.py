"""Collective algorithms over a `Transport`, on numpy buffers: `run(op, algorithm, ...)`.

Operations are named as nccl-tests' binaries and the control plane's collective kinds
(allreduce, reducescatter, allgather, broadcast, alltoall); buffer sizes follow
nccl-tests (`data.buffer_counts`). Every algorithm works for any number of ranks n >= 1
(n = 1 is a local copy) and any count, including 0, counts below n and counts that are
not multiples of n or of `chunks`.

allreduce
  ``ring``  reduce-scatter then all-gather around the ring r -> r+1, n-1 steps each,
            the buffer cut in n nearly equal blocks (NCCL's ring; Patarasuk & Yuan,
            "Bandwidth optimal all-reduce algorithms for clusters of workstations",
            JPDC 2009). Each block piece is forwarded as soon as it is reduced.
  ``rhd``   Rabenseifner's algorithm (R. Rabenseifner, "Optimization of Collective
            Reduction Operations", ICCS 2004): reduce-scatter by recursive halving
            (partner at distance p/2 first, vector halved each step) then all-gather by
            recursive doubling (distance 1 first). For n not a power of two, the
            reduction to p = 2**floor(log2 n) of Thakur, Rabenseifner & Gropp,
            "Optimization of Collective Communication Operations in MPICH", IJHPCA 2005,
            as MPICH's MPIR_Allreduce implements it: with r = n - p, each even rank
            2i < 2r sends its whole vector to 2i+1, which reduces it and takes part as
            rank i of the p ranks (the others, 2r..n-1, as rank - r); the even ranks
            sit out, and at the end each odd rank 2i+1 sends them the whole result.
  ``tree``  NCCL's double binary tree (Sanders, Speck & Traeff, "Two-tree algorithms
            for full bandwidth broadcast, reduction and scan", Parallel Computing
            2009; NCCL 2.4): the first half of the buffer is reduced up and broadcast
            down tree 1, the second half tree 2, in `chunks` pieces each, interleaved
            so both trees are busy. Tree 1 is NCCL's ncclGetBtree on ranks 0..n-1 (an
            in-order binary tree by lowest set bit: odd ranks are leaves, rank 0 the
            root with the single child 2**(ceil(log2 n)-1)); tree 2 (ncclGetDtree) is
            its mirror r -> n-1-r when n is even (even ranks become the leaves) and its
            shift r -> r+1 mod n when n is odd (root 1). So every rank is a leaf in at
            least one tree, except rank 0 when n is odd (root with one child in tree 1,
            one child in tree 2); no rank sends more than 2x the buffer. Up and down
            are two phases here (NCCL overlaps them in split warps); each is
            pipelined over the chunks.
reducescatter   ``ring`` (the first half of ring all-reduce, blocks of `count`).
allgather       ``ring`` (the second half).
broadcast       ``ring``: a chain root -> root+1 -> ... -> root-1, pipelined in
                `chunks` pieces (NCCL's broadcast is a ring too). Not a binomial tree:
                the chain carries the buffer once per link, bus factor 1.
alltoall        ``pairwise``: step k = 1..n-1 sends block (r+k)%n to rank (r+k)%n and
                receives block (r-k)%n from rank (r-k)%n (Thakur et al. 2005's pairwise
                exchange for long messages).

`chunks` splits every message into that many pieces (fewer when the message has fewer
elements), each its own send, so a transport can overlap them over several QPs; tags are
unique per (phase, step, piece) within a call. No memory handed to `send` is written
again before `wait_sends` (sends may be zero-copy): reductions accumulate in a private
copy of the input, received data lands in memory not yet sent, and every call ends with
`wait_sends()`, so the caller may reuse both buffers once `run` returns.

Sizes and bandwidths are nccl-tests': `size_bytes` is max(send, recv) bytes of one rank
(count*itemsize for allreduce and broadcast, count*n*itemsize for reducescatter,
allgather and alltoall); algbw = size / time; busbw = algbw * `bus_factor` (2(n-1)/n
for allreduce, (n-1)/n for reducescatter, allgather and alltoall, 1 for broadcast).

`on_phase(name)` is called at the start of each phase ("reduce_scatter", "all_gather",
"pre_reduce", "post_distribute", "tree_up", "tree_down", "broadcast", "all_to_all");
a phase ends where the next starts, the last when `run` returns. Every rank calls the same
sequence, whether or not it has traffic in a phase.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from agents.collectives import data
from agents.collectives.ops import ALGORITHMS
from agents.collectives.transport import Transport

PhaseHook = Callable[[str], None]

# Tag = (phase * _MAX_STEPS + step) * chunks + piece: unique per call, so no message can
# be taken for another even if a transport delivered tags in any order.
_MAX_STEPS = 1 << 12
(_RS, _AG, _PRE, _POST, _UP, _DOWN, _BCAST, _A2A) = range(8)


@dataclass(frozen=True)
class TreeLinks:
    """One rank's place in a tree: parent (-1 at the root) and children."""

    parent: int
    children: tuple[int, ...]


def btree(n: int, rank: int) -> TreeLinks:
    """NCCL's ncclGetBtree: the in-order binary tree on 0..n-1 rooted at 0.

    A rank whose lowest set bit is b has parent (rank ^ b) | 2b, or rank ^ b when that
    is out of range, and children rank - b/2 and rank + b/2 (the latter, if out of
    range, moved down to rank + b/4, ... or dropped). Rank 0 has the single child
    2**(ceil(log2 n) - 1).
    """
    bit = 1
    while bit < n and not bit & rank:
        bit <<= 1
    if rank == 0:
        return TreeLinks(-1, (bit >> 1,) if n > 1 else ())
    up = (rank ^ bit) | (bit << 1)
    if up >= n:
        up = rank ^ bit
    low = bit >> 1
    children = []
    if low:
        children.append(rank - low)
        while low and rank + low >= n:
            low >>= 1
        if low:
            children.append(rank + low)
    return TreeLinks(up, tuple(children))


def dtree(n: int, rank: int) -> tuple[TreeLinks, TreeLinks]:
    """NCCL's ncclGetDtree: (tree 1, tree 2) for `rank`. Tree 1 is `btree`; tree 2 is
    it mirrored (r -> n-1-r) for even n, shifted (r -> r+1 mod n) for odd n."""
    first = btree(n, rank)
    if n % 2:
        def there(x: int) -> int:
            return (x - 1) % n

        def back(x: int) -> int:
            return (x + 1) % n
    else:
        def there(x: int) -> int:
            return n - 1 - x

        back = there
    mapped = btree(n, there(rank))
    second = TreeLinks(-1 if mapped.parent < 0 else back(mapped.parent),
                       tuple(back(c) for c in mapped.children))
    return first, second


def _split(start: int, stop: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) cut into `parts` contiguous nearly equal ranges (the first
    (stop-start) % parts one longer); the cut depends only on the length, so sender and
    receiver of a block of the same length cut it alike."""
    base, extra = divmod(stop - start, parts)
    out, a = [], start
    for i in range(parts):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


@dataclass
class _Ctx:
    t: Transport
    dtype: str
    redop: str
    chunks: int
    on_phase: PhaseHook

    @property
    def n(self) -> int:
        return self.t.size

    @property
    def rank(self) -> int:
        return self.t.rank

    def tag(self, phase: int, step: int, piece: int) -> int:
        return (phase * _MAX_STEPS + step) * self.chunks + piece

    def pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(piece index, start, stop) of the non-empty pieces of [start, stop): empty
        ones are skipped on both sides (both compute the same cut), never sent."""
        return [(p, a, b) for p, (a, b) in enumerate(_split(start, stop, self.chunks)) if b > a]

    def send(self, peer: int, phase: int, step: int, buf: np.ndarray, start: int,
             stop: int) -> None:
        for p, a, b in self.pieces(start, stop):
            self.t.send(peer, self.tag(phase, step, p), buf[a:b])

    def recv(self, peer: int, phase: int, step: int, buf: np.ndarray, start: int,
             stop: int) -> None:
        for p, a, b in self.pieces(start, stop):
            self.t.recv(peer, self.tag(phase, step, p), buf[a:b])

    def reduce(self, acc: np.ndarray, incoming: np.ndarray) -> None:
        data.reduce_into(self.redop, self.dtype, acc, incoming)


def _ring_neighbours(rank: int, n: int) -> tuple[int, int]:
    """(left, right): receive from the left, send to the right."""
    return (rank - 1) % n, (rank + 1) % n


def _ring_reduce_scatter(ctx: _Ctx, acc: np.ndarray, inbox: np.ndarray,
                         blocks: list[tuple[int, int]]) -> None:
    """Leave the full reduction of block `rank` in acc[blocks[rank]].

    Step s sends block (r-s-1) and receives block (r-s-2), reducing it into acc: after
    n-1 steps block r has passed every rank. A piece reduced at step s is the piece sent
    at step s+1, so it is forwarded at once (the pipeline); no block is written after it
    is sent.
    """
    n, r = ctx.n, ctx.rank
    left, right = _ring_neighbours(r, n)
    if n == 1:
        return
    ctx.send(right, _RS, 0, acc, *blocks[(r - 1) % n])
    for s in range(n - 1):
        for p, a, b in ctx.pieces(*blocks[(r - s - 2) % n]):
            ctx.t.recv(left, ctx.tag(_RS, s, p), inbox[a:b])
            ctx.reduce(acc[a:b], inbox[a:b])
            if s + 1 < n - 1:
                ctx.t.send(right, ctx.tag(_RS, s + 1, p), acc[a:b])


def _ring_all_gather(ctx: _Ctx, buf: np.ndarray, blocks: list[tuple[int, int]]) -> None:
    """Given block `rank` in buf, fill every other block: step s sends block (r-s) and
    receives block (r-s-1), forwarding each piece as it arrives."""
    n, r = ctx.n, ctx.rank
    left, right = _ring_neighbours(r, n)
    if n == 1:
        return
    ctx.send(right, _AG, 0, buf, *blocks[r])
    for s in range(n - 1):
        for p, a, b in ctx.pieces(*blocks[(r - s - 1) % n]):
            ctx.t.recv(left, ctx.tag(_AG, s, p), buf[a:b])
            if s + 1 < n - 1:
                ctx.t.send(right, ctx.tag(_AG, s + 1, p), buf[a:b])


def _all_reduce_ring(ctx: _Ctx, send: np.ndarray, recv: np.ndarray, root: int) -> None:
    blocks = _split(0, recv.size, ctx.n)
    acc, inbox = send.copy(), np.empty_like(send)  # the copy also makes in-place safe
    ctx.on_phase("reduce_scatter")
    _ring_reduce_scatter(ctx, acc, inbox, blocks)
    a, b = blocks[ctx.rank]
    recv[a:b] = acc[a:b]
    ctx.on_phase("all_gather")
    _ring_all_gather(ctx, recv, blocks)


def _reduce_scatter_ring(ctx: _Ctx, send: np.ndarray, recv: np.ndarray, root: int) -> None:
    count = recv.size
    blocks = [(i * count, (i + 1) * count) for i in range(ctx.n)]
    acc, inbox = send.copy(), np.empty_like(send)
    ctx.on_phase("reduce_scatter")
    _ring_reduce_scatter(ctx, acc, inbox, blocks)
    a, b = blocks[ctx.rank]
    recv[:] = acc[a:b]


def _all_gather_ring(ctx: _Ctx, send: np.ndarray, recv: np.ndarray, root: int) -> None:
    count = send.size
    blocks = [(i * count, (i + 1) * count) for i in range(ctx.n)]
    a, b = blocks[ctx.rank]
    recv[a:b] = send.copy() if np.shares_memory(send, recv) else send
    ctx.on_phase("all_gather")
    _ring_all_gather(ctx, recv, blocks)


def _broadcast_ring(ctx: _Ctx, send: np.ndarray, recv: np.ndarray, root: int) -> None:
    """A chain from root: each rank receives each piece from its predecessor and
    forwards it at once, so the pieces pipeline down the chain."""
    n, r = ctx.n, ctx.rank
    pos = (r - root) % n
    left, right = _ring_neighbours(r, n)
    ctx.on_phase("broadcast")
    if pos == 0:
        recv[:] = send  # root sends from recv, which it never writes again
    for p, a, b in ctx.pieces(0, recv.size):
        if pos > 0:
            ctx.t.recv(left, ctx.tag(_BCAST, 0, p), recv[a:b])
        if pos < n - 1:
            ctx.t.send(right, ctx.tag(_BCAST, 0, p), recv[a:b])


def _all_to_all_pairwise(ctx: _Ctx, send: np.ndarray, recv: np.ndarray, root: int) -> None:
    n, r = ctx.n, ctx.rank
    count = send.size // n
    src = send.copy() if np.shares_memory(send, recv) else send  # in-place would overwrite
    ctx.on_phase("all_to_all")
    recv[r * count:(r + 1) * count] = src[r * count:(r + 1) * count]
    for k in range(1, n):
        to, frm = (r + k) % n, (r - k) % n
        ctx.send(to, _A2A, k, src, to * count, (to + 1) * count)
        ctx.recv(frm, _A2A, k, recv, frm * count, (frm + 1) * count)


@dataclass(frozen=True)
class _Rhd:
    """Rabenseifner geometry: p = 2**floor(log2 n) participants, r = n - p folded."""

    n: int

    @property
    def p(self) -> int:
        return 1 << (self.n.bit_length() - 1)

    @property
    def rem(self) -> int:
        return self.n - self.p

    def newrank(self, rank: int) -> int:
        """Rank among the p participants, -1 for the even ranks folded away."""
        if rank < 2 * self.rem:
            return -1 if rank % 2 == 0 else rank // 2
        return rank - self.rem

    def real(self, newrank: int) -> int:
        return 2 * newrank + 1 if newrank < self.rem else newrank + self.rem


def _span(blocks: list[tuple[int, int]], lo: int, hi: int) -> tuple[int, int]:
    """Element range of blocks lo..hi-1 (contiguous)."""
    return blocks[lo][0], blocks[hi - 1][1]


def _rhd_halving(ctx: _Ctx, g: _Rhd, me: int, acc: np.ndarray, inbox: np.ndarray,
                 blocks: list[tuple[int, int]]) -> None:
    """Recursive halving: at distance d = p/2, p/4, .., 1 keep the half of the current
    block range on my side of bit d, send the other half to me ^ d and reduce what it
    sends me. Ends with block `me` fully reduced; sent halves are never written again."""
    lo, hi, d, step = 0, g.p, g.p // 2, 0
    while d >= 1:
        peer, mid = g.real(me ^ d), lo + d
        give, keep = ((lo, mid), (mid, hi)) if me & d else ((mid, hi), (lo, mid))
        ctx.send(peer, _RS, step, acc, *_span(blocks, *give))
        ka, kb = _span(blocks, *keep)
        for p, a, b in ctx.pieces(ka, kb):
            ctx.t.recv(peer, ctx.tag(_RS, step, p), inbox[a:b])
            ctx.reduce(acc[a:b], inbox[a:b])
        lo, hi = keep
        d, step = d // 2, step + 1


def _rhd_doubling(ctx: _Ctx, g: _Rhd, me: int, recv: np.ndarray,
                  blocks: list[tuple[int, int]]) -> None:
    """Recursive doubling: at distance d = 1, 2, .., p/2 exchange the d blocks I hold
    with me ^ d, which holds the adjacent d blocks; received data lands in blocks I
    have not sent."""
    lo, hi, d, step = me, me + 1, 1, 0
    while d < g.p:
        peer = g.real(me ^ d)
        ctx.send(peer, _AG, step, recv, *_span(blocks, lo, hi))
        theirs = (lo - d, lo) if me & d else (hi, hi + d)
        ctx.recv(peer, _AG, step, recv, *_span(blocks, *theirs))
        lo, hi = min(lo, theirs[0]), max(hi, theirs[1])
        d, step = d * 2, step + 1


def _all_reduce_rhd(ctx: _Ctx, send: np.ndarray, recv: np.ndarray, root: int) -> None:
    g, r, count = _Rhd(ctx.n), ctx.rank, recv.size
    me = g.newrank(r)
    acc, inbox = send.copy(), np.empty_like(send)
    if g.rem:
        ctx.on_phase("pre_reduce")
        if me < 0:
            ctx.send(r + 1, _PRE, 0, acc, 0, count)
        elif r < 2 * g.rem:
            for p, a, b in ctx.pieces(0, count):
                ctx.t.recv(r - 1, ctx.tag(_PRE, 0, p), inbox[a:b])
                ctx.reduce(acc[a:b], inbox[a:b])
    blocks = _split(0, count, g.p)
    ctx.on_phase("reduce_scatter")
    if me >= 0:
        _rhd_halving(ctx, g, me, acc, inbox, blocks)
    ctx.on_phase("all_gather")
    if me >= 0:
        a, b = blocks[me]
        recv[a:b] = acc[a:b]
        _rhd_doubling(ctx, g, me, recv, blocks)
    if g.rem:
        ctx.on_phase("post_distribute")
        if me < 0:
            ctx.recv(r + 1, _POST, 0, recv, 0, count)
        elif r < 2 * g.rem:
            ctx.send(r - 1, _POST, 0, recv, 0, count)


def _all_reduce_tree(ctx: _Ctx, send: np.ndarray, recv: np.ndarray, root: int) -> None:
    """Tree t (0, 1) carries half t of the buffer. Work goes chunk by chunk, tree 1
    then tree 2 within a chunk: each (chunk, tree) item waits only on the same item at
    the children (up) or parent (down), so the order cannot deadlock."""
    count = recv.size
    trees = dtree(ctx.n, ctx.rank)
    half = (count + 1) // 2
    cuts = [_split(0, half, ctx.chunks), _split(half, count, ctx.chunks)]
    work = [(t, c, *cuts[t][c]) for c in range(ctx.chunks) for t in (0, 1)
            if cuts[t][c][1] > cuts[t][c][0]]
    acc, inbox = send.copy(), np.empty_like(send)
    ctx.on_phase("tree_up")
    for t, c, a, b in work:
        links = trees[t]
        for child in links.children:
            # Both children land in the same inbox slice: the first is reduced before
            # the second arrives, and the inbox is never sent.
            ctx.t.recv(child, ctx.tag(_UP, t, c), inbox[a:b])
            ctx.reduce(acc[a:b], inbox[a:b])
        if links.parent >= 0:
            ctx.t.send(links.parent, ctx.tag(_UP, t, c), acc[a:b])
    ctx.on_phase("tree_down")
    for t, c, a, b in work:
        links = trees[t]
        if links.parent < 0:
            recv[a:b] = acc[a:b]
        else:
            ctx.t.recv(links.parent, ctx.tag(_DOWN, t, c), recv[a:b])
        for child in links.children:
            ctx.t.send(child, ctx.tag(_DOWN, t, c), recv[a:b])


_Impl = Callable[[_Ctx, np.ndarray, np.ndarray, int], None]
_IMPLS: dict[tuple[str, str], _Impl] = {
    ("allreduce", "ring"): _all_reduce_ring,
    ("allreduce", "rhd"): _all_reduce_rhd,
    ("allreduce", "tree"): _all_reduce_tree,
    ("reducescatter", "ring"): _reduce_scatter_ring,
    ("allgather", "ring"): _all_gather_ring,
    ("broadcast", "ring"): _broadcast_ring,
    ("alltoall", "pairwise"): _all_to_all_pairwise,
}


def _flat(name: str, buf: np.ndarray) -> np.ndarray:
    if not buf.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return buf.reshape(-1)


def _check_sizes(op: str, n: int, send: np.ndarray, recv: np.ndarray) -> None:
    # The count each op's buffers imply; buffer_counts then says what both must be.
    count = {"allgather": send.size, "alltoall": send.size // n}.get(op, recv.size)
    want = data.buffer_counts(op, count, n)
    if (send.size, recv.size) != want:
        raise ValueError(f"{op} on {n} ranks: sendbuf has {send.size} elements and recvbuf "
                         f"{recv.size}; for count {count} they must be {want[0]} and {want[1]}")


def run(op: str, algorithm: str, transport: Transport, sendbuf: np.ndarray,
        recvbuf: np.ndarray, *, redop: str = "sum", root: int = 0, chunks: int = 1,
        dtype: str | None = None, on_phase: PhaseHook | None = None) -> None:
    """Run collective `op` with `algorithm` on this rank; returns when recvbuf holds the
    result and every send has completed (`wait_sends`).

    Buffers are contiguous numpy arrays of the dtype's storage (uint16 for bfloat16),
    sized per nccl-tests (`data.buffer_counts`); `count` is implied by them. `dtype`
    defaults to the one sendbuf's storage implies. `redop` ("sum", "max") matters for
    allreduce and reducescatter, `root` for broadcast. recvbuf may be sendbuf
    (in-place). sendbuf is never written.
    """
    if algorithm not in ALGORITHMS.get(op, ()):
        raise ValueError(f"no algorithm {algorithm!r} for {op!r}: "
                         f"{ {k: list(v) for k, v in ALGORITHMS.items()} }")
    if redop not in data.REDOPS:
        raise ValueError(f"unknown redop {redop!r}: one of {', '.join(data.REDOPS)}")
    n = transport.size
    if chunks < 1 or not 0 <= root < n:
        raise ValueError(f"chunks {chunks} must be >= 1 and root {root} in 0..{n - 1}")
    if n > _MAX_STEPS:
        raise ValueError(f"{n} ranks: the tags have room for {_MAX_STEPS} steps per phase")
    name = dtype or data.dtype_of(sendbuf)
    st = data.storage(name)
    if sendbuf.dtype != st or recvbuf.dtype != st:
        raise ValueError(f"{name} buffers are {st}, not {sendbuf.dtype}/{recvbuf.dtype}")
    send, recv = _flat("sendbuf", sendbuf), _flat("recvbuf", recvbuf)
    _check_sizes(op, n, send, recv)
    ctx = _Ctx(transport, name, redop, chunks, on_phase or (lambda _name: None))
    _IMPLS[op, algorithm](ctx, send, recv, root)
    transport.wait_sends()

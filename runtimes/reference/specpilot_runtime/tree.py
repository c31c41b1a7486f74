"""N-gram trees: several continuations per branch point, every node verified in one target forward.

On a model as small as stories260K a verify row costs little next to a step's per-op overhead, so more candidate
tokens per forward might pay off where a longer chain does not. With `drafter.tree_breadth` b > 1 the n-gram
drafters propose a tree instead of a chain (measured against the chain: benchmarks/tune.md, n-gram trees):
- `ContinuationIndex` keeps, per n-gram, every token seen after it with its count and when it was last seen;
- `build_tree` grows a tree of at most k nodes and b root-to-leaf paths best first: a node's children are the
  top-b continuations of the longest indexed suffix of its context (by count, ties to the most recent), scored
  LONGEST_MATCH x their share of its count, and shorter suffixes fill up to b (scored SHORTER_MATCH x share); the
  tree takes the node whose path has the highest product of scores next, so a suffix seen once grows a chain and
  alternatives branch off it (a branch only from a score of BRANCH_FLOOR);
- `forward_trees` scores the root (the sequence's last token) and every node in one forward; a row attends to the
  KV prefix and to its ancestors in depth order at positions start .. start + depth, exactly the keys a chain
  verify of that path would give it, at the same key indices, so its logits are those of the chain (and of ar) bit
  for bit: the tree is cut into root-to-leaf paths, each row is scored on one path through it, and each path gets
  its own copy of its slot's keys and values with the path's new ones written at the positions a chain's would take
  (rowgemm's and the padded BLAS products give a row the same result whatever rows are beside it);
- `step` accepts the longest path whose tokens the target's greedy tokens follow and writes only that path's keys
  and values into the cache, at consecutive positions; everything after (logprobs, stop checks, streaming) is the
  engine's own. A step whose trees are all chains is verified as the chain drafters' proposals are.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import MAX_TREE_BREADTH as MAX_BREADTH
from .drafters import PromptLookup, SharedNgramCache

LONGEST_MATCH = 0.8  # a continuation of the longest indexed suffix, scaled by its share of that suffix's counts
SHORTER_MATCH = 0.2  # one that only a shorter suffix was followed by
BRANCH_FLOOR = 0.1  # a branch (one more root-to-leaf path: a copy of the cache for the verify) needs this score;
# a tree with none left is a chain, verified as the chain drafters' proposals are


class ContinuationIndex:
    """Map each n-gram (min_n <= n <= max_n) to the tokens seen right after it: token -> [count, last seen]."""

    def __init__(self, min_n: int, max_n: int, capacity: int | None = None):
        self.min_n, self.max_n, self.capacity = min_n, max_n, capacity
        self.table: dict[tuple[int, ...], dict[int, list[int]]] = {}
        self.ranked: dict[tuple[int, ...], list[tuple[int, float]]] = {}  # per n-gram: (token, share), best first
        self.clock = 0
        self.indexed_tokens = 0

    def add(self, tokens: list[int], first_new: int) -> None:
        """Index the continuations at positions first_new .. len(tokens)-1."""
        if self.capacity is not None and self.indexed_tokens > self.capacity:
            self.table.clear()  # start afresh rather than grow without bound (as NgramIndex)
            self.ranked.clear()
            self.indexed_tokens = 0
        table, ranked = self.table, self.ranked
        for pos in range(max(first_new, 1), len(tokens)):
            self.clock += 1
            following = tokens[pos]
            for n in range(self.min_n, min(self.max_n, pos) + 1):
                key = tuple(tokens[pos - n : pos])
                seen = table.setdefault(key, {})
                entry = seen.get(following)
                if entry is None:
                    seen[following] = [1, self.clock]
                else:
                    entry[0] += 1
                    entry[1] = self.clock
                ranked.pop(key, None)
        self.indexed_tokens += len(tokens) - first_new

    def _ranked(self, key: tuple[int, ...]) -> list[tuple[int, float]] | None:
        best = self.ranked.get(key)
        if best is None:
            seen = self.table.get(key)
            if not seen:
                return None
            total = sum(entry[0] for entry in seen.values())
            # by count, ties to the most recent; at most the widest breadth worth keeping
            top = heapq.nlargest(MAX_BREADTH, seen.items(), key=lambda kv: kv[1])
            best = self.ranked[key] = [(token, count / total) for token, (count, _) in top]
        return best

    def continuations(self, context: list[int], breadth: int, longest: int | None = None) -> tuple[list, int]:
        """Up to `breadth` distinct (token, score) that followed the longest indexed suffix of `context` (of at most
        `longest` tokens), best first, shorter suffixes filling the rest at a lower score; and that suffix's length
        (0: none). A context one token longer than one whose longest was n >= min_n - 1 has one of at most n + 1 (its
        suffix minus the new token was followed by that token, so it is indexed)."""
        out: list[tuple[int, float]] = []
        scale = LONGEST_MATCH
        matched = 0
        top = min(self.max_n, len(context), self.max_n if longest is None else longest)
        for n in range(top, self.min_n - 1, -1):
            best = self._ranked(tuple(context[len(context) - n :]))
            if best is None:
                continue
            matched = matched or n
            for token, share in best:
                if all(token != t for t, _ in out):
                    out.append((token, scale * share))
                    if len(out) == breadth:
                        return out, matched
            scale = SHORTER_MATCH
        return out, matched


@dataclass
class DraftTree:
    """Proposed tokens as a tree: node i is `tokens[i]`, a child of node parents[i] (-1: the sequence's last token).
    Parents come before their children."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def rows(self) -> tuple[list[int], list[list[int]]]:
        """Per verify row (0 = the root, 1 + i = node i) its depth, and the root-to-leaf paths as lists of rows."""
        depth = [0]
        has_child = [False] * (len(self) + 1)
        for parent in self.parents:
            depth.append(depth[parent + 1] + 1)
            has_child[parent + 1] = True
        paths = []
        for row in range(len(self) + 1):
            if not has_child[row]:
                path = [row]
                while path[-1] != 0:
                    path.append(self.parents[path[-1] - 1] + 1)
                paths.append(path[::-1])
        return depth, paths

    def accepted(self, targets: list[int]) -> list[int]:
        """The rows of the longest path from the root whose every token is the target's greedy token after its
        parent (targets[row]: the target's token after that row); of equally long ones, the first."""
        children: dict[tuple[int, int], list[int]] = {}
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            children.setdefault((parent + 1, token), []).append(i + 1)
        longest = [0]
        paths = [[0]]  # depth first; siblings with the same token (a drafter repeating itself) are all followed
        while paths:
            path = paths.pop()
            if len(path) > len(longest):
                longest = path
            paths += [path + [child] for child in reversed(children.get((path[-1], targets[path[-1]]), []))]
        return longest


def build_tree(index: ContinuationIndex, tokens: list[int], budget: int, breadth: int) -> DraftTree:
    """At most `budget` nodes and `breadth` leaves (each root-to-leaf path costs the verify a copy of the cache; a new
    one needs a score of BRANCH_FLOOR), best first by the product of the continuation scores along each node's path."""
    tree = DraftTree()
    contexts: list[list[int]] = []
    frontier: list[tuple[float, int, int, int]] = []  # (-score, order, parent, token): ties go to the earlier
    order = 0
    leaves = 1
    has_child = [False] * (budget + 1)  # by row: 0 the root, 1 + i node i

    matched: list[int] = []  # per node, the length of its context's longest indexed suffix

    def expand(parent: int, context: list[int], score: float, longest: int | None) -> int:
        nonlocal order
        # once the tree has all its leaves, a node can only be extended: its best continuation is enough
        found, n = index.continuations(context, breadth if leaves < breadth else 1, longest)
        for token, p in found:
            heapq.heappush(frontier, (-score * p, order, parent, token))
            order += 1
        return n

    root = tokens[len(tokens) - index.max_n :]
    root_matched = expand(-1, root, 1.0, None)
    while frontier and len(tree) < budget:
        negative, _, parent, token = heapq.heappop(frontier)
        if has_child[parent + 1]:  # a new leaf
            if leaves == breadth or -negative < BRANCH_FLOOR:
                continue
            leaves += 1
        has_child[parent + 1] = True
        context = ((root if parent < 0 else contexts[parent]) + [token])[-index.max_n :]
        tree.tokens.append(token)
        tree.parents.append(parent)
        contexts.append(context)
        longest = max(root_matched if parent < 0 else matched[parent], index.min_n - 1) + 1
        matched.append(expand(len(tree) - 1, context, -negative, longest))
    return tree


class TreePromptLookup(PromptLookup):
    """Prompt lookup (this sequence's own tokens) proposing trees of breadth `breadth`."""

    def __init__(self, min_n: int, max_n: int, breadth: int):
        super().__init__(min_n, max_n)
        self.breadth = breadth

    def start(self, seq) -> None:
        seq.ngram_index = ContinuationIndex(self.min_n, self.max_n)
        seq.ngram_index.add(seq.tokens, 0)

    def propose_tree(self, seq, k: int) -> DraftTree:
        return build_tree(seq.ngram_index, seq.tokens, k, self.breadth)


class TreeSharedNgramCache(SharedNgramCache):
    """The shared n-gram index (all earlier prompts and outputs) proposing trees of breadth `breadth`."""

    def __init__(self, min_n: int, max_n: int, capacity: int, breadth: int):
        self.index = ContinuationIndex(min_n, max_n, capacity)  # type: ignore[assignment]
        self.breadth = breadth

    def propose_tree(self, seq, k: int) -> DraftTree:
        return build_tree(self.index, seq.tokens, k, self.breadth)  # type: ignore[arg-type]


def make_tree_drafter(drafter_config, runtime_options: dict):
    breadth = drafter_config.tree_breadth
    if runtime_options.get("shared_ngram_cache"):
        capacity = runtime_options.get("ngram_cache_capacity", 1_000_000)
        return TreeSharedNgramCache(drafter_config.ngram_min_n, drafter_config.ngram_max_n, capacity, breadth)
    return TreePromptLookup(drafter_config.ngram_min_n, drafter_config.ngram_max_n, breadth)


# ------------------------------------------------------------------------------------------------- verify


@dataclass
class TreeBatch:
    """The rows of one step's trees, flattened (sequence by sequence, root first), and where each row attends."""

    tokens: torch.Tensor  # [R] every row's token
    positions: torch.Tensor  # [R] start + depth
    path_slots: torch.Tensor  # [P] the cache slot each path reads
    tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (path, position, row): a path's own keys and values
    query: tuple[torch.Tensor, torch.Tensor]  # (path, place) of each row, rows in order
    mask: torch.Tensor  # [P, 1, places * group, key_len]: 0 where a place's row sees a key, -inf elsewhere
    places: int
    key_len: int
    row_offsets: list[int]  # where each sequence's rows start


def tree_batch(model, seqs: list[tuple[int, int, int, DraftTree]]) -> TreeBatch:
    """seqs: (slot, start, last token, tree) per sequence."""
    tokens: list[int] = []
    positions: list[int] = []
    path_slots: list[int] = []
    paths_end: list[int] = []  # per path, its last position + 1
    tail_path, tail_pos, tail_row = [], [], []
    query_path, query_place = [], []  # per row
    offsets = []
    for slot, start, last, tree in seqs:
        base = len(tokens)
        offsets.append(base)
        depth, paths = tree.rows()
        tokens += [last, *tree.tokens]
        positions += [start + d for d in depth]
        first = len(path_slots)
        through: list[list[int]] = [[] for _ in depth]  # per row, the paths through it
        for p, path in enumerate(paths, first):
            path_slots.append(slot)
            paths_end.append(start + len(path))
            for t, row in enumerate(path):
                tail_path.append(p)
                tail_pos.append(start + t)
                tail_row.append(base + row)
                through[row].append(p)
        # each row is scored on one path through it: deepest rows first, each on the least loaded of its paths
        taken = [0] * len(paths)
        placed = [(0, 0)] * len(depth)
        for row in sorted(range(len(depth)), key=lambda r: (-depth[r], r)):
            p = min(through[row], key=lambda p: (taken[p - first], p))
            placed[row] = (p, taken[p - first])
            taken[p - first] += 1
        for p, place in placed:
            query_path.append(p)
            query_place.append(place)
    places = max(query_place) + 1
    key_len = model._key_length(max(paths_end))
    group = model.shape.num_heads // model.shape.num_kv_heads
    place_pos = torch.zeros(len(path_slots), places, dtype=torch.long)  # a place holding no row: position 0
    place_pos[torch.tensor(query_path), torch.tensor(query_place)] = torch.tensor(positions)
    visible = (torch.arange(key_len)[None, None, :] <= place_pos[:, :, None]).repeat_interleave(group, dim=1)[:, None]
    mask = torch.zeros(visible.shape, dtype=model.dtype).masked_fill_(~visible, float("-inf"))
    device = model.device

    def on_device(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, device=device)

    return TreeBatch(
        tokens=on_device(tokens),
        positions=on_device(positions),
        path_slots=on_device(path_slots),
        tail=(on_device(tail_path), on_device(tail_pos), on_device(tail_row)),
        query=(on_device(query_path), on_device(query_place)),
        mask=mask.to(device),
        places=places,
        key_len=key_len,
        row_offsets=offsets,
    )


def forward_trees(model, batch: TreeBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [R, V] of every row, and every row's new keys and values per layer ([layers, R, kv_heads, head_dim])
    for `commit`; the cache is not written."""
    s = model.shape
    nh, nkv, hd = s.num_heads, s.num_kv_heads, s.head_dim
    group = nh // nkv
    rows = batch.tokens.shape[0]
    paths = batch.path_slots.shape[0]
    places, key_len = batch.places, batch.key_len
    cos, sin = model.cos[batch.positions], model.sin[batch.positions]
    tail_path, tail_pos, tail_row = batch.tail
    query_path, query_place = batch.query
    new_keys, new_values = [], []
    x = F.embedding(batch.tokens, model.embed)
    for i, (weights, (attn_norm, mlp_norm)) in enumerate(zip(model.layers, model.norms)):
        wqkv, wo, w_gate_up, w_down = weights
        qkv = model.mm(model._normalise(x, attn_norm), wqkv).view(rows, 2 * nh + 3 * nkv, hd)
        qk = qkv[:, : nh + nkv] * cos + qkv[:, nh + 2 * nkv :] * sin
        k, v = qk[:, nh:], qkv[:, nh + nkv : nh + 2 * nkv]
        new_keys.append(k)
        new_values.append(v)
        # each path's keys and values: its slot's cache, with the path's rows at start .. start + depth
        keys = model.k_cache[i, :, :, :, :key_len].index_select(0, batch.path_slots)  # [P, kv, hd, pos]
        values = model.v_cache[i, :, :, :key_len].index_select(0, batch.path_slots)  # [P, kv, pos, hd]
        keys.permute(0, 3, 1, 2)[tail_path, tail_pos] = k[tail_row]
        values.permute(0, 2, 1, 3)[tail_path, tail_pos] = v[tail_row]
        q = qk.new_zeros(paths, places, nh, hd)
        q[query_path, query_place] = qk[:, :nh]
        q = q.view(paths, places, nkv, group, hd).transpose(1, 2).reshape(paths, nkv, places * group, hd)
        scores = model.scores(q, keys)
        if not model.folded:
            scores = scores * model.q_scale
        scores += batch.mask
        o = model.attend(model._softmax(scores), values)  # [P, kv, places*group, hd]
        o = o.view(paths, nkv, places, group * hd).transpose(1, 2)[query_path, query_place].reshape(rows, nh * hd)
        x = x + model.mm(o, wo)
        gate, up = model.mm(model._normalise(x, mlp_norm), w_gate_up).chunk(2, dim=-1)
        x = x + model.mm(F.silu(gate) * up, w_down)
    logits = model.mm(model._normalise(x, model.final_norm), model.lm_head).float()
    return logits, torch.stack(new_keys), torch.stack(new_values)


def commit(model, slot: int, start: int, rows: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write the keys and values of `rows` (an accepted path, root first) at positions start, start + 1, ..."""
    index = torch.tensor(rows, device=model.device)
    end = start + len(rows)
    model.k_cache[:, slot, :, :, start:end] = keys[:, index].permute(0, 2, 3, 1)
    model.v_cache[:, slot, :, start:end] = values[:, index].permute(0, 2, 1, 3)


def step(engine, running: list) -> None:
    """One decode step of `running` with tree proposals: the tree counterpart of Engine._step (same accounting)."""
    shared_since, drafting = time.thread_time(), time.perf_counter()
    trees = []
    for seq in running:
        budget = min(engine.num_draft_tokens, seq.request.max_new_tokens - len(seq.output_ids) - 1)
        trees.append(engine.drafter.propose_tree(seq, budget) if budget > 0 else DraftTree())
    if all(tree.parents == list(range(-1, len(tree) - 1)) for tree in trees):  # chains: the chain's own verify
        engine._verify(running, [tree.tokens for tree in trees], shared_since, drafting)
        return
    forwarding = time.perf_counter()
    model = engine.model
    batch = tree_batch(model, [(s.slot, s.cache_len, s.tokens[-1], t) for s, t in zip(running, trees)])
    logits, keys, values = forward_trees(model, batch)
    targets = logits.argmax(dim=-1).tolist()
    done = time.perf_counter()
    share = (time.thread_time() - shared_since) / len(running)

    def accept(seq, tree: DraftTree, base: int) -> None:
        path = tree.accepted(targets[base : base + len(tree) + 1])
        commit(model, seq.slot, seq.cache_len, [base + row for row in path], keys, values)
        new_tokens = [tree.tokens[row - 1] for row in path[1:]] + [targets[base + path[-1]]]
        rows = torch.tensor([base + row for row in path], device=logits.device)
        engine._commit(seq, len(tree), len(path) - 1, new_tokens, logits[rows])

    for seq, tree, base in zip(running, trees, batch.row_offsets):
        seq.cpu_s += share
        engine._charge(seq, "draft", (forwarding - drafting) / len(running))
        engine._charge(seq, "target", (done - forwarding) / len(running))
        engine._own_work(seq, lambda seq, tree=tree, base=base: accept(seq, tree, base), "bookkeeping")
